"""A learning-rate race read from a study's tables: the models of a study that differ only in their peak rate (the
study's ``per_model`` keys) form one group; each group's rates side by side, with every seed's value, and the rate
each group wins with on one seed's metric (the race's rule: one seed decides, the winner's other seeds follow).

    python scripts/study/rate_race.py STUDY.yaml TABLES.json [TABLES.json ...] [--metric val_loss] [--decide-seed 0]
        [--close 0.1] [--also test_ppl mqar ...] [--plot FIG.png] [--core-seeds RUN_STUDY.yaml [--write]]

TABLES.json is the study's ``tables/results.json`` (``linmem study STUDY.yaml --out OUT --report-only`` writes it).
Prints a markdown table (a row per group, labelled by its models' common name and its mixer and shape; a column per
rate; each cell the seeds' values, the winner's in bold) and, with ``--also``, a table per further metric at the same
cells; then what the race needs next, a line per group: ``decided``; ``edge`` (the winner is the bracket's top or
bottom rate: the next rate out, twice or half, is run first); ``close`` (other rates lie less than ``--close`` from
the deciding seed's best in the deciding metric: the study's next seed after the deciding one, a spare, is run at each
of these contenders, and once spares are run the best mean over the seeds run at every contender decides);
``incomplete`` (a rate lacks its run of the deciding seed). ``--plot`` draws each metric against the rate, one panel
per metric, a line per group through the deciding seed with the other seeds as dots.

``--core-seeds`` names the study that trains each family at the rate its race chooses (configs/study/core-seeds.yaml
for core-seeds-lr): a model of it belongs to the race group whose models differ from it only in the race study's
``per_model`` keys. Printed last: the ``models:`` line of each of its models whose race is decided, with ``optim.lr``
the winner and ``optim.min_lr`` a tenth of it merged into its ``set:``, and a comment line with the race's state for
every other model. Nothing is written unless ``--write``: then each decided model whose line sets no ``optim.lr`` yet
gets its new line in that file (its comment kept), and the last line printed is ``written: NAME ...`` (the models
whose line changed; none where it is bare), which scripts/study/core_seeds_device.sh reads to queue their runs.

Several TABLES.json of one study (the records of separate machines, or a shipped table and a machine's new runs)
are read as one: each model's per-seed values from every file, a later file's value at a seed replacing an
earlier file's.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from linmem.study.definition import (  # noqa: E402
    UPDATE_NEUTRAL_KEYS,
    Study,
    flat_sections,
    load_study,
    resolve_model,
)
from linmem.train.config import TrainConfig  # noqa: E402

# the trailing comment of a models: line whose decided rate is its config file's own (core-seeds' header: a model
# that keeps its zoo rate may take rla-paper's runs of seeds 0-2, trained at that rate under the same recipe)
ZOO_RATE_NOTE = "# zoo rate: rla-paper's seeds 0-2 may count"


@dataclass
class Group:
    """Models that differ only in their peak rate: ``models`` maps each rate to its model's name; ``key`` is what they
    share (``race_key``); ``stem`` the words every model's name starts with ('' when none, ``name_stem``)."""

    label: str
    models: dict[float, str]
    key: dict = field(default_factory=dict, repr=False)
    stem: str = ""


def race_key(config: TrainConfig, per_model: list[str]) -> dict:
    """Everything of a resolved model but the keys its race varies: its model section and every recipe key."""
    return {"model": config.model, **{k: v for k, v in flat_sections(config).items() if k not in per_model}}


