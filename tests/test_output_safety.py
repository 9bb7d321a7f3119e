"""Output folders lose nothing: ``--overwrite`` never replaces a file linmem did not write, no write follows a
symbolic link out of an output folder, a failed run leaves no folder behind (and a folder that existed keeps what
it had), and argument and path errors answer before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from linmem.cli import main
from linmem.io.atomic import write_json_atomic
from linmem.io.folders import MARKER, output_file, output_folder, prepare_output_folder

MQAR_REPORT = {"model": "m", "name": "m", "parameters": 1, "trained_tokens": 0,
               "tasks": {"mqar": {"metrics": {"accuracy": 0.5},
                                  "table": [{"pairs": 2, "accuracy": 0.5, "chance": 0.5},
                                            {"pairs": 4, "accuracy": 0.25, "chance": 0.25}]}}}


def users_folder(tmp_path: Path, **files: str) -> Path:
    """A folder of the user's files (``name=text``; ``_`` in a name stands for ``.``)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for name, text in files.items():
        (folder / name.replace("_", ".")).write_text(text)
    return folder


def model_folder(tmp_path: Path) -> Path:
    """A folder that names a model (it holds ``config.json``) but cannot be loaded."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def linked(folder: Path, name: str, tmp_path: Path) -> Path:
    """``folder / name`` as a link to a user's file outside the folder; returns the file."""
    target = tmp_path / f"target-{name}"
    target.write_text("the user's")
    (folder / name).symlink_to(target)
    return target


# ---------------------------------------------------------------- --overwrite keeps the user's files


@pytest.mark.parametrize("command", ["eval", "probe"])
def test_overwrite_refuses_before_any_work_to_replace_a_users_results(tmp_path, capsys, command):
    out = users_folder(tmp_path, results_json="my results", notes_txt="mine")
    args = [command, str(model_folder(tmp_path)), "--out", str(out), "--overwrite"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "results.json" in err and "not written by linmem" in err and "\n" not in err
    assert (out / "results.json").read_text() == "my results" and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "results.json"]


def test_eval_report_keeps_a_users_results_json(tmp_path):
    from linmem.eval.runner import write_report

    out = users_folder(tmp_path, results_json="my results")
    with pytest.raises(ValueError, match="results.json: was not written by linmem"):
        write_report(json.loads(json.dumps(MQAR_REPORT)), out)
    assert (out / "results.json").read_text() == "my results"
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]


def test_probe_report_keeps_a_users_results_json(tmp_path):
    from linmem.memory.report import write_report

    out = users_folder(tmp_path, results_json="my results")
    prepare_output_folder(out, overwrite=True, kind="probe")  # what --overwrite does
    with pytest.raises(ValueError, match="results.json: was not written by linmem"):
        write_report([], out, {"model": "m"})
    assert (out / "results.json").read_text() == "my results"


