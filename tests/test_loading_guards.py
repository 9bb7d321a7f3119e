"""A model folder loads as what it is, and bad input is one line.

Every linmem weights file records the architecture it was saved as in its safetensors header
(``linmem.models.loading.weights_metadata``); the loader checks ``config.json`` against it, and the header's tensor
shapes against the model the config describes, before anything is allocated. Shipped models saved before the header
record are checked against their ``eval.json``, which names the weights by SHA-256. Each broken folder is fed to
``linmem eval`` (or the loader) and must give exit code 2 and one line on stderr.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import linmem.zoo
from linmem.cli import error_line, main
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.loading import ARCHITECTURE_KEY, load_weights, open_model, save_weights
from linmem.train.checkpoint import write_model

ZOO_MODEL = "rla"


def tiny_config(**changes) -> LinMemConfig:
    fields = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_heads=2, head_dim=4, hidden_ratio=2,
                  mixer="rdn")
    return LinMemConfig(**{**fields, **changes})


def save_recorded(folder: Path, **changes) -> Path:
    """A tiny random model written the way linmem writes its folders (``write_model``)."""
    config = tiny_config(**changes)
    torch.manual_seed(0)
    folder.mkdir(parents=True)
    write_model(folder, LinMemForCausalLM(config).state_dict(), config)
    return folder


def save_unrecorded(folder: Path) -> Path:
    """A tiny folder from transformers' ``save_pretrained``, whose header records no architecture."""
    torch.manual_seed(0)
    LinMemForCausalLM(tiny_config()).save_pretrained(folder)
    return folder


def zoo_copy(folder: Path) -> Path:
    """The shipped model's files without its manifest (as a user's copy of them might be)."""
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "eval.json"):
        shutil.copy(linmem.zoo.path(ZOO_MODEL) / name, folder / name)
    return folder


def edit_config(folder: Path, drop: tuple[str, ...] = (), **changes) -> None:
    """Set (or ``drop``) fields of ``folder``'s ``config.json``; ``"attention.rope_theta"`` names a sub-config's
    field."""
    config = json.loads((folder / "config.json").read_text())
    config = {key: value for key, value in config.items() if key not in drop}
    for key, value in changes.items():
        table, _, field = key.rpartition(".")
        (config.setdefault(table, {}) if table else config)[field] = value
    (folder / "config.json").write_text(json.dumps(config))


