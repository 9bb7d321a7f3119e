"""The memory lab at the paper's scale: the state-swap head scan over every recurrent head, the default ``linmem
probe`` protocol and peak GPU memory, on random-weight models of the shapes "How Linear Attention Remembers" used,
against the naive way (the whole prompt re-run for each head).

    python -m linmem.bench.lab_scale --device cuda --out docs/benchmarks/memory-h200      # every model
    python -m linmem.bench.lab_scale --quick --out /tmp/lab-quick                         # tiny shapes, CPU, < 60 s

Models (``MODELS``; bf16 weights, float32 recurrent caches as the paper runs them):

- ``gdn-1.3b``: FLA's GDN-1.3B (``fla_parity.PAPER``: 24 GDN layers, 8 heads of 256 x 256, D = 2048, 1.466B
  parameters), built as the ``LinMemConfig`` that ``load_fla_checkpoint`` makes of that FLA config (192 heads);
- ``qwen3.5-4b``: a Qwen3.5-4B-shaped text model (D = 2560, 32 layers: 24 GDN with 16 key / 32 value heads of
  128 x 128, and full attention in every fourth layer, 16 query / 4 kv heads of 256, MLP 9216, vocabulary 248,320,
  tied embeddings: 4.21B parameters; 768 heads), from transformers' ``Qwen3_5TextConfig`` through
  ``linmem.models.hf_import.hf_config_to_linmem`` (skipped, with the reason, where that converter is missing);
- ``qwen3.5-9b``: a Qwen3.5-9B-shaped text model the same way (D = 4096, 32 layers: 24 GDN with 16 key / 32 value
  heads of 128 x 128, full attention in every fourth layer, 16 query / 4 kv heads of 256, MLP 12288, vocabulary
  248,320, separate input and output embeddings: 8.95B parameters; 768 heads).

Per model: (a) ``experiments.head_scan`` on ``--items`` items (one ``StateSwap`` per head, suffix-only re-runs from
one shared prefix cache; heads per batched run chosen from the free GPU memory by ``linmem.memory.batching``, or
``--chunk``; the output says which and the peak memory); (d) the naive scan: for each head, the recipient's
whole prompt again (prefix into a fresh cache, the head's state swapped for the donor's, suffix), timed on
``--naive-heads`` heads spread over the layers and extrapolated to every head (the output says so), its per-head
effects checked against (a)'s; (b) ``linmem probe``'s default protocol on the same model, once with the default
clean-recall gate (random weights do not recall, and the report must say so) and once with the gate off, timed,
inside what is left of ``--budget``; (c) peak GPU memory of each stage. Random weights: these are timings, not
findings. Writes ``lab_scale.json`` and ``lab_scale.md`` to ``--out`` (and each probe's report below it).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import linmem.memory as mm
from linmem.bench import environment
from linmem.io.atomic import write_bytes_atomic
from linmem.memory import batching
from linmem.memory import experiments as ex
from linmem.memory.commands import positive
from linmem.memory.evaluate import Batch, make_batch
from linmem.memory.intervene import apply_cache_edit
from linmem.memory.metrics import choice_logits, donor_margin
from linmem.memory.probe import ProbeOptions, pick_spec, run_protocol
from linmem.memory.recording import backbone, unembed
from linmem.memory.stats import source_means
from linmem.memory.tasks import TaskSpec, build_items, passages
from linmem.models import LinMemCache, LinMemConfig, LinMemForCausalLM


@dataclass(frozen=True)
class Sizes:
    """What one run measures on: items (prompt pairs) of ``filler`` tokens, the probe's source counts and sizes."""

    items: int = 32
    filler: int = 512
    probe: ProbeOptions = field(default_factory=ProbeOptions)
    tokenizer_vocab: int = 4096


FULL = Sizes()
QUICK = Sizes(items=4, filler=32, probe=ProbeOptions(  # a smoke test: no sweeps, no extras
    dev_sources=2, confirm_sources=2, filler_tokens=32, num_bindings=2, repeats=2, sweeps=False, extras=False))


def gdn_config(quick: bool) -> LinMemConfig:
    """GDN-1.3B as ``load_fla_checkpoint`` maps FLA's config (or a 2-layer copy of its head layout)."""
    from fla.models import GatedDeltaNetConfig

    from linmem.bench.fla_parity import PAPER, scaled_paper_settings
    from linmem.models.fla_import import fla_config_to_linmem

    settings = (scaled_paper_settings("GDN-1.3B", hidden=64, layers=2, vocab=QUICK.tokenizer_vocab)[1] if quick
                else PAPER["GDN-1.3B"][1])
    return fla_config_to_linmem(GatedDeltaNetConfig(**settings).to_dict())


