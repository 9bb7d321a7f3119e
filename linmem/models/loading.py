"""Load a model folder strictly, whatever produced it: the one loader behind ``linmem eval``, ``linmem probe``,
``linmem demo``, ``train.init_from`` and ``linmem.zoo.load``.

The folder comes from ``linmem.io.models.resolve_model_folder`` (a folder, a run folder or ``zoo:NAME``). Its
``config.json`` ``model_type`` picks the loader in ``MODEL_TYPE_LOADERS``; any other type is refused with the list of
supported ones. Missing, unexpected or differently shaped weights are refused with their names (never randomly
initialised). Weights are read from safetensors only. A folder with a SHA-256 manifest (``manifest.json``, see
``linmem.io.manifest``) is verified first, so a damaged file is named as damaged. Nothing here touches the network.

A linmem weights file records the architecture it was saved as: ``save_weights`` (every folder ``linmem train``,
``export`` and ``zoo ship`` write) puts ``architecture_record`` (every config field that changes what the weights
compute, such as ``mixer``, ``residual_target``, ``gamma``) under the key ``linmem_architecture`` of the safetensors
header metadata, and ``record_architecture`` adds it to a folder ``save_pretrained`` wrote (FLA conversion does).
Before any memory is allocated, a linmem folder's ``config.json`` is checked against that record, and the tensor
names and shapes of the header against the model the config describes (built on the meta device), so neither an
edited ``config.json`` (RLA weights loading as RDN) nor an absurd size (a vocabulary of 10^12) gets further than one
line naming both sides. A folder saved without the record (the shipped zoo) falls back on its ``eval.json``, whose
``model_config`` names the weights by SHA-256; a folder with neither loads on names and shapes alone.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from linmem.data.tokenizer import load_tokenizer
from linmem.io.atomic import atomic_write
from linmem.io.folders import short_list
from linmem.io.hub import first_line
from linmem.io.manifest import has_manifest, sha256_file, verify_manifest
from linmem.io.models import pick_device, resolve_model_folder

# model_type -> loader(folder, dtype, device) returning the model in eval mode with every weight from the folder (a
# ``ValueError`` naming what does not fit otherwise). Converters of other architectures register here.
ModelLoader = Callable[[Path, torch.dtype, torch.device], nn.Module]
MODEL_TYPE_LOADERS: dict[str, ModelLoader] = {}

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded save: which shard file holds each tensor
ARCHITECTURE_KEY = "linmem_architecture"  # safetensors header metadata: JSON of ``architecture_record``
# LinMemConfig fields that change how a model runs or starts training, never what its weights compute
RUNTIME_FIELDS = frozenset({"backend", "use_cache", "initializer_range", "max_position_embeddings", "pad_token_id",
                            "bos_token_id", "eos_token_id"})
ZOO_RECORD = "eval.json"  # a shipped model's record: ``model_config`` measured on the weights ``model_sha256`` names


def model_type(folder: Path) -> str:
    """``config.json``'s ``model_type`` (``ValueError`` when unreadable or absent)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{folder / 'config.json'}: not a readable model config ({error})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(kind, str):
        raise ValueError(f"{folder / 'config.json'} names no model_type; supported: {supported()}")
    return kind


def supported() -> str:
    return ", ".join(sorted(MODEL_TYPE_LOADERS))


def check_hub_config(folder: Path, name: str) -> None:
    """Refuse (``ValueError`` naming ``name``) a Hub model's ``config.json`` whose ``model_type`` linmem has no
    loader for, or whose settings its converter cannot reproduce: ``linmem.io.hub`` asks this before it fetches the
    weights."""
    kind = model_type(folder)
    if kind not in MODEL_TYPE_LOADERS:
        raise ValueError(f"{name}: model type {kind!r} is not supported (linmem loads {supported()}); its weights "
                         f"were not downloaded")
    try:
        if kind == "linmem":
            read_linmem_config(folder)
        elif MODEL_TYPE_LOADERS[kind] is load_fla_folder:
            from linmem.models.fla_import import fla_config_to_linmem

            fla_config_to_linmem(json.loads((folder / "config.json").read_text(encoding="utf-8")))
        else:
            from transformers import AutoConfig

            from linmem.models.hf_import import hf_config_to_linmem

            hf_config_to_linmem(AutoConfig.from_pretrained(str(folder)))
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise ValueError(f"{name}: {first_line(error)}; its weights were not downloaded") from None


