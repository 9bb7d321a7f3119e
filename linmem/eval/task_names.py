"""The names of ``linmem eval``'s tasks and the parsing of a ``--tasks`` list: standard library only, so that the
command's help and argument errors need neither torch nor the tasks' modules."""

from __future__ import annotations

TASKS = ("ppl", "cloze", "mqar", "niah", "recall", "stability")


def parse_tasks(text: str) -> list[str]:
    """``"ppl,mqar"`` → ``["ppl", "mqar"]``; ``"all"`` → every task; unknown names raise ``ValueError``."""
    names = list(TASKS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {unknown or text!r}; choose from {', '.join(TASKS)} or all")
    return names
