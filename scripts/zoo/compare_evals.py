"""Compare the evaluation results of two zoo folders model by model: every number in each model's
``eval.json`` (``eval.tasks``), with timings and remeasure notes left out. Used to check that a re-measured copy of
the zoo reproduces the shipped numbers:

    cp -r linmem/zoo/models /tmp/zoo-copy
    linmem zoo remeasure all --tasks ppl,cloze,mqar,niah,recall,stability --why "reproduction check" \\
        --zoo-dir /tmp/zoo-copy
    python scripts/zoo/compare_evals.py linmem/zoo/models /tmp/zoo-copy

Prints, per model, how many values differ, the largest relative difference, and the differing values.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SKIPPED_KEYS = {"seconds", "remeasured", "date"}


def differences(a, b, path: str) -> list[tuple[str, object, object]]:
    """``(path, a, b)`` for every leaf where the two JSON values differ (NaN equals NaN)."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b), key=str):
            if key in SKIPPED_KEYS:
                continue
            found += differences(a.get(key), b.get(key), f"{path}/{key}")
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return [] if a == b or both_nan else [(path, a, b)]


def relative(a, b) -> float:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) / max(abs(a), abs(b), 1e-300)
    return math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shipped", type=Path, help="zoo folder holding the reference eval.json files")
    parser.add_argument("remeasured", type=Path, help="zoo folder measured again")
    args = parser.parse_args()
    for model in sorted(p.name for p in args.shipped.iterdir() if (p / "eval.json").is_file()):
        other = args.remeasured / model / "eval.json"
        if not other.is_file():
            print(f"{model}: no {other}")
            continue
        a = json.loads((args.shipped / model / "eval.json").read_text(encoding="utf-8"))["eval"]["tasks"]
        b = json.loads(other.read_text(encoding="utf-8"))["eval"]["tasks"]
        found = differences(a, b, model)
        if not found:
            print(f"{model}: identical")
            continue
        print(f"{model}: {len(found)} values differ, largest relative difference "
              f"{max(relative(x, y) for _, x, y in found):.2e}")
        for path, x, y in found:
            print(f"  {path}: {x!r} -> {y!r}")


if __name__ == "__main__":
    main()