def verify_model_folder(folder: Path) -> None:
    """SHA-256 check of every file ``folder``'s manifest lists, where it has one (``DamagedFileError``)."""
    if has_manifest(folder):
        verify_manifest(folder)


def load_weights(spec: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 backend: str = "auto") -> tuple[nn.Module, Path]:
    """``(model, folder)``: the model ``spec`` names (see ``resolve_model_folder``) as ``dtype`` on ``device``, in
    eval mode, loaded strictly by its ``model_type``'s loader after the manifest check, its mixers on the op backend
    ``backend`` (``model.set_backend``; a backend in ``config.json`` is not used)."""
    folder = resolve_model_folder(spec, check_hub_config)
    kind = model_type(folder)
    loader = MODEL_TYPE_LOADERS.get(kind)
    if loader is None:
        raise ValueError(f"{folder}: model type {kind!r} is not supported; linmem loads {supported()}")
    verify_model_folder(folder)
    try:
        model = loader(folder, dtype, pick_device(device))
    except SafetensorError as error:  # a weights file cut short after its header was read
        raise ValueError(f"{folder}: a weights file is not complete safetensors ({error}); it is truncated or "
                         f"damaged: copy or save it again") from None
    return model.set_backend(backend).eval(), folder


def open_model(spec: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               backend: str = "auto"):
    """``(model, tokenizer, folder)``: ``load_weights`` plus the folder's ``tokenizer.json`` as a
    transformers ``PreTrainedTokenizerFast`` of ``linmem.data.tokenizer.load_tokenizer`` (``FileNotFoundError``
    naming the folder when it has none)."""
    model, folder = load_weights(spec, device=device, dtype=dtype, backend=backend)
    return model, load_tokenizer(folder), folder


@contextmanager
def _quiet_load_report():
    """transformers logs a table of missing / unexpected weights; linmem raises its own error for them instead.
    (Raising the loading logger's level also makes transformers check a tensor-parallel plan, which linmem models do
    not have, and warn that no layer was sharded: that logger is quieted too.)"""
    loggers = [logging.getLogger(name) for name in ("transformers.modeling_utils",
                                                     "transformers.distributed.tensor_parallel")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def architecture_record(config) -> dict[str, Any]:
    """``config``'s fields that define what its weights compute (every ``LinMemConfig`` argument but
    ``RUNTIME_FIELDS``), as JSON values (the sub-configs ``attention`` and ``moe`` as tables)."""
    names = [name for name in inspect.signature(type(config).__init__).parameters
             if name not in ("self", "kwargs") and name not in RUNTIME_FIELDS]
    fields = config.to_dict()
    return json.loads(json.dumps({name: fields[name] for name in names if name in fields}))


def weights_metadata(config) -> dict[str, str]:
    """The safetensors header metadata of a weights file saved from ``config``: the format tag transformers writes,
    and for a linmem config its ``architecture_record``."""
    metadata = {"format": "pt"}
    if getattr(config, "model_type", None) == "linmem":
        metadata[ARCHITECTURE_KEY] = json.dumps(architecture_record(config), sort_keys=True)
    return metadata


def save_weights(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, config) -> None:
    """Write ``tensors`` to the safetensors file ``path`` with ``weights_metadata(config)``, then read its header
    back: a write the disk cut short (full, or failing) raises ``OSError`` naming the file instead of leaving a
    truncated file to be found at the next load. The same tensors and config always give the same bytes (safetensors
    writes a metadata table of several keys in a random order, so the record is added to its header afterwards)."""
    try:
        save_file(dict(tensors), str(path), metadata={"format": "pt"})
        _rewrite_header_metadata(Path(path), weights_metadata(config))
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, ValueError, struct.error) as error:
        raise OSError(f"{path}: the weights could not be written completely ({error}); check the free space and "
                      f"the folder, then save again") from None


