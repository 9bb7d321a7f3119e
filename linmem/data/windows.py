"""Fixed-length training windows drawn from token shards, deterministic per seed and resumable at any step.

Window ``i`` starts at a uniformly random position of the split (never crossing a shard end; documents inside a
window are separated by EOS), chosen by hashing ``(seed, i)`` (see ``randomness``). Nothing depends on earlier
windows, so ``batch(step)`` after a restart equals what an uninterrupted run drew at that step.

Batches follow the Hugging Face causal-LM convention: ``input_ids [B, T]`` and ``labels [B, T]`` (the model shifts
labels inside; ``IGNORE_INDEX`` is ignored), plus ``synthetic [B]`` (always False here; see ``mixing``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from linmem.data.randomness import StepBatches, hash_u64, sample_indices
from linmem.data.shards import SplitTokens

WINDOW_STREAM = 0x5717D0


class TokenWindows(StepBatches, Dataset):
    """Random windows of ``seq_len`` tokens of a split: ``dataset[i]`` and ``batch(step, batch_size)``.

    ``len(dataset)`` is a nominal epoch (``num_tokens // seq_len``); indices past it are valid too (sampling is
    with replacement).
    """

    def __init__(self, split: SplitTokens, seq_len: int, seed: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (one input and one target); got {seq_len}")
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.positions = np.array([max(len(s) - seq_len + 1, 0) for s in split.shards], dtype=np.int64)
        self.cumulative = np.cumsum(self.positions)
        if not split.shards or self.cumulative[-1] == 0:
            longest = max((len(s) for s in split.shards), default=0)
            raise ValueError(f"split {split.name!r} has no shard of at least seq_len = {seq_len} tokens (longest: "
                             f"{longest}); use a shorter seq_len or more data")

    def __len__(self) -> int:
        return max(1, self.split.num_tokens // self.seq_len)

    def window_tokens(self, indices: np.ndarray) -> np.ndarray:
        """Token ids ``[len(indices), seq_len]`` (int64) of windows ``indices``."""
        total = np.uint64(self.cumulative[-1])
        flat = (hash_u64(self.seed, WINDOW_STREAM, indices) % total).astype(np.int64)
        shard = np.searchsorted(self.cumulative, flat, side="right")
        offset = flat - (self.cumulative[shard] - self.positions[shard])
        rows = [self.split.shards[s][o:o + self.seq_len] for s, o in zip(shard.tolist(), offset.tolist())]
        return np.stack(rows).astype(np.int64) if rows else np.zeros((0, self.seq_len), dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.window_tokens(np.array([index]))[0])
        return {"input_ids": ids, "labels": ids.clone(), "synthetic": torch.tensor(False)}

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """``rank``'s share of training step ``step``: ``input_ids, labels [batch_size, seq_len]``."""
        ids = torch.from_numpy(self.window_tokens(sample_indices(step, batch_size, rank, world_size)))
        return {"input_ids": ids, "labels": ids.clone(), "synthetic": torch.zeros(batch_size, dtype=torch.bool)}


def _window_starts(num_tokens: int, seq_len: int) -> range:
    """Where the sequential windows of a shard of ``num_tokens`` start (its last partial window dropped)."""
    return range(0, num_tokens - seq_len + 1, seq_len)


def sequential_windows(split: SplitTokens, seq_len: int) -> Iterator[torch.Tensor]:
    """Non-overlapping windows ``[seq_len]`` (int64) covering each shard in order, for evaluation; a shard's
    last partial window is dropped."""
    for shard in split.shards:
        for start in _window_starts(len(shard), seq_len):
            yield torch.from_numpy(np.asarray(shard[start:start + seq_len], dtype=np.int64))


def count_sequential_windows(split: SplitTokens, seq_len: int) -> int:
    """How many windows ``sequential_windows`` yields, without reading the tokens."""
    return sum(len(_window_starts(len(shard), seq_len)) for shard in split.shards)


def _target_overlaps(split: SplitTokens, seq_len: int) -> Iterator[tuple[dict, int, np.ndarray]]:
    """Per ``sequential_windows`` window, in order: its shard's index entry, the index of the first document its
    ``seq_len - 1`` target tokens touch, and how many of those targets each touched document holds (EOS separators
    belong to no document)."""
    for shard_tokens, entry in zip(split.shards, split.entries):
        starts = np.asarray(entry["doc_starts"], dtype=np.int64)
        ends = starts + np.asarray(entry["doc_lengths"], dtype=np.int64)
        for start in _window_starts(len(shard_tokens), seq_len):
            low, high = start + 1, start + seq_len  # the targets: tokens 1 .. seq_len - 1 of the window
            first, last = np.searchsorted(ends, low, side="right"), np.searchsorted(starts, high, side="left")
            yield entry, int(first), np.minimum(ends[first:last], high) - np.maximum(starts[first:last], low)


def sequential_window_sources(split: SplitTokens, seq_len: int) -> list[str]:
    """The source of each ``sequential_windows`` window, in the same order: the source whose documents hold most of
    the window's ``seq_len - 1`` target tokens (EOS separators belong to no source; a tie goes to the source listed
    first in the dataset's index)."""
    names, out = split.source_names, []
    for entry, first, overlap in _target_overlaps(split, seq_len):
        sources = np.asarray(entry["sources"][first:first + len(overlap)], dtype=np.int64)
        counts = np.bincount(sources, weights=overlap, minlength=len(names))
        out.append(names[int(np.argmax(counts))] if counts.sum() > 0 else "none")
    return out


def sequential_window_documents(split: SplitTokens, seq_len: int) -> list[str]:
    """The document of each ``sequential_windows`` window, in the same order: the ``source_id`` of the document that
    holds most of the window's targets (a tie goes to the earlier document; "none" for a window of EOS alone), so
    that an evaluation can resample documents rather than windows of one document."""
    out = []
    for entry, first, overlap in _target_overlaps(split, seq_len):
        if len(overlap) and overlap.max() > 0:
            out.append(str(entry["source_ids"][first + int(np.argmax(overlap))]))
        else:
            out.append("none")
    return out
