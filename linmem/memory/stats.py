"""Source-level statistics: every estimate is a mean over source passages with a bootstrap 95% CI over sources.

Items from one source passage are not independent, so a bootstrap draws whole sources with replacement (items of
a drawn source enter with their source's mean). Every estimate carries ``n`` (items) and ``sources``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Estimate:
    """``mean`` with the bootstrap 95% interval ``[low, high]`` over ``sources`` sources holding ``n`` items."""

    mean: float
    low: float
    high: float
    n: int
    sources: int

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n}, sources={self.sources})"


def source_means(values: Sequence[float], sources: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """The mean of the finite values of each source, sources in first-seen order."""
    values = np.asarray(values, dtype=np.float64)
    groups: dict[str, list[float]] = {}
    for value, source in zip(values, sources):
        if np.isfinite(value):
            groups.setdefault(source, []).append(value)
    return np.array([np.mean(v) for v in groups.values()]), list(groups)


def bootstrap(values: Sequence[float], sources: Sequence[str], draws: int = 2000, seed: int = 0,
              statistic=np.mean) -> Estimate:
    """``statistic`` of the per-source means with a percentile 95% CI from ``draws`` resamples of sources."""
    means, names = source_means(values, sources)
    n = int(np.isfinite(np.asarray(values, dtype=np.float64)).sum())
    if len(means) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, 0)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(means), size=(draws, len(means)))
    boots = (means[picks].mean(axis=1) if statistic is np.mean  # one vectorised mean: head scans call this per head
             else np.array([statistic(means[p]) for p in picks]))
    low, high = np.percentile(boots, [2.5, 97.5])
    return Estimate(float(statistic(means)), float(low), float(high), n, len(names))


def bootstrap_ratio(numerator: Sequence[float], denominator: Sequence[float], sources: Sequence[str],
                    draws: int = 2000, seed: int = 0) -> Estimate:
    """A ratio of means (e.g. the normalized donor effect: one cache's donor-margin shift over the full swap's)
    with a percentile 95% CI from ``draws`` resamples of sources: ``Σ_s num̄_s / Σ_s den̄_s`` over the drawn
    sources' means. Averaging per-item ratios instead lets items with a near-zero full effect dominate.

    Items count only where both values are finite; ``n`` is their number.
    """
    num, den = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if num.shape != den.shape or len(num) != len(sources):
        raise ValueError(f"numerator, denominator and sources must have one length; got {num.shape}, "
                         f"{den.shape}, {len(sources)}")
    keep = np.isfinite(num) & np.isfinite(den)
    names = [s for s, k in zip(sources, keep) if k]
    num_means, _ = source_means(num[keep], names)
    den_means, kept = source_means(den[keep], names)
    if not kept:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, 0)
    ratio = lambda picks: num_means[picks].sum() / den_means[picks].sum()  # noqa: E731
    with np.errstate(divide="ignore", invalid="ignore"):
        picks = np.random.default_rng(seed).integers(0, len(kept), size=(draws, len(kept)))
        boots = np.array([ratio(p) for p in picks])
        mean = float(ratio(np.arange(len(kept))))
    finite = boots[np.isfinite(boots)]
    low, high = np.percentile(finite, [2.5, 97.5]) if len(finite) else (float("nan"), float("nan"))
    return Estimate(mean, float(low), float(high), int(keep.sum()), len(kept))


def ranks(values: np.ndarray) -> np.ndarray:
    """Average ranks from 1 (ties share their mean rank)."""
    order = np.argsort(values, kind="mergesort")
    ranked = np.empty(len(values))
    ranked[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tie = values == value
        ranked[tie] = ranked[tie].mean()
    return ranked


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation of two equal-length sequences."""
    rx, ry = ranks(np.asarray(x, dtype=np.float64)), ranks(np.asarray(y, dtype=np.float64))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = np.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    return float((rx * ry).sum() / denominator) if denominator > 0 else float("nan")
