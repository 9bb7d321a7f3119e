"""What a model folder's ``train_info.json`` says about its training, read the same way by every command."""

from __future__ import annotations

from typing import Any


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