def rate_groups(study: Study, seed: int) -> list[Group]:
    """The study's models grouped by everything but the ``per_model`` keys, in the study's order, each labelled by its
    models' common name and its mixer and shape ("gdn-wide (GDN 6 x 256)"); refused when a group holds two models at
    one rate (the race would not know which one it ran)."""
    if "optim.lr" not in study.per_model:
        raise SystemExit(f"{study.path}: the models do not differ in optim.lr (per_model: {study.per_model})")
    groups: list[Group] = []
    for model in study.models:
        config = resolve_model(study, model, seed)
        rest = race_key(config, study.per_model)
        rate = float(config.optim.lr)
        group = next((g for g in groups if g.key == rest), None)
        if group is None:
            shape = config.model
            group = Group(f"{shape['mixer'].upper()} {shape['num_hidden_layers']} x {shape['hidden_size']}", {}, rest)
            groups.append(group)
        if rate in group.models:
            raise SystemExit(f"{study.path}: {model.name} and {group.models[rate]} share the rate {rate:g}")
        group.models[rate] = model.name
    for group in groups:
        group.stem = name_stem(list(group.models.values()))
        if group.stem:
            group.label = f"{group.stem} ({group.label})"
    labels = [g.label for g in groups]
    for group in groups:  # two groups of one label (no common name, or one name twice): named by a model
        if labels.count(group.label) > 1:
            group.label += f" ({next(iter(group.models.values()))})"
    return [g for g in groups if len(g.models) > 1]


def name_stem(names: list[str]) -> str:
    """The whole ``-``-separated words every name starts with: gdn-half-lr, gdn-zoo-lr -> gdn; '' when none."""
    common: list[str] = []
    for words in zip(*(name.split("-") for name in names)):
        if len(set(words)) > 1:
            break
        common.append(words[0])
    return "-".join(common).rstrip("-")


def rate_text(rate: float) -> str:
    """1.25e-3, 2.5e-3, 5e-3."""
    exponent = math.floor(math.log10(rate))
    return f"{rate / 10 ** exponent:.6g}e{exponent}"


def rate_yaml(rate: float) -> str:
    """A rate as the study files write it, 3.0e-3, 2.5e-4: PyYAML reads a mantissa without its point (3e-3) as a
    string."""
    mantissa, _, exponent = rate_text(rate).partition("e")
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exponent}"


def merged_tables(paths: list[Path], study: str) -> dict:
    """The tables of ``study`` in ``paths`` as one: the first file's, with every model's per-seed values of every
    metric from each later file added, a later file's value at a seed replacing an earlier one's."""
    merged = None
    for path in paths:
        tables = json.loads(path.read_text(encoding="utf-8"))
        if tables.get("study") != study:
            raise SystemExit(f"{path} holds the tables of {tables.get('study')!r}, not {study!r}")
        if merged is None:
            merged = tables
            continue
        for model, entry in tables["models"].items():
            if model not in merged["models"]:
                merged["models"][model] = entry
                continue
            metrics = merged["models"][model].setdefault("metrics", {})
            for metric, values in entry.get("metrics", {}).items():
                metrics.setdefault(metric, {}).setdefault("seeds", {}).update(values.get("seeds", {}))
        for metric, meta in tables["metrics"].items():
            merged["metrics"].setdefault(metric, meta)
    return merged


def seed_values(tables: dict, model: str, metric: str) -> dict[int, float]:
    seeds = tables["models"].get(model, {}).get("metrics", {}).get(metric, {}).get("seeds", {})
    return {int(s): v["mean"] for s, v in seeds.items() if v.get("mean") is not None}


def ranked(values: dict[float, float], higher_is_better: bool) -> list[float]:
    """The rates from best to worst value; a value that is not finite (a diverged run) ranks last."""
    def badness(rate: float) -> float:
        value = values[rate]
        if not math.isfinite(value):
            return math.inf
        return -value if higher_is_better else value

    return sorted(values, key=badness)


def winner(tables: dict, group: Group, metric: str, seed: int) -> float | None:
    """The rate whose run of ``seed`` has the best ``metric``; None while any rate lacks that run."""
    values = {rate: seed_values(tables, name, metric).get(seed) for rate, name in group.models.items()}
    if any(v is None for v in values.values()):
        return None
    return ranked(values, tables["metrics"][metric]["higher_is_better"])[0]


def spare_seeds(seeds: list[int], seed: int) -> list[int]:
    """The study's seeds after the deciding one, in the study's order (all but it where the study does not list it)."""
    return seeds[seeds.index(seed) + 1:] if seed in seeds else [s for s in seeds if s != seed]


