"""Figures of the experiments (matplotlib, Agg backend): each takes an experiment's tidy rows, returns a Figure.

Error bars are the source-level bootstrap 95% CIs of the rows.
"""

from __future__ import annotations

import numpy as np


def _subplots(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (6, 3), layout: str | None = None,
              **options):
    """``(figure, axes)`` like ``pyplot.subplots``, but a bare ``Figure`` that pyplot does not track: experiments
    run in loops would otherwise pile up open figures (and warnings) until the process ends."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout=layout)
    return fig, fig.subplots(nrows, ncols, **options)


LABELS = {
    "clean_correct": "clean accuracy", "no_fact_correct": "accuracy with the fact replaced by filler",
    "edited_correct": "accuracy when edited", "donor_answer": "donor-answer rate",
    "qualified_donor_answer": "donor-answer rate, qualified items", "donor_margin_shift": "donor-margin shift",
    "target_margin_change": "target-margin change", "target_margin": "target margin", "break_rate": "break rate",
    "share_of_layer": "share of the layer's S+R swap", "normalized_donor_effect": "share of the both-caches swap",
    "lens_accuracy": "logit-lens accuracy", "share_of_full": "share of the full swap's effect",
    "accuracy_change": "accuracy change", "norm_share": "share of the edit's norm",
    "num_bindings": "bindings per prompt",
    "gap": "gap (filler tokens before the query)", "target": "target fact", "non-target": "other facts",
    "B": "fact B", "direction": "the part itself", "gaussian": "equal-norm Gaussian",
}
PARTS = {"full": "all of Δ_A", "parallel": "Δ_A's part parallel to Δ_B", "orthogonal": "Δ_A's part orthogonal to Δ_B"}


def label(value) -> str:
    """The reader's name of a metric, field or level (the value itself when it has none)."""
    return LABELS.get(str(value), str(value))


def _errors(rows: list[dict]) -> np.ndarray:
    return np.array([[r["mean"] - r["low"] for r in rows], [r["high"] - r["mean"] for r in rows]])


def head_scan(rows: list[dict]):
    """Mean donor-margin shift of each component's state swap, layer × head, one panel per memory, all panels on
    one colour scale (a faint R must not look as strong as a hot S)."""
    memories = sorted({r["memory"] for r in rows}, key=lambda m: (m != "S", m))  # the base memory S first
    fig, axes = _subplots(1, len(memories), figsize=(4.5 * len(memories) + 1.0, 3.6), layout="constrained",
                          squeeze=False)
    limit = max((abs(r["mean"]) for r in rows if np.isfinite(r["mean"])), default=0.0) or 1.0
    for ax, memory in zip(axes[0], memories):
        sub = [r for r in rows if r["memory"] == memory]
        layers, heads = max(r["layer"] for r in sub) + 1, max(r["head"] for r in sub) + 1
        grid = np.full((layers, heads), np.nan)
        for r in sub:
            grid[r["layer"], r["head"]] = r["mean"]
        image = ax.imshow(grid, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", origin="lower")
        ax.set(xlabel="head", ylabel="layer", title=f"state swap of one head ({memory})")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(layers))
    fig.colorbar(image, ax=list(axes[0]), label="donor-margin shift (logit)")
    return fig


def _dot_rows(ax, rows: list[dict], label_keys: tuple[str, ...], xlabel: str) -> None:
    labels = [" / ".join(label(r[k]) for k in label_keys) for r in rows]
    y = np.arange(len(rows))[::-1]
    ax.errorbar([r["mean"] for r in rows], y, xerr=_errors(rows), fmt="o", capsize=3)
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(y, labels)
    ax.set_xlabel(xlabel)


def lifecycle(rows: list[dict]):
    """Left: accuracy under write block (vs control head). Right: donor-margin shift of every intervention."""
    fig, (left, right) = _subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [1, 2]})
    acc = [r for r in rows if r["metric"] == "edited_correct" and r["intervention"] == "write block"]
    _dot_rows(left, acc, ("target",), "recall accuracy with the writes blocked")
    left.set_xlim(-0.05, 1.05)
    shift = [r for r in rows if r["metric"] == "donor_margin_shift" and r["intervention"] != "write block"]
    _dot_rows(right, shift, ("intervention", "target"), "donor-margin shift (logit; > 0: toward the donor)")
    fig.tight_layout()
    return fig


def interaction(rows: list[dict]):
    """Answer-margin change when the hub's, the secondary's or both heads' writes are blocked, the sum of the two
    single blocks, and the interaction (both − sum), on one scale."""
    fig, ax = _subplots(figsize=(7, 3))
    shown = [{**r, "label": f"{r['blocked']} ({r['components']})" if r["components"] else r["blocked"]}
             for r in rows if r["metric"] == "target_margin_change"]
    _dot_rows(ax, shown, ("label",), "answer-margin change (logit; < 0: weaker recall)")
    fig.tight_layout()
    return fig


