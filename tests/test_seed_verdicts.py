"""scripts/probes/seed_verdicts.py: the second paper's claims judged over the seeds of one recipe."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "probes" / "seed_verdicts.py"
PROBES = ROOT / "docs" / "study" / "probes"
SEED_1 = PROBES / "dictionary" / "gdn-small-seed-1.json"


def verdicts(*groups: str, extra: tuple[str, ...] = ()) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *groups, *extra], capture_output=True, text=True, check=True)
    return done.stdout


def cells(text: str, row: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {row} |"))
    return [c.strip() for c in line.strip("|").split("|")][3:]  # the seeds' cells, then the verdict


def swap_row(record: dict, target: str = "chosen") -> dict:
    return next(r for r in record["experiments"]["lifecycle"]["rows"]
                if (r["intervention"], r["target"], r["metric"]) == ("state swap", target, "donor_margin_shift"))


def seeds_with_swaps(tmp_path: Path, intervals: list[tuple[float, float, float]], passed=(True, True, True)) -> str:
    """A group of copies of one real record whose state-swap shifts are the given (mean, low, high)."""
    base = json.loads(SEED_1.read_text())
    paths = []
    for i, ((mean, low, high), gate) in enumerate(zip(intervals, passed)):
        record = copy.deepcopy(base)
        swap_row(record).update(mean=mean, low=low, high=high)
        record["header"]["clean_recall_passed"] = gate
        path = tmp_path / f"seed-{i}.json"
        path.write_text(json.dumps(record))
        paths.append(str(path))
    return "G=" + ",".join(paths)


def test_every_seed_on_the_papers_side_agrees_and_one_undecided_seed_does_not(tmp_path):
    assert cells(verdicts(seeds_with_swaps(tmp_path, [(3.0, 2.0, 4.0), (1.0, 0.1, 2.0), (5.0, 4.0, 6.0)])),
                 "4")[-1] == "agrees"
    assert cells(verdicts(seeds_with_swaps(tmp_path, [(3.0, 2.0, 4.0), (0.5, -0.1, 1.0), (5.0, 4.0, 6.0)])),
                 "4")[-1] == "not resolved"
    assert cells(verdicts(seeds_with_swaps(tmp_path, [(-3.0, -4.0, -2.0), (-1.0, -2.0, -0.1), (-5.0, -6.0, -4.0)])),
                 "4")[-1] == "disagrees"
    split = verdicts(seeds_with_swaps(tmp_path, [(3.0, 2.0, 4.0), (-1.0, -2.0, -0.1), (5.0, 4.0, 6.0)]))
    assert cells(split, "4")[-1] == "not resolved"


def test_a_seed_below_the_gate_is_not_judged_and_fewer_than_three_decide_nothing(tmp_path):
    group = seeds_with_swaps(tmp_path, [(3.0, 2.0, 4.0)] * 3, passed=(True, False, True))
    row = cells(verdicts(group), "4")
    assert row[1].startswith("below the gate (") and row[-1] == "not resolved (2 of 3 seeds pass the gate)"
    two = verdicts(group.rsplit(",", 1)[0])  # the first two seeds only
    assert cells(two, "4")[-1] == "not resolved (1 of 2 seeds pass the gate)"


def test_cells_are_the_records_numbers_and_the_rules_are_applied_to_them():
    paths = [PROBES / "dictionary" / f"gdn-small-seed-{s}.json" for s in range(3)]
    text = verdicts("GDN-small=" + ",".join(map(str, paths)))
    records = [json.loads(p.read_text()) for p in paths]
    for cell, record in zip(cells(text, "4"), records):
        chosen, random = swap_row(record), swap_row(record, "random")
        assert cell == (f"{chosen['mean']:.2f} [{chosen['low']:.2f}, {chosen['high']:.2f}] (random swap "
                        f"{random['mean']:.2f} [{random['low']:.2f}, {random['high']:.2f}])")
    # the state swap's intervals all lie above zero in these records, so the row agrees; the write block's do not
    assert all(swap_row(r)["low"] > 0 for r in records) and cells(text, "4")[-1] == "agrees"
    blocks = [next(r for r in rec["experiments"]["lifecycle"]["rows"] if (r["intervention"], r["target"], r["metric"])
                   == ("write block", "chosen", "target_margin_change")) for rec in records]
    assert not all(b["high"] < 0 for b in blocks) and cells(text, "1")[-1] == "not resolved"


def test_restore_is_judged_against_the_seeds_own_swap(tmp_path):
    base = json.loads(SEED_1.read_text())
    swap = swap_row(base)["mean"]
    restore = next(r for r in base["experiments"]["lifecycle"]["rows"]
                   if (r["intervention"], r["target"], r["metric"]) == ("output restore", "chosen",
                                                                         "donor_margin_shift"))
    paths = []
    for i, (low, high) in enumerate([(-0.01, 0.01), (0.05 * swap, 0.08 * swap), (0.2 * swap, 0.4 * swap)]):
        record = copy.deepcopy(base)
        next(r for r in record["experiments"]["lifecycle"]["rows"] if r == restore).update(low=low, high=high)
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(record))
    assert cells(verdicts("G=" + ",".join(map(str, paths[:2] + paths[:1]))), "6")[-1] == "agrees"
    assert cells(verdicts("G=" + ",".join(map(str, [paths[2]] * 3))), "6")[-1] == "disagrees"


def test_the_documented_tables_are_what_the_records_give(tmp_path):
    results = (ROOT / "docs" / "results.md").read_text()
    start = results.index("P=docs/study/probes/dictionary; python scripts/probes/seed_verdicts.py")
    command = results[start:results.index("```", start)].replace("\\\n", " ")
    words = [w.replace("$P", str(PROBES / "dictionary")) for w in shlex.split(command)[3:]]
    groups = [w for w in words if "=" in w and not w.startswith("--")]
    assert groups, "results.md's seed_verdicts.py command names no group"
    figure = tmp_path / "verdicts.png"
    assert verdicts(*groups, extra=("--plot", str(figure))) in results
    assert figure.stat().st_size > 10_000


def test_a_malformed_group_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), str(SEED_1)], capture_output=True, text=True)
    assert done.returncode == 2 and "expected LABEL=SEED.json,SEED.json" in done.stderr
