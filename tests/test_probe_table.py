"""scripts/probes/probe_table.py: the second paper's rows read from probe records, checked against the records."""

from __future__ import annotations

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
    del record["experiments"]["corrector"]
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(record))
    assert cells(table(f"GDN={path}"), "22:") == ["not measured"]


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
