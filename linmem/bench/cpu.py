"""CPU benchmark of the linear-memory op: forward+backward time of ``chunk`` vs ``reference``, and of each residual
memory (RLA, RDN) vs its base memory (sGLA, GDN), measured side by side in one run; then a length sweep of every
memory on ``chunk`` (time, peak memory, growth per doubling of T).

    python -m linmem.bench.cpu                      # T = 512 … 8192, sweep T = 4K … 32K; B=1, H=4, D=64, float32
    python -m linmem.bench.cpu --lengths 2048 --sweep-lengths 1024 2048 --repeats 3    # a quick run
    python -m linmem.bench.cpu --out docs/benchmarks    # also writes cpu.json and cpu.md there

Peak memory of the sweep: every (memory, T) runs in a fresh process; the figure is the growth of that process's
peak resident set (``VmHWM`` of ``/proc/self/status``, restarted with ``clear_refs``) over its resident set just
before the first forward+backward, inputs already built, so it counts everything the op and autograd allocate,
gradients of the inputs included.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from linmem.io.atomic import atomic_write, write_json_atomic
from linmem.ops import linear_memory

MEMORIES = {  # name: (rule, residual, per-key decay)
    "sGLA": ("additive", False, False),
    "GLA": ("additive", False, True),
    "RLA": ("additive", True, False),
    "GDN": ("delta", False, False),
    "RDN": ("delta", True, False),
}
BASE_OF = {"RLA": "sGLA", "RDN": "GDN"}
SWEEP_LENGTHS = [4096, 8192, 16384, 32768]
NOTES_MARKER = "<!-- notes below this line are kept when the bench rewrites this file -->"


def make_inputs(batch: int, length: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Leaf tensors like a layer would produce: unit keys, log decays in [-0.1, 0] per head (``g``) and per key
    channel (``g_key``, GLA's), gates in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, length, heads)
    inputs = dict(
        q=torch.randn(*shape, dim, generator=gen),
        k=torch.nn.functional.normalize(torch.randn(*shape, dim, generator=gen), dim=-1),
        v=torch.randn(*shape, dim, generator=gen),
        g=-0.1 * torch.rand(*shape, generator=gen),
        g_key=-0.1 * torch.rand(*shape, dim, generator=gen),
        beta=torch.rand(*shape, generator=gen),
        gamma=torch.rand(*shape, generator=gen),
    )
    return {name: t.to(dtype).requires_grad_() for name, t in inputs.items()}


def forward_backward_seconds(inputs: dict, memory: str, backend: str) -> float:
    """Seconds of one forward and backward pass of one memory."""
    rule, residual, per_key = MEMORIES[memory]
    start = time.perf_counter()
    o, _ = linear_memory(inputs["q"], inputs["k"], inputs["v"], inputs["g_key" if per_key else "g"], inputs["beta"],
                         inputs["gamma"] if residual else None, rule=rule, residual=residual, backend=backend)
    o.sum().backward()
    return time.perf_counter() - start


def run(lengths, batch=1, heads=4, dim=64, dtype=torch.float32, repeats=5, reference_max_length=2048) -> list[dict]:
    """One row per (memory, T): median chunk time, reference time (up to ``reference_max_length``), and ratios.

    The memories of one T are timed round-robin (sGLA, GLA, RLA, GDN, RDN, sGLA, ...) so that a slow spell of the
    machine hits all of them alike and the ratios stay fair.
    """
    rows = []
    for length in tqdm(lengths, desc="chunk vs reference", unit="T"):
        inputs = make_inputs(batch, length, heads, dim, dtype)
        times = {name: [] for name in MEMORIES}
        for round_ in range(repeats + 1):  # round 0 warms up
            for name in MEMORIES:
                seconds = forward_backward_seconds(inputs, name, "chunk")
                if round_:
                    times[name].append(seconds)
        for name in MEMORIES:
            row = dict(memory=name, T=length, chunk_s=statistics.median(times[name]))
            if length <= reference_max_length:
                row["reference_s"] = forward_backward_seconds(inputs, name, "reference")
                row["chunk_speedup"] = row["reference_s"] / row["chunk_s"]
            if name in BASE_OF:
                row["vs_base"] = row["chunk_s"] / statistics.median(times[BASE_OF[name]])
            rows.append(row)
    return rows


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (Linux) in bytes: ``VmRSS`` (resident now), ``VmHWM`` (peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/self/status has no field {field!r}")


def reset_peak_resident() -> None:
    """Restart the peak resident set (``VmHWM``) from the current one (Linux ``clear_refs``, value 5); a process
    started by ``spawn`` would otherwise carry its parent's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_one(memory: str, length: int, batch: int, heads: int, dim: int, dtype: str, repeats: int,
                threads: int | None) -> dict:
    """In a fresh process: peak memory growth of the first forward+backward, then the median of ``repeats``."""
    if threads:
        torch.set_num_threads(threads)
    inputs = make_inputs(batch, length, heads, dim, getattr(torch, dtype))
    reset_peak_resident()
    before = proc_status_bytes("VmRSS")
    first = forward_backward_seconds(inputs, memory, "chunk")
    peak = proc_status_bytes("VmHWM") - before
    times = []
    for _ in range(repeats):
        for t in inputs.values():
            t.grad = None
        times.append(forward_backward_seconds(inputs, memory, "chunk"))
    return dict(memory=memory, T=length, chunk_s=statistics.median(times) if times else first, first_s=first,
                peak_mb=peak / 2**20)


def sweep(lengths, batch=1, heads=4, dim=64, dtype="float32", repeats=3, threads=None) -> list[dict]:
    """Every memory at every length on ``chunk``, each in its own process (``measure_one``), with the growth of
    time and memory from the previous length (per doubling when the lengths double)."""
    rows = []
    context = multiprocessing.get_context("spawn")
    jobs = [(name, length) for length in lengths for name in MEMORIES]
    with context.Pool(1, maxtasksperchild=1) as pool:
        for name, length in tqdm(jobs, desc="length sweep", unit="run"):
            rows.append(pool.apply(measure_one, (name, length, batch, heads, dim, dtype, repeats, threads)))
    last = {}
    for row in rows:
        previous = last.get(row["memory"])
        if previous is not None:
            row["time_growth"] = row["chunk_s"] / previous["chunk_s"]
            row["memory_growth"] = row["peak_mb"] / previous["peak_mb"] if previous["peak_mb"] > 0 else None
            row["length_growth"] = row["T"] / previous["T"]
        last[row["memory"]] = row
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


def format_sweep(rows: list[dict]) -> str:
    lines = ["| memory | T | chunk fwd+bwd (ms) | time growth | peak memory growth (MB) | memory growth |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (list(MEMORIES).index(r["memory"]), r["T"])):
        per = f" (T x{r['length_growth']:g})" if r.get("length_growth", 2) != 2 else ""
        time_growth = f"{r['time_growth']:.2f}x{per}" if "time_growth" in r else "—"
        memory_growth = f"{r['memory_growth']:.2f}x{per}" if r.get("memory_growth") else "—"
        lines.append(f"| {r['memory']} | {r['T']} | {r['chunk_s'] * 1e3:.0f} | {time_growth} | {r['peak_mb']:.0f} "
                     f"| {memory_growth} |")
    return "\n".join(lines)


def markdown(command: str, header: str, rows: list[dict], sweep_rows: list[dict], kept_notes: str) -> str:
    """The benchmark page: how it was run, both tables, and the notes kept from the page it replaces."""
    parts = ["# CPU benchmark of the op (chunk vs reference, residual vs base, length sweep)", "",
             f"`{command}`: {header}. Forward+backward; `chunk` times are medians (round-robin over the memories "
             "for the first table, a fresh process per row for the sweep), `reference` one run. Raw rows: "
             "[cpu.json](cpu.json).", ""]
    if rows:
        parts += ["## chunk vs reference", "", format_table(rows), ""]
    if sweep_rows:
        parts += ["## Length sweep (`chunk`)", "",
                  "Time and peak memory growth per step of T (a doubling unless marked). Peak memory: growth of the "
                  "process's peak resident set (`VmHWM`, restarted before the run) over its resident set just before "
                  "the first forward+backward, inputs already built (gradients of the inputs included).", "",
                  format_sweep(sweep_rows), ""]
    parts += [NOTES_MARKER, kept_notes.strip("\n"), ""]
    return "\n".join(parts)


def kept_notes(page: Path) -> str:
    """What follows ``NOTES_MARKER`` in an existing page (hand-written analysis), or nothing."""
    if not page.exists():
        return ""
    text = page.read_text(encoding="utf-8")
    return text.split(NOTES_MARKER, 1)[1] if NOTES_MARKER in text else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192],
                        help="T of the chunk-vs-reference table (none: skip it)")
    parser.add_argument("--sweep-lengths", type=int, nargs="*", default=SWEEP_LENGTHS,
                        help="T of the length sweep (none: skip it)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="head dim K = V")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-max-length", type=int, default=2048,
                        help="time the (slow) reference loop only up to this T")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--out", help="write cpu.json and cpu.md into this folder (notes after the marker line of "
                                      "an existing cpu.md are kept)")
    args = parser.parse_args(argv)
    for name in ("batch", "heads", "dim", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = run(args.lengths, args.batch, args.heads, args.dim, dtype, args.repeats, args.reference_max_length)
    sweep_rows = sweep(args.sweep_lengths, args.batch, args.heads, args.dim, args.dtype, args.repeats, args.threads)
    header = (f"B={args.batch} H={args.heads} K=V={args.dim} {args.dtype}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
    print(f"\n{header}\n")
    if rows:
        print(format_table(rows) + "\n")
    if sweep_rows:
        print(format_sweep(sweep_rows))
    record = dict(settings=vars(args), torch=torch.__version__, threads=torch.get_num_threads(), rows=rows,
                  sweep=sweep_rows)
    if args.json:
        write_json_atomic(args.json, record)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "cpu.json", record)
        command = "python -m linmem.bench.cpu " + " ".join(argv if argv is not None else sys.argv[1:])
        with atomic_write(out / "cpu.md", "w") as f:
            f.write(markdown(command.strip(), header, rows, sweep_rows, kept_notes(out / "cpu.md")))


if __name__ == "__main__":
    main()
