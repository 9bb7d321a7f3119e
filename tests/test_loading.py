"""The one model loader (``linmem.models.loading``) behind every command that takes a model: offline, strict,
verified.

Each loader a user reaches (``open_model``, ``linmem.eval.load_model``, the probe's ``load_model_dir``,
``linmem.zoo.load``) is run on real folders: a tiny model saved with ``save_pretrained``, then broken in one way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

import linmem.zoo
from linmem.eval.loading import load_model
from linmem.io.manifest import DamagedFileError, write_manifest
from linmem.io.models import default_output_folder
from linmem.memory.probe import load_model_dir
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.loading import MODEL_TYPE_LOADERS, open_model

ZOO_MODEL = "rla"


def save_tiny(folder: Path, layers: int = 2) -> Path:
    """A tiny random RDN model folder with the zoo's tokenizer beside it."""
    config = LinMemConfig(vocab_size=300, hidden_size=16, num_hidden_layers=layers, num_heads=2, head_dim=4,
                          hidden_ratio=2, mixer="rdn")
    LinMemForCausalLM(config).save_pretrained(folder)
    shutil.copy(linmem.zoo.path(ZOO_MODEL) / "tokenizer.json", folder / "tokenizer.json")
    return folder


def zoo_load(folder: Path):
    """``linmem.zoo.load`` on ``folder`` as a one-model zoo."""
    zoo = folder.parent / "zoo"
    zoo.mkdir(exist_ok=True)
    shutil.copytree(folder, zoo / "tiny", dirs_exist_ok=True)
    return linmem.zoo.load("tiny", root_dir=zoo)


LOADERS = {
    "open_model": lambda p: open_model(p),
    "eval.load_model": lambda p: load_model(p, device="cpu"),
    "probe.load_model_dir": lambda p: load_model_dir(p, device="cpu"),
    "zoo.load": zoo_load,
}


@pytest.fixture(params=list(LOADERS))
def loader(request):
    return LOADERS[request.param]


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_a_tiny_folder_loads_with_every_weight(tmp_path, loader):
    folder = save_tiny(tmp_path / "m")
    loaded = loader(folder)
    model = loaded.model if hasattr(loaded, "model") else loaded[0]
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())
    assert not model.training


def test_more_layers_in_the_config_than_in_the_weights_is_refused(tmp_path, loader):
    folder = save_tiny(tmp_path / "m")
    edit_config(folder, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"do not fit its config.json \(missing \d+ weight\(s\): model\.layers\.2\."):
        loader(folder)


def test_fewer_layers_in_the_config_than_in_the_weights_is_refused(tmp_path, loader):
    folder = save_tiny(tmp_path / "m")
    edit_config(folder, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"unexpected \d+ weight\(s\): model\.layers\.1\."):
        loader(folder)


def test_weights_of_another_shape_are_refused(tmp_path, loader):
    folder = save_tiny(tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(17)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 weight\(s\) of another shape: model\.norm\.weight"):
        loader(folder)


def test_a_foreign_model_type_is_refused_by_name(tmp_path, loader):
    folder = save_tiny(tmp_path / "m")
    edit_config(folder, model_type="bert")
    with pytest.raises(ValueError, match=r"model type 'bert' is not supported; linmem loads .*linmem"):
        loader(folder)
    assert {"linmem", "gla", "gated_deltanet"} <= set(MODEL_TYPE_LOADERS)


def test_pickled_weights_are_never_read(tmp_path, loader):
    """A folder with only ``pytorch_model.bin`` is refused: loading reads safetensors only (the zoo does not even
    list such a folder as a model)."""
    folder = save_tiny(tmp_path / "m")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises((ValueError, OSError), match="safetensors|no zoo model named 'tiny'"):
        loader(folder)


def test_a_damaged_file_is_named_when_a_manifest_exists(tmp_path, loader):
    folder = save_tiny(tmp_path / "m")
    write_manifest(folder)
    loader(folder)  # intact: loads
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match=r"model\.safetensors: damaged"):
        loader(folder)


@pytest.mark.parametrize("name", ["open_model", "eval.load_model", "probe.load_model_dir"])
def test_a_missing_folder_is_one_line_and_never_reaches_the_hub(tmp_path, name, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError(f"from_pretrained called with {args}")

    monkeypatch.setattr(LinMemForCausalLM, "from_pretrained", no_hub)
    # a name shaped like a Hub id is looked up in the (empty) Hugging Face cache only, offline
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for spec, said in ((tmp_path / "nope", r"^not a model folder: .*no such folder"),
                       ("runs/nope", r"^runs/nope: no such folder, and runs/nope is not in the Hugging Face cache"),
                       ("someone/some-model", r"^someone/some-model: no such folder, and .* not in the Hugging Face")):
        with pytest.raises(ValueError, match=said) as error:
            LOADERS[name](spec)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"no zoo model named 'nope'; available: .*rla"):
        LOADERS[name]("zoo:nope")


def test_probe_cli_on_a_missing_folder_is_one_line(tmp_path, capsys):
    from linmem.cli import main

    assert main(["probe", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a model folder" in err and len(err.splitlines()) == 1


def test_probe_of_a_shipped_model_needs_an_output_folder_outside_the_package(capsys):
    from linmem.cli import main

    folder = linmem.zoo.path(ZOO_MODEL)
    assert main(["probe", f"zoo:{ZOO_MODEL}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out" in err and len(err.splitlines()) == 1
    assert not (folder / "probe").exists()


def test_run_folders_stand_for_their_model(tmp_path):
    run = tmp_path / "run"
    save_tiny(run / "model")
    assert open_model(run)[2] == run / "model"


@pytest.mark.parametrize("name", ["eval.load_model", "probe.load_model_dir"])
def test_zoo_names_load_in_every_command(name):
    loaded = LOADERS[name](f"zoo:{ZOO_MODEL}")
    model = loaded.model if hasattr(loaded, "model") else loaded[0]
    reference, _ = linmem.zoo.load(ZOO_MODEL)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_zoo_is_an_attribute_after_import_linmem():
    """The README's ``linmem.zoo.load("rdn")`` after a plain ``import linmem``, in a fresh interpreter."""
    code = "import linmem; model, tokenizer = linmem.zoo.load('rdn'); print(type(model).__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "LinMemForCausalLM"


def test_eval_never_writes_its_default_report_into_the_package(tmp_path):
    from linmem.eval.runner import EvalOptions, evaluate

    inside = linmem.zoo.path(ZOO_MODEL)
    with pytest.raises(ValueError, match="inside the installed linmem package.*--out"):
        default_output_folder(inside, "eval")
    before = sorted(p.name for p in inside.iterdir())
    for spec in (f"zoo:{ZOO_MODEL}", inside):
        with pytest.raises(ValueError, match="--out DIR"):
            evaluate(spec, ["mqar"], EvalOptions(device="cpu"), progress=False)
    assert sorted(p.name for p in inside.iterdir()) == before
    outside = save_tiny(tmp_path / "m")
    assert default_output_folder(outside, "eval") == outside / "eval"


def test_loading_prints_no_tensor_parallel_warning(caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        open_model(f"zoo:{ZOO_MODEL}")
    assert not [r for r in caplog.records if "not sharded" in r.getMessage()]
