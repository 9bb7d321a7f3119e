#!/usr/bin/env python3
"""The README's command blocks, and the check that ``.ci/run`` runs exactly them.

A block is named by the HTML comment ``<!-- ci: NAME -->`` on the line before its opening fence; its commands are
its lines with comments (``# ...`` after two spaces or at the line's start) and blank lines dropped. ``.ci/run``
writes each command as ``step COMMAND`` (optionally ``|| ...`` after it); ``--check`` compares those commands, in
order, with the blocks ``CI_BLOCKS`` of the README and fails naming the first difference.

    python3 .ci/readme_commands.py NAME [README]        print block NAME's commands
    python3 .ci/readme_commands.py --check CI_FILE      check CI_FILE's step commands against the README
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARK = re.compile(r"<!--\s*ci:\s*([\w-]+)\s*-->")
CI_BLOCKS = ("install", "test", "sources", "test-sources")  # the order .ci/run runs them in
README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(text: str) -> dict[str, list[str]]:
    """``{name: [command, ...]}`` for every named code block of ``text``."""
    lines = text.splitlines()
    found: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        mark = MARK.fullmatch(line.strip())
        if mark is None:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"README line {i + 1}: '{line.strip()}' is not followed by a code block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"README line {i + 2}: the code block named {mark.group(1)!r} is never closed")
        commands = [re.split(r"(?:^|\s{2,})#", body)[0].strip() for body in lines[i + 2:end]]
        found[mark.group(1)] = [c for c in commands if c]
    return found


def step_commands(script: str) -> list[str]:
    """The commands of the ``step COMMAND [|| ...]`` lines of a shell script, in order."""
    found = []
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("step "):
            found.append(line[len("step "):].split(" || ")[0].strip())
    return found


def check(ci_file: Path, readme: Path = README) -> str | None:
    """Why ``ci_file``'s step commands differ from the README's ``CI_BLOCKS`` (None when they are the same)."""
    named = blocks(readme.read_text(encoding="utf-8"))
    missing = [name for name in CI_BLOCKS if name not in named]
    if missing:
        return f"{readme}: no code block named {', '.join(missing)}"
    wanted = [command for name in CI_BLOCKS for command in named[name]]
    run = step_commands(ci_file.read_text(encoding="utf-8"))
    for i, (want, got) in enumerate(zip(wanted, run)):
        if want != got:
            return f"{ci_file}: step {i + 1} runs {got!r}; the README says {want!r}"
    if len(wanted) != len(run):
        return f"{ci_file}: {len(run)} step commands; the README's blocks hold {len(wanted)}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check":
        problem = check(Path(argv[1]))
        if problem:
            print(f"README and CI disagree: {problem}", file=sys.stderr)
            return 1
        return 0
    if len(argv) not in (1, 2) or argv[0].startswith("-"):
        print(__doc__.strip().split("\n\n")[-1], file=sys.stderr)
        return 2
    readme = Path(argv[1]) if len(argv) == 2 else README
    named = blocks(readme.read_text(encoding="utf-8"))
    if argv[0] not in named:
        print(f"{readme}: no code block named {argv[0]!r} (named: {', '.join(sorted(named)) or 'none'})",
              file=sys.stderr)
        return 2
    print("\n".join(named[argv[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
