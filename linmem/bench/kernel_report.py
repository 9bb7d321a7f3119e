"""The kernel benchmark's report as text and pictures: kernels.md, the summary a run ends with, kernels.png, and the
row of launch options a sweep prints, all from the report dict (kernels.json) and the benchmark's method names."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from pathlib import Path

import torch

from linmem.bench.kernel_checks import CLIP_COUPLED_TOLERANCE, FLIP_BAND, TOLERANCE
from linmem.io.atomic import atomic_write

# (label, A, B): the report's A / B columns, each shown when a run timed both methods
RATIOS = [("GDN / FLA GDN", "linmem GDN", "FLA GDN"), ("sGLA / FLA sGLA", "linmem sGLA", "FLA sGLA"),
          ("RDN / FLA GDN", "linmem RDN", "FLA GDN"), ("RLA / FLA sGLA", "linmem RLA", "FLA sGLA"),
          ("GLA / FLA GLA", "linmem GLA", "FLA GLA"),
          ("RDN / FLA GDN 2V", "linmem RDN", "FLA GDN 2V"), ("RLA / FLA sGLA 2V", "linmem RLA", "FLA sGLA 2V"),
          ("RDN / GDN", "linmem RDN", "linmem GDN"), ("RLA / sGLA", "linmem RLA", "linmem sGLA")]
# the summary's further pairs: linmem's two-memory ops against the same op composed from three FLA calls
THREE_CALL_RATIOS = [("RDN / 3-call", "linmem RDN", "FLA 3-call RDN"), ("RLA / 3-call", "linmem RLA", "FLA 3-call RLA")]
GOAL = 1.5  # issue 3: linmem RDN <= 1.5x FLA GDN and RLA <= 1.5x FLA sGLA, forward+backward
# heads and head dim of a report that does not record them: every run that wrote such a report timed these
UNRECORDED_SHAPE = (16, 128)


def markdown(report: dict, methods: Collection[str], chunked: Sequence[str]) -> str:
    """kernels.md: the timings by mode, the GPU busy times, the correctness checks and what was not run. ``methods``:
    every method's name in the order the tables list them; ``chunked``: those on linmem's chunked kernels, whose
    launch options the page lists when it timed one of them."""
    results = report["results"]
    names = _timed(report, methods)
    ratios = [pair for pair in RATIOS if pair[1] in names and pair[2] in names]
    lengths = sorted({r["T"] for r in results})
    heads, widths = _shape(report)
    rounds = report.get("rounds", 1)
    lines = [f"# Kernel benchmark: {report['env']['gpu']}", "",
             f"torch {report['env']['torch']}, triton {report['env']['triton']}, FLA {report['env']['fla']}, "
             f"CUDA {report['env']['cuda']}. bf16, H = {heads}, {widths}, {report['tokens']} tokens per "
             "batch (B = tokens / T), `triton.testing.do_bench` medians in ms"
             + (f", {rounds} rounds in alternating order (ABBA), each cell the median of the rounds" if rounds > 1
                else "")
             + "; A / B: the two methods' times, measured side by side in this run. Command: "
             "`python -m linmem.bench.kernels`.", ""]
    for mode in ("fwd+bwd", "fwd"):
        lines += [f"## {mode}", "", "| T | " + " | ".join(names + [label for label, _, _ in ratios]) + " |",
                  "|---" * (len(names) + 1 + len(ratios)) + "|"]
        for T in lengths:
            ms = {r["method"]: r["ms"] for r in results if r["T"] == T and r["mode"] == mode}
            cells = [_ms(ms, n) for n in names] + [_ratio(ms, a, b) for _, a, b in ratios]
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
        lines.append("")
        if rounds > 1 and ratios:  # the paired ratios the medians above come from, one per round
            lines += [f"{mode} per round: round r's A / round r's B, rounds in the order timed.", "",
                      "| T | " + " | ".join(label for label, _, _ in ratios) + " |", "|---" * (len(ratios) + 1) + "|"]
            for T in lengths:
                timed = _rows(results, T, mode)
                lines.append(f"| {T} | " + " | ".join(_per_round(timed, a, b) for _, a, b in ratios) + " |")
            lines.append("")
    busy = report.get("gpu_busy")
    if busy:
        profiled = [name for name in methods if any(b["method"] == name for b in busy)]
        pairs = [pair for pair in RATIOS if pair[1] in profiled and pair[2] in profiled]
        lines += ["## GPU busy time per fwd+bwd (profiler)", "",
                  f"The sum of the device times of every kernel one forward+backward runs (torch.profiler), "
                  f"{_profiled_steps(report)}, profiled after the timings at the same B and T. `do_bench` above "
                  "measures the wall time between two events, which also counts the host's gaps between launches; "
                  "this counts the kernels only. A / B: the two methods' busy times.", "",
                  "| T | " + " | ".join(profiled + [label for label, _, _ in pairs]) + " |",
                  "|---" * (len(profiled) + 1 + len(pairs)) + "|"]
        for T in sorted({b["T"] for b in busy}):
            ms = _busy_ms(busy, T)
            cells = [_ms(ms, n) for n in profiled] + [_ratio(ms, a, b) for _, a, b in pairs]
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += _span_table(busy, profiled)
        lines += [line + "\n" for line in host_bound(report, profiled)]
    checks = report.get("checks") or []
    if checks:
        passed = sum(c["passed"] for c in checks)
        lines += ["## Correctness (linmem Triton vs float64 reference, relative Frobenius errors)", "",
                  f"{passed} of {len(checks)} cases within tolerance (fp32 {TOLERANCE[torch.float32]:.0e}, bf16 "
                  f"{TOLERANCE[torch.bfloat16]:.0e}; clip cases' dv, dk, dg, dβ, dS0 "
                  f"{CLIP_COUPLED_TOLERANCE[torch.float32]:.1e} / {CLIP_COUPLED_TOLERANCE[torch.bfloat16]:.1e}, "
                  f"their dv without the elements whose float64 error lies within {FLIP_BAND[torch.float32]:.0e} / "
                  f"{FLIP_BAND[torch.bfloat16]:.0e} of ±clip, where rounding flips the clip's slope; dv_all: every "
                  "element, not judged). "
                  "Fresh random inputs each run, NaN-poisoned buffers.", "",
                  "| case | worst | o | dq | dk | dv | dv_all (band share) | dg | dβ | dγ | dS0 | dR0 |",
                  "|---" * 12 + "|"]
        for c in sorted(checks, key=lambda c: c["case"]):
            e = c["errors"] or {"o": math.inf}
            cols = ["–" if e.get(k) is None else f"{e[k]:.1e}"
                    for k in ("o", "dq", "dk", "dv", "dg", "dbeta", "dgamma", "dS0", "dR0")]
            cols.insert(4, f"{c['dv_all']:.1e} ({c['flip_band']:.1%})" if "dv_all" in c else "–")
            lines.append(f"| {c['case']} | {c['worst']:.1e} | " + " | ".join(cols) + " |")
        lines.append("")
    for key in ("offsets", "finite"):
        found = report.get(key)
        if found:
            what = found.get("case") or f"no NaN/Inf in outputs and gradients at T = {found.get('T')}"
            verdict = ("passed" if found["passed"] else
                       f"NOT RUN ({found['error'][:160]})" if "error" in found else "FAILED")
            lines += [f"{verdict}: {what} {found.get('finite') or ''}".strip(), ""]
    tuned = report.get("tuned_checks")
    if tuned:
        bad = [c["case"] for c in tuned["checks"] if not c["passed"]]
        bad += [key for key in ("offsets", "finite") if tuned.get(key) and not tuned[key]["passed"]]
        lines += [f"Checked again with the sweep's winners ({json.dumps(tuned['options'])}), the launch options the "
                  f"timings used: {sum(c['passed'] for c in tuned['checks'])} of {len(tuned['checks'])} cases within "
                  "tolerance" + (f"; failed: {', '.join(bad)}" if bad else "; offsets and finiteness checks "
                                 + ("passed" if tuned.get("offsets") and tuned.get("finite") else "not finished"))
                  + (f"; not finished: {', '.join(tuned['unfinished'])}" if tuned["unfinished"] else "") + ".", ""]
    if report.get("skipped"):
        lines += ["Not run or not measured within the time budget: " + ", ".join(report["skipped"]), ""]
    if report.get("kernel_options") and set(names) & set(chunked):
        lines += ["Launch options of linmem's chunked kernels (" + ", ".join(chunked) + "): `"
                  + json.dumps(report["kernel_options"]) + "`", ""]
    return "\n".join(lines)


def summary(report: dict, methods: Collection[str]) -> str:
    """The short table the run ends with: forward+backward ms against the goal, and the correctness verdict
    (``methods``: every method's name, in the order the tables list them)."""
    checks = report.get("checks") or []
    verdicts = [f"checks {sum(c['passed'] for c in checks)}/{len(checks)} passed"]
    for key in ("offsets", "finite"):
        if report.get(key):
            found = report[key]
            verdicts.append(f"{key} {'ok' if found['passed'] else 'not run' if 'error' in found else 'FAILED'}")
    tuned = report.get("tuned_checks")
    if tuned:
        verdicts.append(f"with the sweep's winners {sum(c['passed'] for c in tuned['checks'])}/"
                        f"{len(tuned['checks'])} passed")
    # correctness and compile tasks are listed by kind ("check ...", "compile {...}"); method timings by name
    unfinished = [s for s in report.get("skipped", []) if s.split(" ", 1)[0] in ("check", "offsets", "finite",
                                                                                "compile")]
    if unfinished:
        verdicts.append(f"{len(unfinished)} correctness/compile tasks not finished")
    names = _timed(report, methods)
    pairs = [pair for pair in RATIOS + THREE_CALL_RATIOS if pair[1] in names and pair[2] in names]
    heads, widths = _shape(report)
    lines = ["", f"Summary: forward+backward, bf16, H = {heads}, {widths}, {report['tokens']} tokens per batch"
             f" (goal for RDN / FLA GDN and RLA / FLA sGLA: <= {GOAL}); " + ", ".join(verdicts)]
    if pairs:  # each cell "A ms / B ms = A / B"
        lines += ["| T | " + " | ".join(label for label, _, _ in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    else:  # no pair of linmem and FLA methods timed: the times alone
        lines += ["| T | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for T in sorted({r["T"] for r in report["results"]}):
        ms = {r["method"]: r["ms"] for r in report["results"] if r["T"] == T and r["mode"] == "fwd+bwd"}
        cells = ([f"{_ms(ms, a)} / {_ms(ms, b)} ms = {_ratio(ms, a, b)}" for _, a, b in pairs] if pairs
                 else [_ms(ms, name) for name in names])
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    if report.get("rounds", 1) > 1:  # each pair's paired ratios, one per round, at every length
        lengths = sorted({r["T"] for r in report["results"]})
        lines += [f"{label} per round ({report['rounds']}, ABBA): " + "; ".join(
            f"T={T} {_per_round(_rows(report['results'], T, 'fwd+bwd'), a, b)}" for T in lengths)
            for label, a, b in pairs]
    busy = report.get("gpu_busy")
    if busy:  # the same pairs by the kernels' device time alone, measured in the same run
        profiled = [name for name in methods if any(b["method"] == name for b in busy)]
        pairs = [pair for pair in RATIOS + THREE_CALL_RATIOS if pair[1] in profiled and pair[2] in profiled]
        lines += [f"GPU busy time per forward+backward (profiler, {_profiled_steps(report)})"]
        if pairs:
            lines += ["| T | " + " | ".join(label for label, _, _ in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
        else:
            lines += ["| T | " + " | ".join(profiled) + " |", "|---" * (len(profiled) + 1) + "|"]
        for T in sorted({b["T"] for b in busy}):
            ms = _busy_ms(busy, T)
            cells = ([f"{_ms(ms, a)} / {_ms(ms, b)} ms = {_ratio(ms, a, b)}" for _, a, b in pairs] if pairs
                     else [_ms(ms, name) for name in profiled])
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
        lines += host_bound(report, profiled)
    return "\n".join(lines)


HOST_BOUND_MARGIN = 0.15  # wall time this far over the kernels' busy time: the host's launches set the pace


def host_bound(report: dict, methods: Collection[str]) -> list[str]:
    """One warning per length at which some of ``methods`` took HOST_BOUND_MARGIN or more wall time (``do_bench``,
    fwd+bwd) than GPU busy time: there the host's launches, not the kernels, set the wall times, and a wall-time
    ratio compares launch overheads (a slower host draws every method's wall ratio towards 1), where the busy ratio
    still compares the kernels. Nothing where every profiled method kept within the margin."""
    warnings = []
    for T in sorted({b["T"] for b in report.get("gpu_busy") or ()}):
        busy = _busy_ms(report["gpu_busy"], T)
        wall = {name: row["ms"] for name, row in _rows(report["results"], T, "fwd+bwd").items() if row.get("ms")}
        over = {name: wall[name] / busy[name] - 1 for name in methods
                if busy.get(name) and wall.get(name) and wall[name] > (1 + HOST_BOUND_MARGIN) * busy[name]}
        if over:
            listed = ", ".join(f"{name} {share:+.0%}" for name, share in over.items())
            warnings.append(f"Host-bound at T={T}: wall time over GPU busy time by {listed}. There the host's "
                            "launches set the wall times: compare the kernels by the busy-time ratios.")
    return warnings


def _span_table(busy: list[dict], profiled: list[str]) -> list[str]:
    """The profiled steps' spans, first kernel start to last kernel end, beside their busy times: span - busy is the
    GPU waiting inside the call (on the host's launches or a synchronisation), which ``do_bench``'s wall time counts
    and the busy time does not. Nothing for records without a span."""
    spanned = [name for name in profiled if any(b["method"] == name and "span_ms" in b for b in busy)]
    if not spanned:
        return []
    lines = ["First kernel to last, per fwd+bwd (medians of the same profiled steps): the span, and in brackets the "
             "GPU's waits inside it (span - busy).", "",
             "| T | " + " | ".join(spanned) + " |", "|---" * (len(spanned) + 1) + "|"]
    for T in sorted({b["T"] for b in busy}):
        found = {b["method"]: b for b in busy if b["T"] == T and "span_ms" in b}
        cells = [f"{found[n]['span_ms']:.2f} ({found[n]['span_ms'] - found[n]['ms']:.2f})" if n in found else "–"
                 for n in spanned]
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    return lines + [""]


def _busy_ms(busy: list[dict], T: int) -> dict:
    """Method → GPU busy ms per forward+backward at length ``T``."""
    return {b["method"]: b["ms"] for b in busy if b["T"] == T}


def _profiled_steps(report: dict) -> str:
    repeats = report.get("profile_repeats") or max(len(b.get("steps_ms", ())) for b in report["gpu_busy"])
    return f"median of {repeats} profiled steps" if repeats > 1 else "one profiled step"


def _timed(report: dict, methods: Collection[str]) -> list[str]:
    """The methods ``report`` holds results of (timed, or tried and failed), in the order of ``methods``."""
    return [name for name in methods if any(r["method"] == name for r in report["results"])]


def _shape(report: dict) -> tuple[int, str]:
    """The heads and the head widths the report's timings used ("head dim 128", or "head dim 128, value dim 256"
    where they differ; a report that does not record them: ``UNRECORDED_SHAPE``)."""
    head_dim = report.get("head_dim", UNRECORDED_SHAPE[1])
    value_dim = report.get("value_dim", head_dim)
    widths = f"head dim {head_dim}" + (f", value dim {value_dim}" if value_dim != head_dim else "")
    return report.get("heads", UNRECORDED_SHAPE[0]), widths


def _ms(ms, name):
    return f"{ms[name]:.2f}" if ms.get(name) is not None else "–"


def _ratio(ms, a, b):
    if ms.get(a) is None or ms.get(b) is None:
        return "–"
    return f"{ms[a] / ms[b]:.2f}x"


def _rows(results: list[dict], T: int, mode: str) -> dict:
    """Method → its result row at length ``T`` in ``mode``."""
    return {r["method"]: r for r in results if r["T"] == T and r["mode"] == mode}


def round_ratios(rows: dict, a: str, b: str) -> list[float]:
    """Round r's time of ``a`` over round r's time of ``b`` (``rows``: method → result row with ``rounds_ms``), for
    the rounds both were timed in: a method timed in fewer rounds has the first ones, as rounds run in order."""
    if a not in rows or b not in rows:
        return []
    return [x / y for x, y in zip(rows[a].get("rounds_ms", []), rows[b].get("rounds_ms", []))]


def _per_round(rows: dict, a: str, b: str) -> str:
    ratios = round_ratios(rows, a, b)
    return ", ".join(f"{ratio:.2f}" for ratio in ratios) if ratios else "–"


def plot(report: dict, path: Path, methods: Collection[str]) -> None:
    """kernels.png: time and throughput against the length, forward and forward+backward, one line per method in
    the order of ``methods``; with one length, bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads, widths = _shape(report)
    title = f"{report['env']['gpu']}: bf16, H={heads}, {widths}, {report['tokens']} tokens per batch"
    lengths = sorted({r["T"] for r in report["results"]})
    if len(lengths) == 1:  # one length: bars from zero, not points on log axes
        _plot_one_length(report, path, title.replace(": ", "\n", 1) + f", T = {lengths[0]}", methods)
        return
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for col, mode in enumerate(("fwd", "fwd+bwd")):
        for name in methods:
            rows = sorted((r["T"], r["ms"]) for r in report["results"]
                          if r["method"] == name and r["mode"] == mode and r["ms"] is not None)
            if not rows:
                continue
            timed_lengths, ms = zip(*rows)
            style = "-" if name.startswith("linmem") else "--"
            axes[0, col].plot(timed_lengths, ms, style, marker="o", label=name)
            axes[1, col].plot(timed_lengths, [report["tokens"] / (t / 1000) / 1e6 for t in ms], style, marker="o",
                              label=name)
        axes[0, col].set(title=f"{mode}: time", xscale="log", yscale="log", xlabel="sequence length T",
                         ylabel="ms")
        axes[1, col].set(title=f"{mode}: throughput", xscale="log", xlabel="sequence length T",
                         ylabel="million tokens / s")
        axes[1, col].set_ylim(bottom=0)  # throughputs are compared as sizes
        for ax in axes[:, col]:
            ax.set_xticks(lengths)
            ax.set_xticklabels([f"{t // 1024}K" for t in lengths])
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_one_length(report: dict, path: Path, title: str, methods: Collection[str]) -> None:
    """Time per method, forward and forward+backward side by side, as bars on one axis from zero."""
    import matplotlib.pyplot as plt

    names = [n for n in _timed(report, methods)
             if any(r["method"] == n and r["ms"] is not None for r in report["results"])]
    ms = {(r["method"], r["mode"]): r["ms"] for r in report["results"] if r["ms"] is not None}
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(names) + 2), 4.5))
    width = 0.38
    for offset, mode in ((-width / 2, "fwd"), (width / 2, "fwd+bwd")):
        heights = [ms.get((name, mode), 0.0) for name in names]
        bars = ax.bar([i + offset for i in range(len(names))], heights, width, label=mode)
        ax.bar_label(bars, labels=[f"{h:.1f}" if h else "–" for h in heights], fontsize=8, padding=2)
    ax.set_xticks(range(len(names)), names, rotation=20 if len(names) > 4 else 0)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("ms (median)")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(report: dict, out: Path, with_plot: bool, methods: Collection[str], chunked: Sequence[str]) -> None:
    """kernels.json and kernels.md under ``out``, and kernels.png ``with_plot`` (``methods`` and ``chunked`` as for
    ``markdown``)."""
    out.mkdir(parents=True, exist_ok=True)
    # whole files or the previous ones: the run may be killed while it writes
    with atomic_write(out / "kernels.json", "w") as f:
        f.write(json.dumps(report, indent=1, default=str))
    with atomic_write(out / "kernels.md", "w") as f:
        f.write(markdown(report, methods, chunked))
    if with_plot:
        plot(report, out / "kernels.png", methods)


def render(out: Path, methods: Collection[str], chunked: Sequence[str]) -> None:
    """Rewrite ``out``'s kernels.md and kernels.png from its kernels.json (a report's tables after a change to how
    they are laid out), and print the summary (``methods`` and ``chunked`` as for ``markdown``)."""
    source = out / "kernels.json"
    if not source.is_file():
        raise SystemExit(f"--render: no kernels.json in {out}")
    report = json.loads(source.read_text())
    with_plot = bool(report["results"])
    write_report(report, out, with_plot, methods, chunked)
    print(f"wrote {out / 'kernels.md'}" + (f" and {out / 'kernels.png'}" if with_plot else " (no timings: no plot)")
          + summary(report, methods))


def table_row(key_dim: int, value_dim: int, row: dict, reason: str) -> str:
    """``row`` as the lines of ``KERNEL_OPTIONS`` (linmem.ops.triton.function) to paste: its changes to
    ``TUNED_AT_128``, with ``reason`` as the comment."""
    from linmem.ops.triton import function

    def literal(value):
        if isinstance(value, dict):
            return "dict(" + ", ".join(f"{key}={literal(v)}" for key, v in value.items()) + ")"
        return f'"{value}"' if isinstance(value, str) else repr(value)

    cls = (function.width_class(key_dim), function.width_class(value_dim))
    changes = [f"        {name}={literal(opts)}," for name, opts in row.items() if opts != function.TUNED_AT_128[name]]
    if not changes:
        return f"    {cls}: _row(),  # {reason}"
    return "\n".join([f"    {cls}: _row(  # {reason}", *changes, "    ),"])
