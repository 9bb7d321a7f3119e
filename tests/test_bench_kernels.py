"""``linmem.bench.kernels`` on the CPU: the order its correctness tasks run in (the memory-heavy ones after the
parallel pool, one at a time, within the deadline), the profile after the timings at each timed shape once
(``kernel_profile``), the report's GPU busy-time tables, old reports included (``kernel_report``), and the float64
checks' own parts (``kernel_checks``).

The scheduling tests run fake tasks in spawned processes; their worker is this module's ``fake_worker``, which a
spawned process imports by name, so this module imports nothing heavy at its top.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def fake_worker(numbered_task):
    """A task that sleeps ``payload["sleep"]`` seconds and appends its start and end (process id, ``time.time()``)
    to ``payload["log"]``: the scheduling, without a GPU."""
    index, (kind, payload) = numbered_task
    with open(payload["log"], "a") as f:
        f.write(f"{payload['name']} {kind} start {os.getpid()} {time.time()!r}\n")
    time.sleep(payload["sleep"])
    with open(payload["log"], "a") as f:
        f.write(f"{payload['name']} {kind} end {os.getpid()} {time.time()!r}\n")
    if kind == "compile":
        return index, (kind, dict(task=payload, ok=True))
    return index, (kind, dict(case=payload["name"], errors={}, worst=0.0, passed=True))


def _read_log(path: Path) -> dict:
    """name → dict(kind, pid, start, end) from the fake tasks' log (``end`` absent for a task killed midway); each
    task ran once."""
    seen = {}
    for line in path.read_text().splitlines():
        name, kind, what, pid, when = line.split()
        task = seen.setdefault(name, dict(kind=kind, pid=int(pid)))
        assert what not in task, f"{name} ran twice"
        task[what] = float(when)
    return seen


def _kernels(monkeypatch):
    """``linmem.bench.kernels`` with the module state a run changes (the timed shape, the interpreter switch) put
    back after the test."""
    from linmem.bench import kernels

    monkeypatch.setattr(kernels, "HEADS", kernels.HEADS)
    monkeypatch.setattr(kernels, "HEAD_DIM", kernels.HEAD_DIM)
    monkeypatch.setattr(kernels, "VALUE_DIM", kernels.VALUE_DIM)
    monkeypatch.setenv("LINMEM_BENCH_SHAPE", "")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main() starts itself again under the interpreter without it
    return kernels


def report_page(report: dict) -> str:
    """``report`` as the benchmark writes it to kernels.md, with its methods."""
    from linmem.bench import kernel_report, kernels

    return kernel_report.markdown(report, kernels.METHODS, kernels.CHUNKED_METHODS)


def report_summary(report: dict) -> str:
    """The summary a benchmark run that measured ``report`` ends with."""
    from linmem.bench import kernel_report, kernels

    return kernel_report.summary(report, kernels.METHODS)


def _fake_tasks(monkeypatch, kernels, log: Path, sleeps: dict[str, tuple[str, float]]):
    """``warm_and_check`` runs ``sleeps`` (name → (kind, seconds)) as its correctness tasks, in that order."""
    tasks = [(kind, dict(name=name, sleep=seconds, log=str(log))) for name, (kind, seconds) in sleeps.items()]
    monkeypatch.setattr(kernels, "correctness_tasks", lambda quick, lengths, tokens: tasks)


def test_heavy_tasks_run_after_the_pool_one_at_a_time_each_in_a_fresh_process(tmp_path, monkeypatch):
    """The offsets and finiteness checks start only after every pooled task has ended, never beside each other,
    each in a process of its own; every result is recorded."""
    kernels = _kernels(monkeypatch)
    log = tmp_path / "log"
    # the heavy tasks first in the list: the order the tasks are listed in must not decide when they run
    _fake_tasks(monkeypatch, kernels, log, {"offsets": ("offsets", 0.4), "finite": ("finite", 0.4),
                                            "a": ("compile", 0.6), "b": ("compile", 0.3), "c": ("compile", 0.3)})
    results, failures = kernels.warm_and_check([], workers=2, skip_check=False, deadline=time.time() + 120,
                                               worker=fake_worker)
    assert not failures and not results["unfinished"]
    assert results["offsets"]["passed"] and results["finite"]["passed"]
    seen = _read_log(log)
    assert set(seen) == {"offsets", "finite", "a", "b", "c"} and all("end" in task for task in seen.values())
    pool_end = max(seen[name]["end"] for name in "abc")
    first, second = sorted((seen["offsets"], seen["finite"]), key=lambda task: task["start"])
    assert first["start"] >= pool_end and second["start"] >= first["end"]
    assert len({task["pid"] for task in seen.values()}) == 5


def test_pool_stops_early_enough_for_the_heavy_tasks(tmp_path, monkeypatch):
    """A pooled task still running when the pool's share of the deadline is spent is stopped and reported as not
    finished; the heavy tasks then run within the deadline."""
    kernels = _kernels(monkeypatch)
    monkeypatch.setattr(kernels, "HEAVY_TASK_SECONDS", 4.0)
    log = tmp_path / "log"
    _fake_tasks(monkeypatch, kernels, log, {"long": ("compile", 60.0), "short": ("compile", 0.1),
                                            "offsets": ("offsets", 0.2), "finite": ("finite", 0.2)})
    start = time.time()
    deadline = start + 20.0  # the pool gets 20 - min(2 x 4, 20 / 2) = 12 s
    results, _ = kernels.warm_and_check([], workers=2, skip_check=False, deadline=deadline, worker=fake_worker)
    assert time.time() < deadline
    assert len(results["unfinished"]) == 1 and results["unfinished"][0].startswith("compile {'name': 'long'")
    assert results["offsets"]["passed"] and results["finite"]["passed"]
    seen = _read_log(log)
    assert "end" not in seen["long"]
    assert min(seen["offsets"]["start"], seen["finite"]["start"]) >= start + 12.0 - 0.5


def test_heavy_tasks_left_without_time_are_reported_unfinished(tmp_path, monkeypatch):
    """A heavy task running at the deadline is stopped there, and one the deadline leaves no time to start is not
    started: both are reported as not finished, and the call returns at the deadline."""
    kernels = _kernels(monkeypatch)
    log = tmp_path / "log"
    _fake_tasks(monkeypatch, kernels, log, {"offsets": ("offsets", 60.0), "finite": ("finite", 0.1)})
    start = time.time()
    results, _ = kernels.warm_and_check([], workers=2, skip_check=False, deadline=start + 6.0, worker=fake_worker)
    assert 6.0 <= time.time() - start < 9.0
    assert results["offsets"] is None and results["finite"] is None
    assert [entry.split()[0] for entry in results["unfinished"]] == ["offsets", "finite"]
    assert set(_read_log(log)) == {"offsets"}


def test_heavy_reserve_is_a_share_of_the_time_left():
    from linmem.bench import kernels

    per_task = kernels.HEAVY_TASK_SECONDS
    assert kernels.heavy_reserve(2, 1000.0) == 2 * per_task
    assert kernels.heavy_reserve(2, 100.0) == 50.0  # never more than half of what is left
    assert kernels.heavy_reserve(0, 1000.0) == 0.0
    assert kernels.heavy_reserve(1, -5.0) == 0.0


def test_profile_shapes_are_the_timed_pairs_once():
    from linmem.bench import kernels

    results = [dict(method=m, mode=mode, B=B, T=T, ms=ms)
               for m, B, T, ms in (("a", 4, 2048, 1.0), ("b", 4, 2048, 2.0), ("a", 1, 8192, 3.0),
                                   ("a", 4, 2048, 1.5), ("a", 2, 4096, None), ("b", 1, 8192, 3.0))
               for mode in ("fwd", "fwd+bwd")]
    assert kernels.profile_shapes(results) == [(4, 2048), (1, 8192)]


def _event(key, device_type, device_ms=0.0, self_cpu_ms=0.0, annotation=False, start_us=0.0, end_us=None):
    """A profiler record's fields the benchmark reads; ``time_range`` from ``start_us`` for ``device_ms`` unless
    ``end_us`` is given (µs, as torch.profiler's events)."""
    end = start_us + 1000 * device_ms if end_us is None else end_us
    return SimpleNamespace(key=key, device_type=device_type, device_time_total=1000 * device_ms,
                           self_cpu_time_total=1000 * self_cpu_ms, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start_us, end=end))


