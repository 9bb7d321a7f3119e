"""Load a model folder strictly, whatever produced it: the one loader behind ``linmem eval``, ``linmem probe``,
``linmem demo``, ``train.init_from`` and ``linmem.zoo.load``.

The folder comes from ``linmem.io.models.resolve_model_folder`` (a folder, a run folder or ``zoo:NAME``). Its
``config.json`` ``model_type`` picks the loader in ``MODEL_TYPE_LOADERS``; any other type is refused with the list of
supported ones. Missing, unexpected or differently shaped weights are refused with their names (never randomly
initialised). Weights are read from safetensors only. A folder with a SHA-256 manifest (``manifest.json``, see
``linmem.io.manifest``) is verified first, so a damaged file is named as damaged. Nothing here touches the network.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from linmem.data.tokenizer import load_tokenizer
from linmem.io.folders import short_list
from linmem.io.manifest import has_manifest, verify_manifest
from linmem.io.models import pick_device, resolve_model_folder

# model_type -> loader(folder, dtype, device) returning the model in eval mode with every weight from the folder (a
# ``ValueError`` naming what does not fit otherwise). Converters of other architectures register here.
ModelLoader = Callable[[Path, torch.dtype, torch.device], nn.Module]
MODEL_TYPE_LOADERS: dict[str, ModelLoader] = {}


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


def verify_model_folder(folder: Path) -> None:
    """SHA-256 check of every file ``folder``'s manifest lists, where it has one (``DamagedFileError``)."""
    if has_manifest(folder):
        verify_manifest(folder)


def load_weights(spec: str | os.PathLike, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Path]:
    """``(model, folder)``: the model ``spec`` names (see ``resolve_model_folder``) as ``dtype`` on ``device``, in
    eval mode, loaded strictly by its ``model_type``'s loader after the manifest check."""
    folder = resolve_model_folder(spec)
    kind = model_type(folder)
    loader = MODEL_TYPE_LOADERS.get(kind)
    if loader is None:
        raise ValueError(f"{folder}: model type {kind!r} is not supported; linmem loads {supported()}")
    verify_model_folder(folder)
    return loader(folder, dtype, pick_device(device)).eval(), folder


def open_model(spec: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """``(model, tokenizer, folder)``: ``load_weights`` plus the folder's ``tokenizer.json`` as a
    ``tokenizers.Tokenizer`` (``FileNotFoundError`` naming the folder when it has none)."""
    model, folder = load_weights(spec, device=device, dtype=dtype)
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


def load_linmem_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A linmem model folder via ``LinMemForCausalLM.from_pretrained`` (safetensors only), refusing any missing,
    unexpected or differently shaped weight."""
    from linmem.models import LinMemForCausalLM

    with _quiet_load_report():
        model, info = LinMemForCausalLM.from_pretrained(
            str(folder), dtype=dtype, use_safetensors=True, output_loading_info=True, ignore_mismatched_sizes=True)
    mismatched = [key[0] if isinstance(key, tuple) else key for key in info.get("mismatched_keys") or []]
    found = {"missing {} weight(s)": info.get("missing_keys"), "unexpected {} weight(s)": info.get("unexpected_keys"),
             "{} weight(s) of another shape": mismatched}
    problems = [f"{what.format(len(keys))}: {short_list(sorted(keys), 8)}" for what, keys in found.items() if keys]
    if problems:
        raise ValueError(f"{folder}: the weights do not fit its config.json ({'; '.join(problems)}); the model would "
                         f"be partly random, so it is not loaded")
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
