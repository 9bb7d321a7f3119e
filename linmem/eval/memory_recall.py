"""The memory lab's clean recall (``linmem.memory.tasks``), when this linmem has it.

The memory lab (issue 4) builds donor/recipient key-value prompts in natural filler; its clean accuracy is the
recall number the zoo reports. It is written separately: this task calls its ``clean_recall(model, tokenizer,
**options) -> dict`` entry point when present and otherwise reports, plainly, that it is not available. It never
substitutes another measurement.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from linmem.eval.loading import EvalModel

ENTRY_POINT = "clean_recall"


def memory_lab_tasks():
    """The ``linmem.memory.tasks`` module, or None if this linmem has no memory lab yet."""
    try:
        if importlib.util.find_spec("linmem.memory.tasks") is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module("linmem.memory.tasks")


def memory_recall(em: EvalModel, seed: int = 0) -> dict[str, Any]:
    """``{"available": True, "metrics": ...}`` from the memory lab, or ``{"available": False, "reason": ...}``."""
    tasks = memory_lab_tasks()
    if tasks is None:
        return {"available": False, "reason": "not available: linmem.memory.tasks is not part of this linmem "
                                              "version (the memory lab is written separately)"}
    entry = getattr(tasks, ENTRY_POINT, None)
    if entry is None:
        return {"available": False, "reason": f"not available: linmem.memory.tasks has no {ENTRY_POINT}(model, "
                                              f"tokenizer, ...) entry point yet"}
    result = entry(em.model, em.tokenizer, seed=seed)
    return {"available": True, "metrics": dict(result)}
