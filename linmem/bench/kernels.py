"""Kernel benchmark (GPU): linmem's fused RLA/RDN kernels against flash-linear-attention (FLA) and flash attention.

    python -m linmem.bench.kernels [--out docs/benchmarks] [--sweep] [--profile] [--quick-check] [--budget 480]
                                   [--rounds 3]

One run does five things, in this order, so that one GPU session answers both "is it right" and "is it fast":

1. compiles the kernels of the methods asked for (``--methods``) in parallel worker processes (one task per
   process: a CUDA fault must not poison later tasks) and, in those workers, checks linmem's Triton backend
   against the float64 reference on fresh random inputs: outputs, final states and every gradient, with every
   kernel output buffer NaN-poisoned first; then, once that pool is done, each in a fresh process with the GPU to
   itself, one at a time, it runs RDN at 614K tokens (per-chunk state tensors of more than 2^31 elements, ~60 GB)
   and checks that the last sequence's results equal those of the same sequence run alone (64-bit addressing),
   and runs RLA and RDN at the longest timed length for finite outputs and gradients (the pool stops early
   enough to leave these two their share of the time, ``heavy_reserve``);
2. optionally (``--sweep``) times alternative launch options of linmem's kernels on RDN, RLA and GDN at the timed
   widths (``--head-dim``, ``--value-dim``) and keeps, per kernel, the one with the smallest sum; it prints the
   row of ``KERNEL_OPTIONS`` (linmem.ops.triton.function, one row per width class) to paste, e.g.
   ``--sweep --heads 8 --head-dim 256`` for GDN-1.3B's heads or ``--head-dim 128 --value-dim 256`` for GLA-340M's;
   ``--swept`` times fewer methods and ``--sweep-kernels`` (e.g. ``backward_states``) one kernel's variants only,
   for a sweep that fits a short budget; ``--sweep-at B,T`` the shape it times (default one sequence of
   ``--tokens``, at most 32K); the winners are checked against float64 again, as in 1;
3. times forward and forward+backward (``triton.testing.do_bench`` medians) at ``--tokens`` tokens per batch, H = 16,
   head dim 128 (``--heads``, ``--head-dim``, ``--value-dim``), bf16: linmem RLA/RDN (and its own sGLA/GDN,
   ``residual=False``), FLA ``chunk_simple_gla``, ``chunk_gated_delta_rule`` and ``chunk_gla``, causal SDPA flash
   attention, and RLA/RDN composed from three FLA calls (queries shifted one step give ``S_{t−1}k_t`` and
   ``S_{t−1}q_t``; a third call runs the residual memory); on request (``--methods``) FLA's sGLA and GDN at twice
   the value width, the state work of two memories; ``--rounds N`` times the methods N times at each length, the
   order reversed every other round (ABBA), so that the machine's drift between timings falls on every method alike:
   each cell is the median of the rounds, and the report adds each round's A / B ratios, paired within the round;
4. optionally (``--profile``), with what is left of the budget (none under ``PROFILE_MIN_SECONDS``), profiles
   forward+backward of ``--profile-methods`` at each (B, T) it timed, ``--profile-repeats`` steps each
   (torch.profiler): the longest kernels' times and the GPU busy time, the sum of every kernel's device time, as
   medians over the steps. ``do_bench`` counts the host's gaps between launches too; the busy times, with the same
   A / B ratios, show what the kernels alone take, and a line warns at each length where a method's wall time exceeds
   its busy time by ``kernel_report.HOST_BOUND_MARGIN`` or more (a host-bound machine: compare by the busy ratios);
5. writes ``kernels.json``, ``kernels.md`` and ``kernels.png`` under ``--out``, with GPU, torch and triton versions
   and the ratios of the linmem / FLA pairs it timed (``kernel_report.RATIOS``), and ends its output with a short
   table of those ratios at every length (RDN / GDN and RLA / sGLA against the 1.5x goal), by ``do_bench`` and, when
   profiled, by GPU busy time.

``--render`` writes kernels.md and kernels.png again from an existing kernels.json, on any machine.

``--budget`` (seconds, default 480) bounds the whole run: compiles and checks get 60% of it, the sweep is skipped and
lengths are dropped (in ``--lengths`` order, the last first) when time runs short, a method's timing, its compiles
and autotune included, is stopped when the budget is spent (it gets at least ``MIN_METHOD_SECONDS``), and the
profiles get what the timings leave; whatever was measured is written after every method and profile. Without
CUDA it runs in Triton's CPU interpreter at the shapes given (``--lengths 128 --tokens 256 --heads 2 --head-dim
32``): a dry run of the whole flow.

FLA 0.6.0 refuses its gated backward on Triton < 3.7.1 on Hopper (its issue #640); for timing only, this script sets
``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True``. linmem's own kernels are checked on the Triton that runs here.

This module holds the method table, the timing, the compile and check workers, the sweep and the run, and the
settings a run changes (the timed shape, the swept methods); its siblings take what they need of those as arguments:
``kernel_checks`` the inputs and the float64 checks, ``kernel_profile`` the profiler's helpers, ``kernel_report`` the
pages, the summary and the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from linmem.bench import environment, kernel_checks, kernel_profile, kernel_report

DEFAULT_SHAPE = (16, 128)  # heads, head dim timed unless --heads / --head-dim say otherwise
HEADS, HEAD_DIM = DEFAULT_SHAPE
VALUE_DIM = HEAD_DIM  # the value width (--value-dim; the head dim unless it says otherwise)
MIN_METHOD_SECONDS = 20.0  # a method timed when the budget is nearly spent still gets this long
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (Triton interpreter) only for a dry run


# ------------------------------------------------------------------------------------------------ methods timed


def linmem_method(rule: str, residual: bool, decay: str = "g"):
    """linmem's op on the Triton backend; ``decay="g_key"``: GLA's per-key-channel decay (FLA GLA's inputs). Timed as
    a model's training step calls it: without the gates' value check (``check_values=False``; a mixer asks for it only
    where a hook could have written the gates), whose read-back is a host synchronisation per call that FLA's
    functions do not make."""

    def run(x):
        from linmem.ops import linear_memory

        o, _ = linear_memory(x["q"], x["k"], x["v"], x[decay], x["beta"], x["gamma"] if residual else None, rule=rule,
                             residual=residual, backend="triton", check_values=False)
        return o

    return run


def fla_method(name: str, values: str = "v"):
    """FLA's kernel ``name`` on the inputs' ``values`` (``v_wide``: twice the value width, the state work of two
    memories such as RLA's or RDN's)."""

    def run(x):
        if name == "sgla":
            from fla.ops.simple_gla import chunk_simple_gla

            return chunk_simple_gla(x["q"], x["k"], x[values], g=x["g"])[0]
        if name == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            return chunk_gated_delta_rule(x["q"], x["k"], x[values], x["g"], x["beta_h"])[0]
        from fla.ops.gla import chunk_gla

        return chunk_gla(x["q"], x["k"], x["v"], x["g_key"])[0]

    return run


def fla_three_calls(rule: str):
    """RLA/RDN from three FLA calls: base memory read with keys then queries shifted one step, then the residual
    memory on the clipped error (exact; the composition of issue 3)."""

    def run(x):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla

        q, k, v, g = x["q"], x["k"], x["v"], x["g"]
        scale = q.shape[-1] ** -0.5

        def call(queries, values, strength):
            if rule == "additive":
                return chunk_simple_gla(queries, k, values * strength[..., None], g=g, scale=1.0)[0]
            return chunk_gated_delta_rule(queries, k, values, g, strength, scale=1.0)[0]

        def next_(t):
            return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)

        def prev(t):
            return torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1)

        predicted = prev(call(next_(k), v, x["beta_h"]))  # S_{t−1} k_t
        base_read = prev(call(next_(q), v, x["beta_h"]))  # S_{t−1} q_t
        target = (v - predicted).clamp(-1.0, 1.0)
        residual_read = call(q, target, x["gamma_h"])  # R_t q_t
        return scale * (g.exp()[..., None] * base_read + x["gamma_h"][..., None] * residual_read)

    return run


def sdpa_method(x):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.transpose(1, 2) for t in (x["q"], x["k"], x["v"]))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


METHODS = {
    "linmem RLA": linmem_method("additive", True),
    "linmem RDN": linmem_method("delta", True),
    "linmem sGLA": linmem_method("additive", False),
    "linmem GDN": linmem_method("delta", False),
    "linmem GLA": linmem_method("additive", False, decay="g_key"),
    "FLA sGLA": fla_method("sgla"),
    "FLA GDN": fla_method("gdn"),
    "FLA GLA": fla_method("gla"),
    "SDPA flash": sdpa_method,
    "FLA 3-call RLA": fla_three_calls("additive"),
    "FLA 3-call RDN": fla_three_calls("delta"),
    # not timed unless asked for (``--methods``): FLA autotunes afresh for the wider values, minutes on an H200
    "FLA sGLA 2V": fla_method("sgla", "v_wide"),
    "FLA GDN 2V": fla_method("gdn", "v_wide"),
}
DEFAULT_METHODS = [name for name in METHODS if not name.endswith(" 2V")]
# linmem's methods on the chunked kernels (``linmem.ops.triton.function``; GLA's per-key decay has its own kernels)
CHUNKED_METHODS = ["linmem RLA", "linmem RDN", "linmem sGLA", "linmem GDN"]
# the FLA kernels each FLA method runs: warming a method compiles and autotunes these
FLA_KERNELS_OF = {"FLA sGLA": ["FLA sGLA"], "FLA GDN": ["FLA GDN"], "FLA GLA": ["FLA GLA"],
                  "FLA 3-call RLA": ["FLA sGLA"], "FLA 3-call RDN": ["FLA GDN"]}


def bench_inputs(B, T, seed=0, wide=False):
    """The timed inputs: q, k, v ``[B, T, H, d]`` in bf16 and the gates; ``wide`` adds ``v_wide [B, T, H, 2d]`` for
    the " 2V" methods."""
    x = kernel_checks.random_inputs(B, T, HEADS, HEAD_DIM, VALUE_DIM, torch.bfloat16, DEVICE, seed)
    x["g"] = x["g"] * 0.3  # log decay ≥ −0.09 per token
    x["beta_h"], x["gamma_h"] = x["beta"].bfloat16(), x["gamma"].bfloat16()
    x["g_key"] = -0.05 * torch.rand(B, T, HEADS, HEAD_DIM, device=DEVICE)
    if wide:
        x["v_wide"] = torch.cat([x["v"], x["v"].flip(-1)], dim=-1)
    for name in ("S0", "R0"):
        del x[name]
    return x


def _median_ms(fn, grad_to_none=None) -> float:
    if DEVICE == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
    times = []
    for _ in range(3):  # dry run on the CPU: wall clock
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[1]


class OverBudget(BaseException):
    """Raised into a method's timing when the run's budget is spent. A ``BaseException``, as ``KeyboardInterrupt``
    is, so that no ``except Exception`` inside an autotuner swallows it."""


@contextmanager
def time_limit(seconds: float):
    """Raise ``OverBudget`` in the code inside after ``seconds`` (a ``SIGALRM`` timer). Python runs the handler
    between bytecodes, so a long compile or autotune (many short calls into Triton) is stopped within about one
    of its compiles. Without ``setitimer`` or off the main thread, no limit."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise OverBudget(f"stopped after {seconds:.0f} s: the time budget is spent")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def time_method(fn, x, backward: bool) -> float:
    if not backward:
        with torch.no_grad():
            return _median_ms(lambda: fn(x))
    leaves = kernel_checks.grad_leaves(x)
    o = fn(leaves)
    d_o = torch.randn_like(o)

    def step():
        fn(leaves).backward(d_o)

    return _median_ms(step, grad_to_none=list(leaves.values()))


def finite_at_length(B, T) -> dict:
    """RLA and RDN forward+backward at this length: are the output and every gradient finite?"""
    out = {}
    for name in ("linmem RLA", "linmem RDN"):
        leaves = kernel_checks.grad_leaves(bench_inputs(B, T, seed=5))
        o = METHODS[name](leaves)
        o.backward(torch.randn_like(o))
        grads = [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "gamma")]
        out[name] = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
        del leaves, o, grads
    return dict(T=T, B=B, finite=out, passed=all(out.values()))


