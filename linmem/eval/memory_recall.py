"""The memory lab's clean recall: key-value facts in held-out filler, one asked at the end, 4 candidate values.

Items come from the memory lab's own task builder (``linmem.memory.tasks``: ``K`` single-token key → value
bindings, each presented ``R`` times between stretches of a held-out passage, then a query), scored with its
4-choice metric (``linmem.memory.metrics.choice_logits``: the answer is the argmax over the four candidates'
logits at the last position) and its source-level bootstrap CI (``linmem.memory.stats.bootstrap``). Chance is 1/4.
If the tokenizer cannot meet the lab's rules (single-token keys and values), the task says so and measures nothing
else in its place.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from linmem.data.shards import SplitTokens
from linmem.data.sources import Document
from linmem.eval.loading import EvalModel
from linmem.memory import tasks
from linmem.memory.evaluate import make_batch
from linmem.memory.metrics import choice_logits
from linmem.memory.stats import bootstrap


def _not_available(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": f"not available: {reason}"}


def memory_recall(em: EvalModel, split: SplitTokens | None, items: int = 64, num_bindings: int = 4,
                  repeats: int = 2, filler_tokens: int = 256, template: str = "code", values: str = "colors",
                  keys: str = "names", seed: int = 0, batch_size: int = 8) -> dict[str, Any]:
    """Clean 4-choice recall accuracy (with a source-level 95% CI) on ``items`` memory-lab items built from the
    documents of ``split``."""
    try:
        spec = tasks.TaskSpec(num_bindings=num_bindings, repeats=repeats, filler_tokens=filler_tokens,
                              template=template, values=values, keys=keys)
        builder = tasks.TaskBuilder(em.tokenizer, spec)
    except ValueError as e:
        return _not_available(f"the memory lab's task rules fail for this tokenizer ({e})")
    documents = [Document(source, sid, em.decode(tokens.tolist())) for source, sid, tokens in split.documents()]
    sources = tasks.passages(documents, tasks.Tokenize(em.tokenizer), min_tokens=filler_tokens)
    if not sources:
        raise ValueError(f"no held-out document of split {split.name!r} has {filler_tokens} tokens of filler")
    per_source = math.ceil(items / len(sources))
    batch = make_batch(tasks.build_items(builder, sources, per_source=per_source, seed=seed)[:items])
    correct = []
    with torch.no_grad():
        for start in range(0, batch.recipient.shape[0], batch_size):
            ids = batch.recipient[start:start + batch_size].to(em.device)
            last = em.model(input_ids=ids, use_cache=False).logits[:, -1].float().cpu()
            choice = choice_logits(last, batch.candidates[start:start + batch_size])
            correct += (choice.argmax(-1) == batch.answer[start:start + batch_size]).double().tolist()
    estimate = bootstrap(correct, batch.sources, seed=seed)
    return {"available": True,
            "metrics": {"accuracy": estimate.mean, "ci_low": estimate.low, "ci_high": estimate.high, "n": estimate.n,
                        "sources": estimate.sources, "chance": 0.25, "prompt_tokens": batch.length,
                        "num_bindings": num_bindings, "repeats": repeats, "template": template}}
