"""scripts/recall/transfer.py on a shipped model: --save writes a folder linmem loads, with the fine-tune's weights,
its options and the tokens it saw; --seed decides the weights; --facts-first holds the text back; a folder of the
user's files is refused before any update."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from linmem.data.build import BuildOptions, build_dataset
from linmem.data.sources import open_path
from linmem.data.splits import SplitFractions
from linmem.data.tokenizer import tokenizer_hash
from linmem.eval.loading import load_model
from linmem.io.run_info import read_train_info
from tests.test_train_support import write_corpus  # noqa: F401  (fixture)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "recall" / "transfer.py"
BATCH, STEPS, WINDOW = 2, 3, 24


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("transfer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("plot_transfer", SCRIPT.with_name("plot_transfer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A dataset of the tiny corpus in the shipped models' tokenizer (their training text is not shipped)."""
    root = tmp_path_factory.mktemp("transfer")
    out = root / "data"
    build_dataset([open_path(write_corpus(root / "corpus"))], out,
                  BuildOptions(tokenizer="zoo:gdn", progress=False, fractions=SplitFractions(0.8, 0.1, 0.1)))
    return out


def run(script, monkeypatch, capsys, data: Path, *options: str) -> list[dict]:
    """The script's main() on the CPU with ``options``; held-out recall is not measured (linmem's memory_recall,
    tested on its own, would take most of the time); returns its records."""
    monkeypatch.setattr(script, "held_out_recall", lambda *args: {})
    monkeypatch.setattr(sys, "argv", ["transfer.py", "ids-lm", "--model", "zoo:gdn", "--data", str(data),
                                      "--steps", str(STEPS), "--every", "1", "--batch", str(BATCH),
                                      "--text-tokens", "0", "--text-window", str(WINDOW), "--device", "cpu",
                                      *options])
    script.main()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_save_writes_the_fine_tuned_model_and_seed_decides_it(script, data, tmp_path, monkeypatch, capsys):
    (tmp_path / ".tmp-a").mkdir()  # the leftover of an interrupted save
    (tmp_path / ".tmp-a" / "model.safetensors").write_text("partial")
    records = run(script, monkeypatch, capsys, data, "--facts-first", "1", "--seed", "3", "--save",
                  str(tmp_path / "a"))
    assert not (tmp_path / ".tmp-a").exists()
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert {(r["seed"], r["facts_first"], r["lr"], r["batch"]) for r in records} == {(3, 1, 3e-4, BATCH)}
    run(script, monkeypatch, capsys, data, "--facts-first", "1", "--seed", "3", "--save", str(tmp_path / "b"))
    run(script, monkeypatch, capsys, data, "--facts-first", "1", "--seed", "4", "--save", str(tmp_path / "c"))

    em = load_model(tmp_path / "a", device="cpu")
    shipped = load_model("zoo:gdn", device="cpu")
    saved = {name: load_file(str(tmp_path / name / "model.safetensors")) for name in "abc"}
    changed = [k for k, v in saved["a"].items() if not torch.equal(v, shipped.model.state_dict()[k].bfloat16())]
    assert changed, "the saved weights are the shipped model's: the fine-tune was not saved"
    assert all(torch.equal(saved["a"][k], saved["b"][k]) for k in saved["a"]), "one seed, two fine-tunes"
    assert any(not torch.equal(saved["a"][k], saved["c"][k]) for k in saved["a"]), "--seed changed nothing"
    assert all(v.dtype == torch.bfloat16 for v in saved["a"].values() if v.is_floating_point())
    assert tokenizer_hash(em.tokenizer) == tokenizer_hash(shipped.tokenizer)

    info = read_train_info(tmp_path / "a")
    fact_inputs = 159  # the fact samples' 160 tokens less the last
    # update 1 on the facts alone (--facts-first 1), updates 2 and 3 on facts and text windows of WINDOW inputs
    assert info["tokens"] == BATCH * (STEPS * fact_inputs + (STEPS - 1) * WINDOW)
    assert info["steps"] == STEPS and info["transfer"]["seed"] == 3 and info["transfer"]["seconds"] is None
    assert info["init_from"]["source"] == "zoo:gdn" and info["init_from"]["init_from"]["source"] == "zoo:gdn"
    assert (tmp_path / "a" / info["dataset"]).resolve() == data.resolve()
    assert info["transfer_updates"] == STEPS and "prior_updates" not in records[0]

    # the saved folder continues the fine-tune: its records count on from its updates, and so does its own save
    chained = run(script, monkeypatch, capsys, data, "--model", str(tmp_path / "a"), "--seed", "5", "--every", "2",
                  "--save", str(tmp_path / "d"))  # the later --model and --every win
    assert {r["prior_updates"] for r in chained} == {STEPS}
    assert [r["step"] for r in chained] == [0, 2, STEPS]  # the last update is measured off the --every grid too
    continued = read_train_info(tmp_path / "d")
    assert continued["transfer_updates"] == 2 * STEPS and continued["name"] == info["name"]
    assert continued["init_from"]["source"] == str(tmp_path / "a")


def test_save_refuses_a_folder_of_the_users_files_before_training(script, data, tmp_path, monkeypatch, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="did not write"):
        run(script, monkeypatch, capsys, data, "--save", str(tmp_path / "mine"))
    assert capsys.readouterr().out == ""  # refused before the first record
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_facts_first_is_refused_for_an_arm_without_text(script, data, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["transfer.py", "ids", "--facts-first", "2", "--data", str(data)])
    with pytest.raises(SystemExit):
        script.main()
    assert "--facts-first applies to" in capsys.readouterr().err


def test_plot_reads_a_chain_as_one_run_counting_on(plot, tmp_path):
    first, then = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({"arm": "ids-lm", "step": s, "phase": p}) + "\n"
                             for s, p in [(0, "start"), (5, "facts"), (7, "facts")]))
    then.write_text("progress line\n" + "".join(json.dumps({"arm": "ids-lm", "step": s, "phase": p, "prior_updates": 7})
                                                + "\n" for s, p in [(0, "start"), (5, "facts")]))
    records = plot.read_chain(f"{first}+{then}")
    assert [r["step"] for r in records] == [0, 5, 7, 12] and records[0]["chained"] == 2
    assert "2 fine-tunes chained" in plot.title(records[0])
    with pytest.raises(SystemExit, match="does not continue"):
        plot.read_chain(f"{then}+{first}")


def test_plot_names_each_panel_by_its_label(plot, tmp_path, monkeypatch):
    import matplotlib.axes

    logs = []
    for name in "ab":
        logs.append(tmp_path / f"{name}.jsonl")
        logs[-1].write_text("".join(json.dumps({"arm": "ids", "step": s, "phase": "facts",
                                                "went/roles/directions": [0.3, 0.4, 0.5]}) + "\n" for s in (0, 5)))
    titles = []
    original = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda ax, text, *a, **k: titles.append(text) or original(ax, text, *a, **k))
    monkeypatch.setattr(sys, "argv", ["plot_transfer.py", *map(str, logs), "--labels", "first", "second",
                                      "--out", str(tmp_path / "p.png")])
    plot.main()
    assert titles == ["first", "second"] and (tmp_path / "p.png").is_file()
    monkeypatch.setattr(sys, "argv", ["plot_transfer.py", *map(str, logs), "--labels", "one", "--out", "x.png"])
    with pytest.raises(SystemExit):
        plot.main()
