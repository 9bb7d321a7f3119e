"""``report.html`` (figures embedded as PNG) and ``results.json`` from experiment results.

The page reads as a paper's figures: every section has a title and a caption saying what was measured, on how many
items and source passages, and what the intervals are; components are spelled out (``L3H0S`` = layer 3, head 0,
base memory S) in a list at the top; summaries and rows are tables of readable names and numbers. ``results.json``
keeps every value as the experiments returned it.
"""

from __future__ import annotations

import ast
import base64
import html
import io
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from linmem.io.atomic import write_bytes_atomic
from linmem.io.folders import output_file, output_folder
from linmem.memory.commands import REPORT_FILES
from linmem.memory.experiments import Result
from linmem.memory.plots import label

TITLES = {
    "clean_recall": "Clean recall", "head_scan": "Head scan: which component holds the fact",
    "lifecycle": "Lifecycle of the fact in the frozen component", "four_facts": "Four facts: one edit, the others",
    "write_reach": "Where the fact is written", "head_interaction": "Head interaction: do two heads add",
    "hybrid_attribution": "Recurrent vs attention caches", "s_vs_r": "Base memory S vs residual memory R",
    "sweep_num_bindings": "Load sweep", "sweep_gap": "Gap sweep", "load_vs_gap": "More facts or a longer gap",
    "overlap": "Write-key overlap", "overlap_sweep": "Write-key overlap by load", "logit_lens": "Logit lens",
    "neutral_suppression": "Neutral state swap", "joint_topk": "Top-k components swapped jointly",
    "write_read_spearman": "Write vs read importance", "corrector": "A linear corrector on the state",
    "subspace_transfer": "Low-rank edits and a shared value subspace",
}

READING = {
    "clean_recall": "Clean 4-choice accuracy of the unedited model on the development and the confirmation sources "
                    "(chance 0.25). Every attribution is gated on it: a model that does not recall the facts holds "
                    "no memory of them to locate. The rows 'accuracy with the fact replaced by filler' are the "
                    "control: the same items with every presentation of the asked fact replaced by filler, so only "
                    "the text can suggest the answer; recall near them is the text's guess.",
    "head_scan": "Each cell: the mean donor-margin shift when only that component's pre-query state is swapped for "
                 "the donor's (development sources). Red = toward the donor. The frozen choice is the top cell.",
    "lifecycle": "Held-out sources, frozen component. Left: recall with the component's writes at the fact blocked "
                 "(vs a control head). Right: donor-margin shift of each intervention; 'random' is the equal-norm "
                 "Gaussian edit, 'control head' the same edit on another head. A content-specific memory shows "
                 "chosen >> random ≈ control for donor write, state swap and output patch, and output restore "
                 "near 0. The rows give each donor-answer rate over all items and over the qualified ones "
                 "(qualified: both prompts answered right unedited).",
    "four_facts": "The frozen component's pre-query state swapped for the donor's on fact A (the target). Left: "
                  "share of target queries answered with the donor's value (donor-answer rate), and share of the "
                  "other facts' queries that were answered right before the edit and wrong after it (break rate). "
                  "Right: fact B's target-margin change when Δ_A, the state difference of fact A's edit (or its "
                  "part parallel / orthogonal to Δ_B, fact B's), is added to the state, each against an equal-norm "
                  "Gaussian direction.",
    "head_interaction": "Held-out sources: the answer's margin change when the fact's writes into the frozen "
                        "component (the hub), into the next component of the development ranking (the secondary) "
                        "or into both are blocked; 'hub + secondary' is the sum of the two single blocks and "
                        "'interaction' the both-block minus that sum (0: the two heads' effects add; < 0: blocking "
                        "both costs more, they back each other up; > 0: they share one role).",
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
                         "values than the basis' (the summary names both value lists).",
}