@dataclass
class Need:
    """What a group needs next: ``text`` (the verdict), ``runs`` (``MODEL:SEED`` of models the study declares),
    ``new_rate`` (a rate the study file must get a model at first, or None) and ``rate`` (the decided rate; None until
    the race is decided)."""

    text: str
    runs: list[str]
    new_rate: float | None = None
    rate: float | None = None


def verdict(tables: dict, group: Group, metric: str, seed: int, seeds: list[int], close: float) -> str:
    """What the race needs next for ``group`` (``need``'s text)."""
    return need(tables, group, metric, seed, seeds, close).text


def need(tables: dict, group: Group, metric: str, seed: int, seeds: list[int], close: float) -> Need:
    """What the race needs next for ``group``, decided on ``metric`` of ``seed`` (``seeds``: the study's):

    - ``incomplete: no run of seed S at R1, R2``: a rate lacks its run of the deciding seed;
    - ``edge: wins at R, the top of its bracket: add 2R`` (or the bottom, R/2): the winner is the group's highest
      (lowest) rate, so the next rate out runs before the winner is used;
    - ``close: R1 and R2 within D (< CLOSE) on seed S: run seed S2 at both`` (``R1, R2 and R3 … at each``): every
      rate whose value on the deciding seed lies less than ``close`` from the best one's is a contender (D: the
      farthest of them), and no spare seed (a study seed after ``seed``) has run at every contender;
    - ``decided (seeds S, S2): R``: there were contenders, and the one with the best mean over the seeds run at
      every contender (``seed`` included) wins (an edge verdict where that rate is an edge);
    - ``decided: R``: the winner is inside its bracket and every other rate at least ``close`` away.

    Every rate within ``close`` contends, not only the runner-up: two rates whose values on the deciding seed differ
    by less than the seeds' spread would otherwise be told apart by that seed's noise alone.
    """
    rates = sorted(group.models)
    values = {rate: seed_values(tables, group.models[rate], metric) for rate in rates}
    missing = [rate for rate in rates if seed not in values[rate]]
    if missing:
        return Need(f"incomplete: no run of seed {seed} at {', '.join(rate_text(r) for r in missing)}",
                    [f"{group.models[r]}:{seed}" for r in missing])
    higher = tables["metrics"][metric]["higher_is_better"]
    first, *others = ranked({rate: values[rate][seed] for rate in rates}, higher)
    gaps = {rate: abs(values[rate][seed] - values[first][seed]) for rate in others}
    contenders = [first] + [rate for rate in others if gaps[rate] < close]  # a value not finite never contends
    spares = spare_seeds(seeds, seed)
    counted = [seed] + [s for s in spares if all(s in values[rate] for rate in contenders)]
    best = first
    if len(contenders) > 1 and len(counted) > 1:
        means = {rate: sum(values[rate][s] for s in counted) / len(counted) for rate in contenders}
        best = ranked(means, higher)[0]
    if best == rates[-1]:
        return Need(f"edge: wins at {rate_text(best)}, the top of its bracket: add {rate_text(best * 2)}", [],
                    best * 2)
    if best == rates[0]:
        return Need(f"edge: wins at {rate_text(best)}, the bottom of its bracket: add {rate_text(best / 2)}", [],
                    best / 2)
    if len(contenders) == 1:
        return Need(f"decided: {rate_text(best)}", [], rate=best)
    if len(counted) > 1:
        return Need(f"decided (seeds {', '.join(str(s) for s in counted)}): {rate_text(best)}", [], rate=best)
    names = [rate_text(rate) for rate in contenders]
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    gap = max(gaps[rate] for rate in contenders[1:])
    pair = f"close: {listed} within {gap:.3g} (< {close:g}) on seed {seed}"
    if not spares:
        return Need(f"{pair}: the study has no spare seed left", [])
    return Need(f"{pair}: run seed {spares[0]} at {'both' if len(contenders) == 2 else 'each'}",
                [f"{group.models[r]}:{spares[0]}" for r in contenders if spares[0] not in values[r]])


