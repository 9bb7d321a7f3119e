"""``train.init_from``: a run starts from a saved model's weights; other architectures, other tokenizers and
folders that hold no model are refused with errors that name the difference; a resumed checkpoint wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import linmem.zoo
from linmem.train.config import parse_config
from linmem.train.distributed import Distributed
from linmem.train.init_from import earlier_stages, resolve_source
from linmem.train.trainer import setup, train, unwrap
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def source(dataset, tmp_path_factory) -> Path:
    """The model folder of a 3-update run (float32 weights)."""
    out = tmp_path_factory.mktemp("source")
    train(parse_config(tiny_config(dataset, train={"steps": 3})), out)
    return out / "model"


def staged(dataset, init_from, **model):
    return parse_config(tiny_config(dataset, train={"steps": 4, "init_from": str(init_from)},
                                    model={**tiny_config(dataset)["model"], **model}))


def test_the_run_starts_from_the_saved_weights(dataset, source, tmp_path):
    run = setup(staged(dataset, source), tmp_path / "a", Distributed(), "config")
    saved = load_file(str(source / "model.safetensors"))
    own = unwrap(run.model).state_dict()
    assert set(saved) <= set(own) and all(torch.equal(own[k], saved[k]) for k in saved)
    assert torch.equal(own["lm_head.weight"], saved["model.embeddings.weight"])  # tied, as saved
    fresh = setup(parse_config(tiny_config(dataset, train={"steps": 4})), tmp_path / "b", Distributed(), "config")
    assert not torch.equal(unwrap(fresh.model).state_dict()["model.embeddings.weight"],
                           saved["model.embeddings.weight"])


def test_a_staged_run_trains_and_records_its_source(dataset, source, tmp_path):
    info = train(staged(dataset, source), tmp_path / "run")
    assert info["steps"] == 4 and info["config"]["train"]["init_from"] == str(source)
    assert info["init_from"] == {"source": str(source), "name": "tiny", "steps": 3, "tokens": 3 * 8 * 32}
    third = train(staged(dataset, tmp_path / "run" / "model"), tmp_path / "third")  # a stage after that one
    assert earlier_stages(third["init_from"]) == [
        {"source": str(source), "name": "tiny", "steps": 3, "tokens": 768},
        {"source": str(tmp_path / "run" / "model"), "name": "tiny", "steps": 4, "tokens": 1024}]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    fresh = train(parse_config(tiny_config(dataset, train={"steps": 1})), tmp_path / "fresh")
    assert first["loss"] < fresh["final_metrics"]["loss"]  # trained weights start lower than random ones


def test_resume_wins_over_init_from(dataset, source, tmp_path):
    config = staged(dataset, source)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(config, whole)
    train(config, cut, max_steps=2)
    train(config, cut, resume=True)
    rows = [[json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (whole, cut)]
    assert rows[0] == rows[1]


def test_another_architecture_is_refused(dataset, source, tmp_path):
    with pytest.raises(ValueError, match=r"another architecture.*hidden_size: saved 32, run 48"):
        setup(staged(dataset, source, hidden_size=48), tmp_path, Distributed(), "config")
    with pytest.raises(ValueError, match=r"mixer: saved 'gdn', run 'rdn'"):
        setup(staged(dataset, source, mixer="rdn"), tmp_path, Distributed(), "config")


def test_another_tokenizer_is_refused(dataset, source, tmp_path):
    by_hash = tmp_path / "by_hash"
    shutil.copytree(source, by_hash)
    info = json.loads((by_hash / "train_info.json").read_text())
    info["tokenizer_hash"] = "0" * 64
    (by_hash / "train_info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"tokenizer \(hash 000000000000\) is not the dataset's"):
        setup(staged(dataset, by_hash), tmp_path / "a", Distributed(), "config")

    by_vocab = tmp_path / "by_vocab"  # no train_info.json: the tokenizer.json vocabularies are compared
    shutil.copytree(source, by_vocab)
    (by_vocab / "train_info.json").unlink()
    tok = json.loads((by_vocab / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (by_vocab / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="vocabulary is not the dataset's"):
        setup(staged(dataset, by_vocab), tmp_path / "b", Distributed(), "config")
    shutil.copy(source / "tokenizer.json", by_vocab / "tokenizer.json")  # the same tokenizer passes
    setup(staged(dataset, by_vocab), tmp_path / "c", Distributed(), "config")


def test_sources_that_hold_no_model(dataset, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train\.init_from .* is not a model folder \(config\.json and "
                                                r"model\.safetensors missing\)"):
        setup(staged(dataset, tmp_path / "nothing"), tmp_path, Distributed(), "config")
    with pytest.raises(FileNotFoundError, match=r"train\.init_from 'zoo:nope'.*available: "):
        resolve_source("zoo:nope")
    for name in linmem.zoo.names():
        assert resolve_source(f"zoo:{name}") == linmem.zoo.path(name)