SUMMARY_LABELS = {
    "chance": "chance (1 of 4 candidates)", "development": "development sources: clean recall",
    "confirmation": "held-out sources: clean recall",
    "development_no_fact": "development sources: accuracy with the fact replaced by filler",
    "confirmation_no_fact": "held-out sources: accuracy with the fact replaced by filler",
    "chosen": "chosen component", "top1_sources": "sources that rank it first", "sources": "source passages",
    "loso_agreement": "leave-one-source-out scans that keep it first", "clean_accuracy": "clean accuracy",
    "component": "component", "control": "control head", "items": "items",
    "qualified_items": "qualified items (both prompts answered right unedited)",
    "conv_width": "short-convolution width W",
    "blocked_fact_tokens": "recall with its writes blocked on the fact's tokens",
    "blocked_through_conv_reach": "recall with its writes blocked through the convolution's reach (d = W − 1)",
    "donor_fact_tokens": "donor-answer rate, donor's writes on the fact's tokens",
    "donor_through_conv_reach": "donor-answer rate, donor's writes through the convolution's reach",
    "hub": "hub (the frozen component)", "secondary": "secondary (next in the development ranking)",
    "break_rate": "break rate of the other facts",
    "break_denominator": "other facts' queries right before the edit (the break rate's denominator)",
    "layers": "layers with a residual memory", "attention_layers": "attention layers",
    "loads": "loads compared (bindings per prompt)", "gaps": "gaps compared (tokens)",
    "num_bindings_at_gaps": "bindings per prompt in the gap conditions",
    "gap_at_loads": "gap in the load conditions (tokens)",
    "recall_difference": "load drop − gap drop, recall", "margin_difference": "load drop − gap drop, margin",
    "more_facts_hurt_more_recall": "more facts hurt recall more than a longer gap",
    "more_facts_hurt_more_margin": "more facts hurt the margin more than a longer gap",
    "order": "ranking (best first)", "spearman": "Spearman correlation", "components": "components",
    "train_queries": "training queries (development)", "test_queries": "test queries (held out)",
    "train_sources": "training sources", "test_sources": "test sources", "features": "features",
    "weight_decay": "weight decay", "rescued": "queries the model got wrong and the corrector right",
    "model_wrong": "queries the model got wrong", "broken": "queries the model got right and the corrector wrong",
    "model_right": "queries the model got right", "ranks": "ranks k", "full_rank": "full rank",
    "dev_items": "development items", "test_items": "held-out items", "basis_energy": "basis energy by rank k",
    "basis_values": "values the basis was learned on", "test_values": "values of the test facts",
    "clean_recall_warning": "warning", "note": "note", "min_clean_recall": "clean-recall gate",
    "write_tokens_after": "tokens after each fact the write edits also cover", "time_limit_s": "time limit (s)",
}
# summary keys shown elsewhere: edits as Python reprs (results.json keeps them), the interaction's verdict (a
# sentence in the caption) and the interval bounds joined to the value they belong to
HIDDEN = {"edit", "edits_of_first_item", "interaction", "low", "high", "additive", "interacting",
          "additive_tolerance", "hub_change", "interaction_share"}
COLUMNS = {"metric": "quantity", "mean": "mean", "low": "95% CI low", "high": "95% CI high", "n": "items",
           "sources": "sources", "tokens_after": "tokens after the fact", "num_bindings": "bindings per prompt",
           "gap": "gap (tokens)", "write_shift": "donor write: donor-margin shift",
           "read_shift": "state swap: donor-margin shift", "denominator": "break-rate denominator",
           "share_of_layer": "share of the layer's S+R swap"}
COMPONENT = re.compile(r"\bL(\d+)H(\d+)([SR])\b")
MEMORY_NAMES = {"S": "base memory S", "R": "residual memory R"}


def spelled(component: str) -> str:
    """``"L3H0S"`` as ``"layer 3, head 0, base memory S"``."""
    layer, head, memory = COMPONENT.fullmatch(component).groups()
    return f"layer {layer}, head {head}, {MEMORY_NAMES[memory]}"


def glossary_html(text: str) -> str:
    """A paragraph spelling out every component name that ``text`` uses ('' when none)."""
    text = re.sub(r"data:image/png;base64,[^\"']*", "", text)  # an image's letters may spell a name by chance
    found = {m.group(0): (int(m.group(1)), int(m.group(2)), m.group(3)) for m in COMPONENT.finditer(text)}
    names = sorted(found, key=found.get)
    if not names:
        return ""
    listed = "; ".join(f"<b>{n}</b> = {spelled(n)}" for n in names)
    return (f"<p class='caption'>Components are named L&lt;layer&gt;H&lt;head&gt;&lt;memory&gt;, counting from 0 "
            f"(S: the base memory, R: the residual memory). In this report: {listed}.</p>")


def figure_png(figure) -> str:
    """A matplotlib figure as a base64 PNG string."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def number(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4g}"


def value_text(value: Any) -> str:
    """A summary or row value as a reader sees it: yes / no, –, numbers to 4 digits, estimates as
    ``mean [low, high]``, lists joined, other mappings as ``name value; ...``."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return number(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(value_text(v) for v in value) or "none"
    if isinstance(value, dict):
        if {"mean", "low", "high"} <= set(value):
            counted = f" ({value['n']} items, {value['sources']} sources)" if {"n", "sources"} <= set(value) else ""
            return f"{number(value['mean'])} [{number(value['low'])}, {number(value['high'])}]{counted}"
        return "; ".join(f"{label(k)}: {value_text(v)}" for k, v in value.items()) or "none"
    return label(value)


def _cell(value) -> str:
    return html.escape(value_text(value))


