"""What a model folder's ``train_info.json`` says about its training, read the same way by every command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRAIN_INFO = "train_info.json"


def read_train_info(folder: str | Path) -> dict[str, Any]:
    """The ``train_info.json`` of model folder ``folder`` (``{}`` when it has none: a model linmem did not train)."""
    path = Path(folder) / TRAIN_INFO
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def total_tokens(info: dict[str, Any]) -> int | None:
    """Tokens a model was trained on over all its stages: its own run's ``tokens`` plus those of every earlier
    stage it started from (the ``init_from`` chain ``train.init_from`` records); None if ``tokens`` is unknown."""
    if info.get("tokens") is None:
        return None
    total, source = int(info["tokens"]), info.get("init_from")
    while source:
        total += int(source.get("tokens") or 0)
        source = source.get("init_from")
    return total
