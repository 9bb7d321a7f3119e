"""The default protocol of ``linmem probe``: head scan on development sources, the frozen choice confirmed and
dissected on held-out sources, then the report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from linmem.data.sources import Document
from linmem.memory import experiments as ex
from linmem.memory.components import Component, attention_layers
from linmem.memory.report import write_report
from linmem.memory.tasks import KEY_WORDS, VALUE_WORDS, TaskBuilder, TaskSpec, Tokenize, build_items, passages


@dataclass
class ProbeOptions:
    """Protocol sizes: ``dev_sources`` / ``confirm_sources`` passages, the task shape, the sweeps' values."""

    dev_sources: int = 16
    confirm_sources: int = 16
    filler_tokens: int = 512
    num_bindings: int = 4
    repeats: int = 3
    seed: int = 0
    loads: tuple[int, ...] = (1, 2, 4, 8)
    gaps: tuple[int, ...] = (0, 128, 256)
    sweeps: bool = True
    extras: bool = True


def pick_spec(tokenizer, spec: TaskSpec) -> TaskBuilder:
    """A builder for ``spec``, or for the first key / value vocabularies this tokenizer keeps single-token."""
    errors = []
    for keys in [spec.keys, *KEY_WORDS]:
        for values in [spec.values, *VALUE_WORDS]:
            try:
                return TaskBuilder(tokenizer, replace(spec, keys=keys, values=values))
            except ValueError as e:
                errors.append(str(e))
    raise ValueError(f"no vocabulary meets the task's rules for this tokenizer; first problem: {errors[0]}")


def split_sources(documents: Iterable[Document], tokenizer, options: ProbeOptions):
    """Passages long enough for the filler, as ``(dev, confirm)`` lists (disjoint by source id)."""
    tokenize, dev, confirm = Tokenize(tokenizer), [], []
    for doc in documents:  # stop reading as soon as both sets are full
        for found in passages([doc], tokenize, options.filler_tokens + 16):
            (dev if found[1] == "dev" else confirm).append(found)
        if len(dev) >= options.dev_sources and len(confirm) >= options.confirm_sources:
            break
    dev, confirm = dev[: options.dev_sources], confirm[: options.confirm_sources]
    if len(dev) < 2 or len(confirm) < 2:
        raise ValueError(f"need >= 2 development and >= 2 confirmation passages of {options.filler_tokens + 16}+ "
                         f"tokens; found {len(dev)} and {len(confirm)}: add --sources or lower --filler")
    return dev, confirm


def run_protocol(model, tokenizer, documents: Iterable[Document], options: ProbeOptions, out_dir: str | Path,
                 header: dict | None = None) -> dict:
    """Run every experiment of the default protocol, write ``report.html`` and ``results.json``; returns the
    results as a dict (``name -> summary``)."""
    spec = TaskSpec(num_bindings=options.num_bindings, repeats=options.repeats,
                    filler_tokens=options.filler_tokens)
    builder = pick_spec(tokenizer, spec)
    dev, confirm = split_sources(documents, tokenizer, options)
    dev_items = build_items(builder, dev, seed=options.seed)
    confirm_items = build_items(builder, confirm, seed=options.seed)
    results = []
    steps = tqdm(total=6 + 2 * options.sweeps + 5 * options.extras, desc="probe", unit="experiment")
    scan = ex.head_scan(model, dev_items)
    results.append(scan)
    steps.update()
    chosen = Component.parse(scan.summary["chosen"])
    results.append(ex.lifecycle(model, confirm_items, chosen))
    steps.update()
    results.append(ex.four_facts(model, builder, confirm, chosen, seed=options.seed))
    steps.update()
    results.append(ex.hybrid_attribution(model, confirm_items))
    steps.update()
    results.append(ex.s_vs_r(model, confirm_items))
    steps.update()
    if options.sweeps:
        loads = [k for k in options.loads if k <= len(builder.keys)]
        results.append(ex.sweep(model, tokenizer, confirm, chosen, builder.spec, "num_bindings", loads,
                                options.seed))
        steps.update()
        gaps = [g for g in options.gaps if g <= options.filler_tokens]
        results.append(ex.sweep(model, tokenizer, confirm, chosen, builder.spec, "gap", gaps, options.seed))
        steps.update()
    if options.extras:
        for run in (lambda: ex.overlap(model, confirm_items, chosen), lambda: ex.logit_lens(model, confirm_items),
                    lambda: ex.neutral_suppression(model, build_items(
                        TaskBuilder(tokenizer, replace(builder.spec, variant="neutral")), confirm, seed=options.seed),
                        chosen),
                    lambda: ex.joint_topk(model, dev_items, confirm_items),
                    lambda: ex.write_read_spearman(model, confirm_items)):
            results.append(run())
            steps.update()
    steps.close()
    results = [r for r in results if r.rows]
    confirmed = confirmation(results[1].rows)
    header = {**(header or {}), "task": repr(builder.spec), "dev_sources": [p[0] for p in dev],
              "confirm_sources": [p[0] for p in confirm], "chosen": str(chosen),
              "confirmed_on_held_out": confirmed,
              "attention_layers": attention_layers(model), "seed": options.seed}
    write_report(results, out_dir, header)
    return {r.name: r.summary for r in results}


def confirmation(lifecycle_rows: list[dict]) -> bool:
    """Whether the frozen choice's state swap beats its equal-norm random swap on held-out sources: the lower CI
    bound of its donor-margin shift above the random swap's upper bound."""
    pick = {r["target"]: r for r in lifecycle_rows
            if r["intervention"] == "state swap" and r["metric"] == "donor_margin_shift"}
    return bool(pick["chosen"]["low"] > pick["random"]["high"])


def load_model_dir(path: str | Path, device: str = "auto"):
    """``(model, tokenizer)`` from a linmem model folder or an FLA checkpoint folder (with ``tokenizer.json``)."""
    from linmem.data.tokenizer import load_tokenizer
    from linmem.models import LinMemForCausalLM
    from linmem.models.fla_import import is_fla_checkpoint, load_fla_checkpoint

    path = Path(path)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if is_fla_checkpoint(path):
        model = load_fla_checkpoint(path, dtype=torch.float32, device=device)
    else:
        model = LinMemForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    return model.eval(), load_tokenizer(path)
