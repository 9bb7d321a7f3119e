"""``linmem demo --quick`` on the tiny RDN shipped by ``tests/test_zoo.py``'s fixture: it evaluates the model,
probes it with the memory lab (S vs R: a residual model) and writes a self-contained report; with no model
shipped it says how to ship one."""

from __future__ import annotations

import json

import pytest

from linmem.cli import main
from linmem.demo import TASKS, pick_probe_model
from tests.test_zoo import NAME, shipped  # noqa: F401


def test_demo_quick_writes_the_report(shipped, tmp_path, capsys):  # noqa: F811
    root, _ = shipped
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--zoo-dir", str(root / "zoo"), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "linmem demo: total time" in printed and str(out / "report.html") in printed
    page = (out / "report.html").read_text()
    for section in ("<h2>Recall and perplexity</h2>", f"<h2>Memory lab: {NAME}</h2>",
                    "<h3>Base memory S vs residual memory R</h3>", "<h3>The probe's full report</h3>",
                    "lab recall (4 items)", "MQAR 4 pairs (2 seq.)", "<h2>The model cards' numbers</h2>",
                    "share of the layer&#x27;s S+R swap"):
        assert section in page, section
    assert page.count('src="data:image/png;base64,') >= 8  # the demo's own figures and the probe's
    assert "<link" not in page and "src=\"http" not in page  # self-contained
    results = json.loads((out / "results.json").read_text())
    assert set(results["models"]) == {NAME} and set(results["models"][NAME]["tasks"]) == set(TASKS)
    assert results["probe"]["model"] == NAME and results["probe"]["s_vs_r"] and results["seconds"] > 0
    assert (out / "probe" / "report.html").is_file() and (out / "eval" / NAME / "results.json").is_file()


def test_demo_without_models_says_how_to_ship(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo"), "--zoo-dir", str(tmp_path / "none")]) == 2
    error = capsys.readouterr().err
    assert "no zoo models are shipped in" in error and "linmem zoo ship RUN_DIR" in error


def test_probe_model_choice():
    mixers = {"sgla": "sgla", "rla": "rla", "rdn": "rdn", "rla-no-clip": "rla", "gdn-hybrid": "gdn"}
    assert pick_probe_model(list(mixers), mixers, None) == "rdn"
    assert pick_probe_model(["sgla", "rla-no-clip", "rla"], mixers, None) == "rla"
    assert pick_probe_model(["sgla", "gdn-hybrid"], mixers, None) == "sgla"
    assert pick_probe_model(["sgla", "rla"], mixers, "sgla") == "sgla"
    with pytest.raises(ValueError, match="not among the evaluated models"):
        pick_probe_model(["sgla"], mixers, "rdn")
    # a model that does not recall the fact gives the memory lab nothing to find: recall decides first
    recall = {"sgla": 0.9, "rla": 0.6, "rdn": 0.27, "rla-no-clip": 1.0, "gdn-hybrid": 0.95}
    assert pick_probe_model(list(mixers), mixers, None, recall) == "rla"  # the first residual model that recalls
    assert pick_probe_model(["sgla", "rdn", "gdn-hybrid"], mixers, None, recall) == "gdn-hybrid"  # best recall
    assert pick_probe_model(["sgla", "rdn"], mixers, None, {"sgla": 0.3, "rdn": None}) == "rdn"  # none recalls
    assert pick_probe_model(["sgla", "rdn"], mixers, "sgla", recall) == "sgla"
