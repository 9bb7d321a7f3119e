"""Text of the zoo: a model card per shipped model and ``docs/zoo.md`` over every evaluated run, both rendered from
the records ``linmem.zoo.ship.evaluate_run`` writes (no number is typed in by hand)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from linmem.data.builtin import DESCRIPTIONS
from linmem.zoo import MAIN, order

MIXERS = {
    "sgla": "simple gated linear attention (sGLA: additive memory, one scalar decay per head)",
    "gla": "gated linear attention (GLA: additive memory, per-key-channel decay)",
    "gdn": "Gated DeltaNet (GDN: delta-rule memory with a scalar decay)",
    "rla": "Residual Linear Attention (RLA: an additive base memory S plus a residual memory R fitting its error)",
    "rdn": "Residual Delta Net (RDN: a delta-rule base memory S plus a residual memory R fitting its clipped error)",
}
CONFIG_FIELDS = ("mixer", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "expand_v",
                 "intermediate_size", "attn_layers", "vocab_size", "tie_word_embeddings", "residual_target",
                 "fit_history", "output_gates", "gamma")
RESIDUAL_FIELDS = ("residual_target", "fit_history", "output_gates", "gamma")


# ---------------------------------------------------------------- numbers


def fmt(value: Any, digits: int = 3) -> str:
    """A number as a table shows it (``–`` for missing); ints with thousands separators."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def millions(n: int | float | None) -> str:
    """``4.82M``, or the plain count below 100,000."""
    if n is None:
        return "–"
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{int(n):,}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def mixer_label(config: dict[str, Any]) -> str:
    """``gdn``, ``gdn + attention in 2, 5``, or ``attention`` (every layer softmax attention), for a
    ``config.json`` as a dict."""
    from linmem.models.configuration import attention_layers

    attn = attention_layers(config)
    if attn and len(attn) == config.get("num_hidden_layers"):
        return "attention"
    return config["mixer"] + (f" + attention in {', '.join(map(str, attn))}" if attn else "")


