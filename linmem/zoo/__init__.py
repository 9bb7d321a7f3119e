"""The model zoo: small trained linmem models shipped inside the package.

Each shipped model is a folder ``<zoo dir>/<name>/`` with ``config.json``, ``model.safetensors`` (bfloat16),
``tokenizer.json`` + ``tokenizer_config.json`` (so ``AutoTokenizer.from_pretrained(folder)`` works),
``train_info.json``, a model card ``README.md`` and ``eval.json`` (the numbers of the card, as ``linmem zoo ship``
measured them). Held-out text of the training dataset lies beside them in ``<zoo dir>/_heldout/<dataset>/`` (a
token dataset with only the test split), so ``linmem eval`` and ``linmem demo`` work on a machine without the data.

The zoo dir is ``linmem/zoo/models`` in the installed package, or the folder named by the environment variable
``LINMEM_ZOO_DIR``; every function also takes it as ``root``.

```python
import linmem.zoo
linmem.zoo.names()                               # ['sgla', 'gla', 'gdn', 'rla', 'rdn', 'gdn-hybrid', 'transformer']
model, tokenizer = linmem.zoo.load("rdn")        # float32 on the CPU, eval mode; a transformers tokenizer
```
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

ENV_VAR = "LINMEM_ZOO_DIR"
PACKAGE_DIR = Path(__file__).resolve().parent / "models"
HELDOUT_DIR = "_heldout"
# The seven main models of the zoo, in the order tables list them; the ablations follow in name order.
MAIN = ("sgla", "gla", "gdn", "rla", "rdn", "gdn-hybrid", "transformer")
SIZE_LIMIT = 10_000_000  # bytes per shipped model folder: 10 MB
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


class UnknownModelError(ValueError):
    """A name that is not a shipped model; the message lists the shipped ones."""


def root(path: str | os.PathLike | None = None) -> Path:
    """The zoo dir: ``path`` if given, else ``$LINMEM_ZOO_DIR``, else the package's ``linmem/zoo/models``."""
    if path is not None:
        return Path(path)
    return Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else PACKAGE_DIR


def order(names) -> list[str]:
    """``names`` with the main models first (in ``MAIN`` order), then the rest sorted."""
    names = list(dict.fromkeys(names))
    return [n for n in MAIN if n in names] + sorted(n for n in names if n not in MAIN)


def is_model_dir(folder: Path) -> bool:
    return folder.is_dir() and all((folder / f).is_file() for f in MODEL_FILES)


def names(path: str | os.PathLike | None = None) -> list[str]:
    """The shipped models' names (main models first); empty if none are shipped."""
    folder = root(path)
    if not folder.is_dir():
        return []
    return order(p.name for p in folder.iterdir() if not p.name.startswith(("_", ".")) and is_model_dir(p))


def path(name: str, root_dir: str | os.PathLike | None = None) -> Path:
    """The folder of shipped model ``name``; ``UnknownModelError`` naming the shipped models if there is none."""
    shipped = names(root_dir)
    if name not in shipped:
        available = ", ".join(shipped) if shipped else f"none (no model is shipped in {root(root_dir)})"
        raise UnknownModelError(f"no zoo model named {name!r}; available: {available}")
    return root(root_dir) / name


def load(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         root_dir: str | os.PathLike | None = None):
    """``(model, tokenizer)``: the shipped model ``name`` (``linmem.io.models.load_weights``: every weight from the
    folder, its manifest verified) as ``dtype`` on ``device`` in eval mode, and its tokenizer
    (the transformers fast tokenizer ``AutoTokenizer.from_pretrained(folder)`` gives, loaded without AutoTokenizer's
    model-type warning)."""
    from transformers import PreTrainedTokenizerFast

    from linmem.io.models import load_weights

    model, folder = load_weights(path(name, root_dir), device=device, dtype=dtype)  # strict, manifest-checked
    return model, PreTrainedTokenizerFast.from_pretrained(str(folder))


def eval_record(name: str, root_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The shipped model's ``eval.json`` (what its model card shows)."""
    return json.loads((path(name, root_dir) / "eval.json").read_text(encoding="utf-8"))


def heldout_dir(name: str, root_dir: str | os.PathLike | None = None) -> Path:
    """The held-out token dataset shipped for model ``name`` (recorded in its ``train_info.json``)."""
    folder = path(name, root_dir)
    info = json.loads((folder / "train_info.json").read_text(encoding="utf-8"))
    return (folder / info["dataset"]).resolve()


def folder_bytes(folder: Path) -> int:
    """Total size of the files in ``folder`` (not recursive: a model folder is flat)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


__all__ = ["MAIN", "SIZE_LIMIT", "UnknownModelError", "eval_record", "heldout_dir", "load", "names", "path", "root"]
