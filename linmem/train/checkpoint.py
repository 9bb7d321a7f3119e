"""Checkpoints: a folder per step, written in a hidden temp folder and renamed into place when complete.

``OUT/checkpoints/step-00000100/``::

    config.json, model.safetensors     the model (loadable with ``AutoModelForCausalLM.from_pretrained``)
    tokenizer.json, tokenizer_config.json
    optimizer.safetensors              AdamW moments and step counts, keyed ``state/<param name>/<field>``
    optimizer.json                     the param groups (hyperparameters and parameter names)
    rng-rank<R>.json                   each process's Python / NumPy / torch (/ CUDA) generator states
    trainer_state.json                 steps done, tokens seen, the next data position, the resolved config
    manifest.json                      written last: every file's size and SHA-256

A run under FSDP2 (``train.parallel: fsdp``) writes the model and AdamW state sharded instead, each process its
own part through ``torch.distributed.checkpoint`` (DCP) in safetensors, so no process ever holds the whole model
or optimizer::

    model-shards/shard-<R+1>-model-00001-of-00001.safetensors       process R's slices of every weight
    optimizer-shards/shard-<R+1>-model-00001-of-00001.safetensors   process R's slices of the AdamW moments
    optimizer.json, config.json, tokenizer, rng-rank<R>.json, trainer_state.json, manifest.json as above

Each shard file's safetensors header records where its slices sit in the full tensors (DCP's
``DCP_SHARDING_INFO``), so loading reads headers as JSON, never a pickle, and a run may resume at another world
size (DCP reslices). ``consolidated_model_state`` joins the model shards in one process (``linmem export``).

Nothing is pickled (no ``torch.load``). The folder appears under its final name only by ``os.rename`` after the
manifest is on disk, so a crash mid-write leaves a ``.tmp-step-*`` folder (removed on the next start) and never a
checkpoint that looks complete. Only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from linmem.io.atomic import fsync_dir, write_json_atomic
from linmem.io.checkpoints import complete_checkpoints, latest_checkpoint, step_dir_name  # noqa: F401  (trainer)
from linmem.io.folders import swap_folder
from linmem.io.manifest import MANIFEST_NAME as MANIFEST
from linmem.io.manifest import DamagedFileError, verify_manifest, write_manifest
from linmem.models.loading import save_weights
from linmem.models.special_tokens import write_model_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class Checkpoint:
    """What ``read_checkpoint`` returns: full (unsharded) model and optimizer state dicts and the trainer state."""

    path: Path
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    trainer_state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.trainer_state["step"])


# ---------------------------------------------------------------- random generator states


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's generator states as JSON-ready lists (Python, NumPy, torch CPU, and CUDA if used)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back the states ``capture_rng`` took."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)


# ---------------------------------------------------------------- optimizer state without pickle


def split_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer state dict keyed by parameter names (``get_optimizer_state_dict``, full or sharded) as
    ``(tensors keyed state/<param>/<field>, as they are, DTensors included; JSON: param groups and non-tensor
    values)``."""
    tensors, scalars = {}, {}
    for param, fields in state["state"].items():
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{param}/{name}"] = value
            else:
                scalars[f"{param}/{name}"] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def flatten_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A full optimizer state dict as ``(CPU tensors for safetensors, JSON)`` (see ``split_optimizer_state``)."""
    tensors, meta = split_optimizer_state(state)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, meta


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``flatten_optimizer_state``."""
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, rest = key.split("/", 1)
        param, name = rest.rsplit("/", 1)
        state.setdefault(param, {})[name] = value
    for key, value in meta["scalars"].items():
        param, name = key.rsplit("/", 1)
        state.setdefault(param, {})[name] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------- writing


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def checkpoint_files(folder: Path) -> list[str]:
    """Paths (relative, ``/``-separated) of every file in the checkpoint folder ``folder`` and its shard folders,
    the manifest left out."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST)


def temp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{step_dir_name(step)}"


def prepare_temp_dir(root: Path, step: int) -> Path:
    """A fresh, empty hidden folder for checkpoint ``step`` (rank 0 calls this before any rank writes)."""
    tmp = temp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_rng(tmp: Path, rank: int, state: dict[str, Any]) -> None:
    write_json_atomic(tmp / f"rng-rank{rank}.json", state)


def write_model(folder: Path, model_state: dict[str, torch.Tensor], config, dtype: torch.dtype | None = None) -> None:
    """``config.json``, ``generation_config.json`` + ``model.safetensors`` (tied ``lm_head.weight`` left out, as
    Hugging Face does)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model_state.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    save_weights(tensors, folder / "model.safetensors", config)  # the header records the architecture
    write_model_config(folder, config, next((t.dtype for t in tensors.values() if t.is_floating_point()), None))


