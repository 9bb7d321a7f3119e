"""``linmem demo [--out DIR] [--device cpu] [--quick]``: the shipped zoo on this machine, in minutes.

1. every shipped model (``linmem.zoo``) is evaluated with ``linmem.eval``'s runner on recall (MQAR, the memory
   lab's clean recall, a small needle-in-a-haystack grid) and perplexity, on the held-out text shipped with the zoo;
2. the memory lab's default protocol (``linmem probe``'s ``run_protocol``: head scan, lifecycle, four facts, hybrid
   attribution, S vs R; ``--quick`` adds tiny load and gap sweeps) runs on one residual model (RDN if shipped), at
   small sizes;
3. ``DIR/report.html`` (self-contained: tables, figures embedded as PNG, the probe's report inline) and
   ``DIR/results.json``; each model's evaluation report in ``DIR/eval/<name>/``, the probe's in ``DIR/probe/``.

The sizes (``DEMO`` / ``QUICK``) keep the default run under 10 minutes on a 2-core CPU; the numbers are therefore
coarser than the model cards' (``eval.json``, measured by ``linmem zoo ship`` with far more samples).

Only argparse, the standard library and light modules (tqdm, the zoo's cards) load with this module; the functions
that evaluate, probe or draw import torch and the rest when called, so that ``linmem demo --help`` answers at once.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from linmem.io.atomic import write_bytes_atomic
from linmem.io.backend_names import add_backend_option
from linmem.io.folders import check_output_folder, output_file, output_folder, output_subfolder
from linmem.zoo.cards import headline, mixer_label

if TYPE_CHECKING:
    from linmem.eval.runner import EvalOptions
    from linmem.memory.probe import ProbeOptions

TASKS = ("ppl", "mqar", "recall", "niah")
REPORT_FILES = ("results.json", "report.html")  # the demo's own files; eval/ and probe/ hold the reports it runs
RESIDUAL = ("rdn", "rla")


@dataclass(frozen=True)
class DemoSettings:
    """The demo's sizes: keyword arguments of ``EvalOptions`` (``eval``) and of ``ProbeOptions`` (``probe``), plain
    values so that defining them needs neither the evaluation nor the memory lab."""

    eval: dict[str, Any]
    probe: dict[str, Any]

    def options(self, device: str) -> tuple[EvalOptions, ProbeOptions]:
        """``(EvalOptions, ProbeOptions)`` of these sizes, the evaluation on ``device``."""
        from linmem.eval.runner import EvalOptions
        from linmem.memory.probe import ProbeOptions

        return EvalOptions(**self.eval, device=device), ProbeOptions(**self.probe)


# 4 perplexity windows, MQAR with 8 and 32 pairs (16 sequences each, as the model cards), 16 memory-lab items, NIAH
# at 256 and 512 tokens x 3 depths (4 trials per cell, as the cards); the probe on 6 development and 4 held-out
# passages of 128 filler tokens, without the load / gap sweeps and the extras (``linmem probe --no-sweeps
# --no-extras``: the sweeps alone take minutes).
DEMO = DemoSettings(
    dict(split="test", batch_size=8, max_tokens=2048, mqar_pairs=(8, 32), mqar_samples=16, niah_lengths=(256, 512),
         niah_depths=(0.0, 0.5, 1.0), niah_samples=4, recall_items=16, recall_filler=128),
    dict(dev_sources=6, confirm_sources=4, filler_tokens=128, num_bindings=4, repeats=2, sweeps=False, extras=False))
# The smallest sizes that still run every step (tests); the clean-recall gate is off so that every experiment runs
# even on an untrained model (the report still gives its clean recall).
QUICK = DemoSettings(
    dict(split="test", batch_size=8, max_tokens=64, mqar_pairs=(4,), mqar_samples=2, niah_lengths=(64,),
         niah_depths=(0.5,), niah_samples=1, recall_items=4, recall_filler=32),
    dict(dev_sources=2, confirm_sources=2, filler_tokens=32, num_bindings=2, repeats=2, loads=(1, 2), gaps=(0, 8),
         sweeps=True, extras=False, min_clean_recall=0.0))


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("linmem-demo"), help="report folder (default ./linmem-demo)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out that linmem demo did not make (its other files are kept)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, auto")
    parser.add_argument("--quick", action="store_true", help="the smallest sizes (a smoke test, seconds per model)")
    parser.add_argument("--models", default=None, help="comma-separated shipped models (default: all)")
    parser.add_argument("--probe", default=None, help="the model the memory lab probes (default: rdn if shipped, "
                                                       "else another residual model)")
    parser.add_argument("--zoo-dir", default=None, help="zoo folder (default: $LINMEM_ZOO_DIR or the package's)")
    add_backend_option(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    check_output_folder(args.out, overwrite=args.overwrite, kind="demo", files=REPORT_FILES)  # before slow imports
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model and task would bury the demo's own
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    result = run_demo(args.out, args.device, args.quick, models=models, probe=args.probe, zoo_dir=args.zoo_dir,
                      overwrite=args.overwrite, backend=args.backend)
    print(f"linmem demo: {len(result['models'])} models evaluated, memory lab on {result['probe']['model']}; "
          f"report: {Path(args.out) / 'report.html'}")
    print(f"linmem demo: total time {result['seconds']:.0f} s ({result['seconds'] / 60:.1f} min)")
    return 0


PROBE_RECALL_BAR = 0.5  # the memory lab's clean 4-choice recall (chance 0.25) a model needs to be worth probing


def pick_probe_model(names: list[str], mixers: dict[str, str], wanted: str | None,
                     recall: dict[str, float | None] | None = None) -> str:
    """``wanted`` if given; else the first residual model (RDN, then RLA, then the others with those mixers) whose
    clean memory-lab ``recall`` reaches ``PROBE_RECALL_BAR``; else the model with the best recall if it reaches it
    (probing a model that does not hold the fact finds nothing); else the first residual model, else the first."""
    if wanted is not None:
        if wanted not in names:
            raise ValueError(f"--probe {wanted!r} is not among the evaluated models: {', '.join(names)}")
        return wanted
    residual = [n for n in dict.fromkeys([*RESIDUAL, *names]) if n in names and mixers[n] in RESIDUAL]
    recall = recall or {}
    recalls = [n for n in names if (recall.get(n) or 0.0) >= PROBE_RECALL_BAR]
    for name in residual:
        if name in recalls:
            return name
    if recalls:
        return max(recalls, key=lambda n: recall[n])
    return residual[0] if residual else names[0]


def _recall_text(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}, chance 0.25"


def heldout_documents(name: str, zoo_dir: str | None):
    """The shipped held-out test documents of model ``name``, decoded to text (the probe's filler)."""
    from linmem import zoo
    from linmem.data.shards import TokenShards
    from linmem.data.sources import Document
    from linmem.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(zoo.path(name, zoo_dir))
    split = TokenShards(zoo.heldout_dir(name, zoo_dir)).split("test")
    return [Document(source, sid, tokenizer.decode(ids.tolist(), skip_special_tokens=True,
                                                   clean_up_tokenization_spaces=False))
            for source, sid, ids in split.documents()]


def run_probe(name: str, options: ProbeOptions, device: str, out: Path, zoo_dir: str | None,
              backend: str = "auto") -> dict[str, Any]:
    from linmem import zoo
    from linmem.memory.probe import load_model_dir, run_protocol

    folder = zoo.path(name, zoo_dir)
    model, tokenizer = load_model_dir(folder, device, backend)
    start = time.perf_counter()
    summaries = run_protocol(model, tokenizer, heldout_documents(name, zoo_dir), options, out,
                             header={"model": f"zoo:{name}", "device": device})
    payload = json.loads((out / "results.json").read_text(encoding="utf-8"))
    return {"model": name, "seconds": round(time.perf_counter() - start, 1), "header": payload["header"],
            "summaries": summaries, "s_vs_r": payload["experiments"].get("s_vs_r", {}).get("rows", [])}


def run_demo(out: str | Path, device: str = "cpu", quick: bool = False, models: list[str] | None = None,
             probe: str | None = None, zoo_dir: str | None = None, overwrite: bool = False,
             backend: str = "auto") -> dict[str, Any]:
    """Evaluate the shipped models, probe one, write ``report.html`` and ``results.json`` into ``out`` (new, empty or
    an earlier demo's, unless ``overwrite``: ``linmem.io.folders.prepare_output_folder``); the models run on the op
    ``backend``."""
    from linmem import zoo
    from linmem.zoo import figures

    start = time.perf_counter()
    shipped = zoo.names(zoo_dir)
    if not shipped:
        raise FileNotFoundError(f"no zoo models are shipped in {zoo.root(zoo_dir)}: train them (configs/zoo/) and "
                                f"package them with `linmem zoo ship RUN_DIR ...` (docs/zoo.md), or point "
                                f"{zoo.ENV_VAR} at a zoo folder")
    if not figures.have_matplotlib():
        raise ValueError("linmem demo draws its figures with matplotlib (a base dependency): pip install matplotlib")
    names = [zoo.path(n, zoo_dir).name for n in models] if models else shipped
    eval_options, probe_options = (QUICK if quick else DEMO).options(device)
    with output_folder(out, overwrite=overwrite, kind="demo", files=REPORT_FILES) as out:  # a failed demo: no folder
        results = evaluate_models(names, eval_options, output_subfolder(out, "eval"), zoo_dir, backend)
        mixers = {n: json.loads((zoo.path(n, zoo_dir) / "config.json").read_text(encoding="utf-8"))["mixer"]
                  for n in names}
        recall = {n: headline(r["tasks"]).get("recall") for n, r in results.items()}
        chosen = pick_probe_model(names, mixers, probe, recall)
        print(f"demo: memory lab on {chosen} ...", flush=True)
        probe_result = {**run_probe(chosen, probe_options, device, output_subfolder(out, "probe"), zoo_dir, backend),
                        "recall": recall.get(chosen)}
        total = time.perf_counter() - start
        summary = {"seconds": round(total, 1), "quick": quick, "device": device, "machine": machine(),
                   "zoo_dir": str(zoo.root(zoo_dir)),
                   "settings": {"eval": asdict(eval_options), "probe": asdict(probe_options)},
                   "models": results, "probe": probe_result}
        write_bytes_atomic(output_file(out, "results.json"), json.dumps(summary, indent=1, default=str).encode("utf-8"))
        write_bytes_atomic(output_file(out, "report.html"), report_html(summary, out).encode("utf-8"))
    return summary


def evaluate_models(names: list[str], eval_options: EvalOptions, out: Path, zoo_dir: str | None,
                    backend: str = "auto") -> dict[str, Any]:
    """Evaluate each shipped model ``names`` (on the op ``backend``) into ``out / NAME``; its row of the demo's
    summary by name."""
    from linmem import zoo
    from linmem.eval.runner import evaluate

    results: dict[str, Any] = {}
    bar = tqdm(names, desc="demo: evaluating", unit="model")
    for name in bar:
        bar.set_postfix(model=name)
        report = evaluate(zoo.path(name, zoo_dir), TASKS, eval_options, out_dir=out / name, progress=False,
                          backend=backend)
        config = json.loads((zoo.path(name, zoo_dir) / "config.json").read_text(encoding="utf-8"))
        results[name] = {"mixer": mixer_label(config), "vocab_size": config["vocab_size"],
                         "parameters": report["parameters"], "tasks": report["tasks"],
                         "seconds": round(sum(t["seconds"] for t in report["tasks"].values()), 1)}
    return results


def machine() -> dict[str, Any]:
    import torch

    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average_1min": load,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


# ---------------------------------------------------------------- the report


def sample_sizes(models: dict[str, Any]) -> tuple[int | None, int | None, int]:
    """``(MQAR sequences per size, NIAH trials per cell, NIAH depths)`` as the evaluations recorded them (None:
    not recorded)."""
    tasks = next(iter(models.values()))["tasks"]
    sequences = next((r.get("samples") for r in tasks.get("mqar", {}).get("table", [])), None)
    niah = tasks.get("niah", {})
    return sequences, niah.get("metrics", {}).get("samples_per_cell"), len(niah.get("grid", {}).get("depths", []))


def _share(value: float | None, trials: int | None) -> str:
    """``"0.94 [0.80, 0.98]"``: a share with its Wilson 95% interval over ``trials`` (``–`` when not measured)."""
    from linmem.zoo.cards import fmt
    from linmem.zoo.figures import wilson

    if value is None or not trials:
        return fmt(value, 2)
    low, high = wilson(value, trials)
    return f"{value:.2f} [{low:.2f}, {high:.2f}]"


def summary_rows(models: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model with the numbers the demo measured here, each share with its 95% interval, then what
    guessing scores; the column names say the sample."""
    from linmem.eval.descriptions import describe_perplexity
    from linmem.zoo.cards import fmt, recall_cell

    heads = {name: headline(r["tasks"]) for name, r in models.items()}
    pairs = sorted({p for h in heads.values() for p in h.get("mqar", {})})
    lengths = sorted({n for h in heads.values() for n in h.get("niah", {})})
    mqar, trials, depths = sample_sizes(models)
    niah = trials * depths if trials else None
    rows = []
    for name, r in models.items():
        h = heads[name]
        rows.append({"model": name, "mixer": r["mixer"], "params": f"{r['parameters'] / 1e6:.2f}M",
                     "test ppl": describe_perplexity(r["tasks"]["ppl"]["metrics"]) if "ppl" in h else fmt(None),
                     **{f"MQAR {p} pairs ({mqar} seq.)": _share(h.get("mqar", {}).get(p), mqar) for p in pairs},
                     f"lab recall ({h.get('recall_n', '?')} items)": recall_cell(h),
                     **{f"NIAH {n} tokens ({niah} trials)": _share(h.get("niah", {}).get(n), niah) for n in lengths},
                     "seconds": fmt(r["seconds"], 1)})
    vocab = sorted({r["vocab_size"] for r in models.values()})
    chance = {"model": "chance", "mixer": "", "params": "", "test ppl": ", ".join(f"{v:,}" for v in vocab),
              **{f"MQAR {p} pairs ({mqar} seq.)": fmt(1 / p, 2) for p in pairs}}
    chance.update({k: "0.25" if k.startswith("lab") else "1e-04" for k in rows[0] if k.startswith(("lab", "NIAH"))})
    rows.append({**{k: "" for k in rows[0]}, **chance})
    return rows


def card_rows(names: list[str], zoo_dir: str | None) -> tuple[list[dict[str, str]], list[str]]:
    """The model cards' headline numbers of ``names`` as ``linmem zoo list`` prints them, and its legend."""
    from linmem import zoo
    from linmem.zoo.commands import card_legend, card_numbers

    records = {n: zoo.eval_record(n, zoo_dir) if (zoo.path(n, zoo_dir) / "eval.json").is_file() else {} for n in names}
    return [{"model": n, **card_numbers(r)} for n, r in records.items()], card_legend(list(records.values()))


def summary_figures(models: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(caption, Figure)``: MQAR curves, recall bars, the NIAH grids and perplexity per model, each caption
    saying the sample and what the intervals are."""
    from linmem.zoo import figures

    heads = {name: headline(r["tasks"]) for name, r in models.items()}
    sequences, trials, depths = sample_sizes(models)
    out = [(f"MQAR accuracy against the number of key-value pairs, {sequences} sequences per point (each pair "
            f"queried once); bars: Wilson 95% intervals counting each sequence as one trial; dashed: chance.",
            figures.mqar_curves({n: r["tasks"]["mqar"]["table"] for n, r in models.items()}, intervals=True))]
    most_pairs = max((max(h["mqar"]) for h in heads.values() if h.get("mqar")), default=None)
    longest = max((max(h["niah"]) for h in heads.values() if h.get("niah")), default=None)
    groups = {f"MQAR, {most_pairs} pairs": {n: h["mqar"].get(most_pairs) for n, h in heads.items() if h.get("mqar")},
              f"NIAH, {longest} tokens": {n: h["niah"].get(longest) for n, h in heads.items() if h.get("niah")}}
    counts = {f"MQAR, {most_pairs} pairs": sequences, f"NIAH, {longest} tokens": trials and trials * depths}
    errors = {task: {n: figures.wilson(v, counts[task]) for n, v in values.items() if v is not None}
              for task, values in groups.items() if counts[task]}
    chance = {f"MQAR, {most_pairs} pairs": 1 / most_pairs} if most_pairs else {}
    recalls = {n: h["recall"] for n, h in heads.items() if "recall" in h}
    if recalls and min(recalls.values()) < 1:
        groups["memory-lab recall"] = recalls
        errors["memory-lab recall"] = {n: (heads[n]["recall_low"], heads[n]["recall_high"]) for n in recalls}
        chance["memory-lab recall"] = 0.25
        left = "memory-lab recall with source-bootstrap 95% CIs"
    else:
        left = ("memory-lab recall is left out: every model answers every item right (1.00), a ceiling that does not "
                "separate them")
    caption = (f"The hardest settings measured here, one 0–1 scale: MQAR at {most_pairs} pairs ({sequences} "
               f"sequences) and NIAH at {longest} tokens ({(trials or 0) * depths} trials), with Wilson 95% "
               f"intervals; {left}. NIAH's chance is about 1e-4.")
    out.append((caption, figures.grouped_bars(groups, "recall", "accuracy", errors, chance)))
    grids = {n: r["tasks"]["niah"]["grid"] for n, r in models.items() if "niah" in r["tasks"]}
    if grids:
        out.append((f"Needle in a haystack: hits out of {trials} trials in each cell of the length x depth grid, "
                    f"one colour scale for every model. With {trials} trials a cell's share is coarse; the bars "
                    f"above pool the depths.", figures.niah_grids(grids, trials)))
    out.append(("Perplexity on held-out text (lower is better; the axis starts at 0).",
                figures.bars({n: h.get("ppl") for n, h in heads.items()}, "test perplexity", "perplexity")))
    return out


def s_vs_r_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe's S-vs-R rows as one line per layer and memory: donor-margin shift and share of the layer's S+R
    swap. A share is shown only where the layer's S+R swap moves the margin (its CI excludes 0): a ratio over a
    shift of zero is noise."""
    from linmem.zoo.cards import fmt

    both = {r["layer"]: r for r in rows if r["metric"] == "donor_margin_shift" and r["memory"] == "S+R"}
    table: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        line = table.setdefault((r["layer"], r["memory"]), {"layer": r["layer"], "memory swapped": r["memory"]})
        if r["metric"] == "donor_margin_shift":
            line["donor-margin shift"] = f"{fmt(r['mean'])} [{fmt(r['low'])}, {fmt(r['high'])}]"
            continue
        whole = both.get(r["layer"])
        moved = whole is not None and (whole["low"] > 0 or whole["high"] < 0)
        line["share of the layer's S+R swap"] = (f"{fmt(r['mean'])} [{fmt(r['low'])}, {fmt(r['high'])}]" if moved
                                                 else "– (the S+R swap does not move the margin)")
    return list(table.values())


def _body(page: str) -> str:
    """The inside of an HTML page's ``<body>`` (the whole page if it has none)."""
    found = re.search(r"<body[^>]*>(.*)</body>", page, flags=re.DOTALL)
    return found.group(1) if found else page


def memory_lab_html(probe: dict[str, Any]) -> str:
    """The demo's paragraph on the probe: which model, why, what it chose and whether it held on held-out text."""
    from linmem.memory.report import spelled

    header = probe["header"]
    chosen = header.get("chosen")
    found = "The clean-recall gate stopped the attributing experiments: no component was chosen."
    if chosen:
        confirmed = header.get("confirmed_on_held_out")
        verdict = "" if confirmed is None else (
            f" On the held-out passages its state swap {'beats' if confirmed else 'does not beat'} the equal-norm "
            f"random swap.")
        found = (f"The head scan on the development passages chose <b>{html.escape(chosen)}</b> ({spelled(chosen)})."
                 f"{verdict}")
    return (f"<p class='caption'>The memory lab's default protocol (<code>linmem probe</code>) on "
            f"<b>{html.escape(probe['model'])}</b>, {probe['seconds']:.0f} s: key-value facts in held-out text, "
            f"causal edits of the recurrent state (its clean recall above: {_recall_text(probe.get('recall'))}; the "
            f"demo probes the first residual model with at least {PROBE_RECALL_BAR:g}, else the model that recalls "
            f"best). {found}</p>")


def report_html(summary: dict[str, Any], out: Path) -> str:
    """The self-contained report page."""
    from linmem.memory.report import figure_png, table_html
    from linmem.zoo import figures

    e = summary["settings"]["eval"]
    images = []
    for caption, figure in summary_figures(summary["models"]):
        images.append(f"<figure><img src=\"data:image/png;base64,{figure_png(figure)}\"><figcaption>"
                      f"{html.escape(caption)}</figcaption></figure>")
        figures.close(figure)
    probe, m = summary["probe"], summary["machine"]
    probe_page = (out / "probe" / "report.html").read_text(encoding="utf-8")
    settings = (f"Measured here, on the test split of each model's shipped held-out text: perplexity on "
                f"{e['max_tokens']:,} tokens; MQAR with {e['mqar_samples']} sequences per size (each pair queried "
                f"once); {e['recall_items']} memory-lab items ({e['recall_filler']} filler tokens); NIAH at "
                f"{', '.join(map(str, e['niah_lengths']))} tokens x {len(e['niah_depths'])} depths, "
                f"{e['niah_samples']} trials per cell. Brackets: 95% intervals (Wilson over sequences or trials; the "
                f"lab's over source passages). These samples are smaller than the model cards' below, so the two "
                f"differ within their intervals; the cards' are the numbers to quote.")
    cards, legend = card_rows(list(summary["models"]), summary.get("zoo_dir"))
    style = ("body{font-family:sans-serif;max-width:1150px;margin:auto;padding:0 1em}table{border-collapse:collapse;"
             "font-size:12px;margin:6px 0}td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}"
             "figure{display:inline-block;max-width:48%;margin:4px;vertical-align:top}figcaption{font-size:12px}"
             ".probe{border-top:2px solid #888;margin-top:1em}")
    parts = [
        "<h1>linmem demo</h1>",
        f"<p>{len(summary['models'])} shipped models evaluated on this machine ({m['cpus']} CPUs, {m['torch_threads']} "
        f"torch threads, load average {m['load_average_1min']}), device {html.escape(summary['device'])}; total "
        f"time {summary['seconds']:.0f} s{' (--quick sizes)' if summary['quick'] else ''}. Zoo: "
        f"<code>{html.escape(summary['zoo_dir'])}</code>.</p>",
        "<h2>Recall and perplexity</h2>", f"<p class='caption'>{html.escape(settings)}</p>",
        table_html(summary_rows(summary["models"])), *images,
        "<h2>The model cards' numbers</h2>", f"<p class='caption'>{html.escape(' '.join(legend))} The README and "
        f"<code>linmem zoo list</code> quote these.</p>", table_html(cards),
        f"<h2>Memory lab: {html.escape(probe['model'])}</h2>", memory_lab_html(probe),
    ]
    if probe["s_vs_r"]:
        parts += ["<h3>Base memory S vs residual memory R</h3>",
                  "<p class='caption'>Per layer, the pre-query states of every head's base memory S, residual memory "
                  "R, or both swapped for the donor's: the donor-margin shift (logit, &gt; 0 toward the donor's value) "
                  "and its share of the layer's S+R swap, with 95% CIs over source passages.</p>",
                  table_html(s_vs_r_rows(probe["s_vs_r"]))]
    parts += ["<div class='probe'><h3>The probe's full report</h3>",
              "<p class='caption'>The report <code>linmem probe</code> wrote (probe/report.html), every experiment "
              "with its caption.</p>", _body(probe_page), "</div>"]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>linmem demo</title><style>{style}</style>"
            f"</head><body>{''.join(parts)}</body></html>")
