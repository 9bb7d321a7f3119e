"""scripts/probes/seed_verdicts.py: the second paper's claims tested over the seeds of one recipe."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest

from tests.script_modules import load_script, printed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "probes" / "seed_verdicts.py"
PROBES = ROOT / "docs" / "study" / "probes"
SEED_1 = PROBES / "dictionary" / "gdn-small-seed-1.json"

seed_verdicts = load_script(SCRIPT, "seed_verdicts")  # it imports probe_table from its own folder


def verdicts(*args: str) -> str:
    """What the script prints."""
    return printed(seed_verdicts.main, *args)


def columns(text: str, row: str) -> tuple[list[str], dict[str, str]]:
    """The first table's row ``row``: its seeds' cells, and every cell by its column's name."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| row |"))
    names = [c.strip() for c in lines[header].strip("|").split("|")]
    line = next(line for line in lines[header:] if line.startswith(f"| {row} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    seeds = names.index("effect per seed") - names.index("effect (> 0: paper's side)") - 1
    return cells[4:4 + seeds], dict(zip(names, cells))


def verdict_of(text: str, row: str) -> str:
    return columns(text, row)[1]["verdict"]


def lifecycle_row(record: dict, intervention: str, target: str = "chosen") -> dict:
    metric = "target_margin_change" if intervention == "write block" else "donor_margin_shift"
    return next(r for r in record["experiments"]["lifecycle"]["rows"]
                if (r["intervention"], r["target"], r["metric"]) == (intervention, target, metric))


def swap_row(record: dict, target: str = "chosen") -> dict:
    return lifecycle_row(record, "state swap", target)


def only_the_swap(record: dict) -> dict:
    """The record with the state swap as its only measured claim (every other claim not measured)."""
    record["experiments"] = {"lifecycle": {"rows": [r for r in record["experiments"]["lifecycle"]["rows"]
                                                    if r["intervention"] == "state swap"]}}
    return record


def seeds_with_swaps(tmp_path: Path, intervals: list[tuple[float, float, float]], passed=None,
                     alone: bool = False) -> str:
    """A group of copies of one real record whose state-swap shifts are the given (mean, low, high); ``alone``:
    with nothing else measured."""
    base = json.loads(SEED_1.read_text())
    paths = []
    for i, ((mean, low, high), gate) in enumerate(zip(intervals, passed or [True] * len(intervals))):
        record = copy.deepcopy(base)
        swap_row(record).update(mean=mean, low=low, high=high)
        record["header"]["clean_recall_passed"] = gate
        path = tmp_path / f"seed-{i}.json"
        path.write_text(json.dumps(only_the_swap(record) if alone else record))
        paths.append(str(path))
    return "G=" + ",".join(paths)


def test_a_consistent_effect_agrees_an_opposite_one_disagrees_and_split_seeds_are_not_resolved(tmp_path):
    agree = verdicts(seeds_with_swaps(tmp_path, [(5.0, 4.0, 6.0), (5.1, 4.1, 6.1), (4.9, 3.9, 5.9)]))
    assert verdict_of(agree, "4") == "agrees"
    assert columns(agree, "4")[1]["effect per seed"] == "+5, +5.1, +4.9"
    disagree = verdicts(seeds_with_swaps(tmp_path, [(-5.0, -6.0, -4.0), (-5.1, -6.1, -4.1), (-4.9, -5.9, -3.9)]))
    assert verdict_of(disagree, "4") == "disagrees"
    split = verdicts(seeds_with_swaps(tmp_path, [(3.0, 2.0, 4.0), (-1.0, -2.0, -0.1), (5.0, 4.0, 6.0)]))
    assert verdict_of(split, "4").startswith("not resolved (Holm p = ") and verdict_of(split, "4").endswith(
        ", 3 seeds)")


def test_three_seeds_on_the_papers_side_with_small_effects_against_their_spread_do_not_agree(tmp_path):
    seeds = [(0.05, 0.01, 0.09), (0.5, 0.4, 0.6), (2.0, 1.5, 2.5)]
    assert all(low > 0 for _, low, _ in seeds)  # every seed's interval on the paper's side: no test over seeds
    _, row = columns(verdicts(seeds_with_swaps(tmp_path, seeds)), "4")
    assert row["verdict"].startswith("not resolved (Holm p = ")
    assert row["sign-flip p"] == "0.25" and row["t-test"].startswith("t(2) = ")
    assert float(row["t-test"].split("p = ")[1]) > 0.05  # not even the uncorrected test passes


def test_consistent_effects_over_enough_seeds_agree(tmp_path):
    seeds = [(2.0, 1.0, 3.0), (2.5, 1.5, 3.5), (1.5, 0.5, 2.5), (3.0, 2.0, 4.0), (2.2, 1.2, 3.2)]
    text = verdicts(seeds_with_swaps(tmp_path, seeds, alone=True))  # 15 other claims at p = 1 in the family
    _, row = columns(text, "4")
    assert row["verdict"] == "agrees" and float(row["Holm p"]) < 0.05
    assert row["sign-flip p"] == "0.062"  # 2 of 2**5 sign patterns reach the sum: reported, not deciding


def test_holm_counts_the_claims_a_p_that_passes_alone_fails_among_many(tmp_path, monkeypatch):
    group = seeds_with_swaps(tmp_path, [(4.0, 3.0, 5.0), (5.0, 4.0, 6.0), (6.0, 5.0, 7.0)], alone=True)
    among_all = verdicts(group)
    _, row = columns(among_all, "4")
    p = float(row["t-test"].split("p = ")[1])
    assert p < 0.05 and float(row["Holm p"]) == pytest.approx(16 * p, rel=0.02)
    assert "Holm over the 16 claims with an effect" in among_all
    assert row["verdict"].startswith("not resolved (Holm p = ")
    swap = next(c for c in seed_verdicts.CLAIMS if c.row == "4")
    monkeypatch.setattr(seed_verdicts, "CLAIMS", [swap])
    alone = verdicts(group)
    assert "Holm over the 1 claims with an effect" in alone and verdict_of(alone, "4") == "agrees"


def test_a_claim_without_a_per_seed_effect_is_described_never_decided():
    paths = [PROBES / "dictionary" / f"gdn-small-seed-{s}.json" for s in range(3)]
    text = verdicts("GDN-small=" + ",".join(map(str, paths)))
    for row in ("3", "7"):
        seeds, cells = columns(text, row)
        assert cells["verdict"] == "descriptive (no per-seed effect)" and cells["Holm p"] == "–"
        assert all(cell and cell != "not measured" for cell in seeds)  # the seeds' readings are still shown


def test_a_seed_below_the_gate_is_not_judged_and_fewer_than_three_decide_nothing(tmp_path):
    group = seeds_with_swaps(tmp_path, [(5.0, 4.0, 6.0), (5.1, 4.1, 6.1), (4.9, 3.9, 5.9)],
                             passed=(True, False, True))
    seeds, row = columns(verdicts(group), "4")
    assert seeds[1].startswith("below the gate (") and row["verdict"] == "not resolved (2 of 3 seeds pass the gate)"
    assert row["effect per seed"] == "+5, –, +4.9"
    two = verdicts(group.rsplit(",", 1)[0])  # the first two seeds only
    assert verdict_of(two, "4") == "not resolved (1 of 2 seeds pass the gate)"


def test_cells_and_effects_are_the_records_numbers():
    paths = [PROBES / "dictionary" / f"gdn-small-seed-{s}.json" for s in range(3)]
    text = verdicts("GDN-small=" + ",".join(map(str, paths)))
    records = [json.loads(p.read_text()) for p in paths]
    seeds, row = columns(text, "4")
    for cell, record in zip(seeds, records):
        chosen, random = swap_row(record), swap_row(record, "random")
        assert cell == (f"{chosen['mean']:.2f} [{chosen['low']:.2f}, {chosen['high']:.2f}] (random swap "
                        f"{random['mean']:.2f} [{random['low']:.2f}, {random['high']:.2f}])")
    assert row["effect per seed"] == ", ".join(f"{swap_row(r)['mean']:+.3g}" for r in records)
    blocks = [lifecycle_row(r, "write block")["mean"] for r in records]  # the paper's sign is negative
    assert columns(text, "1")[1]["effect per seed"] == ", ".join(f"{-b:+.3g}" for b in blocks)
    spearman = [r["experiments"]["write_read_spearman"]["summary"]["spearman"] for r in records]
    assert columns(text, "17")[1]["effect per seed"] == ", ".join(f"{0.5 - s:+.3g}" for s in spearman)


def test_restore_is_measured_against_the_seeds_own_swap(tmp_path):
    base = json.loads(SEED_1.read_text())
    swap = swap_row(base)["mean"]
    paths = []
    for i, mean in enumerate([0.0, 0.005 * swap, 0.01 * swap, 0.3 * swap, 0.31 * swap, 0.29 * swap]):
        record = copy.deepcopy(base)
        lifecycle_row(record, "output restore").update(mean=mean, low=mean - 0.1, high=mean + 0.1)
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(record))
    inside = verdicts("G=" + ",".join(map(str, paths[:3])))
    assert columns(inside, "6")[1]["effect per seed"] == ", ".join(
        f"{0.1 * swap - share * swap:+.3g}" for share in (0.0, 0.005, 0.01))
    assert verdict_of(inside, "6") == "agrees"
    assert verdict_of(verdicts("G=" + ",".join(map(str, paths[3:]))), "6") == "disagrees"


def test_the_documented_tables_are_what_the_records_give(tmp_path):
    results = (ROOT / "docs" / "results.md").read_text()
    start = results.index("P=docs/study/probes/dictionary; python scripts/probes/seed_verdicts.py")
    command = results[start:results.index("```", start)].replace("\\\n", " ")
    words = [w.replace("$P", str(PROBES / "dictionary")) for w in shlex.split(command)[3:]]
    groups = [w for w in words if "=" in w and not w.startswith("--")]
    assert groups, "results.md's seed_verdicts.py command names no group"
    figure = tmp_path / "verdicts.png"
    assert verdicts(*groups, "--plot", str(figure)) in results
    assert figure.stat().st_size > 10_000


def test_a_malformed_group_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        verdicts(str(SEED_1))
    assert stop.value.code == 2 and "expected LABEL=SEED.json,SEED.json" in capsys.readouterr().err
