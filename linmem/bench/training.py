"""End-to-end training throughput: RDN and RLA language models against the same model with GDN and sGLA mixers,
measured one after another in one run (issue 3).

    python -m linmem.bench.training --out docs/benchmarks          # ~125M models, B=8 x T=2048, bf16, on CUDA
    python -m linmem.bench.training --mixers rdn,gdn --backends triton --steps 20 --budget 120
    python -m linmem.bench.training --hidden 64 --layers 2 --heads 2 --head-dim 32 --vocab 256 \\
        --batch 1 --seq-len 64 --steps 2 --warmup 1 --backends chunk --threads 1   # CPU dry run, seconds

Every (backend, mixer) pair, backends outer and mixers inner in the order given, builds a ``LinMemForCausalLM`` of the
same shape (default: D = 768, 12 layers, H = 6 heads of K = V = 128, SwiGLU MLP 3·D = 2304, vocabulary 32000, tied
embeddings: 123.9M to 124.0M parameters; the exact count of each model is printed), seeds it alike, and runs full
training steps on one fixed batch of random token ids ``[B, T]``: forward with labels (mean next-token cross entropy),
backward, gradient clipping at 1.0 and AdamW, under bfloat16 autocast on CUDA (float32 on the CPU). ``--warmup`` steps
(Triton compilation, allocator) come first; then ``--steps`` steps are timed one by one between
``torch.cuda.synchronize()`` calls. Reported per model: the median step time (ms), tokens/s = B·T / median step time,
the step-time ratio to the base mixer on the same backend (RDN / GDN, RLA / sGLA: 1.30 means 30% slower), the peak
allocated GPU memory (GiB, the peak counter reset before each model) and the final loss, which must be finite: a
non-finite loss is printed and, once everything is written, the run exits with an error.

A pair that raises (Triton not usable here, out of memory, ...) is skipped with the reason printed; the rest run.
``--budget`` (seconds, default 240) bounds the run: a measurement is not started when the longest one so far (on the
same backend, else on any) would end past the budget, and a measurement that crosses it stops after its current
timed step. Skipped pairs are listed with the reason. With ``--out DIR`` the results are (re)written after every
measurement to ``DIR/training.json`` (GPU, torch and triton versions, all settings, every row) and
``DIR/training.md`` (the table, the settings line and the command), so a run killed from outside keeps what it had.
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
from pathlib import Path

import torch

from linmem.bench import environment
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.configuration import MIXERS
from linmem.ops import BACKENDS
from linmem.train.trainer import count_parameters

NAMES = {"sgla": "sGLA", "gla": "GLA", "gdn": "GDN", "rla": "RLA", "rdn": "RDN"}
BASE_OF = {"rdn": "gdn", "rla": "sgla"}
GIB = 2**30


class NonFiniteLoss(RuntimeError):
    """A model's final training loss is NaN or infinite."""


def model_config(args: argparse.Namespace, mixer: str, backend: str) -> LinMemConfig:
    return LinMemConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_heads=args.heads, head_dim=args.head_dim, expand_v=args.expand_v,
                        intermediate_size=args.intermediate_size, tie_word_embeddings=True, mixer=mixer,
                        backend=backend, use_cache=False)


def train_step(model: LinMemForCausalLM, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               autocast) -> torch.Tensor:
    """One update on ``tokens [B, T]`` (inputs and labels); returns the loss (a detached scalar)."""
    optimizer.zero_grad(set_to_none=True)
    with autocast:
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


