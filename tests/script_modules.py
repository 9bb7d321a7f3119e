"""Scripts under ``scripts/`` as modules in the test process: loaded by path, and ``main`` run with its printed
output captured (a fresh process per call would import torch again each time)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` imported as module ``name``; registered in ``sys.modules`` (its dataclasses look their
    module up there) and with its own folder on ``sys.path`` (for imports of its sibling scripts)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def printed(main: Callable[[list[str]], object], *args: str) -> str:
    """What ``main(list(args))`` prints to standard output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(args))
    return out.getvalue()
