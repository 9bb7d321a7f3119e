"""Intervals of a study: item bootstrap within a seed, seed bootstrap over seeds, paired two-level differences.

A seed's value of a metric is ``f(mean over groups g of Σ num / Σ den within g)`` over its items (``ItemSet``;
``f`` is ``exp`` for perplexity, else the identity). Its item interval resamples units (windows, documents,
sequences, trials) with replacement within each group. A model's value is the mean over its seeds, with a
seed-bootstrap interval (``linmem.memory.stats.bootstrap``, each seed one source): with three seeds that interval is
coarse (it never leaves the range of the seeds). A difference A - B between two models is resampled on both levels:
seeds drawn with replacement and shared by A and B (seed ``s`` of each model sees the same data order), and within
each drawn seed the units drawn again, shared by A and B when both were scored on the same items, so that the
interval holds seed noise and test-set noise. Metrics without items (activation norms, training loss) have only
the seed level.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from linmem.memory.stats import Estimate, bootstrap

DRAWS = 2000


@dataclass(frozen=True)
class ItemSet:
    """The items of one seed's metric, summed per unit: ``num[g]``, ``den[g]`` ``[units of g]`` per group ``g``
    (groups and units in first-seen order), the item count ``n`` and the unit names (for pairing)."""

    num: tuple[np.ndarray, ...]
    den: tuple[np.ndarray, ...]
    units: tuple[tuple[str, ...], ...]
    n: int

    @classmethod
    def from_columns(cls, units: Sequence[str], groups: Sequence[str], num: Sequence[float],
                     den: Sequence[float]) -> ItemSet:
        if not (len(units) == len(groups) == len(num) == len(den)) or not len(units):
            raise ValueError(f"item columns must be non-empty and of one length; got {len(units)}, {len(groups)}, "
                             f"{len(num)}, {len(den)}")
        sums: dict[str, dict[str, list[float]]] = {}
        for unit, group, a, b in zip(units, groups, num, den):
            pair = sums.setdefault(group, {}).setdefault(unit, [0.0, 0.0])
            pair[0] += a
            pair[1] += b
        return cls(tuple(np.array([p[0] for p in g.values()]) for g in sums.values()),
                   tuple(np.array([p[1] for p in g.values()]) for g in sums.values()),
                   tuple(tuple(g) for g in sums.values()), len(units))

    def value(self) -> float:
        return float(np.mean([n.sum() / d.sum() for n, d in zip(self.num, self.den)]))

    def draws(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``[count]`` statistics, units resampled with replacement within each group."""
        total = np.zeros(count)
        for num, den in zip(self.num, self.den):
            picks = rng.integers(0, len(num), size=(count, len(num)))
            with np.errstate(divide="ignore", invalid="ignore"):
                total += num[picks].sum(1) / den[picks].sum(1)
        return total / len(self.num)

    @property
    def unit_count(self) -> int:
        return sum(len(u) for u in self.units)


Measurement = ItemSet | float  # a seed's items, or a seed-level number (no items)
Transform = Callable[[np.ndarray], np.ndarray]


def identity(x: np.ndarray) -> np.ndarray:
    return x


def _interval(values: np.ndarray) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if not len(finite):
        return math.nan, math.nan
    low, high = np.percentile(finite, [2.5, 97.5])
    return float(low), float(high)


def seed_value(measurement: Measurement, transform: Transform = identity) -> float:
    raw = measurement.value() if isinstance(measurement, ItemSet) else float(measurement)
    return float(transform(np.array(raw)))


def item_estimate(items: ItemSet, transform: Transform = identity, draws: int = DRAWS, seed: int = 0) -> Estimate:
    """One seed's value with its item-bootstrap 95% interval (``n`` items, ``sources`` resampled units)."""
    boots = transform(items.draws(draws, np.random.default_rng(seed)))
    low, high = _interval(boots)
    return Estimate(seed_value(items, transform), low, high, items.n, items.unit_count)


def seed_estimate(values: Mapping[int, float], draws: int = DRAWS, seed: int = 0) -> Estimate:
    """Mean over seeds with a seed-bootstrap 95% interval (``linmem.memory.stats.bootstrap``, one source per
    seed)."""
    seeds = sorted(values)
    return bootstrap([values[s] for s in seeds], [str(s) for s in seeds], draws=draws, seed=seed)


def _same_items(a: Measurement, b: Measurement) -> bool:
    return isinstance(a, ItemSet) and isinstance(b, ItemSet) and a.units == b.units


def _seed_draws(a: Measurement, b: Measurement, transform: Transform, count: int,
                rng: np.random.Generator) -> np.ndarray:
    """``[count]`` item-level draws of ``transform(a) - transform(b)`` for one seed (shared units when paired)."""
    if not isinstance(a, ItemSet) and not isinstance(b, ItemSet):
        return np.full(count, seed_value(a, transform) - seed_value(b, transform))
    if _same_items(a, b):
        state = rng.bit_generator.state
        draws_a = a.draws(count, rng)
        rng.bit_generator.state = state  # the same unit picks for b
        return transform(draws_a) - transform(b.draws(count, rng))
    side = [transform(m.draws(count, rng)) if isinstance(m, ItemSet) else np.full(count, seed_value(m, transform))
            for m in (a, b)]
    return side[0] - side[1]


def paired_difference(a: Mapping[int, Measurement], b: Mapping[int, Measurement], transform: Transform = identity,
                      draws: int = DRAWS, seed: int = 0) -> Estimate:
    """Mean over the common seeds of ``value(A) - value(B)`` with a two-level bootstrap 95% interval (module
    docstring); ``n`` is the number of paired seeds, ``sources`` the same."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return Estimate(math.nan, math.nan, math.nan, 0, 0)
    rng = np.random.default_rng(seed)
    per_seed = np.stack([_seed_draws(a[s], b[s], transform, draws, rng) for s in seeds])  # [S, D]
    picks = rng.integers(0, len(seeds), size=(draws, len(seeds)))
    slots = (np.arange(draws)[:, None] + 7919 * np.arange(len(seeds))[None, :]) % draws  # fresh items per slot
    boots = per_seed[picks, slots].mean(1)
    mean = float(np.mean([seed_value(a[s], transform) - seed_value(b[s], transform) for s in seeds]))
    low, high = _interval(boots)
    return Estimate(mean, low, high, len(seeds), len(seeds))
