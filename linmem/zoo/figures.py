"""Figures comparing models (matplotlib, Agg): loss curves, MQAR curves, bars with error bars. Each function
returns a Figure; ``save`` writes one as PNG, ``linmem.memory.report.figure_png`` embeds one in HTML."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from linmem.eval.plots import have_matplotlib

__all__ = ["bars", "close", "have_matplotlib", "loss_curves", "mqar_curves", "save"]


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


def mqar_curves(tables: dict[str, list[dict[str, Any]]], title: str = "MQAR accuracy"):
    """Accuracy against the number of pairs for each model (``{name: mqar table rows}``), with chance."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    pairs: set[int] = set()
    colors = plt.get_cmap("tab20" if len(tables) > 10 else "tab10")
    for i, (name, rows) in enumerate(tables.items()):
        ax.plot([r["pairs"] for r in rows], [r["accuracy"] for r in rows], marker="o", label=name, color=colors(i),
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
         chance: float | None = None, log: bool = False):
    """One bar per model (missing values left out), optional ``(low, high)`` intervals and a chance line."""
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
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
