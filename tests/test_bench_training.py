"""``python -m linmem.bench.training`` as a CPU dry run: every requested mixer measured, ratios from the times,
the budget and failing pairs skipped with a reason."""

import json
import math

import pytest
import torch

from linmem.bench import training

TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--head-dim", "16", "--vocab", "64", "--batch", "1",
        "--seq-len", "32", "--steps", "2", "--warmup", "1", "--backends", "chunk", "--threads", "1"]


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_dry_run_writes_every_mixer_and_ratios(tmp_path):
    rows = training.main([*TINY, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["torch"] == torch.__version__ and report["settings"]["batch"] == 1 and not report["skipped"]
    by_mixer = {r["mixer"]: r for r in report["rows"]}
    assert set(by_mixer) == {"rdn", "rla", "gdn", "sgla"} and len(rows) == 4
    for r in report["rows"]:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and r["finite"]
        assert r["tokens_per_s"] == pytest.approx(32 / (r["step_ms"] / 1e3))
        assert r["params"] > 0 and r["timed_steps"] == 2 and r["backend"] == "chunk"
    assert by_mixer["rdn"]["vs_base"] == pytest.approx(by_mixer["rdn"]["step_ms"] / by_mixer["gdn"]["step_ms"])
    assert by_mixer["rla"]["vs_base"] == pytest.approx(by_mixer["rla"]["step_ms"] / by_mixer["sgla"]["step_ms"])
    assert by_mixer["gdn"]["vs_base"] is None and by_mixer["sgla"]["vs_base"] is None
    md = (tmp_path / "training.md").read_text()
    assert "| RDN | chunk |" in md and f"{by_mixer['rdn']['vs_base']:.2f}x GDN" in md
    assert "python -m linmem.bench.training" in md


def test_budget_and_failures_are_skipped_with_a_reason(tmp_path, monkeypatch):
    build = training.model_config

    def failing_sgla(args, mixer, backend):
        if mixer == "sgla":
            raise RuntimeError("no sGLA here")
        return build(args, mixer, backend)

    monkeypatch.setattr(training, "model_config", failing_sgla)
    rows = training.main([*TINY, "--mixers", "sgla,rla", "--out", str(tmp_path)])
    assert [r["mixer"] for r in rows] == ["rla"] and rows[0]["vs_base"] is None
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["skipped"] == [dict(mixer="sgla", backend="chunk", reason="RuntimeError: no sGLA here")]

    rows = training.main([*TINY, "--mixers", "gdn,rdn", "--budget", "0"])
    assert [r["mixer"] for r in rows] == ["gdn"] and rows[0]["timed_steps"] == 1  # the deadline ends its timing


def test_environment_names_the_software():
    from linmem.bench import environment

    env = environment("cpu")
    assert env["device"] == "cpu" and env["gpu"] is None and env["torch"] == torch.__version__
    triton = pytest.importorskip("triton")
    assert env["triton"] == triton.__version__
