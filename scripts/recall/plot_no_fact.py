"""Clean recall against its no-fact control: one panel per recall format, per model three bars at one load: the
clean recall, the no-fact control (the same items with the asked fact replaced by filler: what the text alone
guesses) and the recall over the items whose text guess is wrong (the fact has to overturn it), from the
``results.json`` of ``linmem eval MODEL --tasks recall ...`` runs.

    python scripts/recall/plot_no_fact.py docs/study/no-fact/*.json --out docs/study/no-fact/no-fact.png \
        [--facts 4] [--labels "GDN (zoo)" ...]

Each file is one model on one format; files of one format share a panel, in the order given. Intervals: the eval's
source-bootstrap 95% CIs (none is recorded for the third bar, drawn without one).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CHANCE = 0.25  # the lab's recall scores the value among 4 candidates
BARS = (("accuracy", "ci_low", "ci_high", "clean recall"),
        ("no_fact", "no_fact_low", "no_fact_high", "no fact in context (the text's guess)"),
        ("against_text", None, None, "clean recall where the text guesses wrong"))


def read(path: Path, facts: int) -> tuple[str, str, dict]:
    """``(format, model folder, metrics)`` of one eval ``results.json`` (the folder tells models of one name
    apart, such as two fine-tunes of one model); ``ValueError`` for a file without the no-fact control at
    ``facts``."""
    record = json.loads(path.read_text())
    recall = record.get("tasks", {}).get("recall", {})
    metrics = recall.get("metrics", {})
    if f"no_fact@{facts}" not in metrics:
        raise ValueError(f"{path}: no recall with the no-fact control at {facts} facts (run linmem eval --tasks "
                         f"recall --recall-bindings {facts})")
    fmt = f"{metrics['template']} / {metrics['keys']} -> {metrics['values']}"
    return fmt, record.get("model", path.stem), metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of linmem eval --tasks recall")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--facts", type=int, default=4, help="the load drawn (4)")
    parser.add_argument("--labels", nargs="+", help="one name per model, in the order of its first file")
    args = parser.parse_args()
    panels: dict[str, list[tuple[str, dict]]] = {}
    for path in args.results:
        fmt, name, metrics = read(path, args.facts)
        panels.setdefault(fmt, []).append((name, metrics))
    names = list(dict.fromkeys(name for rows in panels.values() for name, _ in rows))
    if args.labels and len(args.labels) != len(names):
        parser.error(f"--labels names {len(args.labels)} models; the files hold {len(names)}: {names}")
    label = dict(zip(names, args.labels or [Path(name).name for name in names]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), sharey=True, squeeze=False)
    width = 0.27
    for ax, (fmt, rows) in zip(axes[0], panels.items()):
        for b, (key, low, high, text) in enumerate(BARS):
            xs = [i + (b - 1) * width for i in range(len(rows))]
            values = [m[f"{key}@{args.facts}"] for _, m in rows]
            errors = None
            if low:
                errors = [[v - m[f"{low}@{args.facts}"] for v, (_, m) in zip(values, rows)],
                          [m[f"{high}@{args.facts}"] - v for v, (_, m) in zip(values, rows)]]
            ax.bar(xs, values, width, yerr=errors, capsize=2, label=text, color=f"C{b}")
            if not low:  # no interval to read the bar against: its value, so that a bar at zero reads as zero
                for x, v in zip(xs, values):
                    ax.text(x, v + 0.01, f"{v:.2f}", ha="center", va="bottom", fontsize=6, color=f"C{b}")
        ax.axhline(CHANCE, color="grey", linestyle=":", linewidth=1, label="chance (4 candidates)")
        ax.set_xticks(range(len(rows)), [label[name] for name, _ in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(fmt, fontsize=9)
        ax.set_ylim(0, 1.1)
    axes[0][0].set_ylabel(f"4-choice accuracy at {args.facts} facts")
    handles, texts = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, texts, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
