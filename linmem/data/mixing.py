"""Interleave synthetic recall sequences into the natural-text training stream.

Sample ``i`` of the mixed stream is a synthetic sequence with probability ``fraction`` (decided by hashing
``(seed, i)``), else the text window ``i``. A synthetic sample comes from one of the generators (picked by
``weights``), opens with the separator (EOS: a new document starts) and has labels only on its answers. Like the
windows, every choice depends on ``(seed, i)`` alone, so batches are resumable at any step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from linmem.data.randomness import StepBatches, sample_indices, sample_rng, uniform
from linmem.data.synthetic import RecallGenerator, check_sample
from linmem.data.windows import TokenWindows
from linmem.io.labels import IGNORE_INDEX

MIX_STREAM, CHOICE_STREAM, SAMPLE_STREAM = 0x313C, 0xC401CE, 0x5A3B1E


class RecallMix(StepBatches):
    """Text windows with a ``fraction`` of synthetic recall sequences mixed in.

    Batches: ``input_ids, labels [B, T]`` (``T = text.seq_len``; ``labels`` is ``IGNORE_INDEX`` outside a synthetic
    sample's answers) and ``synthetic [B]`` (bool).
    """

    def __init__(self, text: TokenWindows, generators: Sequence[RecallGenerator], fraction: float,
                 seed: int = 0, weights: Sequence[float] | None = None, separator_id: int | None = None):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1]; got {fraction}")
        if fraction > 0 and not generators:
            raise ValueError("a positive fraction needs at least one recall generator")
        weights = np.ones(len(generators)) if weights is None else np.asarray(weights, dtype=np.float64)
        if len(weights) != len(generators) or (len(weights) and (weights.min() < 0 or weights.sum() <= 0)):
            raise ValueError(f"weights must be {len(generators)} non-negative numbers, not all 0; got {list(weights)}")
        self.text, self.generators, self.fraction, self.seed = text, list(generators), fraction, seed
        self.cumulative_weights = np.cumsum(weights) / weights.sum() if len(weights) else weights
        self.separator_id = text.split.eos_id if separator_id is None else separator_id

    @property
    def seq_len(self) -> int:
        return self.text.seq_len

    def is_synthetic(self, indices: np.ndarray) -> np.ndarray:
        """``[len(indices)]`` bool: which samples are synthetic."""
        return uniform(self.seed, MIX_STREAM, indices) < self.fraction

    def synthetic_sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [T] int64, loss_mask [T] bool)`` of synthetic sample ``index``: separator, then a sequence."""
        pick = int(np.searchsorted(self.cumulative_weights, uniform(self.seed, CHOICE_STREAM, index), side="right"))
        generator = self.generators[min(pick, len(self.generators) - 1)]
        sample = generator.sample(sample_rng(self.seed, SAMPLE_STREAM, index), self.seq_len - 1)
        check_sample(sample, self.seq_len - 1)
        tokens = np.concatenate([[self.separator_id], sample.tokens]).astype(np.int64)
        return tokens, np.concatenate([[False], sample.loss_mask])

    def samples(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """``input_ids, labels [len(indices), T]`` and ``synthetic [len(indices)]`` of samples ``indices``."""
        synthetic = self.is_synthetic(indices)
        ids = self.text.window_tokens(indices)  # text windows of synthetic slots are drawn and discarded
        labels = ids.copy()
        for row in np.flatnonzero(synthetic):
            tokens, mask = self.synthetic_sample(int(indices[row]))
            ids[row], labels[row] = tokens, np.where(mask, tokens, IGNORE_INDEX)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "synthetic": torch.from_numpy(synthetic)}

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.samples(np.array([index])).items()}

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """``rank``'s share of training step ``step`` (see ``randomness.sample_indices``)."""
        return self.samples(sample_indices(step, batch_size, rank, world_size))
