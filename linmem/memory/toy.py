"""A toy model that recalls key-value bindings in natural filler, trained in a minute or two on a CPU.

For tests, docs and demos of the lab: a small BPE tokenizer (trained on the filler text and the task's own
sentences, so keys and values are whole tokens), the ``kv-filler`` recall generator on that text, and a tiny
linmem model trained on it with AdamW.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from linmem.data.tokenizer import train_tokenizer, wrap_tokenizer
from linmem.memory.fact_formats import KEY_WORDS, TEMPLATES, VALUE_WORDS
from linmem.memory.kv_filler import KeyValueFiller
from linmem.memory.tasks import TaskBuilder, TaskSpec
from linmem.models import LinMemConfig, LinMemForCausalLM

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


@dataclass
class ToySetup:
    """What ``train_toy`` needs and returns: the spec, tokenizer, builder and, after training, model and losses."""

    spec: TaskSpec
    tokenizer: PreTrainedTokenizerFast
    builder: TaskBuilder
    model: LinMemForCausalLM | None = None
    losses: list[float] | None = None


def toy_tokenizer(texts: Sequence[str], spec: TaskSpec, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE on ``texts`` plus the task's template and vocabulary words (repeated so they merge)."""
    before, middle, after = TEMPLATES[spec.template]
    words = KEY_WORDS[spec.keys].split() + VALUE_WORDS[spec.values].split()
    task_text = [f"{before} {w}{middle} {w}{after}" for w in words] * 50
    return wrap_tokenizer(train_tokenizer(list(texts) + task_text, vocab_size=vocab_size))


def train_toy(texts: Sequence[str], spec: TaskSpec, mixer: str = "gdn", steps: int = 400, seq_len: int = 96,
              batch_size: int = 32, lr: float = 3e-3, seed: int = 0, **config) -> ToySetup:
    """Train a tiny ``mixer`` model on ``kv-filler`` samples over ``texts``; returns the ``ToySetup``."""
    torch.manual_seed(seed)
    tokenizer = toy_tokenizer(texts, spec)
    builder = TaskBuilder(tokenizer, spec)
    encoded = (tokenizer.encode(" " + " ".join(t.split()), add_special_tokens=False) for t in texts)
    stream = np.asarray([i for ids in encoded for i in ids], dtype=np.int64)
    generator = KeyValueFiller.from_builder(builder, stream, num_bindings=spec.num_bindings, repeats=spec.repeats)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=2.0, hidden_ratio=2)
    model = LinMemForCausalLM(LinMemConfig(vocab_size=len(tokenizer), mixer=mixer,
                                           **{**sizes, **config}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng, losses = np.random.default_rng(seed), []
    model.train()
    for step in range(steps):
        samples = [generator.sample(rng, seq_len) for _ in range(batch_size)]
        ids = torch.from_numpy(np.stack([s.tokens for s in samples]))
        answers = torch.from_numpy(np.stack([s.loss_mask for s in samples]))
        logits = model(ids[:, :-1]).logits
        token_loss = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = 0.1 * token_loss.mean() + (token_loss * answers[:, 1:]).sum() / answers[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * (1 - step / steps))
        optimizer.step()
        losses.append(loss.item())
    return ToySetup(spec, tokenizer, builder, model.eval(), losses)