def four_facts(rows: list[dict]):
    """Left: target donor-answer rate and non-target break rate. Right: fact B's margin change per part of Δ_A."""
    fig, (left, right) = _subplots(1, 2, figsize=(11, 3.8))
    rates = [r for r in rows if r["metric"] in ("donor_answer", "break_rate")]
    _dot_rows(left, rates, ("fact", "metric"), "rate")
    left.set_xlim(-0.05, 1.05)
    parts = [{**r, "part": PARTS.get(r["part"], r["part"])} for r in rows if r.get("part")]
    _dot_rows(right, parts, ("part", "control"), "fact B: target-margin change (logit)")
    fig.tight_layout()
    return fig


def hybrid(rows: list[dict]):
    """Normalized donor effect of each cache kind (1 = the effect of swapping both)."""
    fig, ax = _subplots(figsize=(6, 2.8))
    _dot_rows(ax, [r for r in rows if r["metric"] == "normalized_donor_effect"], ("cache",),
              "normalized donor effect (share of the both-caches swap)")
    fig.tight_layout()
    return fig


def s_vs_r(rows: list[dict]):
    """Per layer: donor-margin shift of swapping S, R, or both."""
    sub = [r for r in rows if r["metric"] == "donor_margin_shift"]
    fig, ax = _subplots(figsize=(7, 0.4 * len(sub) + 1.5))
    _dot_rows(ax, sub, ("layer", "memory"), "donor-margin shift (logit) of the layer's S / R / both swap")
    fig.tight_layout()
    return fig


def sweep(rows: list[dict], field_name: str):
    """The three-way view of Fig. 8 against the swept field: clean accuracy, the state swap's donor-margin shift
    (chosen vs random) and the non-target break rate."""
    fig, axes = _subplots(1, 3, figsize=(14, 3.5))
    panels = (("clean_correct", ("chosen",), "clean accuracy"), ("donor_margin_shift", ("chosen", "random"),
              "donor-margin shift"), ("break_rate", ("chosen", "random"), "non-target break rate"))
    for ax, (metric, edits, name) in zip(axes, panels):
        for edit in edits:
            sub = [r for r in rows if r["metric"] == metric and r["edit"] == edit]
            if sub:
                ax.errorbar([r[field_name] for r in sub], [r["mean"] for r in sub], yerr=_errors(sub), marker="o",
                            capsize=3, label=edit)
        ax.set(xlabel=label(field_name), ylabel=name)
        if metric == "clean_correct":
            ax.axhline(0.25, color="gray", ls="--", lw=0.8)
        elif metric == "break_rate":
            ax.axhline(0.05, color="gray", ls="--", lw=0.8)
        if len(edits) > 1:
            ax.legend()
    fig.tight_layout()
    return fig


def load_vs_gap(rows: list[dict]):
    """Left: clean recall at the fewest / most facts and the shortest / longest gap (0-1, chance dashed). Middle and
    right: each drop, in recall and in the answer's margin, and the difference of the two drops, zero marked."""
    fig, (left, middle, right) = _subplots(1, 3, figsize=(15, 3.6))
    points = [r for r in rows if r.get("condition") and r["metric"] == "clean_correct"]
    labels = [(f"{r['value']} fact{'s' * (r['value'] != 1)}" if r["condition"] == "load" else f"gap {r['value']}")
              for r in points]
    x = np.arange(len(points))
    left.bar(x, [r["mean"] for r in points], yerr=_errors(points), capsize=3,
             color=["C0" if r["condition"] == "load" else "C1" for r in points])
    left.axhline(0.25, color="gray", ls="--", lw=0.8)
    left.set_xticks(x, labels)
    left.set(ylim=(0, 1.05), ylabel="clean recall")
    for ax, metric, unit in ((middle, "clean_correct", "clean recall"), (right, "target_margin", "margin (logit)")):
        drops = [r for r in rows if r.get("comparison") and r["metric"] == metric]
        _dot_rows(ax, drops, ("comparison",), f"drop in {unit}, first point − last")
    right.set_yticks([])
    fig.tight_layout()
    return fig


def write_reach(rows: list[dict], width: int):
    """By d, the tokens after the fact also edited: recall accuracy with the head's writes blocked (left) and the
    donor-answer rate with the donor's writes patched in (right), chosen vs control head, both panels on one 0-1
    scale; chance (1 of 4 candidates) dashed, the short convolutions' reach (d = W − 1) dotted."""
    panels = (("write block", "edited_correct", "recall accuracy"),
              ("donor write", "donor_answer", "donor-answer rate"))
    fig, axes = _subplots(1, 2, figsize=(9, 4), layout="constrained", sharey=True)
    for ax, (intervention, metric, ylabel) in zip(axes, panels):
        for target, marker, nudge in (("chosen", "o", -0.04), ("control head", "s", 0.04)):  # nudged: bars apart
            sub = [r for r in rows if (r["intervention"], r["metric"], r["target"]) == (intervention, metric, target)]
            ax.errorbar([r["tokens_after"] + nudge for r in sub], [r["mean"] for r in sub], yerr=_errors(sub),
                        marker=marker, capsize=3, label=f"{target} ({sub[0]['component']})")
        ax.axhline(0.25, color="gray", ls="--", lw=0.8, label="chance (1 of 4)")
        if width > 1:
            ax.axvline(width - 1, color="gray", ls=":", lw=0.8, label=f"short-conv reach (W − 1 = {width - 1})")
        ax.set(title=f"{intervention}: {ylabel}", ylabel=ylabel, ylim=(0, 1.05), xticks=range(width + 1))
    fig.supxlabel("tokens after the fact also edited (0: the fact's own tokens)", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncol=4, fontsize=8, frameon=False)
    return fig


