"""The FLA-against-linmem benchmark's report as text: versus_fla.md, the tables a run prints as it goes, and the
files ``--out`` gets, all from the report dict (versus_fla.json) that ``linmem.bench.versus_fla`` builds."""

from __future__ import annotations

import json
from pathlib import Path

from linmem.bench.step_profile import KINDS, table_name
from linmem.io.atomic import atomic_write

OOM = "OOM"  # a cell's status where its model ran out of memory; the tables show it as is
PROFILE_TOP = 15  # kernels or operators kept ranked in a cell's profile, and difference rows shown per row
NAME_WIDTH = 90  # characters of a kernel's name shown in a table


def ok(cell: dict | None) -> bool:
    """Whether a cell was measured through: it ran (not None) and its status is "ok" (not OOM nor an error)."""
    return cell is not None and cell["status"] == "ok"


def _cell(cell: dict | None, key: str, digits: int = 1) -> str:
    """A number of a measurement, its status when it did not run through, or a dash when it did not start."""
    if cell is None:
        return "–"
    if cell["status"] != "ok":
        return OOM if cell["status"] == OOM else "failed"
    value = cell.get(key)
    return "–" if value is None else f"{value:.{digits}f}"


def _ratio(top: dict | None, bottom: dict | None, key: str) -> str:
    if not (ok(top) and ok(bottom)) or top.get(key) is None or not bottom.get(key):
        return "–"
    return f"{top[key] / bottom[key]:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _per_round(row: dict) -> str:
    """A row's per-round ratios (``rounds_ratio``), or a dash where it has none."""
    ratios = row.get("rounds_ratio")
    return ", ".join(f"{ratio:.2f}" for ratio in ratios) if ratios else "–"


def _with_rounds(header: list[str], body: list[list[str]], rows: list[dict], after: int) -> tuple[list, list]:
    """``header`` and ``body`` with a "per round" column after column ``after`` (the time ratio's) where the rows
    were measured in several rounds (they have ``rounds``); unchanged where they were not."""
    if not any("rounds" in r for r in rows):
        return header, body
    at = after + 1
    return (header[:at] + ["per round"] + header[at:],
            [line[:at] + [_per_round(r)] + line[at:] for line, r in zip(body, rows)])


def _first_loss(cell: dict | None) -> str:
    return f"{cell['losses'][0]:.4f}" if ok(cell) and cell["losses"] else _cell(cell, "")


def format_train(rows: list[dict]) -> str:
    header = ["shape", "B", "T", "mode", "FLA ms/step", "linmem ms/step", "linmem / FLA", "FLA peak GiB",
              "linmem peak GiB", "linmem / FLA", "first loss FLA", "first loss linmem", "max |Δ loss|",
              "linmem loss chunk"]
    body = []
    for r in rows:
        fla, linmem = r.get("fla"), r.get("linmem")
        difference = r.get("max_loss_difference")
        body.append([r["shape"], str(r["batch"]), str(r["seq_len"]), r["mode"], _cell(fla, "step_ms"),
                     _cell(linmem, "step_ms"), _ratio(linmem, fla, "step_ms"), _cell(fla, "peak_gib", 2),
                     _cell(linmem, "peak_gib", 2), _ratio(linmem, fla, "peak_gib"), _first_loss(fla),
                     _first_loss(linmem), "–" if difference is None else f"{difference:.2e}",
                     str(r["loss_chunk_tokens"] or "whole")])
    return _table(*_with_rounds(header, body, rows, 6))


def format_residual(rows: list[dict]) -> str:
    header = ["shape", "B", "T", "mode", "mixer", "linmem base ms/step", "residual ms/step", "residual / base",
              "base peak GiB", "residual peak GiB", "residual / base"]
    body = [[r["shape"], str(r["batch"]), str(r["seq_len"]), r["mode"], r["mixer"], _cell(r["base"], "step_ms"),
             _cell(r["residual"], "step_ms"), _ratio(r["residual"], r["base"], "step_ms"),
             _cell(r["base"], "peak_gib", 2), _cell(r["residual"], "peak_gib", 2),
             _ratio(r["residual"], r["base"], "peak_gib")] for r in rows]
    return _table(*_with_rounds(header, body, rows, 7))