# The text models of Qwen3.5-4B and -9B as their model cards give them (layers, hidden size, the Gated DeltaNet's
# 16 query-key / 32 value heads of 128, the gated attention's 16 query / 4 kv heads of 256 in every fourth layer,
# MLP, padded vocabulary), as Qwen3_5TextConfig fields. The 4B ties its embeddings; the 9B does not: its reported
# 8.95B text parameters are this shape with separate input and output embeddings (7.94B if they were tied).
QWEN_SHAPES = {
    "4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, tie_word_embeddings=True),
    "9b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, tie_word_embeddings=False),
}
QWEN_HEADS = dict(vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, num_attention_heads=16, num_key_value_heads=4, head_dim=256)
QWEN_QUICK = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, vocab_size=QUICK.tokenizer_vocab,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def qwen_config(quick: bool, size: str = "4b") -> LinMemConfig:
    """A Qwen3.5 text model of ``QWEN_SHAPES[size]`` through ``hf_config_to_linmem`` (or a 4-layer copy of its
    layout, with its embedding tying); full attention in every fourth layer, as the config's default."""
    from transformers import Qwen3_5TextConfig

    from linmem.models.hf_import import hf_config_to_linmem

    shape = QWEN_SHAPES[size]
    fields = {**QWEN_QUICK, "tie_word_embeddings": shape["tie_word_embeddings"]} if quick else {**QWEN_HEADS, **shape}
    return hf_config_to_linmem(Qwen3_5TextConfig(**fields))


def qwen9b_config(quick: bool) -> LinMemConfig:
    """``qwen_config`` of the Qwen3.5-9B shape."""
    return qwen_config(quick, "9b")


MODELS = {"gdn-1.3b": gdn_config, "qwen3.5-4b": qwen_config, "qwen3.5-9b": qwen9b_config}


