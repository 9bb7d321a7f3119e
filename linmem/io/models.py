"""Which model folder a command means: ``linmem eval``, ``linmem probe``, ``linmem demo``, ``train.init_from`` and
``linmem.models.loading`` (the one strict loader) all resolve their model argument here.

A model is named by a folder, ``zoo:NAME`` (a model shipped in ``linmem.zoo``) or a Hugging Face Hub id
``ORG/NAME[@REVISION]``. A folder is a model folder (``config.json`` + safetensors weights: a run's ``OUT/model``, a
checkpoint, a ``save_pretrained`` folder, an FLA checkpoint), or a run folder, which stands for its ``model/`` or else
its newest checkpoint. An existing file or folder always wins over a Hub id of the same spelling; only a Hub id
touches the network (``linmem.io.hub``: fetched into the Hugging Face cache, config checked before the weights), so a
name that is neither an existing folder, a shipped model nor a Hub id is refused at once, and only folders reach
``from_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from linmem.io import zoo_dir
from linmem.io.checkpoints import latest_checkpoint
from linmem.io.hub import ConfigCheck, parse_hub_name, resolve_hub_model
from linmem.io.zoo_dir import ZOO_PREFIX

if TYPE_CHECKING:
    import torch  # imported where a device is picked, so that resolving a path answers without torch

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the installed ``linmem`` package


def pick_device(name: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; any other name as ``torch.device``."""
    import torch

    if isinstance(name, str) and name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_model_folder(spec: str | os.PathLike, check_hub_config: ConfigCheck | None = None) -> Path:
    """The model folder ``spec`` names: ``zoo:NAME``'s shipped folder, ``spec`` itself when it holds
    ``config.json``, else a run folder's ``model/`` or newest checkpoint, else (no such file or folder) the Hugging
    Face cache's snapshot of the Hub id ``ORG/NAME[@REVISION]``, its config passed to ``check_hub_config``
    (``linmem.models.loading.check_hub_config``) before the weights are fetched; without that check a Hub id is
    refused. ``ValueError`` (one line) otherwise."""
    text = os.fspath(spec)
    if text.startswith(ZOO_PREFIX):
        return zoo_dir.path(text[len(ZOO_PREFIX):])  # UnknownModelError (a ValueError) lists the shipped ones
    hub_name = named_hub_model(text)
    if hub_name is not None:
        return hub_folder(text, hub_name, check_hub_config)
    path = Path(text)
    if not path.is_dir():
        why = "not a folder" if path.exists() else "no such folder"
        raise ValueError(f"not a model folder: {path} ({why}; give a model or run folder, zoo:NAME or a Hugging Face "
                         f"model id ORG/NAME)")
    if (path / "config.json").is_file():
        return path
    if (path / "model" / "config.json").is_file():
        return path / "model"
    newest = latest_checkpoint(path / "checkpoints")
    if newest is not None:
        return newest
    raise ValueError(f"not a model folder: {path} (no config.json, no model/ or checkpoints/ inside)")


def named_hub_model(spec: str | os.PathLike) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` is a Hub id ``ORG/NAME[@REVISION]`` and no file or folder of that name
    exists (a local path always wins), else None."""
    return None if Path(spec).exists() else parse_hub_name(os.fspath(spec))


def local_or_hub_folder(spec: str | os.PathLike, check_hub_config: ConfigCheck) -> Path:
    """``spec`` as a path, or for a Hub id (``named_hub_model``) the Hugging Face cache's snapshot of that model,
    config checked by ``check_hub_config`` and files fetched (``linmem.io.hub.resolve_hub_model``)."""
    hub_name = named_hub_model(spec)
    return Path(spec) if hub_name is None else hub_folder(os.fspath(spec), hub_name, check_hub_config)


def hub_folder(text: str, hub_name: tuple[str, str | None], check_hub_config: ConfigCheck | None) -> Path:
    """``resolve_hub_model`` of ``hub_name`` (``text`` as given), refused when the caller has no config check."""
    if check_hub_config is None:
        raise ValueError(f"not a model folder: {text} (no such folder; a Hugging Face model id is not accepted here)")
    return resolve_hub_model(*hub_name, check_hub_config)


def default_output_folder(model_folder: Path, name: str) -> Path:
    """Where a command writes about a model when no output folder is given: ``model_folder/name``. Refused
    (``ValueError`` asking for ``--out``) when the model folder lies inside the installed linmem package (a zoo
    model: reports must not change the package) or is a Hugging Face cache snapshot (a Hub model: reports must not
    change the cache), or is not writable."""
    folder = Path(model_folder).resolve()
    if folder == PACKAGE_ROOT or PACKAGE_ROOT in folder.parents:
        raise ValueError(f"{model_folder} is inside the installed linmem package; give an output folder outside it "
                         f"with --out DIR")
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        raise ValueError(f"{model_folder} is a model in the Hugging Face cache; give an output folder outside the "
                         f"cache with --out DIR")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{model_folder} is not writable; give an output folder with --out DIR")
    return Path(model_folder) / name
