"""The names of ``linmem eval``'s tasks and the parsing of a ``--tasks`` list and of ``max_tokens``: standard library
only, so that the command's help and argument errors need neither torch nor the tasks' modules."""

from __future__ import annotations

TASKS = ("ppl", "cloze", "mqar", "niah", "recall", "stability")
WHOLE_SPLIT = 2**62  # ``max_tokens: all`` (a study's eval options, ``linmem eval --max-tokens all``): every window


def parse_max_tokens(text: str) -> int:
    """``"all"`` → ``WHOLE_SPLIT``, ``"65536"`` → 65536; anything else, a count below 1 included, raises
    ``ValueError``."""
    if text.strip() == "all":
        return WHOLE_SPLIT
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"max_tokens must be a whole number >= 1 or all; got {text!r}")
    return count


def parse_tasks(text: str) -> list[str]:
    """``"ppl,mqar"`` → ``["ppl", "mqar"]``; ``"all"`` → every task; unknown names raise ``ValueError``."""
    names = list(TASKS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {unknown or text!r}; choose from {', '.join(TASKS)} or all")
    return names
