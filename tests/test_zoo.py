"""The model zoo: a tiny RDN trained here on the CPU is evaluated and shipped into a temporary zoo by
``linmem.zoo.ship``; its folder loads back (bfloat16 weights, logits of the float32 run within bfloat16 rounding),
its model card, ``eval.json`` and the docs page hold the measured numbers, and the size limit is enforced. Every
model really shipped in the package loads with finite logits (skipped while none is shipped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from linmem import zoo
from linmem.cli import main
from linmem.eval.loading import load_model, open_heldout
from linmem.eval.runner import EvalOptions
from linmem.io.manifest import write_manifest
from linmem.models import LinMemForCausalLM
from linmem.train.config import parse_config
from linmem.train.trainer import train
from linmem.zoo import cards
from linmem.zoo import ship as shipping
from tests.test_train_support import build_tiny_dataset, tiny_config  # noqa: F401

NAME = "tiny-rdn"
STEPS = 12
SEQ_LEN = 128  # the kv-filler facts need about 90 tokens
# Every task, at sizes a tiny model gets through in seconds.
TINY_EVAL = EvalOptions(split="test", batch_size=8, max_tokens=256, cloze_examples=4, mqar_pairs=(2, 4),
                        mqar_samples=4, niah_lengths=(64,), niah_depths=(0.0, 1.0), niah_samples=2,
                        stability_windows=2, recall_items=8, recall_filler=32, seed=0, device="cpu")


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """``(root, record)``: a tiny RDN run (float32 weights) shipped into ``root/zoo`` with docs in ``root/docs``."""
    root = tmp_path_factory.mktemp("zoo")
    data = build_tiny_dataset(root)
    recall = [{"name": "mqar", "num_kv_pairs": 4}, {"name": "kv-filler", "num_bindings": 2}]
    config = tiny_config(data, name=NAME, model={"mixer": "rdn"}, data={"seq_len": SEQ_LEN, "recall": recall},
                         train={"steps": STEPS, "eval_interval": 6, "checkpoint_interval": 0})
    train(parse_config(config), root / "run")
    records = shipping.ship([root / "run"], [NAME], zoo_dir=root / "zoo", docs=root / "docs" / "zoo.md",
                            options=TINY_EVAL, progress=False)
    return root, records[0]


def test_names_path_and_unknown_name(shipped, monkeypatch):
    root, _ = shipped
    assert zoo.names(root / "zoo") == [NAME]  # the held-out folder is not a model
    assert zoo.path(NAME, root / "zoo") == root / "zoo" / NAME
    with pytest.raises(zoo.UnknownModelError, match=f"no zoo model named 'rnd'; available: {NAME}"):
        zoo.load("rnd", root_dir=root / "zoo")
    monkeypatch.setenv(zoo.ENV_VAR, str(root / "zoo"))
    assert zoo.names() == [NAME] and zoo.root() == root / "zoo"
    with pytest.raises(zoo.UnknownModelError, match="available: none"):
        zoo.path("rdn", root / "empty")
    assert zoo.order(["rdn-no-clip", "transformer", "aaa", "sgla", "rdn"]) == [
        "sgla", "rdn", "transformer", "aaa", "rdn-no-clip"]


def test_load_round_trips_bf16_weights(shipped):
    root, _ = shipped
    folder = zoo.path(NAME, root / "zoo")
    stored = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}
    model, tokenizer = zoo.load(NAME, root_dir=root / "zoo")
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    run = LinMemForCausalLM.from_pretrained(str(root / "run" / "model"), dtype=torch.float32).eval()
    run_state = run.state_dict()
    assert next(iter(load_file(str(root / "run" / "model" / "model.safetensors")).values())).dtype == torch.float32
    for key, value in model.state_dict().items():  # each weight is the float32 one rounded to bfloat16
        assert torch.equal(value, run_state[key].to(torch.bfloat16).float()), key
    ids = torch.tensor([tokenizer("Alice saw a red fox near the old stone tower.")["input_ids"]])
    with torch.no_grad():
        shipped_logits, run_logits = model(ids).logits, run(ids).logits
    scale = run_logits.abs().max()
    assert (shipped_logits - run_logits).abs().max() < 0.02 * scale + 1e-3  # bfloat16 keeps 8 bits of mantissa
    assert (shipped_logits.argmax(-1) == run_logits.argmax(-1)).float().mean() > 0.9


def test_eval_json_and_model_card(shipped):
    root, record = shipped
    folder = zoo.path(NAME, root / "zoo")
    assert zoo.eval_record(NAME, root / "zoo") == record == json.loads((root / "run" / "zoo" / "eval.json").read_text())
    assert set(record["eval"]["tasks"]) == {"ppl", "cloze", "mqar", "niah", "recall", "stability"}
    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    t = record["training"]
    assert t["steps"] == STEPS and t["tokens"] == metrics[-1]["tokens"] == STEPS * 8 * SEQ_LEN
    assert t["final_loss"] == metrics[-1]["loss"] and t["val_loss"] == metrics[-1]["val_loss"]
    assert t["tokens_per_s"] > 0 and t["curve"]["step"][-1] == STEPS
    assert record["parameters"] == sum(p.numel() for p in zoo.load(NAME, root_dir=root / "zoo")[0].parameters())
    assert record["chance"]["recall"] == 0.25 and record["chance"]["ppl"] == record["model_config"]["vocab_size"]
    h = cards.headline(record["eval"]["tasks"])
    assert h["recall_n"] == TINY_EVAL.recall_items and set(h["mqar"]) == {2, 4} and set(h["niah"]) == {64}
    card = (folder / "README.md").read_text()
    for text in (f"# linmem zoo: `{NAME}`", "## Evaluation", "## Training data", f"configs/zoo/{NAME}.yaml",
                 f"linmem.zoo.load('{NAME}')", "PSF License", "public domain", f"| updates | {STEPS} |",
                 f"| perplexity | {cards.fmt(h['ppl'])} | {record['chance']['ppl']:,} (uniform) |",
                 f"| MQAR, 4 pairs ({SEQ_LEN} tokens) | accuracy | {cards.fmt(h['mqar'][4])} | 0.250 |",
                 f"| memory-lab clean recall (4 candidates) | accuracy [95% CI] | {cards.recall_cell(h)} | 0.250 |"):
        assert text in card, text
    info = json.loads((folder / "train_info.json").read_text())
    assert info["dataset"].startswith("../_heldout/") and info["trained_on"] == str((root / "data").resolve())


def test_shipped_folder_evaluates_without_a_dataset(shipped, tmp_path):
    """``train_info.json`` points at the held-out text shipped beside the model (relative to the folder)."""
    root, record = shipped
    em = load_model(zoo.path(NAME, root / "zoo"), "cpu")
    split = open_heldout(em, None, "test")
    assert split.num_tokens > 0 and split.folder.resolve() == zoo.heldout_dir(NAME, root / "zoo")
    assert main(["eval", str(zoo.path(NAME, root / "zoo")), "--tasks", "ppl", "--max-tokens", "256",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    measured = json.loads((tmp_path / "results.json").read_text())["tasks"]["ppl"]["metrics"]
    assert measured["ppl"] == pytest.approx(record["eval"]["tasks"]["ppl"]["metrics"]["ppl"], rel=1e-6)


def test_remeasure_replaces_one_task_of_a_shipped_record(shipped, tmp_path):
    """``linmem zoo remeasure`` runs a task again with the record's own settings on the shipped held-out text,
    replaces only that task, notes why, re-renders the card; it refuses changed weights and a missing reason."""
    import shutil

    root, _ = shipped
    zoo_dir = shutil.copytree(root / "zoo", tmp_path / "zoo")
    folder = zoo.path(NAME, zoo_dir)
    record = json.loads((folder / "eval.json").read_text())
    old = record["eval"]["tasks"]["cloze"]
    old["metrics"].pop("eos_before_context")  # as recorded before the cloze protocol changed
    old["metrics"]["accuracy"] = -1.0
    (folder / "eval.json").write_text(json.dumps(record))
    write_manifest(folder)  # the edited record is the folder's content now
    assert cards.cloze_cell(record).endswith(" *")
    assert main(["zoo", "remeasure", NAME, "--tasks", "cloze", "--why", "a test", "--zoo-dir", str(zoo_dir)]) == 0
    new = json.loads((folder / "eval.json").read_text())
    cloze = new["eval"]["tasks"]["cloze"]
    assert cloze["metrics"]["eos_before_context"] is False and 0 <= cloze["metrics"]["accuracy"] <= 1
    assert cloze["metrics"]["examples"] == TINY_EVAL.cloze_examples and not cards.cloze_cell(new).endswith("*")
    assert new["eval"]["remeasured"]["cloze"]["why"] == "a test"
    assert {k: v for k, v in new["eval"]["tasks"].items() if k != "cloze"} == \
        {k: v for k, v in record["eval"]["tasks"].items() if k != "cloze"}
    assert "`cloze` was measured again (" in (folder / "README.md").read_text()
    with pytest.raises(ValueError, match="why"):
        shipping.remeasure([NAME], ["cloze"], " ", zoo_dir=zoo_dir)
    with pytest.raises(ValueError, match="unknown task"):
        shipping.remeasure([NAME], ["lambada"], "x", zoo_dir=zoo_dir)
    weights = load_file(folder / "model.safetensors")
    next(iter(weights.values())).add_(1)
    from safetensors.torch import save_file

    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not the file"):
        shipping.remeasure([NAME], ["cloze"], "x", zoo_dir=zoo_dir)


def test_remeasure_on_the_recorded_device_reproduces_the_record(shipped, tmp_path, capsys):
    """With the default device ("recorded") an unchanged protocol gives the shipped numbers again, exactly; the
    device a record names is used where present, CPU (said) where a recorded GPU is absent."""
    import shutil

    root, _ = shipped
    zoo_dir = shutil.copytree(root / "zoo", tmp_path / "zoo")
    folder = zoo.path(NAME, zoo_dir)
    before = json.loads((folder / "eval.json").read_text())
    tasks = ["ppl", "mqar", "recall"]
    assert main(["zoo", "remeasure", NAME, "--tasks", ",".join(tasks), "--why", "check", "--zoo-dir",
                 str(zoo_dir)]) == 0
    after = json.loads((folder / "eval.json").read_text())
    for task in tasks:
        old, new = dict(before["eval"]["tasks"][task]), dict(after["eval"]["tasks"][task])
        old.pop("seconds", None), new.pop("seconds", None)
        assert new == old, task
        assert after["eval"]["remeasured"][task]["device"] == before["eval"]["request"]["options"]["device"]
    record = {"name": "m", "eval": {"request": {"options": {"device": "cpu"}},
                                    "remeasured": {"cloze": {"device": "cuda"}}}}
    assert shipping.recorded_device(record, "ppl") == "cpu"
    if not torch.cuda.is_available():
        assert shipping.recorded_device(record, "cloze") == "cpu"
        assert "no GPU here" in capsys.readouterr().out


def test_docs_table(shipped):
    root, record = shipped
    page = (root / "docs" / "zoo.md").read_text()
    h = cards.headline(record["eval"]["tasks"])
    row = next(line for line in page.splitlines() if line.startswith(f"| `{NAME}` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in page.splitlines() if line.startswith("| model |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(columns)
    values = dict(zip(columns, cells))
    assert values["kind"] == "ablation, shipped" and values["test ppl"] == cards.fmt(h["ppl"], 2)
    assert values["MQAR 4"] == cards.fmt(h["mqar"][4]) and values["recall [95% CI]"] == cards.recall_cell(h)
    assert values["tokens"] == f"{STEPS * 8 * SEQ_LEN:,}" and values["params"] == cards.millions(record["parameters"])
    chance = next(line for line in page.splitlines() if line.startswith("| chance |"))
    assert "0.500" in chance and "0.25" in chance  # MQAR with 2 pairs, memory-lab recall
    assert values["updates"] == f"{STEPS:,}" and len(chance.strip("|").split("|")) == len(columns)
    assert (root / "docs" / "zoo" / "loss.png").stat().st_size > 1000
    assert "![Training and validation loss](zoo/loss.png)" in page and "## Needle in a haystack per depth" in page


def test_updates_cell_marks_a_run_stopped_early():
    assert cards.updates_cell({"steps": 2000, "scheduled_steps": 2000}) == "2,000"
    assert cards.updates_cell({"steps": 1019, "scheduled_steps": 2000}) == "1,019 of 2,000 (stopped early)"


def test_cells_of_a_later_stage_count_the_earlier_ones():
    stage2 = {"steps": 1000, "scheduled_steps": 1000, "tokens": 16_384_000,
              "earlier_stages": [{"source": "zoo:gdn", "name": "gdn", "steps": 3000, "tokens": 49_152_000}]}
    assert cards.updates_cell(stage2) == "1,000 after 3,000 (zoo:gdn)"
    assert cards.tokens_cell(stage2) == "16.38M; 65.54M in all"
    assert cards.total_tokens(stage2) == 65_536_000
    unknown = dict(stage2, earlier_stages=[{"source": "elsewhere/model"}])
    assert cards.total_tokens(unknown) is None and cards.tokens_cell(unknown) == "16.38M; earlier stages unknown"
    assert cards.tokens_cell({"tokens": 16_384_000}) == "16.38M"
    assert cards.updates_cell({"steps": 7}) == "7"  # records written before scheduled_steps existed


def test_size_limit_and_reused_eval(shipped, monkeypatch):
    root, record = shipped
    assert zoo.folder_bytes(zoo.path(NAME, root / "zoo")) <= zoo.SIZE_LIMIT
    run = shipping.read_run(root / "run")
    again = shipping.evaluate_run(run, TINY_EVAL, progress=False)  # same weights and options: not re-run
    assert again == record
    monkeypatch.setattr(shipping, "SIZE_LIMIT", 100_000)
    with pytest.raises(ValueError, match=r"over the zoo's limit of 0.1 MB"):
        shipping.ship_model(run, record, root / "zoo", "card")
    assert zoo.names(root / "zoo") == [NAME] and not list((root / "zoo").glob(".tmp-*"))


def test_cli_list_and_ship_errors(shipped, capsys):
    root, _ = shipped
    assert main(["zoo", "list", "--zoo-dir", str(root / "zoo")]) == 0
    assert NAME in capsys.readouterr().out
    assert main(["zoo", "ship", str(root / "run"), "--ship", "rdn", "--zoo-dir", str(root / "zoo")]) == 2
    assert "--ship names rdn but no run folder given has that name; runs: tiny-rdn" in capsys.readouterr().err
    assert main(["zoo", "ship", str(root / "data")]) == 2
    assert "not a finished training run" in capsys.readouterr().err


def test_package_data_covers_a_shipped_folder(shipped):
    """pyproject's package-data globs (relative to linmem/zoo) match every file ``ship`` writes."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    root, _ = shipped
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["linmem.zoo"]
    assert all(p.startswith("models/") for p in patterns)
    matched = {p for pattern in patterns for p in (root / "zoo").glob(pattern.removeprefix("models/")) if p.is_file()}
    files = {p for p in (root / "zoo").rglob("*") if p.is_file()}
    assert len(files) > 8 and matched == files


@pytest.mark.parametrize("name", zoo.names(zoo.PACKAGE_DIR) or [None])
def test_shipped_package_models_load(name):
    if name is None:
        pytest.skip("no model is shipped in linmem/zoo/models yet")
    model, tokenizer = zoo.load(name, root_dir=zoo.PACKAGE_DIR)
    ids = torch.tensor([tokenizer("def main():\n    print('hello')\n")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == model.config.vocab_size
    assert zoo.folder_bytes(zoo.path(name, zoo.PACKAGE_DIR)) <= zoo.SIZE_LIMIT
    record = zoo.eval_record(name, zoo.PACKAGE_DIR)
    assert record["name"] == name and set(record["eval"]["tasks"]) >= {"ppl", "mqar", "niah", "recall"}
