"""linmem: the memory of linear-attention language models.

The package's names load on first use (PEP 562), so that ``linmem --help`` and a command's argument errors answer
without importing torch and transformers. Importing ``linmem.models`` (which every model-loading path does) or
touching any name below registers the ``"linmem"`` model type with ``AutoConfig`` / ``AutoModel`` /
``AutoModelForCausalLM``; so does ``linmem.register_auto_classes()``.
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


__all__ = ["LinMemConfig", "LinMemForCausalLM", "LinMemModel", "linear_memory", "linear_memory_step", "__version__"]
