"""Figures comparing models (matplotlib, Agg): loss curves, MQAR curves, bars with error bars. Each function
returns a Figure; ``save`` writes one as PNG, ``linmem.memory.report.figure_png`` embeds one in HTML."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from linmem.eval.plots import have_matplotlib

__all__ = ["bars", "close", "grouped_bars", "have_matplotlib", "loss_curves", "mqar_curves", "niah_grids", "save",
           "wilson"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure, path: Path) -> Path:
    """Write ``figure`` as PNG (parent folders made) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    close(figure)
    return path


def close(figure) -> None:
    _pyplot().close(figure)


def wilson(share: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson 95% interval ``(low, high)`` of a success share over ``trials`` independent trials."""
    if trials <= 0:
        return (0.0, 1.0)
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * (share * (1 - share) / trials + z * z / (4 * trials * trials)) ** 0.5
    return (max(0.0, centre - half), min(1.0, centre + half))


def _smooth(values: Sequence[float], width: int) -> list[float]:
    """Trailing moving average over ``width`` points."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def loss_curves(groups: dict[str, dict[str, dict[str, list]]]):
    """One panel per group (``{"main models": {name: curve}}``, a curve as ``training_summary`` keeps it): the
    training loss (moving average) and the validation losses (markers)."""
    plt = _pyplot()
    panels = [(title, curves) for title, curves in groups.items() if curves]
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, curves) in zip(axes.flat, panels):
        tops, lows = [], []
        for name, curve in curves.items():
            width = max(1, len(curve["loss"]) // 40)
            smooth = _smooth(curve["loss"], width)
            (line,) = ax.plot(curve["step"], smooth, label=name, linewidth=1.3)
            if curve.get("val_step"):
                ax.plot(curve["val_step"], curve["val_loss"], "o", color=line.get_color(), markersize=3)
            later = smooth[len(smooth) // 10:] or smooth  # the warm-up's fall would flatten the rest
            tops.append(max(later + curve.get("val_loss", [])))
            lows.append(min(smooth + curve.get("val_loss", [])))
        margin = 0.05 * (max(tops) - min(lows))
        ax.set_ylim(min(lows) - margin, max(tops) + margin)
        ax.set_xlabel("update")
        ax.set_ylabel("loss (nats / token)")
        ax.set_title(f"{title}: training loss (line), validation loss (dots)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def mqar_curves(tables: dict[str, list[dict[str, Any]]], title: str = "MQAR accuracy", intervals: bool = False):
    """Accuracy against the number of pairs for each model (``{name: mqar table rows}``), with chance; with
    ``intervals``, Wilson 95% intervals counting each of a row's ``samples`` sequences as one trial (conservative:
    a sequence's queries are not independent, and a mean of per-sequence shares varies no more than that)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    pairs: set[int] = set()
    colors = plt.get_cmap("tab20" if len(tables) > 10 else "tab10")
    for i, (name, rows) in enumerate(tables.items()):
        xs = [r["pairs"] * 1.03 ** (i - (len(tables) - 1) / 2) for r in rows]  # nudged apart: bars stay readable
        accuracy = [r["accuracy"] for r in rows]
        yerr = None
        if intervals and all(r.get("samples") for r in rows):
            bounds = [wilson(a, r["samples"]) for a, r in zip(accuracy, rows)]
            yerr = [[a - lo for a, (lo, _) in zip(accuracy, bounds)], [hi - a for a, (_, hi) in zip(accuracy, bounds)]]
        ax.errorbar(xs, accuracy, yerr=yerr, marker="o", label=name, color=colors(i), capsize=2,
                    linestyle="-" if i < 10 else ":")
        pairs |= {r["pairs"] for r in rows}
    xs = sorted(pairs)
    ax.plot(xs, [1 / n for n in xs], linestyle="--", color="grey", label="chance (1 / pairs)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(n) for n in xs])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("key-value pairs")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def bars(values: dict[str, float | None], title: str, ylabel: str, errors: dict[str, tuple[float, float]] | None = None,
         chance: float | None = None):
    """One bar per model (missing values left out), optional ``(low, high)`` intervals and a chance line; the axis
    starts at zero, so bar heights compare as sizes."""
    plt = _pyplot()
    names = [n for n, v in values.items() if v is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.75 * len(names) + 2), 3.6))
    heights = [values[n] for n in names]
    yerr = None
    if errors:
        yerr = [[max(values[n] - errors[n][0], 0) if n in errors else 0 for n in names],
                [max(errors[n][1] - values[n], 0) if n in errors else 0 for n in names]]
    ax.bar(range(len(names)), heights, yerr=yerr, capsize=3, color="#4c72b0")
    if chance is not None:
        ax.axhline(chance, linestyle="--", color="grey", label=f"chance ({chance:.3g})")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def grouped_bars(groups: dict[str, dict[str, float | None]], title: str, ylabel: str,
                 errors: dict[str, dict[str, tuple[float, float]]] | None = None,
                 chance: dict[str, float] | None = None):
    """Bars of several tasks per model on one 0–1 scale: ``groups[task][model]``, optional ``errors[task][model]``
    ``(low, high)`` and a chance mark per task (a short dashed line over that task's bars)."""
    plt = _pyplot()
    tasks = list(groups)
    names = list(dict.fromkeys(n for values in groups.values() for n in values))
    width = 0.8 / max(1, len(tasks))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(names) + 3), 3.8))
    for i, task in enumerate(tasks):
        xs = [j + (i - (len(tasks) - 1) / 2) * width for j in range(len(names))]
        heights = [groups[task].get(n) for n in names]
        shown = [(x, h, n) for x, h, n in zip(xs, heights, names) if h is not None]
        if not shown:
            continue
        yerr = None
        task_errors = (errors or {}).get(task)
        if task_errors:
            yerr = [[max(h - task_errors[n][0], 0) if n in task_errors else 0 for _, h, n in shown],
                    [max(task_errors[n][1] - h, 0) if n in task_errors else 0 for _, h, n in shown]]
        bars_ = ax.bar([x for x, _, _ in shown], [h for _, h, _ in shown], width=width * 0.95, yerr=yerr, capsize=2,
                       label=task)
        if chance and task in chance:
            for x, _, _ in shown:
                ax.plot([x - width / 2, x + width / 2], [chance[task]] * 2, color="black", linestyle=":", lw=1,
                        label=None)
            bars_.set_label(f"{task} (dotted: chance {chance[task]:.2g})")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def niah_grids(grids: dict[str, dict[str, Any]], trials: int | None = None):
    """Needle-in-a-haystack accuracy over the length × depth grid, one small panel per model, one 0–1 colour scale
    (``grids[name]`` as the runner's NIAH report keeps it: ``lengths``, ``depths``, ``accuracy[length][depth]``).
    With ``trials`` per cell, each cell reads ``hits/trials`` instead of a share, so a small sample shows as one."""
    plt = _pyplot()
    names = list(grids)
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols + 1.2, 2.3 * rows + 0.4), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    image = None
    for ax, name in zip(axes.flat, names):
        grid = grids[name]
        image = ax.imshow(grid["accuracy"], cmap="viridis", vmin=0, vmax=1, aspect="auto", origin="lower")
        ax.set_xticks(range(len(grid["depths"])), [f"{d:.0%}" for d in grid["depths"]], fontsize=7)
        ax.set_yticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]], fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("needle depth", fontsize=7)
        ax.set_ylabel("tokens", fontsize=7)
        for i, row in enumerate(grid["accuracy"]):
            for j, value in enumerate(row):
                if value is None:
                    continue
                text = f"{round(value * trials)}/{trials}" if trials else f"{value:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="black" if value > 0.6 else "white")
    if image is not None:
        fig.colorbar(image, ax=list(axes.flat[:len(names)]), label="accuracy", shrink=0.8)
    return fig
