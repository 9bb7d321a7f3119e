"""Training runs lose nothing: a run folder takes one trainer at a time (a lock left by a killed one is taken over),
``--resume`` refuses a rebuilt dataset, a metrics line cut short by a crash does not block ``--resume``, ``linmem
params`` needs no data, ``linmem train`` answers path errors before importing torch and says where it builds a
dataset, and the run's writes do not follow a symbolic link out of its folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import linmem
from linmem.cli import main
from linmem.data.shards import dataset_fingerprint
from linmem.train.config import parse_config
from linmem.train.trainer import train
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)

LOCK = ".linmem-train.lock"  # linmem.train.run_lock.LOCK_NAME
# A process that holds the run folder's lock as the trainer does (flock, its pid and host in the file) until its
# stdin closes; it prints "held" once it has the lock.
HOLDER = """
import fcntl, json, os, socket, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
print("held", flush=True)
sys.stdin.read()
"""


def hold_lock(folder: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder / LOCK)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def two_steps(dataset, tmp_path_factory) -> Path:
    """A run stopped after update 2 (its checkpoint step-00000002 written)."""
    out = tmp_path_factory.mktemp("two") / "run"
    train(parse_config(tiny_config(dataset)), out, max_steps=2)
    return out


@pytest.fixture
def run_copy(two_steps, tmp_path) -> Path:
    return Path(shutil.copytree(two_steps, tmp_path / "run", symlinks=True))


# ---------------------------------------------------------------- the lock


def test_second_trainer_on_a_held_folder_is_refused(dataset, run_copy, capsys):
    config = parse_config(tiny_config(dataset))
    holder = hold_lock(run_copy)
    try:
        before = (run_copy / "metrics.jsonl").read_bytes()
        with pytest.raises(ValueError, match=rf"{run_copy}: another linmem train .*pid {holder.pid} on host"):
            train(config, run_copy, max_steps=3, resume=True)
        assert (run_copy / "metrics.jsonl").read_bytes() == before  # nothing touched
        path = run_copy / "config.yaml"
        path.write_text(yaml.safe_dump(tiny_config(dataset)), encoding="utf-8")
        assert main(["train", str(path), "--out", str(run_copy), "--resume"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"pid {holder.pid}" in err and str(run_copy) in err
    finally:
        holder.stdin.close()
        holder.wait()


def test_lock_of_a_killed_trainer_is_taken_over_with_a_warning(dataset, run_copy, capsys):
    holder = hold_lock(run_copy)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    train(parse_config(tiny_config(dataset)), run_copy, max_steps=3, resume=True)
    err = capsys.readouterr().err
    assert f"taking over the run folder's lock from pid {holder.pid}" in err and str(run_copy) in err
    assert steps(run_copy) == [1, 2, 3]
    assert (run_copy / LOCK).read_text(encoding="utf-8") == ""  # released at the end: not stale


# ---------------------------------------------------------------- the data under --resume


def change_one_token(folder: Path) -> None:
    """Rebuild-like change: one token of the first train shard differs, and the index has the shard's new hash."""
    index = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    entry = index["splits"]["train"][0]
    tokens = np.fromfile(folder / entry["file"], dtype=index["dtype"])
    tokens[5] = (tokens[5] + 1) % index["vocab_size"]
    tokens.tofile(folder / entry["file"])
    entry["sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    (folder / "index.json").write_text(json.dumps(index), encoding="utf-8")


def test_resume_refuses_a_rebuilt_dataset(dataset, tmp_path, capsys):
    data = Path(shutil.copytree(dataset, tmp_path / "data"))
    config, out = parse_config(tiny_config(data)), tmp_path / "run"
    train(config, out, max_steps=2)
    before = dataset_fingerprint(data)
    change_one_token(data)
    after = dataset_fingerprint(data)
    with pytest.raises(ValueError, match=r"--resume: the dataset .* changed since the run started \(fingerprint "
                                         rf"{before} in step-00000002, {after} now\)"):
        train(config, out, max_steps=3, resume=True)
    train(config, out, max_steps=3, resume=True, accept_changed_data=True)
    assert "continuing on it (--accept-changed-data)" in capsys.readouterr().err
    state = json.loads((out / "checkpoints" / "step-00000003" / "trainer_state.json").read_text(encoding="utf-8"))
    assert state["dataset_fingerprint"] == after


# ---------------------------------------------------------------- metrics.jsonl


def test_torn_last_metrics_line_is_dropped_and_resume_continues(dataset, run_copy, capsys):
    log = run_copy / "metrics.jsonl"
    with open(log, "a", encoding="utf-8") as f:
        f.write('{"step": 3, "loss": 6.2')  # killed mid-write
    train(parse_config(tiny_config(dataset)), run_copy, max_steps=3, resume=True)
    assert f"{log}: dropping line 3, cut short" in capsys.readouterr().err
    assert steps(run_copy) == [1, 2, 3]


def test_damaged_metrics_line_names_file_and_line(dataset, run_copy):
    log = run_copy / "metrics.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines()
    log.write_text("\n".join(["{not json", *lines[1:]]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{log}: line 1 is not a JSON record"):
        train(parse_config(tiny_config(dataset)), run_copy, max_steps=3, resume=True)


# ---------------------------------------------------------------- writes stay in the run folder


def test_symlinked_checkpoints_and_metrics_are_refused(dataset, run_copy, tmp_path):
    config = parse_config(tiny_config(dataset))
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("", encoding="utf-8")
    (run_copy / "metrics.jsonl").unlink()
    (run_copy / "metrics.jsonl").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=r"metrics\.jsonl: is a symbolic link"):
        train(config, run_copy, max_steps=3, resume=True)
    assert elsewhere.read_text(encoding="utf-8") == ""
    (run_copy / "metrics.jsonl").unlink()
    shutil.move(run_copy / "checkpoints", tmp_path / "checkpoints")
    (run_copy / "checkpoints").symlink_to(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"checkpoints: is a symbolic link"):
        train(config, run_copy, max_steps=3, resume=True)


# ---------------------------------------------------------------- commands


def test_params_needs_no_data_section(tmp_path, capsys):
    config = tiny_config(tmp_path)
    del config["data"]
    path = tmp_path / "model-only.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["params", str(path), "--json"]) == 0
    count = json.loads(capsys.readouterr().out)
    assert count["vocab_size"] == 4096 and count["vocab_source"] == "data.vocab_size (no data.dir)"


def test_train_path_errors_come_before_torch(tmp_path):
    command = tmp_path / "linmem"  # the console command's name: ``import linmem`` then waits for the command
    command.write_text("import sys\nfrom linmem.cli import main\ncode = main()\n"
                       "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)\n",
                       encoding="utf-8")
    missing = tmp_path / "missing.yaml"
    env = {**os.environ, "PYTHONPATH": str(Path(linmem.__file__).parents[1])}  # the linmem under test
    done = subprocess.run([sys.executable, str(command), "train", str(missing), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and done.stdout.strip() == "no torch"
    assert done.stderr.strip() == f"linmem train: error: {missing}: no such config file"


def test_train_says_where_it_builds_the_dataset(tmp_path, monkeypatch, capsys):
    from linmem.train import data as train_data

    def stop(*args, **kwargs):
        raise ValueError("stopped before building")

    monkeypatch.setattr(train_data, "build_dataset", stop)
    monkeypatch.chdir(tmp_path)
    config = tiny_config(Path("data/built"), data={"dir": "data/built", "sources": ["stdlib"]})
    with pytest.raises(ValueError, match="stopped before building"):
        train(parse_config(config), tmp_path / "out")
    assert (f"data.dir 'data/built' holds no dataset: building it from data.sources (stdlib) in "
            f"{tmp_path / 'data' / 'built'}") in capsys.readouterr().out
