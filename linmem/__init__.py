"""linmem: the memory of linear-attention language models.

``import linmem`` registers the ``"linmem"`` model type with ``AutoConfig`` / ``AutoModel`` /
``AutoModelForCausalLM`` (by importing ``linmem.models``), so that ``AutoModelForCausalLM.from_pretrained(folder)``
works after it. In the ``linmem`` console command it does not: there the package's names load on first use
(PEP 562), so that ``linmem --help`` and a command's argument errors answer without importing torch and
transformers, and each command imports what it runs.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
EXPORTS = {
    "LinMemConfig": "linmem.models",
    "LinMemForCausalLM": "linmem.models",
    "LinMemModel": "linmem.models",
    "register_auto_classes": "linmem.models",
    "linear_memory": "linmem.ops",
    "linear_memory_step": "linmem.ops",
}
SUBPACKAGES = ("zoo",)  # ``linmem.zoo`` after a plain ``import linmem``


def __getattr__(name: str):
    """Import ``name``'s module on first use (and the models package, which registers the Auto classes)."""
    if name not in EXPORTS and name not in SUBPACKAGES:
        raise AttributeError(f"module 'linmem' has no attribute {name!r}")
    importlib.import_module("linmem.models")
    if name in SUBPACKAGES:
        return importlib.import_module(f"linmem.{name}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS, *SUBPACKAGES})


def _started_as_command() -> bool:
    """True in the ``linmem`` console command (``sys.argv[0]`` is the script), where imports wait for the command."""
    import os
    import sys

    argv = getattr(sys, "argv", None) or [""]
    return os.path.basename(argv[0]).removesuffix(".exe") == "linmem"


if not _started_as_command():
    importlib.import_module("linmem.models")  # registers the Auto classes


__all__ = ["LinMemConfig", "LinMemForCausalLM", "LinMemModel", "linear_memory", "linear_memory_step", "__version__"]