def eval_error(folder: Path, tmp_path: Path, capsys) -> str:
    """``linmem eval FOLDER``'s one line on stderr (asserting exit code 2 and a single line)."""
    capsys.readouterr()  # what setting the folder up printed
    code = main(["eval", str(folder), "--tasks", "mqar", "--out", str(tmp_path / "report"), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_rla_weights_under_a_config_without_mixer_are_refused(tmp_path):
    """Without ``mixer`` the config means RDN; the zoo's eval.json, which names these weights by hash, says RLA."""
    folder = zoo_copy(tmp_path / "rla")
    edit_config(folder, drop=("mixer",))
    with pytest.raises(ValueError, match=r"mixer 'rla' in eval\.json .*'rdn' in config\.json"):
        load_weights(folder)


@pytest.mark.parametrize(("field", "saved", "edited"), [("mixer", "rdn", "rla"), ("residual_target", "clip", "tanh"),
                                                         ("gamma", "independent", "tied")])
def test_a_config_edited_away_from_the_recorded_architecture_is_refused(tmp_path, field, saved, edited):
    folder = save_recorded(tmp_path / "m")
    edit_config(folder, **{field: edited})
    with pytest.raises(ValueError, match=rf"{field} '{saved}' in the header of model\.safetensors, '{edited}' in "
                                         rf"config\.json"):
        load_weights(folder)


def test_linmem_folders_record_their_architecture_and_load(tmp_path):
    folder = save_recorded(tmp_path / "m", mixer="rla")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        record = json.loads(weights.metadata()[ARCHITECTURE_KEY])
    assert record["mixer"] == "rla" and "backend" not in record
    model, _ = load_weights(folder)
    assert model.config.mixer == "rla"
    for again in range(4):  # the same model gives the same bytes (the zoo reuses evaluations by SHA-256)
        same = save_recorded(tmp_path / f"again-{again}", mixer="rla")
        assert (same / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_folders_without_a_record_still_load(tmp_path):
    folder = save_unrecorded(tmp_path / "m")
    model, _ = load_weights(folder)
    assert model.config.mixer == "rdn"


def test_zoo_logits_are_those_of_a_plain_from_pretrained():
    model, _, folder = open_model(f"zoo:{ZOO_MODEL}")
    reference = LinMemForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.arange(2, 40).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_truncated_weights_file_is_one_line(tmp_path, capsys):
    folder = save_unrecorded(tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert "model.safetensors: not a complete safetensors file" in eval_error(folder, tmp_path, capsys)


def test_an_absurd_vocabulary_is_refused_before_anything_is_allocated(tmp_path, capsys):
    folder = save_unrecorded(tmp_path / "m")
    edit_config(folder, vocab_size=10**12)
    err = eval_error(folder, tmp_path, capsys)
    assert "model.embeddings.weight [64, 16] in the file, [1000000000000, 16] in config.json" in err


@pytest.mark.parametrize(("field", "value", "message"), [
    ("norm_eps", "abc", "norm_eps must be a finite number; got 'abc'"),
    ("scale", math.nan, "scale must be a finite number; got nan"),
    ("attention.rope_theta", math.inf, "attention.rope_theta must be a finite number; got inf"),
    ("attention.heads", 4, "attention has no field 'heads'; its fields: layers, num_heads"),
    ("fit_history", "yes", "fit_history must be true or false; got 'yes'"),
])
def test_a_bad_value_in_config_json_is_one_line_naming_the_file(tmp_path, capsys, field, value, message):
    folder = save_unrecorded(tmp_path / "m")
    edit_config(folder, **{field: value})
    err = eval_error(folder, tmp_path, capsys)
    assert f"config.json: {message}" in err


def test_a_linmem_config_over_fla_weights_is_one_line(tmp_path, capsys):
    models = pytest.importorskip("fla.models", exc_type=ImportError)
    folder = tmp_path / "fla"
    torch.manual_seed(0)
    models.GLAForCausalLM(models.GLAConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2)
                          ).save_pretrained(folder)
    shutil.copy(linmem.zoo.path(ZOO_MODEL) / "config.json", folder / "config.json")
    assert "the weights do not fit its config.json" in eval_error(folder, tmp_path, capsys)


def test_an_fla_conversion_records_its_architecture_with_the_tensors_unchanged(tmp_path):
    models = pytest.importorskip("fla.models", exc_type=ImportError)
    from linmem.models import convert_fla_checkpoint
    from linmem.models.fla_import import read_safetensors

    source, converted = tmp_path / "fla", tmp_path / "converted"
    torch.manual_seed(0)
    models.GatedDeltaNetForCausalLM(models.GatedDeltaNetConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1,
                                                               num_heads=2, head_dim=8)).save_pretrained(source)
    convert_fla_checkpoint(source, converted)
    with safe_open(str(converted / "model.safetensors"), framework="pt") as weights:
        assert json.loads(weights.metadata()[ARCHITECTURE_KEY])["mixer"] == "gdn"
    model, _ = load_weights(converted)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in read_safetensors(source).items())
    edit_config(converted, mixer="rdn")
    with pytest.raises(ValueError, match=r"mixer 'gdn' in the header of model\.safetensors, 'rdn' in config\.json"):
        load_weights(converted)


def test_a_weights_write_cut_short_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    import linmem.models.loading as loading

    real_save = loading.save_file

    def disk_full(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        Path(path).write_bytes(Path(path).read_bytes()[:-10])

    monkeypatch.setattr(loading, "save_file", disk_full)
    path = tmp_path / "model.safetensors"
    with pytest.raises(OSError) as error:
        save_weights({"w": torch.zeros(8)}, path, tiny_config())
    line = error_line(error.value)
    assert line.startswith(f"error: {path}: the weights could not be written completely") and "\n" not in line


def test_a_recall_module_that_does_not_exist_is_a_value_error_naming_the_entry():
    from linmem.train.data import resolve_generator

    with pytest.raises(ValueError, match=r"^config\.yaml: data\.recall\[0\]: No module named 'linmem_no_such_mod'"):
        resolve_generator({"name": "mqar", "module": "linmem_no_such_mod"}, 0, None, "config.yaml")
