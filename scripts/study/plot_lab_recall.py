"""Draw the recall in held-out formats that training runs logged (``train.eval_lab_recall``), from their
``metrics.jsonl`` files, as the study's ``lab_recall.png`` draws it for a study's runs.

    python scripts/study/plot_lab_recall.py MODEL=FILE.jsonl [MODEL=FILE.jsonl ...] --out FIGURE.png

A model named more than once gets one line over its files (its seeds), their range shaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from linmem.study.figures import lab_recall_figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="MODEL=metrics.jsonl")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    logs: dict[str, list[list[dict]]] = {}
    for item in args.runs:
        model, sep, file = item.partition("=")
        if not sep or not model:
            parser.error(f"expected MODEL=FILE.jsonl; got {item!r}")
        rows = [json.loads(line) for line in Path(file).read_text(encoding="utf-8").splitlines() if line.strip()]
        logs.setdefault(model, []).append(rows)
    fig = lab_recall_figure(logs)
    if fig is None:
        parser.error("no row of these files holds a val_lab_recall metric (train.eval_lab_recall)")
    fig.savefig(args.out, dpi=110, metadata={"Software": None})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
