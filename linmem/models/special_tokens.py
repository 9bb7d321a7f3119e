"""What a saved model folder declares besides its weights: the special-token ids of its tokenizer, its class and
dtype in ``config.json``, and a ``generation_config.json``.

``model.generate()`` stops at ``generation_config.eos_token_id`` and pads with its ``pad_token_id``; both must be
the tokenizer's ids (linmem's tokenizers: end-of-text ``<|endoftext|>`` = 0, which is also where every document
starts, and ``<|pad|>`` = 1). ``declare_special_tokens`` copies them from a tokenizer folder into a config;
``write_model_config`` writes ``config.json`` and ``generation_config.json`` of a model folder.

``python -m linmem.models.special_tokens FOLDER...`` re-declares the ids of model folders saved without them (their
weights untouched): ``config.json`` gets the folder's tokenizer's ids, ``architectures`` and the weights' ``dtype``,
and ``generation_config.json`` is written beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from transformers import GenerationConfig

from linmem.data.tokenizer import special_token_ids
from linmem.io.atomic import write_json_atomic

ARCHITECTURE = "LinMemForCausalLM"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def declare_special_tokens(config, tokenizer_dir: str | Path):
    """Set ``config``'s ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` to those of the tokenizer saved in
    ``tokenizer_dir`` (``linmem.data.tokenizer.special_token_ids``); returns ``config``."""
    for key, value in special_token_ids(tokenizer_dir).items():
        setattr(config, key, value)
    return config


def generation_config(config) -> GenerationConfig:
    """The ``GenerationConfig`` of a model with ``config``: its special-token ids, nothing else."""
    return GenerationConfig(**{key: getattr(config, key, None) for key in SPECIAL_TOKEN_KEYS})


def _write_generation_config(folder: Path, config) -> None:
    write_json_atomic(folder / GENERATION_CONFIG, json.loads(generation_config(config).to_json_string(use_diff=True)))


def write_model_config(folder: str | Path, config, dtype: torch.dtype | None = None) -> None:
    """Write ``folder/config.json`` (with ``architectures`` and ``dtype``: the dtype the weights are saved in) and
    ``folder/generation_config.json``; ``config`` itself is left unchanged."""
    folder = Path(folder)
    config = copy.deepcopy(config)
    config.architectures = [ARCHITECTURE]
    if dtype is not None:
        config.dtype = dtype
    write_json_atomic(folder / "config.json", json.loads(config.to_json_string(use_diff=True)))
    _write_generation_config(folder, config)


def weights_dtype(weights: str | Path) -> str | None:
    """The dtype of the first floating-point tensor of a safetensors file (``"bfloat16"``), or None."""
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            tensor = f.get_slice(key)
            name = tensor.get_dtype()
            if name in ("BF16", "F16", "F32", "F64"):
                return {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}[name]
    return None


def redeclare_folder(folder: str | Path) -> dict[str, Any]:
    """Rewrite ``folder/config.json`` with the special-token ids of the folder's own tokenizer, ``architectures``
    and the weights' ``dtype`` (every other field as it was), and write ``generation_config.json``. The weights are
    not read into memory nor changed. Returns the new ``config.json`` as a dict."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not a model folder)")
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(special_token_ids(folder))
    config["architectures"] = [ARCHITECTURE]
    weights = folder / "model.safetensors"
    if weights.is_file() and (dtype := weights_dtype(weights)):
        config["dtype"] = dtype
    write_json_atomic(path, dict(sorted(config.items())))
    _write_generation_config(folder, SimpleNamespace(**config))
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linmem.models.special_tokens",
                                     description="declare the tokenizer's special-token ids in model folders "
                                                 "(config.json, generation_config.json); weights untouched")
    parser.add_argument("folders", nargs="+", help="model folders, each with config.json and its tokenizer")
    args = parser.parse_args(argv)
    for folder in args.folders:
        config = redeclare_folder(folder)
        ids = ", ".join(f"{key} {config[key]}" for key in SPECIAL_TOKEN_KEYS)
        print(f"{folder}: {ids}, dtype {config.get('dtype')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