def next_steps(tables: dict, groups: list[Group], metric: str, seed: int, seeds: list[int], close: float) -> str:
    """A markdown list: each group's verdict, under the rule it follows."""
    spares = spare_seeds(seeds, seed)
    spare = (f"spare seeds {', '.join(str(s) for s in spares)} decide" if spares
             else "a spare seed would decide (the study lists none)")
    rule = (f"{metric} on seed {seed} decides; a winner at an edge of its bracket gets the next rate out first; where "
            f"other rates lie less than {close:g} from the best, {spare} among them")
    needs = [need(tables, g, metric, seed, seeds, close) for g in groups]
    lines = [f"What the race needs next ({rule})", ""]
    lines += [f"- {g.label}: {n.text}" for g, n in zip(groups, needs)]
    runs = [run for n in needs for run in n.runs]
    lines += ["", "Runs to queue (MODEL:SEED, models the study file declares): " + (" ".join(runs) or "none")]
    # a group by its models' common name, or by its first model where they share none
    new = [f"{g.stem or next(iter(g.models.values()))} at {rate_text(n.new_rate)}" for g, n in zip(groups, needs)
           if n.new_rate]
    if new:
        lines += ["", "Models to add to the study file first (the next rate out): " + "; ".join(new)]
    return "\n".join(lines)


def flow_scalar(value) -> str:
    """``value`` as a YAML flow scalar (or flow collection), quoted only where YAML needs it."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).split("\n")[0]


def models_line(name: str, config: str, overrides: dict, rate: float) -> str:
    """A study file's ``models:`` entry as one flow-mapping line: ``optim.lr`` at ``rate`` and ``optim.min_lr`` a
    tenth of it, then the entry's other ``set:`` keys."""
    written = {"optim.lr": rate_yaml(rate), "optim.min_lr": rate_yaml(rate / 10)}
    written |= {k: flow_scalar(v) for k, v in overrides.items() if k not in written}
    values = ", ".join(f"{flow_scalar(k)}: {v}" for k, v in written.items())
    return f"  - {{name: {flow_scalar(name)}, config: {flow_scalar(config)}, set: {{{values}}}}}"


def decided_lines(run_study: Study, race_study: Study, tables: dict, groups: list[Group], metric: str, seed: int,
                  close: float) -> dict[str, str]:
    """Per model of ``run_study`` (file order), its ``models:`` line at the rate its race decided (``need``): its
    config path and other ``set:`` keys as its study file writes them (the zoo-rate note where the winner is its
    config file's own rate); for a model whose race is not decided, a comment with the race's state.

    A model's race is the group whose models differ from it only in the race study's ``per_model`` keys (and in
    settings that change no update), both resolved at ``seed``."""
    missing = [k for k in ("optim.lr", "optim.min_lr") if k not in run_study.per_model]
    if missing:
        raise SystemExit(f"{run_study.path}: per_model lacks {', '.join(missing)}: its models cannot take their own "
                         "rates")
    # the config paths as the file writes them (load_study resolves them)
    entries = {e["name"]: e for e in yaml.safe_load(run_study.path.read_text(encoding="utf-8"))["models"]}

    def comparable(key: dict) -> dict:
        return {k: v for k, v in key.items() if k not in UPDATE_NEUTRAL_KEYS}

    lines = {}
    for model in run_study.models:
        key = comparable(race_key(resolve_model(run_study, model, seed), race_study.per_model))
        group = next((g for g in groups if comparable(g.key) == key), None)
        if group is None:
            lines[model.name] = f"# {model.name}: no race in the study file"
            continue
        state = need(tables, group, metric, seed, race_study.seeds, close)
        if state.rate is None:
            lines[model.name] = f"# {model.name}: not decided ({state.text})"
            continue
        line = models_line(model.name, entries[model.name]["config"], model.overrides, state.rate)
        own = {k: v for k, v in model.overrides.items() if k not in run_study.per_model}
        zoo_rate = resolve_model(run_study, replace(model, overrides=own), seed).optim.lr
        if math.isclose(state.rate, zoo_rate, rel_tol=1e-9):
            line += f"   {ZOO_RATE_NOTE}"
        lines[model.name] = line
    return lines


