"""End-to-end training throughput, in two modes.

**Mixers** (default): RDN and RLA language models against the same model with GDN and sGLA mixers, measured one
after another in one run (issue 3), optionally with and without gradient checkpointing (issue 18).

    python -m linmem.bench.training --out docs/benchmarks          # ~125M models, B=8 x T=2048, bf16, on CUDA
    python -m linmem.bench.training --mixers rdn,gdn --backends triton --steps 20 --budget 120
    python -m linmem.bench.training --mixers rdn,gdn --backends triton --batch 2 --seq-len 8192 --checkpointing both
    python -m linmem.bench.training --hidden 64 --layers 2 --heads 2 --head-dim 32 --vocab 256 \\
        --batch 1 --seq-len 64 --steps 2 --warmup 1 --backends chunk --threads 1   # CPU dry run, seconds

Every (backend, mixer, checkpointing) triple, backends outer, mixers inner in the order given, builds a
``LinMemForCausalLM`` of the same shape (default: D = 768, 12 layers, H = 6 heads of K = V = 128, SwiGLU MLP
3·D = 2304, vocabulary 32000, tied embeddings: 123.9M to 124.0M parameters; the exact count of each model is printed),
seeds it alike, and runs full training steps on one fixed batch of random token ids ``[B, T]``: forward with labels
(mean next-token cross entropy), backward, gradient clipping at 1.0 and AdamW, under bfloat16 autocast on CUDA
(float32 on the CPU). ``--warmup`` steps (Triton compilation, allocator) come first; then ``--steps`` steps are timed
one by one between ``torch.cuda.synchronize()`` calls. Reported per model: the median step time (ms), tokens/s =
B·T / median step time, the step-time ratio to the base mixer on the same backend and checkpointing setting (RDN /
GDN, RLA / sGLA: 1.30 means 30% slower), the peak allocated GPU memory (GiB, the peak counter reset before each
model) and the final loss, which must be finite: a non-finite loss is printed and, once everything is written, the
run exits with an error. ``--checkpointing on`` checkpoints every block (``model.gradient_checkpointing_enable()``),
``both`` measures each model without and with it and reports the memory saving (peak without / peak with) and the
throughput kept (tokens/s with / without).

**Paper** (``--paper rdn,gdn``, issue 21): the RLA paper's 1.5B presets (``configs/paper/NAME-1.5b.yaml``, with
``--set`` overrides) as the trainer runs them on one GPU: FSDP2 (``fully_shard`` per block, then on the model) over
a one-process group (NCCL on CUDA, gloo on the CPU), gradient checkpointing per block, bfloat16 autocast (or, with
``--param-dtype bfloat16``, FSDP2's bfloat16 parameters with float32 gradient reduction), the preset's AdamW, for
each context length of ``--seq-lens`` with ``--tokens-per-step`` tokens per step (B = tokens / T sequences) of
random ids. Reported per (model, T): tokens/s, peak allocated and reserved GPU memory and MFU, the model FLOPs
per token (``linmem.bench.flops``: 6·N for the weights plus the memory / attention term) times tokens/s over the
peak ``--peak-tflops`` (default 989: the H100 / H200 SXM dense bfloat16 peak).

    python -m linmem.bench.training --paper rdn,gdn --seq-lens 2048,8192 --backends triton --out runs/paper-bench
    python -m linmem.bench.training --paper rdn --seq-lens 2048 --backends triton --compile --checkpointing off

``--compile`` (or ``--compile MODE``) runs each block's norms, mixer and MLP through ``torch.compile``
(``linmem.train.compile``; the op itself stays a graph break), in both modes; the warm-up steps include the compilation,
so give at least one.

``--profile STEPS`` profiles STEPS more steps of each row after its timed ones and reports where a step's time goes
(``linmem.bench.step_profile``): the kernels by their own time and the shares of matmul, linmem's recurrence
kernels, attention, the optimizer, communication and the rest, the first place to look when MFU is low.

A measurement that raises (Triton not usable here, out of memory, ...) is skipped with the reason printed; the rest
run. ``--budget`` (seconds, default 240) bounds the run: a measurement is not started when the longest one so far
(on the same backend, else on any) would end past the budget, and a measurement that crosses it stops after its
current timed step. Skipped ones are listed with the reason. With ``--out DIR`` the results are (re)written after
every measurement to ``DIR/training.json`` (paper mode: ``DIR/paper-training.json``; GPU, torch and triton
versions, all settings, every row) and the matching ``.md`` (the table, the settings line and the command), so a run
killed from outside keeps what it had.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from linmem.bench import environment
from linmem.bench.flops import H200_BF16_DENSE_TFLOPS, flops_per_token, mfu
from linmem.bench.step_profile import format_profile, profile_steps, synchronize
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.configuration import MIXERS
from linmem.ops import BACKENDS
from linmem.train.compile import COMPILE_MODES, compile_blocks
from linmem.train.config import LOSS_CHUNK_TOKENS, TrainConfig, load_config
from linmem.train.distributed import enable_gradient_checkpointing, fully_shard_model, start_local_group
from linmem.train.params import model_config_of
from linmem.train.trainer import build_optimizer, count_parameters

NAMES = {"sgla": "sGLA", "gla": "GLA", "gdn": "GDN", "rla": "RLA", "rdn": "RDN", "transformer": "Transformer"}
BASE_OF = {"rdn": "gdn", "rla": "sgla"}
GIB = 2**30
PAPER_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "paper"
PAPER_MODELS = ("sgla", "gla", "gdn", "rla", "rdn", "transformer")
CHECKPOINTING = {"off": (False,), "on": (True,), "both": (False, True)}


class NonFiniteLoss(RuntimeError):
    """A model's final training loss is NaN or infinite."""