def record_architecture(folder: str | os.PathLike, config) -> None:
    """Add ``weights_metadata(config)`` to the header of every weights file in ``folder`` (what
    ``save_pretrained`` wrote); the tensor bytes are copied unchanged and each file is replaced atomically."""
    folder = Path(folder)
    if not (folder / WEIGHTS_NAME).is_file() and not (folder / WEIGHTS_INDEX).is_file():
        return
    for path in weights_files(folder):
        _rewrite_header_metadata(path, weights_metadata(config))


def _rewrite_header_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Merge ``metadata`` into the safetensors file ``path``'s header; the data section after the header stays
    byte-identical (its offsets are relative to its start)."""
    with open(path, "rb") as source:
        (length,) = struct.unpack("<Q", source.read(8))
        header = json.loads(source.read(length))
        header["__metadata__"] = {**header.get("__metadata__", {}), **metadata}
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # safetensors keeps the data section 8-byte aligned
        with atomic_write(path) as target:
            target.write(struct.pack("<Q", len(text)) + text)
            shutil.copyfileobj(source, target, 1 << 20)


def weights_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: its shards (``WEIGHTS_INDEX``) or ``WEIGHTS_NAME``
    (``ValueError`` when it has neither, or a shard is missing)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
            raise ValueError(f"{index}: not a readable weights index ({error})") from None
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"{folder}: shard(s) {short_list(missing)} listed in {WEIGHTS_INDEX} are missing")
        return [folder / name for name in names]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    raise ValueError(f"{folder}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX}; linmem reads weights from safetensors only")


def read_weights_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``(shapes, metadata)`` of the safetensors file ``path``, read from its header without loading a tensor
    (``ValueError`` naming the file when it is truncated or not safetensors)."""
    try:
        with safe_open(str(path), framework="pt") as weights:
            shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
            return shapes, weights.metadata() or {}
    except SafetensorError as error:
        raise ValueError(f"{path}: not a complete safetensors file ({error}); it is truncated or damaged: copy or "
                         f"save it again") from None


def read_linmem_config(folder: Path):
    """``folder``'s ``config.json`` as a ``LinMemConfig`` (``ValueError`` naming the file and the field)."""
    from linmem.models import LinMemConfig

    try:
        return LinMemConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{folder / 'config.json'}: {error}") from None


def saved_architecture(path: Path, metadata: dict[str, str]) -> tuple[dict[str, Any], str] | None:
    """``(record, where it is kept)`` of the architecture the weights file ``path`` (header ``metadata``) was saved
    as: the header's ``ARCHITECTURE_KEY``, else a ``ZOO_RECORD`` beside it that names it by SHA-256; None when
    neither exists."""
    if ARCHITECTURE_KEY in metadata:
        try:
            record = json.loads(metadata[ARCHITECTURE_KEY])
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ValueError(f"{path}: the header's {ARCHITECTURE_KEY} is not a JSON table; the file is damaged")
        return record, f"the header of {path.name}"
    return _zoo_record(path.parent)


def _zoo_record(folder: Path) -> tuple[dict[str, Any], str] | None:
    path = folder / ZOO_RECORD
    if not path.is_file() or not (folder / WEIGHTS_NAME).is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("model_config"), dict):
        return None
    if record.get("model_sha256") != sha256_file(folder / WEIGHTS_NAME):
        return None
    return record["model_config"], f"{ZOO_RECORD} (which names {WEIGHTS_NAME} by its SHA-256)"


def check_architecture(folder: Path, config, headers: Mapping[Path, dict[str, str]]) -> None:
    """Refuse (``ValueError`` naming both values) a ``config.json`` that differs from the architecture the weights
    were saved as, in any field of ``architecture_record``. A record of the flat fields older versions saved
    (``attn_layers``, ``num_experts``, ...) is read into the sub-configs first (``nest_flat_fields``); a field the
    record does not have is not compared."""
    from linmem.models.configuration import nest_flat_fields

    for path, metadata in headers.items():
        saved = saved_architecture(path, metadata)
        if saved is None:
            continue
        record, where = saved
        try:
            record = _dotted(nest_flat_fields(record))
        except ValueError as error:
            raise ValueError(f"{path}: the architecture in {where} is not readable ({error})") from None
        current = _dotted(architecture_record(config))
        differ = [f"{name} {record[name]!r} in {where}, {current[name]!r} in config.json"
                  for name in current if name in record and record[name] != current[name]]
        if differ:
            raise ValueError(f"{folder}: config.json does not describe the model its weights were saved as "
                             f"({'; '.join(differ)}); put the saved values back into config.json")


