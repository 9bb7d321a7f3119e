"""Checkpoint folders ``OUT/checkpoints/step-XXXXXXXX/``, complete once their ``manifest.json`` is written (what
they hold: ``linmem.train.checkpoint``)."""

from __future__ import annotations

import re
from pathlib import Path

from linmem.io.manifest import MANIFEST_NAME

STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` with a manifest, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST_NAME).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None