def format_prefill(rows: list[dict]) -> str:
    header = ["shape", "T", "FLA ms", "linmem ms", "linmem / FLA", "FLA peak GiB", "linmem peak GiB"]
    body = [[r["shape"], str(r["seq_len"]), _cell(r.get("fla"), "ms", 2), _cell(r.get("linmem"), "ms", 2),
             _ratio(r.get("linmem"), r.get("fla"), "ms"), _cell(r.get("fla"), "peak_gib", 2),
             _cell(r.get("linmem"), "peak_gib", 2)] for r in rows]
    return _table(*_with_rounds(header, body, rows, 4))


def format_decode(rows: list[dict]) -> str:
    header = ["shape", "B", "new tokens", "FLA tokens/s", "linmem tokens/s", "linmem / FLA"]
    for name in ("captured", "reused"):
        header += [f"{name} tokens/s", f"{name} / FLA", f"{name} tokens"]
    header += ["linmem = FLA tokens", "first difference", "teacher-forced agree (FLA's own)",
               "linmem margin median / max", "FLA top-2 margin median / max", "spacing at logit"]
    body = []
    for r in rows:
        fla, linmem = r.get("fla"), r.get("linmem")
        line = [r["shape"], str(r["batch"]), str(r["new_tokens"]), _cell(fla, "tokens_per_s"),
                _cell(linmem, "tokens_per_s"), _ratio(linmem, fla, "tokens_per_s")]
        for name in ("captured", "reused"):
            other = linmem.get(name) if ok(linmem) else None
            if other is None:
                line += ["n/a"] * 3
                continue
            other = dict(other, status="ok")
            line += [_cell(other, "tokens_per_s"), _ratio(other, fla, "tokens_per_s"),
                     "agree" if other["agrees"] else "DIFFER"]
        body.append(line + _agreement_cells(r))
    return _table(header, body)


def _agreement_cells(row: dict) -> list[str]:
    """The decode table's agreement columns of one row (``versus_fla.decode_agreement``'s keys); dashes where
    absent."""
    if "fla_token_agreement" not in row:
        return ["–"] * 6
    if "first_difference" not in row:  # a record made before the first difference was kept
        where = "not recorded"
    else:
        first = row["first_difference"]
        where = "none" if first is None else f"token {first}"
    cells = [f"{row['fla_token_agreement']:.0%}", where]
    if "teacher_forced_agreement" not in row:
        return cells + ["–"] * 4
    cells.append(f"{row['teacher_forced_agreement']:.0%} ({row['fla_teacher_forced_agreement']:.0%})")
    for key in ("linmem_margin", "fla_margin"):
        spread = row[key]
        cells.append("–" if spread is None else f"{spread['median']:.3g} / {spread['max']:.3g}")
    spacing = row["rounding_spacing"]
    return cells + ["–" if spacing is None else f"{spacing:.3g}"]


DECODE_RULE = ("First difference: the first new token (from 0, earliest row) where linmem's free-running tokens "
               "leave FLA's; teacher-forced agree: the share of new tokens that linmem, given FLA's tokens so far, "
               "predicts as FLA did (in brackets FLA's own parallel forward against its decoding); at the "
               "positions where it does not, a linmem margin (its top logit minus FLA's token's) and an FLA top-2 "
               "margin below the spacing of the decode's dtype at that logit size (last column) mean a near tie "
               "that rounding decided, and far larger margins a real difference in decoding.")


PROFILE_RULE = ("Profiled steps (`--profile`) run after each cell's timed steps, on its timed batches, and do not "
                "enter the timings; with several rounds only each cell's first round is profiled. Busy: the summed "
                "own time of the step's kernels on the GPU (off CUDA: of its operators on the CPU), per step; it is "
                "not the wall time, so wall − busy (the cell's median step time less its busy time) is the time the "
                "host kept the GPU waiting.")