def _dotted(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with each sub-config's table spread into ``"attention.layers"``-style names."""
    from linmem.models.configuration import SUB_CONFIGS

    flat = {}
    for name, value in record.items():
        if name in SUB_CONFIGS and isinstance(value, Mapping):
            flat.update({f"{name}.{field}": inner for field, inner in value.items()})
        else:
            flat[name] = value
    return flat


def check_weights_fit(folder: Path, config, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse (``ValueError``) weights whose names or shapes differ from the model ``config`` describes, comparing
    the header with that model built on the meta device, so nothing is allocated for a config of absurd size."""
    from linmem.models import LinMemForCausalLM

    with torch.device("meta"):
        model = LinMemForCausalLM(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    wrong = [f"{name} {list(shapes[name])} in the file, {list(expected[name])} in config.json"
             for name in sorted(set(expected) & set(shapes)) if shapes[name] != expected[name]]
    _refuse_unfit(folder, sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected)), wrong,
                  (_count(expected.values()), _count(shapes.values())))


def _count(shapes) -> int:
    return sum(int(torch.Size(shape).numel()) for shape in shapes)


def _refuse_unfit(folder: Path, missing: list[str], unexpected: list[str], wrong: list[str],
                  sizes: tuple[int, int] | None = None) -> None:
    found = {"missing {} weight(s)": missing, "unexpected {} weight(s)": unexpected,
             "{} weight(s) of another shape": wrong}
    problems = [f"{what.format(len(keys))}: {short_list(keys, 8)}" for what, keys in found.items() if keys]
    if not problems:
        return
    if sizes is not None and sizes[0] != sizes[1]:
        problems.append(f"config.json describes {sizes[0]:,} parameters, the weights hold {sizes[1]:,}")
    raise ValueError(f"{folder}: the weights do not fit its config.json ({'; '.join(problems)}); the model would "
                     f"be partly random, so it is not loaded")


def load_linmem_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A linmem model folder via ``LinMemForCausalLM.from_pretrained`` (safetensors only), refusing any missing,
    unexpected or differently shaped weight."""
    from linmem.models import LinMemForCausalLM

    config = read_linmem_config(folder)
    headers = {path: read_weights_header(path) for path in weights_files(folder)}
    check_architecture(folder, config, {path: metadata for path, (_, metadata) in headers.items()})
    check_weights_fit(folder, config, {name: shape for shapes, _ in headers.values() for name, shape in shapes.items()})
    with _quiet_load_report():
        model, info = LinMemForCausalLM.from_pretrained(
            str(folder), config=config, dtype=dtype, use_safetensors=True, output_loading_info=True,
            ignore_mismatched_sizes=True)
    mismatched = [key[0] if isinstance(key, tuple) else key for key in info.get("mismatched_keys") or []]
    _refuse_unfit(folder, sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or []),
                  sorted(mismatched))
    return model.to(device)


def load_fla_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An FLA GLA / Gated DeltaNet checkpoint (``linmem.models.fla_import``, which checks names and shapes)."""
    from linmem.models.fla_import import load_fla_checkpoint

    return load_fla_checkpoint(folder, dtype=dtype, device=device)


def load_hf_hybrid_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A transformers GDN hybrid (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid) converted by
    ``linmem.models.hf_import`` (which refuses missing weights and, naming why, the types it cannot reproduce)."""
    from linmem.models.hf_import import load_hf_hybrid

    return load_hf_hybrid(folder, dtype=dtype, device=device)


MODEL_TYPE_LOADERS.update({"linmem": load_linmem_folder, "gla": load_fla_folder, "gated_deltanet": load_fla_folder})
MODEL_TYPE_LOADERS.update(dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                                         "olmo_hybrid", "kimi_linear"), load_hf_hybrid_folder))
