"""The second paper's claims judged over the seeds of one recipe, read from their `linmem probe` records.

    python scripts/probes/seed_verdicts.py LABEL=SEED.json[+MORE.json],SEED.json,... [LABEL=...] [--out TABLE.md]
        [--plot FIGURE.png]

A LABEL is one model under one recipe, its records the probes of its seeds (each may join several records of one
seed as in probe_table.py, `A.json+B.json`). For each claim of "How Linear Attention Remembers" that a probe of a
pure recurrent model measures with an interval, a table gives each seed's statistic with its source-bootstrap 95%
interval (as the record holds it) and a verdict over the seeds:

- **agrees**: at least MIN_SEEDS seeds pass the probe's clean-recall gate, and in every one of them the interval
  lies on the paper's side of the claim's rule;
- **disagrees**: as many seeds, each interval on the other side;
- **not resolved**: anything else (a seed whose interval holds the boundary, seeds that split, or fewer than
  MIN_SEEDS seeds above the gate: a seed below it has no attribution to judge).

Each claim's rule is printed beside it. Where the paper compares an edit with its control, the rule compares the
two intervals (they must not overlap), which asks more than a test of the paired difference would. Left out: the
hybrid's KV-vs-recurrent split and the pure model's recurrent share (rows 10-11: a hybrid, or the
`hybrid_attribution` experiment, is needed), the load-32 and edit-strength claims (rows 15-16: the sweeps stop at
K = 8), the subspace's transfer to another vocabulary (row 20's second half: another record) and natural-sentence
retrieval (row 23: scripts/recall/natural_sentence.py).

`--plot` draws the claims measured in logits (margin changes) for every LABEL on one scale: each seed's interval,
the zero line, and the verdict.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from probe_table import Record, ci, lifecycle

MIN_SEEDS = 3  # docs/results.md decides no comparison over fewer seeds
PAPER, OTHER, UNDECIDED = 1, -1, 0


@dataclass(frozen=True)
class Reading:
    """One seed's statistic: its text, which side of the claim's rule its interval lies on, and (for the figure)
    the interval in logits where the claim is a margin change."""

    text: str
    side: int
    logits: tuple[float, float, float] | None = None


def sign_side(row: dict, paper_sign: int) -> int:
    """PAPER when the interval excludes zero with the paper's sign, OTHER when it excludes it with the other."""
    if row["low"] > 0:
        return PAPER if paper_sign > 0 else OTHER
    if row["high"] < 0:
        return PAPER if paper_sign < 0 else OTHER
    return UNDECIDED


def above(a: dict, b: dict) -> int:
    """PAPER when ``a``'s interval lies above ``b``'s, OTHER when below, UNDECIDED when they overlap."""
    if a["low"] > b["high"]:
        return PAPER
    if a["high"] < b["low"]:
        return OTHER
    return UNDECIDED


def margin(row: dict, paper_sign: int, control: dict | None = None, label: str = "") -> Reading:
    text = ci(row) + (f" ({label} {ci(control)})" if control is not None else "")
    return Reading(text, sign_side(row, paper_sign), (row["mean"], row["low"], row["high"]))


def write_block(r: Record) -> Reading:
    return margin(lifecycle(r, "write block", "chosen", "target_margin_change"), -1,
                  lifecycle(r, "write block", "control head", "target_margin_change"), "control head")


def donor_write(r: Record) -> Reading:
    return margin(lifecycle(r, "donor write", "chosen", "donor_margin_shift"), +1,
                  lifecycle(r, "donor write", "random", "donor_margin_shift"), "random write")


def first_everywhere(r: Record) -> Reading:
    s = r.summary("head_scan")
    if not s:
        raise KeyError("head_scan")
    first, sources, stable = s["top1_sources"], s["sources"], s["loso_agreement"]
    confirmed = r.header.get("confirmed_on_held_out")
    everywhere = first == sources and stable == sources
    side = PAPER if everywhere and confirmed else OTHER if 2 * first < sources or confirmed is False else UNDECIDED
    return Reading(f"{s['chosen']} first on {first} of {sources}, {stable} of {sources} left out; "
                   f"{'confirmed' if confirmed else 'not confirmed'}", side)


def state_swap(r: Record) -> Reading:
    return margin(lifecycle(r, "state swap", "chosen", "donor_margin_shift"), +1,
                  lifecycle(r, "state swap", "random", "donor_margin_shift"), "random swap")