def profile_difference(base: dict[str, dict], other: dict[str, dict]) -> list[dict]:
    """Two profiles' ``by_name`` (name → ``{ms_per_step, calls_per_step, kind}``) name by name: per kernel or
    operator of either, ``name``, ``kind``, ``base_ms``, ``other_ms``, ``difference_ms`` (other − base),
    ``base_calls`` and ``other_calls`` (per step); a name that one profile lacks counts 0 ms and 0 calls there. The
    largest |difference| first, ties by name."""
    absent = dict(ms_per_step=0.0, calls_per_step=0)
    rows = []
    for name in base.keys() | other.keys():
        one, two = base.get(name, absent), other.get(name, absent)
        rows.append(dict(name=name, kind=(base.get(name) or other[name])["kind"], base_ms=one["ms_per_step"],
                         other_ms=two["ms_per_step"], difference_ms=two["ms_per_step"] - one["ms_per_step"],
                         base_calls=one["calls_per_step"], other_calls=two["calls_per_step"]))
    return sorted(rows, key=lambda row: (-abs(row["difference_ms"]), row["name"]))


def kinds_ms(by_name: dict[str, dict]) -> dict[str, float]:
    """A profile's busy ms per step by kind (``step_profile.KINDS``): its ``by_name`` summed kind by kind."""
    totals = dict.fromkeys(KINDS, 0.0)
    for entry in by_name.values():
        totals[entry["kind"]] += entry["ms_per_step"]
    return totals


def _profiled(cell: dict | None) -> bool:
    return ok(cell) and "by_name" in cell.get("profile", {})


def format_kinds_against(base: dict, other: dict, base_label: str, other_label: str) -> str:
    """Two profiles' busy ms per step by kind side by side, their difference (other − base) and the busy total."""
    one, two = kinds_ms(base["by_name"]), kinds_ms(other["by_name"])
    body = [[kind, f"{one[kind]:.3f}", f"{two[kind]:.3f}", f"{two[kind] - one[kind]:+.3f}"] for kind in KINDS]
    body.append(["busy (all)", f"{base['total_ms']:.3f}", f"{other['total_ms']:.3f}",
                 f"{other['total_ms'] - base['total_ms']:+.3f}"])
    return _table(["kind", f"{base_label} ms/step", f"{other_label} ms/step", f"{other_label} − {base_label} ms"],
                  body)


def format_difference(base: dict, other: dict, top: int = PROFILE_TOP) -> str:
    """The ``top`` kernels or operators of ``profile_difference`` (largest |residual − base| first)."""
    body = [[table_name(r["name"], NAME_WIDTH), r["kind"], f"{r['base_ms']:.3f}", f"{r['other_ms']:.3f}",
             f"{r['difference_ms']:+.3f}", f"{r['base_calls']:g} / {r['other_calls']:g}"]
            for r in profile_difference(base["by_name"], other["by_name"])[:top]]
    return _table(["kernel or operator", "kind", "base ms/step", "residual ms/step", "residual − base ms",
                   "calls per step base / residual"], body)


def _row_title(row: dict) -> str:
    return f"{row['shape']} B={row['batch']} T={row['seq_len']} {row['mode']}"


def _profile_failures(row: dict, cells: dict[str, dict | None]) -> list[str]:
    """A line per cell of ``cells`` (label → cell) whose profiling raised."""
    return [f"- {_row_title(row)} {label}: profiling failed: {cell['profile']['error']}"
            for label, cell in cells.items() if ok(cell) and "error" in cell.get("profile", {})]


def _profile_section(parts: list[str]) -> str:
    """A profile section's lines, under ``PROFILE_RULE`` where they hold a profiled row (a "###" title); without one,
    only the failure lines, if any."""
    if not any(line.startswith("### ") for line in parts):
        return "\n".join(parts)
    return "\n".join([PROFILE_RULE, *parts])


def format_residual_profiles(rows: list[dict]) -> str:
    """Per residual row whose base and residual cells were profiled: both cells' busy ms per step and their
    difference, each cell's wall − busy, the kinds side by side and the ``PROFILE_TOP`` kernels or operators by
    |residual − base|. Empty where no row has both profiles."""
    parts = []
    for r in rows:
        base, residual = r["base"], r["residual"]
        parts += _profile_failures(r, dict(base=base, residual=residual))
        if not (_profiled(base) and _profiled(residual)):
            continue
        one, two = base["profile"], residual["profile"]
        gaps = {label: cell["step_ms"] - cell["profile"]["total_ms"] for label, cell in
                (("base", base), ("residual", residual))}
        parts += ["", f"### {_row_title(r)}: {r['mixer']} against linmem's import (profiled steps: {one['steps']})", "",
                  f"- busy per step: base {one['total_ms']:.3f} ms, residual {two['total_ms']:.3f} ms, residual − "
                  f"base {two['total_ms'] - one['total_ms']:+.3f} ms",
                  f"- wall − busy per step (the host's gap): base {base['step_ms']:.3f} − {one['total_ms']:.3f} = "
                  f"{gaps['base']:.3f} ms, residual {residual['step_ms']:.3f} − {two['total_ms']:.3f} = "
                  f"{gaps['residual']:.3f} ms", "", format_kinds_against(one, two, "base", "residual"), "",
                  format_difference(one, two)]
    return _profile_section(parts)


