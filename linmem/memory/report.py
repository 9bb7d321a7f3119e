"""``report.html`` (figures embedded as PNG) and ``results.json`` from experiment results."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path

from linmem.io.atomic import write_bytes_atomic
from linmem.io.folders import output_file, output_folder
from linmem.memory.commands import REPORT_FILES
from linmem.memory.experiments import Result

READING = {
    "clean_recall": "Clean 4-choice accuracy of the unedited model on the development and the confirmation sources "
                    "(chance 0.25). Every attribution is gated on it: a model that does not recall the facts holds "
                    "no memory of them to locate. The no_fact_correct rows are the control: the same items with "
                    "every presentation of the asked fact replaced by filler, so only the text can suggest the "
                    "answer; recall near them is the text's guess.",
    "head_scan": "Each cell: the mean donor-margin shift when only that component's pre-query state is swapped for "
                 "the donor's (development sources). Red = toward the donor. The frozen choice is the top cell.",
    "lifecycle": "Held-out sources, frozen component. Left: recall with the component's writes at the fact blocked "
                 "(vs a control head). Right: donor-margin shift of each intervention; 'random' is the equal-norm "
                 "Gaussian edit, 'control head' the same edit on another head. A content-specific memory shows "
                 "chosen >> random ≈ control for donor write, state swap and output patch, and output restore "
                 "near 0. The rows give each donor-answer rate over all items and over the qualified ones "
                 "(qualified_donor_answer: both prompts answered unedited).",
    "four_facts": "Left: share of target queries answered with the donor value after the state swap, and share of "
                  "non-target queries that were right and broke. Right: fact B's margin change when Δ_A (or its "
                  "part parallel / orthogonal to Δ_B) is added, against equal-norm Gaussians.",
    "write_reach": "Held-out sources, frozen component: left, recall with its writes blocked over the fact and the "
                   "d tokens after it; right, the donor-answer rate with the donor prompt's writes put there instead "
                   "(d = 0: the lifecycle's write block and donor write); against a control head. With short "
                   "convolutions of width W, the keys and values written at the W − 1 tokens after the fact still "
                   "hold its tokens (dotted line): recall that falls, or donor answers that rise, only once d "
                   "reaches them mean the binding is written just after the fact, not on its tokens.",
    "hybrid_attribution": "Donor-margin shift of swapping only the recurrent (state + conv) caches or only the "
                          "attention KV caches, as a share of swapping both (1 = all of the effect; a ratio of "
                          "source means).",
    "s_vs_r": "Per layer, the donor-margin shift of swapping the base memories S, the residual memories R, or both.",
    "sweep_num_bindings": "Left: clean recall as the number of bindings (load) grows at a fixed prompt length "
                          "(added facts replace filler). Middle: the frozen component's state-swap effect vs the "
                          "equal-norm random swap. Right: the non-target break rate (5% dashed).",
    "overlap": "Target-margin change when the chosen head's write keys after the target's last presentation are "
               "turned toward the key it wrote the target's value with (align), away from it (orthogonal, the "
               "control), or the same on a control head. < 0: overlapping later writes harm the fact.",
    "overlap_sweep": "The write-key overlap edits at each load (number of bindings, prompts of one length): does "
                     "aligning later keys with the target's harm it more as the memory fills?",
    "logit_lens": "4-choice accuracy of the answer read from the residual stream after each layer: where the answer "
                  "becomes readable (not where the information first exists).",
    "neutral_suppression": "The chosen head's pre-query state taken from the run where the target fact is replaced "
                           "by filler: accuracy of the target and of the other facts before / after.",
    "joint_topk": "Components ranked on development sources, the top k swapped together on held-out sources: share "
                  "of the effect of swapping every state and conv cache. 1 at k = 1: one component carries it.",
    "write_read_spearman": "Each component's effect as a donor write at the fact (x) and as a pre-query state swap "
                           "(y); Spearman correlation across components with a source-bootstrap CI.",
    "sweep_gap": "As the sweep above, with the filler between the last fact and the query varied.",
    "load_vs_gap": "Held-out sources, clean runs: recall at the fewest and the most facts (prompts of one length) "
                   "and at the shortest and the longest gap; middle and right, each drop in recall and in the "
                   "answer's margin, and the difference of the two drops (source-paired interval; > 0: more facts "
                   "hurt more than a longer gap).",
    "corrector": "Held-out accuracy of the model alone, a linear corrector on the chosen component's query-aligned "
                 "state reads (trained on development sources), the model with the corrector (its logits as one "
                 "more feature) and the corrector trained on shuffled labels (should sit at chance, 0.25 dashed). "
                 "Corrector above the model: the state holds answers the model's read-out misses.",
    "subspace_transfer": "Donor-answer rate and donor-margin shift when the fact's edit direction Δ (donor − "
                         "recipient state of the chosen component) is replaced by its own rank-k truncation, its "
                         "projection on a rank-k value basis learned from development items, the rest of it, or an "
                         "equal-norm random rank-k matrix. Own ≈ full at small k: the edit is low-rank; basis ≈ "
                         "own: the answers share one subspace. With --transfer-values the test facts have other "
                         "values than the basis' (summary: basis_values, test_values).",
}


def figure_png(figure) -> str:
    """A matplotlib figure as a base64 PNG string."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return html.escape(str(value))


