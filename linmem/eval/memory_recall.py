"""The memory lab's clean recall: key-value facts in held-out filler, one asked at the end, 4 candidate values.

Items come from the memory lab's own task builder (``linmem.memory.tasks``: ``K`` single-token key → value
bindings, each presented ``R`` times between stretches of a held-out passage, then a query), scored with its
4-choice metric (``linmem.memory.metrics.choice_logits``: the answer is the argmax over the four candidates'
logits at the last position) and its source-level bootstrap CI (``linmem.memory.stats.bootstrap``). Chance is 1/4.

The format (``template``, ``keys``, ``values``: names of the lab's ``TEMPLATES`` / ``KEY_WORDS`` / ``VALUE_WORDS``,
a file, or a template text) and the loads (``loads``: numbers of bindings ``K``) are chosen by the caller; every
load is measured on the same passages. If the tokenizer cannot build the format at all (too few single-token
keys for the smallest load, or values, or an empty query template), the task says so and measures nothing else in
its place. A load larger than the key vocabulary supplies is refused with a ``ValueError`` naming the load and
the vocabulary (``check_loads``), never dropped from the sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from linmem.data.shards import SplitTokens
from linmem.data.sources import Document
from linmem.eval.loading import EvalModel
from linmem.memory import tasks
from linmem.memory.evaluate import make_batch
from linmem.memory.fact_formats import label, load_template, load_vocabulary
from linmem.memory.metrics import choice_logits
from linmem.memory.stats import bootstrap

DEFAULT_LOADS = (4,)
CHANCE = 0.25


class FormatUnavailable(ValueError):
    """The tokenizer cannot build the recall format at its smallest load (the lab's rules fail)."""


@dataclass(frozen=True)
class RecallFormat:
    """What a recall item looks like: the fact ``template``, the ``keys`` and ``values`` vocabularies (names, files
    or a template text), ``repeats`` presentations of each fact and ``filler_tokens`` of held-out text in all."""

    template: str = "code"
    keys: str = "names"
    values: str = "colors"
    repeats: int = 2
    filler_tokens: int = 256


@dataclass
class LoadTrials:
    """The scored items of one load: ``correct`` (1.0 / 0.0 per item: the answer beats the other 3 candidates),
    each item's source passage, the prompt length in tokens (every item of one load has the same length),
    ``top1`` (1.0 / 0.0 per item: the answer is the model's first choice over the whole vocabulary) and
    ``no_fact`` (1.0 / 0.0 per item: the answer still wins with the asked fact's presentations replaced by filler,
    ``Item.no_fact``: the text alone guessed it; empty when not measured)."""

    num_bindings: int
    correct: list[float]
    sources: list[str]
    prompt_tokens: int
    top1: list[float]
    no_fact: list[float] = field(default_factory=list)

    def against_text(self) -> tuple[list[float], list[str]]:
        """``correct`` and ``sources`` of the items whose no-fact prompt chooses a wrong candidate: there the fact
        has to overturn what the text alone suggests."""
        kept = [i for i, guessed in enumerate(self.no_fact) if not guessed]
        return [self.correct[i] for i in kept], [self.sources[i] for i in kept]


def check_loads(loads: Sequence[int], name: str = "loads") -> tuple[int, ...]:
    """``loads`` as a tuple of distinct integers >= 1 (``ValueError`` naming the argument ``name`` otherwise)."""
    if isinstance(loads, (str, bytes)) or not isinstance(loads, Sequence) or not loads:
        raise ValueError(f"{name} must be a non-empty list of numbers of bindings; got {loads!r}")
    bad = [k for k in loads if not isinstance(k, int) or isinstance(k, bool) or k < 1]
    if bad:
        raise ValueError(f"{name} must hold integers >= 1 (numbers of bindings); got {list(loads)}")
    if len(set(loads)) != len(loads):
        raise ValueError(f"{name} must be distinct; got {list(loads)}")
    return tuple(loads)


def check_format(fmt: RecallFormat, where: str = "recall") -> None:
    """``ValueError`` naming the field for an unknown template or vocabulary (names, files or template texts)."""
    for part, check in (("template", lambda v: load_template(v)),
                         ("keys", lambda v: load_vocabulary(v, "keys")),
                         ("values", lambda v: load_vocabulary(v, "values"))):
        value = getattr(fmt, part)
        if not isinstance(value, str):
            raise ValueError(f"{where}_{part} must be a name or a file path; got {value!r}")
        try:
            check(value)
        except ValueError as e:
            raise ValueError(f"{where}_{part}: {e}") from None


def builders(tokenizer, fmt: RecallFormat, loads: Sequence[int]) -> dict[int, tasks.TaskBuilder]:
    """One lab ``TaskBuilder`` per load. ``FormatUnavailable`` when the smallest load cannot be built with this
    tokenizer; ``ValueError`` naming every larger load the key vocabulary cannot supply."""
    loads = check_loads(loads)
    template = load_template(fmt.template)
    keys, values = load_vocabulary(fmt.keys, "keys"), load_vocabulary(fmt.values, "values")

    def build(k: int) -> tasks.TaskBuilder:
        spec = tasks.TaskSpec(num_bindings=k, repeats=fmt.repeats, filler_tokens=fmt.filler_tokens,
                              template=template, values=values, keys=keys)
        return tasks.TaskBuilder(tokenizer, spec)

    try:
        smallest = build(min(loads))
    except ValueError as e:
        raise FormatUnavailable(str(e)) from None
    supplied = len(smallest.keys)
    refused = sorted(k for k in loads if k > supplied)
    if refused:
        raise ValueError(f"recall loads {refused} are refused: a load of K bindings needs K distinct single-token "
                         f"keys, and vocabulary {label(keys)!r} has {supplied} with this tokenizer (the largest "
                         f"load it supplies is {supplied}); choose smaller loads or another key vocabulary")
    return {k: smallest if k == smallest.spec.num_bindings else build(k) for k in loads}


def check_recall_loads(tokenizer, fmt: RecallFormat, loads: Sequence[int]) -> None:
    """``ValueError`` for a load the tokenizer's key vocabulary cannot supply (see ``builders``); a format the
    tokenizer cannot build at all passes here and is reported by the task as not available."""
    try:
        builders(tokenizer, fmt, loads)
    except FormatUnavailable:
        pass


def filler_passages(em: EvalModel, split: SplitTokens, filler_tokens: int) -> list:
    """The lab's filler passages (``tasks.passages``) of the documents of ``split`` with at least ``filler_tokens``
    tokens; ``ValueError`` when no document has that many."""
    documents = [Document(source, sid, em.decode(tokens.tolist())) for source, sid, tokens in split.documents()]
    sources = tasks.passages(documents, em.tokenizer, min_tokens=filler_tokens)
    if not sources:
        raise ValueError(f"no held-out document of split {split.name!r} has {filler_tokens} tokens of filler")
    return sources


def last_logits(em: EvalModel, prompts: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``[B, V]`` float32 logits (on the CPU) at the last position of each of ``prompts`` ``[B, T]``, run
    ``batch_size`` at a time."""
    with torch.no_grad():
        return torch.cat([em.model(input_ids=prompts[start:start + batch_size].to(em.device),
                                   use_cache=False).logits[:, -1].float().cpu()
                          for start in range(0, prompts.shape[0], batch_size)])


def recall_trials(em: EvalModel, split: SplitTokens, fmt: RecallFormat, loads: Sequence[int], items: int = 64,
                  seed: int = 0, batch_size: int = 8, sources: list | None = None,
                  no_fact: bool = False) -> list[LoadTrials]:
    """``items`` scored items per load (in the order of ``loads``), built from the documents of ``split`` (or from
    ``sources``, its ``filler_passages`` made once by a caller that scores it often); with ``no_fact`` the same
    items are also scored without the asked fact (``LoadTrials.no_fact``, twice the model runs); raises as
    ``builders`` does."""
    by_load = builders(em.tokenizer, fmt, loads)
    if sources is None:
        sources = filler_passages(em, split, fmt.filler_tokens)
    per_source = math.ceil(items / len(sources))
    out = []
    for k, builder in by_load.items():
        batch = make_batch(tasks.build_items(builder, sources, per_source=per_source, seed=seed)[:items])
        answer_ids = batch.candidates.gather(-1, batch.answer[:, None])[:, 0]
        last = last_logits(em, batch.recipient, batch_size)
        correct = (choice_logits(last, batch.candidates).argmax(-1) == batch.answer).double().tolist()
        top1 = (last.argmax(-1) == answer_ids).double().tolist()
        guessed = []
        if no_fact:
            prompts = torch.tensor([it.prompt(no_fact=True) for it in batch.items])
            choice = choice_logits(last_logits(em, prompts, batch_size), batch.candidates)
            guessed = (choice.argmax(-1) == batch.answer).double().tolist()
        out.append(LoadTrials(k, correct, list(batch.sources), batch.length, top1, guessed))
    return out


def _not_available(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": f"not available: {reason}"}


def memory_recall(em: EvalModel, split: SplitTokens | None, items: int = 64, num_bindings: int | None = None,
                  repeats: int = 2, filler_tokens: int = 256, template: str = "code", values: str = "colors",
                  keys: str = "names", seed: int = 0, batch_size: int = 8,
                  loads: Sequence[int] | None = None) -> dict[str, Any]:
    """Clean 4-choice recall accuracy (with a source-level 95% CI) on ``items`` memory-lab items per load, built
    from the documents of ``split``. ``loads`` (default ``[num_bindings]``, else ``[4]``) are the numbers of
    bindings measured.

    Metrics: ``accuracy``, ``ci_low``, ``ci_high``, ``n``, ``sources`` over every item of every load (the mean
    over loads: each has ``items`` items), ``accuracy@K`` / ``ci_low@K`` / ``ci_high@K`` per load, the same for
    ``top1`` (the answer is the model's first choice over the whole vocabulary, not only over the 4 candidates:
    chance is near zero, and it is the paper's F.2 criterion) and for ``no_fact`` (the no-fact control: the same
    items with every presentation of the asked fact replaced by filler, so that only the text can suggest the
    answer; near chance when the values are ones the text does not guess), ``against_text`` / ``against_text_n``
    (the clean accuracy over the items, and their number, whose no-fact prompt chooses a wrong value: recall that
    has to overturn the text's guess), and the settings (``num_bindings``: the load, or the list of loads).
    ``table``: one row per load.
    """
    if loads is None:
        loads = DEFAULT_LOADS if num_bindings is None else (num_bindings,)
    elif num_bindings is not None:
        raise ValueError(f"give num_bindings or loads, not both; got {num_bindings} and {loads}")
    loads = check_loads(loads)
    fmt = RecallFormat(template, keys, values, repeats, filler_tokens)
    check_format(fmt)
    try:
        trials = recall_trials(em, split, fmt, loads, items, seed, batch_size, no_fact=True)
    except FormatUnavailable as e:
        return _not_available(f"the memory lab's task rules fail for this tokenizer ({e})")
    table = []
    for t in trials:
        e, first = bootstrap(t.correct, t.sources, seed=seed), bootstrap(t.top1, t.sources, seed=seed)
        guessed, against = bootstrap(t.no_fact, t.sources, seed=seed), bootstrap(*t.against_text(), seed=seed)
        table.append({"num_bindings": t.num_bindings, "accuracy": e.mean, "ci_low": e.low, "ci_high": e.high,
                      "n": e.n, "sources": e.sources, "prompt_tokens": t.prompt_tokens, "top1": first.mean,
                      "top1_low": first.low, "top1_high": first.high, "no_fact": guessed.mean,
                      "no_fact_low": guessed.low, "no_fact_high": guessed.high, "against_text": against.mean,
                      "against_text_n": against.n})
    all_sources = [s for t in trials for s in t.sources]
    pooled = bootstrap([c for t in trials for c in t.correct], all_sources, seed=seed)
    pooled_top1 = bootstrap([c for t in trials for c in t.top1], all_sources, seed=seed)
    pooled_no_fact = bootstrap([c for t in trials for c in t.no_fact], all_sources, seed=seed)
    overturned = [t.against_text() for t in trials]
    pooled_against = bootstrap([c for values, _ in overturned for c in values],
                               [s for _, names in overturned for s in names], seed=seed)
    per_load = {f"{key}@{row['num_bindings']}": row[key] for row in table
                for key in ("accuracy", "ci_low", "ci_high", "top1", "top1_low", "top1_high", "no_fact",
                            "no_fact_low", "no_fact_high", "against_text", "against_text_n")}
    metrics = {"accuracy": pooled.mean, "ci_low": pooled.low, "ci_high": pooled.high, "n": pooled.n,
               "top1": pooled_top1.mean, "top1_low": pooled_top1.low, "top1_high": pooled_top1.high,
               "no_fact": pooled_no_fact.mean, "no_fact_low": pooled_no_fact.low,
               "no_fact_high": pooled_no_fact.high, "against_text": pooled_against.mean,
               "against_text_n": pooled_against.n,
               "sources": pooled.sources, "chance": CHANCE, "prompt_tokens": max(t.prompt_tokens for t in trials),
               "num_bindings": loads[0] if len(loads) == 1 else list(loads), "repeats": repeats,
               "template": template, "keys": keys, "values": values, **per_load}
    return {"available": True, "metrics": metrics, "table": table}
