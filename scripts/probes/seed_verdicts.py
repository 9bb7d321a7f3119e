"""The second paper's claims tested over the seeds of one recipe, read from their `linmem probe` records.

    python scripts/probes/seed_verdicts.py LABEL=SEED.json[+MORE.json],SEED.json,... [LABEL=...] [--out TABLE.md]
        [--plot FIGURE.png]

A LABEL is one model under one recipe, its records the probes of its seeds (each may join several records of one
seed as in probe_table.py, `A.json+B.json`). For each claim of "How Linear Attention Remembers" that a probe of a
pure recurrent model measures, a table gives each seed's statistic with its source-bootstrap 95% interval (as the
record holds it, a description of that seed), each seed's **effect** and a verdict over the seeds.

A claim's effect is one number per seed in the claim's units, measured from the boundary of the claim's rule and
signed so that > 0 is the paper's side: a margin change the paper finds negative gives -mean, "a above b" gives
a - b, a Spearman coefficient that should be weak gives 0.5 - value (each claim's definition is printed beside it).
The verdict is a test of the seeds' effects against 0 (`linmem.study.estimates`, the rule `linmem study` decides its
claims by): a two-sided one-sample t-test (df = seeds - 1), its p-value Holm-corrected over every claim of the label
that has an effect (a claim measured on fewer than MIN_SEEDS seeds counts with p = 1, so that a missing measurement
never shrinks the family), and the exact sign-flip p-value beside it where there are at most 10 seeds (reported,
not deciding: at 3 seeds it is never below 0.25):

- **agrees**: at least MIN_SEEDS seeds pass the probe's clean-recall gate and have an effect, the Holm-adjusted p is
  below 0.05 and the mean effect is > 0;
- **disagrees**: the same with a mean effect < 0;
- **not resolved**: anything else, with the reason (the adjusted p and the seeds, or too few seeds above the gate:
  a seed below it has no attribution to judge);
- **descriptive**: a claim without a per-seed number that has a boundary (row 3's "first on every source" is a
  count against "all"; row 7's interaction is the paper's on either sign): shown, never decided.

Why a test and not the seeds' intervals: "every seed's interval on the paper's side" is no test over seeds. Under
pure noise three seeds all fall on one side a quarter of the time, and some twenty claims judged that way give
several agreements by chance. The t-test holds its 5% level at any number of seeds when the seeds' effects scatter
roughly normally, and Holm's step-down holds the family-wise error of the label's claims at 5%.

Left out: the hybrid's KV-vs-recurrent split and the pure model's recurrent share (rows 10-11: a hybrid, or the
`hybrid_attribution` experiment, is needed), the load-32 and edit-strength claims (rows 15-16: the sweeps stop at
K = 8), the subspace's transfer to another vocabulary (row 20's second half: another record) and natural-sentence
retrieval (row 23: scripts/recall/natural_sentence.py).

`--plot` draws the claims measured in logits (margin changes) for every LABEL on one scale: each seed's interval,
the zero line, and the verdict with its Holm-adjusted p.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from probe_table import Record, ci, lifecycle

from linmem.study.definition import MIN_SEEDS
from linmem.study.estimates import ALPHA, PairedTest, holm, paired_test


@dataclass(frozen=True)
class Reading:
    """One seed's statistic: its text (the record's means and intervals), its effect (module docstring; None where
    the claim has none or this seed cannot give one) and, for the figure, the interval in logits where the claim is
    a margin change."""

    text: str
    effect: float | None
    logits: tuple[float, float, float] | None = None


def margin(row: dict, paper_sign: int, control: dict | None = None, label: str = "") -> Reading:
    """A change the paper finds of sign ``paper_sign``, against zero (the control's interval is shown, not
    tested)."""
    text = ci(row) + (f" ({label} {ci(control)})" if control is not None else "")
    return Reading(text, paper_sign * row["mean"], (row["mean"], row["low"], row["high"]))


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
    return Reading(f"{s['chosen']} first on {first} of {sources}, {stable} of {sources} left out; "
                   f"{'confirmed' if confirmed else 'not confirmed'}", None)


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
    return Reading(f"{ci(restored)} (bound ±{bound:.2f})", bound - abs(restored["mean"]),
                   (restored["mean"], restored["low"], restored["high"]))


def interaction(r: Record) -> Reading:
    s = r.summary("head_interaction")
    if not s:
        raise KeyError("head_interaction")
    return Reading(f"{s['hub']} + {s['secondary']}: {s['interaction']:+.3f} [{s['low']:.3f}, {s['high']:.3f}]",
                   None, (s["interaction"], s["low"], s["high"]))


SELECTIVE = 0.1  # "the other facts stay": a non-target break rate below this (the paper's: 0.4-1.4 %)


def four_facts(r: Record) -> Reading:
    target = r.row("four_facts", fact="target", metric="donor_answer")
    broken = r.row("four_facts", fact="non-target", metric="break_rate")
    effect = min(target["mean"] - broken["mean"], SELECTIVE - broken["mean"])  # both halves of the rule must hold
    return Reading(f"target {ci(target)}, non-target break {ci(broken)}", effect)


def coupling(r: Record) -> Reading:
    parallel = r.row("four_facts", fact="B", part="parallel", control="direction", metric="target_margin_change")
    orthogonal = r.row("four_facts", fact="B", part="orthogonal", control="direction",
                       metric="target_margin_change")
    return Reading(f"parallel {ci(parallel)}, orthogonal {ci(orthogonal)}",
                   min(-parallel["mean"], orthogonal["mean"]))  # both halves of the rule must hold


def load(r: Record) -> Reading:
    clean = {x["num_bindings"]: x for x in r.measured("sweep_num_bindings")
             if x["edit"] == "chosen" and x["metric"] == "clean_correct"}
    fewest, most = clean[min(clean)], clean[max(clean)]
    return Reading(f"K = {min(clean)} {ci(fewest)}, K = {max(clean)} {ci(most)}", fewest["mean"] - most["mean"])


def load_vs_gap(r: Record) -> Reading:
    recall = r.row("load_vs_gap", comparison="load drop − gap drop", metric="clean_correct")
    in_logits = r.row("load_vs_gap", comparison="load drop − gap drop", metric="target_margin")
    return Reading(f"margin {ci(in_logits)}, recall {ci(recall)}", in_logits["mean"])


def overlap(r: Record) -> Reading:
    return margin(r.row("overlap", edit="align", metric="target_margin_change"), -1,
                  r.row("overlap", edit="orthogonal", metric="target_margin_change"), "orthogonalised")


WEAK = 0.5  # "correlate only weakly": a Spearman coefficient below this


def spearman(r: Record) -> Reading:
    s = r.summary("write_read_spearman")
    if not s:
        raise KeyError("write_read_spearman")
    return Reading(f"{s['spearman']:.2f} [{s['low']:.2f}, {s['high']:.2f}] over {s['components']} heads",
                   WEAK - s["spearman"])


def logit_lens(r: Record) -> Reading:
    layer = int(r.header["chosen"][1:].split("H")[0])
    by_layer = {x["layer"]: x for x in r.measured("logit_lens")}
    if layer == 0:
        return Reading(f"L0 {ci(by_layer[0])}: no layer before it", None)
    before, at = by_layer[layer - 1], by_layer[layer]
    return Reading(f"L{layer - 1} {ci(before)}, L{layer} {ci(at)}", at["mean"] - before["mean"])


def neutral(r: Record) -> Reading:
    target = r.row("neutral_suppression", fact="target", metric="change")
    other = r.row("neutral_suppression", fact="other", metric="change")
    return Reading(f"target {ci(target)}, other facts {ci(other)}", -target["mean"])


TOP1_SHARE = 0.5  # "most of the full swap"


def joint_top1(r: Record) -> Reading:
    share = r.row("joint_topk", k=1, metric="share_of_full")
    return Reading(ci(share), share["mean"] - TOP1_SHARE)


def corrector(r: Record) -> Reading:
    change = r.row("corrector", predictor="model+corrector − model", metric="accuracy_change")
    return Reading(ci(change), change["mean"])


def subspace(r: Record, rank: int = 4) -> Reading:
    cell = {x["edit"]: x for x in r.rows("subspace_transfer")
            if x["metric"] == "donor_answer" and x["rank"] == rank and not x["full"]}
    return Reading(f"basis {ci(cell['basis'])}, random {ci(cell['random'])}",
                   cell["basis"]["mean"] - cell["random"]["mean"])


@dataclass(frozen=True)
class Claim:
    """A row of the paper's claims: the rule on the paper's side, the per-seed effect that measures it (its
    definition, or why there is none when ``tested`` is False) and the reader of one seed's record."""

    row: str
    claim: str
    rule: str
    effect: str
    read: Callable[[Record], Reading]
    tested: bool = True


