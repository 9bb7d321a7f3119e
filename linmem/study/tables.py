"""The study's tables, rebuilt from the run folder's files alone (``items.json``, ``metrics.jsonl``): per model and
metric the mean over seeds with a seed-bootstrap 95% interval and every seed's value with its item-bootstrap
interval, then the study's paired comparisons (A - B with a two-level interval and a paired t-test over seeds).
Written as ``tables/results.json`` and ``tables/results.md`` (figures beside them, ``linmem.study.figures``); the
same files give the same bytes.

The decision rule: only the study's claims (``claims:`` in its file, declared before the runs) are decided. Their
paired t-tests' p-values are Holm-corrected over every claimed metric of the study (a claim that was not measured
counts with p = 1, so that missing runs never shrink the family), and a claim is decided when it has at least
``MIN_SEEDS`` seeds, its Holm-adjusted p is below ``ALPHA`` and its two-level interval (seeds and test documents)
excludes zero: the test answers for the seeds, the interval for the test set, which every seed shares. Every other
comparison is exploratory: shown with its uncorrected p, never decided. Test perplexity resamples documents (the
windows of one document are not independent); records written before windows named their document resample
windows, and the tables say so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from linmem.eval.stability import largest_readout_norm
from linmem.eval.task_names import WHOLE_SPLIT
from linmem.io.atomic import atomic_write, write_json_atomic
from linmem.io.run_info import read_train_info
from linmem.memory.experiment_names import CLEAN_RECALL_GATE
from linmem.memory.stats import Estimate
from linmem.study.definition import MIN_SEEDS, Study
from linmem.study.estimates import (
    ALPHA,
    ItemSet,
    Measurement,
    PairedTest,
    holm,
    identity,
    item_estimate,
    paired_difference,
    paired_test,
    seed_estimate,
    seed_value,
)
from linmem.study.figures import draw_figures
from linmem.study.runs import read_items, run_dir, training_log
from linmem.train.lab_recall import parse_entries

TABLES = "tables"
FINAL_SHARE = 0.1  # the final training loss: mean over the last tenth of the updates
DOCUMENT = "document"  # the column of a test window's document, which the test bootstrap resamples


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


def _items(task: str, keep: Callable[[dict[str, Any]], bool] | None = None, unit: str = "unit"):
    """Reader of a task's items; ``unit`` names the column the bootstrap resamples (``unit`` where it is absent)."""
    def read(record: dict[str, Any], folder: Path) -> ItemSet | None:
        columns = record["records"].get(task)
        if not columns or not columns["unit"]:
            return None
        resampled = unit if unit in columns else "unit"
        rows = range(len(columns["unit"]))
        if keep is not None:
            rows = [i for i in rows if keep({k: v[i] for k, v in columns.items()})]
        if not rows:
            return None
        pick = lambda key: [columns[key][i] for i in rows]  # noqa: E731
        return ItemSet.from_columns(pick(resampled), pick("group"), pick("num"), pick("den"))
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


def _readout_norm(record: dict[str, Any], folder: Path) -> float | None:
    """The stability eval's largest per-layer mean read-out norm; from its per-layer table where the record was
    evaluated before the metric was kept (the same maximum); None for a model without a memory read-out."""
    value = _eval_metric("stability", "max_layer_readout_norm")(record, folder)
    if value is not None:
        return value
    return largest_readout_norm(record.get("eval_tables", {}).get("stability") or [])


def _log_readout_norm(record: dict[str, Any], folder: Path) -> float | None:
    value = _readout_norm(record, folder)
    return None if value is None or value <= 0 else math.log(value)


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
        windows = _items("ppl", unit=DOCUMENT)
        out += [Metric("test_loss", f"{o.split} loss (nats/token, whole split)", windows, False),
                Metric("test_ppl", f"{o.split} perplexity (whole split)", windows, False, np.exp)]
        out += [Metric(f"test_ppl@{source}", f"{o.split} perplexity of the windows mostly from {source}",
                       _items("ppl", lambda r, s=source: r.get("source") == s, DOCUMENT), False, np.exp)
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
        out.append(Metric("readout_norm", "largest per-layer mean memory read-out norm, before the per-head output "
                          "norm", _readout_norm, False))
        # the same on a log scale, where a difference is a log ratio: norms that grow do so by factors (the RLA
        # paper's Fig. 4a has a log axis), and one seed's growth by 100x does not swamp the others' spread
        out.append(Metric("log_readout_norm", "natural log of the largest per-layer mean memory read-out norm",
                          _log_readout_norm, False))
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


def _environments(records: dict[str, dict[int, dict[str, Any]]], out: Path) -> list[dict[str, Any]]:
    """Which GPU (else device), torch and triton trained the finished runs, from each run's ``train_info.json``:
    ``[{"environment": label, "runs": ["MODEL:SEED", ...]}]``, most runs first; runs whose record names none (trained
    before records did) under "not recorded"."""
    groups: dict[str, list[str]] = {}
    for model, by_seed in records.items():
        for seed in sorted(by_seed):
            env = read_train_info(run_dir(out, model, seed) / "model").get("environment")
            label = "not recorded" if not env else (f"{env['gpu'] or env['device']}, torch {env['torch']}, "
                                                    f"triton {env['triton'] or 'not installed'}")
            groups.setdefault(label, []).append(f"{model}:{seed}")
    return [{"environment": label, "runs": runs}
            for label, runs in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))]


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
    comparisons, not_measured = compare(study, metrics, measured, models)
    return {"study": study.name, "description": study.description, "seeds": study.seeds,
            "tasks": study.tasks, "eval": study.eval_record(),
            "metrics": {m.name: {"label": m.label, "higher_is_better": m.higher, "bounded": m.bounded}
                        for m in metrics},
            "test_resamples": _test_resamples(records), "environments": _environments(records, out),
            "models": models, "comparisons": comparisons, "claims_not_measured": not_measured}