def output_patch(r: Record) -> Reading:
    return margin(lifecycle(r, "output patch", "chosen", "donor_margin_shift"), +1,
                  lifecycle(r, "output patch", "control head", "donor_margin_shift"), "control head")


RESTORE_SHARE = 0.1  # "near zero": within this share of the seed's own state-swap shift


def output_restore(r: Record) -> Reading:
    restored = lifecycle(r, "output restore", "chosen", "donor_margin_shift")
    bound = RESTORE_SHARE * abs(lifecycle(r, "state swap", "chosen", "donor_margin_shift")["mean"])
    inside = -bound <= restored["low"] and restored["high"] <= bound
    outside = restored["low"] > bound or restored["high"] < -bound
    side = PAPER if inside else OTHER if outside else UNDECIDED
    return Reading(f"{ci(restored)} (bound ±{bound:.2f})", side,
                   (restored["mean"], restored["low"], restored["high"]))


def interaction(r: Record) -> Reading:
    s = r.summary("head_interaction")
    if not s:
        raise KeyError("head_interaction")
    side = PAPER if s["low"] > 0 or s["high"] < 0 else UNDECIDED
    return Reading(f"{s['hub']} + {s['secondary']}: {s['interaction']:+.3f} [{s['low']:.3f}, {s['high']:.3f}]",
                   side, (s["interaction"], s["low"], s["high"]))


SELECTIVE = 0.1  # "the other facts stay": a non-target break rate below this (the paper's: 0.4-1.4 %)


def four_facts(r: Record) -> Reading:
    target = r.row("four_facts", fact="target", metric="donor_answer")
    broken = r.row("four_facts", fact="non-target", metric="break_rate")
    moves = above(target, broken)
    side = (PAPER if moves == PAPER and broken["high"] < SELECTIVE
            else OTHER if moves == OTHER or broken["low"] > SELECTIVE else UNDECIDED)
    return Reading(f"target {ci(target)}, non-target break {ci(broken)}", side)


def coupling(r: Record) -> Reading:
    parallel = r.row("four_facts", fact="B", part="parallel", control="direction", metric="target_margin_change")
    orthogonal = r.row("four_facts", fact="B", part="orthogonal", control="direction",
                       metric="target_margin_change")
    sides = {sign_side(parallel, -1), sign_side(orthogonal, +1)}
    side = sides.pop() if len(sides) == 1 else UNDECIDED
    return Reading(f"parallel {ci(parallel)}, orthogonal {ci(orthogonal)}", side)


def load(r: Record) -> Reading:
    clean = {x["num_bindings"]: x for x in r.measured("sweep_num_bindings")
             if x["edit"] == "chosen" and x["metric"] == "clean_correct"}
    fewest, most = clean[min(clean)], clean[max(clean)]
    return Reading(f"K = {min(clean)} {ci(fewest)}, K = {max(clean)} {ci(most)}", above(fewest, most))


def load_vs_gap(r: Record) -> Reading:
    recall = r.row("load_vs_gap", comparison="load drop − gap drop", metric="clean_correct")
    in_logits = r.row("load_vs_gap", comparison="load drop − gap drop", metric="target_margin")
    return Reading(f"margin {ci(in_logits)}, recall {ci(recall)}", sign_side(in_logits, +1))


def overlap(r: Record) -> Reading:
    return margin(r.row("overlap", edit="align", metric="target_margin_change"), -1,
                  r.row("overlap", edit="orthogonal", metric="target_margin_change"), "orthogonalised")


WEAK = 0.5  # "correlate only weakly": a Spearman coefficient below this


def spearman(r: Record) -> Reading:
    s = r.summary("write_read_spearman")
    if not s:
        raise KeyError("write_read_spearman")
    side = PAPER if s["high"] < WEAK else OTHER if s["low"] > WEAK else UNDECIDED
    return Reading(f"{s['spearman']:.2f} [{s['low']:.2f}, {s['high']:.2f}] over {s['components']} heads", side)


def logit_lens(r: Record) -> Reading:
    layer = int(r.header["chosen"][1:].split("H")[0])
    by_layer = {x["layer"]: x for x in r.measured("logit_lens")}
    if layer == 0:
        return Reading(f"L0 {ci(by_layer[0])}: no layer before it", UNDECIDED)
    before, at = by_layer[layer - 1], by_layer[layer]
    return Reading(f"L{layer - 1} {ci(before)}, L{layer} {ci(at)}", above(at, before))