def table_html(rows: Sequence[dict]) -> str:
    """Rows of dicts as an HTML table (columns: the union of keys, first-seen order)."""
    if not rows:
        return "<p>(no rows)</p>"
    columns = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _flat(summary: dict) -> list[dict]:
    return [{"key": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v} for k, v in summary.items()]


def _merge(results: Sequence[Result]) -> dict[str, dict]:
    """``name -> {summary, rows}``; results of one name (the clean recall of each split) are concatenated."""
    merged: dict[str, dict] = {}
    for r in results:
        entry = merged.setdefault(r.name, {"summary": {}, "rows": []})
        entry["summary"].update(r.summary)
        entry["rows"] += r.rows
    return merged


def write_report(results: Sequence[Result], out_dir: str | Path, header: dict,
                 warning: str | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` and ``results.json`` into ``out_dir``; returns both paths. ``warning`` (e.g. the
    clean-recall gate's verdict) opens the page and is stored as ``results.json``'s ``warning``. The folder is
    marked as linmem's; files linmem did not write stay, and a write that would replace one (or follow a link) is
    refused."""
    with output_folder(out_dir, overwrite=True, kind="probe", files=REPORT_FILES) as out:
        return write_pages(results, out, header, warning)


def write_pages(results: Sequence[Result], out: Path, header: dict, warning: str | None) -> tuple[Path, Path]:
    """``write_report``'s two files, each at the path ``output_file`` gives in the prepared folder ``out``."""
    merged = _merge(results)
    payload = {"header": header, "warning": warning, "experiments": merged}
    json_path = output_file(out, "results.json")
    write_bytes_atomic(json_path, json.dumps(payload, indent=1, default=str).encode("utf-8"))
    figures = {r.name: r.figure for r in results if r.figure is not None}
    sections = []
    for name, entry in merged.items():
        image = f'<img src="data:image/png;base64,{figure_png(figures[name])}">' if name in figures else ""
        sections.append(f"<h2>{html.escape(name)}</h2><p>{html.escape(READING.get(name, ''))}</p>{image}"
                        f"{table_html(_flat(entry['summary']))}<details><summary>all rows ({len(entry['rows'])})"
                        f"</summary>{table_html(entry['rows'])}</details>")
    banner = f'<p class="warning"><strong>{html.escape(warning)}</strong></p>' if warning else ""
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse;"
             "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}"
             ".warning{background:#fde8e8;border:2px solid #c00;padding:8px}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>linmem probe</title><style>{style}</style>"
            f"</head><body><h1>linmem memory probe</h1>{banner}{table_html(_flat(header))}{''.join(sections)}"
            f"</body></html>")
    html_path = output_file(out, "report.html")
    write_bytes_atomic(html_path, page.encode("utf-8"))
    return html_path, json_path
