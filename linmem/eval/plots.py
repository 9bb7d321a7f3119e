"""Figures of an evaluation (PNG, matplotlib from the ``eval`` extra): NIAH heatmap, stability norms, MQAR curve."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from linmem.io.atomic import write_bytes_atomic

FIGURE_FILES = {"niah": "niah.png", "stability": "stability.png", "mqar": "mqar.png"}  # task -> its figure's name


def report_files(tasks: Iterable[str]) -> list[str]:
    """The names an evaluation of ``tasks`` writes into its folder: ``results.json``, ``results.md`` and the
    figures (checked before any work, ``linmem.io.folders.check_output_folder``)."""
    return ["results.json", "results.md", *(FIGURE_FILES[task] for task in tasks if task in FIGURE_FILES)]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Lay out, write as PNG and close ``fig``; returns ``path``. The bytes go through ``write_bytes_atomic``, which
    never writes through a symbolic link (matplotlib's own ``savefig(path)`` would)."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    write_bytes_atomic(path, buffer.getbuffer())
    return path


def niah_heatmap(grid: dict[str, Any], path: Path, title: str) -> Path:
    """Accuracy heatmap: context length (rows) x needle depth (columns); empty cells grey."""
    plt = _pyplot()
    import numpy as np

    values = np.array([[np.nan if a is None else a for a in row] for row in grid["accuracy"]], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 * len(grid["depths"]) + 2, 0.6 * len(grid["lengths"]) + 1.6))
    image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(grid["depths"])), [f"{d:.0%}" for d in grid["depths"]])
    ax.set_yticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
    for (i, j), a in np.ndenumerate(values):
        if not np.isnan(a):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", color="white" if a < 0.6 else "black", fontsize=8)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context length (tokens)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    return _save(plt, fig, path)


def stability_plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Per-layer mean norms (log scale): mixer output and memory read-out (RLA Fig. 4a)."""
    plt = _pyplot()
    layers = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(layers, [r["output_norm_mean"] for r in rows], marker="o", label="mixer output")
    readout = [float("nan") if r["readout_norm_mean"] is None else r["readout_norm_mean"] for r in rows]
    if any(r["readout_norm_mean"] is not None for r in rows):  # gaps at attention layers (no memory)
        ax.plot(layers, readout, marker="s", label="memory read-out")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean per-token L2 norm")
    ax.set_title(title)
    ax.legend()
    return _save(plt, fig, path)


def mqar_plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """MQAR accuracy against the number of pairs, with chance."""
    plt = _pyplot()
    pairs = [r["pairs"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(pairs, [r["accuracy"] for r in rows], marker="o", label="model")
    ax.plot(pairs, [r["chance"] for r in rows], linestyle="--", color="grey", label="chance (1 / pairs)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("key-value pairs")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.legend()
    return _save(plt, fig, path)