def model_config(args: argparse.Namespace, mixer: str, backend: str) -> LinMemConfig:
    return LinMemConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_heads=args.heads, head_dim=args.head_dim, expand_v=args.expand_v,
                        intermediate_size=args.intermediate_size, tie_word_embeddings=True, mixer=mixer,
                        backend=backend, use_cache=False)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               autocast, loss_chunk_tokens: int = 0) -> torch.Tensor:
    """One update on ``tokens [B, T]`` (inputs and labels); returns the loss (a detached scalar).
    ``loss_chunk_tokens``: the head and loss over that many tokens at a time (0: the whole logits at once)."""
    optimizer.zero_grad(set_to_none=True)
    with autocast:
        loss = model(input_ids=tokens, labels=tokens, use_cache=False, loss_chunk_tokens=loss_chunk_tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


def free_memory(device: torch.device) -> None:
    """Release what the last model and optimizer held (called once nothing refers to them)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(step: Callable[[], torch.Tensor], warmup: int, steps: int, device: torch.device,
               deadline: float) -> tuple[list[float], float]:
    """Run ``warmup`` untimed steps, then time up to ``steps`` steps one by one (fewer once ``deadline``, a
    ``time.perf_counter()`` value, has passed); returns the step times (s) and the last loss."""
    for _ in range(warmup):
        step()
    times, loss = [], None
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss = step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return times, float(loss)


def random_tokens(seed: int, batch: int, seq_len: int, vocab: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)


def peak_memory(device: torch.device) -> dict[str, float | None]:
    cuda = device.type == "cuda"
    return dict(peak_gib=torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
                reserved_gib=torch.cuda.max_memory_reserved(device) / GIB if cuda else None)


def measure(args: argparse.Namespace, mixer: str, backend: str, device: torch.device, deadline: float,
            checkpointing: bool = False) -> dict:
    """Build one model and time its training steps on a fixed random batch ``[args.batch, args.seq_len]``.

    Returns a row: ``params``, ``step_ms`` (median), ``steps_ms`` (every timed step), ``tokens_per_s``,
    ``peak_gib`` (None on the CPU), ``final_loss``, ``timed_steps`` (fewer than ``args.steps`` when ``deadline``,
    a ``time.perf_counter()`` value, passed during the timed steps) and ``seconds`` (the whole measurement).
    """
    start = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    model = LinMemForCausalLM(model_config(args, mixer, backend)).to(device)
    if checkpointing:
        enable_gradient_checkpointing(model)
    if args.compile:
        compile_blocks(model, args.compile)
    params = count_parameters(model)
    print(f"{NAMES[mixer]}/{backend}{' checkpointed' if checkpointing else ''}: {params:,} parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    tokens = random_tokens(args.seed, args.batch, args.seq_len, args.vocab, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    times, final_loss = time_steps(lambda: train_step(model, optimizer, tokens, autocast, args.loss_chunk),
                                   args.warmup, args.steps, device, deadline)
    step_s = statistics.median(times)
    return dict(mixer=mixer, backend=backend, checkpointing=checkpointing, params=params, step_ms=step_s * 1e3,
                steps_ms=[t * 1e3 for t in times], tokens_per_s=args.batch * args.seq_len / step_s,
                **peak_memory(device), final_loss=final_loss, finite=math.isfinite(final_loss),
                timed_steps=len(times), seconds=time.perf_counter() - start)


def add_ratios(rows: list[dict]) -> None:
    """``vs_base``: a residual mixer's median step time over its base mixer's on the same backend and checkpointing
    setting (when measured)."""
    by_key = {(r["mixer"], r["backend"], r.get("checkpointing", False)): r for r in rows}
    for r in rows:
        base = by_key.get((BASE_OF.get(r["mixer"]), r["backend"], r.get("checkpointing", False)))
        r["base"] = base["mixer"] if base else None
        r["vs_base"] = r["step_ms"] / base["step_ms"] if base else None


def checkpointing_savings(rows: list[dict]) -> list[dict]:
    """Per (mixer, backend) measured both ways: ``memory_saving`` = peak memory without / with checkpointing (None
    off CUDA), ``throughput_kept`` = tokens/s with / without."""
    by_key = {(r["mixer"], r["backend"], r["checkpointing"]): r for r in rows}
    out = []
    for (mixer, backend, on), row in by_key.items():
        plain = by_key.get((mixer, backend, False))
        if not on or plain is None:
            continue
        saving = plain["peak_gib"] / row["peak_gib"] if row["peak_gib"] and plain["peak_gib"] else None
        out.append(dict(mixer=mixer, backend=backend, peak_gib_without=plain["peak_gib"], peak_gib_with=row["peak_gib"],
                        memory_saving=saving, tokens_per_s_without=plain["tokens_per_s"],
                        tokens_per_s_with=row["tokens_per_s"],
                        throughput_kept=row["tokens_per_s"] / plain["tokens_per_s"]))
    return out


def _gib(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "—"


def format_table(rows: list[dict]) -> str:
    lines = ["| mixer | backend | checkpointing | params | ms/step | tokens/s | step time vs base | peak GiB | "
             "final loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['vs_base']:.2f}x {NAMES[r['base']]}" if r.get("vs_base") is not None else "—"
        lines.append(f"| {NAMES[r['mixer']]} | {r['backend']} | {'yes' if r.get('checkpointing') else 'no'} | "
                     f"{r['params'] / 1e6:.2f}M | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {ratio} | "
                     f"{_gib(r['peak_gib'])} | {r['final_loss']:.3f} |")
    return "\n".join(lines)


def format_savings(savings: list[dict]) -> str:
    lines = ["| mixer | backend | peak GiB without | peak GiB with | memory saving | tokens/s without | "
             "tokens/s with | throughput kept |", "|---|---|---|---|---|---|---|---|"]
    for s in savings:
        saving = f"{s['memory_saving']:.2f}x" if s["memory_saving"] is not None else "—"
        lines.append(f"| {NAMES[s['mixer']]} | {s['backend']} | {_gib(s['peak_gib_without'])} | "
                     f"{_gib(s['peak_gib_with'])} | {saving} | {s['tokens_per_s_without']:,.0f} | "
                     f"{s['tokens_per_s_with']:,.0f} | {s['throughput_kept']:.2f} |")
    return "\n".join(lines)


def settings_line(args: argparse.Namespace, env: dict) -> str:
    value_dim = round(args.head_dim * args.expand_v)
    dtype = "bf16 autocast" if env["device"].startswith("cuda") else "float32"
    return (f"B={args.batch} T={args.seq_len}, D={args.hidden} L={args.layers} H={args.heads} K={args.head_dim} "
            f"V={value_dim} MLP={args.intermediate_size} vocab={args.vocab} (tied), {dtype}, AdamW lr {args.lr}, "
            f"clip 1.0, {compiled(args)}, {args.warmup} warm-up + {args.steps} timed steps (median), seed "
            f"{args.seed}; {env['gpu'] or env['device']}, torch {env['torch']}, triton {env['triton']}")


def compiled(args: argparse.Namespace) -> str:
    """How the blocks ran, for the settings line: eager, or ``torch.compile`` of their parts in a mode."""
    return f"torch.compile per block (mode {args.compile})" if args.compile else "eager (no torch.compile)"


# ---------------------------------------------------------------- paper mode: 1.5B presets under FSDP2


def paper_model_config(args: argparse.Namespace, name: str, backend: str) -> tuple[LinMemConfig, TrainConfig]:
    """The ``LinMemConfig`` of ``configs/paper/NAME-1.5b.yaml`` with ``args.overrides``, on ``backend``, and the
    preset's whole training config."""
    config = load_config(PAPER_CONFIGS / f"{name}-1.5b.yaml", args.overrides)
    model_config, _ = model_config_of(config)
    model_config.backend, model_config.use_cache = backend, False
    return model_config, config


def measure_paper(args: argparse.Namespace, name: str, backend: str, seq_len: int, device: torch.device,
                  deadline: float) -> dict:
    """One paper preset at context ``seq_len``: FSDP2 over the running group, checkpointing per block, its AdamW.

    Returns a row: ``params``, ``batch``, ``step_ms`` (median), ``tokens_per_s``, ``peak_gib`` / ``reserved_gib``
    (None on the CPU), ``flops_per_token`` (``linmem.bench.flops``), ``mfu``, ``final_loss``, ``timed_steps``.
    """
    start = time.perf_counter()
    cuda = device.type == "cuda"
    batch = max(1, args.tokens_per_step // seq_len)
    model_config, config = paper_model_config(args, name, backend)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    with torch.device(device):  # built where it trains: a 1.5B model initialised on the CPU takes a while
        model = LinMemForCausalLM(model_config)
    params = count_parameters(model)
    if args.checkpointing != "off":
        enable_gradient_checkpointing(model)
    if args.compile:  # the blocks' parts, before fully_shard (its hooks stay outside the compiled code)
        compile_blocks(model, args.compile)
    policy = {}
    if args.param_dtype == "bfloat16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model = fully_shard_model(model, **policy)
    optimizer = build_optimizer(model, config)
    print(f"{NAMES[name]}/{backend} T={seq_len} B={batch}: {params:,} parameters, FSDP2 over {dist.get_backend()} "
          f"(world size {dist.get_world_size()})", flush=True)
    tokens = random_tokens(args.seed, batch, seq_len, model_config.vocab_size, device)
    use_autocast = cuda and args.param_dtype == "float32"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()
    step = lambda: train_step(model, optimizer, tokens, autocast, args.loss_chunk)  # noqa: E731
    times, final_loss = time_steps(step, args.warmup, args.steps, device, deadline)
    profiled = {}
    if args.profile:
        top, kinds = profile_steps(step, args.profile, device)
        profiled = dict(profile=dict(steps=args.profile, top=top, kinds=kinds))
    step_s = statistics.median(times)
    tokens_per_s = batch * seq_len / step_s
    flops = flops_per_token(model_config, seq_len)
    return dict(model=name, backend=backend, seq_len=seq_len, batch=batch, params=params,
                checkpointing=args.checkpointing != "off", param_dtype=args.param_dtype, loss_chunk=args.loss_chunk,
                step_ms=step_s * 1e3,
                steps_ms=[t * 1e3 for t in times], tokens_per_s=tokens_per_s, **peak_memory(device),
                flops_per_token=flops, mfu=mfu(tokens_per_s, flops["total"], args.peak_tflops),
                final_loss=final_loss, finite=math.isfinite(final_loss), timed_steps=len(times),
                seconds=time.perf_counter() - start, **profiled)


def format_paper_profiles(rows: list[dict]) -> str:
    """Per profiled row: where its step's time goes (``linmem.bench.step_profile``)."""
    return "".join(f"## Where a step's time goes: {NAMES[r['model']]}/{r['backend']} T={r['seq_len']:,} "
                   f"({r['profile']['steps']} profiled steps)\n\n"
                   f"{format_profile(r['profile']['top'], r['profile']['kinds'])}\n\n" for r in rows if "profile" in r)


def format_paper_table(rows: list[dict]) -> str:
    lines = ["| model | backend | T | B | params | ms/step | tokens/s | peak GiB (reserved) | GFLOP/token | MFU | "
             "final loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {NAMES[r['model']]} | {r['backend']} | {r['seq_len']:,} | {r['batch']} | "
                     f"{r['params'] / 1e6:,.1f}M | {r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} | "
                     f"{_gib(r['peak_gib'])} ({_gib(r['reserved_gib'])}) | {r['flops_per_token']['total'] / 1e9:.2f} | "
                     f"{100 * r['mfu']:.1f}% | {r['final_loss']:.3f} |")
    return "\n".join(lines)


def paper_settings_line(args: argparse.Namespace, env: dict) -> str:
    precision = ("bf16 autocast, float32 parameters" if args.param_dtype == "float32" else
                 "FSDP2 bf16 parameters, float32 gradient reduction")
    if not env["device"].startswith("cuda"):
        precision = "float32"
    overrides = "".join(f" --set {o}" for o in args.overrides)
    chunk = f"loss in chunks of {args.loss_chunk:,} tokens" if args.loss_chunk else "loss over the whole logits"
    return (f"configs/paper presets{overrides}; FSDP2 world size 1, gradient checkpointing "
            f"{args.checkpointing}, {compiled(args)}, {precision}, {chunk}, {args.tokens_per_step:,} tokens per step "
            f"(B = tokens / T), "
            f"preset AdamW, clip 1.0, {args.warmup} warm-up + {args.steps} timed steps (median), seed {args.seed}; "
            f"MFU = model FLOPs per token (linmem.bench.flops: 6·N + memory / attention term) x tokens/s / "
            f"{args.peak_tflops:g} TFLOP/s; {env['gpu'] or env['device']}, torch {env['torch']}, "
            f"triton {env['triton']}")


# ---------------------------------------------------------------- the run


def label(job: dict) -> str:
    name = NAMES[job.get("mixer") or job["model"]]
    extra = f" T={job['seq_len']}" if "seq_len" in job else (" checkpointed" if job.get("checkpointing") else "")
    return f"{name}/{job['backend']}{extra}"


def write_outputs(out: Path, report: dict) -> None:
    """``training.json`` / ``.md`` (paper mode: ``paper-training.*``), each written whole to a temporary file and
    renamed, so a reader never sees half a report."""
    out.mkdir(parents=True, exist_ok=True)
    stem = "paper-training" if report["mode"] == "paper" else "training"
    skipped = "".join(f"- {label(s)}: {s['reason']}\n" for s in report["skipped"])
    if report["mode"] == "paper":
        body = (f"# Training throughput of the 1.5B presets\n\n{format_paper_table(report['rows'])}\n\n"
                + format_paper_profiles(report["rows"]))
    else:
        body = f"# Training throughput\n\n{format_table(report['rows'])}\n\n"
        if report.get("savings"):
            body += f"Gradient checkpointing:\n\n{format_savings(report['savings'])}\n\n"
    md = (body + f"{report['settings_line']}\n\n" + (f"Skipped:\n\n{skipped}\n" if skipped else "")
          + f"```\n{report['command']}\n```\n")
    for path, text in ((out / f"{stem}.json", json.dumps(report, indent=2) + "\n"), (out / f"{stem}.md", md)):
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(text)
        temporary.replace(path)


def _list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return items
    return parse


def _lengths(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected; got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"context lengths must be >= 2; got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixers", type=_list(MIXERS), default="rdn,rla,gdn,sgla")
    parser.add_argument("--backends", type=_list(BACKENDS), default="triton,chunk")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size D")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=6, help="mixer heads H")
    parser.add_argument("--head-dim", type=int, default=128, help="key width per head K")
    parser.add_argument("--expand-v", type=float, default=1.0, help="value width per head V = K * expand_v")
    parser.add_argument("--intermediate-size", type=int, default=None, help="SwiGLU MLP width (default: 3 x hidden)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--checkpointing", choices=tuple(CHECKPOINTING), default=None,
                        help="gradient checkpointing per block: off, on, or both (each model twice; default: off, "
                             "in paper mode on)")
    parser.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                        help="torch.compile each block's norms, mixer and MLP (linmem.train.compile), optionally in a "
                             "mode (default: eager; --compile alone: mode default); the warm-up steps compile")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run (see the docstring)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the .json and .md reports here")
    paper = parser.add_argument_group("paper mode")
    paper.add_argument("--paper", type=_list(PAPER_MODELS), default=None,
                       help="the configs/paper presets to measure (e.g. rdn,gdn); switches to paper mode")
    paper.add_argument("--seq-lens", type=_lengths, default="2048,8192", help="context lengths T (2048,8192)")
    paper.add_argument("--tokens-per-step", type=int, default=32768, help="tokens per step; B = tokens / T (32768)")
    paper.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a preset value (repeatable), e.g. --set model.num_hidden_layers=2")
    paper.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="float32 parameters under bf16 autocast (the trainer's way), or FSDP2's bf16 parameters")
    paper.add_argument("--loss-chunk", type=int, default=None, metavar="TOKENS",
                       help="LM head and loss over TOKENS tokens at a time, so the whole float32 logits never exist "
                            f"(0: off; default {LOSS_CHUNK_TOKENS} in paper mode, else 0)")
    paper.add_argument("--profile", type=int, default=0, metavar="STEPS",
                       help="after the timed steps, profile STEPS more and report where a step's time goes: the "
                            "kernels by their own time and the share of matmul, linmem's kernels, optimizer, ... "
                            "(0: off)")
    paper.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                       help="the accelerator's peak for MFU, TFLOP/s (989: H100 / H200 SXM dense bf16)")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.intermediate_size = args.intermediate_size or 3 * args.hidden
    paper_mode = args.paper is not None
    args.checkpointing = args.checkpointing or ("on" if paper_mode else "off")
    if args.loss_chunk is None:
        args.loss_chunk = LOSS_CHUNK_TOKENS if paper_mode else 0
    if args.loss_chunk < 0:
        parser.error("--loss-chunk must be >= 0 (0: off)")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if paper_mode and (args.checkpointing == "both" or args.tokens_per_step < 1 or args.peak_tflops <= 0):
        parser.error("paper mode takes --checkpointing on or off, --tokens-per-step >= 1 and --peak-tflops > 0")
    if args.profile < 0 or (args.profile and not paper_mode):
        parser.error("--profile STEPS (>= 0) profiles paper-mode runs: use it with --paper")
    if args.overrides and not paper_mode:
        parser.error("--set changes the paper presets: use it with --paper")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    deadline = start + args.budget
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    env = environment(device)
    command = shlex.join(["python", "-m", "linmem.bench.training", *(sys.argv[1:] if argv is None else argv)])
    rows, skipped = [], []
    if paper_mode:
        jobs = [dict(model=m, backend=b, seq_len=t) for b in args.backends for m in args.paper for t in args.seq_lens]
        settings = paper_settings_line(args, env)
    else:
        jobs = [dict(mixer=m, backend=b, checkpointing=c) for b in args.backends for m in args.mixers
                for c in CHECKPOINTING[args.checkpointing]]
        settings = settings_line(args, env) + f"; gradient checkpointing {args.checkpointing}"
    report = dict(mode="paper" if paper_mode else "mixers", command=command, **env,
                  settings=dict(vars(args), out=str(args.out)), settings_line=settings, rows=rows, skipped=skipped)
    started_group = start_local_group(device) if paper_mode else False
    try:
        run_jobs(args, jobs, device, deadline, report)
    finally:
        if started_group:
            dist.destroy_process_group()
    report["elapsed_s"] = time.perf_counter() - start
    table = format_paper_table(rows) if paper_mode else format_table(rows)
    print(f"\n{report['settings_line']}\n\n{table}")
    if paper_mode and args.profile:
        print(f"\n{format_paper_profiles(rows)}")
    if report.get("savings"):
        print(f"\ngradient checkpointing:\n{format_savings(report['savings'])}")
    for s in skipped:
        print(f"skipped {label(s)}: {s['reason']}")
    print(f"({report['elapsed_s']:.0f} s)")
    if args.out:
        write_outputs(args.out, report)
        stem = "paper-training" if paper_mode else "training"
        print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.md')}")
        if paper_mode:
            print(json.dumps([{k: r[k] for k in ("model", "seq_len", "tokens_per_s", "peak_gib", "mfu")}
                              for r in rows]))
    bad = [label(r) for r in rows if not r["finite"]]
    if bad:
        raise NonFiniteLoss(f"non-finite final loss: {', '.join(bad)}")
    return rows