MARGIN_SHIFT = "the shift (logits)"
MARGIN_DROP = "-(the margin change) (logits)"

CLAIMS = [
    Claim("1", "blocking the chosen head's writes over the fact harms recall",
          "the answer's margin change < 0 (logits)", MARGIN_DROP, write_block),
    Claim("2", "the donor's write carries content", "the donor-margin shift > 0 (logits)", MARGIN_SHIFT,
          donor_write),
    Claim("3", "recall runs through one head, which ranks first across sources",
          "first on every development source and with any one left out, and its state swap above the random "
          "swap's on the held-out sources", "none: counts of sources against 'every one', no number with a boundary",
          first_everywhere, tested=False),
    Claim("4", "swapping the head's pre-query state moves the answer to the donor's",
          "the donor-margin shift > 0 (logits)", MARGIN_SHIFT, state_swap),
    Claim("5", "patching the head's query-time output carries the donor effect",
          "the donor-margin shift > 0 (logits)", MARGIN_SHIFT, output_patch),
    Claim("6", "restoring the recipient's output after the swap removes the effect",
          f"the shift within ±{RESTORE_SHARE:g} of the seed's swap shift",
          "the bound less the shift's size (logits)", output_restore),
    Claim("7", "heads interact non-additively", "the interaction's interval excludes 0 (no other side)",
          "none: either sign is the paper's side", interaction, tested=False),
    Claim("8", "four-fact edits are selective: the target moves, the other facts stay",
          f"target donor answers above the non-target break rate, which lies below {SELECTIVE:g}",
          f"the smaller of target - break and {SELECTIVE:g} - break (shares)", four_facts),
    Claim("9", "edits are coupled: A's part parallel to B lowers B's margin, the orthogonal part raises it",
          "parallel < 0 and orthogonal > 0 (logits)", "the smaller of -parallel and orthogonal (logits)",
          coupling),
    Claim("12", "more facts hurt recall", "clean recall at the fewest facts above that at the most",
          "recall at the fewest - at the most (share)", load),
    Claim("13", "more facts hurt recall more than a longer gap",
          "the drop in the answer's margin from the fewest to the most facts, less its drop from the shortest to "
          "the longest gap, > 0 (logits, sources paired)", "that difference (logits)", load_vs_gap),
    Claim("14", "keys aligned to the fact's key lower its margin", "the margin change < 0 (logits)", MARGIN_DROP,
          overlap),
    Claim("17", "write and read importance correlate only weakly", f"Spearman's coefficient below {WEAK:g}",
          f"{WEAK:g} - the coefficient", spearman),
    Claim("18", "the logit lens jumps at the chosen head's layer",
          "lens accuracy at the chosen layer above the layer before",
          "accuracy at the chosen layer - the layer before (none at layer 0)", logit_lens),
    Claim("19", "a neutral counterfactual state suppresses the target fact",
          "the target's recall change < 0 (the other facts' change is shown, not judged)",
          "-(the target's change) (share)", neutral),
    Claim("20", "a rank-4 basis of the value subspace carries the edit (D.2)",
          "donor answers of the basis edit above a random rank-4 edit's", "basis - random (share)", subspace),
    Claim("21", "the top-1 head recovers most of the full swap", f"joint top-1 share > {TOP1_SHARE:g}",
          f"the share - {TOP1_SHARE:g}", joint_top1),
    Claim("22", "a corrector on state features rescues some errors", "accuracy change > 0", "the change (share)",
          corrector),
]


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
    """One claim over a label's seeds: each seed's reading (None where not measured or below the gate), the test of
    the seeds' effects (None for a descriptive claim), its Holm-adjusted p (None where the claim is not tested)
    and the verdict."""

    claim: Claim
    readings: list[Reading | None]
    test: PairedTest | None
    holm_p: float | None
    verdict: str

    def effects(self) -> list[float]:
        return [x.effect for x in self.readings if x is not None and x.effect is not None]