def with_tied_head(model_state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """``model_state`` as read from a ``model.safetensors`` that ``write_model`` wrote: with tied embeddings, the
    left-out ``lm_head.weight`` put back as the embedding matrix (a state dict ``load_state_dict`` accepts)."""
    state = dict(model_state)
    if getattr(config, "tie_word_embeddings", False) and "model.embeddings.weight" in state:
        state["lm_head.weight"] = state["model.embeddings.weight"]
    return state


def copy_tokenizer(source: Path, folder: Path) -> None:
    """Copy the tokenizer files found in ``source`` (a dataset or model folder) into ``folder``."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)


def finish_checkpoint(root: Path, step: int, keep: int) -> Path:
    """Write the manifest into the temp folder, fsync, rename it to ``step-XXXXXXXX``, prune old ones (rank 0)."""
    tmp = temp_dir(root, step)
    files = checkpoint_files(tmp)
    for name in files:
        _fsync_file(tmp / name)
    for folder in {(tmp / name).parent for name in files}:
        fsync_dir(folder)
    write_manifest(tmp, files, extra={"step": step})
    fsync_dir(tmp)
    final = swap_folder(tmp, root / step_dir_name(step))  # a step saved again replaces its folder
    prune_checkpoints(root, keep)
    return final


def prune_checkpoints(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints."""
    for path in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path)


def remove_stale_temp(root: Path) -> None:
    """Remove leftovers of interrupted writes (``.tmp-step-*``, ``.old-step-*``)."""
    if root.is_dir():
        for path in list(root.glob(".tmp-step-*")) + list(root.glob(".old-step-*")):
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- reading


def verify_checkpoint(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Check every file the manifest lists: present, same size and SHA-256 (``DamagedFileError``, a
    ``ValueError`` naming the file, otherwise). ``share=(rank, world_size)``: this process checks its share."""
    try:
        verify_manifest(path, share)
    except DamagedFileError as error:
        raise DamagedFileError(f"{error}; the checkpoint {path.name} is damaged (delete it to resume from an "
                               "older one)") from None


def read_checkpoint(path: Path) -> Checkpoint:
    """Model, optimizer and trainer state of the checkpoint folder ``path`` (verified against its manifest)."""
    verify_checkpoint(path)
    model_state = load_file(str(path / "model.safetensors"))
    optimizer = unflatten_optimizer_state(load_file(str(path / "optimizer.safetensors")),
                                          json.loads((path / "optimizer.json").read_text(encoding="utf-8")))
    return Checkpoint(path, model_state, optimizer, read_trainer_state(path))


def read_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of checkpoint ``path``."""
    return json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))


def read_rng(path: Path, rank: int) -> dict[str, Any] | None:
    """Process ``rank``'s generator states, or None if that rank did not exist when the checkpoint was written."""
    file = path / f"rng-rank{rank}.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def write_optimizer(folder: Path, state: dict[str, Any]) -> None:
    tensors, meta = flatten_optimizer_state(state)
    save_file(tensors, str(folder / "optimizer.safetensors"), metadata={"format": "pt"})
    write_json_atomic(folder / "optimizer.json", meta)


