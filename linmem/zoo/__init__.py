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

from linmem.io.lazy import lazy_exports
from linmem.io.run_info import read_train_info
from linmem.io.zoo_dir import ENV_VAR, MAIN, PACKAGE_DIR, UnknownModelError, names, order, path, root

# ``load`` (torch, transformers) loads with its module on first use, so that ``linmem zoo --help`` imports neither
__getattr__, __dir__, _ = lazy_exports(__name__, {"linmem.zoo.loading": ("load",)})

HELDOUT_DIR = "_heldout"
SIZE_LIMIT = 10_000_000  # bytes per shipped model folder: 10 MB


def eval_record(name: str, root_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The shipped model's ``eval.json`` (what its model card shows)."""
    return json.loads((path(name, root_dir) / "eval.json").read_text(encoding="utf-8"))


def heldout_dir(name: str, root_dir: str | os.PathLike | None = None) -> Path:
    """The held-out token dataset shipped for model ``name`` (recorded in its ``train_info.json``)."""
    folder = path(name, root_dir)
    return (folder / read_train_info(folder)["dataset"]).resolve()


def folder_bytes(folder: Path) -> int:
    """Total size of the files in ``folder`` (not recursive: a model folder is flat)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


__all__ = ["ENV_VAR", "MAIN", "PACKAGE_DIR", "SIZE_LIMIT", "UnknownModelError", "eval_record", "heldout_dir", "load",
           "names", "order", "path", "root"]
