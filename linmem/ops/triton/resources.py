"""Offline resource check of the Triton kernels: compile every kernel that one forward and backward pass launches
for a GPU target (default sm_90, the H200) with the ptxas that ships with Triton, without a GPU, and report
registers, spilled stack and shared memory per kernel.

    python -m linmem.ops.triton.resources [--dtypes bfloat16,float32] [--widths 64,128,256] [--memories RDN,RLA]

The launches are recorded by running the backend's own host code (``function._forward``/``_backward``) on CPU
tensors with every kernel replaced by a recorder, so the compiled signatures, block sizes and launch options are
exactly those of a GPU run (``KERNEL_OPTIONS``, the row of each width). Pointer arguments and integers divisible
by 16 get Triton's 16-divisibility hint, as its launcher gives them. Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import triton

from linmem.ops.config import MemoryConfig

MEMORIES = {"RDN": ("delta", True), "RLA": ("additive", True), "GDN": ("delta", False), "sGLA": ("additive", False)}
_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
                  torch.int64: "*i64"}


@dataclass
class Launch:
    name: str
    kernel: object
    args: tuple
    kwargs: dict
    info: dict = field(default_factory=dict)


class _Recorder:
    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(Launch(self.name, self.kernel, args, kwargs))

        return launch


@contextmanager
def _recording(log):
    from linmem.ops.triton import function, inverse, scores

    targets = [(scores, "chunk_scores_kernel"), (inverse, "chunk_inverse_kernel")]
    targets += [(function, name) for name in dir(function) if name.endswith("_kernel")]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    try:
        for module, name, kernel in saved:
            setattr(module, name, _Recorder(name.removesuffix("_kernel"), kernel, log))
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def record_launches(memory: str, dtype: torch.dtype, width: int, output_gates: bool = True) -> list[Launch]:
    """The kernel launches of one forward and backward pass (B = 1, T = 200, H = 2, K = V = width), the backward's
    recomputation of the state passes (the row's ``recompute_states``) included."""
    from linmem.ops.triton import function
    from linmem.ops.triton.layout import SequenceLayout, interpreting

    if interpreting():
        raise RuntimeError("run the offline resource check without TRITON_INTERPRET (compiled kernels are needed)")
    rule, residual = MEMORIES[memory]
    config = MemoryConfig(rule=rule, residual=residual, output_gates=output_gates)
    n_tok, heads = 200, 2
    layout = SequenceLayout.fixed(1, n_tok, torch.device("cpu"))
    qk = [torch.zeros(n_tok, heads, width, dtype=dtype) for _ in range(2)]
    v = torch.zeros(n_tok, heads, width, dtype=dtype)
    gates = [torch.zeros(n_tok, heads) for _ in range(3)]
    state = torch.zeros(1, heads, width, width)
    flags = function._Flags(config, dtype)
    log: list[Launch] = []
    with _recording(log):
        _, base_final, res_final, saved = function._forward(*qk, v, *gates, state, state if residual else None,
                                                            flags, 0.1, layout)
        recompute = function.kernel_options(width, width)["recompute_states"]
        if recompute:  # the backward's state passes again, as LinearMemoryFunction.backward runs them
            function._state_passes(qk[1], v, saved["b"], *gates, saved["key_scores"], saved["inv_beta"],
                                   saved["inv_gamma"], state, state if residual else None, flags, layout,
                                   residual_pass="res_chunks" in function.recomputed_names(recompute),
                                   writes=saved if recompute == "writes" else None)
        function._backward(torch.zeros_like(v), state, state if residual else None, *qk, v, *gates, flags, 0.1,
                           layout, saved)
    for launch in log:
        launch.info = dict(memory=memory, dtype=str(dtype).removeprefix("torch."), width=width)
    return log


def _unwrapped(launch: Launch):
    """The jit function under a launch's ``triton.heuristics`` wrappers, and every argument by name (those the
    heuristics derive included)."""
    kernel = launch.kernel
    named = dict(launch.kwargs)
    while isinstance(kernel, triton.runtime.Heuristics):
        named.update(zip(kernel.arg_names, launch.args))
        named.update({name: rule(named) for name, rule in kernel.values.items()})
        kernel = kernel.fn
    return kernel, named


def _signature(launch: Launch):
    kernel, named = _unwrapped(launch)
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        value = launch.args[i] if i < len(launch.args) else named[name]
        if param.is_constexpr or value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                   and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: argument {name} of type {type(value).__name__}")
    options = {key: launch.kwargs[key] for key in ("num_warps", "num_stages") if key in launch.kwargs}
    return signature, constants, attrs, options


def compile_launch(launch: Launch, arch: int = 90) -> dict:
    """Compile one recorded launch for ``sm_<arch>``; registers, stack (spills) and shared memory per thread/block."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs, options = _signature(launch)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    start = time.time()
    try:
        compiled = triton.compile(ASTSource(_unwrapped(launch)[0], signature, constexprs=constants, attrs=attrs),
                                  target=target, options=backend.parse_options(options).__dict__)
    except Exception as exc:  # noqa: BLE001 (reported in the table)
        return dict(launch.info, kernel=launch.name, error=f"{type(exc).__name__}: {str(exc)[:300]}", **options)
    usage = _cubin_usage(compiled.asm["cubin"])
    blocks = {key: value for key, value in constants.items() if key in ("BV", "BK", "NK")}
    return dict(launch.info, kernel=launch.name, **options, **blocks, shared=compiled.metadata.shared,
                seconds=round(time.time() - start, 1), **usage)


def _cubin_usage(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not found:
        return dict(regs=None, stack=None)
    return dict(regs=int(found.group(1)), stack=int(found.group(2)))


def _compile_one(args):
    from linmem.ops.triton import function

    memory, dtype, width, index, overrides, arch, kernels = args
    function.override_options(overrides)
    return compile_launch(record_launches(memory, dtype, width)[index], arch)


def resource_table(memories, dtypes, widths, workers: int = 1, arch: int = 90, overrides: dict | None = None,
                   kernels: list[str] | None = None) -> list[dict]:
    """Compile every distinct kernel launch of these configurations (in ``workers`` processes) and return a row per
    configuration and launch (launches that compile to the same kernel share one compile); ``overrides`` changes
    ``KERNEL_OPTIONS`` entries (in every row), ``kernels`` keeps only these kernels (names without ``_kernel``)."""
    from linmem.ops.triton import function

    function.override_options(overrides)
    jobs, keys, found = [], {}, []
    for memory in memories:
        for dtype in dtypes:
            for width in widths:
                for index, launch in enumerate(record_launches(memory, dtype, width)):
                    if kernels and launch.name not in kernels:
                        continue
                    signature, constants, _, options = _signature(launch)
                    key = (launch.name, repr(sorted(signature.items())), repr(sorted(constants.items())),
                           repr(sorted(options.items())))
                    if key not in keys:
                        keys[key] = len(jobs)
                        jobs.append((memory, dtype, width, index, overrides, arch, kernels))
                    found.append((keys[key], launch.info))
    if workers <= 1:
        compiled = [_compile_one(job) for job in jobs]
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            compiled = list(pool.map(_compile_one, jobs))
    return [dict(compiled[job], **info) for job, info in found]


def markdown(rows: list[dict]) -> str:
    lines = ["| memory | inputs | K = V | kernel | warps | stages | BV | registers | spilled stack (B/thread) | "
             "shared memory (KB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['memory']} | {r['dtype']} | {r['width']} | {r['kernel']} | | | | compile failed: "
                         f"{r['error'][:80]} | | |")
            continue
        lines.append(f"| {r['memory']} | {r['dtype']} | {r['width']} | {r['kernel']} | {r.get('num_warps', '')} | "
                     f"{r.get('num_stages', '')} | {r.get('BV', '')} | {r['regs']} | {r['stack']} | "
                     f"{r['shared'] / 1024:.1f} |")
    return "\n".join(lines)


KERNEL_ORDER = ("chunk_scores", "chunk_inverse", "state_pass", "both_state_passes", "output", "reverse_pass",
                "both_reverse_passes", "backward_scores", "backward_keys", "decay_grad")


def pivot_markdown(rows: list[dict]) -> str:
    """One table per input type: a row per kernel, a column per memory × width with ``registers`` (``+N`` bytes of
    spilled stack per thread where there are any; the larger of a memory's two launches for the sequential passes),
    and the kernel's launch options and largest shared memory."""
    memories = [m for m in MEMORIES if any(r["memory"] == m for r in rows)]
    widths = sorted({r["width"] for r in rows})
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        cols = [(m, w) for m in memories for w in widths]
        out += [f"**{dtype} inputs** (registers per thread, +spilled bytes):", "",
                "| kernel | warps, stages, BV | " + " | ".join(f"{m} {w}" for m, w in cols) + " | shared memory |",
                "|---" * (len(cols) + 3) + "|"]
        for kernel in KERNEL_ORDER:
            found = [r for r in rows if r["dtype"] == dtype and r["kernel"] == kernel and "error" not in r]
            if not found:
                continue
            cells = []
            for m, w in cols:
                here = [r for r in found if r["memory"] == m and r["width"] == w]
                if not here:
                    cells.append("–")
                    continue
                worst = max(here, key=lambda r: (r["stack"], r["regs"]))
                cells.append(f"{worst['regs']}" + (f" +{worst['stack']}" if worst["stack"] else ""))
            launch = sorted({f"{r.get('num_warps', '')}, {r.get('num_stages', '')}, {r.get('BV', '–')}"
                             for r in found})
            shared = max(r["shared"] for r in found) / 1024
            out.append(f"| {kernel} | {'; '.join(launch)} | " + " | ".join(cells) + f" | ≤ {shared:.1f} KB |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memories", default="RDN,RLA,GDN,sGLA")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--options", default="{}", help='JSON, e.g. {"forward": {"num_warps": 8}}')
    parser.add_argument("--kernels", default="", help="only these kernels, e.g. state_pass,output")
    parser.add_argument("--pivot", action="store_true", help="one compact table per input type")
    args = parser.parse_args(argv)
    rows = resource_table(args.memories.split(","), [getattr(torch, d) for d in args.dtypes.split(",")],
                          [int(w) for w in args.widths.split(",")], args.workers, args.arch,
                          json.loads(args.options), [k for k in args.kernels.split(",") if k])
    print(f"triton {triton.__version__}, sm_{args.arch}, offline (no GPU)")
    print(pivot_markdown(rows) if args.pivot else markdown(rows))
    bad = [r for r in rows if "error" in r or (r["stack"] or 0) > 0 or r["shared"] > 227 * 1024]
    print(f"{len(rows)} launches compiled; {len(bad)} failed, spilled or over 227 KB of shared memory")


if __name__ == "__main__":
    main()
