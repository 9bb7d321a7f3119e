"""The study's figures (PNG): per-metric model comparison, MQAR by pairs, NIAH by length, training loss curves,
recall in held-out formats during training (``train.eval_lab_recall``), per-layer activation norms and the paired
differences.

Compared sizes (accuracies, perplexities, norms) sit on axes from zero, accuracies on one 0-1 scale; every seed is
drawn as a dot beside the mean and its seed interval, so that a reader sees the spread the interval summarises.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from linmem.study.definition import Study
from linmem.study.runs import read_items, run_dir, training_log
from linmem.train.lab_recall import PREFIX as LAB_RECALL

HEADLINE = ("test_ppl", "cloze", "mqar", "niah", "lab_recall", "norm", "train_loss")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> str:
    if fig.get_layout_engine() is None:  # a figure laid out by its own engine (constrained) keeps that layout
        fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path.name


def _grid(plt, panels: int, width: float, height: float):
    """A figure of ``panels`` axes, at most three per row; unused axes hidden. Returns (figure, axes list)."""
    columns = min(3, panels)
    rows = -(-panels // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[panels:]:
        ax.set_visible(False)
    return fig, flat[:panels]


def _models_with(tables: dict[str, Any], metric: str) -> list[str]:
    return [m for m, e in tables["models"].items() if metric in e["metrics"]]


def metric_panels(tables: dict[str, Any], path: Path) -> str | None:
    """One panel per headline metric: a bar per model (mean over seeds, from zero), seed interval, seed dots."""
    names = [n for n in HEADLINE if n in tables["metrics"] and _models_with(tables, n)]
    if not names:
        return None
    plt = _pyplot()
    fig, axes = _grid(plt, len(names), 0.35 * max(len(tables["models"]), 6) + 1.2, 3.8)
    for ax, name in zip(axes, names):
        models = _models_with(tables, name)
        rows = [tables["models"][m]["metrics"][name] for m in models]
        x = np.arange(len(models))
        means = [r["seed_bootstrap"]["mean"] for r in rows]
        low = [r["seed_bootstrap"]["mean"] - r["seed_bootstrap"]["low"] for r in rows]
        high = [r["seed_bootstrap"]["high"] - r["seed_bootstrap"]["mean"] for r in rows]
        ax.bar(x, means, color="#9db4d0", yerr=[low, high], capsize=3)
        for i, r in enumerate(rows):
            seeds = [v["mean"] for v in r["seeds"].values()]
            ax.plot(np.full(len(seeds), i) + np.linspace(-0.15, 0.15, len(seeds)), seeds, "o", color="#1f3b5c",
                    markersize=3)
        ax.set_xticks(x, models, rotation=60, ha="right", fontsize=7)
        info = tables["metrics"][name]
        ax.set_title(f"{name} ({'higher' if info['higher_is_better'] else 'lower'} is better)", fontsize=8)
        ax.set_ylim(0, 1.0 if tables["metrics"][name].get("bounded") else None)
        ax.set_ylim(bottom=0)
    return _save(plt, fig, path)


def keys_of(tables: dict[str, Any], prefix: str) -> list[int]:
    """The sizes ``N`` of the table's ``prefix@N`` metrics (e.g. the MQAR pair counts or the recall loads)."""
    return sorted({int(n.split("@")[1]) for n in tables["metrics"] if n.startswith(f"{prefix}@")})


def curve_panel(tables: dict[str, Any], prefix: str, keys: list, xlabel: str, path: Path, title: str,
                chance: float | None = None) -> str | None:
    """Accuracy against ``keys`` (``prefix@key`` metrics): one line per model with its seed interval, y in [0, 1];
    ``chance`` draws the guessing level as a dashed line."""
    models = [m for m in tables["models"] if any(f"{prefix}@{k}" in tables["models"][m]["metrics"] for k in keys)]
    if not models:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for model in models:
        rows = [(k, tables["models"][model]["metrics"].get(f"{prefix}@{k}")) for k in keys]
        rows = [(k, r["seed_bootstrap"]) for k, r in rows if r is not None]
        x = [float(k) for k, _ in rows]
        ax.plot(x, [e["mean"] for _, e in rows], "o-", label=model, markersize=3)
        ax.fill_between(x, [e["low"] for _, e in rows], [e["high"] for _, e in rows], alpha=0.15)
    if chance is not None:
        ax.axhline(chance, color="0.5", linestyle="--", linewidth=0.8, label=f"chance ({chance:g})")
    ax.set_xscale("log", base=2)
    ax.set_xticks([float(k) for k in keys], [f"{k:g}" for k in keys])  # the measured sizes, as plain numbers
    ax.minorticks_off()
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (mean over seeds, seed CI)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