def build_model(config: LinMemConfig, device: str, dtype: torch.dtype, seed: int = 0) -> LinMemForCausalLM:
    """A random model of ``config`` on ``device`` in ``dtype`` (initialised there: no host copy of the weights).
    Projections are drawn N(0, 1/fan_in) instead of the 0.02 init, so that a head's state moves the logits and
    the two scans compare effects, not rounding."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LinMemForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model.to(dtype).eval()


def task_batch(tokenizer, documents, sizes: Sizes) -> Batch:
    """``sizes.items`` prompt pairs of ``sizes.filler`` filler tokens (4 bindings, 3 presentations)."""
    spec = TaskSpec(num_bindings=4, repeats=3, filler_tokens=sizes.filler)
    builder = pick_spec(tokenizer, spec)
    found = passages(documents, tokenizer, sizes.filler + 16)[: sizes.items]
    if len(found) < sizes.items:
        raise ValueError(f"need {sizes.items} passages of {sizes.filler + 16}+ tokens; the sources hold "
                         f"{len(found)}: lower --items or --filler")
    return make_batch(build_items(builder, found, seed=0))


@torch.no_grad()
def naive_scan(model, batch: Batch, components) -> torch.Tensor:
    """The naive head scan: per component, the recipient's whole prompt again (prefix into a fresh cache, the
    component's state swapped for the donor's, suffix); the donor's prefix cache and the clean run once. Returns the
    mean donor-margin shift per component ``[C]`` (float64), as ``experiments.head_scan`` reports it."""
    at, device = batch.boundary, next(model.parameters()).device
    recipient, donor_ids = batch.recipient.to(device), batch.donor.to(device)
    donor = LinMemCache.from_config(model.config)
    backbone(model)(input_ids=donor_ids[:, :at], cache=donor, use_cache=True)
    answer, donor_answer = batch.answer, batch.donor_answer

    def margin(hidden: torch.Tensor) -> torch.Tensor:
        choice = choice_logits(unembed(model, hidden[:, -1]), batch.candidates).cpu()
        return donor_margin(choice, answer, donor_answer)

    clean = margin(backbone(model)(input_ids=recipient, use_cache=False).last_hidden_state)
    shifts = []
    for c in tqdm(components, desc="naive re-runs", unit="head", leave=False):
        cache = LinMemCache.from_config(model.config)
        backbone(model)(input_ids=recipient[:, :at], cache=cache, use_cache=True)
        apply_cache_edit(model, cache, donor, mm.StateSwap([c], at), slice(None))
        hidden = backbone(model)(input_ids=recipient[:, at:], cache=cache, use_cache=True).last_hidden_state
        shifts.append(float(np.mean(source_means((margin(hidden) - clean).numpy(), batch.sources)[0])))
    return torch.tensor(shifts, dtype=torch.float64)  # the mean of source means, as stats.bootstrap's point estimate


def spread(components: list, count: int) -> list:
    """``count`` components evenly spread over the list (every layer's share), first and last included."""
    if count >= len(components):
        return list(components)
    return [components[i] for i in np.linspace(0, len(components) - 1, count).round().astype(int)]


class Clock:
    """Wall seconds and peak device memory of one stage (CUDA synchronised at both ends; the peak spans the resets
    that ``batching`` makes to measure its batches)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.device = device

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            batching.reset_peak(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.start
        self.peak_gib = batching.peak_allocated(self.device) / 2**30 if self.cuda else None
        return False


def log(message: str) -> None:
    print(message, flush=True)


def bench_model(name: str, args, sizes: Sizes, tokenizer, documents, deadline: float, out: Path) -> dict:
    """Every stage on one model; returns its row of the results."""
    row: dict = {"model": name}
    try:
        config = MODELS[name](args.quick)
    except (ImportError, AttributeError, ValueError) as error:
        log(f"{name}: skipped, its config cannot be built here: {type(error).__name__}: {error}")
        return {**row, "skipped": f"{type(error).__name__}: {error}"}
    dtype = getattr(torch, args.dtype)
    with Clock(args.device) as clock:
        model = build_model(config, args.device, dtype)
    components = mm.heads(model)
    row.update(parameters=sum(p.numel() for p in model.parameters()), heads=len(components),
               layers=config.num_hidden_layers, attention_layers=list(config.attention.layers), dtype=args.dtype,
               build_s=round(clock.seconds, 1))
    log(f"{name}: {row['parameters'] / 1e9:.3f}B parameters, {len(components)} recurrent heads, built in "
        f"{clock.seconds:.1f} s")
    batch = task_batch(tokenizer, documents, sizes)
    row.update(items=batch.recipient.shape[0], prompt_tokens=batch.length, suffix_tokens=batch.length - batch.boundary)
    ex.head_scan(model, batch.items[:2], components[:2], chunk=2)  # warm-up: kernel compilation, allocator
    naive_scan(model, batch.subset([0]), components[:1])
    with Clock(args.device) as clock:
        scan = ex.head_scan(model, batch.items, components, chunk=args.chunk)
    fast = {r["component"]: r["mean"] for r in scan.rows}
    row.update(head_scan_s=round(clock.seconds, 2), head_scan_peak_gib=clock.peak_gib,
               head_scan_batch=scan.summary["batch_choice"], clean_accuracy=scan.summary["clean_accuracy"]["mean"])
    log(f"{name}: (a) head scan over {len(components)} heads x {row['items']} items of {batch.length} tokens: "
        f"{clock.seconds:.1f} s" + (f", peak {clock.peak_gib:.1f} GiB" if clock.peak_gib else "")
        + f"; {row['head_scan_batch']}")
    timed = spread(components, args.naive_heads)
    with Clock(args.device) as clock:
        slow = naive_scan(model, batch, timed)
    per_head = clock.seconds / len(timed)
    naive_total = per_head * len(components)
    difference = max(abs(fast[str(c)] - s) for c, s in zip(timed, slow.tolist()))
    scale = max(max(abs(v) for v in fast.values()), 1e-30)
    row.update(naive_heads_timed=len(timed), naive_timed_s=round(clock.seconds, 2), naive_peak_gib=clock.peak_gib,
               naive_s=round(naive_total, 1), naive_extrapolated=len(timed) < len(components),
               speedup=round(naive_total / row["head_scan_s"], 1), max_effect_difference=difference,
               relative_effect_difference=difference / scale)
    log(f"{name}: (d) naive re-runs: {clock.seconds:.1f} s for {len(timed)} heads = {per_head:.2f} s a head; "
        f"{'extrapolated to' if row['naive_extrapolated'] else 'all'} {len(components)} heads: {naive_total:.1f} s; "
        f"speedup {row['speedup']}x; per-head effects differ by at most {difference:.2e} ({difference / scale:.1e} of "
        f"the largest)")
    row["probe"] = run_probes(model, tokenizer, documents, sizes, args, components, per_head, batch, deadline,
                              out / f"probe-{name}")
    del model, scan
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def run_probes(model, tokenizer, documents, sizes: Sizes, args, components, naive_per_head: float, batch: Batch,
               deadline: float, out: Path) -> dict:
    """(b): the default protocol with the default clean-recall gate; where the gate stops it (random weights), again
    with the gate off, timed. Both within what is left before ``deadline``: an experiment that would not fit is not
    started (the write/read scan, a donor write per head and item over whole prompts, is estimated from the naive
    per-head time)."""
    if args.probe == "skip":
        return {"skipped": "--probe skip"}
    confirm_rows = sizes.probe.confirm_sources / max(batch.recipient.shape[0], 1)
    estimates = {"write_read_spearman": naive_per_head * len(components) * confirm_rows}
    result: dict = {}
    for run, gate in (("gated", sizes.probe.min_clean_recall), ("ungated", 0.0)):
        left = max(deadline - time.monotonic(), 0.0)
        options = replace(sizes.probe, min_clean_recall=gate, time_limit_s=left, cost_estimates=estimates,
                          chunk=args.chunk)
        with Clock(args.device) as clock:
            summary = run_protocol(model, tokenizer, documents, options, out / run, header={"model": "random"})
        payload = json.loads((out / run / "results.json").read_text())
        header = payload["header"]
        result[run] = {"seconds": round(clock.seconds, 1), "peak_gib": clock.peak_gib, "min_clean_recall": gate,
                       "clean_recall": header["clean_recall"], "warning": payload["warning"],
                       "experiments": sorted(summary), "time_limit_s": round(left, 1),
                       "experiment_seconds": header["seconds"], "not_started": header["not_started_time_limit"],
                       "batch_choice": header["batch_choice"],
                       "estimated_s": {k: round(v, 1) for k, v in estimates.items()}}
        log(f"  (b) probe, {'gate ' + format(gate, 'g') if gate else 'gate off (timing only)'}: {clock.seconds:.1f} s"
            + (f", peak {clock.peak_gib:.1f} GiB" if clock.peak_gib else "")
            + f"; clean recall {header['clean_recall']}"
            + (f"; not started within the {left:.0f} s left: {header['not_started_time_limit']}"
               if header["not_started_time_limit"] else "")
            + f"; seconds per experiment {header['seconds']}"
            + (f"; head scan: {header['batch_choice']['head_scan']}" if "head_scan" in header["batch_choice"]
               else ""))
        if payload["warning"]:
            log(f"  the report says: {payload['warning']}")
        if header["clean_recall_passed"] or args.probe == "gated":
            break  # a passed gate ran the whole protocol already
    return result


def markdown(results: dict) -> str:
    """The results as a markdown table with the run's versions."""
    env = results["environment"]
    lines = [f"- device: {env['gpu'] or 'CPU'} ({env['device']}); torch {env['torch']}, triton {env['triton']}, "
             f"flash-linear-attention {env['fla']}, CUDA {env['cuda']}, Python {env['python']}",
             f"- {results['sizes']['items']} items of {results['sizes']['filler']} filler tokens; weights "
             f"{results['dtype']}, recurrent caches float32; random weights (timings, not findings)",
             f"- command: `{results['command']}`", "",
             "| model | params | heads | prompt / suffix tokens | head scan (a) | peak | naive re-runs (d) | speedup "
             "| max Δ effect | probe, default gate (b) | probe, whole protocol (b) | probe peak |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["models"]:
        if "skipped" in row:
            lines.append(f"| {row['model']} | skipped: {row['skipped']} | | | | | | | | | | |")
            continue
        probe = row.get("probe", {})
        gated, ungated = probe.get("gated", {}), probe.get("ungated", probe.get("gated", {}))
        gib = lambda v: "–" if v is None else f"{v:.1f} GiB"  # noqa: E731
        naive = (f"{row['naive_s']} s (timed {row['naive_heads_timed']} heads, extrapolated)"
                 if row["naive_extrapolated"] else f"{row['naive_s']} s")
        off = (f"{ungated['seconds']} s" + (f" (not started: {', '.join(ungated['not_started'])})"
                                            if ungated.get("not_started") else "")) if ungated else "–"
        lines.append(f"| {row['model']} | {row['parameters'] / 1e9:.3f}B | {row['heads']} | {row['prompt_tokens']} / "
                     f"{row['suffix_tokens']} | {row['head_scan_s']} s | {gib(row['head_scan_peak_gib'])} | {naive} | "
                     f"{row['speedup']}x | {row['max_effect_difference']:.1e} | "
                     f"{gated.get('seconds', '–')} s | {off} | {gib(ungated.get('peak_gib'))} |")
    lines.append("")
    lines += [f"- {row['model']}: head scan (a) ran {row['head_scan_batch']}" for row in results["models"]
              if row.get("head_scan_batch")]
    for row in results["models"]:
        gated = row.get("probe", {}).get("gated")
        if gated:
            lines += ["", f"{row['model']}: clean recall {gated['clean_recall']}; the gated probe's report says: "
                          f"\"{gated['warning'] or 'recall passed the gate'}\""]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    """``lab_scale.json`` and ``lab_scale.md`` in ``out``, each written whole or not at all."""
    write_bytes_atomic(out / "lab_scale.json", json.dumps(results, indent=1, default=str).encode("utf-8"))
    write_bytes_atomic(out / "lab_scale.md", markdown(results).encode("utf-8"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float64"),
                        help="weights (default bfloat16; float32 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny copies of the shapes, small task: CPU, < 60 s")
    parser.add_argument("--items", type=int, default=None, help="prompt pairs of the scans (default 32; 4 quick)")
    parser.add_argument("--filler", type=int, default=None, help="filler tokens per prompt (default 512; 32 quick)")
    parser.add_argument("--chunk", type=positive, default=None,
                        help="heads (edit sets) per batched run of the fast scan and the probe (default: as many "
                             "as the free GPU memory holds, measured on a first batch; 16 on a CPU); halved on an "
                             "out-of-memory error either way")
    parser.add_argument("--naive-heads", type=int, default=None,
                        help="heads the naive scan is timed on, spread over the layers (default 8; 4 with --quick)")
    parser.add_argument("--probe", default="full", choices=("full", "gated", "skip"),
                        help="full: the default protocol gated, then with the gate off (timed); gated: only the first")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for the whole run; the gate-off probes share what the scans leave, and "
                             "experiments that would not fit are left out (and named)")
    parser.add_argument("--sources", nargs="+", default=None, help="filler text (default: linmem probe's)")
    parser.add_argument("--out", type=Path, required=True, help="folder for lab_scale.json, lab_scale.md, probes")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    args.naive_heads = args.naive_heads or (4 if args.quick else 8)
    base = QUICK if args.quick else FULL
    sizes = replace(base, items=args.items or base.items, filler=args.filler or base.filler)
    start = time.monotonic()
    deadline = start + args.budget
    from linmem.data.tokenizer import train_tokenizer, wrap_tokenizer
    from linmem.memory.commands import documents as probe_documents

    docs = list(itertools.islice(probe_documents(args.sources), 400))
    tokenizer = wrap_tokenizer(train_tokenizer((d.text for d in docs), vocab_size=sizes.tokenizer_vocab))
    log(f"tokenizer: {len(tokenizer)} tokens from {len(docs)} documents "
        f"({time.monotonic() - start:.1f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(args.device), "dtype": args.dtype, "quick": args.quick,
               "sizes": {"items": sizes.items, "filler": sizes.filler, "probe": asdict(sizes.probe)},
               "budget_s": args.budget,
               "command": "python -m linmem.bench.lab_scale " + " ".join(sys.argv[1:] if argv is None else argv),
               "models": []}
    for i, name in enumerate(args.models):  # each model may use an equal share of the time left
        share = time.monotonic() + (deadline - time.monotonic()) / (len(args.models) - i)
        results["models"].append(bench_model(name, args, sizes, tokenizer, docs, share, args.out))
        write_results(args.out, results)
    results["total_s"] = round(time.monotonic() - start, 1)
    write_results(args.out, results)
    log(markdown(results))
    log(f"total {results['total_s']} s; wrote {args.out / 'lab_scale.json'} and {args.out / 'lab_scale.md'}")
    return results


if __name__ == "__main__":
    main()
