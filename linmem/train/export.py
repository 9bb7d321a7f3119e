"""``linmem export CHECKPOINT OUT``: a training checkpoint (full or FSDP2-sharded) as a model folder that
``AutoModelForCausalLM.from_pretrained`` loads: ``config.json``, one consolidated ``model.safetensors``, the
tokenizer and a SHA-256 manifest.

The checkpoint is verified against its manifest first. Sharded weights are joined in this one process from the
shard files' safetensors headers (``checkpoint.consolidated_model_state``): no process group and nothing
unpickled. The folder is written hidden and renamed into place when complete.

Only argparse and the standard library load with this module; the functions import torch, safetensors and
transformers when called, so that ``linmem export --help`` and its argument errors answer at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from linmem.io.folders import staged_folder
from linmem.io.manifest import write_manifest

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes a floating-point weight may be exported as


def checkpoint_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of checkpoint folder ``path`` (verified): joined from its shards, or its
    ``model.safetensors``."""
    from safetensors.torch import load_file

    from linmem.train import checkpoint as ckpt

    ckpt.verify_checkpoint(path)
    if ckpt.is_sharded(path):
        return ckpt.consolidated_model_state(path)
    return load_file(str(path / "model.safetensors"))


def export_model(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the model of ``checkpoint`` into the folder ``out`` (``dtype``: ``float32``, ``bfloat16`` or
    ``float16`` for the floating-point weights; default as saved); returns ``out``."""
    import torch
    from transformers import AutoConfig

    from linmem.train import checkpoint as ckpt

    path, out = Path(checkpoint), Path(out)
    if not (path / "trainer_state.json").is_file():
        raise ValueError(f"checkpoint {path}: not a linmem training checkpoint (no trainer_state.json); give a "
                         "folder OUT/checkpoints/step-XXXXXXXX")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    config = AutoConfig.from_pretrained(str(path))
    state = checkpoint_model_state(path)
    with staged_folder(out) as tmp:
        ckpt.write_model(tmp, state, config, getattr(torch, dtype) if dtype else None)
        ckpt.copy_tokenizer(path, tmp)
        write_manifest(tmp)
    return out


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, OUT/checkpoints/step-XXXXXXXX")
    parser.add_argument("out", type=Path, help="model folder to write (from_pretrained loads it)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the floating-point weights (default: as in the checkpoint)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    written = export_model(args.checkpoint, args.out, args.dtype)
    print(f"wrote {written}")
    return 0
