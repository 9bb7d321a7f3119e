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

A comparison is decided by a test over seeds, not by its interval: ``paired_test`` gives a two-sided paired t-test
of the per-seed differences (df = seeds - 1; ``t_two_sided_p`` computes the tail exactly for integer df) with its
95% interval, and the exact sign-flip permutation p-value beside it where there are at most
``SIGN_FLIP_MAX_SEEDS`` seeds (distribution-free, but at n seeds never below ``2 / 2**n``: 0.25 at 3). ``holm``
corrects the p-values of a family of claims (Holm's step-down, which holds the family-wise error rate at the level).
A bootstrap interval over 3 seeds excludes zero whenever the three seeds fall on one side, which pure noise does a
quarter of the time; the t-test's error rate at the 5% level is 5% at any number of seeds when the seed
differences are roughly normal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from linmem.memory.stats import Estimate, bootstrap

DRAWS = 2000
ALPHA = 0.05  # the level of every test and interval of a study
SIGN_FLIP_MAX_SEEDS = 10  # 2**10 sign patterns enumerated at most


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


def t_two_sided_p(t: float, df: int) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` (a positive integer) degrees of freedom: one minus the finite
    series of Abramowitz & Stegun 26.7.3 (odd df) and 26.7.4 (even df) in ``theta = atan(|t| / sqrt(df))``."""
    if isinstance(df, bool) or int(df) != df or df < 1:
        raise ValueError(f"the t distribution's degrees of freedom must be a positive integer; got {df!r}")
    if math.isnan(t):
        return math.nan
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    if df % 2 == 0:  # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2))
        term = total = 1.0
        for k in range(1, df // 2):
            term *= cos * cos * (2 * k - 1) / (2 * k)
            total += term
        inside = sin * total
    else:  # 2/pi (theta + sin(theta) (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ... up to cos^(df-2)))
        term = total = cos if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cos * cos * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + sin * total)
    return min(1.0, max(0.0, 1.0 - inside))


@functools.cache
def t_critical(df: int, alpha: float = ALPHA) -> float:
    """The ``t`` with ``t_two_sided_p(t, df) == alpha`` (bisection; the tail falls as ``t`` grows)."""
    low, high = 0.0, 1.0
    while t_two_sided_p(high, df) > alpha:
        low, high = high, 2 * high
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if t_two_sided_p(middle, df) > alpha else (low, middle)
    return (low + high) / 2


def sign_flip_p(differences: Sequence[float]) -> float | None:
    """The exact two-sided sign-flip permutation p-value of the mean of ``differences`` (each seed's A - B): the
    share of the ``2**n`` sign patterns whose ``|sum|`` reaches the observed one; None above
    ``SIGN_FLIP_MAX_SEEDS`` seeds or with none."""
    d = np.asarray(differences, dtype=float)
    if not 0 < len(d) <= SIGN_FLIP_MAX_SEEDS:
        return None
    patterns = 1 - 2 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))[None, :]) & 1)  # [2**n, n] of +-1
    sums = np.abs(patterns @ d)
    tolerance = 1e-12 * max(1.0, float(np.abs(d).sum()))  # equal sums added in another order
    return float(np.mean(sums >= abs(d.sum()) - tolerance))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order: the ``i``-th smallest of ``m`` is multiplied by
    ``m - i`` (i from 0), made non-decreasing and capped at 1; a NaN (nothing measured) counts as 1."""
    p = np.nan_to_num(np.asarray(p_values, dtype=float), nan=1.0)
    order = np.argsort(p, kind="stable")
    steps = np.minimum(1.0, (len(p) - np.arange(len(p))) * p[order])
    adjusted = np.empty(len(p))
    adjusted[order] = np.maximum.accumulate(steps) if len(p) else steps
    return [float(x) for x in adjusted]


@dataclass(frozen=True)
class PairedTest:
    """A two-sided paired t-test of A - B over ``seeds`` paired seeds: the mean difference, ``t`` (df = seeds - 1),
    its p-value, the t-distribution's 95% interval of the mean and the exact sign-flip p-value (None above
    ``SIGN_FLIP_MAX_SEEDS`` seeds). NaN where there are fewer than two seeds."""

    seeds: int
    mean: float
    t: float
    p: float
    low: float
    high: float
    sign_flip_p: float | None
    name: str = "paired t"

    @property
    def df(self) -> int:
        return self.seeds - 1


def paired_test(differences: Sequence[float], alpha: float = ALPHA) -> PairedTest:
    """The paired t-test of the per-seed differences ``differences`` (``PairedTest``). Equal non-zero differences
    give ``t = +-inf`` and the sign-flip p-value (0 above ``SIGN_FLIP_MAX_SEEDS`` seeds); all zero: t = 0, p = 1."""
    d = np.asarray(differences, dtype=float)
    n, flip = len(d), sign_flip_p(d)
    mean = float(d.mean()) if n else math.nan
    if n < 2:
        return PairedTest(n, mean, math.nan, math.nan, math.nan, math.nan, flip)
    error = float(d.std(ddof=1)) / math.sqrt(n)
    if error <= 1e-12 * abs(mean):  # equal differences, up to rounding: the t statistic is degenerate
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
        # a spread of zero is no evidence of a small one: the exact sign-flip p stands in (1 / 2**(n-1) at best),
        # and above its seed limit the t-test's limit, 0
        p = 1.0 if mean == 0 else (flip if flip is not None else 0.0)
        return PairedTest(n, mean, t, p, mean, mean, flip)
    t, half = mean / error, t_critical(n - 1, alpha) * error
    return PairedTest(n, mean, t, t_two_sided_p(t, n - 1), mean - half, mean + half, flip)