def verdict(claim: Claim, test: PairedTest | None, holm_p: float, gate_passed: int, seeds: int) -> str:
    """The claim's verdict over ``seeds`` seeds (module docstring)."""
    if not claim.tested:
        return "descriptive (no per-seed effect)"
    if gate_passed < MIN_SEEDS:
        return f"not resolved ({gate_passed} of {seeds} seeds pass the gate)"
    measured = test.seeds if test is not None else 0
    if measured < MIN_SEEDS:
        return f"not resolved (measured on {measured} of {seeds} seeds)"
    if holm_p < ALPHA and test.mean != 0:
        return "agrees" if test.mean > 0 else "disagrees"
    return f"not resolved (Holm p = {holm_p:.2g}, {measured} seeds)"


def judge(seeds: list[tuple[str, Record]]) -> tuple[int, list[Judged]]:
    """How many seeds pass the clean-recall gate, and every claim read, tested and judged over the seeds: the
    t-tests' p-values Holm-corrected over every claim with an effect (``family``), a claim decided by fewer than
    ``MIN_SEEDS`` seeds (or with fewer above the gate) counting with p = 1."""
    passed = sum(bool(r.header.get("clean_recall_passed")) for _, r in seeds)
    readings = [[read(r, claim) for _, r in seeds] for claim in CLAIMS]
    tests: list[PairedTest | None] = []
    for claim, seen in zip(CLAIMS, readings):
        effects = [x.effect for x in seen if x is not None and x.effect is not None]
        tests.append(paired_test(effects) if claim.tested and effects else None)
    family = [i for i, claim in enumerate(CLAIMS) if claim.tested]
    usable = [tests[i] is not None and tests[i].seeds >= MIN_SEEDS and passed >= MIN_SEEDS for i in family]
    adjusted = dict(zip(family, holm([tests[i].p if ok else 1.0 for i, ok in zip(family, usable)])))
    judged = []
    for i, claim in enumerate(CLAIMS):
        holm_p = adjusted.get(i)
        judged.append(Judged(claim, readings[i], tests[i], holm_p,
                             verdict(claim, tests[i], math.nan if holm_p is None else holm_p, passed, len(seeds))))
    return passed, judged


