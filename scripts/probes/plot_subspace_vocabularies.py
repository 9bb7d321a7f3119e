"""Draw the subspace transfer within and across value vocabularies (paper 2, App. D.2) from `linmem probe` records.

    python scripts/probes/plot_subspace_vocabularies.py OUT.png --rank 4 \\
        GLA=docs/study/probes/gla.json:docs/study/probes/subspace-vocab/gla-animals.json ...

Each ``LABEL=SAME:OTHER`` pair names two probe records of one model: ``SAME`` tests the rank-k basis on facts of
the vocabulary it was learned on, ``OTHER`` on facts of another vocabulary (``--transfer-values``). One panel per
model: the donor-answer rate (with its source-bootstrap 95% interval) of each edit at rank k, the two records side
by side, on one 0-1 scale. A record whose test facts fall below its clean-recall gate is drawn hatched.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

EDITS = ("own", "basis", "orthogonal", "random")


def donor_answers(path: Path, rank: int) -> tuple[dict[str, tuple[float, float, float]], dict]:
    """``{edit: (mean, low, high)}`` of the donor-answer rate at ``rank`` and the experiment's summary."""
    experiment = json.loads(path.read_text(encoding="utf-8"))["experiments"]["subspace_transfer"]
    rows = {r["edit"]: (r["mean"], r["low"], r["high"]) for r in experiment["rows"]
            if r["metric"] == "donor_answer" and r["rank"] == rank}
    missing = [e for e in EDITS if e not in rows]
    if missing:
        raise SystemExit(f"{path}: no donor_answer rows at rank {rank} for {missing}")
    return rows, experiment["summary"]


def task_values(path: Path) -> str:
    """The value vocabulary of a record's task (records without ``--transfer-values`` test on it)."""
    found = re.search(r"values='([^']+)'", json.loads(path.read_text(encoding="utf-8"))["header"]["task"])
    if not found:
        raise SystemExit(f"{path}: the task's value vocabulary is not in its header")
    return found.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("pairs", nargs="+", metavar="LABEL=SAME:OTHER")
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args()
    fig, axes = plt.subplots(1, len(args.pairs), figsize=(4.4 * len(args.pairs), 4.2), squeeze=False)
    for ax, pair in zip(axes[0], args.pairs):
        label, _, paths = pair.partition("=")
        same_path, _, other_path = paths.partition(":")
        if not (label and same_path and other_path):
            raise SystemExit(f"expected LABEL=SAME:OTHER, got {pair!r}")
        width = 0.38
        for shift, path, colour in ((-width / 2, Path(same_path), "tab:blue"), (width / 2, Path(other_path),
                                                                                 "tab:orange")):
            rows, summary = donor_answers(path, args.rank)
            values = summary.get("test_values") or task_values(path)
            basis = summary.get("basis_values", values)
            below = summary.get("below_clean_recall", False)
            means = [rows[e][0] for e in EDITS]
            errors = [[rows[e][0] - rows[e][1] for e in EDITS], [rows[e][2] - rows[e][0] for e in EDITS]]
            ax.bar([i + shift for i in range(len(EDITS))], means, width, yerr=errors, capsize=3, color=colour,
                   hatch="//" if below else None, alpha=0.85,
                   label=f"{basis} basis -> {values} facts (clean recall {summary['clean_accuracy']:.2f}"
                         f"{', below the gate' if below else ''})")
        ax.set_xticks(range(len(EDITS)), EDITS)
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"donor answers, rank {args.rank} edit")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.suptitle("Subspace transfer (App. D.2): a value basis learned on colour facts, tested on colour facts and "
                 "on facts of another vocabulary", fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