def table_html(rows: Sequence[dict], columns: dict[str, str] | None = None) -> str:
    """Rows of dicts as an HTML table (columns: the union of keys, first-seen order, headed by ``columns``' names
    where given); cells as ``value_text`` writes them."""
    if not rows:
        return "<p>(no rows)</p>"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    names = columns or {}
    head = "".join(f"<th>{html.escape(names.get(k, k.replace('_', ' ')))}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(k, ''))}</td>" for k in keys) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def summary_rows(summary: dict) -> list[dict]:
    """The summary as ``{"quantity", "value"}`` rows: readable names, an estimate's interval beside its value."""
    rows = []
    for key, value in summary.items():
        if key in HIDDEN:
            continue
        if key == "spearman" and {"low", "high"} <= set(summary):
            value = {"mean": value, "low": summary["low"], "high": summary["high"]}
        rows.append({"quantity": SUMMARY_LABELS.get(key, key.replace("_", " ")), "value": value})
    return rows


def sample_sentence(rows: Sequence[dict]) -> str:
    """How many items and source passages the estimates rest on, and what the intervals are."""
    counted = [r for r in rows if isinstance(r.get("n"), int) and isinstance(r.get("sources"), int)]
    if not counted:
        return ""
    items, sources = max(r["n"] for r in counted), max(r["sources"] for r in counted)
    every = all(r["n"] == items and r["sources"] == sources for r in counted)
    amount = f"{items} items from {sources} source passages" if every else (
        f"up to {items} items from up to {sources} source passages (each row gives its own)")
    coarse = f" With {sources} passages the intervals are wide." if sources < 10 else ""
    return (f" Estimates on {amount}; error bars and intervals are 95% bootstrap confidence intervals over source "
            f"passages.{coarse}")


def interaction_sentence(summary: dict) -> str:
    """The head interaction's verdict, judged against the hub's own effect (``experiments.additivity``)."""
    if "additive_tolerance" not in summary:
        return ""
    band, hub = summary["additive_tolerance"], summary["hub_change"]
    estimate = f"{number(summary['interaction'])} [{number(summary['low'])}, {number(summary['high'])}]"
    share = f"{summary['interaction_share']:.1%}" if not math.isnan(summary["interaction_share"]) else "n/a"
    against = f"±{band:.0%} of the hub's own margin change ({number(hub)})"
    if summary["additive"]:
        return f" Verdict: the two heads add. The interaction, {estimate}, lies within {against}; its mean is {share}."
    if summary["interacting"]:
        role = ("blocking both costs more than the two alone: they back each other up" if summary["interaction"] < 0
                else "blocking both costs less than the two alone: they share one role")
        return f" Verdict: the two heads do not add. The interaction, {estimate}, lies beyond {against}: {role}."
    return (f" Verdict: undecided. The interaction's interval, {estimate}, reaches beyond {against} without lying "
            f"outside it; more source passages would decide.")


def caption(name: str, entry: dict) -> str:
    text = READING.get(name, f"The {name.replace('_', ' ')} experiment.") + sample_sentence(entry["rows"])
    if name == "head_interaction":
        text += interaction_sentence(entry["summary"])
    clean = [r["mean"] for r in entry["rows"] if r.get("metric") == "clean_correct"]
    if name == "clean_recall" and clean and min(clean) == 1:
        text += " Every item is answered right: recall is at its ceiling and cannot rank models."
    if name == "lifecycle" and "edits_of_first_item" in entry["summary"]:
        text += " results.json lists the exact edits of the first item."
    return f"<p class='caption'>{html.escape(text)}</p>"


def _merge(results: Sequence[Result]) -> dict[str, dict]:
    """``name -> {summary, rows}``; results of one name (the clean recall of each split) are concatenated."""
    merged: dict[str, dict] = {}
    for r in results:
        entry = merged.setdefault(r.name, {"summary": {}, "rows": []})
        entry["summary"].update(r.summary)
        entry["rows"] += r.rows
    return merged


def task_sentence(text: str) -> str:
    """The task of ``header["task"]`` (a ``TaskSpec`` as Python writes it) as a sentence."""
    try:
        call = ast.parse(text, mode="eval").body
        spec = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, AttributeError):
        return "Task: a user's template or vocabulary (results.json gives it)."
    gap = "" if spec.get("gap") is None else f", the last {spec['gap']} filler tokens right before the query"
    return (f"Task: each prompt binds {spec['num_bindings']} keys (the '{spec['keys']}' word list) to values (the "
            f"'{spec['values']}' word list), each binding presented {spec['repeats']} times among "
            f"{spec['filler_tokens']} filler tokens{gap} (template '{spec['template']}', variant "
            f"'{spec['variant']}'); the query asks one key and the model's answer is the best of 4 candidate values "
            f"(chance 0.25).")


