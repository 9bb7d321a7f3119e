"""scripts/recall/plot_no_fact.py draws linmem eval's recall with its no-fact control, one panel per format, and
refuses what it cannot draw."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from linmem.eval.loading import open_heldout
from linmem.eval.memory_recall import memory_recall
from tests.test_eval import em, trained  # noqa: F401  (fixtures)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "recall" / "plot_no_fact.py"


def plot(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


@pytest.mark.slow
def test_panels_per_format_and_refusals(em, tmp_path):  # noqa: F811
    split = open_heldout(em, None, "test")
    files = []
    for folder in ("one", "two"):  # two models of one name, told apart by their folders
        for template in ("code", "likes"):
            result = memory_recall(em, split, items=8, loads=[2], filler_tokens=48, template=template)
            path = tmp_path / f"{folder}-{template}.json"
            path.write_text(json.dumps({"model": f"/models/{folder}", "name": "gdn", "tasks": {"recall": result}}))
            files.append(path)
    out = tmp_path / "figure" / "no-fact.png"
    done = plot(*files, "--out", out, "--facts", "2", "--labels", "first", "second")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    wrong_load = plot(*files, "--out", out, "--facts", "4")
    assert wrong_load.returncode != 0 and "no recall with the no-fact control at 4 facts" in wrong_load.stderr
    too_few = plot(*files, "--out", out, "--facts", "2", "--labels", "only")
    assert too_few.returncode != 0 and "names 1 models; the files hold 2" in too_few.stderr
