"""The zoo's first stage against its second: one row per main model and stage, the headline columns of docs/zoo.md.

    python scripts/zoo/compare_stages.py docs/zoo/runs/stage1 [ZOO_DIR]

Reads ``STAGE1_DIR/<name>.eval.json`` (the first-stage records kept in the repository) and the shipped models'
``eval.json`` (the package's zoo, or ZOO_DIR), and prints a markdown table built with linmem.zoo.cards, so every
cell is what ``linmem zoo ship`` measured.
"""

import json
import sys
from pathlib import Path

import linmem.zoo as zoo
from linmem.zoo import cards

COLUMNS = ("updates", "test ppl", "MQAR 2", "MQAR 4", "MQAR 8", "MQAR 16", "NIAH 256", "NIAH 512", "NIAH 1024",
           "recall [95% CI]")


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    stage1_dir = Path(sys.argv[1])
    zoo_dir = sys.argv[2] if len(sys.argv) > 2 else None
    names = [n for n in zoo.names(zoo_dir) if n in zoo.MAIN]
    pairs = []
    for name in names:
        first = stage1_dir / f"{name}.eval.json"
        if not first.is_file():
            raise SystemExit(f"{first}: no first-stage record of {name!r}")
        pairs.append((json.loads(first.read_text()), json.loads((zoo.path(name, zoo_dir) / "eval.json").read_text())))
    header, rows = cards.overview_rows([r for pair in pairs for r in pair], shipped=())
    keep = [header.index(c) for c in COLUMNS]
    chance = rows[-1]
    print("\n".join(cards.table(["model", "stage", *COLUMNS],
                                [[row[0], stage, *(row[i] for i in keep)]
                                 for row, stage in zip(rows[:-1], ["1", "2"] * len(pairs))]
                                + [["chance", "", *(chance[i] for i in keep)]])))


if __name__ == "__main__":
    main()
