"""``linmem.zoo.load(name)``: a shipped model and its tokenizer, ready to run."""

from __future__ import annotations

import os

import torch

from linmem.io.zoo_dir import path


def load(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         root_dir: str | os.PathLike | None = None):
    """``(model, tokenizer)``: the shipped model ``name`` (``linmem.models.loading.load_weights``: every weight from
    the folder, its manifest verified) as ``dtype`` on ``device`` in eval mode, and its tokenizer
    (``linmem.data.tokenizer.load_tokenizer``: the transformers fast tokenizer ``AutoTokenizer.from_pretrained(folder)``
    gives, loaded without AutoTokenizer's model-type warning)."""
    from linmem.data.tokenizer import load_tokenizer
    from linmem.models.loading import load_weights

    model, folder = load_weights(path(name, root_dir), device=device, dtype=dtype)  # strict, manifest-checked
    return model, load_tokenizer(folder)
