"""The study's tables, rebuilt from the run folder's files alone (``items.json``, ``metrics.jsonl``): per model and
metric the mean over seeds with a seed-bootstrap 95% interval and every seed's value with its item-bootstrap
interval, then the study's paired comparisons (A - B with a two-level interval). Written as ``tables/results.json``
and ``tables/results.md`` (figures beside them, ``linmem.study.figures``); the same files give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from linmem.eval.task_names import WHOLE_SPLIT
from linmem.io.atomic import atomic_write, write_json_atomic
from linmem.memory.experiment_names import CLEAN_RECALL_GATE
from linmem.study.definition import MIN_SEEDS, Study
from linmem.study.estimates import ItemSet, Measurement, identity, item_estimate, paired_difference, seed_estimate
from linmem.study.figures import draw_figures
from linmem.study.runs import read_items, run_dir, training_log
from linmem.train.lab_recall import parse_entries

TABLES = "tables"
FINAL_SHARE = 0.1  # the final training loss: mean over the last tenth of the updates


@dataclass(frozen=True)
class Metric:
    """One column of the tables: ``name``, what it means, how a seed's measurement is read, ``higher`` is better."""

    name: str
    label: str
    read: Callable[[dict[str, Any], Path], Measurement | None]
    higher: bool
    transform: Callable[[np.ndarray], np.ndarray] = identity
    bounded: bool = False  # an accuracy in [0, 1]
    gate: float | None = None  # the memory lab's clean-recall gate, for the lab's recall metrics


def _items(task: str, keep: Callable[[dict[str, Any]], bool] | None = None):
    def read(record: dict[str, Any], folder: Path) -> ItemSet | None:
        columns = record["records"].get(task)
        if not columns or not columns["unit"]:
            return None
        rows = range(len(columns["unit"]))
        if keep is not None:
            rows = [i for i in rows if keep({k: v[i] for k, v in columns.items()})]
        if not rows:
            return None
        pick = lambda key: [columns[key][i] for i in rows]  # noqa: E731
        return ItemSet.from_columns(pick("unit"), pick("group"), pick("num"), pick("den"))
    return read


def _eval_metric(task: str, key: str):
    def read(record: dict[str, Any], folder: Path) -> float | None:
        value = record.get("eval_metrics", {}).get(task, {}).get(key)
        return None if value is None else float(value)
    return read


def _recall(record: dict[str, Any], folder: Path) -> Measurement | None:
    """The recall items (mean over loads); a record without them (evaluated before recall had items) gives the
    eval's seed-level accuracy."""
    return _items("recall")(record, folder) or _eval_metric("recall", "accuracy")(record, folder)


def _final_train_loss(record: dict[str, Any], folder: Path) -> float | None:
    losses = [r["loss"] for r in training_log(folder) if r.get("loss") is not None]
    if not losses:
        return None
    return float(np.mean(losses[-max(1, math.ceil(FINAL_SHARE * len(losses))):]))


def _final_logged(key: str):
    """Reader of the last value of ``key`` that training logged (an evaluation-time metric of ``metrics.jsonl``)."""
    def read(record: dict[str, Any], folder: Path) -> float | None:
        values = [r[key] for r in training_log(folder) if r.get(key) is not None]
        return float(values[-1]) if values else None
    return read