def neutral(r: Record) -> Reading:
    target = r.row("neutral_suppression", fact="target", metric="change")
    other = r.row("neutral_suppression", fact="other", metric="change")
    return Reading(f"target {ci(target)}, other facts {ci(other)}", sign_side(target, -1))


def joint_top1(r: Record) -> Reading:
    share = r.row("joint_topk", k=1, metric="share_of_full")
    side = PAPER if share["low"] > 0.5 else OTHER if share["high"] < 0.5 else UNDECIDED
    return Reading(ci(share), side)


def corrector(r: Record) -> Reading:
    change = r.row("corrector", predictor="model+corrector − model", metric="accuracy_change")
    return Reading(ci(change), sign_side(change, +1))


def subspace(r: Record, rank: int = 4) -> Reading:
    cell = {x["edit"]: x for x in r.rows("subspace_transfer")
            if x["metric"] == "donor_answer" and x["rank"] == rank and not x["full"]}
    return Reading(f"basis {ci(cell['basis'])}, random {ci(cell['random'])}", above(cell["basis"], cell["random"]))


@dataclass(frozen=True)
class Claim:
    row: str
    claim: str
    rule: str
    read: Callable[[Record], Reading]


CLAIMS = [
    Claim("1", "blocking the chosen head's writes over the fact harms recall",
          "the answer's margin change < 0 (logits)", write_block),
    Claim("2", "the donor's write carries content", "the donor-margin shift > 0 (logits)", donor_write),
    Claim("3", "recall runs through one head, which ranks first across sources",
          "first on every development source and with any one left out, and its state swap above the random "
          "swap's on the held-out sources (other side: first on fewer than half, or not confirmed)",
          first_everywhere),
    Claim("4", "swapping the head's pre-query state moves the answer to the donor's",
          "the donor-margin shift > 0 (logits)", state_swap),
    Claim("5", "patching the head's query-time output carries the donor effect",
          "the donor-margin shift > 0 (logits)", output_patch),
    Claim("6", "restoring the recipient's output after the swap removes the effect",
          f"the shift within ±{RESTORE_SHARE:g} of the seed's swap shift", output_restore),
    Claim("7", "heads interact non-additively", "the interaction's interval excludes 0 (no other side)",
          interaction),
    Claim("8", "four-fact edits are selective: the target moves, the other facts stay",
          f"target donor answers above the non-target break rate, whose interval lies below {SELECTIVE:g}",
          four_facts),
    Claim("9", "edits are coupled: A's part parallel to B lowers B's margin, the orthogonal part raises it",
          "parallel < 0 and orthogonal > 0 (logits)", coupling),
    Claim("12", "more facts hurt recall", "clean recall at the fewest facts above that at the most", load),
    Claim("13", "more facts hurt recall more than a longer gap",
          "the drop in the answer's margin from the fewest to the most facts, less its drop from the shortest to "
          "the longest gap, > 0 (logits, sources paired)", load_vs_gap),
    Claim("14", "keys aligned to the fact's key lower its margin", "the margin change < 0 (logits)", overlap),
    Claim("17", "write and read importance correlate only weakly", f"Spearman's interval below {WEAK:g}",
          spearman),
    Claim("18", "the logit lens jumps at the chosen head's layer",
          "lens accuracy at the chosen layer above the layer before", logit_lens),
    Claim("19", "a neutral counterfactual state suppresses the target fact",
          "the target's recall change < 0 (the other facts' change is shown, not judged)", neutral),
    Claim("20", "a rank-4 basis of the value subspace carries the edit (D.2)",
          "donor answers of the basis edit above a random rank-4 edit's", subspace),
    Claim("21", "the top-1 head recovers most of the full swap", "joint top-1 share > 0.5", joint_top1),
    Claim("22", "a corrector on state features rescues some errors", "accuracy change > 0", corrector),
]


def verdict(readings: list[Reading | None], gate_passed: int) -> str:
    sides = [x.side for x in readings if x is not None]
    if gate_passed < MIN_SEEDS:
        return f"not resolved ({gate_passed} of {len(readings)} seeds pass the gate)"
    if len(sides) < MIN_SEEDS:
        return f"not resolved (measured on {len(sides)} of {len(readings)} seeds)"
    if all(s == PAPER for s in sides):
        return "agrees"
    if all(s == OTHER for s in sides):
        return "disagrees"
    return "not resolved"


def read(record: Record, claim: Claim) -> Reading | None:
    """The seed's reading, or None where its record does not hold the experiment (or the seed is below the gate)."""
    if not record.header.get("clean_recall_passed"):
        return None
    try:
        return claim.read(record)
    except (KeyError, IndexError, StopIteration):
        return None