def number(x: float | None) -> str:
    """Three significant digits with a sign, or a dash for nothing."""
    if x is None or math.isnan(x):
        return "–"
    return f"{x:+.3g}"


def p_text(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.2g}"


def test_cells(j: Judged) -> list[str]:
    """The effects over the seeds: their mean with the t-distribution's 95% interval, the t-test, the sign-flip p
    and the Holm-adjusted p."""
    test = j.test
    if test is None:
        return ["–"] * 4
    interval = "" if math.isnan(test.low) else f" [{test.low:.3g}, {test.high:.3g}]"
    t = "–" if math.isnan(test.t) else f"t({test.df}) = {test.t:.3g}, p = {p_text(test.p)}"  # equal effects: inf
    return [number(test.mean) + interval, t, p_text(test.sign_flip_p), p_text(j.holm_p)]


def family(judged: list[Judged]) -> int:
    """How many claims Holm's correction counts: every claim with an effect, measured or not."""
    return sum(j.claim.tested for j in judged)


def group_table(label: str, seeds: list[tuple[str, Record]]) -> str:
    passed, judged = judge(seeds)
    names = [name for name, _ in seeds]
    lines = [f"**{label}** ({len(seeds)} seeds, {passed} at or above the clean-recall gate; Holm over the "
             f"{family(judged)} claims with an effect)", "",
             "| row | claim | rule (paper's side) | effect (> 0: paper's side) | " + " | ".join(names) +
             " | effect per seed | mean effect [t 95% CI] | t-test | sign-flip p | Holm p | verdict |",
             "|---" * (len(seeds) + 10) + "|"]
    for j in judged:
        cells = [x.text if x is not None else gate_text(r) if not r.header.get("clean_recall_passed")
                 else "not measured" for x, (_, r) in zip(j.readings, seeds)]
        effects = ", ".join(number(x.effect if x is not None else None) for x in j.readings)
        lines.append(f"| {j.claim.row} | {j.claim.claim} | {j.claim.rule} | {j.claim.effect} | " +
                     " | ".join(cells) + f" | {effects if j.claim.tested else '–'} | " +
                     " | ".join(test_cells(j)) + f" | {j.verdict} |")
    return "\n".join(lines) + "\n"


SHORT = {  # the claims the figure draws, all margin changes in logits
    "1": "write block\n(paper: < 0)", "2": "donor write\n(paper: > 0)", "4": "state swap\n(paper: > 0)",
    "5": "output patch\n(paper: > 0)", "6": "swap, then restore\n(paper: near 0)", "14": "aligned keys\n(paper: < 0)",
}


def plot(groups: list[tuple[str, list[tuple[str, Record]]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 3.4 * len(groups)), sharey=True, squeeze=False)
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
            holm_p = "" if judged_claim.holm_p is None else f"\nHolm p {p_text(judged_claim.holm_p)}"
            ax.text(i, 1.0, judged_claim.verdict.split(" (")[0] + holm_p, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(in_logits)), [f"row {c.claim.row}: {SHORT[c.claim.row]}" for c in in_logits],
                      fontsize=8)
        ax.set_ylabel("margin change (logits)")
        ax.set_title(f"{label}: each seed's 95% interval over the confirmation sources ({passed} of {len(seeds)} "
                     f"seeds pass the clean-recall gate)\nverdict: t-test of the seeds' effects, Holm-corrected over "
                     f"{family(judged)} claims", fontsize=9, pad=26)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="+", help="LABEL=SEED.json,SEED.json,... (one model under one recipe)")
    parser.add_argument("--out", type=Path, help="write the tables here as well")
    parser.add_argument("--plot", type=Path, help="the claims in logits, every group on one scale")
    args = parser.parse_args(argv)
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