def decided_models(run_study: Study, lines: dict[str, str], metric: str, seed: int) -> str:
    """``run_study``'s ``models:`` lines at the rates their races decided (``decided_lines``) under a heading, and
    the count of decided models."""
    decided = sum(not line.startswith("#") for line in lines.values())
    head = (f"{run_study.name} models at the decided rates (its `models:` lines, {run_study.path}; optim.min_lr a "
            f"tenth of optim.lr; decided on {metric} of seed {seed})")
    count = f"{decided} of {len(run_study.models)} {run_study.name} models decided"
    return "\n".join([head, "", "```yaml", *lines.values(), "```", "", count])


def write_rates(run_study: Study, lines: dict[str, str]) -> list[str]:
    """Each decided model of ``run_study`` whose file line sets no ``optim.lr`` yet gets its line from ``lines``
    (``decided_lines``) in the study file, the old line's comment kept after the new one's; a model whose line sets
    a rate is never rewritten (its runs may exist). Returns the names whose line changed."""
    text = run_study.path.read_text(encoding="utf-8")
    out, written = [], []
    for old in text.splitlines(keepends=True):
        entry = re.match(r"^\s*- \{name: ([^,}]+)[,}]", old)
        name = entry and entry.group(1).strip().strip("'\"")
        new = lines.get(name) if name else None
        if new is None or new.startswith("#") or "optim.lr" in run_study.model(name).overrides:
            out.append(old)
            continue
        comment = re.search(r"\}\s*(#.*)$", old.rstrip("\n"))
        if comment:
            note = comment.group(1)[1:].strip()
            new = f"{new}; {note}" if "#" in new else f"{new}   # {note}"
        out.append(new + "\n")
        written.append(name)
    if written:
        run_study.path.write_text("".join(out), encoding="utf-8")
        load_study(run_study.path)  # the file still reads as a study
    return written


def leader(tables: dict, group: Group, metric: str, seed: int, seeds: list[int], close: float) -> float | None:
    """The rate a group's race has decided, or while it is open the deciding seed's best (None while incomplete)."""
    decided = need(tables, group, metric, seed, seeds, close).rate
    return decided if decided is not None else winner(tables, group, metric, seed)


