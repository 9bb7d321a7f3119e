"""A package's public names, each imported from its module on first use (PEP 562 module ``__getattr__``).

A subpackage's ``__init__`` that re-exports names of heavy modules (torch, transformers) would load them on any
import below it, also of a light module such as ``linmem.data.commands``, and so slow ``linmem CMD --help`` to
seconds. With ``lazy_exports`` the ``__init__`` only records where each name lives::

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"linmem.data.build": ("BuildOptions", "build_dataset")})

and ``from linmem.data import BuildOptions`` or ``linmem.data.BuildOptions`` imports ``linmem.data.build`` then.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for the ``__init__`` of ``package`` (its ``__name__``, while it is being
    imported). ``exports`` maps a module to the public names it defines; the first access of a name imports that
    module and keeps the value in the package, so later accesses are plain attribute lookups."""
    where = {name: module for module, names in exports.items() for name in names}
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__, sorted(where)