def test_busy_time_sums_every_kernel_once_and_takes_step_medians():
    """On a GPU a step's busy time is the sum of every device record (a host op, whose device time is its kernels',
    an annotation spanning kernels, the driver's markers and the profiler's own records are left out), not of the
    rows shown; steps are summarised by medians."""
    from torch.autograd import DeviceType

    from linmem.bench import kernel_profile

    rng = __import__("random").Random()
    steps = []
    for _ in range(3):
        kernel_ms = [rng.uniform(0.01, 1.0) for _ in range(kernel_profile.PROFILE_TOP + 6)]
        events = [_event(f"kernel_{i}", DeviceType.CUDA, ms) for i, ms in enumerate(kernel_ms)]
        events += [_event("aten::mm", DeviceType.CPU, device_ms=sum(kernel_ms), self_cpu_ms=5.0),
                   _event("LinearMemoryFunction", DeviceType.CUDA, sum(kernel_ms), annotation=True),
                   _event("Activity Buffer Request", DeviceType.CUDA, 7.0),
                   _event("Command Buffer Full", DeviceType.CUDA, 3.0)]
        times = kernel_profile.kernel_times(events, device="cuda")
        assert set(times) == {f"kernel_{i}" for i in range(len(kernel_ms))}
        assert sum(times.values()) == pytest.approx(sum(kernel_ms), rel=1e-12)
        steps.append(times)
    found = kernel_profile.step_summary(steps)
    busy = [sum(step.values()) for step in steps]
    assert found["steps_ms"] == pytest.approx(busy) and found["busy_ms"] == pytest.approx(sorted(busy)[1])
    assert len(found["rows"]) == kernel_profile.PROFILE_TOP
    medians = {name: sorted(step[name] for step in steps)[1] for name in steps[0]}
    want = sorted(medians.items(), key=lambda row: -row[1])[:kernel_profile.PROFILE_TOP]
    assert [name for name, _ in found["rows"]] == [name for name, _ in want]
    assert [ms for _, ms in found["rows"]] == pytest.approx([ms for _, ms in want])
    # the CPU dry run: each op's own CPU time
    mm = _event("aten::mm", DeviceType.CPU, device_ms=9.0, self_cpu_ms=2.0)
    cpu = kernel_profile.kernel_times([mm], device="cpu")
    assert cpu == {"aten::mm": pytest.approx(2.0)}


