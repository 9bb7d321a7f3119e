#!/usr/bin/env python3
"""Print the shell commands of one README code block, so that CI runs the README's own words.

A block is named by the HTML comment ``<!-- ci: NAME -->`` on the line before its opening fence. Its commands are
printed one per line, with comments (``# ...`` after two spaces or at the line's start) and blank lines dropped, so
``eval "$(python3 .ci/readme_commands.py install)"`` runs exactly what a reader of the README types.

    python3 .ci/readme_commands.py NAME [README]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARK = re.compile(r"<!--\s*ci:\s*([\w-]+)\s*-->")


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


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    readme = Path(argv[1]) if len(argv) == 2 else Path(__file__).resolve().parent.parent / "README.md"
    named = blocks(readme.read_text(encoding="utf-8"))
    if argv[0] not in named:
        print(f"{readme}: no code block named {argv[0]!r} (named: {', '.join(sorted(named)) or 'none'})",
              file=sys.stderr)
        return 2
    print("\n".join(named[argv[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
