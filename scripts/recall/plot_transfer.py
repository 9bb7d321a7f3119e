"""Held-out recall over fine-tuning, one panel per arm of scripts/recall/transfer.py, one line per held-out format.

    python scripts/recall/plot_transfer.py docs/study/transfer/{text,gen,text8,text-lm,mix}.jsonl \
        --out docs/study/transfer/transfer.png [--facts 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"went/roles/directions": "new template and words (went: roles -> directions)",
          "keeps/roles/materials": "new template and words (keeps: roles -> materials)",
          "went/names/colors": "new template only (went: names -> colours)",
          "code/roles/directions": "new words only (code: roles -> directions)"}
LOAD_INDEX = {1: 0, 4: 1, 8: 2}
ARMS = {"text": "text templates", "gen": "generated templates", "text8": "text templates, 8 facts",
        "text-lm": "text templates + text (LM loss)", "mix": "text templates + MQAR + NIAH",
        "wide": "text templates + MQAR, all ids but held-out", "oracle": "text templates + MQAR, all ids"}


def read(path: Path) -> list[dict]:
    """The JSON records of one run's output (other lines, such as progress, are skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--facts", type=int, default=4, choices=sorted(LOAD_INDEX))
    args = parser.parse_args()
    runs = [records for records in map(read, args.logs) if records]
    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.4), sharex=True, sharey=True,
                             squeeze=False)
    for ax, records in zip(axes[0], runs):
        steps = [r["step"] for r in records]
        for i, (name, label) in enumerate(LABELS.items()):
            if name in records[0] and len(records[0][name]) > LOAD_INDEX[args.facts]:
                ax.plot(steps, [r[name][LOAD_INDEX[args.facts]] for r in records], marker="o", markersize=3,
                        color=f"C{i}", label=label)
        ax.axhline(1 / args.facts if args.facts > 1 else 0, color="grey", linestyle=":", linewidth=1)
        ax.set_title(ARMS.get(records[0]["arm"], records[0]["arm"]), fontsize=9)
        ax.set_xlabel("fine-tuning updates")
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
    axes[0][0].set_ylabel(f"clean recall, {args.facts} facts (chance dotted)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(args.out)


if __name__ == "__main__":
    main()