def overlap(rows: list[dict], label_keys: tuple[str, ...] = ("edit",)):
    """Target-margin change when later write keys are aligned with / orthogonalized to the target's key (one row
    per ``label_keys`` value, e.g. load and edit for the overlap sweep)."""
    sub = [r for r in rows if r["metric"] == "target_margin_change"]
    fig, ax = _subplots(figsize=(6, 0.35 * len(sub) + 1.5))
    _dot_rows(ax, sub, label_keys, "target-margin change (logit; < 0: the fact is harmed)")
    fig.tight_layout()
    return fig


def neutral(rows: list[dict]):
    """Accuracy of the target and the other facts before and after the neutral state swap."""
    fig, ax = _subplots(figsize=(6, 2.8))
    _dot_rows(ax, [r for r in rows if r["metric"] in ("clean_correct", "edited_correct")], ("fact", "metric"),
              "accuracy")
    ax.set_xlim(-0.05, 1.05)
    fig.tight_layout()
    return fig


def lens(rows: list[dict]):
    """4-choice accuracy read from the residual stream after each layer."""
    fig, ax = _subplots(figsize=(6, 3))
    ax.errorbar([r["layer"] for r in rows], [r["mean"] for r in rows], yerr=_errors(rows), marker="o", capsize=3)
    ax.axhline(0.25, color="gray", ls="--", lw=0.8)
    ax.set(xlabel="after layer", ylabel="4-choice accuracy (logit lens)", ylim=(-0.05, 1.05))
    fig.tight_layout()
    return fig


def topk(rows: list[dict]):
    """Share of the full effect recovered by swapping the top-k components jointly."""
    fig, ax = _subplots(figsize=(6, 3))
    ks = [r["k"] for r in rows]
    ax.errorbar(ks, [r["mean"] for r in rows], yerr=_errors(rows), marker="o", capsize=3)
    ax.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax.set(xlabel="top-k components swapped jointly", ylabel="share of the full swap's effect", xscale="log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    fig.tight_layout()
    return fig


def write_read(rows: list[dict], summary: dict):
    """Each component's write importance against its read importance."""
    fig, ax = _subplots(figsize=(5, 4))
    ax.scatter([r["write_shift"] for r in rows], [r["read_shift"] for r in rows], s=12)
    ax.set(xlabel="donor write: donor-margin shift", ylabel="state swap: donor-margin shift",
           title=f"Spearman {summary['spearman']:.2f} [{summary['low']:.2f}, {summary['high']:.2f}]")
    fig.tight_layout()
    return fig


def subspace_transfer(rows: list[dict]):
    """Donor-answer rate (left) and donor-margin shift (right) per rank k of each edit: the item's own rank-k
    truncation, its projection on the learned basis, the rest, and the equal-norm random rank-k control."""
    fig, axes = _subplots(1, 2, figsize=(10, 3.4))
    styles = {"own": ("C0", "o", "-"), "basis": ("C1", "s", "-"), "orthogonal": ("C2", "^", "-"),
              "random": ("gray", "x", "--")}
    for ax, metric, name in zip(axes, ("donor_answer", "donor_margin_shift"),
                                 ("donor-answer rate", "donor-margin shift (logits)")):
        for edit, (color, marker, line) in styles.items():
            sub = sorted((r for r in rows if r["edit"] == edit and r["metric"] == metric), key=lambda r: r["rank"])
            if sub:
                ax.errorbar([r["rank"] for r in sub], [r["mean"] for r in sub], yerr=_errors(sub), color=color,
                            marker=marker, ls=line, capsize=3, label=edit)
        ranks = sorted({r["rank"] for r in rows})
        ax.set(xlabel="rank k (last: full)", ylabel=name, xscale="log")
        ax.set_xticks(ranks, [str(k) for k in ranks])
        ax.minorticks_off()
        ax.axhline(0, color="black", lw=0.5)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def corrector(rows: list[dict]):
    """Held-out 4-choice accuracy of the model alone, the state-feature corrector, the model with the corrector,
    and the corrector trained on shuffled labels (chance 0.25 dashed)."""
    fig, ax = _subplots(figsize=(6, 3.2))
    sub = [r for r in rows if r["metric"] == "accuracy"]
    ax.bar(range(len(sub)), [r["mean"] for r in sub], yerr=_errors(sub), capsize=4,
           color=["C0", "C1", "C2", "gray"][: len(sub)])
    ax.set_xticks(range(len(sub)), [r["predictor"] for r in sub], fontsize=8)
    ax.axhline(0.25, color="gray", ls="--", lw=0.8)
    ax.set(ylabel="held-out accuracy", ylim=(0, 1.05))
    fig.tight_layout()
    return fig
