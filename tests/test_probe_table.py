"""scripts/probes/probe_table.py: the second paper's rows read from probe records, checked against the records."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "probes" / "probe_table.py"
PROBES = ROOT / "docs" / "study" / "probes"


def table(*records: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *records], capture_output=True, text=True, check=True)
    return done.stdout


def cells(text: str, row_prefix: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {row_prefix}"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def rows_of(path: Path, experiment: str) -> list[dict]:
    return json.loads(path.read_text())["experiments"][experiment]["rows"]


def test_cells_are_the_records_numbers_and_a_failed_gate_gets_no_column():
    rdn, gla = PROBES / "remember" / "rdn-seed-0.json", PROBES / "remember" / "gla-seed-0.json"
    text = table(f"RDN={rdn}", f"GLA={gla}")
    assert text.splitlines()[0] == "| row | RDN |"  # GLA fails the gate: no column
    assert "- GLA: clean recall 0.12 / 0.12 (development / confirmation sources), below the gate 0.5" in text
    swap = next(r for r in rows_of(rdn, "lifecycle") if (r["intervention"], r["target"], r["metric"]) ==
                ("state swap", "chosen", "donor_margin_shift"))
    assert cells(text, "4:")[0].startswith(f"{swap['mean']:.2f} [{swap['low']:.2f}, {swap['high']:.2f}]")
    chosen_layer = int(json.loads(rdn.read_text())["header"]["chosen"][1:].split("H")[0])
    share = {r["memory"]: r for r in rows_of(rdn, "s_vs_r")
             if r["layer"] == chosen_layer and r["metric"] == "share_of_layer"}
    assert cells(text, "S vs R")[0] == (f"base S {share['S']['mean']:.2f} [{share['S']['low']:.2f}, "
                                        f"{share['S']['high']:.2f}], residual R {share['R']['mean']:.2f} "
                                        f"[{share['R']['low']:.2f}, {share['R']['high']:.2f}]")
    loads = sorted((r for r in rows_of(rdn, "sweep_num_bindings")
                    if r["edit"] == "chosen" and r["metric"] == "clean_correct"), key=lambda r: r["num_bindings"])
    assert cells(text, "12:")[0] == ", ".join(f"{r['mean']:.2f}" for r in loads)


def test_a_record_without_an_experiment_says_not_measured(tmp_path):
    record = json.loads((PROBES / "remember" / "gdn-seed-2.json").read_text())
    for name in ("corrector", "sweep_num_bindings", "sweep_gap", "logit_lens"):
        del record["experiments"][name]
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(record))
    for row in ("22:", "12:", "13:", "18:"):
        assert cells(table(f"GDN={path}"), row) == ["not measured"], row


def documented_records(results: str) -> list[str]:
    """The LABEL=PATH arguments of results.md's probe_table.py command, with its `$P` made a real path."""
    start = results.index("P=docs/study/probes; python scripts/probes/probe_table.py")
    command = results[start:results.index("```", start)].replace("\\\n", " ")
    words = shlex.split(command)[3:]  # after "P=...;", "python" and the script
    assert words, "results.md's probe_table.py command names no record"
    return [word.replace("$P", str(PROBES)) for word in words]


def test_the_documented_table_is_what_the_records_give():
    results = (ROOT / "docs" / "results.md").read_text()
    assert table(*documented_records(results)) in results


def test_a_column_joins_records_of_one_model_and_refuses_any_other(tmp_path):
    """A later `--only write_reach` record beside the full one fills the widened write-block row; a record of
    another model, or an experiment both records hold, is refused."""
    full = PROBES / "remember" / "gdn-seed-2.json"
    base = json.loads(full.read_text())
    assert cells(table(f"GDN={full}"), "1, widened") == ["not measured"]

    def row(target: str, d: int, mean: float, metric: str = "edited_correct") -> dict:
        return {"target": target, "tokens_after": d, "metric": metric, "mean": mean,
                "low": mean - 0.1, "high": mean + 0.1, "n": 16, "sources": 16}

    chosen, control = [0.75, 0.25, 0.31], [0.70, 0.69, 0.72]
    margins = {"chosen": [-0.05, -1.5, -1.4], "control head": [0.0, -0.02, 0.03]}
    later = {"header": dict(base["header"]),
             "experiments": {"clean_recall": base["experiments"]["clean_recall"],
                             "write_reach": {"summary": {"conv_width": 2},
                                             "rows": [row("chosen", d, m) for d, m in enumerate(chosen)]
                                             + [row("control head", d, m) for d, m in enumerate(control)]
                                             + [row(t, d, m, "target_margin_change") for t, ms in margins.items()
                                                for d, m in enumerate(ms)]}}}
    path = tmp_path / "reach.json"
    path.write_text(json.dumps(later))
    joined = table(f"GDN={full}+{path}")
    assert cells(joined, "1, widened") == [
        "recall at d = 0-2: 0.75 / 0.25 / 0.31; margin change at d = 0 -0.05 [-0.15, 0.05], at d = 1 "
        "-1.50 [-1.60, -1.40] (-0.02 [-0.12, 0.08])"]
    assert cells(joined, "4:") == cells(table(f"GDN={full}"), "4:")  # the full record's rows are kept as they were
    assert cells(joined, "2, widened") == ["not measured"]  # a write_reach record without the donor arm
    donors = {"chosen": [0.0, 0.62, 0.56], "control head": [0.0, 0.0, 0.06]}
    with_donors = copy.deepcopy(later)
    with_donors["experiments"]["write_reach"]["rows"] += [
        {**row(t, d, m, "donor_answer"), "intervention": "donor write"} for t, ms in donors.items()
        for d, m in enumerate(ms)]
    (tmp_path / "donors.json").write_text(json.dumps(with_donors))
    assert cells(table(f"GDN={full}+{tmp_path / 'donors.json'}"), "2, widened") == [
        "donor answers at d = 0-2: 0.00 / 0.62 / 0.56; at d = 1 0.62 [0.52, 0.72] (0.00)"]

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**later, "header": {**later["header"], "model": "zoo:gla"}}))
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps({**later, "experiments": {**later["experiments"],
                                                          "lifecycle": base["experiments"]["lifecycle"]}}))
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**later, "header": {**later["header"], "chosen": "L0H0S"}}))
    for wrong, message in ((other, "a column joins records of one model, task and chosen head"),
                           (elsewhere, "its chosen 'L0H0S'"),
                           (twice, "lifecycle is in an earlier record of this column")):
        done = subprocess.run([sys.executable, str(SCRIPT), f"GDN={full}+{wrong}"], capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr
