"""The kernel benchmark's profiles: one method's forward+backward under torch.profiler, as the time of each kernel it
runs and the GPU busy time, their sum (on the CPU dry run: each operator's own CPU time)."""

from __future__ import annotations

import statistics

import torch

from linmem.bench.kernel_checks import grad_leaves
from linmem.bench.step_profile import synchronize

PROFILE_TOP = 14  # the kernels a profile shows and keeps, the longest first (its busy time sums all of them)


def profile_method(fn, x: dict, repeats: int, device: str) -> dict:
    """Per-kernel device times of the method ``fn``'s forward+backward on the inputs ``x`` (torch.profiler),
    ``repeats`` steps each profiled on its own: ``rows`` the ``PROFILE_TOP`` longest kernels (name, median ms over
    the steps), ``steps_ms`` each step's busy time (the sum over every kernel it ran, ``kernel_times``) and
    ``busy_ms`` their median; ``spans_ms`` each step's span (``kernel_span_ms``) and ``span_ms`` their median, so that
    span - busy is the time the GPU waited inside the call. On ``device`` "cpu" (the dry run): the ops' CPU times
    instead."""
    from torch.profiler import profile

    step = _warm_step(fn, x, device)
    steps, spans = [], []
    for _ in range(repeats):
        with profile(activities=[_profiled_activity(device)]) as prof:
            step()
            synchronize(device)
        steps.append(kernel_times(prof.key_averages(), device))
        spans.append(kernel_span_ms(prof.events(), device))
    return step_summary(steps, spans)


def busy_ms(fn, x: dict, repeats: int, device: str) -> float:
    """The kernels' own GPU time of one forward+backward of ``fn`` on ``x``: their summed time over ``repeats``
    calls profiled in one session (one profiler start, not one per call), per call. It is what a training step pays
    for the call, whose host gaps the step's later layers hide."""
    from torch.profiler import profile

    step = _warm_step(fn, x, device)
    with profile(activities=[_profiled_activity(device)]) as prof:
        for _ in range(repeats):
            step()
        synchronize(device)
    return sum(kernel_times(prof.key_averages(), device).values()) / repeats


def _warm_step(fn, x: dict, device: str):
    """One forward+backward of ``fn`` on fresh leaves of ``x``, run twice before it is returned: as the benchmark's
    ``time_method`` times it, the gradients set afresh, not added to earlier ones."""
    leaves = grad_leaves(x)
    d_o = torch.randn_like(fn(leaves))

    def step():
        for leaf in leaves.values():
            leaf.grad = None
        fn(leaves).backward(d_o)

    for _ in range(2):
        step()
    synchronize(device)
    return step


def _profiled_activity(device: str):
    from torch.profiler import ProfilerActivity

    return ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU


def counted_events(events, device: str) -> list:
    """The profiler events a step's busy time counts: on a GPU its kernels, copies and fills, each once
    (``step_profile.device_work``: no host op, whose device time is that of its kernels, no annotation spanning
    kernels, no driver marker or profiler record); on the CPU (``device="cpu"``, the dry run) every op but the
    profiler's own records."""
    from linmem.bench.step_profile import PROFILER_RECORDS, device_work

    return device_work(events) if device == "cuda" else [e for e in events if e.key not in PROFILER_RECORDS]


def kernel_times(events, device: str) -> dict[str, float]:
    """ms per kernel name in one profiled step (``prof.key_averages()``), over every ``counted_events`` one: on a GPU
    each kernel's device time, on the CPU (the dry run) each op's self CPU time."""
    own = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    times: dict[str, float] = {}
    for event in counted_events(events, device):
        times[event.key] = times.get(event.key, 0.0) + getattr(event, own) / 1000
    return times


def kernel_span_ms(events, device: str) -> float:
    """ms from the start of the first kernel one profiled step ran to the end of its last (``prof.events()``, its
    ``counted_events``; 0 without one): the busy time plus every wait of the GPU between them, on the host's
    launches or on a synchronisation. On the CPU (the dry run) the span of the counted ops."""
    counted = counted_events(events, device)
    if not counted:
        return 0.0
    return (max(e.time_range.end for e in counted) - min(e.time_range.start for e in counted)) / 1000


def step_summary(steps: list[dict[str, float]], spans: list[float] | None = None) -> dict:
    """Profiled steps (``kernel_times`` each) as medians over the steps: ``rows``, the ``PROFILE_TOP`` longest kernels
    (a kernel absent from a step counts 0 ms there); ``busy_ms``, the median of each step's sum over all its kernels;
    and ``steps_ms``, those sums. With ``spans`` (``kernel_span_ms`` of each step): ``spans_ms`` and their median
    ``span_ms`` too."""
    names = set().union(*steps)
    rows = [(name, statistics.median(step.get(name, 0.0) for step in steps)) for name in names]
    busy = [sum(step.values()) for step in steps]
    summary = dict(rows=sorted(rows, key=lambda row: -row[1])[:PROFILE_TOP], busy_ms=statistics.median(busy),
                   steps_ms=busy)
    if spans is not None:
        summary.update(span_ms=statistics.median(spans), spans_ms=spans)
    return summary