# ------------------------------------------------------------------------------------------------ compile workers


def _worker(numbered_task):
    index, (kind, payload) = numbered_task
    return index, _run_task(kind, payload)


def _run_task(kind, task):
    if os.environ.get("LINMEM_BENCH_SHAPE"):
        _set_shape(*(int(x) for x in os.environ["LINMEM_BENCH_SHAPE"].split(",")))
    # launch options to run with instead of those of KERNEL_OPTIONS' row at the timed widths
    kernel_options = task.get("kernel_options")
    payload = {key: value for key, value in task.items() if key != "kernel_options"}
    if kernel_options:
        from linmem.ops.triton import function

        function.kernel_options(HEAD_DIM, VALUE_DIM).update(kernel_options)
    try:
        import fla.ops.common.chunk_o as fla_chunk_o

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
    except Exception:  # noqa: BLE001 (FLA absent: its methods fail later, with their error recorded)
        pass
    try:
        if kind in ("check", "offsets", "finite"):
            result = (kernel_checks.run_check(payload, DEVICE) if kind == "check"
                      else kernel_checks.offsets_check(DEVICE, **payload) if kind == "offsets"
                      else finite_at_length(**payload))
            if kernel_options:
                row = function.kernel_options(HEAD_DIM, VALUE_DIM)
                result["kernel_options"] = {name: row[name] for name in kernel_options}
            return kind, result
        fn = METHODS[payload["method"]]
        # linmem's sequential passes pick their value block by the number of sequences (one long sequence and many
        # short ones compile different variants): warm both
        for batch in [payload["B"]] if "B" in payload else [1, 64]:
            o = fn(kernel_checks.grad_leaves(bench_inputs(batch, payload.get("T", 2048) if batch == 1 else 128)))
            o.float().sum().backward()
        kernel_profile.synchronize(DEVICE)
        return kind, dict(task=task, ok=True)
    except Exception as exc:  # noqa: BLE001
        failed = dict(task=task, ok=False, error=f"{type(exc).__name__}: {exc}",
                      trace=traceback.format_exc()[-2000:])
        if kind in ("check", "offsets", "finite"):
            name = kernel_checks.case_name(payload) if kind == "check" else f"{kind} {payload}"
            failed.update(case=name, errors={}, worst=math.inf, passed=False)
        return kind, failed


def warm_tasks(methods: list[str], sweep_variants: list[dict]) -> list[tuple[str, dict]]:
    """The compile tasks that warm Triton's cache for ``methods`` before they are timed: linmem's Triton methods
    (``SWEPT``'s under every sweep variant as well, when there is a sweep, which times them whatever is asked),
    and each FLA kernel an FLA method runs, at B = 2, T = 8K, for its autotune's candidates (FLA's autotune keys do
    not hold the length; the results are not kept, the compiled candidates are)."""
    tasks = []
    tuned = SWEPT if sweep_variants else ()
    for method in [m for m in METHODS if m.startswith("linmem ") and (m in methods or m in tuned)]:
        tasks.append(("compile", dict(method=method)))
        if method in tuned:
            tasks += [("compile", dict(method=method, kernel_options=variant)) for variant in sweep_variants]
    kernels = {kernel for method in methods for kernel in FLA_KERNELS_OF.get(method, [])}
    tasks += [("compile", dict(method=kernel, B=2, T=8192)) for kernel in FLA_KERNELS_OF if kernel in kernels]
    return tasks


