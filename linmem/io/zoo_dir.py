"""The zoo dir (``linmem/zoo/models``, or ``$LINMEM_ZOO_DIR``) and which shipped models it holds: what ``zoo:NAME``
means wherever a model or tokenizer is named. ``linmem.zoo`` re-exports these names as its public API."""

from __future__ import annotations

import os
from pathlib import Path

ZOO_PREFIX = "zoo:"  # a model or tokenizer named zoo:NAME is the shipped model NAME
ENV_VAR = "LINMEM_ZOO_DIR"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "zoo" / "models"
# The seven main models of the zoo, in the order tables list them; the ablations follow in name order.
MAIN = ("sgla", "gla", "gdn", "rla", "rdn", "gdn-hybrid", "transformer")
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
