"""A learning-rate race read from a study's tables: the models of a study that differ only in their peak rate (the
study's ``per_model`` keys) form one group; each group's rates side by side, with every seed's value, and the rate
each group wins with on one seed's metric (the race's rule: one seed decides, the winner's other seeds follow).

    python scripts/study/rate_race.py STUDY.yaml TABLES.json [--metric val_loss] [--decide-seed 0]
        [--also test_ppl mqar ...] [--plot FIG.png]

TABLES.json is the study's ``tables/results.json`` (``linmem study STUDY.yaml --out OUT --report-only`` writes it).
Prints a markdown table (a row per group, a column per rate; each cell the seeds' values, the winner's in bold) and,
with ``--also``, a table per further metric at the same cells; ``--plot`` draws each metric against the rate, one
panel per metric, a line per group through the deciding seed with the other seeds as dots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from linmem.study.definition import Study, flat_sections, load_study, resolve_model  # noqa: E402


@dataclass
class Group:
    """Models that differ only in their peak rate: ``models`` maps each rate to its model's name."""

    label: str
    models: dict[float, str]


def rate_groups(study: Study, seed: int) -> list[Group]:
    """The study's models grouped by everything but the ``per_model`` keys, in the study's order; refused when a
    group holds two models at one rate (the race would not know which one it ran)."""
    if "optim.lr" not in study.per_model:
        raise SystemExit(f"{study.path}: the models do not differ in optim.lr (per_model: {study.per_model})")
    groups: list[tuple[dict, Group]] = []
    for model in study.models:
        config = resolve_model(study, model, seed)
        rest = {"model": config.model, **{k: v for k, v in flat_sections(config).items() if k not in study.per_model}}
        rate = float(config.optim.lr)
        group = next((g for key, g in groups if key == rest), None)
        if group is None:
            shape = config.model
            label = f"{shape['mixer'].upper()} {shape['num_hidden_layers']} x {shape['hidden_size']}"
            group = Group(label, {})
            groups.append((rest, group))
        if rate in group.models:
            raise SystemExit(f"{study.path}: {model.name} and {group.models[rate]} share the rate {rate:g}")
        group.models[rate] = model.name
    labels = [g.label for _, g in groups]
    for _, group in groups:  # two groups of one mixer and shape (another recipe key differs): named by a model
        if labels.count(group.label) > 1:
            group.label += f" ({next(iter(group.models.values()))})"
    return [g for _, g in groups if len(g.models) > 1]


def rate_text(rate: float) -> str:
    """1.25e-3, 2.5e-3, 5e-3."""
    exponent = math.floor(math.log10(rate))
    return f"{rate / 10 ** exponent:.6g}e{exponent}"


def seed_values(tables: dict, model: str, metric: str) -> dict[int, float]:
    seeds = tables["models"].get(model, {}).get("metrics", {}).get(metric, {}).get("seeds", {})
    return {int(s): v["mean"] for s, v in seeds.items() if v.get("mean") is not None}


def winner(tables: dict, group: Group, metric: str, seed: int) -> float | None:
    """The rate whose run of ``seed`` has the best ``metric``; None while any rate lacks that run."""
    values = {rate: seed_values(tables, name, metric).get(seed) for rate, name in group.models.items()}
    if any(v is None for v in values.values()):
        return None
    higher = tables["metrics"][metric]["higher_is_better"]
    return (max if higher else min)(values, key=values.get)


def table(tables: dict, groups: list[Group], metric: str, decide: str, seed: int) -> str:
    """A row per group, a column per rate: the seeds' values (the deciding seed first), the winner's in bold."""
    rates = sorted({rate for g in groups for rate in g.models})
    info = tables["metrics"][metric]
    better = "higher" if info["higher_is_better"] else "lower"
    lines = [f"{metric}: {info['label']} ({better} is better); seed {seed} first, then the others where run; in "
             f"bold the rate each model wins the race with ({decide}, seed {seed})",
             "", "| model | " + " | ".join(rate_text(r) for r in rates) + " |", "|---" * (len(rates) + 1) + "|"]
    everything = [abs(v) for g in groups for name in g.models.values()
                  for v in seed_values(tables, name, metric).values()] or [1.0]
    # one number of decimals for the whole table: 2 for accuracies, else 4 significant digits of the largest value
    decimals = 2 if info.get("bounded") else max(0, 3 - math.floor(math.log10(max(everything) or 1.0)))
    for group in groups:
        best = winner(tables, group, decide, seed)
        cells = []
        for rate in rates:
            values = seed_values(tables, group.models[rate], metric) if rate in group.models else {}
            ordered = sorted(values, key=lambda s: (s != seed, s))
            text = " / ".join(f"{values[s]:.{decimals}f}" for s in ordered) or "–"
            cells.append(f"**{text}**" if rate == best and values else text)
        lines.append(f"| {group.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(tables: dict, groups: list[Group], metrics: list[str], decide: str, seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({rate for g in groups for rate in g.models})
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        info = tables["metrics"][metric]
        for i, group in enumerate(groups):
            color = f"C{i}"
            xs = sorted(group.models)
            deciding = [seed_values(tables, group.models[r], metric).get(seed, math.nan) for r in xs]
            ax.plot(xs, deciding, "o-", color=color, label=f"{group.label}, seed {seed}")
            for rate in xs:
                others = [v for s, v in seed_values(tables, group.models[rate], metric).items() if s != seed]
                ax.plot([rate] * len(others), others, ".", color=color, alpha=0.6, markersize=7)
            best = winner(tables, group, decide, seed)
            if best is not None:
                value = seed_values(tables, group.models[best], metric).get(seed)
                ax.plot([best], [value], "o", markersize=14, markerfacecolor="none", markeredgecolor=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [rate_text(r) for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("peak learning rate")
        if info.get("bounded"):
            ax.set_ylim(0, 1)
        better = "higher" if info["higher_is_better"] else "lower"
        ax.set_title(f"{metric} ({better} is better)", fontsize=10)
    axes[0][0].legend(fontsize=8, loc="best")
    fig.suptitle(f"rate race: ringed, the rate each model wins with on seed {seed}'s {decide}; dots, other seeds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study file (YAML)")
    parser.add_argument("tables", type=Path, help="the study's tables/results.json")
    parser.add_argument("--metric", default="val_loss", help="the metric that decides the race (val_loss)")
    parser.add_argument("--decide-seed", type=int, default=0, help="the seed whose runs decide (0)")
    parser.add_argument("--also", nargs="*", default=[], help="further metrics shown at the same cells")
    parser.add_argument("--plot", type=Path, help="write the figure here")
    args = parser.parse_args(argv)
    study = load_study(args.study)
    tables = json.loads(args.tables.read_text(encoding="utf-8"))
    if tables.get("study") != study.name:
        raise SystemExit(f"{args.tables} holds the tables of {tables.get('study')!r}, not {study.name!r}")
    for metric in [args.metric, *args.also]:
        if metric not in tables["metrics"]:
            raise SystemExit(f"no metric {metric!r} in {args.tables}; it has {', '.join(tables['metrics'])}")
    groups = rate_groups(study, args.decide_seed)
    if not groups:
        raise SystemExit(f"{args.study}: no two models differ only in their rate")
    print("\n\n".join(table(tables, groups, m, args.metric, args.decide_seed) for m in [args.metric, *args.also]))
    if args.plot:
        plot(tables, groups, [args.metric, *args.also], args.metric, args.decide_seed, args.plot)


if __name__ == "__main__":
    main()
