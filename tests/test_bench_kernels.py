"""``linmem.bench.kernels`` on the CPU: the order its correctness tasks run in (the memory-heavy ones after the
parallel pool, one at a time, within the deadline), the profile after the timings at each timed shape once, and the
report's GPU busy-time tables, old reports included.

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


def _event(key, device_type, device_ms=0.0, self_cpu_ms=0.0, annotation=False):
    return SimpleNamespace(key=key, device_type=device_type, device_time_total=1000 * device_ms,
                           self_cpu_time_total=1000 * self_cpu_ms, is_user_annotation=annotation)


def test_busy_time_sums_every_kernel_once_and_takes_step_medians():
    """On a GPU a step's busy time is the sum of every device record (a host op, whose device time is its kernels',
    an annotation spanning kernels and the profiler's own records are left out), not of the rows shown; steps are
    summarised by medians."""
    from torch.autograd import DeviceType

    from linmem.bench import kernels

    rng = __import__("random").Random()
    steps = []
    for _ in range(3):
        kernel_ms = [rng.uniform(0.01, 1.0) for _ in range(kernels.PROFILE_TOP + 6)]
        events = [_event(f"kernel_{i}", DeviceType.CUDA, ms) for i, ms in enumerate(kernel_ms)]
        events += [_event("aten::mm", DeviceType.CPU, device_ms=sum(kernel_ms), self_cpu_ms=5.0),
                   _event("LinearMemoryFunction", DeviceType.CUDA, sum(kernel_ms), annotation=True),
                   _event("Activity Buffer Request", DeviceType.CUDA, 7.0)]
        times = kernels.kernel_times(events, device="cuda")
        assert set(times) == {f"kernel_{i}" for i in range(len(kernel_ms))}
        assert sum(times.values()) == pytest.approx(sum(kernel_ms), rel=1e-12)
        steps.append(times)
    found = kernels.step_summary(steps)
    busy = [sum(step.values()) for step in steps]
    assert found["steps_ms"] == pytest.approx(busy) and found["busy_ms"] == pytest.approx(sorted(busy)[1])
    assert len(found["rows"]) == kernels.PROFILE_TOP
    medians = {name: sorted(step[name] for step in steps)[1] for name in steps[0]}
    want = sorted(medians.items(), key=lambda row: -row[1])[:kernels.PROFILE_TOP]
    assert [name for name, _ in found["rows"]] == [name for name, _ in want]
    assert [ms for _, ms in found["rows"]] == pytest.approx([ms for _, ms in want])
    # the CPU dry run: each op's own CPU time
    cpu = kernels.kernel_times([_event("aten::mm", DeviceType.CPU, device_ms=9.0, self_cpu_ms=2.0)], device="cpu")
    assert cpu == {"aten::mm": pytest.approx(2.0)}


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
    from linmem.bench import kernels

    report = _report({"linmem RDN": 2.51, "FLA GDN": 1.57, "linmem RLA": 2.0},
                     busy={"linmem RDN": 1.8, "FLA GDN": 1.2, "linmem RLA": 1.1}, lengths=(2048, 8192))
    page = kernels.markdown(report)
    section = page.split("## GPU busy time per fwd+bwd (profiler)")[1].split("##")[0]
    assert "median of 3 profiled steps" in section
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table[0] == "| T | linmem RLA | linmem RDN | FLA GDN | RDN / FLA GDN |"
    assert table[2:] == ["| 2048 | 1.10 | 1.80 | 1.20 | 1.50x |", "| 8192 | 4.40 | 7.20 | 4.80 | 1.50x |"]
    assert page.index("## fwd+bwd") < page.index("## GPU busy")
    summary = kernels.summary(report).splitlines()
    assert summary[-4:] == ["| T | RDN / FLA GDN |", "|---|---|", "| 2048 | 1.80 / 1.20 ms = 1.50x |",
                            "| 8192 | 7.20 / 4.80 ms = 1.50x |"]
    assert summary[-5].startswith("GPU busy time per forward+backward (profiler, median of 3")
    assert "| 2048 | 2.51 / 1.57 ms = 1.60x |" in summary  # the do_bench table stays above it
    # without the busy times: no such table, and the summary ends with the do_bench one
    plain = _report({"linmem RDN": 2.51, "FLA GDN": 1.57})
    assert "GPU busy" not in kernels.markdown(plain) and "GPU busy" not in kernels.summary(plain)
    assert kernels.summary(plain).splitlines()[-1] == "| 2048 | 2.51 / 1.57 ms = 1.60x |"
    # no pair profiled: the busy times alone
    alone = _report({"linmem RDN": 2.51, "FLA GDN": 1.57}, busy={"linmem RDN": 1.8})
    assert kernels.summary(alone).splitlines()[-2:] == ["|---|---|", "| 2048 | 1.80 |"]


def test_summary_counts_unfinished_correctness_and_compile_tasks_not_skipped_timings():
    from linmem.bench import kernels

    report = _report({"linmem RDN": 2.51, "FLA GDN": 1.57})
    report["skipped"] = ["check RDN float32 B=2 T=300", "offsets {}", "compile {'method': 'FLA GDN'}", "T=8192",
                         "linmem GDN T=2048", "linmem GDN T=64 from fwd (stopped after 20 s)"]
    assert "3 correctness/compile tasks not finished" in kernels.summary(report)


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
        return dict(rows=[("k", 0.5)], busy_ms=0.75, steps_ms=[0.75] * repeats)

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
        "linmem RDN", "linmem GDN", "FLA GDN"]
    assert kernels.default_profile_methods(["FLA GDN", "linmem RDN", "FLA GDN 2V"]) == ["linmem RDN", "FLA GDN"]
    assert kernels.default_profile_methods(["linmem RDN", "FLA GDN 2V"]) == ["linmem RDN", "linmem RLA"]


def test_profile_of_a_real_step_in_the_interpreter(monkeypatch):
    """``profile_kernels`` itself, on a CPU dry-run shape: one busy time per step, their median, the top rows."""
    kernels = _kernels(monkeypatch)
    kernels._set_shape(1, 16)
    found = kernels.profile_kernels(1, 64, "linmem sGLA", repeats=2)
    assert len(found["steps_ms"]) == 2 and all(ms > 0 for ms in found["steps_ms"])
    assert min(found["steps_ms"]) <= found["busy_ms"] <= max(found["steps_ms"])
    assert 0 < len(found["rows"]) <= kernels.PROFILE_TOP


@pytest.mark.parametrize("given, expected", [([], (1, 64)), (["--sweep-at", "4,16"], (4, 16))])
def test_the_sweep_times_at_the_batch_and_length_asked_for(tmp_path, monkeypatch, given, expected):
    """``--sweep-at B,T`` is the shape the sweep times (default: one sequence of --tokens, at most 32768)."""
    kernels = _kernels(monkeypatch)
    from linmem.ops.triton import function

    swept = []

    def tune(variants, B, T, deadline=None):
        swept.append((B, T))
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
    from linmem.bench import kernels

    seed = int(torch.randint(0, 2**31, ()).item())
    x = {n: t.double() for n, t in kernels.random_inputs(2, 40, 3, 8, 5, torch.float64, "cpu", seed).items()}
    found = kernels.base_errors(x, "additive")
    assert found.dtype == torch.float64 and found.shape == x["v"].shape
    torch.testing.assert_close(found, _additive_errors(x), rtol=1e-10, atol=1e-10)
    # the delta rule's first error is v − S0 k; its later ones differ from the additive rule's
    delta = kernels.base_errors(x, "delta")
    torch.testing.assert_close(delta[:, 0], found[:, 0])
    assert (delta[:, 5:] - found[:, 5:]).abs().max() > 1e-3
    # packed sequences: each from its own initial state, as if run alone (an empty sequence in between)
    one = kernels.random_inputs(1, 40, 3, 8, 5, torch.float64, "cpu", seed + 1)
    bounds = [0, 15, 15, 40]
    one["S0"] = torch.randn(3, 3, 5, 8, dtype=torch.float64)
    packed = kernels.base_errors(one, "delta", bounds)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            alone = {n: t[:, start:end] if t.dim() > 1 and n != "S0" else t for n, t in one.items()}
            alone["S0"] = one["S0"][i:i + 1]
            torch.testing.assert_close(packed[:, start:end], kernels.base_errors(alone, "delta"))


def test_clip_dv_error_leaves_out_only_the_elements_beside_the_clip():
    from linmem.bench import kernels

    err = torch.randn(2, 50, 3, 16, dtype=torch.float64)
    want = torch.randn_like(err)
    near = (err.abs() - 1.0).abs() < 0.05
    assert near.any() and not near.all()
    flipped = want + torch.where(near, 5.0, 0.0)  # a flip's whole term, beside the clip only
    found = kernels.clip_dv_error(flipped, want, err, clip=1.0, band=0.05)
    assert found["dv"] == 0.0 and found["dv_all"] > 0.1 and found["flip_band"] == near.double().mean().item()
    wrong = want + 0.05 * torch.randn_like(want)  # an error everywhere is not hidden
    assert kernels.clip_dv_error(wrong, want, err, clip=1.0, band=0.05)["dv"] > 0.03


def test_a_clip_case_judges_dv_beside_the_band_and_records_it_whole(monkeypatch):
    """run_check in the interpreter: a clip case reports dv without the flip band, dv_all and the band's share, and
    passes; a tanh case has none of them."""
    kernels = _kernels(monkeypatch)
    found = kernels.run_check(dict(rule="delta", residual=True, dtype="float32", B=1, T=70, H=1, K=16, V=16))
    assert found["passed"], found
    assert 0.0 <= found["flip_band"] < 0.2 and found["dv_all"] < 1e-3 and found["errors"]["dv"] < 1e-3
    smooth = kernels.run_check(dict(rule="delta", residual=True, dtype="float32", B=1, T=70, H=1, K=16, V=16,
                                    options=dict(residual_target="tanh")))
    assert "dv_all" not in smooth and "flip_band" not in smooth