def test_linmems_own_files_are_replaced_and_listed_in_the_marker(tmp_path):
    from linmem.eval.runner import write_report

    out = users_folder(tmp_path, notes_txt="mine")
    for _ in range(2):  # the second report replaces the first one's files
        write_report(json.loads(json.dumps(MQAR_REPORT)), out)
    marker = json.loads((out / MARKER).read_text())
    assert marker["foreign"] == ["notes.txt"] and {"results.json", "results.md", "mqar.png"} <= set(marker["written"])
    assert (out / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- no write follows a link


@pytest.mark.parametrize("name", ["results.md", "mqar.png"])
def test_eval_report_does_not_write_through_a_link(tmp_path, name):
    from linmem.eval.runner import write_report

    out = tmp_path / "eval"
    prepare_output_folder(out, overwrite=False, kind="eval")
    target = linked(out, name, tmp_path)
    with pytest.raises(ValueError, match="symbolic link"):
        write_report(json.loads(json.dumps(MQAR_REPORT)), out)
    assert target.read_text() == "the user's" and (out / name).is_symlink()


def test_tokenizer_is_not_saved_through_a_link(tmp_path):
    from linmem.data.tokenizer import save_tokenizer, train_tokenizer, wrap_tokenizer

    out = tmp_path / "data"
    prepare_output_folder(out, overwrite=False, kind="data")
    target = linked(out, "tokenizer.json", tmp_path)
    with pytest.raises(ValueError, match="symbolic link"):
        save_tokenizer(wrap_tokenizer(train_tokenizer(["a small text to learn from"] * 4, vocab_size=300)), out)
    assert target.read_text() == "the user's"


def test_atomic_write_refuses_a_link(tmp_path):
    target = linked(tmp_path, "record.json", tmp_path)
    with pytest.raises(ValueError, match="symbolic link"):
        write_json_atomic(tmp_path / "record.json", {"a": 1})
    assert target.read_text() == "the user's"


def test_output_file_refuses_links_names_outside_and_folders(tmp_path):
    out = prepare_output_folder(tmp_path / "out", overwrite=False, kind="eval")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (out / "figures").symlink_to(outside)
    (out / "table").mkdir()
    for name, why in (("figures/a.png", "symbolic link"), ("../a.txt", "not a file name inside"),
                      ("table", "is a folder")):
        with pytest.raises(ValueError, match=why):
            output_file(out, name)
    assert not any(outside.iterdir())


# ---------------------------------------------------------------- a failed run leaves nothing behind


@pytest.mark.parametrize("command", ["eval", "probe"])
def test_a_failed_run_leaves_no_output_folder(tmp_path, capsys, command):
    out = tmp_path / "new" / "report"
    assert main([command, str(model_folder(tmp_path)), "--out", str(out), "--device", "cpu"]) != 0
    capsys.readouterr()
    assert not (tmp_path / "new").exists()


def test_a_failed_run_keeps_what_an_existing_folder_had(tmp_path):
    out = users_folder(tmp_path, notes_txt="mine")
    prepare_output_folder(out, overwrite=True, kind="eval")
    output_file(out, "results.json").write_text("earlier run")
    output_file(out, "results.md").write_text("earlier page")
    marker = (out / MARKER).read_text()
    with pytest.raises(RuntimeError), output_folder(out, overwrite=False, kind="eval"):
        output_file(out, "results.json").write_text("this run")
        output_file(out, "niah.png").write_text("this run")
        output_file(out, "results.md")  # named but not yet written when the run fails
        raise RuntimeError("the run fails")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "notes.txt", "results.md"])
    assert (out / "results.md").read_text() == "earlier page" and (out / MARKER).read_text() == marker


def test_a_failed_run_removes_the_folder_it_made_and_only_it(tmp_path):
    with pytest.raises(KeyboardInterrupt), output_folder(tmp_path / "a" / "b", overwrite=False, kind="eval") as out:
        output_file(out, "results.json").write_text("x")
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- errors before torch


def test_path_errors_answer_before_torch_is_imported(tmp_path):
    model, filler = model_folder(tmp_path), tmp_path / "filler.txt"
    for path in (tmp_path / "file", filler):
        path.write_text("some text " * 50)
    out = users_folder(tmp_path, results_json="mine")
    probe = ["--sources", str(filler)]  # a small filler text: the built-in ones take seconds to open
    cases = [["eval", str(tmp_path / "absent")], ["probe", str(tmp_path / "absent"), "--out", str(tmp_path / "p")],
             ["eval", "zoo:no-such-model", "--out", str(tmp_path / "e")],
             ["probe", "zoo:no-such-model", "--out", str(tmp_path / "p"), *probe],
             ["eval", str(model), "--out", str(tmp_path / "file")],
             ["probe", str(model), "--out", str(tmp_path / "file"), *probe],
             ["eval", str(model), "--out", str(out)], ["probe", str(model), "--out", str(out), *probe],
             ["demo", "--out", str(tmp_path / "file")]]
    script = ("import json, sys\nsys.argv[0] = 'linmem'  # as the console command starts\n"
              "from linmem.cli import main\n"
              "print(json.dumps([[main(args), 'torch' in sys.modules] for args in json.loads(sys.argv[1])]))\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          env={**os.environ, "LINMEM_DEBUG": ""}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[2, False]] * len(cases), done.stderr
    assert not (tmp_path / "p").exists() and not (tmp_path / "e").exists()