def free_memory(device: torch.device) -> None:
    """Release what the last model and optimizer held (called once nothing refers to them)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace, mixer: str, backend: str, device: torch.device, deadline: float) -> dict:
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
    params = count_parameters(model)
    print(f"{NAMES[mixer]}/{backend}: {params:,} parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    for _ in range(args.warmup):
        train_step(model, optimizer, tokens, autocast)
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, tokens, autocast)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    final_loss = float(loss)
    step_s = statistics.median(times)
    return dict(mixer=mixer, backend=backend, params=params, step_ms=step_s * 1e3,
                steps_ms=[t * 1e3 for t in times], tokens_per_s=args.batch * args.seq_len / step_s,
                peak_gib=torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
                final_loss=final_loss, finite=math.isfinite(final_loss), timed_steps=len(times),
                seconds=time.perf_counter() - start)


def add_ratios(rows: list[dict]) -> None:
    """``vs_base``: a residual mixer's median step time over its base mixer's on the same backend (when measured)."""
    by_key = {(r["mixer"], r["backend"]): r for r in rows}
    for r in rows:
        base = by_key.get((BASE_OF.get(r["mixer"]), r["backend"]))
        r["base"] = base["mixer"] if base else None
        r["vs_base"] = r["step_ms"] / base["step_ms"] if base else None


def format_table(rows: list[dict]) -> str:
    lines = ["| mixer | backend | params | ms/step | tokens/s | step time vs base | peak GiB | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['vs_base']:.2f}x {NAMES[r['base']]}" if r.get("vs_base") is not None else "—"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "—"
        lines.append(f"| {NAMES[r['mixer']]} | {r['backend']} | {r['params'] / 1e6:.2f}M | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {ratio} | {peak} | {r['final_loss']:.3f} |")
    return "\n".join(lines)


def settings_line(args: argparse.Namespace, env: dict) -> str:
    value_dim = round(args.head_dim * args.expand_v)
    dtype = "bf16 autocast" if env["device"].startswith("cuda") else "float32"
    return (f"B={args.batch} T={args.seq_len}, D={args.hidden} L={args.layers} H={args.heads} K={args.head_dim} "
            f"V={value_dim} MLP={args.intermediate_size} vocab={args.vocab} (tied), {dtype}, AdamW lr {args.lr}, "
            f"clip 1.0, {args.warmup} warm-up + {args.steps} timed steps (median), seed {args.seed}; "
            f"{env['gpu'] or env['device']}, torch {env['torch']}, triton {env['triton']}")


def write_outputs(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    skipped = "".join(f"- {NAMES[s['mixer']]}/{s['backend']}: {s['reason']}\n" for s in report["skipped"])
    md = (f"# Training throughput\n\n{format_table(report['rows'])}\n\n{report['settings_line']}\n\n"
          + (f"Skipped:\n\n{skipped}\n" if skipped else "")
          + f"```\n{report['command']}\n```\n")
    (out / "training.md").write_text(md)


def _list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return items
    return parse


def main(argv: list[str] | None = None) -> list[dict]:
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
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run (see the docstring)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="write training.json and training.md here")
    args = parser.parse_args(argv)
    args.intermediate_size = args.intermediate_size or 3 * args.hidden
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    deadline = start + args.budget
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    env = environment(device)
    command = shlex.join(["python", "-m", "linmem.bench.training",
                          *(sys.argv[1:] if argv is None else argv)])
    rows, skipped, durations = [], [], {}
    report = dict(command=command, **env, settings=dict(vars(args), out=str(args.out)),
                  settings_line=settings_line(args, env), rows=rows, skipped=skipped)
    for backend in args.backends:
        for mixer in args.mixers:
            same = durations.get(backend)
            estimate = max(same) if same else max((d for ds in durations.values() for d in ds), default=0.0)
            left = deadline - time.perf_counter()
            if durations and estimate > left:
                reason = f"budget: {left:.0f} s left, the longest measurement so far took {estimate:.0f} s"
                skipped.append(dict(mixer=mixer, backend=backend, reason=reason))
                print(f"skip {NAMES[mixer]}/{backend}: {reason}", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                row = measure(args, mixer, backend, device, deadline)
            except Exception as error:  # noqa: BLE001 - any failure of one pair is reported and the rest run
                reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
                skipped.append(dict(mixer=mixer, backend=backend, reason=reason))
                print(f"skip {NAMES[mixer]}/{backend}: {reason}", flush=True)
                continue
            finally:  # the failed pair's traceback (and with it its model) is gone once the except clause ends
                durations.setdefault(backend, []).append(time.perf_counter() - t0)
                free_memory(device)
            rows.append(row)
            add_ratios(rows)
            print(f"  {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, final loss "
                  f"{row['final_loss']:.4f} ({row['seconds']:.1f} s)", flush=True)
            if not row["finite"]:
                print(f"ERROR: {NAMES[mixer]}/{backend}: final loss is {row['final_loss']}", flush=True)
            if args.out:
                write_outputs(args.out, report)
    report["elapsed_s"] = time.perf_counter() - start
    print(f"\n{report['settings_line']}\n\n{format_table(rows)}")
    for s in skipped:
        print(f"skipped {NAMES[s['mixer']]}/{s['backend']}: {s['reason']}")
    print(f"({report['elapsed_s']:.0f} s)")
    if args.out:
        write_outputs(args.out, report)
        print(f"wrote {args.out / 'training.json'} and {args.out / 'training.md'}")
    bad = [f"{NAMES[r['mixer']]}/{r['backend']}" for r in rows if not r["finite"]]
    if bad:
        raise NonFiniteLoss(f"non-finite final loss: {', '.join(bad)}")
    return rows


if __name__ == "__main__":
    main()
