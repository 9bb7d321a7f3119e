"""The clean-recall gate: a model that does not recall the probe's facts gets a report that says so, and no
attribution, instead of a head ranking computed on noise."""

from __future__ import annotations

import json
import math

from linmem.memory import experiments as ex
from tests.test_memory_experiments import lab, model_dir, probe  # noqa: F401  (fixtures)


def test_gate_verdicts():
    passed = ex.recall_gate({"development": 0.75, "confirmation": 0.5}, 0.5)
    assert passed["passed"] and "at or above" in passed["message"]
    failed = ex.recall_gate({"development": 0.75, "confirmation": 0.4375}, 0.5)
    assert not failed["passed"] and "too low" in failed["message"] and "0.438 on the confirmation" in failed["message"]
    assert not ex.recall_gate({"development": math.nan}, 0.0)["passed"]  # no items: nothing to attribute
    controlled = ex.recall_gate({"development": 0.75}, 0.5, {"development": 0.625})
    assert "the text alone picks the answer in 0.625" in controlled["message"]
    assert controlled["no_fact"] == {"development": 0.625} and passed["no_fact"] == {}
    assert ex.recall_warning(0.3, 0.5)["clean_recall_warning"].startswith("clean recall 0.300 is below the gate")
    assert ex.recall_warning(0.3, None) == {} and ex.recall_warning(0.5, 0.5) == {}


def test_probe_of_a_random_model_reports_recall_too_low(model_dir, capsys):  # noqa: F811
    """The default protocol on the random-weight tiny GDN, gated at 0.9: it writes a report, the report and
    results.json say recall is too low, and only the experiments that attribute nothing ran."""
    assert probe(model_dir, "--loads", "1", "2", "--gaps", "0", "8", "--min-clean-recall", "0.9") == 0
    assert "clean recall too low to attribute anything" in capsys.readouterr().out
    payload = json.loads((model_dir / "out" / "results.json").read_text())
    header = payload["header"]
    recall = header["clean_recall"]
    assert set(recall) == {"development", "confirmation"} and min(recall.values()) < 0.9
    assert header["clean_recall_passed"] is False and header["chosen"] is None
    assert "too low to attribute anything" in payload["warning"] and payload["warning"] == header["clean_recall_gate"]
    assert set(payload["experiments"]) == {"clean_recall", "logit_lens"}
    assert {"head_scan", "lifecycle", "four_facts", "write_read_spearman"} <= set(header["skipped_by_gate"])
    rows = payload["experiments"]["clean_recall"]["rows"]
    assert [(r["split"], r["metric"]) for r in rows] == [(split, metric) for split in ("development", "confirmation")
                                                          for metric in ("clean_correct", "no_fact_correct")]
    assert [r["mean"] for r in rows[::2]] == [recall["development"], recall["confirmation"]]
    assert header["clean_recall_no_fact"] == {r["split"]: r["mean"] for r in rows[1::2]}
    assert "the text alone picks the answer" in header["clean_recall_gate"]
    page = (model_dir / "out" / "report.html").read_text()
    assert 'class="warning"' in page and "too low to attribute anything" in page
