"""MQAR accuracy against the number of key-value pairs (Zoology's multi-query associative recall).

Sequences are made exactly as the training mix makes them (``RecallMix``: an EOS separator, then ``MQAR.sample``)
with the ``vocab_range`` the model was trained with, from a seed training never used. Accuracy is the share of
answers whose argmax is the bound value; ``chance`` is 1 / pairs (guessing among the values in the sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from linmem.data.randomness import sample_rng
from linmem.data.synthetic import MQAR
from linmem.eval.loading import EvalModel
from linmem.eval.scoring import logits_of

EVAL_STREAM = 0xE7A1


def mqar_vocab_range(em: EvalModel) -> tuple[int, int]:
    """The training MQAR ``vocab_range`` from ``train_info.json``, else every id above EOS."""
    for spec in em.info.get("recall_generators", []):
        if spec.get("name") == "mqar" and "vocab_range" in spec:
            return tuple(spec["vocab_range"])
    return (em.eos_id + 1, em.model.config.vocab_size)


def mqar_batch(task: MQAR, seq_len: int, samples: int, seed: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N, seq_len], answer mask [N, seq_len])``: EOS then an MQAR sequence of ``seq_len - 1`` tokens."""
    ids, masks = [], []
    for i in range(samples):
        sample = task.sample(sample_rng(seed, EVAL_STREAM + task.num_kv_pairs, i), seq_len - 1)
        ids.append(np.concatenate([[eos_id], sample.tokens]))
        masks.append(np.concatenate([[False], sample.loss_mask]))
    return torch.as_tensor(np.stack(ids), dtype=torch.long), torch.as_tensor(np.stack(masks))


def mqar_accuracy(em: EvalModel, task: MQAR, seq_len: int, samples: int, seed: int, batch_size: int) -> float:
    """Share of answers predicted exactly (argmax at the token before each answer)."""
    ids, mask = mqar_batch(task, seq_len, samples, seed, em.eos_id)
    hits = total = 0
    for chunk_ids, chunk_mask in zip(ids.split(batch_size), mask.split(batch_size)):
        predicted = logits_of(em, chunk_ids)[:, :-1].argmax(-1)
        answer = chunk_mask[:, 1:]
        hits += int(((predicted == chunk_ids[:, 1:]) & answer).sum())
        total += int(answer.sum())
    return hits / max(total, 1)


def mqar(em: EvalModel, pairs: Sequence[int] = (2, 4, 8, 16, 32, 64), seq_len: int | None = None,
         samples: int = 64, seed: int = 0, power_a: float = 0.01, batch_size: int = 16) -> dict[str, Any]:
    """Accuracy for each number of pairs that fits ``seq_len`` (default: the training length) and the vocab range."""
    seq_len = seq_len or em.seq_len
    low, high = mqar_vocab_range(em)
    rows = []
    for n in pairs:
        if 4 * n > seq_len - 1 or n > (high - low) // 2:
            continue
        task = MQAR((low, high), n, power_a)
        rows.append({"pairs": n, "accuracy": mqar_accuracy(em, task, seq_len, samples, seed, batch_size),
                     "chance": 1.0 / n, "samples": samples})
    if not rows:
        raise ValueError(f"no MQAR size in {list(pairs)} fits seq_len {seq_len} and vocab range {(low, high)}")
    mean = sum(r["accuracy"] for r in rows) / len(rows)
    return {"metrics": {"mean_accuracy": mean, "seq_len": seq_len, "vocab_range": [low, high]}, "table": rows}
