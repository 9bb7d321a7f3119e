"""Counter-based randomness: the random choices for sample ``i`` depend only on ``(seed, stream, i)``.

Nothing carries state from one sample to the next, so any sample (and so any training step) can be produced
directly: resuming at step ``k`` gives bit for bit the batches that an uninterrupted run would have drawn, on any
number of workers or ranks. ``stream`` keeps unrelated choices (window offsets, mixing, generators) independent.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on ``uint64`` arrays (wrapping arithmetic): a bijective bit mixer."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_u64(seed: int, stream: int, index: np.ndarray | int) -> np.ndarray:
    """A well-mixed ``uint64`` for each ``index`` (shape of ``index``), fixed by ``(seed, stream)``."""
    index = np.asarray(index, dtype=np.uint64)
    key = _splitmix64(np.array([seed & _MASK], dtype=np.uint64))
    key = _splitmix64(key ^ np.uint64(stream & _MASK))
    # 1-d arrays throughout: NumPy wraps array arithmetic silently but warns on 0-d (scalar) overflow.
    return _splitmix64(key ^ _splitmix64(index.reshape(-1))).reshape(index.shape)


def uniform(seed: int, stream: int, index: np.ndarray | int) -> np.ndarray:
    """Floats in [0, 1) (53 random bits each), one per ``index``."""
    return (hash_u64(seed, stream, index) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    """A NumPy generator for the many draws of one sample (e.g. a synthetic sequence)."""
    return np.random.default_rng([seed & _MASK, stream & _MASK, int(index)])


def sample_indices(step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
    """Global sample indices ``[batch_size]`` of ``rank``'s share of training step ``step``.

    Step ``s`` covers samples ``s * world_size * batch_size`` onwards, rank ``r`` the ``r``-th block of
    ``batch_size``: the global batch of a step does not depend on how it is split over ranks.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}); got {rank}")
    if step < 0 or batch_size < 1:
        raise ValueError(f"need step >= 0 and batch_size >= 1; got step={step}, batch_size={batch_size}")
    first = (step * world_size + rank) * batch_size
    return np.arange(first, first + batch_size, dtype=np.int64)


class StepBatches:
    """Endless training batches of a source that makes ``rank``'s share of any step on demand
    (``batch(step, batch_size, rank, world_size)``): resuming at step ``k`` is ``batches(..., start_step=k)``."""

    def batches(self, batch_size: int, start_step: int = 0, rank: int = 0, world_size: int = 1):
        step = start_step
        while True:
            yield self.batch(step, batch_size, rank, world_size)
            step += 1
