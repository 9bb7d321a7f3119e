"""CPU benchmark of the linear-memory op: forward+backward time of ``chunk`` vs ``reference``, and of each residual
memory (RLA, RDN) vs its base memory (sGLA, GDN), measured side by side in one run.

    python -m linmem.bench.cpu                      # T = 512 … 8192, B=1, H=4, D=64, float32
    python -m linmem.bench.cpu --lengths 2048 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

from linmem.ops import linear_memory

MEMORIES = {  # name: (rule, residual)
    "sGLA": ("additive", False),
    "RLA": ("additive", True),
    "GDN": ("delta", False),
    "RDN": ("delta", True),
}
BASE_OF = {"RLA": "sGLA", "RDN": "GDN"}


def make_inputs(batch: int, length: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Leaf tensors like a layer would produce: unit keys, log decays in [-0.1, 0], gates in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, length, heads)
    inputs = dict(
        q=torch.randn(*shape, dim, generator=gen),
        k=torch.nn.functional.normalize(torch.randn(*shape, dim, generator=gen), dim=-1),
        v=torch.randn(*shape, dim, generator=gen),
        g=-0.1 * torch.rand(*shape, generator=gen),
        beta=torch.rand(*shape, generator=gen),
        gamma=torch.rand(*shape, generator=gen),
    )
    return {name: t.to(dtype).requires_grad_() for name, t in inputs.items()}


def forward_backward_seconds(inputs: dict, rule: str, residual: bool, backend: str) -> float:
    """Seconds of one forward and backward pass."""
    start = time.perf_counter()
    o, _ = linear_memory(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                         inputs["gamma"] if residual else None, rule=rule, residual=residual, backend=backend)
    o.sum().backward()
    return time.perf_counter() - start


def run(lengths, batch=1, heads=4, dim=64, dtype=torch.float32, repeats=5, reference_max_length=2048) -> list[dict]:
    """One row per (memory, T): median chunk time, reference time (up to ``reference_max_length``), and ratios.

    The memories of one T are timed round-robin (sGLA, RLA, GDN, RDN, sGLA, ...) so that a slow spell of the
    machine hits all of them alike and the ratios stay fair.
    """
    rows = []
    for length in tqdm(lengths, desc="benchmark", unit="T"):
        inputs = make_inputs(batch, length, heads, dim, dtype)
        times = {name: [] for name in MEMORIES}
        for round_ in range(repeats + 1):  # round 0 warms up
            for name, (rule, residual) in MEMORIES.items():
                seconds = forward_backward_seconds(inputs, rule, residual, "chunk")
                if round_:
                    times[name].append(seconds)
        for name, (rule, residual) in MEMORIES.items():
            row = dict(memory=name, T=length, chunk_s=statistics.median(times[name]))
            if length <= reference_max_length:
                row["reference_s"] = forward_backward_seconds(inputs, rule, residual, "reference")
                row["chunk_speedup"] = row["reference_s"] / row["chunk_s"]
            if name in BASE_OF:
                row["vs_base"] = row["chunk_s"] / statistics.median(times[BASE_OF[name]])
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| memory | T | chunk fwd+bwd (ms) | reference fwd+bwd (ms) | chunk speedup | cost vs base |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ref = f"{r['reference_s'] * 1e3:.0f}" if "reference_s" in r else "—"
        speedup = f"{r['chunk_speedup']:.1f}x" if "chunk_speedup" in r else "—"
        base = f"{r['vs_base']:.2f}x {BASE_OF[r['memory']]}" if "vs_base" in r else "—"
        lines.append(f"| {r['memory']} | {r['T']} | {r['chunk_s'] * 1e3:.1f} | {ref} | {speedup} | {base} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="head dim K = V")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-max-length", type=int, default=2048,
                        help="time the (slow) reference loop only up to this T")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.lengths, args.batch, args.heads, args.dim, getattr(torch, args.dtype), args.repeats,
               args.reference_max_length)
    print(f"\nB={args.batch} H={args.heads} D={args.dim} {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=vars(args), torch=torch.__version__, threads=torch.get_num_threads(), rows=rows),
                      f, indent=2)


if __name__ == "__main__":
    main()
