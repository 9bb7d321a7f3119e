"""Needle in a haystack: a key-value sentence inserted into held-out text, asked for at the end.

For a context length L and a depth d in [0, 1], the haystack is L tokens of held-out text (from a random
position), the needle ``" The secret number of NAME is NUMBER."`` is inserted at token ``d·(haystack length)``,
and the prompt ends with ``" The secret number of NAME is"``; the answer is ``" NUMBER"`` (4 digits). A trial
counts when greedy decoding gives every answer token. Chance is about 1 in 9,000.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from linmem.data.randomness import sample_rng
from linmem.data.shards import SplitTokens
from linmem.eval.loading import EvalModel
from linmem.eval.scoring import score_continuations

NAMES = ("Alice", "Bernard", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
         "Luca", "Mira", "Nils", "Olga", "Pavel")
NIAH_STREAM = 0x41A4


def haystack_tokens(split: SplitTokens, limit: int = 4_000_000) -> np.ndarray:
    """The split's tokens (documents with EOS separators), concatenated, at most ``limit``."""
    parts, size = [], 0
    for shard in split.shards:
        parts.append(np.asarray(shard[: limit - size], dtype=np.int64))
        size += len(parts[-1])
        if size >= limit:
            break
    return np.concatenate(parts)


def niah_prompt(em: EvalModel, hay: np.ndarray, length: int, depth: float,
                rng: np.random.Generator) -> tuple[list[int], list[int]] | None:
    """``(context ids, answer ids)`` of one trial of ``length`` tokens in all, or None if it does not fit."""
    name, number = NAMES[rng.integers(len(NAMES))], int(rng.integers(1000, 10000))
    needle = em.encode(f" The secret number of {name} is {number}.")
    query = em.encode(f"\n The secret number of {name} is")
    answer = em.encode(f" {number}")
    filler = length - len(needle) - len(query) - 1
    if filler < 1 or filler >= len(hay):
        return None
    start = int(rng.integers(0, len(hay) - filler))
    text = hay[start:start + filler].tolist()
    cut = int(round(depth * filler))
    return [em.eos_id] + text[:cut] + needle + text[cut:] + query, answer


def niah(em: EvalModel, split: SplitTokens, lengths: Sequence[int] = (256, 512, 1024, 2048),
         depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), samples: int = 20, seed: int = 0,
         batch_size: int = 8) -> dict[str, Any]:
    """Accuracy on the ``lengths`` x ``depths`` grid, ``samples`` trials per cell."""
    hay = haystack_tokens(split)
    grid = []
    for li, length in enumerate(lengths):
        row = []
        for di, depth in enumerate(depths):
            trials = [niah_prompt(em, hay, length, depth, sample_rng(seed, NIAH_STREAM, (li * 100 + di) * 10_000 + j))
                      for j in range(samples)]
            trials = [t for t in trials if t is not None]
            scores = score_continuations(em, trials, batch_size) if trials else []
            row.append(sum(s[1] for s in scores) / len(scores) if scores else None)
        grid.append(row)
    cells = [a for row in grid for a in row if a is not None]
    if not cells:
        raise ValueError(f"no NIAH length in {list(lengths)} fits the held-out split ({len(hay)} tokens)")
    return {"metrics": {"mean_accuracy": sum(cells) / len(cells), "samples_per_cell": samples},
            "grid": {"lengths": list(lengths), "depths": list(depths), "accuracy": grid}}
