"""``linmem probe zoo:gdn --out X`` with a misspelt flag, a misspelt choice or a model folder that does not exist
answers within a second: the console command, in a fresh process, exits with 2 and one error line, creates no
output folder, and spends at most 1 s of CPU time doing so (CPU time, not wall time: on a busy machine the wall
time also counts the wait for a core, which the command does not choose)."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

CONSOLE = Path(sys.executable).with_name("linmem")


def run_console(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``linmem ARGS`` as a user types it; the result and the CPU seconds (user + system) the process used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([str(CONSOLE), *args], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.skipif(not CONSOLE.exists(), reason="the linmem console command is not installed beside this Python")
@pytest.mark.parametrize(("args", "error"), [
    (["probe", "zoo:gdn", "--out", "{out}", "--onyl", "lifecycle"], "unrecognized arguments: --onyl lifecycle"),
    (["probe", "zoo:gdn", "--outt", "{out}"], "unrecognized arguments: --outt"),
    (["probe", "zoo:gdn", "--out", "{out}", "--only", "lifecycl"], "invalid choice: 'lifecycl'"),
    (["probe", "{missing}", "--out", "{out}"], "not a model folder"),
], ids=["misspelt flag", "misspelt --out", "misspelt experiment", "missing model folder"])
def test_a_mistyped_probe_command_answers_within_a_second(tmp_path, args, error):
    out, missing = tmp_path / "new" / "report", tmp_path / "no-such-model"
    started = time.perf_counter()
    args = [a.format(out=out, missing=missing) for a in args]
    done, cpu = run_console(*args)
    wall = time.perf_counter() - started
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and error in last, done.stderr
    assert last.startswith(("linmem: error:", "linmem probe: error:")), done.stderr
    assert not (tmp_path / "new").exists()
    assert cpu <= 1.0, f"{cpu:.2f} s of CPU time ({wall:.2f} s wall)"
    print(f"linmem {' '.join(args)}: {cpu:.2f} s CPU, {wall:.2f} s wall")
