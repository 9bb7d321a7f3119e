"""Checkpoint folders on disk: ``OUT/checkpoints/step-XXXXXXXX/``, complete once their ``manifest.json`` is written.

What a checkpoint holds and how it is written is ``linmem.train.checkpoint``'s; finding the newest complete one is
needed below training too (a run folder names its newest checkpoint when it has no ``model/``).
"""

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