def table(tables: dict, groups: list[Group], metric: str, decide: str, seed: int, leaders: list[float | None]) -> str:
    """A row per group, a column per rate: the seeds' values (the deciding seed first), the group's leader (``leader``,
    one per group in ``leaders``) in bold."""
    rates = sorted({rate for g in groups for rate in g.models})
    info = tables["metrics"][metric]
    better = "higher" if info["higher_is_better"] else "lower"
    lines = [f"{metric}: {info['label']} ({better} is better); seed {seed} first, then the others where run; in "
             f"bold each model's rate: the one its race decided, or while it is open the best on {decide} of seed "
             f"{seed}",
             "", "| model | " + " | ".join(rate_text(r) for r in rates) + " |", "|---" * (len(rates) + 1) + "|"]
    everything = [abs(v) for g in groups for name in g.models.values()
                  for v in seed_values(tables, name, metric).values()] or [1.0]
    # one number of decimals for the whole table: 2 for accuracies, else 4 significant digits of the largest value
    decimals = 2 if info.get("bounded") else max(0, 3 - math.floor(math.log10(max(everything) or 1.0)))
    for group, best in zip(groups, leaders, strict=True):
        cells = []
        for rate in rates:
            values = seed_values(tables, group.models[rate], metric) if rate in group.models else {}
            ordered = sorted(values, key=lambda s: (s != seed, s))
            text = " / ".join(f"{values[s]:.{decimals}f}" for s in ordered) or "–"
            cells.append(f"**{text}**" if rate == best and values else text)
        lines.append(f"| {group.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(tables: dict, groups: list[Group], metrics: list[str], decide: str, seed: int, leaders: list[float | None],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(g, best) for g, best in zip(groups, leaders, strict=True)
             if any(seed_values(tables, name, m) for name in g.models.values() for m in metrics)]
    rates = sorted({rate for g, _ in shown for rate in g.models})
    palette = plt.get_cmap("tab10" if len(shown) <= 10 else "tab20").colors
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        info = tables["metrics"][metric]
        for i, (group, best) in enumerate(shown):
            color = palette[i % len(palette)]
            xs = sorted(group.models)
            deciding = [seed_values(tables, group.models[r], metric).get(seed, math.nan) for r in xs]
            ax.plot(xs, deciding, "o-", color=color, label=group.label, markersize=4)
            for rate in xs:
                others = [v for s, v in seed_values(tables, group.models[rate], metric).items() if s != seed]
                ax.plot([rate] * len(others), others, ".", color=color, alpha=0.6, markersize=7)
            if best is not None:
                value = seed_values(tables, group.models[best], metric).get(seed)
                ax.plot([best], [value], "o", markersize=12, markerfacecolor="none", markeredgecolor=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [rate_text(r) for r in rates], rotation=60, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("peak learning rate")
        if info.get("bounded"):
            ax.set_ylim(0, 1)
        better = "higher" if info["higher_is_better"] else "lower"
        ax.set_title(f"{metric} ({better} is better)", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5), title=f"seed {seed}",
               title_fontsize=8)
    fig.suptitle(f"rate race: ringed, each model's rate (decided, or while open the best on seed {seed}'s {decide}); "
                 "dots, other seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend right of the panels
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study file (YAML)")
    parser.add_argument("tables", type=Path, nargs="+",
                        help="the study's tables/results.json, or several: their per-seed values merged, a later "
                             "file's replacing an earlier one's")
    parser.add_argument("--metric", default="val_loss", help="the metric that decides the race (val_loss)")
    parser.add_argument("--decide-seed", type=int, default=0, help="the seed whose runs decide (0)")
    parser.add_argument("--close", type=float, default=0.1,
                        help="rates closer than this to the best in the deciding metric call for a spare seed (0.1)")
    parser.add_argument("--also", nargs="*", default=[], help="further metrics shown at the same cells")
    parser.add_argument("--plot", type=Path, help="write the figure here")
    parser.add_argument("--core-seeds", type=Path, metavar="RUN_STUDY.yaml",
                        help="print this study's models: lines at the rates the races decided")
    parser.add_argument("--write", action="store_true",
                        help="with --core-seeds: set the decided rates in that file where its line has none yet")
    args = parser.parse_args(argv)
    if args.write and not args.core_seeds:
        raise SystemExit("--write needs --core-seeds: the study file to write the decided rates into")
    study = load_study(args.study)
    tables = merged_tables(args.tables, study.name)
    for metric in [args.metric, *args.also]:
        if metric not in tables["metrics"]:
            raise SystemExit(f"no metric {metric!r} in {', '.join(map(str, args.tables))}; it has "
                             f"{', '.join(tables['metrics'])}")
    groups = rate_groups(study, args.decide_seed)
    if not groups:
        raise SystemExit(f"{args.study}: no two models differ only in their rate")
    metrics = [args.metric, *args.also]
    leaders = [leader(tables, g, args.metric, args.decide_seed, study.seeds, args.close) for g in groups]
    print("\n\n".join(table(tables, groups, m, args.metric, args.decide_seed, leaders) for m in metrics))
    print()
    print(next_steps(tables, groups, args.metric, args.decide_seed, study.seeds, args.close))
    if args.core_seeds:
        run_study = load_study(args.core_seeds)
        print()
        lines = decided_lines(run_study, study, tables, groups, args.metric, args.decide_seed, args.close)
        print(decided_models(run_study, lines, args.metric, args.decide_seed))
        if args.write:
            print("written: " + " ".join(write_rates(run_study, lines)))
    if args.plot:
        plot(tables, groups, metrics, args.metric, args.decide_seed, leaders, args.plot)


if __name__ == "__main__":
    main()