def run_jobs(args: argparse.Namespace, jobs: list[dict], device: torch.device, deadline: float, report: dict) -> None:
    """Measure each job (skipping, with the reason, what fails or would end past ``deadline``), updating
    ``report`` (and its files under ``args.out``) after each."""
    rows, skipped, durations = report["rows"], report["skipped"], {}
    for job in jobs:
        same = durations.get(job["backend"])
        estimate = max(same) if same else max((d for ds in durations.values() for d in ds), default=0.0)
        left = deadline - time.perf_counter()
        if durations and estimate > left:
            reason = f"budget: {left:.0f} s left, the longest measurement so far took {estimate:.0f} s"
            skipped.append(dict(job, reason=reason))
            print(f"skip {label(job)}: {reason}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            if "model" in job:
                row = measure_paper(args, job["model"], job["backend"], job["seq_len"], device, deadline)
            else:
                row = measure(args, job["mixer"], job["backend"], device, deadline, job["checkpointing"])
        except Exception as error:  # noqa: BLE001 - any failure of one job is reported and the rest run
            reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
            skipped.append(dict(job, reason=reason))
            print(f"skip {label(job)}: {reason}", flush=True)
            continue
        finally:  # the failed job's traceback (and with it its model) is gone once the except clause ends
            durations.setdefault(job["backend"], []).append(time.perf_counter() - t0)
            free_memory(device)
        rows.append(row)
        line = f"  {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s"
        if "mfu" in row:
            line += f", MFU {100 * row['mfu']:.1f}%, peak {_gib(row['peak_gib'])} GiB"
        else:
            add_ratios(rows)
            report["savings"] = checkpointing_savings(rows)
        print(f"{line}, final loss {row['final_loss']:.4f} ({row['seconds']:.1f} s)", flush=True)
        if not row["finite"]:
            print(f"ERROR: {label(job)}: final loss is {row['final_loss']}", flush=True)
        if args.out:
            write_outputs(args.out, report)


if __name__ == "__main__":
    main()