# The learning-rate tags of a rate study's model names, ``<family>-<tag>-lr``, lowest rate first: each rate is twice
# the one before it and "zoo" is the zoo config's own, so a tag's place gives its factor (2 ** (place - 3)).
_RATE_TAGS = ("eighth", "quarter", "half", "zoo", "double", "quad", "oct")
_RATE_NAME = re.compile(rf"(?P<family>.+)-(?P<rate>{'|'.join(_RATE_TAGS)})-lr")
_LINESTYLES = ("-", "--", ":", "-.")


def _rate_families(models: list[str]) -> dict[str, dict[str, str]] | None:
    """The models of a learning-rate study by family, ``{family: {rate tag: model}}`` in the models' order; None
    unless every name ends in a rate tag and they make two families or more."""
    families: dict[str, dict[str, str]] = {}
    for model in models:
        found = _RATE_NAME.fullmatch(model)
        if found is None:
            return None
        families.setdefault(found["family"], {})[found["rate"]] = model
    return families if len(families) > 1 else None


def _rate_label(tag: str) -> str:
    factor = 2.0 ** (_RATE_TAGS.index(tag) - 3)
    return f"{tag} (×{factor:g})" if factor >= 1 else f"{tag} (×1/{1 / factor:g})"


def _seed_label(count: int) -> str:
    return f"{count} seed{'s' if count > 1 else ''}"