def test_span_runs_from_the_first_kernel_to_the_last_and_shows_the_waits():
    """A step's span is the first counted kernel's start to the last one's end (µs records, ms out): a host op, an
    annotation and the profiler's records around the kernels do not widen it; the summary keeps each step's span and
    their median, and the report puts span and waits (span - busy) beside each other."""
    from torch.autograd import DeviceType

    from linmem.bench import kernel_profile, kernel_report

    rng = __import__("random").Random()
    spans = []
    for _ in range(3):
        events, busy = [], 0.0
        at = start = rng.uniform(0, 1e4)  # the first kernel's start, µs
        for i in range(rng.randint(2, 8)):
            at += rng.uniform(0, 300) if i else 0.0  # a wait before the kernel
            ms = rng.uniform(0.01, 1.0)
            events.append(_event(f"kernel_{i}", DeviceType.CUDA, ms, start_us=at))
            at += 1000 * ms
            busy += ms
        events += [_event("aten::mm", DeviceType.CPU, device_ms=busy, start_us=start - 500, end_us=at + 900),
                   _event("LinearMemoryFunction", DeviceType.CUDA, busy + 2, annotation=True, start_us=start - 800),
                   _event("Activity Buffer Request", DeviceType.CUDA, 7.0, start_us=at + 100)]
        span = kernel_profile.kernel_span_ms(events, device="cuda")
        assert span == pytest.approx((at - start) / 1000, rel=1e-12) and span >= busy
        spans.append(span)
    assert kernel_profile.kernel_span_ms([], device="cuda") == 0.0
    found = kernel_profile.step_summary([{"k": 1.0}, {"k": 2.0}, {"k": 3.0}], spans)
    assert found["spans_ms"] == spans and found["span_ms"] == pytest.approx(sorted(spans)[1])
    assert "span_ms" not in kernel_profile.step_summary([{"k": 1.0}])
    busy = [dict(method="linmem RDN", T=2048, B=4, ms=2.35, span_ms=2.61),
            dict(method="FLA GDN 2V", T=2048, B=4, ms=2.17)]  # a record from before spans were kept
    table = "\n".join(kernel_report._span_table(busy, ["linmem RDN", "FLA GDN 2V"]))
    assert "| 2048 | 2.61 (0.26) |" in table and "FLA GDN 2V" not in table
    assert kernel_report._span_table(busy[1:], ["FLA GDN 2V"]) == []