def metric_names(study: Study) -> tuple[set[str], tuple[str, ...]]:
    """The metrics ``study``'s tables can hold (what a claim may name): their names, and the prefixes of those
    whose names only the records give (``test_ppl@SOURCE``)."""
    names = {m.name for m in metrics_of(study, {})}
    if "mqar" in study.tasks:
        names |= {f"mqar@{n}" for n in study.eval_options.mqar_pairs}
    return names, ("test_ppl@",) if "ppl" in study.tasks else ()


def _test_resamples(records: dict[str, dict[int, dict[str, Any]]]) -> str | None:
    """What the test perplexity's bootstrap resamples: documents, or windows when a record predates documents."""
    ppl = [r["records"]["ppl"] for by_seed in records.values() for r in by_seed.values() if r["records"].get("ppl")]
    if not ppl:
        return None
    return "documents" if all(DOCUMENT in columns for columns in ppl) else "windows"


def _test(test: PairedTest) -> dict[str, Any]:
    return {"name": test.name, "df": test.df, "t": _round(test.t), "p": _round(test.p), "low": _round(test.low),
            "high": _round(test.high), "sign_flip_p": None if test.sign_flip_p is None else _round(test.sign_flip_p)}


def compare(study: Study, metrics: list[Metric], measured: dict[str, dict[str, dict[int, Measurement]]],
            models: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every pair of ``compare`` on every metric both models have (the difference with its two-level interval and
    the paired t-test over seeds), the claims decided (module docstring); and the claims with nothing measured."""
    comparisons, found = [], {}
    for a, b in study.compare:
        for metric in metrics:
            va, vb = measured[metric.name].get(a, {}), measured[metric.name].get(b, {})
            seeds = sorted(set(va) & set(vb))
            if not seeds:
                continue
            diff = paired_difference(va, vb, metric.transform)
            test = paired_test([seed_value(va[s], metric.transform) - seed_value(vb[s], metric.transform)
                                for s in seeds])
            comparison = {"a": a, "b": b, "metric": metric.name, "difference": _estimate(diff),
                          "enough_seeds": diff.n >= MIN_SEEDS, "test": _test(test), "claim": False, "holm_p": None,
                          "decided": False, "a_better": None}
            if metric.gate is not None and all(models[m]["metrics"][metric.name]["seed_bootstrap"]["mean"]
                                               < metric.gate for m in (a, b)):
                comparison["below_gate"] = metric.gate  # a lead between two models the lab attributes nothing in
            comparisons.append(comparison)
            found[(a, b, metric.name)] = comparison, diff, test, metric.higher
    family = [(c.a, c.b, name) for c in study.claims for name in c.metrics]
    adjusted = holm([found[k][2].p if k in found and found[k][1].n >= MIN_SEEDS else 1.0 for k in family])
    for key, p in zip(family, adjusted):
        if key in found:
            comparison, diff, _, higher = found[key]
            comparison.update(claim=True, holm_p=_round(p), **decide(diff, p, higher))
    return comparisons, [{"a": a, "b": b, "metric": name} for a, b, name in family if (a, b, name) not in found]


def decide(diff: Estimate, holm_p: float, higher: bool) -> dict[str, Any]:
    """Whether a claim is decided, and for whom: over at least ``MIN_SEEDS`` paired seeds, its Holm-adjusted p
    below ``ALPHA`` and its two-level interval ``diff`` excluding zero (``a_better`` None when not decided)."""
    decided = diff.n >= MIN_SEEDS and holm_p < ALPHA and (diff.low > 0 or diff.high < 0)
    return {"decided": bool(decided), "a_better": ((diff.mean > 0) == higher) if decided else None}


def _verdict(c: dict[str, Any]) -> str:
    if not c["claim"]:
        return "exploratory"
    if c["decided"]:
        better = f"{c['a'] if c['a_better'] else c['b']} better"
        return better + (f" (both below the lab's {c['below_gate']:g} recall gate)" if "below_gate" in c else "")
    if not c["enough_seeds"]:
        return f"not decided (fewer than {MIN_SEEDS} seeds)"
    if c["holm_p"] is not None and c["holm_p"] < ALPHA:
        return "not decided (the test set's interval holds 0)"
    return "not decided"


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
    if tables.get("environments"):
        lines += ["Trained on: " + "; ".join(f"{g['environment']} ({len(g['runs'])} run{'s' * (len(g['runs']) > 1)})"
                                          for g in tables["environments"]) + ".", ""]
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
    if tables["comparisons"] or tables.get("claims_not_measured"):
        lines += _comparison_sections(tables)
    return "\n".join(lines)


def _fmt_p(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def _t_cell(test: dict[str, Any]) -> str:
    if test["p"] is None:
        return "–"
    t = "±inf" if test["t"] is None else _fmt(test["t"])
    return f"{test['name']}({test['df']}) = {t}"  # paired t(2) = 5.1


def _comparison_sections(tables: dict[str, Any]) -> list[str]:
    """The claims (decided by the rule of the module docstring) and the exploratory comparisons."""
    comparisons = tables["comparisons"]
    lines = _claims_section([c for c in comparisons if c["claim"]], tables.get("claims_not_measured", []))
    lines += _exploratory_section([c for c in comparisons if not c["claim"]])
    if tables.get("test_resamples") == "windows":
        lines += ["The test perplexity's items resample test windows: these records predate windows naming their "
                  "document, so the intervals of `test_loss` and `test_ppl` leave out that windows of one document "
                  "move together and are too narrow (a new evaluation records documents).", ""]
    return lines


def _claims_section(claims: list[dict[str, Any]], not_measured: list[dict[str, str]]) -> list[str]:
    family = len(claims) + len(not_measured)
    if not family:
        return ["## Claims", "", "The study file declares no claims (`claims:`): no comparison is decided.", ""]
    gate = (f" A recall lead between two models whose means are both below the memory lab's clean-recall gate "
            f"({CLEAN_RECALL_GATE:g}; chance 0.25) says so: the lab attributes nothing in either."
            if any("below_gate" in c for c in claims) else "")
    lines = ["## Claims", "",
             f"The comparisons the study file declares as its claims (`claims:`), {family} claimed metrics in all. "
             "A - B over the seeds both have, with a two-level bootstrap 95% CI (seeds paired, then test items paired "
             "within each seed); a two-sided paired t-test over the seeds (df = seeds - 1) with its 95% CI of the "
             f"mean; p Holm-corrected over the {family} claimed metrics. Decided: at least {MIN_SEEDS} seeds, Holm "
             f"p < {ALPHA:g} and the two-level CI excludes 0. Sign-flip p is the exact permutation test over the same "
             "seeds, which assumes no normality but cannot go below 2 / 2^seeds (0.25 at 3 seeds, 0.0625 at 5): a "
             "verdict at fewer than 6 seeds rests on the t-test's assumption that the seeds' differences scatter "
             "normally." + gate, "",
             "| A | B | metric | A - B [CI] | seeds | test | t 95% CI | p | Holm p | sign-flip p | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in claims:
        test = c["test"]
        lines.append(f"| {c['a']} | {c['b']} | {c['metric']} | {_interval(c['difference'])} | "
                     f"{c['difference']['n']} | {_t_cell(test)} | [{_fmt(test['low'])}, {_fmt(test['high'])}] | "
                     f"{_fmt_p(test['p'])} | {_fmt_p(c['holm_p'])} | {_fmt_p(test['sign_flip_p'])} | {_verdict(c)} |")
    lines += [f"| {c['a']} | {c['b']} | {c['metric']} | – | 0 | – | – | – | – | – | not measured |"
              for c in not_measured]
    return lines + [""]


def _exploratory_section(exploratory: list[dict[str, Any]]) -> list[str]:
    if not exploratory:
        return []
    lines = ["## Exploratory comparisons", "", "The other compared pairs and metrics: A - B over the seeds both have, "
             "two-level bootstrap 95% CI (seeds paired, then test items paired within each seed), and the paired "
             "t-test's p uncorrected for the many comparisons. Shown, never decided.", "",
             "| A | B | metric | A - B [CI] | seeds | p, uncorrected |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['a']} | {c['b']} | {c['metric']} | {_interval(c['difference'])} | {c['difference']['n']} | "
              f"{_fmt_p(c['test']['p'])} |" for c in exploratory]
    return lines + [""]


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
