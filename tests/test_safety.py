"""Never lose a user's files or a run: output folders linmem did not make are refused, checkpoints and model
folders are verified by SHA-256, ``--resume`` of a finished (or nearly finished) run keeps every record, and the
CLI reports expected failures in one line."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from linmem.cli import main
from linmem.io.folders import (
    MARKER,
    check_replaceable,
    prepare_output_folder,
    replace_folder,
    staged_folder,
    staging_path,
)
from linmem.io.manifest import DamagedFileError, has_manifest, verify_manifest, write_manifest
from linmem.train import checkpoint as ckpt
from linmem.train.config import parse_config
from linmem.train.trainer import MODEL_DIR, TRAIN_INFO, train
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)

SHORT = {"steps": 2, "checkpoint_interval": 1, "eval_interval": 2, "log_interval": 1}


def config_file(dataset: Path, folder: Path, **train: int) -> Path:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(dataset, train={**SHORT, **train})), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def finished(dataset, tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoints at 1 and 2, the final model)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(parse_config(tiny_config(dataset, train=SHORT)), out)
    return out


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- 1. output folders


def test_train_refuses_a_users_folder_and_keeps_its_files(dataset, tmp_path, capsys):
    config = config_file(dataset, tmp_path)
    out = tmp_path / "d"
    (out / "model").mkdir(parents=True)
    (out / "model" / "important.bin").write_text("thesis")
    assert main(["train", str(config), "--out", str(out), "--no-progress"]) == 2
    err = one_error_line(capsys)
    assert str(out) in err and "--overwrite" in err
    # --overwrite writes linmem's files but never deletes the user's: OUT/model holds one, so it is refused at once
    assert main(["train", str(config), "--out", str(out), "--no-progress", "--overwrite"]) == 2
    assert "important.bin" in one_error_line(capsys)
    assert (out / "model" / "important.bin").read_text() == "thesis"
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    # a user's file beside linmem's outputs stays through --overwrite
    shutil.rmtree(out / "model")
    (out / "notes.txt").write_text("mine")
    assert main(["train", str(config), "--out", str(out), "--no-progress", "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "model" / "model.safetensors").is_file()
    assert json.loads((out / MARKER).read_text())["foreign"] == ["notes.txt"]


@pytest.mark.parametrize("argv", [
    ["demo", "--quick", "--out", "{out}"],
    ["eval", "{model}", "--tasks", "ppl", "--out", "{out}"],
    ["probe", "{model}", "--out", "{out}"],
    ["data", "build", "--sources", "{corpus}", "--out", "{out}", "--no-progress"],
    ["zoo", "ship", "{run}", "--ship", "tiny", "--zoo-dir", "{out}"],
], ids=lambda a: " ".join(a[:2]))
def test_every_command_refuses_a_folder_it_did_not_make(finished, tmp_path, capsys, argv):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "report.html").write_text("my report")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text " * 50)
    fields = {"out": out, "model": finished / MODEL_DIR, "run": finished, "corpus": corpus}
    assert main([a.format(**fields) for a in argv]) == 2
    err = one_error_line(capsys)
    assert str(out) in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == ["report.html"] and (out / "report.html").read_text() == "my report"


def test_fla_conversion_refuses_a_folder_it_did_not_make(tmp_path):
    from linmem.models import convert_fla_checkpoint

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--overwrite"):
        convert_fla_checkpoint(tmp_path / "no-fla", tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == "{}"


def test_output_folder_rules(tmp_path):
    fresh = prepare_output_folder(tmp_path / "a" / "b", overwrite=False, kind="eval")
    (fresh / "results.md").write_text("x")
    assert prepare_output_folder(fresh, overwrite=False, kind="eval") == fresh  # its own folder: accepted again
    with pytest.raises(ValueError, match="written by linmem eval, not linmem demo"):
        prepare_output_folder(fresh, overwrite=False, kind="demo")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        prepare_output_folder(tmp_path / "file", overwrite=True, kind="eval")
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_output_folder(empty, overwrite=False, kind="data")
    # replace_folder removes an old folder only if everything in it is linmem's
    final, tmp = tmp_path / "model", tmp_path / ".tmp-model"
    for folder in (final, tmp):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (final / "eval").mkdir()
    prepare_output_folder(final / "eval", overwrite=False, kind="eval")  # linmem's own subfolder
    replace_folder(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    (final / "thesis.tex").write_text("mine")
    with pytest.raises(ValueError, match="thesis.tex"):
        replace_folder(tmp, final)
    assert (final / "thesis.tex").read_text() == "mine"
    check_replaceable(tmp_path / "absent", ())


def test_staged_folder_appears_whole_over_a_leftover(tmp_path):
    final = tmp_path / "runs" / "model"
    leftover = tmp_path / "runs" / ".tmp-model"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_text("half")  # an interrupted earlier build
    with staged_folder(final) as tmp:
        assert tmp == leftover and not list(tmp.iterdir()) and not final.exists()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_text("weights")
    assert {p.name: p.read_text() for p in final.iterdir()} == {"config.json": "{}", "model.safetensors": "weights"}
    assert sorted(p.name for p in final.parent.iterdir()) == ["model"]
    with staged_folder(final) as tmp:  # a second build of the same files replaces the first
        (tmp / "config.json").write_text("{2}")
        (tmp / "model.safetensors").write_text("weights 2")
    assert {p.name: p.read_text() for p in final.iterdir()} == {"config.json": "{2}", "model.safetensors": "weights 2"}


def test_staged_folder_left_by_a_failed_build_is_removed_and_final_untouched(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="build failed"), staged_folder(final) as tmp:
        (tmp / "config.json").write_text("half")
        raise RuntimeError("build failed")
    assert {p.name: p.read_text() for p in final.iterdir()} == {"config.json": "old"}  # the older version stays
    absent = tmp_path / "absent"
    with pytest.raises(KeyboardInterrupt), staged_folder(absent) as tmp:
        (tmp / "config.json").write_text("half")
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no absent/, no staging folder


# ---------------------------------------------------------------- 2. SHA-256 verification


def test_every_damaged_checkpoint_file_is_named(finished, tmp_path):
    newest = ckpt.latest_checkpoint(finished / "checkpoints")
    names = sorted(p.name for p in newest.iterdir() if p.name != "manifest.json")
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json", "rng-rank0.json"} <= set(names)
    for name in names:
        copy = tmp_path / name / newest.name
        shutil.copytree(newest, copy)
        flip_byte(copy / name)  # same size, one bit different
        with pytest.raises(DamagedFileError, match=rf"{name}: damaged \(SHA-256"):
            ckpt.read_checkpoint(copy)


def test_resume_from_a_damaged_checkpoint_fails_naming_the_file(dataset, finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / MODEL_DIR)  # so that resuming has work to do
    flip_byte(ckpt.latest_checkpoint(run / "checkpoints") / "optimizer.safetensors")
    assert main(["train", str(config_file(dataset, tmp_path)), "--out", str(run), "--resume", "--no-progress"]) == 2
    err = one_error_line(capsys)
    assert "optimizer.safetensors" in err and "damaged" in err


def test_model_folders_have_manifests(finished, tmp_path):
    model = finished / MODEL_DIR
    assert has_manifest(model)
    verify_manifest(model)
    listed = set(json.loads((model / "manifest.json").read_text())["files"])
    assert listed == {p.name for p in model.iterdir()} - {"manifest.json"}
    copy = tmp_path / "model"
    shutil.copytree(model, copy)
    flip_byte(copy / "model.safetensors", offset=-3)
    with pytest.raises(DamagedFileError, match="model.safetensors: damaged"):
        verify_manifest(copy)
    (copy / "config.json").unlink()
    write_manifest(copy, ["model.safetensors"])
    verify_manifest(copy)


def test_shipped_zoo_models_match_their_manifests():
    from linmem import zoo

    names = zoo.names()
    assert names
    for name in names:
        folder = zoo.path(name)
        listed = set(json.loads((folder / "manifest.json").read_text())["files"])
        assert listed == {p.name for p in folder.iterdir() if p.is_file()} - {"manifest.json"}, name
        verify_manifest(folder)


@pytest.mark.slow
def test_manifest_command_line(tmp_path):
    import subprocess

    (tmp_path / "a.txt").write_text("a")
    run = [sys.executable, "-m", "linmem.io.manifest"]
    assert subprocess.run([*run, "write", str(tmp_path)], capture_output=True).returncode == 0
    (tmp_path / "a.txt").write_text("b")
    done = subprocess.run([*run, "verify", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1 and "a.txt: damaged" in done.stderr


# ---------------------------------------------------------------- 5. resuming a finished run


def test_resume_of_a_finished_run_keeps_every_record(dataset, finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", f"{MODEL_DIR}/{TRAIN_INFO}",
                                                           f"{MODEL_DIR}/model.safetensors")}
    info = train(parse_config(tiny_config(dataset, train=SHORT)), run, resume=True)
    assert {name: (run / name).read_bytes() for name in before} == before
    assert info == json.loads(before[f"{MODEL_DIR}/{TRAIN_INFO}"])
    assert info["final_metrics"]["loss"] > 0 and info["train_seconds"] > 0


def test_resume_after_a_kill_while_writing_the_final_model(dataset, finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    original = json.loads((run / MODEL_DIR / TRAIN_INFO).read_text())
    staging = staging_path(run / MODEL_DIR)
    os.rename(run / MODEL_DIR, staging)  # killed before the rename: only the hidden folder is there
    (staging / "model.safetensors").write_bytes(b"half")
    info = train(parse_config(tiny_config(dataset, train=SHORT)), run, resume=True)
    assert not staging.exists()
    verify_manifest(run / MODEL_DIR)
    saved = json.loads((run / MODEL_DIR / TRAIN_INFO).read_text())
    assert saved == info and saved["final_metrics"] == original["final_metrics"] and saved["final_metrics"]
    state = json.loads((ckpt.latest_checkpoint(run / "checkpoints") / "trainer_state.json").read_text())
    assert saved["train_seconds"] == state["train_seconds"] > 0
    assert saved["steps"] == original["steps"] and saved["tokens"] == original["tokens"]


def test_resume_counts_every_segment_and_needs_a_run(dataset, tmp_path, capsys):
    config = parse_config(tiny_config(dataset, train={**SHORT, "steps": 3}))
    out = tmp_path / "run"
    first = train(config, out, max_steps=2)
    second = train(config, out, resume=True)
    state = json.loads((ckpt.latest_checkpoint(out / "checkpoints") / "trainer_state.json").read_text())
    assert second["steps"] == 3 and second["train_seconds"] >= first["train_seconds"] > 0
    assert state["train_seconds"] >= first["train_seconds"]
    assert second["total_tokens"] == second["tokens"] == 3 * 8 * 32
    path = config_file(dataset, tmp_path)
    assert main(["train", str(path), "--out", str(tmp_path / "nowhere"), "--resume", "--no-progress"]) == 2
    assert "does not exist" in one_error_line(capsys) and not (tmp_path / "nowhere").exists()


def test_resume_takes_an_option_added_after_the_checkpoint_at_its_default(dataset, tmp_path, capsys):
    """A checkpoint saved before an option existed (its config lacks ``optim.fused``) resumes under a config that
    leaves the option at its default, and is refused, naming the key, when the option is set away from it or
    another key changed."""
    config = parse_config(tiny_config(dataset, train={**SHORT, "steps": 3}))
    out = tmp_path / "run"
    train(config, out, max_steps=2)
    checkpoint = ckpt.latest_checkpoint(out / "checkpoints")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["config"]["optim"]["fused"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(checkpoint)
    path = config_file(dataset, tmp_path, steps=3)
    for key, value in (("fused", True), ("lr", 0.123)):
        raw = yaml.safe_load(path.read_text())
        raw["optim"][key] = value
        changed = tmp_path / f"changed-{key}.yaml"
        changed.write_text(yaml.safe_dump(raw))
        assert main(["train", str(changed), "--out", str(out), "--resume", "--no-progress"]) == 2
        assert f"optim.{key} differ" in one_error_line(capsys)
    assert train(config, out, resume=True)["steps"] == 3


def test_total_tokens_count_every_stage():
    from linmem.io.run_info import total_tokens

    tokens = [int(t) for t in torch.randint(1, 10**6, (3,))]
    info = {"tokens": tokens[2], "init_from": {"tokens": tokens[1], "init_from": {"tokens": tokens[0]}}}
    assert total_tokens(info) == sum(tokens)
    assert total_tokens({"tokens": tokens[0]}) == tokens[0] and total_tokens({}) is None


# ---------------------------------------------------------------- 6. one-line errors


def test_os_errors_are_one_line_with_a_nonzero_exit(dataset, tmp_path, capsys):
    path = config_file(dataset, tmp_path)
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main(["train", str(path), "--out", str(blocker / "sub"), "--no-progress"]) != 0
    assert "file.txt" in one_error_line(capsys)
    if os.geteuid() != 0:  # root writes into read-only folders
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            assert main(["train", str(path), "--out", str(locked / "run"), "--no-progress"]) == 1
            assert "Permission denied" in one_error_line(capsys)
        finally:
            locked.chmod(0o700)
    with pytest.raises(OSError):  # --debug: the traceback instead
        main(["--debug", "train", str(path), "--out", str(blocker / "sub"), "--no-progress"])


def test_interrupt_is_one_line(tmp_path, capsys, monkeypatch):
    from linmem.data import commands

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "run_info", interrupted)
    assert main(["data", "info", str(tmp_path)]) == 130
    assert "interrupted" in one_error_line(capsys)