def _loss_series(logs: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    """A model's loss curves from its seeds' ``metrics.jsonl`` rows: ``train`` (tokens in millions [N], moving mean of
    the training loss per seed [S, N]) over the seeds that logged a loss, ``val`` (tokens in millions [M], validation
    loss per seed [S', M], at the evaluations every such seed reached) or None. None without a training loss."""
    train = [log for log in ([r for r in log if r.get("loss") is not None] for log in logs) if log]
    if not train:
        return None
    length = min(len(log) for log in train)
    tokens = np.array([r["tokens"] for r in train[0][:length]], dtype=float) / 1e6
    losses = np.array([[r["loss"] for r in log[:length]] for log in train])
    window = max(1, length // 50)
    kernel = np.ones(window) / window
    smooth = np.stack([np.convolve(row, kernel, mode="valid") for row in losses])
    val = [v for v in ({r["tokens"]: r["val_loss"] for r in log if r.get("val_loss") is not None} for log in logs)
           if v]
    series = {"train": (tokens[window - 1:], smooth), "val": None}
    if val:
        common = sorted(set.intersection(*(set(v) for v in val)))
        series["val"] = (np.asarray(common, dtype=float) / 1e6, np.array([[v[t] for t in common] for v in val]))
    return series


def _band(ax, curve: tuple[np.ndarray, np.ndarray], **line) -> None:
    """The mean over seeds (rows of ``curve[1]``) as a line, their range shaded in the line's colour."""
    x, values = curve
    ax.plot(x, values.mean(0), **line)
    ax.fill_between(x, values.min(0), values.max(0), color=line["color"], alpha=0.15)


def _two_panels(plt, series: dict[str, dict[str, Any]]):
    """Training loss (left) and validation loss (right) of every model on one y scale; a (colour, line style) per
    model, the line styles cycled when the colours run out; the legend right of the panels, in as many columns as
    keep it at most 18 entries tall, the figure as tall as the legend."""
    styles = _model_styles(plt, list(series))
    columns, height = _legend_layout(len(series))
    fig, axes = plt.subplots(1, 2, figsize=(9.0 + 2.6 * columns, height), sharey=True, layout="constrained")
    for model, curves in series.items():
        colour, style = styles[model]
        label = f"{model} ({_seed_label(curves['train'][1].shape[0])})"
        _band(axes[0], curves["train"], color=colour, linestyle=style, label=label)
        if curves["val"] is not None:
            _band(axes[1], curves["val"], color=colour, linestyle=style, marker="o", markersize=2, label=label)
    for ax, title in zip(axes, ("training loss (moving mean)", "validation loss (each evaluation)")):
        ax.set_xlabel("training tokens (millions)")
        ax.set_xlim(left=0)
        ax.xaxis.set_major_locator(plt.MaxNLocator(6))  # few ticks: a tiny run's labels (0.00035) do not overlap
        ax.set_title(f"{title}, seed range shaded", fontsize=9)
    axes[0].set_ylabel("loss (nats/token)")
    fig.legend(handles=axes[0].lines, loc="outside right upper", fontsize=7, ncols=columns)
    return fig


def _model_styles(plt, models: list[str]) -> dict[str, tuple[Any, str]]:
    """``{model: (colour, line style)}``, distinct for every model: the default colours for up to ten models, tab20's
    beyond, the line styles cycled when the colours run out."""
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"] if len(models) <= 10 else plt.get_cmap("tab20").colors
    return {m: (colours[i % len(colours)], _LINESTYLES[(i // len(colours)) % len(_LINESTYLES)])
            for i, m in enumerate(models)}


def _legend_layout(entries: int) -> tuple[int, float]:
    """A legend right of the panels: the columns that keep it at most 18 entries tall, and a figure height in inches
    that holds it (3.8 at least)."""
    columns = -(-entries // 18)
    return columns, max(3.8, 0.18 * -(-entries // columns) + 1.0)


def _rate_panels(plt, series: dict[str, dict[str, Any]], families: dict[str, dict[str, str]]):
    """The validation loss of a learning-rate study: a panel per family (four to a row), a line per rate coloured by
    the rate (viridis, low to high, one colour per rate in every panel), all panels on one x and one y scale; the
    seeds' range shaded and their count written in each panel; one legend of the rates right of the panels."""
    tags = [t for t in _RATE_TAGS if any(t in rates for rates in families.values())]
    colour = dict(zip(tags, plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(tags)))))
    columns = min(4, len(families))
    rows = -(-len(families) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(3.0 * columns + 1.8, 2.5 * rows + 0.8), sharex=True,
                             sharey=True, squeeze=False, layout="constrained")
    panels = list(grid.flat)
    for ax in panels[len(families):]:
        ax.set_visible(False)
    for i, (ax, (family, rates)) in enumerate(zip(panels, families.items())):
        counts: dict[int, list[str]] = {}
        for tag in (t for t in tags if t in rates):
            curve = series[rates[tag]]["val"]
            _band(ax, curve, color=colour[tag], marker="o", markersize=2, linewidth=1.2, label=_rate_label(tag))
            counts.setdefault(curve[1].shape[0], []).append(tag)
        seeds = ("1 seed each" if set(counts) == {1} else
                 "; ".join(f"{_seed_label(n)}: {', '.join(t)}" for n, t in sorted(counts.items()) if n > 1))
        ax.text(0.97, 0.95, seeds, transform=ax.transAxes, ha="right", va="top", fontsize=7, color="0.3")
        ax.set_title(family, fontsize=9)
        ax.set_xlim(left=0)
        if i + columns >= len(families):  # lowest panel of its column: the x scale is read here
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("training tokens (millions)", fontsize=8)
        if i % columns == 0:
            ax.set_ylabel("validation loss (nats/token)", fontsize=8)
    handles = [plt.Line2D([], [], color=colour[t], marker="o", markersize=3, label=_rate_label(t)) for t in tags]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="learning rate\n(× the zoo config's)",
               title_fontsize=8)
    fig.suptitle("Validation loss by learning rate, a panel per model family (one scale for all; seed range shaded)",
                 fontsize=10)
    return fig


def _loss_figure(out: Path, tables: dict[str, Any]):
    """The loss curves of the study's finished runs (``loss_curves``) as a figure; None when no run logged a loss."""
    plt = _pyplot()
    series = {}
    for model, entry in tables["models"].items():
        curves = _loss_series([training_log(run_dir(out, model, s)) for s in entry["seeds"]])
        if curves is not None:
            series[model] = curves
    if not series:
        return None
    families = _rate_families([m for m, curves in series.items() if curves["val"] is not None])
    return _two_panels(plt, series) if families is None else _rate_panels(plt, series, families)


def loss_curves(study: Study, out: Path, tables: dict[str, Any], path: Path) -> str | None:
    """Loss against training tokens, per model the mean over its finished seeds with their range shaded. A
    learning-rate study (names ``<family>-<rate tag>-lr``, two families or more) gets the validation loss in a panel
    per family, a line per rate; any other study the training loss (moving mean) on the left and the validation loss
    of each evaluation on the right, on one scale, where a model that overfits its data turns upward."""
    fig = _loss_figure(out, tables)
    # laid out by the figure's own (constrained) layout, which keeps the figure-level legend inside the figure
    return None if fig is None else _save(_pyplot(), fig, path)


def lab_recall_figure(logs: dict[str, list[list[dict[str, Any]]]]):
    """Recall in the formats of ``train.eval_lab_recall`` against training tokens: a row of panels per format, a
    column per load, all on one 0-1 scale with chance dashed; per model the mean over its seeds with their range
    shaded, and, thin and dotted in the model's colour, its accuracy on the trained recall tasks
    (``val_recall_acc``), which shows when it learned to recall at all. ``logs``: per model, each seed's
    ``metrics.jsonl`` rows. None when no row holds such a metric."""
    names = {k for runs in logs.values() for log in runs for row in log for k in row if k.startswith(LAB_RECALL + ":")}
    if not names:
        return None
    formats = sorted({k[len(LAB_RECALL) + 1:].rpartition("@")[0] for k in names})
    loads = sorted({int(k.rpartition("@")[2]) for k in names})
    plt = _pyplot()
    fig, axes = plt.subplots(len(formats), len(loads), figsize=(4.2 * len(loads), 3.0 * len(formats)),
                             squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def seed_mean(runs: list[list[dict[str, Any]]], key: str):
        series = [s for s in ({row["tokens"]: row[key] for row in log if row.get(key) is not None} for log in runs)
                  if s]
        if not series:
            return None
        tokens = sorted(set.intersection(*(set(s) for s in series)))
        return np.asarray(tokens, dtype=float) / 1e6, np.array([[s[t] for t in tokens] for s in series])

    for row, label in enumerate(formats):
        for column, load in enumerate(loads):
            ax, name = axes[row][column], f"{LAB_RECALL}:{label}@{load}"
            for i, (model, runs) in enumerate(logs.items()):
                colour = colours[i % len(colours)]
                found = seed_mean(runs, name)
                if found is None:
                    continue
                x, values = found
                ax.plot(x, values.mean(0), "o-", color=colour, markersize=2,
                        label=f"{model} ({values.shape[0]} seed{'s' if values.shape[0] > 1 else ''})")
                ax.fill_between(x, values.min(0), values.max(0), color=colour, alpha=0.15)
                trained = seed_mean(runs, "val_recall_acc")
                if trained is not None:
                    ax.plot(trained[0], trained[1].mean(0), ":", color=colour, linewidth=0.9,
                            label=f"{model}: trained recall tasks")
            ax.axhline(0.25, color="gray", linestyle="--", linewidth=0.8, label="chance (4 choices)")
            ax.set_title(f"{label}, {load} fact{'s' if load > 1 else ''}", fontsize=9)
            ax.set_ylim(0, 1)
            ax.set_xlim(left=0)
            ax.set_xlabel("training tokens (millions)", fontsize=8)
            ax.set_ylabel("clean recall", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("Recall in formats held out of training, during training (template / keys / values; validation "
                 "documents)", fontsize=9)
    fig.tight_layout()
    return fig


def lab_recall_curves(study: Study, out: Path, tables: dict[str, Any], path: Path) -> str | None:
    """``lab_recall_figure`` of the study's finished runs, saved to ``path``."""
    logs = {model: [training_log(run_dir(out, model, s)) for s in entry["seeds"]]
            for model, entry in tables["models"].items()}
    fig = lab_recall_figure(logs)
    return None if fig is None else _save(_pyplot(), fig, path)


def _stability_rows(out: Path, model: str, seeds) -> dict[Any, list[dict[str, Any]]]:
    """``{seed: per-layer stability table}`` of a model's runs that have one."""
    rows = {s: read_items(out, model, s).get("eval_tables", {}).get("stability") for s in seeds}
    return {s: r for s, r in rows.items() if r}


def layer_norm_figure(stability: dict[str, dict[Any, list[dict[str, Any]]]]):
    """Per layer: the mean mixer-output norm (mean over seeds, from zero: the RLA paper's Fig. 4a) and, where the
    models have a memory read-out, its norm before the per-head output norm, one line per seed on a log scale (an
    unclipped residual memory grows by factors, in some seeds only, which a mean over seeds would hide); a (colour,
    line style) per model in both panels, one legend right of them. ``stability``: ``{model: {seed: per-layer
    stability table}}``. Returns the figure, or None with no table."""
    stability = {model: rows for model, rows in stability.items() if rows}
    if not stability:
        return None
    readout = {model: {seed: [np.nan if layer["readout_norm_mean"] is None else layer["readout_norm_mean"]
                              for layer in table] for seed, table in rows.items()}
               for model, rows in stability.items()}
    readout = {model: seeds for model, seeds in readout.items()
               if any(np.isfinite(v).any() for v in seeds.values())}
    plt = _pyplot()
    styles = _model_styles(plt, list(stability))
    columns, height = _legend_layout(len(stability))
    fig, axes = plt.subplots(1, 2 if readout else 1, figsize=((10.5 if readout else 5.5) + 2.6 * columns, height),
                             squeeze=False, layout="constrained")
    axes = list(axes.flat)
    ax = axes[0]
    for model, rows in stability.items():
        norms = np.mean([[layer["output_norm_mean"] for layer in table] for table in rows.values()], axis=0)
        colour, style = styles[model]
        ax.plot(np.arange(len(norms)), norms, marker="o", color=colour, linestyle=style, markersize=3,
                label=f"{model} ({_seed_label(len(rows))})")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean mixer-output L2 norm")
    ax.set_title("mixer output, after the per-head norm (mean over seeds)", fontsize=9)
    if readout:
        ax = axes[1]
        for model, seeds in readout.items():
            colour, style = styles[model]
            for values in seeds.values():
                ax.plot(np.arange(len(values)), values, marker="o", color=colour, linestyle=style, alpha=0.7,
                        linewidth=1, markersize=2.5, label=model)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("mean read-out L2 norm (log scale)")
        ax.set_title("memory read-out, before the per-head norm (one line per seed)", fontsize=9)
    fig.legend(handles=axes[0].lines, loc="outside right upper", fontsize=7, ncols=columns)
    return fig


def layer_norms(study: Study, out: Path, tables: dict[str, Any], path: Path) -> str | None:
    """:func:`layer_norm_figure` of the study's runs, saved to ``path``; its file name, or None without a table."""
    fig = layer_norm_figure({model: _stability_rows(out, model, entry["seeds"])
                             for model, entry in tables["models"].items()})
    return None if fig is None else _save(_pyplot(), fig, path)


def differences(tables: dict[str, Any], path: Path) -> str | None:
    """The paired differences A - B with their intervals, one panel per metric (one x scale within a metric): the
    headline metrics, test loss and every metric the study declares as a claim."""
    by_metric: dict[str, list[dict[str, Any]]] = {}
    for c in tables["comparisons"]:
        if c["metric"] in HEADLINE or c["metric"] == "test_loss" or c.get("claim"):
            by_metric.setdefault(c["metric"], []).append(c)
    if not by_metric:
        return None
    plt = _pyplot()
    fig, axes = _grid(plt, len(by_metric), 4.2, 0.35 * max(len(v) for v in by_metric.values()) + 1.6)
    for ax, (metric, rows) in zip(axes, by_metric.items()):
        # comparisons over too few seeds to be decided: hollow grey markers, the seed count in the label
        for decided, style in ((True, {"fmt": "o", "color": "C0"}),
                               (False, {"fmt": "o", "color": "grey", "markerfacecolor": "white"})):
            ys = [i for i, r in enumerate(rows) if r["enough_seeds"] == decided]
            d = [rows[i]["difference"] for i in ys]
            if ys:
                ax.errorbar([e["mean"] for e in d], ys, xerr=[[e["mean"] - e["low"] for e in d],
                                                              [e["high"] - e["mean"] for e in d]], capsize=3, **style)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.set_yticks(np.arange(len(rows)), [f"{r['a']} - {r['b']}" + ("" if r["enough_seeds"] else
                                             f" ({r['difference']['n']} seed{'s' * (r['difference']['n'] > 1)})")
                                             for r in rows], fontsize=7)
        ax.set_title(f"{metric}: A - B", fontsize=8)
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))  # a few ticks: long labels such as -0.075 do not overlap
    return _save(plt, fig, path)


def draw_figures(tables: dict[str, Any], study: Study, out: Path, folder: Path) -> dict[str, str]:
    """Every figure the tables support, written into ``folder``; ``{name: file name}``."""
    o = study.eval_options
    loads = keys_of(tables, "recall")
    recall_title = f"Clean recall by facts in the prompt ({o.recall_template}: {o.recall_keys} -> {o.recall_values})"
    made = {"metrics": metric_panels(tables, folder / "metrics.png"),
            "mqar": curve_panel(tables, "mqar", keys_of(tables, "mqar"), "key-value pairs", folder / "mqar.png",
                                "MQAR by pairs"),
            "recall": curve_panel(tables, "recall", loads, "facts in the prompt (load)", folder / "recall.png",
                                  recall_title, chance=0.25) if len(loads) > 1 else None,
            "niah": curve_panel(tables, "niah", list(o.niah_lengths), "context length (tokens)",
                                folder / "niah.png", "NIAH by length (mean over depths)"),
            "loss_curves": loss_curves(study, out, tables, folder / "loss_curves.png"),
            "lab_recall": lab_recall_curves(study, out, tables, folder / "lab_recall.png"),
            "norms": layer_norms(study, out, tables, folder / "norms.png"),
            "differences": differences(tables, folder / "differences.png")}
    return {k: v for k, v in made.items() if v}