def format_train_profiles(rows: list[dict]) -> str:
    """Per train row whose FLA and linmem cells were profiled: their busy ms per step by kind side by side. Empty
    where no row has both profiles."""
    parts = []
    for r in rows:
        fla, linmem = r.get("fla"), r.get("linmem")
        parts += _profile_failures(r, dict(fla=fla, linmem=linmem))
        if _profiled(fla) and _profiled(linmem):
            parts += ["", f"### {_row_title(r)} (profiled steps: {fla['profile']['steps']})", "",
                      format_kinds_against(fla["profile"], linmem["profile"], "FLA", "linmem")]
    return _profile_section(parts)


def header_lines(report: dict) -> list[str]:
    env, s = report["env"], report["settings"]
    return [f"- device: {env['gpu'] or env['device']}; torch {env['torch']}, triton {env['triton']}, "
            f"flash-linear-attention {env['fla']}, transformers {env['transformers']}, CUDA {env['cuda']}, "
            f"Python {env['python']}",
            f"- train: float32 parameters, {'bfloat16 autocast' if env['gpu'] else 'float32 (no autocast)'}, fused "
            f"AdamW lr {s['learning_rate']:g}, no clipping, no checkpointing, {s['warmup']} warm-up + {s['steps']} "
            f"timed steps, T = {s['seq_len']}; linmem backend {s['backend']}; prefill T = {s['prefill_len']}, B = 1; "
            f"decode {s['decode_tokens']} new tokens after {s['prompt_tokens']} prompt tokens, greedy"
            + (f"; scaled shapes (hidden, layers, vocab) = {s['scaled']}" if s["scaled"] else "")
            + (f"; train and prefill: {s['rounds']} rounds, ABBA order (each cell measured {s['rounds']} times, the "
               "cells' order reversed every other round; a cell's median is over every round's steps, \"per round\" "
               "gives each round's ratio)" if s.get("rounds", 1) > 1 else ""),
            "- ratios are linmem / FLA (residual rows: residual mixer / linmem's import); time and memory: above 1 "
            "is worse for linmem; tokens/s: above 1 is better",
            *(f"- {note}" for note in report["notes"])]


def markdown(report: dict) -> str:
    parts = ["# linmem against FLA, whole models", "", *header_lines(report), ""]
    for title, key, format_rows in (("Training step", "train", format_train),
                                    ("Residual mixer against linmem's import", "residual", format_residual),
                                    ("Prefill", "prefill", format_prefill), ("Greedy decoding", "decode",
                                                                             format_decode)):
        if report[key]:
            parts += [f"## {title}", "", format_rows(report[key]), ""]
            if key == "decode":
                parts += [DECODE_RULE, ""]
            profiles = {"train": ("Training step by kind: FLA against linmem", format_train_profiles),
                        "residual": ("Where the residual mixer's extra time goes", format_residual_profiles)}
            if key in profiles and (section := profiles[key][1](report[key])):
                parts += [f"## {profiles[key][0]}", "", section, ""]
    if report["skipped"]:
        parts += ["Skipped (budget spent):", "", *(f"- {what}" for what in report["skipped"]), ""]
    return "\n".join(parts + ["```", report["command"], "```", ""])


def write_outputs(out: Path, report: dict) -> None:
    """``versus_fla.json`` (the report dict, every raw number) and ``versus_fla.md`` (``markdown``) under ``out``,
    each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / "versus_fla.json", "w") as f:
        f.write(json.dumps(report, indent=1) + "\n")
    with atomic_write(out / "versus_fla.md", "w") as f:
        f.write(markdown(report))
