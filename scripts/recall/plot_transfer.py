"""Held-out recall over fine-tuning, one panel per run of scripts/recall/transfer.py (arm and model), one line per
held-out format; with --loss-out, the runs' test loss over fine-tuning on one axis (runs that recorded it).

    python scripts/recall/plot_transfer.py docs/study/transfer/{text,gen,text8,text-lm,mix}.jsonl \
        --out docs/study/transfer/transfer.png [--facts 4] [--columns 5] [--loss-out LOSS.png]
        [--one-format went/roles/directions]

With --one-format, one axis instead: that held-out format's recall, one line per run. A log written as
``A.jsonl+B.jsonl`` is one fine-tune continued by another (transfer.py --save, then --model with the saved folder):
B's updates are counted on from A's (its records' ``prior_updates``) and drawn as one line.
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
        "wide": "text templates + MQAR, all ids but held-out", "oracle": "text templates + MQAR, all ids",
        "ids": "text templates, keys and values any id", "ids8": "any-id facts, 8 per sample",
        "ids-lm": "any-id facts + text (LM loss)", "lm": "text alone (LM loss)"}
TEXT_ARMS = ("text-lm", "ids-lm", "lm")
SLICE = 400_000  # tokens of text the arms with text drew from unless --text-tokens said otherwise
CHANCE = 0.25  # the lab's recall scores the value among 4 candidates


def title(record: dict) -> str:
    """A panel's title: the arm, and the model where the record names one (records before it was named: zoo:rdn);
    for the arms with text, its loss weight (other than 1) and whether it is the whole training split or the
    400,000-token slice (records before they said which: the slice); a learning rate other than 3e-4, a seed other
    than 0 and updates on the facts alone first, where the record says so."""
    name = f"{record.get('model', 'zoo:rdn')}: {ARMS.get(record['arm'], record['arm'])}"
    if record["arm"] in TEXT_ARMS:
        if record.get("lm_weight") not in (None, 1.0):
            name += f" x{record['lm_weight']:g}"
        name += ", whole text" if record.get("text_tokens", SLICE) > SLICE else ", 400k-token text"
    if record.get("facts_first"):
        name += f", facts alone first {record['facts_first']:,}"
    if record.get("lr", 3e-4) != 3e-4:
        name += f", lr {record['lr']:g}"
    if record.get("seed"):
        name += f", seed {record['seed']}"
    if record.get("batch", 32) != 32:
        name += f", batch {record['batch']}"
    if record.get("chained", 1) > 1:
        name += f", {record['chained']} fine-tunes chained"
    return name


def plot_one_format(runs: list[list[dict]], name: str, facts: int, out: Path, labels: list[str]) -> None:
    """Format ``name``'s clean recall at ``facts`` facts against the updates, a line per run (named ``labels``), on
    one axis."""
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for i, (records, label) in enumerate(zip(runs, labels)):
        if name not in records[0]:
            raise SystemExit(f"{records[0]['arm']} ({records[0].get('model')}) recorded no {name}")
        ax.plot([r["step"] for r in records], [r[name][LOAD_INDEX[facts]] for r in records], marker="o",
                markersize=3, color=f"C{i % 10}", linestyle="-" if i < 10 else "--", label=label)
    ax.axhline(CHANCE, color="grey", linestyle=":", linewidth=1, label="chance (4 candidates)")
    ax.set_title(f"{LABELS.get(name, name)}, {facts} facts", fontsize=9)
    ax.set_xlabel("fine-tuning updates")
    ax.set_ylabel(f"clean recall, {facts} facts")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    print(out)


def plot_loss(runs: list[list[dict]], out: Path, labels: list[str]) -> None:
    """Each run's test loss (nats per token) against its updates, on one axis from zero."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, (records, label) in enumerate((r, n) for r, n in zip(runs, labels) if "test_loss" in r[0]):
        ax.plot([r["step"] for r in records], [r["test_loss"] for r in records], marker="o", markersize=3,
                color=f"C{i % 10}", linestyle="-" if i < 10 else "--", label=label)
    ax.set_xlabel("fine-tuning updates")
    ax.set_ylabel("test loss (nats per token)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.15))  # below: lines stay clear
    fig.savefig(out, dpi=130, bbox_inches="tight")
    print(out)


def read(path: Path) -> list[dict]:
    """The JSON records of one run's output (other lines, such as progress, are skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def read_chain(logs: str) -> list[dict]:
    """The records of ``A.jsonl+B.jsonl+...`` as one run: each continuation's steps moved on by the updates before
    it (its ``prior_updates``) and its first evaluation, of the model the one before it saved, left out."""
    records = read(Path(logs.split("+")[0]))
    for path in logs.split("+")[1:]:
        more = read(Path(path))
        if not more or "prior_updates" not in more[0]:
            raise SystemExit(f"{path} does not continue a saved fine-tune (its records say no prior_updates)")
        records += [{**r, "step": r["step"] + r["prior_updates"]} for r in more if r["phase"] != "start"]
    if records:
        records[0] = {**records[0], "chained": logs.count("+") + 1}
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="transfer.py outputs (JSON lines); A.jsonl+B.jsonl: a chain")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--facts", type=int, default=4, choices=sorted(LOAD_INDEX))
    parser.add_argument("--columns", type=int, default=None, help="panels per row (default: all in one row)")
    parser.add_argument("--loss-out", type=Path, default=None, help="also plot the runs' test loss here")
    parser.add_argument("--one-format", default=None, choices=sorted(LABELS),
                        help="one axis: this format's recall, a line per run (instead of a panel per run)")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="a name per log for the legends (default: from the records: model, arm, options)")
    args = parser.parse_args()
    if args.labels and len(args.labels) != len(args.logs):
        parser.error(f"--labels names {len(args.labels)} runs, for {len(args.logs)} logs")
    runs = [read_chain(logs) for logs in args.logs]
    if empty := [logs for logs, records in zip(args.logs, runs) if not records]:
        raise SystemExit(f"no records in {', '.join(empty)}")
    labels = args.labels or [title(records[0]) for records in runs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.loss_out:
        plot_loss(runs, args.loss_out, labels)
    if args.one_format:
        plot_one_format(runs, args.one_format, args.facts, args.out, labels)
        return
    columns = min(args.columns or len(runs), len(runs))
    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * max(columns, 3), 3.0 * rows + 0.5), sharex=True, sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, records, run_label in zip(axes.flat, runs, labels):
        steps = [r["step"] for r in records]
        for i, (name, label) in enumerate(LABELS.items()):
            if name in records[0] and len(records[0][name]) > LOAD_INDEX[args.facts]:
                ax.plot(steps, [r[name][LOAD_INDEX[args.facts]] for r in records], marker="o", markersize=3,
                        color=f"C{i}", label=label)
        ax.axhline(CHANCE, color="grey", linestyle=":", linewidth=1)
        ax.set_title(run_label, fontsize=8)
        ax.set_xlabel("fine-tuning updates")
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
    for row in axes:
        row[0].set_ylabel(f"clean recall, {args.facts} facts")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles + [plt.Line2D([], [], color="grey", linestyle=":")], labels + ["chance (4 candidates)"],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.5 / (3.0 * rows + 0.5) + 0.03, 1, 1))
    fig.savefig(args.out, dpi=130)
    print(args.out)


if __name__ == "__main__":
    main()