def headline(tasks: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a runner report's ``tasks`` (any subset of them): perplexity, cloze, MQAR per pairs
    and mean, NIAH per length and mean, memory-lab recall with its CI, stability norms."""
    out: dict[str, Any] = {}
    if "ppl" in tasks:
        m = tasks["ppl"]["metrics"]
        out.update(ppl=m["ppl"], loss=m["loss"], ppl_tokens=m["tokens"], ppl_seq_len=m["seq_len"])
    if "cloze" in tasks:
        m = tasks["cloze"]["metrics"]
        out.update(cloze_acc=m["accuracy"], cloze_target_ppl=m["target_ppl"], cloze_examples=m["examples"])
    if "mqar" in tasks:
        out["mqar"] = {r["pairs"]: r["accuracy"] for r in tasks["mqar"]["table"]}
        out["mqar_mean"] = tasks["mqar"]["metrics"]["mean_accuracy"]
        out["mqar_seq_len"] = tasks["mqar"]["metrics"]["seq_len"]
    if "niah" in tasks:
        grid = tasks["niah"]["grid"]
        out["niah"] = {n: _mean(row) for n, row in zip(grid["lengths"], grid["accuracy"])}
        out["niah_mean"] = tasks["niah"]["metrics"]["mean_accuracy"]
    if "recall" in tasks:
        r = tasks["recall"]
        if r.get("available") is False:
            out["recall_note"] = r["reason"]
        else:
            m = r["metrics"]
            out.update(recall=m["accuracy"], recall_low=m["ci_low"], recall_high=m["ci_high"], recall_n=m["n"])
    if "stability" in tasks:
        rows = tasks["stability"]["table"]
        out["max_output_norm"] = tasks["stability"]["metrics"]["max_layer_output_norm"]
        readouts = [r["readout_norm_mean"] for r in rows if r["readout_norm_mean"] is not None]
        out["max_readout_norm"] = max(readouts) if readouts else None
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table; cells formatted with ``fmt`` unless already strings."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |" for row in rows]
    return lines


def recall_cell(h: dict[str, Any]) -> str:
    if "recall" not in h:
        return "n/a" if "recall_note" in h else "–"
    return f"{h['recall']:.3f} [{h['recall_low']:.2f}, {h['recall_high']:.2f}]"


# ---------------------------------------------------------------- the model card


def eval_rows(record: dict[str, Any]) -> list[list[Any]]:
    """``[task, metric, value, chance]`` rows of the card's evaluation table."""
    tasks, chance, h = record["eval"]["tasks"], record["chance"], headline(record["eval"]["tasks"])
    rows: list[list[Any]] = []
    if "ppl" in h:
        rows += [[f"perplexity ({h['ppl_tokens']:,} held-out tokens, {h['ppl_seq_len']}-token windows)",
                  "perplexity", h["ppl"], f"{chance['ppl']:,} (uniform)"],
                 ["", "loss (nats / token)", h["loss"], fmt(math.log(chance["ppl"]))]]
    if "cloze_acc" in h:
        rows += [[f"LAMBADA-style cloze ({h['cloze_examples']} passages)", "exact match", h["cloze_acc"], "~0"],
                 ["", "target perplexity", h["cloze_target_ppl"], "–"]]
    for pairs, acc in h.get("mqar", {}).items():
        rows.append([f"MQAR, {pairs} pairs ({h['mqar_seq_len']} tokens)", "accuracy", acc, fmt(1 / pairs)])
    if "niah" in h:
        for length, acc in h["niah"].items():
            rows.append([f"needle in a haystack, {length} tokens", "accuracy (mean over depths)", acc,
                         f"{chance['niah']:.0e}"])
    if "recall" in tasks:
        rows.append(["memory-lab clean recall (4 candidates)", "accuracy [95% CI]", recall_cell(h),
                     fmt(chance["recall"])])
    if "max_output_norm" in h:
        rows.append(["stability (RLA Fig. 4a)", "max over layers of the mean mixer-output norm",
                     h["max_output_norm"], "–"])
    return rows


def niah_grid_lines(niah: dict[str, Any]) -> list[str]:
    grid = niah["grid"]
    header = ["length \\ depth", *(f"{d:.0%}" for d in grid["depths"])]
    return table(header, [[f"{n:,}", *row] for n, row in zip(grid["lengths"], grid["accuracy"])])


def stability_lines(stability: dict[str, Any]) -> list[str]:
    rows = [[r["layer"], r["kind"], r["output_norm_mean"], r["output_norm_max"], r["readout_norm_mean"],
             r["readout_norm_max"]] for r in stability["table"]]
    return table(["layer", "kind", "output norm (mean)", "output norm (max)", "read-out norm (mean)",
                  "read-out norm (max)"], rows)


def data_lines(record: dict[str, Any]) -> list[str]:
    """The data section: sources with their token counts and licences, the recall mix."""
    card = record["data"].get("card") or {}
    by_source = card.get("tokens", {}).get("by_source", {})
    names = card.get("sources") or list(by_source)
    lines = [f"Dataset `{record['data']['dataset']}` (built by `linmem data build`): byte-level BPE with "
             f"{record['data']['vocab_size']:,} tokens, trained on the training split; documents split into "
             f"train / validation / test by a hash of their id."]
    if names:
        rows = [[n, DESCRIPTIONS.get(n, (n, "see the source"))[0], by_source.get(n),
                 DESCRIPTIONS.get(n, ("", "–"))[1]] for n in names]
        lines += ["", *table(["source", "what", "tokens (all splits)", "licence"], rows)]
    split_tokens = card.get("tokens", {}).get("by_split", {})
    if split_tokens:
        lines += ["", "Tokens per split: " + ", ".join(f"{k} {v:,}" for k, v in split_tokens.items()) + "."]
    config = record.get("train_config", {}).get("data", {})
    fraction = config.get("recall_fraction")
    if fraction:
        mix = "; ".join(", ".join(f"{k} {v}" for k, v in g.items() if k != "weight")
                        for g in record.get("recall_generators", []))
        lines += ["", f"A share of {fraction:g} of the training sequences is synthetic recall instead of text "
                      f"(generators picked by weight): {mix}."]
    return lines


def updates_cell(training: dict[str, Any]) -> str:
    """``2,000``, or ``1,019 of 2,000 (stopped early)`` for a run finalised before its schedule's end; a later stage
    (``train.init_from``) adds what came before: ``1,000 after 3,000 (zoo:gdn)``."""
    steps, scheduled = training["steps"], training.get("scheduled_steps")
    cell = f"{fmt(steps)} of {fmt(scheduled)} (stopped early)" if scheduled and steps < scheduled else fmt(steps)
    stages = training.get("earlier_stages") or []
    if stages:
        cell += " after " + " + ".join(f"{fmt(s.get('steps'))} ({s['source']})" for s in stages)
    return cell


def total_tokens(training: dict[str, Any]) -> int | None:
    """Tokens of this run and every earlier stage (None if an earlier stage did not record its tokens)."""
    earlier = [s.get("tokens") for s in training.get("earlier_stages") or []]
    return None if None in earlier else training["tokens"] + sum(earlier)


def tokens_cell(training: dict[str, Any]) -> str:
    """Tokens of this run (``16.38M``), and of every stage where there were several (``16.38M; 65.54M in all``)."""
    if not training.get("earlier_stages"):
        return millions(training["tokens"])
    total = total_tokens(training)
    return f"{millions(training['tokens'])}; " + (f"{millions(total)} in all" if total else "earlier stages unknown")


def training_lines(record: dict[str, Any]) -> list[str]:
    t = record["training"]
    optim = t.get("optim", {})
    rows = [["updates", updates_cell(t)], ["batch", f"{fmt(t['batch_size'])} sequences x {fmt(t['seq_len'])} tokens"],
            ["tokens trained", tokens_cell(t) if t.get("earlier_stages") else t["tokens"]],
            ["optimizer", f"AdamW, peak lr {optim.get('lr'):g}, cosine to {optim.get('min_lr'):g}, warmup "
                          f"{optim.get('warmup_steps')} updates, weight decay {optim.get('weight_decay'):g}, grad clip "
                          f"{optim.get('grad_clip'):g}"],
            ["time in updates", duration(t["update_seconds"])], ["throughput", f"{fmt(t['tokens_per_s'], 0)} tokens/s"],
            ["device", f"{t.get('device')} x {t.get('world_size')}"],
            [f"final training loss (mean of the last {t['final_window']} updates)", t["final_loss_mean"]],
            ["final text loss / recall loss", f"{fmt(t['final_text_loss'])} / {fmt(t['final_recall_loss'])}"],
            [f"validation loss / perplexity (update {fmt(t['val_step'])})",
             f"{fmt(t['val_loss'])} / {fmt(t['val_ppl'], 2)}"],
            ["validation recall accuracy (synthetic, held-out seeds)", t["val_recall_acc"]]]
    return table(["", ""], rows)


def front_matter(record: dict[str, Any]) -> list[str]:
    """The card's YAML metadata block (what the Hugging Face Hub indexes): licence, library, task, language and
    tags naming the architecture. The training text comes from ``linmem data``'s built-in sources, not from Hub
    datasets, so no ``datasets`` ids are listed."""
    attn = record.get("attn_layers") or []
    layers = record["model_config"].get("num_hidden_layers")
    kind = ["transformer"] if attn and len(attn) == layers else ["linear-attention", record["mixer"]]
    if attn and len(attn) != layers:
        kind.append("hybrid")
    meta = {"license": "apache-2.0", "library_name": "linmem", "pipeline_tag": "text-generation",
            "language": ["en"], "tags": ["linmem", *kind, "research"]}
    return ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", ""]


def model_card(record: dict[str, Any]) -> str:
    """The ``README.md`` of a shipped model: YAML front matter, then the card."""
    from linmem.models.configuration import attention_layers

    name, config, h = record["name"], record["model_config"], headline(record["eval"]["tasks"])
    config = {**config, "attn_layers": attention_layers(config)}  # the card's row, from a flat or a nested config
    mixer = MIXERS.get(record["mixer"], record["mixer"])
    attn = record.get("attn_layers") or []
    if attn and len(attn) == config["num_hidden_layers"]:
        what = "a softmax-attention Transformer (every layer attention)"
    elif attn:
        what = f"a hybrid: {mixer} layers, with softmax attention in layers {', '.join(map(str, attn))}"
    else:
        what = mixer
    residual = record["mixer"] in ("rla", "rdn")
    fields = [f for f in CONFIG_FIELDS if f in config and (residual or f not in RESIDUAL_FIELDS)]
    values = [[f, json.dumps(config[f]) if isinstance(config[f], list) else config[f]] for f in fields]
    opts = record["eval"]["request"]["options"]
    tokens = total_tokens(record["training"]) or record["training"]["tokens"]
    lines = [
        *front_matter(record),
        f"# linmem zoo: `{name}` ({record['description'] or name})", "",
        f"Architecture: {what}. {record['parameters']:,} parameters, trained from scratch by "
        f"linmem on {millions(tokens)} tokens of public-domain and "
        f"PSF-licensed text with synthetic recall mixed in. A small research model for studying how linear-attention "
        f"memories store and recall facts (`linmem probe`, `linmem demo`), not a general-purpose language model.", "",
        "## Load", "", "```python", "import linmem.zoo", "",
        f"model, tokenizer = linmem.zoo.load({name!r})          # float32, CPU, eval mode",
        "text = tokenizer.eos_token + \"The secret number of Alice is 4821.\"  # sequences start with <|endoftext|>",
        "ids = tokenizer(text, return_tensors=\"pt\").input_ids",
        "logits = model(ids).logits", "```", "",
        "Every synthetic recall sequence of training began with the end-of-text token (text windows start anywhere "
        "in a document, without it), and the models lean on it for recall: start recall prompts with it as above "
        "(`linmem eval` and `linmem probe` do). Without it, recall can collapse (the shipped GDN on 16 MQAR "
        "sequences of 512 tokens with 8 pairs, the training format: 100% of answers with it, 9% without). Before "
        "text cut from the middle of a document it can hurt instead: `linmem eval`'s cloze leaves it out.", "",
        "or with the Hugging Face Auto classes (`import linmem` registers the model type):", "", "```python",
        "import linmem", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        f"folder = linmem.zoo.path({name!r})",
        "model = AutoModelForCausalLM.from_pretrained(folder)", "tokenizer = AutoTokenizer.from_pretrained(folder)",
        "```", "",
        f"Weights are stored in bfloat16 ({record['model_bytes'] / 1e6:.2f} MB). `linmem eval` and `linmem probe` "
        "take this folder (`linmem.zoo.path(name)`); held-out text of the training dataset is shipped beside it "
        "(`train_info.json` records where), so `linmem eval` needs no dataset.", "",
        "## Model", "", *table(["field", "value"], values), "",
        "## Training data", "", *data_lines(record), "",
        "## Training", "", *training_lines(record), "",
        "## Evaluation", "",
        f"Measured by `linmem zoo ship` with `linmem.eval` on the `{opts['split']}` split (held-out documents), the "
        f"shipped bfloat16 weights run in float32; seed {opts['seed']}. {record['eval']['seconds']:.0f} s of "
        "evaluation.", "",
        *table(["task", "metric", "value", "chance"], eval_rows(record)), "",
    ]
    for task, note in record["eval"].get("remeasured", {}).items():  # linmem zoo remeasure
        lines += [f"`{task}` was measured again ({note['device']}): {note['why']}", ""]
    tasks = record["eval"]["tasks"]
    if "niah" in tasks:
        lines += ["Needle in a haystack, accuracy per context length and needle depth "
                  f"({tasks['niah']['metrics']['samples_per_cell']} trials per cell):", "",
                  *niah_grid_lines(tasks["niah"]), ""]
    if "stability" in tasks:
        lines += ["Per-layer norms (stability diagnostic):", "", *stability_lines(tasks["stability"]), ""]
    if "recall_note" in h:
        lines += [f"Memory-lab recall: {h['recall_note']}", ""]
    lines += [
        "## Re-train", "",
        f"From a checkout of linmem: `linmem train configs/zoo/{name}.yaml --out runs/zoo/{name}`, then "
        f"`linmem zoo ship runs/zoo/{name}` to evaluate and package it. The full training config:", "",
        "```yaml", yaml.safe_dump(record.get("train_config", {}), sort_keys=False).rstrip(), "```", "",
        "## Licence", "",
        "The weights are released with linmem under the Apache-2.0 licence. Training data: the Python standard "
        "library's documentation is under the PSF License Agreement (copyright Python Software Foundation); "
        "Shakespeare's works and the King James Bible are in the public domain. The held-out sample shipped with "
        "the zoo comes from the same sources.", "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- docs/zoo.md


def _pairs(records: Sequence[dict[str, Any]]) -> list[int]:
    return sorted({p for r in records for p in headline(r["eval"]["tasks"]).get("mqar", {})})


def _lengths(records: Sequence[dict[str, Any]]) -> list[int]:
    return sorted({n for r in records for n in headline(r["eval"]["tasks"]).get("niah", {})})


def cloze_cell(record: dict[str, Any]) -> str:
    """The cloze exact match, with a * where the end-of-text token went before each context (records measured
    before linmem.eval.cloze left it out)."""
    cloze = record["eval"]["tasks"].get("cloze")
    if cloze is None:
        return "–"
    return fmt(cloze["metrics"]["accuracy"]) + ("" if cloze["metrics"].get("eos_before_context") is False else " *")


def overview_rows(records: Sequence[dict[str, Any]], shipped: Sequence[str]) -> tuple[list[str], list[list[Any]]]:
    """The header and rows of the docs table (one row per run, then the chance row)."""
    pairs, lengths = _pairs(records), _lengths(records)
    header = ["model", "kind", "mixer", "params", "tokens", "updates", "update time", "tokens/s", "final loss",
              "val loss", "test ppl", "cloze acc", *(f"MQAR {p}" for p in pairs), "MQAR mean",
              *(f"NIAH {n}" for n in lengths), "NIAH mean", "recall [95% CI]", "max norm"]
    rows = []
    for r in records:
        h, t = headline(r["eval"]["tasks"]), r["training"]
        kind = ("main" if r["name"] in MAIN else "ablation") + (", shipped" if r["name"] in shipped else "")
        rows.append([f"`{r['name']}`", kind, mixer_label(r["model_config"]), millions(r["parameters"]),
                     tokens_cell(t), updates_cell(t), duration(t["update_seconds"]), fmt(t["tokens_per_s"], 0),
                     t["final_loss_mean"], t["val_loss"],
                     fmt(h.get("ppl"), 2), cloze_cell(r), *(h.get("mqar", {}).get(p) for p in pairs),
                     h.get("mqar_mean"), *(h.get("niah", {}).get(n) for n in lengths), h.get("niah_mean"),
                     recall_cell(h), h.get("max_output_norm")])
    vocab = {r["chance"]["ppl"] for r in records}
    niah = records[0]["chance"]["niah"] if records else 0
    chance = ["chance", "", "", "", "", "", "", "", fmt(math.log(max(vocab))) if vocab else "–", "",
              ", ".join(f"{v:,}" for v in sorted(vocab)), "~0", *(fmt(1 / p) for p in pairs), "",
              *(f"{niah:.0e}" for _ in lengths), "", "0.25", ""]
    return header, rows + [chance]


def curve_groups(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, list]]]:
    """Loss curves by panel: the main models; each main model with its ablations (``rla`` and ``rla-*``); the
    rest."""
    curves = {r["name"]: r["training"]["curve"] for r in records}
    groups = {"main models": {n: c for n, c in curves.items() if n in MAIN}}
    for name, curve in curves.items():
        if name in MAIN:
            continue
        base = next((m for m in sorted(MAIN, key=len, reverse=True) if name.startswith(m + "-")), None)
        group = groups.setdefault(f"{base} and its ablations" if base else "other runs",
                                  {base: curves[base]} if base in curves else {})
        group[name] = curve
    return groups