def gate_text(record: Record) -> str:
    recall = record.header.get("clean_recall", {})
    return (f"below the gate ({recall.get('development', float('nan')):.2f} / "
            f"{recall.get('confirmation', float('nan')):.2f})")


@dataclass(frozen=True)
class Judged:
    """One claim over a group's seeds: each seed's reading (None where not measured or below the gate) and the
    verdict."""

    claim: Claim
    readings: list[Reading | None]
    verdict: str


def judge(seeds: list[tuple[str, Record]]) -> tuple[int, list[Judged]]:
    """How many seeds pass the clean-recall gate, and every claim read and judged over the seeds."""
    passed = sum(bool(r.header.get("clean_recall_passed")) for _, r in seeds)
    judged = []
    for claim in CLAIMS:
        readings = [read(r, claim) for _, r in seeds]
        judged.append(Judged(claim, readings, verdict(readings, passed)))
    return passed, judged


def group_table(label: str, seeds: list[tuple[str, Record]]) -> str:
    passed, judged = judge(seeds)
    lines = [f"**{label}** ({len(seeds)} seeds, {passed} at or above the clean-recall gate)", "",
             "| row | claim | rule (paper's side) | " + " | ".join(name for name, _ in seeds) + " | verdict |",
             "|---" * (len(seeds) + 4) + "|"]
    for j in judged:
        cells = [x.text if x is not None else gate_text(r) if not r.header.get("clean_recall_passed")
                 else "not measured" for x, (_, r) in zip(j.readings, seeds)]
        lines.append(f"| {j.claim.row} | {j.claim.claim} | {j.claim.rule} | " + " | ".join(cells) +
                     f" | {j.verdict} |")
    return "\n".join(lines) + "\n"


SHORT = {  # the claims the figure draws, all margin changes in logits
    "1": "write block\n(paper: < 0)", "2": "donor write\n(paper: > 0)", "4": "state swap\n(paper: > 0)",
    "5": "output patch\n(paper: > 0)", "6": "swap, then restore\n(paper: near 0)", "14": "aligned keys\n(paper: < 0)",
}


def plot(groups: list[tuple[str, list[tuple[str, Record]]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 3.2 * len(groups)), sharey=True, squeeze=False)
    for ax, (label, seeds) in zip(axes[:, 0], groups):
        passed, judged = judge(seeds)
        in_logits = [j for j in judged if j.claim.row in SHORT]
        width = 0.8 / len(seeds)
        for i, judged_claim in enumerate(in_logits):
            for j, (reading, (name, _)) in enumerate(zip(judged_claim.readings, seeds)):
                if reading is None or reading.logits is None:
                    continue
                mean, low, high = reading.logits
                x = i - 0.4 + width * (j + 0.5)
                ax.errorbar([x], [mean], yerr=[[mean - low], [high - mean]], fmt="o", color=f"C{j}", capsize=3,
                            label=name if i == 0 else None)
            ax.text(i, 1.0, judged_claim.verdict.split(" (")[0], transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(in_logits)), [f"row {c.claim.row}: {SHORT[c.claim.row]}" for c in in_logits],
                      fontsize=8)
        ax.set_ylabel("margin change (logits)")
        ax.set_title(f"{label}: each seed's 95% interval over the confirmation sources "
                     f"({passed} of {len(seeds)} seeds pass the clean-recall gate)", fontsize=9, pad=14)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_group(item: str) -> tuple[str, list[tuple[str, Record]]]:
    label, sep, paths = item.partition("=")
    if not sep or not label or not paths:
        raise ValueError(f"expected LABEL=SEED.json,SEED.json,...; got {item!r}")
    seeds = []
    for seed in paths.split(","):
        files = [Path(p) for p in seed.split("+")]
        seeds.append((files[0].stem, Record(*files)))
    return label, seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="+", help="LABEL=SEED.json,SEED.json,... (one model under one recipe)")
    parser.add_argument("--out", type=Path, help="write the tables here as well")
    parser.add_argument("--plot", type=Path, help="the claims in logits, every group on one scale")
    args = parser.parse_args()
    try:
        groups = [parse_group(item) for item in args.groups]
    except (ValueError, OSError) as e:
        parser.error(str(e))
    text = "\n".join(group_table(label, seeds) for label, seeds in groups)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    if args.plot:
        plot(groups, args.plot)
    print(text, end="")


if __name__ == "__main__":
    main()
