"""Perplexity on held-out text: non-overlapping windows of the split, every target token counted once."""

from __future__ import annotations

import math
from typing import Any

import torch

from linmem.data.shards import SplitTokens
from linmem.data.windows import count_sequential_windows, sequential_windows
from linmem.eval.loading import EvalModel
from linmem.eval.scoring import window_losses


def leading_windows(split: SplitTokens, seq_len: int, max_tokens: int) -> list[torch.Tensor]:
    """The split's first sequential windows ``[seq_len]``, as many as cover ``max_tokens`` (or all there are)."""
    windows = []
    for window in sequential_windows(split, seq_len):
        if len(windows) * seq_len >= max_tokens:
            break
        windows.append(window)
    return windows


def perplexity(em: EvalModel, split: SplitTokens, seq_len: int, max_tokens: int = 262_144,
               batch_size: int = 8) -> dict[str, Any]:
    """Mean next-token loss and perplexity over the first windows ``[seq_len]`` of ``split`` that cover
    ``max_tokens`` (``leading_windows``; the first token of a window is context only); ``whole_split`` says whether
    they are all of the split's windows."""
    windows = leading_windows(split, seq_len, max_tokens)
    if not windows:
        raise ValueError(f"split {split.name!r} has no window of {seq_len} tokens; use a smaller --seq-len")
    total, count = 0.0, 0
    for chunk in torch.stack(windows).split(batch_size):
        losses = window_losses(em, chunk)
        total += float(losses.double().sum())
        count += losses.numel()
    loss = total / count
    return {"metrics": {"loss": loss, "ppl": math.exp(loss), "tokens": count, "windows": len(windows),
                        "seq_len": seq_len, "split": split.name,
                        "whole_split": len(windows) == count_sequential_windows(split, seq_len)}}
