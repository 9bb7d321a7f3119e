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

from linmem.backend_names import add_backend_option
from linmem.io.atomic import write_bytes_atomic
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


# 4 perplexity windows, MQAR with 8 and 32 pairs (4 sequences each), 16 memory-lab items, NIAH at 256 and 512 tokens
# x 3 depths (2 trials per cell); the probe on 6 development and 4 held-out passages of 128 filler tokens, without
# the load / gap sweeps and the extras (``linmem probe --no-sweeps --no-extras``: the sweeps alone take minutes).
DEMO = DemoSettings(
    dict(split="test", batch_size=8, max_tokens=2048, mqar_pairs=(8, 32), mqar_samples=4, niah_lengths=(256, 512),
         niah_depths=(0.0, 0.5, 1.0), niah_samples=2, recall_items=16, recall_filler=128),
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
    return [Document(source, sid, tokenizer.decode(ids.tolist())) for source, sid, ids in split.documents()]


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


def summary_rows(models: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model with the demo's headline numbers, then what guessing scores."""
    from linmem.eval.descriptions import describe_perplexity
    from linmem.zoo.cards import fmt, recall_cell

    heads = {name: headline(r["tasks"]) for name, r in models.items()}
    pairs = sorted({p for h in heads.values() for p in h.get("mqar", {})})
    rows = []
    for name, r in models.items():
        h = heads[name]
        rows.append({"model": name, "mixer": r["mixer"],
                     "params": f"{r['parameters'] / 1e6:.2f}M",
                     "test ppl": describe_perplexity(r["tasks"]["ppl"]["metrics"]) if "ppl" in h else fmt(None),
                     **{f"MQAR {p} pairs": fmt(h.get("mqar", {}).get(p)) for p in pairs},
                     "memory-lab recall [95% CI]": recall_cell(h), "NIAH": fmt(h.get("niah_mean")),
                     "seconds": fmt(r["seconds"], 1)})
    vocab = sorted({r["vocab_size"] for r in models.values()})
    rows.append({"model": "chance", "mixer": "", "params": "", "test ppl": ", ".join(f"{v:,}" for v in vocab),
                 **{f"MQAR {p} pairs": fmt(1 / p) for p in pairs}, "memory-lab recall [95% CI]": "0.250",
                 "NIAH": "1e-04", "seconds": ""})
    return rows


def summary_figures(models: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(caption, Figure)``: MQAR curves, recall on the three tasks, the NIAH grids and perplexity per model."""
    from linmem.zoo import figures

    heads = {name: headline(r["tasks"]) for name, r in models.items()}
    out = [("MQAR accuracy against the number of key-value pairs (dashed: chance).",
            figures.mqar_curves({n: r["tasks"]["mqar"]["table"] for n, r in models.items()}))]
    most_pairs = max((max(h["mqar"]) for h in heads.values() if h.get("mqar")), default=None)
    groups = {f"MQAR, {most_pairs} pairs": {n: h["mqar"].get(most_pairs) for n, h in heads.items() if h.get("mqar")},
              "memory-lab recall": {n: h.get("recall") for n, h in heads.items()},
              "NIAH (grid mean)": {n: h.get("niah_mean") for n, h in heads.items()}}
    errors = {"memory-lab recall": {n: (h["recall_low"], h["recall_high"]) for n, h in heads.items() if "recall" in h}}
    chance = {"memory-lab recall": 0.25, **({f"MQAR, {most_pairs} pairs": 1 / most_pairs} if most_pairs else {})}
    recalls = [v for v in groups["memory-lab recall"].values() if v is not None]
    ceiling = " Every model recalls the lab's facts at the ceiling (1.0) here." if recalls and min(recalls) == 1 else ""
    out.append(("Recall on the three tasks, one 0–1 scale (memory-lab recall with source-bootstrap 95% CIs; NIAH's "
                f"chance is about 1e-4).{ceiling}",
                figures.grouped_bars(groups, "recall", "accuracy", errors, chance)))
    grids = {n: r["tasks"]["niah"]["grid"] for n, r in models.items() if "niah" in r["tasks"]}
    if grids:
        out.append(("Needle in a haystack: accuracy over the length x depth grid, one colour scale for every model.",
                    figures.niah_grids(grids)))
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


def report_html(summary: dict[str, Any], out: Path) -> str:
    """The self-contained report page."""
    from linmem.memory.report import figure_png, table_html
    from linmem.zoo import figures

    images = []
    for caption, figure in summary_figures(summary["models"]):
        images.append(f"<figure><img src=\"data:image/png;base64,{figure_png(figure)}\"><figcaption>"
                      f"{html.escape(caption)}</figcaption></figure>")
        figures.close(figure)
    probe, m = summary["probe"], summary["machine"]
    header = probe["header"]
    probe_page = (out / "probe" / "report.html").read_text(encoding="utf-8")
    e = summary["settings"]["eval"]
    settings = (f"perplexity on {e['max_tokens']:,} held-out tokens; MQAR with {e['mqar_samples']} sequences per "
                f"size; {e['recall_items']} memory-lab items ({e['recall_filler']} filler tokens); NIAH at "
                f"{', '.join(map(str, e['niah_lengths']))} tokens x {len(e['niah_depths'])} depths, "
                f"{e['niah_samples']} trials per cell. The model cards (eval.json) hold the full evaluation.")
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
        "<h2>Recall and perplexity</h2>", f"<p>{html.escape(settings)}</p>",
        table_html(summary_rows(summary["models"])), *images,
        f"<h2>Memory lab: {html.escape(probe['model'])}</h2>",
        f"<p>The memory lab's default protocol (<code>linmem probe</code>) on <b>{html.escape(probe['model'])}</b>, "
        f"{probe['seconds']:.0f} s: key-value facts in held-out text, causal edits of the recurrent state "
        f"(its clean recall above: {_recall_text(probe.get('recall'))}; the demo probes the first residual model "
        f"with at least {PROBE_RECALL_BAR:g}, else the model that recalls best). Chosen "
        f"component (head scan on development passages): <b>{html.escape(str(header.get('chosen')))}</b>; its "
        f"state swap beats the equal-norm random swap on held-out passages: "
        f"<b>{header.get('confirmed_on_held_out')}</b>.</p>",
    ]
    if probe["s_vs_r"]:
        parts += ["<h3>Base memory S vs residual memory R</h3>",
                  "<p>Per layer, the pre-query states of every head's base memory S, residual memory R, or both "
                  "swapped for the donor's: the donor-margin shift (logit, &gt; 0 toward the donor's value) and its "
                  "share of the layer's S+R swap, with 95% CIs over source passages.</p>",
                  table_html(s_vs_r_rows(probe["s_vs_r"]))]
    parts += ["<div class='probe'><h3>The probe's full report</h3>", _body(probe_page), "</div>"]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>linmem demo</title><style>{style}</style>"
            f"</head><body>{''.join(parts)}</body></html>")
