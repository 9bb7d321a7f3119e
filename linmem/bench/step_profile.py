"""Where a training step's time goes: ``torch.profiler`` over a few steps, the kernels (CUDA) or operators (CPU)
ranked by their own time, and that time summed into a few kinds a reader can act on.

Kinds, by kernel or operator name: ``matmul`` (cuBLAS / CUTLASS GEMMs, ``aten::mm`` and relatives), ``linmem
kernels`` (the Triton kernels of ``linmem.ops.triton``: the memories' recurrence), ``linmem blocks`` (the Triton
kernels of ``linmem.ops.fused``: norms, short convolution, SwiGLU, cross-entropy), ``attention`` (flash / SDPA
kernels), ``optimizer`` (AdamW's fused and foreach kernels), ``communication`` (NCCL / gloo) and ``other``
(PyTorch's element-wise work, copies and casts). linmem's kernels are recognised by their exact names, which are
unique across both packages (the profiler groups by name). A step that is mostly ``linmem blocks`` and ``other`` is
bound by memory traffic and launches, not by the tensor cores, and MFU stays low whatever the GEMMs do.

    rows, kinds = profile_steps(step, steps=3, device=torch.device("cuda"))
    print(format_profile(rows, kinds))
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from functools import cache

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = ("matmul", "linmem kernels", "linmem blocks", "attention", "optimizer", "communication", "other")
MATMUL_MARKS = ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm",
                "aten::matmul", "aten::linear")
ATTENTION_MARKS = ("flash", "fmha", "attention")
OPTIMIZER_MARKS = ("adam", "multi_tensor_apply", "_foreach_")
COMMUNICATION_MARKS = ("nccl", "gloo", "c10d::")
# CUPTI records these where the launch queue was full: time the host waited, not work on the GPU
DRIVER_MARKERS = frozenset({"Command Buffer Full"})
PROFILER_RECORDS = frozenset({"Activity Buffer Request"})  # the profiler's own records, not the step's work


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def triton_kernel_names(package_name: str) -> frozenset[str]:
    """The names ending in ``_kernel`` defined by the modules of ``package_name`` (empty where Triton, which they
    import, is not installed)."""
    try:
        package = importlib.import_module(package_name)
    except ImportError:
        return frozenset()
    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
        except ImportError:
            continue
        names.update(name for name in vars(module) if name.endswith("_kernel"))
    return frozenset(names)


@cache
def linmem_kernel_names() -> frozenset[str]:
    """The Triton kernels of the memories' op (``linmem.ops.triton``)."""
    return triton_kernel_names("linmem.ops.triton")


@cache
def linmem_block_names() -> frozenset[str]:
    """The Triton kernels of the fused blocks around the op (``linmem.ops.fused``)."""
    return triton_kernel_names("linmem.ops.fused")


def kind_of(name: str) -> str:
    """The kind (``KINDS``) of a kernel or operator ``name``."""
    if name in linmem_kernel_names():
        return "linmem kernels"
    if name in linmem_block_names():
        return "linmem blocks"
    lowered = name.lower()
    for kind, marks in (("communication", COMMUNICATION_MARKS), ("optimizer", OPTIMIZER_MARKS),
                        ("attention", ATTENTION_MARKS), ("matmul", MATMUL_MARKS)):
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def device_work(events: list) -> list:
    """The profiler events that are work on the GPU: kernels, copies and fills (``device_type`` CUDA), each counted
    once, as itself. Left out: a CPU-side event, whose device time is that of the kernels it launched (an autograd
    Function launching Triton kernels, for one: those kernels are events of their own); a user annotation on the
    GPU's timeline (``record_function`` ranges such as the optimizer's step), which spans kernels; the driver's
    markers (``DRIVER_MARKERS``) and the profiler's own records (``PROFILER_RECORDS``)."""
    skipped = DRIVER_MARKERS | PROFILER_RECORDS
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in skipped
            and not getattr(e, "is_user_annotation", False)]


def profile_steps(step: Callable[[], object], steps: int, device: torch.device,
                  top: int | None = 15) -> tuple[list[dict], dict[str, float]]:
    """Profile ``steps`` calls of ``step`` (warmed up already) on ``device``.

    Returns the ``top`` kernels (CUDA) or operators (CPU) by their own time (``top=None``: every one, so that their
    ``ms_per_step`` sum to the step's own time), each ``{name, kind, ms_per_step, share, calls_per_step}``, and
    ``{kind: share of the step's own time}`` over every kernel or operator (shares sum to 1). On the CPU an
    operator's own time excludes the operators it calls, so nothing is counted twice.
    """
    if steps < 1:
        raise ValueError(f"profile steps must be >= 1; got {steps}")
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    own = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, own, 0) > 0]
    if cuda:
        events = device_work(events)
    total = sum(getattr(e, own) for e in events) or 1.0
    kinds = dict.fromkeys(KINDS, 0.0)
    for e in events:
        kinds[kind_of(e.key)] += getattr(e, own) / total
    ranked = sorted(events, key=lambda e: getattr(e, own), reverse=True)[:top]
    rows = [dict(name=e.key, kind=kind_of(e.key), ms_per_step=getattr(e, own) / 1e3 / steps,
                 share=getattr(e, own) / total, calls_per_step=e.count / steps) for e in ranked]
    return rows, kinds


def own_time_by_name(rows: list[dict]) -> dict[str, dict]:
    """``profile_steps``'s rows (all of them: ``top=None``) keyed by kernel or operator name, each ``{ms_per_step,
    calls_per_step, kind}``, for comparing two profiles name by name (names are unique: the profiler's averages are
    grouped by name)."""
    return {r["name"]: dict(ms_per_step=r["ms_per_step"], calls_per_step=r["calls_per_step"], kind=r["kind"])
            for r in rows}


def table_name(name: str, width: int = 90) -> str:
    """A kernel's or operator's name for a Markdown table cell: code, cut to ``width`` characters, bars escaped."""
    name = name if len(name) <= width else name[:width - 1] + "…"
    return "`" + name.replace("|", "\\|") + "`"


def format_profile(rows: list[dict], kinds: dict[str, float], name_width: int = 90) -> str:
    """Markdown: the share of each kind, then the ranked kernels or operators."""
    lines = ["| kind | share of the step's own time |", "|---|---|"]
    lines += [f"| {kind} | {100 * share:.1f}% |" for kind, share in kinds.items()]
    lines += ["", "| kernel or operator | kind | ms per step | share | calls per step |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {table_name(r['name'], name_width)} | {r['kind']} | {r['ms_per_step']:.2f} | "
                     f"{100 * r['share']:.1f}% | {r['calls_per_step']:g} |")
    return "\n".join(lines)