def correctness_tasks(quick: bool, lengths: list[int], tokens: int) -> list[tuple[str, dict]]:
    """The float64 checks, the 64-bit offsets check and the finiteness check at the longest length."""
    tasks = [("check", c) for c in kernel_checks.check_cases(quick, DEVICE, HEAD_DIM, VALUE_DIM)]
    if DEVICE == "cuda":
        tasks.append(("offsets", {}))
    else:  # dry run: the same code at a tiny shape
        tasks.append(("offsets", dict(batch=2, length=70, heads=1, dim=16)))
    longest = max(lengths)
    tasks.append(("finite", dict(B=max(1, tokens // longest), T=longest)))
    return tasks


# the correctness tasks that need the GPU to themselves: the 64-bit offsets check allocates ~60 GB, and the
# finiteness check runs the longest timed length; beside the pool's workers they run out of memory
HEAVY_TASKS = ("offsets", "finite")
# what one heavy task is given out of a caller's deadline: a fresh process (10-20 s to import torch and start CUDA),
# its kernels compiled from Triton's disk cache the pool filled, and two forward+backward passes of a few seconds
# each; 60 s covers that with room to spare
HEAVY_TASK_SECONDS = 60.0


def heavy_reserve(heavy: int, seconds_left: float) -> float:
    """The seconds kept back from the parallel pool for ``heavy`` serial tasks, when ``seconds_left`` remain before
    the deadline: ``HEAVY_TASK_SECONDS`` each, but never more than half of what is left, so that a short deadline
    still leaves the float64 checks and the compiles as long as the heavy tasks get. The pool stops at the
    deadline less this; the heavy tasks then start as soon as the pool is done, and may run to the deadline."""
    return min(heavy * HEAVY_TASK_SECONDS, 0.5 * max(0.0, seconds_left)) if heavy else 0.0


def run_tasks(tasks: list[tuple[str, dict]], workers: int, deadline: float | None, record, worker=_worker) -> set:
    """Run ``tasks`` (kind, payload) in spawned processes, one task per process (a CUDA fault poisons its process's
    context and must not fail later tasks): the ``HEAVY_TASKS`` after all the others, one at a time, each with the
    device to itself; the others in a pool of ``workers`` processes that stops ``heavy_reserve`` seconds before
    ``deadline`` (``time.time()``). A task still running at its stop is killed (the pool's exit terminates its
    workers). ``record(index, kind, result)`` gets each result as it comes; ``worker`` (a picklable function of
    ``(index, (kind, payload))``) runs a task. Returns the indexes of the tasks that finished."""
    numbered = list(enumerate(tasks))
    light = [task for task in numbered if task[1][0] not in HEAVY_TASKS]
    heavy = [task for task in numbered if task[1][0] in HEAVY_TASKS]
    pool_deadline = None
    if deadline is not None:
        pool_deadline = deadline - heavy_reserve(len(heavy), deadline - time.time())
    done = _run_pool(light, workers, pool_deadline, record, worker)
    for task in heavy:  # each in a pool of its own: a fresh process, alone on the device
        if deadline is not None and time.time() >= deadline:
            break
        done |= _run_pool([task], 1, deadline, record, worker)
    return done


def _run_pool(numbered: list, workers: int, deadline: float | None, record, worker) -> set:
    done = set()
    if not numbered:
        return done
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(numbered)), maxtasksperchild=1) as pool:
        pending = pool.imap_unordered(worker, numbered)
        for _ in numbered:
            wait = None if deadline is None else max(0.0, deadline - time.time())
            try:
                index, (kind, result) = pending.next(timeout=wait)
            except mp.TimeoutError:
                break
            done.add(index)
            record(index, kind, result)
    return done


def warm_and_check(sweep_variants, workers: int, skip_check: bool, quick: bool = False,
                   lengths: tuple[int, ...] = (131072,), tokens: int = 131072, deadline: float | None = None,
                   kernel_options: dict | None = None, methods: list[str] | None = None, worker=_worker):
    """Run the correctness tasks and compile the kernels of ``methods`` (default: every default method; with
    ``sweep_variants``, RDN's and RLA's under each variant too) in parallel processes, then the offsets and
    finiteness checks one at a time (``run_tasks``), until ``deadline`` (``time.time()``); return the correctness
    results (checks, offsets, finite, what did not finish) and the compile failures. With ``kernel_options``
    (kernel name → launch options, e.g. a sweep's winners): only the correctness tasks, run with those options
    instead of the defaults."""
    tasks = [] if skip_check else correctness_tasks(quick, list(lengths), tokens)
    if kernel_options:
        tasks = [(kind, dict(payload, kernel_options=kernel_options)) for kind, payload in tasks]
    if DEVICE == "cuda" and not kernel_options:
        tasks += warm_tasks(DEFAULT_METHODS if methods is None else methods, sweep_variants)
    results = dict(checks=[], offsets=None, finite=None, unfinished=[])
    failures = []

    def record(index, kind, result):
        if kind in ("check", *HEAVY_TASKS):
            if kind == "check":
                results["checks"].append(result)
            else:
                results[kind] = result
            # a check that raised (out of memory, say) did not run: not a wrong result
            status = "ok  " if result["passed"] else "ERR " if "error" in result else "FAIL"
            label = result.get("case") or f"finite at T={result.get('T')}: {result.get('finite')}"
            worst = f" worst={result['worst']:.1e}" if "worst" in result else ""
            print(f"{kind} {status}{worst}  {label}", flush=True)
            if "error" in result:
                print(f"  {result['error']}\n{result['trace']}", flush=True)
        elif not result["ok"]:
            failures.append(result)
            print(f"compile FAILED {result['task']}: {result['error']}\n{result['trace']}", flush=True)

    done = run_tasks(tasks, workers, deadline, record, worker)
    for index, (kind, payload) in enumerate(tasks):
        if index not in done:  # stopped at the deadline, or not started before it
            results["unfinished"].append(f"{kind} {kernel_checks.case_name(payload) if kind == 'check' else payload}")
    if results["unfinished"]:
        print(f"not finished within the time budget: {results['unfinished']}", flush=True)
    return results, failures


# ------------------------------------------------------------------------------------------------ launch options


# the methods a sweep times, each forward+backward: a kernel keeps the variant with the smallest sum of their times
SWEPT = ("linmem RDN", "linmem RLA", "linmem GDN")


# the state passes' own launch options, all off (a candidate's launch | these | the ones it turns on)
FORWARD_OFF = dict(KEYS_ONCE=False, FUSED=False, PIPELINED=False, PREFORMED=False)
REVERSE_OFF = dict(KEYS_ONCE=False, ONE_KEY_BLOCK=False, FUSED=False, PREFORMED=False)


def sweep_variants(key_dim: int = 128, value_dim: int = 128) -> list[dict]:
    """One kernel's launch options changed at a time from their row of ``KERNEL_OPTIONS`` in
    linmem.ops.triton.function at these widths (the offline sm_90 compiles say which of them spill: ``--profile``);
    with K or V over 128, the wide candidates as well (``wide_variants``). Every variant computes the same thing to
    within the checked tolerances: the inverse's PRECISION variants are at least as exact as the default (tf32 for
    16-bit inputs)."""
    from linmem.ops.triton import function

    sequential = [dict(num_warps=4, num_stages=1, BV=16),
                  dict(num_warps=4, num_stages=1, BV=32),
                  dict(num_warps=8, num_stages=None, BV=None),  # BV=None: function._sequential_block
                  dict(num_warps=4, num_stages=1, BV=None)]  # one stage
    inverse = [dict(num_warps=1, num_stages=1, PRECISION=p) for p in ("ieee", "tf32x3")]
    inverse += [dict(num_warps=2, num_stages=1, PRECISION=None)]  # two warps
    # the reverse passes: the same, and (where BV=None picks 64: N·H·V/64 programs fill half the GPU) 32, or 64 at
    # 8 warps; KEYS_ONCE loads each key tile once per chunk for both of its products (less shared memory at two
    # stages, more registers at one); ONE_KEY_BLOCK holds dSᵀ as one [K, BV] tile (one dot per product and chunk)
    reverse = [o | REVERSE_OFF for o in sequential]
    reverse += [dict(num_warps=None, num_stages=None, BV=32) | REVERSE_OFF,
                dict(num_warps=8, num_stages=None, BV=64) | REVERSE_OFF,
                dict(num_warps=None, num_stages=None, BV=None) | REVERSE_OFF | dict(KEYS_ONCE=True),
                dict(num_warps=8, num_stages=None, BV=None) | REVERSE_OFF | dict(ONE_KEY_BLOCK=True)]
    # the forward's state passes: the same, and KEYS_ONCE (each key tile loaded once for the read and the update) at
    # the row's own options
    row = function.kernel_options(key_dim, value_dim)
    forward = [o | FORWARD_OFF for o in sequential]
    forward += [dict(row["forward"], KEYS_ONCE=True)]
    # an RLA/RDN's two memories in one pass (FUSED: both states held, the key blocks loaded once for both) with half
    # the row's value block (the same registers for two states as for one), and at K <= 128 at the row's own too
    # (offline sm_90, RDN bf16: at K = 256 only BV 16 in three stages holds both without spilling, 192 KB of shared
    # memory; BV 32 spills 288-432 bytes per thread; at K = 128, BV 32 in two stages spills 56)
    fused = dict(row["forward"], FUSED=True)
    forward += [dict(fused, BV=max(16, (fused["BV"] or 32) // 2))] + ([fused] if key_dim <= 128 else [])
    # the two passes in one launch, the residual memory's programs PIPELINED_GROUP chunks behind the base memory's
    # (PIPELINED: one state per program, the row's own value block), and at K = 256 at BV 16 in two stages, where a
    # base and a residual program fit one SM together (offline sm_90, RDN bf16, K = V = 256: 108.5 KB of shared memory
    # and 226 registers each, no spill; the row's BV 32 in three stages takes 173 KB, one program per SM); at K <= 128
    # the row's BV None already picks 16 or 32 per call, two stages the default there
    forward += [dict(row["forward"], PIPELINED=True)]
    forward += [dict(row["forward"], PIPELINED=True, BV=16, num_stages=2)] if key_dim > 128 else []
    # the delta writes' state-free products formed in parallel kernels before each chain (PREFORMED: the chain one
    # read and one update, as FLA's state pass), at BV 64 with 8 warps in two stages (offline sm_90, RDN bf16,
    # K = V = 256: 244 registers, no spill, 184 KB of shared memory). On an H100 at K = V = 256 its chains took 14%
    # less than the row's forming passes, its forming kernels more than that saved (GDN + RDN +13.8%); the row's
    # launch in two stages (+21%) and BV 64 in one stage (+36.5%) lost more (docs/benchmarks/kernel-widths.md)
    forward += [dict(row["forward"], PREFORMED=True, BV=64, KEYS_ONCE=False, num_warps=8, num_stages=2)]
    # their two reverse passes in one program (FUSED: the base memory's chunk beside the residual memory's next one,
    # two chains that do not wait on each other, both dSᵀ held). Pipelined, its loop loads two chunks' tiles: offline
    # (sm_90, RDN bf16) two stages take 284 KB of shared memory at K = 128 and 352-480 KB at K = 256 for any value
    # block, so it runs in one stage; at K = 128, BV 16 holds both states without spilling (BV 32 spills 192 B); at
    # K = 256 every variant spills, least (112 B) at BV 16 with 4 warps and the key tiles loaded per product
    fused = dict(row["backward_states"], FUSED=True, num_stages=1, BV=16, num_warps=4)
    reverse += [fused if key_dim <= 128 else dict(fused, KEYS_ONCE=False)]
    # each memory's W formed before the reverse passes (PREFORMED: the chain the read K dSᵀ and the update Wᵀ du, as
    # FLA's reverse state pass; dx = T_σᵀ du after it), in one stage at the row's value block (offline sm_90, RDN
    # bf16, K = V = 256, BV 32: 190-248 registers, no spill, 24-28 KB of shared memory; two stages ask for 232-316 KB
    # with or without KEYS_ONCE, and BV 64 spills 288-672 bytes per thread at 4 or 8 warps). On an H100 at
    # K = V = 256 the one stage cost its chains 38% (GDN + RDN +15.0%; at BV 16 +37.1%)
    reverse += [dict(row["backward_states"], PREFORMED=True, KEYS_ONCE=False, num_stages=1)]
    variants = ([{"forward": o} for o in forward] + [{"backward_states": o} for o in reverse]
                + [{"inverse": o} for o in inverse]
                + [{"scores": dict(num_warps=2, num_stages=1)}]
                + [{"output": dict(num_warps=4, num_stages=1, BV=64)},
                   {"output": dict(num_warps=4, num_stages=1, BV=128)},
                   {"output": dict(num_warps=8, num_stages=1, BV=128)}]
                + [{"backward_scores": dict(num_warps=8, num_stages=1, BV=64)},
                   {"backward_scores": dict(num_warps=4, num_stages=None, BV=64)},
                   {"backward_scores": dict(num_warps=8, num_stages=None, BV=32)},
                   {"backward_scores": dict(num_warps=8, num_stages=None, BV=128)}]
                # dk and dq in one launch (five [64, BK] accumulators; offline, bf16 K = 128 RDN spills 392 bytes per
                # thread, against 16 and 0 in two launches)
                + [{"backward_keys": dict(num_warps=4, num_stages=None, BV=64, BK=None, SPLIT=False)},
                   {"backward_keys": dict(num_warps=8, num_stages=None, BV=64, BK=None, SPLIT=False)},
                   {"backward_keys": dict(num_warps=8, num_stages=None, BV=64, BK=None, SPLIT=True)},
                   {"backward_keys": dict(num_warps=4, num_stages=None, BV=32, BK=None, SPLIT=True)},
                   # every key in one program: the token tiles read once per chunk, not once per 64 keys
                   {"backward_keys": dict(num_warps=8, num_stages=None, BV=64, BK=128, SPLIT=True)}]
                + [{"decay_grad": dict(num_warps=w, num_stages=1)} for w in (1, 4)])
    if max(key_dim, value_dim) > 128:
        variants += wide_variants(key_dim)
    # a row that moved a kernel away from TUNED_AT_128 keeps those options among the candidates, so that a later
    # sweep (another shape, another GPU) can move it back: e.g. the scores' 2 warps at K = 256, chosen within noise,
    # spill 368-448 bytes per thread offline where 4 warps spill none
    variants += [{name: dict(options)} for name, options in function.TUNED_AT_128.items()
                 if name != "recompute_states"]
    # every other recompute_states (all passes, the base memory's only, all from the kept writes, none): timed and
    # reported, never chosen (tune)
    variants += [{"recompute_states": choice} for choice in function.RECOMPUTE_CHOICES
                 if choice != row["recompute_states"]]
    kept, seen = [], set()
    for variant in variants:  # neither the row's own launch nor one launch twice
        ((name, options),) = variant.items()
        key = (name, launch_key(options, key_dim))
        if key != (name, launch_key(row[name], key_dim)) and key not in seen:
            seen.add(key)
            kept.append(variant)
    return kept


def _option_values(text: str) -> dict[str, set[str]]:
    """``--sweep-only``'s ``NAME=VALUE,...`` as {name: the value texts given for it}."""
    pairs = [item.partition("=") for item in text.split(",")]
    if not text or any(not name.strip() or not sep or not value.strip() for name, sep, value in pairs):
        raise ValueError(f"a comma list of NAME=VALUE; got {text!r}")
    wanted: dict[str, set[str]] = {}
    for name, _, value in pairs:
        wanted.setdefault(name.strip(), set()).add(value.strip())
    return wanted


def variant_sets(variant: dict, wanted: dict[str, set[str]]) -> bool:
    """Whether a ``sweep_variants`` entry sets one of ``wanted``'s options (a kernel's launch option, or
    ``recompute_states``) to one of its values, compared as text (``FUSED=True``, ``BV=16``,
    ``recompute_states=base``)."""
    ((name, options),) = variant.items()
    settings = options if isinstance(options, dict) else {name: options}
    return any(key in settings and str(settings[key]) in values for key, values in wanted.items())


def launch_key(options, key_dim: int) -> str:
    """``options`` (one kernel's entry of a ``KERNEL_OPTIONS`` row, or ``recompute_states``'s bool) as the launch the
    timed bf16 inputs get: ``num_warps`` None is 4 and ``num_stages`` None the row's pipeline depth at this key width
    (``function._pipeline_stages``), and a switch set False is the same as one not named, so that two spellings of one
    launch are timed once."""
    from linmem.ops.triton import function

    if not isinstance(options, dict):
        return repr(options)
    resolved = {name: value for name, value in options.items() if value is not False}  # an option off = not named
    if resolved.get("num_warps", 0) is None:
        resolved["num_warps"] = 4
    if resolved.get("num_stages", 0) is None:
        resolved["num_stages"] = function._pipeline_stages(key_dim, torch.bfloat16)
    return repr(sorted(resolved.items()))


def wide_variants(key_dim: int) -> list[dict]:
    """Candidates for heads with K or V over 128, whose row started from the K = 128 sweep (value blocks of 16 in
    the sequential passes and one stage at K > 128, ``function._sequential_block`` and ``_pipeline_stages``): value
    blocks of 32 and 64, 4 or 8 warps, one or two stages, for the sequential passes, the read-out and the backward
    kernels. The reverse pass at K > 128 gets two stages only with KEYS_ONCE (BV 16 and 32; with ONE_KEY_BLOCK at 8
    warps): without it two asked for 237–277 KiB of shared memory at K = 256 (the limit is 227 KiB). The forward's
    state pass at K > 128 also gets KEYS_ONCE at BV = 32 in three or four stages, or two at 8 warps: the settings
    that fit without spills in the offline compiles of docs/benchmarks/kernel-widths.md (BV = 64 spills with it),
    and at BV = 16 in two or three stages (two programs per SM at two).
    A variant that does not compile is reported and not chosen."""
    grid = [(bv, warps, stages) for bv in (32, 64) for warps in (4, 8) for stages in (1, 2)]
    reverse_stages = (1,) if key_dim > 128 else (1, 2)
    keys_once = []
    if key_dim > 128:
        keys_once = [(bv, warps, False) for bv in (16, 32) for warps in (4, 8)] + [(16, 8, True), (32, 8, True)]
    reverse = [dict(num_warps=w, num_stages=st, BV=bv) | REVERSE_OFF for bv, w, st in grid if st in reverse_stages]
    reverse += [dict(num_warps=w, num_stages=2, BV=bv) | REVERSE_OFF | dict(KEYS_ONCE=True, ONE_KEY_BLOCK=one)
                for bv, w, one in keys_once]
    forward = [dict(num_warps=w, num_stages=st, BV=bv) | FORWARD_OFF for bv, w, st in grid]
    if key_dim > 128:
        forward += [dict(num_warps=w, num_stages=st, BV=32) | FORWARD_OFF | dict(KEYS_ONCE=True)
                    for w, st in ((4, 3), (4, 4), (8, 2), (8, 3))]
        # BV 16: twice the programs, and at two stages two of them fit on one SM (offline at K = 256: 92.5-108.5 KiB
        # of shared memory and 145-193 registers each, where BV 32 at three stages takes 149-173 KiB, one per SM),
        # so that one program's loads and dots can overlap the other's on a loop that waits for each dot
        forward += [dict(num_warps=4, num_stages=st, BV=16) | FORWARD_OFF | dict(KEYS_ONCE=True) for st in (2, 3)]
    return ([{"forward": o} for o in forward]
            + [{"backward_states": o} for o in reverse]
            + [{"output": dict(num_warps=w, num_stages=st, BV=bv)} for bv, w, st in grid]
            + [{"backward_scores": dict(num_warps=w, num_stages=st, BV=bv)} for bv, w, st in grid]
            + [{"backward_keys": dict(num_warps=w, num_stages=st, BV=bv, BK=None, SPLIT=True)}
               for bv, w, st in grid])


SWEEP_MARGIN = 0.02  # a variant replaces the row's options only if it beats the default timed beside it by this
SWEEP_METRICS = ("wall", "busy")  # tune's measure: do_bench's wall time of a call, or its kernels' GPU time
SWEEP_BUSY_REPEATS = 5  # calls per busy time, profiled in one session


def tune(variants, B, T, deadline: float | None = None, metric: str = "wall") -> dict:
    """Time ``SWEPT`` forward+backward with each variant at the timed widths; keep, per kernel, the variant with the
    smallest time relative to the default (the kernels are specialised per rule, and a change can help one rule and
    cost another: the sum over ``SWEPT`` decides). Each variant is timed next to a fresh timing of the default, the
    two in alternating order from one variant to the next, and judged by the ratio of the pair: a GPU whose speed
    drifts over minutes (clocks, other tenants) moves both sides of a pair alike, where a single timing of the default
    at the start would be compared with variants timed minutes later. A variant is kept only if its pair's ratio is
    below ``1 - SWEEP_MARGIN``, so that noise alone does not move a row. ``recompute_states`` is timed and its saving
    printed, but the row's own value is kept: it trades time for memory, a choice the times alone do not make.
    Variants left when ``deadline`` (``time.time()``) has passed are not timed (listed). ``metric`` "wall" times each
    call with ``time_method`` (``do_bench``); "busy" takes the kernels' own GPU time (``kernel_profile.busy_ms``),
    which leaves out the host's launches between them: at a training micro-batch (B = 4, T = 2048) one call's wall
    time is mostly host and scatters by ±20% from pair to pair, while a model step hides those gaps behind its later
    layers.
    Changes, and returns, the row of ``KERNEL_OPTIONS`` at these widths."""
    from linmem.ops.triton import function

    if metric not in SWEEP_METRICS:
        raise ValueError(f"metric must be one of {SWEEP_METRICS}; got {metric!r}")
    row = function.kernel_options(HEAD_DIM, VALUE_DIM)
    default = dict(row)
    x = bench_inputs(B, T)
    print(f"sweep: recompute_states leaves {saved_states_text(B, T)} for the backward (the forward's state "
          "passes, run again there)", flush=True)

    def total(options: dict) -> tuple[float, str]:
        row.clear()
        row.update(options)
        try:
            times = [time_method(METHODS[name], x, True) if metric == "wall"
                     else kernel_profile.busy_ms(METHODS[name], x, SWEEP_BUSY_REPEATS, DEVICE) for name in SWEPT]
        finally:
            row.clear()
            row.update(default)
        return sum(times), " + ".join(f"{name.removeprefix('linmem ')} {ms:.2f}" for name, ms in zip(SWEPT, times))

    base_ms, shown = total(default)
    busy = "the kernels' GPU time" if DEVICE == "cuda" else "the ops' own CPU time (dry run)"
    measured = "wall time" if metric == "wall" else f"{busy} (busy)"
    print(f"sweep: default fwd+bwd {shown} = {base_ms:.2f} ms at B={B} T={T}, {measured}; each variant below is "
          f"timed next to the default again (the pair in alternating order) and kept only {SWEEP_MARGIN:.0%} or more "
          "below it", flush=True)
    best = {name: (1.0 - SWEEP_MARGIN, opts) for name, opts in default.items()}
    for index, variant in enumerate(variants):
        if deadline is not None and time.time() > deadline:
            print(f"sweep: the time budget is spent; not timed: {variants[index:]}", flush=True)
            break
        try:
            if index % 2:
                (ms, shown), (base_ms, _) = total(dict(default, **variant)), total(default)
            else:
                (base_ms, _), (ms, shown) = total(default), total(dict(default, **variant))
        except Exception as exc:  # noqa: BLE001 (a variant that does not run is not chosen)
            ms, shown = math.inf, "failed"
            print(f"sweep: {variant}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        (name, opts), = variant.items()
        ratio = ms / base_ms
        print(f"sweep: {name} {opts}: {shown} = {ms:.2f} ms against the default's {base_ms:.2f} beside it "
              f"({ratio - 1:+.1%})", flush=True)
        if name == "recompute_states" and DEVICE == "cuda":
            print(f"sweep: peak memory of one fwd+bwd with recompute_states {opts!r}: "
                  f"{peak_memory_text(x, dict(default, **variant))}; the row's {default[name]!r}: "
                  f"{peak_memory_text(x, default)}", flush=True)
        if ratio < best[name][0] and name != "recompute_states":
            best[name] = (ratio, opts)
    chosen = {name: opts for name, (_, opts) in best.items()}
    row.update(chosen)
    return chosen


def peak_memory_text(x: dict, row: dict | None = None) -> str:
    """The CUDA memory each of ``SWEPT`` allocates at its peak over one forward+backward on ``x`` (above what was
    allocated before), with ``row`` as the launch options of the timed widths if given."""
    from linmem.ops.triton import function

    current = function.kernel_options(HEAD_DIM, VALUE_DIM)
    saved = dict(current)
    current.update(row or {})
    parts = []
    try:
        for name in SWEPT:
            leaves = kernel_checks.grad_leaves(x)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            o = METHODS[name](leaves)
            o.backward(torch.ones_like(o))
            torch.cuda.synchronize()
            parts.append(f"{name.removeprefix('linmem ')} {(torch.cuda.max_memory_allocated() - before) / 2**20:.0f} "
                         "MiB")
            del leaves, o
    finally:
        current.clear()
        current.update(saved)
    return ", ".join(parts)


def saved_states_text(B: int, T: int) -> str:
    """What ``recompute_states`` does not keep between the forward and the backward of each swept memory at
    ``B × T`` tokens and the timed heads, and for a residual memory what "base" does not keep
    (``function.recomputed_bytes`` of a forward on meta tensors: the shapes without the work)."""
    from linmem.ops.config import MemoryConfig
    from linmem.ops.triton import function
    from linmem.ops.triton.layout import CHUNK

    chunks = B * -(-T // CHUNK)
    parts = []
    for name in SWEPT:
        rule, residual = {"linmem RDN": ("delta", True), "linmem RLA": ("additive", True),
                          "linmem GDN": ("delta", False)}[name]
        flags = function._Flags(MemoryConfig(rule=rule, residual=residual), torch.bfloat16)
        saved = function.state_pass_outputs(B * T, chunks, B, HEADS, HEAD_DIM, VALUE_DIM, flags, "meta")
        text = f"{name.removeprefix('linmem ')} {function.recomputed_bytes(saved) / 2**20:.0f} MiB"
        text += f" ({function.recomputed_bytes(saved, 'writes') / 2**20:.0f} with 'writes'"
        if residual:
            text += f", {function.recomputed_bytes(saved, 'base') / 2**20:.0f} with 'base'"
        text += ")"
        parts.append(text)
    return ", ".join(parts) + f" per layer at B={B}, T={T}, H={HEADS}, K={HEAD_DIM}, V={VALUE_DIM}"


PROFILE_MIN_SECONDS = 30.0  # the profiles after the timings start only while this much of the budget is left


def profile_kernels(B, T, method: str = "linmem RDN", repeats: int = 3) -> dict:
    """``kernel_profile.profile_method`` of ``method`` on the timed inputs at ``B`` × ``T`` (a 2V method on the wide
    values it is timed on): its ``PROFILE_TOP`` longest kernels, each step's busy time and span, and their medians."""
    inputs = bench_inputs(B, T, wide=method.endswith(" 2V"))
    return kernel_profile.profile_method(METHODS[method], inputs, repeats, DEVICE)


def profile_shapes(results: list[dict]) -> list[tuple[int, int]]:
    """The (B, T) pairs ``results`` timed (a time measured), each once, in the order they were timed."""
    return list(dict.fromkeys((r["B"], r["T"]) for r in results if r["ms"] is not None))


def default_profile_methods(methods: list[str]) -> list[str]:
    """What ``--profile`` profiles unless told: both methods of every ``kernel_report.RATIOS`` pair in ``methods``
    (the 2V methods on the same wide values they are timed on), so that the busy times have the report's ratios;
    without such a pair, linmem RDN and RLA."""
    paired = {name for _, a, b in kernel_report.RATIOS if a in methods and b in methods for name in (a, b)}
    return [name for name in METHODS if name in paired] or ["linmem RDN", "linmem RLA"]


def profile_timed(report: dict, methods: list[str], repeats: int, left, out: Path) -> None:
    """Profile ``methods`` at each (B, T) the report timed, with what is left of the budget (``left()`` seconds):
    the per-kernel rows go to ``report["profile"]``, the busy times to ``report["gpu_busy"]``, written after each.
    Stops, with a line, when under ``PROFILE_MIN_SECONDS`` are left."""
    report["profile_repeats"] = repeats
    for B, T in profile_shapes(report["results"]):
        for method in methods:
            if left() < PROFILE_MIN_SECONDS:
                print(f"profile skipped from {method} T={T}: {left():.0f} s of the budget left", flush=True)
                return
            try:
                with time_limit(left()):
                    found = profile_kernels(B, T, method, repeats)
            except OverBudget as exc:
                print(f"profile {method} T={T}: {exc}", flush=True)
                return
            except Exception as exc:  # noqa: BLE001 (a method that does not run has no profile; the rest go on)
                print(f"profile {method} T={T}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            report.setdefault("profile", {})[f"{method} T={T}"] = found["rows"]
            report.setdefault("gpu_busy", []).append(dict(method=method, T=T, B=B, ms=found["busy_ms"],
                                                          steps_ms=found["steps_ms"], span_ms=found["span_ms"],
                                                          spans_ms=found["spans_ms"]))
            print(f"profile {method} fwd+bwd B={B} T={T} (medians of {repeats} steps): busy {found['busy_ms']:.3f} "
                  f"ms, steps {', '.join(f'{ms:.3f}' for ms in found['steps_ms'])}; first kernel to last "
                  f"{found['span_ms']:.3f} ms\n"
                  + "\n".join(f"  {ms:8.3f} ms  {name[:90]}" for name, ms in found["rows"]), flush=True)
            _write(report, out, with_plot=False)


# ------------------------------------------------------------------------------------------------ main


def run_environment() -> dict:
    env = environment(DEVICE if DEVICE == "cuda" else "cpu")
    env["gpu"] = env["gpu"] or f"CPU (Triton interpreter, {platform.machine()})"
    return env


def _set_swept(names: list[str]) -> None:
    global SWEPT
    SWEPT = tuple(names)


def _set_shape(heads: int, head_dim: int, value_dim: int | None = None) -> None:
    global HEADS, HEAD_DIM, VALUE_DIM
    HEADS, HEAD_DIM, VALUE_DIM = heads, head_dim, head_dim if value_dim is None else value_dim
    os.environ["LINMEM_BENCH_SHAPE"] = f"{HEADS},{HEAD_DIM},{VALUE_DIM}"  # for the worker processes


def _write(report: dict, out: Path, with_plot: bool) -> None:
    """kernels.json, kernels.md and, ``with_plot``, kernels.png under ``out``, for this module's methods."""
    kernel_report.write_report(report, out, with_plot, METHODS, CHUNKED_METHODS)


MODES = ("fwd", "fwd+bwd")


def time_at_length(report: dict, names: list[str], x: dict, B: int, T: int, rounds: int, left, out: Path) -> None:
    """Time ``names`` (``METHODS`` keys) on the inputs ``x`` (``[B, T, H, d]``), forward and forward+backward, in
    ``rounds`` rounds: round 0 in the order given, round 1 reversed, round 2 forward again, ... (ABBA), both modes
    of a method within its turn, so that the machine's drift over the rounds falls on every method alike and each
    round gives a paired A / B ratio.

    Appends to ``report["results"]`` one row per (method, mode) at its first timing: ``ms`` its time, with several
    rounds the median of the rounds' times (``rounds_ms``, one per round, in round order). A method's first turn
    includes its compiles and autotune; every timing gets what is left of the budget (``left()`` seconds), at
    least ``MIN_METHOD_SECONDS``. A mode whose timing raised keeps what it measured (``ms`` None where nothing) and
    is not timed again; a method stopped by the budget (``OverBudget``) is done. The budget is checked before every
    turn: once spent, the remaining rounds are not run and ``report["skipped"]`` lists what they leave out.
    kernels.json and kernels.md are written under ``out`` after every turn, so a run killed inside a method keeps
    what was measured before it."""
    rows = {}  # (method, mode) → its result row
    active = {name: list(MODES) for name in names}  # the modes each method is still timed in
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            if not active[name]:
                continue
            if left() < 0:
                _skip_remaining_rounds(report, names, rows, active, T, rounds, left)
                return
            this_turn = {}
            for mode in list(active[name]):
                try:
                    # a method's first timing may compile and autotune for minutes (FLA's chunk_gla does): it gets
                    # what is left of the budget, at least MIN_METHOD_SECONDS
                    with time_limit(max(left(), MIN_METHOD_SECONDS)):
                        ms = time_method(METHODS[name], x, mode == "fwd+bwd")
                except OverBudget as exc:  # its other mode, and its later rounds, would only run on: it is done
                    at = f" in round {index + 1} of {rounds}" if index else ""
                    report["skipped"].append(f"{name} T={T} from {mode}{at} ({exc})")
                    print(f"{name} {mode} T={T}{at}: {exc}", flush=True)
                    active[name] = []
                    break
                except Exception as exc:  # noqa: BLE001 (recorded, the table shows a dash or the rounds before)
                    ms = None
                    active[name].remove(mode)
                    print(f"{name} {mode} T={T}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    if index:
                        report["skipped"].append(f"{name} T={T} {mode} from round {index + 1} of {rounds} "
                                                 f"({type(exc).__name__})")
                row = rows.get((name, mode))
                if row is None:
                    row = rows[name, mode] = dict(method=name, mode=mode, T=T, B=B, ms=ms)
                    report["results"].append(row)
                    if rounds > 1:
                        row["rounds_ms"] = []
                if rounds > 1 and ms is not None:
                    row["rounds_ms"].append(ms)
                    row["ms"] = statistics.median(row["rounds_ms"])
                this_turn[mode] = ms
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            which = f" round {index + 1}/{rounds}" if rounds > 1 else ""
            print(f"T={T:6d} {name:16s}{which} " + "  ".join(
                f"{mode} {ms:.2f} ms" for mode, ms in this_turn.items() if ms is not None), flush=True)
            _write(report, out, with_plot=False)


def _skip_remaining_rounds(report: dict, names: list[str], rows: dict, active: dict, T: int, rounds: int,
                           left) -> None:
    """List in ``report["skipped"]`` what the budget, spent, leaves out at length ``T``: each method never timed
    there, and each method timed in fewer than ``rounds`` rounds (a method that failed or was stopped is done)."""
    for name in names:
        if not active[name]:
            continue
        if not any((name, mode) in rows for mode in MODES):
            report["skipped"].append(f"{name} T={T}")
            print(f"{name} T={T} skipped: {left():.0f} s of the budget left", flush=True)
            continue
        done = min(len(rows[name, mode].get("rounds_ms", [None])) for mode in active[name])
        if done < rounds:
            report["skipped"].append(f"{name} T={T}: {done} of {rounds} rounds")
            print(f"{name} T={T}: {done} of {rounds} rounds, {left():.0f} s of the budget left", flush=True)


def _batch_and_length(text: str) -> tuple[int, int]:
    try:
        B, T = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"B,T expected (two integers); got {text!r}") from None
    if B < 1 or T < 1:
        raise argparse.ArgumentTypeError(f"B and T must be >= 1; got {text!r}")
    return B, T


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--lengths", default="2048,131072,32768,8192", help="timed in this order")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"any of: {', '.join(METHODS)}")
    parser.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 4))
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--quick-check", action="store_true", help="a subset of the float64 checks")
    parser.add_argument("--sweep", action="store_true", help="time alternative launch options and keep the best")
    parser.add_argument("--swept", default=",".join(SWEPT),
                        help="the linmem methods --sweep compiles and times under every variant (fewer: a sweep "
                             "that fits a shorter budget; the chosen row then rests on these only)")
    parser.add_argument("--sweep-kernels", default=None,
                        help="a comma list of the row's kernel names (forward, backward_states, ...) or "
                             "recompute_states: --sweep times only their variants, the other kernels keep the row's "
                             "options (default: every kernel and recompute_states)")
    parser.add_argument("--sweep-only", default=None, metavar="NAME=VALUE,...",
                        help="of the variants --sweep-kernels leaves, time only those that set one of these "
                             "options to its value (e.g. FUSED=True,recompute_states=base): a sweep of candidates "
                             "the row's earlier sweeps have not timed, without timing the rest again")
    parser.add_argument("--options", type=json.loads, default=None, metavar="JSON",
                        help="launch options for this run, in every row of the op's KERNEL_OPTIONS before anything "
                             "is timed or swept, e.g. '{\"recompute_states\": \"writes\"}' or "
                             "'{\"forward\": {\"FUSED\": true}}' (the report's launch options show them)")
    parser.add_argument("--sweep-at", type=_batch_and_length, default=None, metavar="B,T",
                        help="the batch and length the sweep times (default: one sequence of min(--tokens, 32768)); "
                             "e.g. 4,2048 for a training micro-batch, where more sequences fill more of the GPU")
    parser.add_argument("--sweep-metric", choices=SWEEP_METRICS, default="wall",
                        help="what the sweep compares: wall (do_bench's median of one call) or busy (the kernels' "
                             "own GPU time, torch.profiler; for a micro-batch shape, where one call's wall time is "
                             "mostly the host's launches)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timings: per-kernel times and GPU busy time of fwd+bwd (--profile-methods) "
                             "at each timed B and T")
    parser.add_argument("--profile-methods", default=None,
                        help="the methods --profile profiles, at the timed widths (not the 2V methods); default: "
                             "both methods of each ratio the run times (RDN / GDN, ...), else linmem RDN and RLA")
    parser.add_argument("--profile-repeats", type=int, default=3,
                        help="steps profiled per method and length; the report gives their medians")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (see the docstring)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the methods at each length this many times, the order reversed every other "
                             "round (ABBA), so that the machine's drift falls on every method alike; each cell is "
                             "the median of the rounds, and the report adds each round's ratios")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="the key width (and the value width)")
    parser.add_argument("--value-dim", type=int, default=None, help="the value width, if not the head dim")
    parser.add_argument("--render", action="store_true",
                        help="write kernels.md and kernels.png again from the kernels.json in --out; times nothing")
    args = parser.parse_args(argv)
    if args.render:
        kernel_report.render(Path(args.out), METHODS, CHUNKED_METHODS)
        return
    methods = args.methods.split(",")
    profile_methods = (default_profile_methods(methods) if args.profile_methods is None
                       else args.profile_methods.split(","))
    unknown = [name for name in methods + profile_methods if name not in METHODS]
    if unknown:
        parser.error(f"--methods / --profile-methods: unknown {', '.join(map(repr, unknown))}; known: "
                     f"{', '.join(METHODS)}")
    if args.profile_repeats < 1:
        parser.error(f"--profile-repeats: at least 1; got {args.profile_repeats}")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1; got {args.rounds}")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # the dry run needs the interpreter, and Triton fixes its own jit helpers (tl.sum, …) as compiled or
        # interpreted when it is first imported, which the linmem package did before this ran: start again
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "linmem.bench.kernels",
                                  *(sys.argv[1:] if argv is None else argv)])
    swept = args.swept.split(",")
    if not swept or any(name not in SWEPT for name in swept):
        parser.error(f"--swept: a comma list of {', '.join(SWEPT)}; got {args.swept!r}")
    _set_swept(swept)
    _set_shape(args.heads, args.head_dim, args.value_dim)
    if args.sweep_kernels is not None:
        from linmem.ops.triton import function

        sweep_kernels = args.sweep_kernels.split(",")
        known = list(function.kernel_options(HEAD_DIM, VALUE_DIM))  # recompute_states too: timed, never chosen
        if not set(sweep_kernels) <= set(known):
            parser.error(f"--sweep-kernels: a comma list of {', '.join(known)}; got {args.sweep_kernels!r}")
    try:
        sweep_only = None if args.sweep_only is None else _option_values(args.sweep_only)
    except ValueError as exc:
        parser.error(f"--sweep-only: {exc}")
    if args.options is not None:
        from linmem.ops.triton import function

        try:
            function.override_options(args.options)
        except ValueError as exc:
            parser.error(f"--options: {exc}")
    os.environ.setdefault("FLA_CACHE_RESULTS", "0")  # FLA autotunes in this process, on quiet timings
    try:
        import fla.ops.common.chunk_o as fla_chunk_o

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: FLA's gated backward on Triton < 3.7.1 (FLA #640)
    except ImportError:
        print("flash-linear-attention is not installed: FLA columns stay empty")
    start = time.time()
    left = lambda: args.budget - (time.time() - start)  # noqa: E731
    lengths = [int(t) for t in args.lengths.split(",")]
    variants = sweep_variants(HEAD_DIM, VALUE_DIM) if args.sweep else []
    if args.sweep_kernels is not None:
        variants = [v for v in variants if next(iter(v)) in sweep_kernels]
    if sweep_only is not None:
        variants = [v for v in variants if variant_sets(v, sweep_only)]
        if args.sweep and not variants:
            parser.error(f"--sweep-only: no variant left to time sets any of {args.sweep_only!r}")
    correctness, failures = warm_and_check(variants, args.workers, args.skip_check, args.quick_check, lengths,
                                           args.tokens, deadline=start + 0.6 * args.budget,
                                           methods=args.methods.split(","))
    checks = correctness["checks"]
    print(f"compile + checks: {time.time() - start:.0f} s; {sum(c['passed'] for c in checks)} of {len(checks)} "
          "checks passed", flush=True)

    report = dict(env=run_environment(), tokens=args.tokens, heads=HEADS, head_dim=HEAD_DIM,
                  value_dim=VALUE_DIM, checks=checks,
                  offsets=correctness["offsets"], finite=correctness["finite"], results=[],
                  skipped=list(correctness["unfinished"]), compile_failures=[f["task"] for f in failures])
    if args.rounds > 1:
        report["rounds"] = args.rounds
    from linmem.ops.triton import function

    if args.sweep and left() > 0.3 * args.budget:
        defaults = dict(function.kernel_options(HEAD_DIM, VALUE_DIM))
        B, T = args.sweep_at or (max(1, args.tokens // 32768), min(32768, args.tokens))
        report["kernel_options"] = tune(variants, B, T, deadline=start + 0.8 * args.budget, metric=args.sweep_metric)
        report["sweep_metric"] = args.sweep_metric
        reason = (f"{report['env']['gpu']} sweep (triton {report['env']['triton']}), "
                  f"{'+'.join(name.removeprefix('linmem ') for name in SWEPT)} fwd+bwd, B={B}, T={T}, H={HEADS}"
                  + (", busy time" if args.sweep_metric == "busy" else ""))
        print("the row of linmem.ops.triton.function.KERNEL_OPTIONS to paste:\n"
              + kernel_report.table_row(HEAD_DIM, VALUE_DIM, report["kernel_options"], reason), flush=True)
        changed = {k: v for k, v in report["kernel_options"].items() if v != defaults[k]}
        if changed and not args.skip_check:  # the options about to be timed, against float64 like the defaults
            print(f"re-checking with the sweep's winners: {changed}", flush=True)
            tuned, _ = warm_and_check([], args.workers, False, True, lengths, args.tokens,
                                      deadline=time.time() + max(60.0 + 2 * HEAVY_TASK_SECONDS, 0.3 * left()),
                                      kernel_options=changed)
            report["tuned_checks"] = dict(tuned, options=changed)
    else:
        if args.sweep:
            print(f"sweep skipped: {left():.0f} s of the budget left", flush=True)
        # linmem's launch row, where a linmem method runs (FLA's alone may run wider than linmem's widest row,
        # e.g. its GDN at V = 512 as the twice-as-wide state of K = V = 256 heads, profiled as such)
        chunked = set(args.methods.split(",")) & set(CHUNKED_METHODS)
        report["kernel_options"] = function.kernel_options(HEAD_DIM, VALUE_DIM) if chunked else None
    for T in lengths:
        if left() < 30:
            report["skipped"].append(f"T={T}")
            print(f"T={T} skipped: {left():.0f} s of the budget left", flush=True)
            continue
        B = max(1, args.tokens // T)
        x = bench_inputs(B, T, wide=any(name.endswith(" 2V") for name in args.methods.split(",")))
        time_at_length(report, args.methods.split(","), x, B, T, args.rounds, left, Path(args.out))
        del x
    if args.profile:  # after the timings, which are the point of a run: with what is left of the budget
        profile_timed(report, profile_methods, args.profile_repeats, left, Path(args.out))
    _write(report, Path(args.out), with_plot=bool(report["results"]))
    print(kernel_report.markdown(report, METHODS, CHUNKED_METHODS))
    print(f"total {time.time() - start:.0f} s")
    print(kernel_report.summary(report, METHODS))


if __name__ == "__main__":
    main()