def _window_sources(records: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """The sources of the perplexity windows, in first-seen order (records written before windows had sources
    give none)."""
    seen: dict[str, None] = {}
    for by_seed in records.values():
        for record in by_seed.values():
            seen.update(dict.fromkeys(record["records"].get("ppl", {}).get("source", [])))
    return list(seen)


def metrics_of(study: Study, records: dict[str, dict[int, dict[str, Any]]]) -> list[Metric]:
    """The metrics the study's tasks give (MQAR per number of pairs, NIAH per length and per depth)."""
    tasks, o = set(study.tasks), study.eval_options
    out = [Metric("train_loss", f"training loss (last {FINAL_SHARE:.0%} of updates)", _final_train_loss, False),
           Metric("val_loss", "validation loss at the end of training", _final_logged("val_loss"), False)]
    if "ppl" in tasks:
        out += [Metric("test_loss", f"{o.split} loss (nats/token, whole split)", _items("ppl"), False),
                Metric("test_ppl", f"{o.split} perplexity (whole split)", _items("ppl"), False, np.exp)]
        out += [Metric(f"test_ppl@{source}", f"{o.split} perplexity of the windows mostly from {source}",
                       _items("ppl", lambda r, s=source: r.get("source") == s), False, np.exp)
                for source in _window_sources(records)]
    if "cloze" in tasks:
        out.append(Metric("cloze", "cloze accuracy", _items("cloze"), True, bounded=True))
    if "mqar" in tasks:
        out.append(Metric("mqar", "MQAR accuracy, mean over pairs", _items("mqar"), True, bounded=True))
        seen = sorted({n for by_seed in records.values() for r in by_seed.values()
                       for n in r["records"].get("mqar", {}).get("pairs", [])})
        out += [Metric(f"mqar@{n}", f"MQAR accuracy, {n} pairs", _items("mqar", lambda r, n=n: r["pairs"] == n),
                       True, bounded=True) for n in seen]
    if "niah" in tasks:
        out.append(Metric("niah", "NIAH accuracy, mean over cells", _items("niah"), True, bounded=True))
        out += [Metric(f"niah@{n}", f"NIAH accuracy, {n} tokens", _items("niah", lambda r, n=n: r["length"] == n),
                       True, bounded=True) for n in o.niah_lengths]
        out += [Metric(f"niah@depth{d:g}", f"NIAH accuracy, depth {d:g}",
                       _items("niah", lambda r, d=d: r["depth"] == d), True, bounded=True) for d in o.niah_depths]
    if "recall" in tasks:
        fmt = f"template {o.recall_template}, keys {o.recall_keys}, values {o.recall_values}"
        out.append(Metric("lab_recall", f"the memory lab's clean recall (4-choice; {fmt}), mean over loads",
                          _recall, True, bounded=True, gate=CLEAN_RECALL_GATE))
        out += [Metric(f"recall@{k}", f"the memory lab's clean recall (4-choice; {fmt}), {k} facts",
                       _items("recall", lambda r, k=k: r["bindings"] == k), True, bounded=True,
                       gate=CLEAN_RECALL_GATE) for k in o.recall_bindings]
    for entry in parse_entries(study.recipe_config.train.eval_lab_recall, str(study.path)):
        out += [Metric(entry.metric(k), f"the memory lab's clean recall at the last evaluation of training "
                       f"({entry.label}, {k} facts; validation documents)", _final_logged(entry.metric(k)), True,
                       bounded=True, gate=CLEAN_RECALL_GATE) for k in entry.loads]
    if "stability" in tasks:
        out.append(Metric("norm", "largest per-layer mean mixer-output norm", _eval_metric(
            "stability", "max_layer_output_norm"), False))
    return out


def collect(study: Study, out: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """``{model: {seed: items.json}}`` of every finished run."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for model in study.model_names:
        for seed in study.seeds:
            if (run_dir(out, model, seed) / "items.json").is_file():
                found.setdefault(model, {})[seed] = read_items(out, model, seed)
    return found


def _round(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")


def _estimate(e) -> dict[str, Any]:
    return {"mean": _round(e.mean), "low": _round(e.low), "high": _round(e.high), "n": e.n, "units": e.sources}


def build_tables(study: Study, out: str | Path) -> dict[str, Any]:
    """The tables of every finished run in ``out`` (missing runs listed), as a JSON-ready dict."""
    out = Path(out)
    records = collect(study, out)
    metrics = metrics_of(study, records)
    measured: dict[str, dict[str, dict[int, Measurement]]] = {}
    models: dict[str, Any] = {}
    for model in study.model_names:
        by_seed = records.get(model, {})
        entry = {"seeds": sorted(by_seed), "missing_seeds": [s for s in study.seeds if s not in by_seed],
                 "agreement": {str(s): r.get("agreement", {}) for s, r in sorted(by_seed.items())}, "metrics": {}}
        for metric in metrics:
            values = {s: m for s, r in sorted(by_seed.items())
                      if (m := metric.read(r, run_dir(out, model, s))) is not None}
            measured.setdefault(metric.name, {})[model] = values
            if not values:
                continue
            per_seed = {}
            for s, m in values.items():
                if isinstance(m, ItemSet):
                    per_seed[str(s)] = _estimate(item_estimate(m, metric.transform))
                else:
                    per_seed[str(s)] = {"mean": _round(float(metric.transform(np.array(m)))), "low": None,
                                        "high": None, "n": None, "units": None}
            summary = seed_estimate({int(s): v["mean"] for s, v in per_seed.items()})
            entry["metrics"][metric.name] = {"seed_bootstrap": _estimate(summary), "seeds": per_seed}
        models[model] = entry
    comparisons = []
    for a, b in study.compare:
        for metric in metrics:
            va, vb = measured[metric.name].get(a, {}), measured[metric.name].get(b, {})
            if not (set(va) & set(vb)):
                continue
            diff = paired_difference(va, vb, metric.transform)
            comparison = {"a": a, "b": b, "metric": metric.name, "difference": _estimate(diff),
                          **decide(diff.low, diff.high, diff.mean, diff.n, metric.higher)}
            if metric.gate is not None and all(models[m]["metrics"][metric.name]["seed_bootstrap"]["mean"]
                                               < metric.gate for m in (a, b)):
                comparison["below_gate"] = metric.gate  # a lead between two models the lab attributes nothing in
            comparisons.append(comparison)
    return {"study": study.name, "description": study.description, "seeds": study.seeds,
            "tasks": study.tasks, "eval": study.eval_record(),
            "metrics": {m.name: {"label": m.label, "higher_is_better": m.higher, "bounded": m.bounded}
                        for m in metrics},
            "models": models, "comparisons": comparisons}


def decide(low: float, high: float, mean: float, seeds: int, higher: bool) -> dict[str, Any]:
    """Whether an A - B interval over ``seeds`` paired seeds decides the comparison, and for whom: resolved when it
    excludes zero over at least ``MIN_SEEDS`` seeds (``a_better`` None when unresolved). With fewer, the interval
    holds the test items' noise but not the spread between seeds (a training-loss difference from one seed has no
    interval at all)."""
    enough = seeds >= MIN_SEEDS
    resolved = enough and (low > 0 or high < 0)
    return {"resolved": bool(resolved), "enough_seeds": enough,
            "a_better": ((mean > 0) == higher) if resolved else None}


def _verdict(c: dict[str, Any]) -> str:
    if c["resolved"]:
        better = f"{c['a'] if c['a_better'] else c['b']} better"
        return better + (f" (both below the lab's {c['below_gate']:g} recall gate)" if "below_gate" in c else "")
    if not c["enough_seeds"]:
        return f"not decided (fewer than {MIN_SEEDS} seeds)"
    return "not resolved"


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.3e}"


def _interval(e: dict[str, Any]) -> str:
    if e["low"] is None:
        return _fmt(e["mean"])
    return f"{_fmt(e['mean'])} [{_fmt(e['low'])}, {_fmt(e['high'])}]"


def markdown(tables: dict[str, Any]) -> str:
    """``results.md``: the per-model tables, the comparisons, what is missing."""
    lines = [f"# Study {tables['study']}", ""]
    if tables["description"]:
        lines += [tables["description"], ""]
    options = tables["eval"]["options"]
    size = "the whole split" if options["max_tokens"] >= WHOLE_SPLIT else f"its first {options['max_tokens']:,} tokens"
    lines += [f"Seeds {tables['seeds']}, every seed reported. Evaluation: tasks {', '.join(tables['tasks'])} on the "
              f"`{options['split']}` split ({size} for perplexity), the same settings for every run. "
              "Model rows: mean over seeds [seed-bootstrap 95% CI]; seed columns: the seed's value [item-bootstrap "
              "95% CI over test items]. With 3 seeds the seed interval cannot leave the seeds' range.", ""]
    missing = [f"{m}: seeds {e['missing_seeds']}" for m, e in tables["models"].items() if e["missing_seeds"]]
    if missing:
        lines += ["**Partial tables**: runs not finished: " + "; ".join(missing) + ".", ""]
    for name, info in tables["metrics"].items():
        rows = [(m, e["metrics"][name]) for m, e in tables["models"].items() if name in e["metrics"]]
        if not rows:
            continue
        seeds = sorted({s for _, r in rows for s in r["seeds"]}, key=int)
        arrow = "higher is better" if info["higher_is_better"] else "lower is better"
        lines += [f"## {name}: {info['label']} ({arrow})", "",
                  "| model | mean [seed CI] | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|---|---|" + "---|" * len(seeds)]
        for model, row in rows:
            cells = [_interval(row["seeds"][s]) if s in row["seeds"] else "–" for s in seeds]
            lines.append(f"| {model} | {_interval(row['seed_bootstrap'])} | " + " | ".join(cells) + " |")
        lines.append("")
    if tables["comparisons"]:
        lines += ["## Paired comparisons", "", "A - B over the seeds both have, two-level bootstrap 95% CI (seeds "
                  "paired, test items paired). Resolved: the interval excludes 0 over at least "
                  f"{MIN_SEEDS} seeds." + (" A recall lead between two models whose means are both below the memory "
                  f"lab's clean-recall gate ({CLEAN_RECALL_GATE:g}; chance 0.25) says so: the lab attributes nothing "
                  "in either." if any("below_gate" in c for c in tables["comparisons"]) else ""), "",
                  "| A | B | metric | A - B [CI] | seeds | verdict |", "|---|---|---|---|---|---|"]
        for c in tables["comparisons"]:
            verdict = _verdict(c)
            lines.append(f"| {c['a']} | {c['b']} | {c['metric']} | {_interval(c['difference'])} | "
                         f"{c['difference']['n']} | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def write_tables(study: Study, out: str | Path, figures: bool = True) -> Path:
    """Build the tables from ``out``'s files and write ``out/tables`` (results.json, results.md, figures)."""
    out = Path(out)
    tables = build_tables(study, out)
    folder = out / TABLES
    folder.mkdir(parents=True, exist_ok=True)
    if figures:
        tables["figures"] = draw_figures(tables, study, out, folder)
    write_json_atomic(folder / "results.json", tables)
    with atomic_write(folder / "results.md", "w") as f:
        f.write(markdown(tables))
        for name, file in tables.get("figures", {}).items():
            f.write(f"\n![{name}]({file})\n")
    return folder