def header_html(header: dict) -> str:
    """The run's setup as a captioned section of sentences, with a table of the other settings."""
    h = dict(header)
    said = []

    def take(key: str, default: Any = None) -> Any:
        said.append(key)
        return h.get(key, default)

    model, device = take("model"), take("device")
    lines = [f"Model <code>{html.escape(str(model))}</code> on {html.escape(str(device))}"
             + (f", filler text from {html.escape(str(h['filler_text']))}" if take("filler_text") else "")
             + f", seed {take('seed', 0)}."]
    if take("task"):
        lines.append(html.escape(task_sentence(h["task"])))
    dev, confirm = take("dev_sources") or [], take("confirm_sources") or []
    lines.append(f"Development sources (the head scan and rankings): {len(dev)} passages; held-out confirmation "
                 f"sources (every other experiment): {len(confirm)} passages. Every estimate resamples passages.")
    if take("clean_recall_gate"):
        lines.append(html.escape(h["clean_recall_gate"]))
    chosen, by = take("chosen"), take("chosen_by")
    if chosen:
        confirmed = take("confirmed_on_held_out")
        verdict = "" if confirmed is None else (
            f" Its state swap {'beats' if confirmed else 'does not beat'} the equal-norm random swap on the held-out "
            f"sources.")
        lines.append(f"Chosen component: <b>{html.escape(chosen)}</b> ({spelled(chosen)}), by the "
                     f"{html.escape(str(by or 'option'))}.{verdict}")
    lines += [html.escape(note[0].upper() + note[1:] + ".") for note in take("notes") or []]
    for key, what in (("skipped_by_gate", "Not run (clean recall below the gate)"),
                      ("not_started_time_limit", "Not started (time limit)")):
        if take(key):
            lines.append(f"{what}: {html.escape(', '.join(h[key]))}.")
    seconds, batches = take("seconds") or {}, take("batch_choice") or {}
    other = [{"setting": SUMMARY_LABELS.get(k, k.replace("_", " ")), "value": v} for k, v in h.items()
             if k not in said and k not in ("clean_recall", "clean_recall_no_fact", "clean_recall_passed")]
    timing = [{"experiment": TITLES.get(k, k), "seconds": seconds.get(k, "–"), "batches": batches.get(k, "–")}
              for k in [*[k for k in batches if k not in seconds], *seconds]]
    return (f"<section><h2>Setup</h2><p class='caption'>{' '.join(lines)}</p>{table_html(other)}"
            f"<details><summary>run time and batch size per experiment</summary>{table_html(timing)}</details>"
            f"</section>")


def write_report(results: Sequence[Result], out_dir: str | Path, header: dict,
                 warning: str | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` and ``results.json`` into ``out_dir``; returns both paths. ``warning`` (e.g. the
    clean-recall gate's verdict) opens the page and is stored as ``results.json``'s ``warning``. The folder is
    marked as linmem's; files linmem did not write stay, and a write that would replace one (or follow a link) is
    refused."""
    with output_folder(out_dir, overwrite=True, kind="probe", files=REPORT_FILES) as out:
        return write_pages(results, out, header, warning)


def section_html(name: str, entry: dict, figure) -> str:
    """One experiment: title, caption, figure, summary table and its rows (folded)."""
    image = f'<img src="data:image/png;base64,{figure_png(figure)}">' if figure is not None else ""
    return (f"<section id='{html.escape(name)}'><h2>{html.escape(TITLES.get(name, name.replace('_', ' ')))}</h2>"
            f"{caption(name, entry)}{image}{table_html(summary_rows(entry['summary'])) if entry['summary'] else ''}"
            f"<details><summary>every "
            f"estimate ({len(entry['rows'])} rows)</summary>{table_html(entry['rows'], COLUMNS)}</details></section>")


def write_pages(results: Sequence[Result], out: Path, header: dict, warning: str | None) -> tuple[Path, Path]:
    """``write_report``'s two files, each at the path ``output_file`` gives in the prepared folder ``out``."""
    merged = _merge(results)
    payload = {"header": header, "warning": warning, "experiments": merged}
    json_path = output_file(out, "results.json")
    write_bytes_atomic(json_path, json.dumps(payload, indent=1, default=str).encode("utf-8"))
    figures = {r.name: r.figure for r in results if r.figure is not None}
    body = header_html(header) + "".join(section_html(n, e, figures.get(n)) for n, e in merged.items())
    banner = f'<p class="warning"><strong>{html.escape(warning)}</strong></p>' if warning else ""
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse;"
             "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}"
             ".warning{background:#fde8e8;border:2px solid #c00;padding:8px}.caption{font-size:14px}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>linmem probe</title><style>{style}</style>"
            f"</head><body><h1>linmem memory probe</h1>{banner}{glossary_html(body)}{body}</body></html>")
    html_path = output_file(out, "report.html")
    write_bytes_atomic(html_path, page.encode("utf-8"))
    return html_path, json_path