def write_docs(records: Sequence[dict[str, Any]], path: Path, shipped: Sequence[str] = ()) -> Path:
    """``docs/zoo.md``: every run's numbers in one table, NIAH grids and per-layer norms, and the loss and MQAR
    figures in ``<path stem>/`` (PNG, if matplotlib is installed)."""
    from linmem.zoo import figures

    records = sorted(records, key=lambda r: order([x["name"] for x in records]).index(r["name"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig_dir = path.parent / path.stem
    images = []
    if figures.have_matplotlib() and records:
        groups = curve_groups(records)
        images.append(("Training and validation loss", figures.save(figures.loss_curves(groups),
                                                                    fig_dir / "loss.png")))
        tables = {r["name"]: r["eval"]["tasks"]["mqar"]["table"] for r in records if "mqar" in r["eval"]["tasks"]}
        if tables:
            images.append(("MQAR accuracy against the number of pairs",
                           figures.save(figures.mqar_curves(tables), fig_dir / "mqar.png")))
    header, rows = overview_rows(records, shipped)
    first = records[0] if records else None
    opts = first["eval"]["request"]["options"] if first else {}
    lines = [
        "# The linmem model zoo", "",
        "Generated by `linmem zoo ship` from the trained runs (do not edit by hand; re-run the command). Every number "
        "below was measured by that command: training numbers come from each run's `metrics.jsonl` and "
        "`train_info.json`, evaluation numbers from `linmem.eval` on the held-out test split of the training data, "
        "with the bfloat16 weights that are shipped.", "",
        "This page is a catalogue of single shipped runs, not evidence for the papers' claims: "
        "[results.md](results.md) lists each claim with its status under one recipe and 3 seeds (`linmem study`).",
        "",
        f"Shipped in the package (`linmem.zoo.names()`): {', '.join(f'`{n}`' for n in shipped) or 'none'}. "
        "Re-train any of them with `linmem train configs/zoo/<name>.yaml --out runs/zoo/<name>`.", "",
        "## All runs", "",
        *table(header, rows), "",
        "Columns: parameters; tokens trained; updates (and the schedule's, where a run was stopped early); time "
        "spent in optimizer updates and the mean throughput (from "
        "`metrics.jsonl`; validation passes excluded); final training loss (mean of the last updates); last "
        "validation loss; test perplexity; LAMBADA-style cloze exact match (a * marks "
        "cells measured with the end-of-text token before each mid-document context, a protocol `linmem.eval` "
        "no longer uses: not comparable with the others); MQAR accuracy per number of key-value "
        "pairs and its mean; needle-in-a-haystack accuracy per context length (mean over depths) and overall; the "
        "memory lab's clean 4-choice recall with its source-bootstrap 95% CI; the largest per-layer mean norm of a "
        "mixer's output (RLA Fig. 4a). The last row is what guessing scores (for perplexity: the vocabulary size; "
        "the loss column shows its log).", "",
    ]
    if first:
        lines += [f"Evaluation settings: perplexity on up to {opts['max_tokens']:,} tokens, {opts['cloze_examples']} "
                  f"cloze passages, MQAR with {opts['mqar_samples']} sequences per size, NIAH {opts['niah_samples']} "
                  f"trials per cell at depths {', '.join(f'{d:.0%}' for d in opts['niah_depths'])}, "
                  f"{opts['recall_items']} memory-lab items with {opts['recall_filler']} filler tokens, "
                  f"{opts['stability_windows']} stability windows; seed {opts['seed']}.", ""]
    for title, image in images:
        lines += [f"## {title}", "", f"![{title}]({image.relative_to(path.parent).as_posix()})", ""]
    lines += ["## Needle in a haystack per depth", ""]
    for r in records:
        if "niah" in r["eval"]["tasks"]:
            lines += [f"`{r['name']}`:", "", *niah_grid_lines(r["eval"]["tasks"]["niah"]), ""]
    lines += ["## Per-layer norms", ""]
    for r in records:
        if "stability" in r["eval"]["tasks"]:
            lines += [f"`{r['name']}`:", "", *stability_lines(r["eval"]["tasks"]["stability"]), ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
