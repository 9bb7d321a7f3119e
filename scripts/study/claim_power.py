"""How many seeds a study's claims need: each declared claim's power under the study's own decision rule, with the
seed-to-seed spread of the paired differences taken from another study's records of the same pairs.

    python scripts/study/claim_power.py PLANNED.yaml RECORDS.json [--seeds 8] [--power 0.8] [--draws 4000]

PLANNED.yaml is the study whose claims are planned (e.g. configs/study/core-seeds.yaml); RECORDS.json the tables of a
study that ran the same pairs (``tables/results.json``, e.g. docs/study/rla-paper/results.json). For each claim
(A, B, metric) the records give the per-seed differences A - B on their common seeds: their mean and standard
deviation (df = seeds - 1: with three seeds the deviation itself is uncertain by a factor of about two either way).
A claim is decided when its paired t-test (``linmem.study.estimates.paired_test``) passes after Holm's correction over
the study's m claimed metrics; Holm tests the smallest p at alpha / m and the largest at alpha, so a claim's power
lies between the two printed columns: at alpha / m (it is the family's strongest result, or every p is alike) and at
alpha (every other claim is decided before it). Power is simulated: ``--draws`` samples of ``--seeds`` normal
differences with the records' mean and deviation, the fraction the test rejects. "Smallest detectable" is the
difference the test finds with ``--power`` at alpha / m, in the metric's units (deviation x effect size); the
two-level interval the tables also require is not simulated (it excludes zero with the t-test nearly always). The
test is two-sided: "records' side" says whether the records' mean lies on the claim's side ("claim") or on the other
("against"), where a decision would be one against the claim.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rate_race import seed_values  # noqa: E402  (the sibling script: a model's per-seed values in the tables)

from linmem.study.definition import load_study  # noqa: E402
from linmem.study.estimates import ALPHA, paired_test  # noqa: E402


def seed_differences(tables: dict, a: str, b: str, metric: str) -> list[float]:
    """The per-seed values of A minus B's at the seeds both have (empty where either has none)."""
    mine, theirs = seed_values(tables, a, metric), seed_values(tables, b, metric)
    return [mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))]


def power(effect: float, seeds: int, level: float, draws: int, rng: np.random.Generator) -> float:
    """The share of ``draws`` samples of ``seeds`` differences, normal with mean ``effect`` (in standard deviations)
    and deviation 1, that the paired t-test rejects at ``level``."""
    samples = rng.normal(effect, 1.0, size=(draws, seeds))
    return float(np.mean([paired_test(row).p < level for row in samples]))


def smallest_detectable(seeds: int, level: float, target: float, draws: int, rng: np.random.Generator) -> float:
    """The effect size (difference / deviation) the test finds with power ``target`` at ``level``: bisection on
    ``power``, to 0.01."""
    low, high = 0.0, 1.0
    while power(high, seeds, level, draws, rng) < target:
        low, high = high, 2 * high
        if high > 64:
            return math.inf
    while high - low > 0.01:
        middle = (low + high) / 2
        low, high = (middle, high) if power(middle, seeds, level, draws, rng) < target else (low, middle)
    return high


def report(planned_path: Path, records_path: Path, seeds: int, target: float, draws: int, seed: int = 0) -> str:
    """The markdown table (a row per claimed metric) and the lines above it."""
    planned = load_study(planned_path)
    tables = json.loads(records_path.read_text(encoding="utf-8"))
    claims = [(c.a, c.b, metric) for c in planned.claims for metric in c.metrics]
    if not claims:
        raise SystemExit(f"{planned_path}: the study declares no claims")
    m = len(claims)
    rng = np.random.default_rng(seed)
    detectable = smallest_detectable(seeds, ALPHA / m, target, draws, rng)
    lines = [f"# Power of {planned.name}'s {m} claims at {seeds} seeds",
             "",
             f"Paired t-test, Holm over the {m} claimed metrics (alpha {ALPHA:g}: the strictest step {ALPHA / m:.4f});"
             f" the seed spread of each pair from {tables.get('study', records_path.name)}'s records; "
             f"{draws} simulated studies per cell. At {seeds} seeds the test finds a difference of "
             f"{detectable:.2f} standard deviations with power {target:g} at alpha / m.",
             "",
             "| A | B | metric | record seeds | mean A - B | records' side | sd of A - B | power at alpha / m | "
             f"power at alpha | smallest detectable (power {target:g}, alpha / m) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a, b, metric in claims:
        d = seed_differences(tables, a, b, metric)
        if len(d) < 2:
            lines.append(f"| {a} | {b} | {metric} | {len(d)} | – | – | – | – | – | no record of both at two seeds |")
            continue
        mean, sd = float(np.mean(d)), float(np.std(d, ddof=1))
        effect = abs(mean) / sd if sd > 0 else math.inf
        strict, lenient = (power(effect, seeds, level, draws, rng) for level in (ALPHA / m, ALPHA))
        claim_side = (mean > 0) == tables["metrics"][metric]["higher_is_better"]
        lines.append(f"| {a} | {b} | {metric} | {len(d)} | {mean:+.4g} | {'claim' if claim_side else 'against'} | "
                     f"{sd:.3g} | {strict:.2f} | {lenient:.2f} | {detectable * sd:.3g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("planned", type=Path, help="the study whose claims are planned (YAML)")
    parser.add_argument("records", type=Path, help="tables/results.json of a study that ran the same pairs")
    parser.add_argument("--seeds", type=int, default=8, help="seeds per arm in the planned study (8)")
    parser.add_argument("--power", type=float, default=0.8, help="the power the smallest detectable difference has")
    parser.add_argument("--draws", type=int, default=4000, help="simulated studies per cell (4000)")
    args = parser.parse_args(argv)
    if args.seeds < 2 or not 0 < args.power < 1 or args.draws < 100:
        parser.error("--seeds must be at least 2, --power in (0, 1) and --draws at least 100")
    print(report(args.planned, args.records, args.seeds, args.power, args.draws))


if __name__ == "__main__":
    main()