def _report(ms: dict[str, float], busy: dict[str, float] | None = None, lengths=(2048,)) -> dict:
    results = [dict(method=m, mode=mode, T=T, B=131072 // T, ms=t) for T in lengths for m, t in ms.items()
               for mode in ("fwd", "fwd+bwd")]
    report = dict(env=dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c"), tokens=131072, results=results)
    if busy is not None:
        # each length's busy times: ``busy``'s scaled by T / 2048
        report["gpu_busy"] = [dict(method=m, T=T, B=131072 // T, ms=t * T / 2048, steps_ms=[t * T / 2048] * 3)
                              for T in lengths for m, t in busy.items()]
        report["profile_repeats"] = 3
    return report


def test_busy_time_table_has_the_ratios_of_the_timing_tables():
    report = _report({"linmem RDN": 2.51, "FLA GDN": 1.57, "linmem RLA": 2.0},
                     busy={"linmem RDN": 1.8, "FLA GDN": 1.2, "linmem RLA": 1.1}, lengths=(2048, 8192))
    page = report_page(report)
    section = page.split("## GPU busy time per fwd+bwd (profiler)")[1].split("##")[0]
    assert "median of 3 profiled steps" in section
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table[0] == "| T | linmem RLA | linmem RDN | FLA GDN | RDN / FLA GDN |"
    assert table[2:] == ["| 2048 | 1.10 | 1.80 | 1.20 | 1.50x |", "| 8192 | 4.40 | 7.20 | 4.80 | 1.50x |"]
    assert page.index("## fwd+bwd") < page.index("## GPU busy")
    summary = report_summary(report).splitlines()
    # wall over busy by 39% (RDN), 31% (FLA GDN), 82% (RLA) at 2048: a warning after the busy table; at 8192 the
    # busy times are four times longer and the wall times the same, no warning
    assert summary[-1].startswith("Host-bound at T=2048: wall time over GPU busy time by linmem RLA +82%, linmem RDN "
                                  "+39%, FLA GDN +31%.")
    assert summary[-5:-1] == ["| T | RDN / FLA GDN |", "|---|---|", "| 2048 | 1.80 / 1.20 ms = 1.50x |",
                              "| 8192 | 7.20 / 4.80 ms = 1.50x |"]
    assert summary[-6].startswith("GPU busy time per forward+backward (profiler, median of 3")
    assert summary[-1] + "\n" in page.split("## GPU busy time")[1]
    assert "| 2048 | 2.51 / 1.57 ms = 1.60x |" in summary  # the do_bench table stays above it
    # without the busy times: no such table, and the summary ends with the do_bench one
    plain = _report({"linmem RDN": 2.51, "FLA GDN": 1.57})
    assert "GPU busy" not in report_page(plain) and "GPU busy" not in report_summary(plain)
    assert report_summary(plain).splitlines()[-1] == "| 2048 | 2.51 / 1.57 ms = 1.60x |"
    # no pair profiled: the busy times alone
    alone = _report({"linmem RDN": 2.51, "FLA GDN": 1.57}, busy={"linmem RDN": 2.3})
    assert report_summary(alone).splitlines()[-2:] == ["|---|---|", "| 2048 | 2.30 |"]


def test_host_bound_warns_only_where_wall_time_exceeds_busy_time_by_the_margin():
    from linmem.bench import kernel_report

    margin = kernel_report.HOST_BOUND_MARGIN
    busy = {"linmem RDN": 2.0, "FLA GDN": 2.0}
    report = _report({"linmem RDN": 2.0 * (1 + margin) * 0.99, "FLA GDN": 2.0 * (1 + margin) * 1.01}, busy=busy)
    (warning,) = kernel_report.host_bound(report, ["linmem RDN", "FLA GDN"])
    assert "FLA GDN +" in warning and "linmem RDN" not in warning
    assert kernel_report.host_bound(report, ["linmem RDN"]) == []  # the methods asked about only
    assert kernel_report.host_bound(_report({"linmem RDN": 2.0}), ["linmem RDN"]) == []  # not profiled


def test_summary_counts_unfinished_correctness_and_compile_tasks_not_skipped_timings():
    report = _report({"linmem RDN": 2.51, "FLA GDN": 1.57})
    report["skipped"] = ["check RDN float32 B=2 T=300", "offsets {}", "compile {'method': 'FLA GDN'}", "T=8192",
                         "linmem GDN T=2048", "linmem GDN T=64 from fwd (stopped after 20 s)"]
    assert "3 correctness/compile tasks not finished" in report_summary(report)


@pytest.mark.parametrize("name", ["kernels.json", "kernel-widths-256.json"])
def test_old_reports_render(name, tmp_path, capsys):
    """Reports written before the busy times were recorded (docs/benchmarks) render as before."""
    from linmem.bench import kernels

    shutil.copy(REPO / "docs" / "benchmarks" / name, tmp_path / "kernels.json")
    kernels.main(["--render", "--out", str(tmp_path)])
    page = (tmp_path / "kernels.md").read_text()
    assert "## fwd+bwd" in page and "GPU busy" not in page
    assert "Summary: forward+backward" in capsys.readouterr().out


DRY_RUN = ["--skip-check", "--tokens", "64", "--heads", "1", "--head-dim", "16", "--workers", "1"]


def test_profile_runs_after_the_timings_at_each_timed_shape_once(tmp_path, monkeypatch):
    """``--profile`` profiles each (B, T) timed, once, after every timing, and its busy times reach kernels.json
    and kernels.md."""
    kernels = _kernels(monkeypatch)
    calls = []

    def timed(fn, x, backward):
        calls.append(("time", x["q"].shape[0], x["q"].shape[1]))
        return 1.0

    def profiled(B, T, method, repeats):
        calls.append(("profile", B, T, method, repeats))
        return dict(rows=[("k", 0.5)], busy_ms=0.75, steps_ms=[0.75] * repeats, span_ms=0.8, spans_ms=[0.8] * repeats)

    monkeypatch.setattr(kernels, "time_method", timed)
    monkeypatch.setattr(kernels, "profile_kernels", profiled)
    kernels.main([*DRY_RUN, "--lengths", "64,32,64", "--methods", "linmem sGLA", "--profile", "--profile-methods",
                  "linmem sGLA", "--profile-repeats", "2", "--out", str(tmp_path)])
    profiles = [call for call in calls if call[0] == "profile"]
    assert profiles == [("profile", 1, 64, "linmem sGLA", 2), ("profile", 2, 32, "linmem sGLA", 2)]
    assert calls.index(profiles[0]) == len(calls) - 2  # every timing came first
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert [(b["method"], b["T"], b["B"], b["ms"]) for b in report["gpu_busy"]] == [("linmem sGLA", 64, 1, 0.75),
                                                                                    ("linmem sGLA", 32, 2, 0.75)]
    assert "| 64 | 0.75 |" in (tmp_path / "kernels.md").read_text()


def test_profile_is_skipped_when_the_timings_leave_too_little(tmp_path, monkeypatch, capsys):
    kernels = _kernels(monkeypatch)
    monkeypatch.setattr(kernels, "time_method", lambda fn, x, backward: 1.0)
    monkeypatch.setattr(kernels, "PROFILE_MIN_SECONDS", 1e9)
    monkeypatch.setattr(kernels, "profile_kernels", lambda *args: pytest.fail("profiled without the time"))
    kernels.main([*DRY_RUN, "--lengths", "64", "--methods", "linmem sGLA", "--profile", "--out", str(tmp_path)])
    assert "profile skipped from linmem RDN T=64:" in capsys.readouterr().out
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert report["results"] and "gpu_busy" not in report


def test_default_profile_methods_are_the_ratio_pairs():
    from linmem.bench import kernels

    assert kernels.default_profile_methods(["FLA GDN", "linmem RDN", "linmem GDN", "FLA GDN 2V"]) == [
        "linmem RDN", "linmem GDN", "FLA GDN", "FLA GDN 2V"]
    assert kernels.default_profile_methods(["FLA GDN", "linmem GDN"]) == ["linmem GDN", "FLA GDN"]
    assert kernels.default_profile_methods(["linmem RDN", "FLA GDN 2V"]) == ["linmem RDN", "FLA GDN 2V"]
    assert kernels.default_profile_methods(["linmem GDN", "FLA GDN 2V"]) == ["linmem RDN", "linmem RLA"]


def test_busy_time_of_a_real_step_in_the_interpreter(monkeypatch):
    """``busy_ms``, the sweep's busy metric, on a CPU dry-run shape: the kernels' (here the ops') time of its calls,
    profiled in one session, per call; the profile of the same call, one session per call, comes out alike."""
    from linmem.bench import kernel_profile

    kernels = _kernels(monkeypatch)
    kernels._set_shape(1, 16)
    x = kernels.bench_inputs(1, 64)
    busy = kernel_profile.busy_ms(kernels.METHODS["linmem GDN"], x, 2, kernels.DEVICE)
    found = kernel_profile.profile_method(kernels.METHODS["linmem GDN"], x, 2, kernels.DEVICE)
    assert busy > 0 and found["busy_ms"] > 0
    assert 0.2 < busy / found["busy_ms"] < 5  # the same call's CPU time twice, within a dry run's scatter


def test_profile_of_a_real_step_in_the_interpreter(monkeypatch):
    """``profile_kernels`` itself, on a CPU dry-run shape: one busy time per step, their median, the top rows."""
    from linmem.bench import kernel_profile

    kernels = _kernels(monkeypatch)
    kernels._set_shape(1, 16)
    found = kernels.profile_kernels(1, 64, "linmem sGLA", repeats=2)
    assert len(found["steps_ms"]) == 2 and all(ms > 0 for ms in found["steps_ms"])
    assert min(found["steps_ms"]) <= found["busy_ms"] <= max(found["steps_ms"])
    # one thread runs the ops one after another: their own times fit in the span they cover
    assert all(span >= busy * (1 - 1e-6) for span, busy in zip(found["spans_ms"], found["steps_ms"]))
    assert 0 < len(found["rows"]) <= kernel_profile.PROFILE_TOP


@pytest.mark.parametrize("given, expected", [([], (1, 64, "wall")),
                                             (["--sweep-at", "4,16", "--sweep-metric", "busy"], (4, 16, "busy"))])
def test_the_sweep_times_at_the_batch_and_length_asked_for(tmp_path, monkeypatch, given, expected):
    """``--sweep-at B,T`` is the shape the sweep times (default: one sequence of --tokens, at most 32768), and
    ``--sweep-metric`` what it compares (default: wall time)."""
    kernels = _kernels(monkeypatch)
    from linmem.ops.triton import function

    swept = []

    def tune(variants, B, T, deadline=None, metric="wall"):
        swept.append((B, T, metric))
        return function.kernel_options(kernels.HEAD_DIM, kernels.VALUE_DIM)

    monkeypatch.setattr(kernels, "tune", tune)
    monkeypatch.setattr(kernels, "time_method", lambda fn, x, backward: 1.0)
    kernels.main([*DRY_RUN, "--lengths", "64", "--methods", "linmem sGLA", "--sweep", "--sweep-kernels", "decay_grad",
                  *given, "--out", str(tmp_path)])
    assert swept == [expected]


@pytest.mark.parametrize("bad", ["4", "4,0", "a,b", "1,2,3"])
def test_sweep_at_refuses_what_is_not_a_batch_and_a_length(bad):
    from linmem.bench import kernels

    with pytest.raises(SystemExit):
        kernels.main(["--sweep-at", bad, "--render", "--out", "/nonexistent"])


def _additive_errors(x: dict) -> torch.Tensor:
    """err_t = v_t − S_{t−1}k_t of the additive rule in closed form: S_{t−1} = e^{G_{t−1}} S0 + Σ_{s<t}
    e^{G_{t−1} − G_s} β_s v_s k_sᵀ with G the running sum of the log decays (one sequence per batch row)."""
    G = x["g"].cumsum(1)  # [B, T, H]
    G_before = torch.cat([torch.zeros_like(G[:, :1]), G[:, :-1]], 1)  # G_{t−1}
    from_s0 = torch.einsum("bhvk,bthk->bthv", x["S0"], x["k"]) * G_before.exp()[..., None]
    scores = torch.einsum("bshk,bthk->bhts", x["k"], x["k"])  # k_sᵀ k_t
    weights = (G_before.transpose(1, 2)[..., :, None] - G.transpose(1, 2)[..., None, :]).exp()  # e^{G_{t−1} − G_s}
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril(-1)
    mixing = torch.where(causal, scores * weights * x["beta"].transpose(1, 2)[..., None, :], 0.0)
    return x["v"] - from_s0 - torch.einsum("bhts,bshv->bthv", mixing, x["v"])


def test_base_errors_are_the_base_memorys_prediction_errors_and_restart_per_sequence():
    from linmem.bench import kernel_checks

    seed = int(torch.randint(0, 2**31, ()).item())
    x = {n: t.double() for n, t in kernel_checks.random_inputs(2, 40, 3, 8, 5, torch.float64, "cpu", seed).items()}
    found = kernel_checks.base_errors(x, "additive")
    assert found.dtype == torch.float64 and found.shape == x["v"].shape
    torch.testing.assert_close(found, _additive_errors(x), rtol=1e-10, atol=1e-10)
    # the delta rule's first error is v − S0 k; its later ones differ from the additive rule's
    delta = kernel_checks.base_errors(x, "delta")
    torch.testing.assert_close(delta[:, 0], found[:, 0])
    assert (delta[:, 5:] - found[:, 5:]).abs().max() > 1e-3
    # packed sequences: each from its own initial state, as if run alone (an empty sequence in between)
    one = kernel_checks.random_inputs(1, 40, 3, 8, 5, torch.float64, "cpu", seed + 1)
    bounds = [0, 15, 15, 40]
    one["S0"] = torch.randn(3, 3, 5, 8, dtype=torch.float64)
    packed = kernel_checks.base_errors(one, "delta", bounds)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            alone = {n: t[:, start:end] if t.dim() > 1 and n != "S0" else t for n, t in one.items()}
            alone["S0"] = one["S0"][i:i + 1]
            torch.testing.assert_close(packed[:, start:end], kernel_checks.base_errors(alone, "delta"))


def test_clip_dv_error_leaves_out_only_the_elements_beside_the_clip():
    from linmem.bench import kernel_checks

    err = torch.randn(2, 50, 3, 16, dtype=torch.float64)
    want = torch.randn_like(err)
    near = (err.abs() - 1.0).abs() < 0.05
    assert near.any() and not near.all()
    flipped = want + torch.where(near, 5.0, 0.0)  # a flip's whole term, beside the clip only
    found = kernel_checks.clip_dv_error(flipped, want, err, clip=1.0, band=0.05)
    assert found["dv"] == 0.0 and found["dv_all"] > 0.1 and found["flip_band"] == near.double().mean().item()
    wrong = want + 0.05 * torch.randn_like(want)  # an error everywhere is not hidden
    assert kernel_checks.clip_dv_error(wrong, want, err, clip=1.0, band=0.05)["dv"] > 0.03


def test_a_clip_case_judges_dv_beside_the_band_and_records_it_whole(monkeypatch):
    """run_check in the interpreter: a clip case reports dv without the flip band, dv_all and the band's share, and
    passes; a tanh case has none of them."""
    from linmem.bench import kernel_checks

    kernels = _kernels(monkeypatch)
    case = dict(rule="delta", residual=True, dtype="float32", B=1, T=70, H=1, K=16, V=16)
    found = kernel_checks.run_check(case, kernels.DEVICE)
    assert found["passed"], found
    assert 0.0 <= found["flip_band"] < 0.2 and found["dv_all"] < 1e-3 and found["errors"]["dv"] < 1e-3
    smooth = kernel_checks.run_check(dict(case, options=dict(residual_target="tanh")), kernels.DEVICE)
    assert "dv_all" not in smooth and "flip_band" not in smooth


# ------------------------------------------------------------------------------------------------ --rounds


def _scripted_timings(monkeypatch, kernels, values: dict, clock=None):
    """``time_method`` replaced by a recorder: each call appends (method, mode, T) to the returned list and returns
    the next of ``values[(method, mode, T)]`` (an exception instance there is raised instead); ``clock``, if given,
    a callable run on every call (a fake clock's step)."""
    by_fn = {id(fn): name for name, fn in kernels.METHODS.items()}
    calls = []

    def timed(fn, x, backward):
        name, mode, T = by_fn[id(fn)], "fwd+bwd" if backward else "fwd", x["q"].shape[1]
        done = sum(call == (name, mode, T) for call in calls)
        calls.append((name, mode, T))
        if clock is not None:
            clock()
        value = values[name, mode, T]
        value = value[done] if isinstance(value, list) else value
        if isinstance(value, BaseException):
            raise value
        return value

    monkeypatch.setattr(kernels, "time_method", timed)
    return calls


def _rows(report: dict) -> dict:
    return {(r["method"], r["mode"], r["T"]): r for r in report["results"]}


def test_rounds_alternate_the_order_and_each_cell_is_the_median_of_its_rounds(tmp_path, monkeypatch, capsys):
    """``--rounds 3``: at each length the methods are timed in the order given, then reversed, then in order again
    (both modes within a method's turn); each row keeps its rounds' times and their median, and the report gives
    each round's A / B ratio of the times timed in that round."""
    import random

    kernels = _kernels(monkeypatch)
    rng = random.Random()
    methods, lengths = ["linmem RDN", "FLA GDN"], [64, 32]
    values = {(name, mode, T): [rng.uniform(0.5, 5.0) for _ in range(3)]
              for name in methods for mode in ("fwd", "fwd+bwd") for T in lengths}
    calls = _scripted_timings(monkeypatch, kernels, values)
    kernels.main([*DRY_RUN, "--lengths", "64,32", "--methods", ",".join(methods), "--rounds", "3",
                  "--out", str(tmp_path)])
    a, b = methods
    turn = lambda name, T: [(name, "fwd", T), (name, "fwd+bwd", T)]  # noqa: E731
    assert calls == [call for T in lengths
                     for call in turn(a, T) + turn(b, T) + turn(b, T) + turn(a, T) + turn(a, T) + turn(b, T)]
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert report["rounds"] == 3
    rows = _rows(report)
    assert set(rows) == set(values)
    for key, times in values.items():
        assert rows[key]["rounds_ms"] == pytest.approx(times)
        assert rows[key]["ms"] == pytest.approx(sorted(times)[1])
    page = (tmp_path / "kernels.md").read_text()
    assert "3 rounds in alternating order (ABBA), each cell the median of the rounds" in page

    def per_round(mode, T):
        return ", ".join(f"{x / y:.2f}" for x, y in zip(values[a, mode, T], values[b, mode, T]))

    for mode, after in (("fwd+bwd", "## fwd+bwd"), ("fwd", "## fwd\n")):
        section = page.split(after)[1].split("##")[0]
        table = [line for line in section.split("per round")[1].splitlines() if line.startswith("|")]
        assert table == ["| T | RDN / FLA GDN |", "|---|---|"] + [f"| {T} | {per_round(mode, T)} |"
                                                                  for T in sorted(lengths)]
    out = capsys.readouterr().out
    assert ("RDN / FLA GDN per round (3, ABBA): "
            + "; ".join(f"T={T} {per_round('fwd+bwd', T)}" for T in sorted(lengths))) in out.splitlines()


def test_rounds_do_not_time_again_what_failed_or_was_stopped(tmp_path, monkeypatch):
    """A method whose first timing raised is not timed again, one stopped by the budget neither, and one that
    fails in a later round keeps the rounds before; the other methods get all their rounds, in ABBA order."""
    import random

    kernels = _kernels(monkeypatch)
    rng = random.Random()
    good = {(name, mode, 64): [rng.uniform(0.5, 5.0) for _ in range(3)]
            for name in ("linmem sGLA", "linmem RDN") for mode in ("fwd", "fwd+bwd")}
    broken = RuntimeError("no kernel")
    stopped = kernels.OverBudget("stopped after 20 s: the time budget is spent")  # what the alarm raises
    values = {**good, ("linmem GDN", "fwd", 64): broken, ("linmem GDN", "fwd+bwd", 64): broken,
              ("linmem RLA", "fwd", 64): stopped, ("linmem RLA", "fwd+bwd", 64): 1.0}
    values["linmem RDN", "fwd+bwd", 64] = values["linmem RDN", "fwd+bwd", 64][:1] + [broken]  # fails in round 2
    calls = _scripted_timings(monkeypatch, kernels, values)
    methods = ["linmem GDN", "linmem sGLA", "linmem RLA", "linmem RDN"]
    kernels.main([*DRY_RUN, "--lengths", "64", "--methods", ",".join(methods), "--rounds", "3",
                  "--out", str(tmp_path)])
    both = lambda name: [(name, "fwd", 64), (name, "fwd+bwd", 64)]  # noqa: E731
    assert calls == (both("linmem GDN") + both("linmem sGLA") + [("linmem RLA", "fwd", 64)] + both("linmem RDN")
                     + both("linmem RDN") + both("linmem sGLA")
                     + both("linmem sGLA") + [("linmem RDN", "fwd", 64)])
    report = json.loads((tmp_path / "kernels.json").read_text())
    rows = _rows(report)
    assert [rows["linmem GDN", mode, 64]["ms"] for mode in ("fwd", "fwd+bwd")] == [None, None]
    assert ("linmem RLA", "fwd", 64) not in rows and ("linmem RLA", "fwd+bwd", 64) not in rows
    assert any(s.startswith("linmem RLA T=64 from fwd (stopped after 20 s") for s in report["skipped"])
    for mode in ("fwd", "fwd+bwd"):
        assert rows["linmem sGLA", mode, 64]["rounds_ms"] == pytest.approx(good["linmem sGLA", mode, 64])
    assert rows["linmem RDN", "fwd", 64]["rounds_ms"] == pytest.approx(good["linmem RDN", "fwd", 64])
    late = rows["linmem RDN", "fwd+bwd", 64]
    assert late["rounds_ms"] == pytest.approx(values["linmem RDN", "fwd+bwd", 64][:1])
    assert late["ms"] == pytest.approx(late["rounds_ms"][0])
    assert "linmem RDN T=64 fwd+bwd from round 2 of 3 (RuntimeError)" in report["skipped"]
    # RDN / GDN: GDN has no round, so no per-round ratio
    per_round = (tmp_path / "kernels.md").read_text().split("## fwd+bwd")[1].split("##")[0].split("per round")[1]
    assert [line for line in per_round.splitlines() if line.startswith("|")] == ["| T | RDN / GDN |", "|---|---|",
                                                                                 "| 64 | – |"]


def test_rounds_stop_where_the_budget_is_spent_and_list_what_is_left(tmp_path, monkeypatch):
    """The budget is checked before every method's turn: once spent, the remaining rounds are not run, what was
    measured stays, and each method's missing rounds are listed as skipped."""
    kernels = _kernels(monkeypatch)
    now = [1000.0]

    def step():  # each timing takes 30 s of a fake clock
        now[0] += 30.0

    monkeypatch.setattr(kernels, "time", SimpleNamespace(time=lambda: now[0], perf_counter=time.perf_counter))
    values = {(name, mode, 64): 1.0 for name in ("linmem sGLA", "linmem GDN") for mode in ("fwd", "fwd+bwd")}
    calls = _scripted_timings(monkeypatch, kernels, values, clock=step)
    # 100 s: round 0 (four timings, 120 s) runs whole, as a turn started within the budget finishes its modes
    kernels.main([*DRY_RUN, "--lengths", "64", "--methods", "linmem sGLA,linmem GDN", "--rounds", "3", "--budget",
                  "100", "--out", str(tmp_path)])
    assert calls == [(name, mode, 64) for name in ("linmem sGLA", "linmem GDN") for mode in ("fwd", "fwd+bwd")]
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert all(r["rounds_ms"] == [1.0] and r["ms"] == 1.0 for r in report["results"]) and len(report["results"]) == 4
    assert report["skipped"] == ["linmem sGLA T=64: 1 of 3 rounds", "linmem GDN T=64: 1 of 3 rounds"]


def test_one_round_is_the_run_without_the_option(tmp_path, monkeypatch):
    """``--rounds 1`` (the default) writes the report a run without the option writes: no ``rounds`` nor
    ``rounds_ms``, the tables and sentence as they were."""
    kernels = _kernels(monkeypatch)
    values = {("linmem RDN", mode, 64): 2.0 for mode in ("fwd", "fwd+bwd")}
    values.update({("linmem GDN", mode, 64): 1.0 for mode in ("fwd", "fwd+bwd")})
    pages, reports = [], []
    for given in ([], ["--rounds", "1"]):
        calls = _scripted_timings(monkeypatch, kernels, values)
        out = tmp_path / str(len(given))
        kernels.main([*DRY_RUN, "--lengths", "64", "--methods", "linmem RDN,linmem GDN", *given, "--out", str(out)])
        assert len(calls) == 4
        pages.append((out / "kernels.md").read_text())
        reports.append(json.loads((out / "kernels.json").read_text()))
    assert pages[0] == pages[1]
    assert reports[0]["results"] == reports[1]["results"] and reports[0].keys() == reports[1].keys()
    assert "rounds" not in reports[1] and all("rounds_ms" not in r for r in reports[1]["results"])
    assert "per round" not in pages[1] and "ABBA" not in pages[1]
    assert ("`triton.testing.do_bench` medians in ms; A / B: the two methods' times, measured side by side in this "
            "run. Command: `python -m linmem.bench.kernels`.") in pages[1]
    table = pages[1].split("## fwd+bwd")[1].strip().splitlines()
    assert table[:4] == ["| T | linmem RDN | linmem GDN | RDN / GDN |", "|---|---|---|---|",
                         "| 64 | 2.00 | 1.00 | 2.00x |", ""]
    assert table[4] == "## fwd"


def test_fla_alone_may_run_wider_than_linmems_widest_launch_row(tmp_path, monkeypatch):
    """FLA's GDN at twice a wide head's value width (V = 512 for K = V = 256) has no linmem launch row: a run of FLA
    methods only reports none instead of failing after its timings; a linmem method at that width is still refused
    by its own row lookup."""
    kernels = _kernels(monkeypatch)
    from linmem.ops.triton import function

    wide = 2 * function.WIDTH_CLASSES[-1]
    _scripted_timings(monkeypatch, kernels, {("FLA GDN", mode, 64): 1.0 for mode in ("fwd", "fwd+bwd")})
    kernels.main([*DRY_RUN, "--value-dim", str(wide), "--lengths", "64", "--methods", "FLA GDN", "--out",
                  str(tmp_path)])
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert report["kernel_options"] is None and report["value_dim"] == wide
    assert {r["method"] for r in report["results"]} == {"FLA GDN"}
    assert "Launch options" not in (tmp_path / "kernels.md").read_text()
    with pytest.raises(ValueError, match="over the widest launch class"):
        function.kernel_options(16, wide)


def test_a_2v_method_is_profiled_on_the_wide_values_it_is_timed_on(monkeypatch):
    """FLA's GDN at twice the value width (the state work of RDN's two memories) reads ``v_wide``: its profile gets
    the inputs its timing gets, so that the busy times hold RDN / FLA GDN 2V beside the other ratios."""
    from linmem.bench import kernel_profile

    kernels = _kernels(monkeypatch)
    seen = {}

    def recorded(fn, x, repeats, device):
        seen[fn] = set(x)
        return {"rows": [], "steps_ms": [1.0], "busy_ms": 1.0}

    monkeypatch.setattr(kernel_profile, "profile_method", recorded)
    kernels.profile_kernels(1, 64, "FLA GDN 2V", 1)
    kernels.profile_kernels(1, 64, "linmem RDN", 1)
    assert "v_wide" in seen[kernels.METHODS["FLA GDN 2V"]]
    assert "v_wide" not in seen[kernels.METHODS["linmem RDN"]]
