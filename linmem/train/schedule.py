"""The learning-rate schedule: linear warmup, cosine decay, a floor (RLA Table 7: 3e-4 down to 3e-5)."""

from __future__ import annotations

import math


def cosine_lr(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of update ``step`` (0-based).

    ``lr · (step + 1) / warmup_steps`` during warmup, then a half cosine from ``lr`` to ``min_lr`` over the
    remaining ``total_steps - warmup_steps`` updates, and ``min_lr`` after ``total_steps``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