# ---------------------------------------------------------------- sharded (FSDP2) model and optimizer state

MODEL_SHARDS = "model-shards"
OPTIMIZER_SHARDS = "optimizer-shards"


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint folder ``path`` holds sharded state (``write_sharded``) rather than
    ``model.safetensors``."""
    return (path / MODEL_SHARDS).is_dir()


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for every parameter reachable under a second name (a tied ``lm_head.weight`` is the
    embedding matrix): safetensors stores a tensor once, so aliases are left out of the shards and put back on
    reading."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def write_sharded(folder: Path, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                  is_main: bool, aliases: dict[str, str] | None = None) -> None:
    """Every process writes its slices of ``model_state`` and ``optimizer_state`` (sharded state dicts of
    ``get_model_state_dict`` / ``get_optimizer_state_dict``: DTensors) into ``folder/model-shards`` and
    ``folder/optimizer-shards``, leaving out the tied names ``aliases`` (``tied_names``); the main process also
    writes ``optimizer.json``. A collective: every process calls it."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    tensors, meta = split_optimizer_state(optimizer_state)
    model_state = {k: v for k, v in model_state.items() if k not in (aliases or {})}
    save(model_state, storage_writer=HuggingFaceStorageWriter(str(folder / MODEL_SHARDS), save_distributed=True))
    save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder / OPTIMIZER_SHARDS), save_distributed=True))
    if is_main:
        write_json_atomic(folder / "optimizer.json", meta)


def read_sharded(path: Path, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                 aliases: dict[str, str] | None = None) -> dict:
    """Fill ``model_state`` (in place; the tied names ``aliases`` are set to the tensor they share) and return
    the optimizer state dict of checkpoint ``path``, read into the layout of ``model_state`` /
    ``optimizer_state`` (this process's sharded state dicts, DTensors or plain tensors): each process reads
    only the slices it holds. A collective under a process group. The caller verifies the manifest first
    (``verify_checkpoint``)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    aliases = aliases or {}
    stored = {k: v for k, v in model_state.items() if k not in aliases}
    load(stored, storage_reader=HuggingFaceStorageReader(str(path / MODEL_SHARDS)))
    model_state.update(stored)
    model_state.update({alias: stored[name] for alias, name in aliases.items() if name in stored})
    tensors, _ = split_optimizer_state(optimizer_state)
    load(tensors, storage_reader=HuggingFaceStorageReader(str(path / OPTIMIZER_SHARDS)))
    return unflatten_optimizer_state(tensors, json.loads((path / "optimizer.json").read_text(encoding="utf-8")))


def consolidated_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of checkpoint ``path``, joined from its model shards (``join_shards``)."""
    return join_shards(path / MODEL_SHARDS)


def join_shards(folder: Path) -> dict[str, torch.Tensor]:
    """The full tensors of a shard folder (``write_sharded``), joined in this process alone (no process group):
    each shard file's header says where its slices sit. Raises ``DamagedFileError`` when the slices do not cover
    a tensor exactly."""
    from safetensors import safe_open

    pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DamagedFileError(f"{folder}: no shard files; the checkpoint is incomplete")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            placement = json.loads((f.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
            for key in f.keys():
                if key not in placement:
                    raise DamagedFileError(f"{file}: tensor {key!r} has no sharding record in its header")
                pieces.setdefault(key, []).append((tuple(placement[key]["saved_offsets"]), f.get_tensor(key)))
    state = {}
    for key, parts in pieces.items():
        shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        full = torch.empty(shape, dtype=parts[0][1].dtype)
        if sum(t.numel() for _, t in parts) != full.numel():
            raise DamagedFileError(f"{folder}: the slices of {key!r} do not cover its shape {tuple(shape)}; a shard "
                                   "file is missing or from another checkpoint")
        for offsets, tensor in parts:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
        state[key] = full
    return state
