"""The default protocol of ``linmem probe``: head scan on development sources, the frozen choice confirmed and
dissected on held-out sources, then the report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from linmem.data.sources import Document
from linmem.memory import batching
from linmem.memory import experiments as ex
from linmem.memory.components import Component, attention_layers, check_component, heads, recurrent_layers
from linmem.memory.corrector import corrector
from linmem.memory.experiment_names import CLEAN_RECALL_GATE, EXPERIMENTS
from linmem.memory.fact_formats import KEY_WORDS, VALUE_WORDS, label, load_template, load_vocabulary
from linmem.memory.report import write_report
from linmem.memory.subspace import subspace_transfer
from linmem.memory.tasks import TaskBuilder, TaskSpec, build_items, passages


@dataclass
class ProbeOptions:
    """Protocol sizes: ``dev_sources`` / ``confirm_sources`` passages, the task shape, the sweeps' values; ``only``
    runs just the named experiments (``EXPERIMENTS``), ``component`` (like ``"L3H1S"``) replaces the head scan's
    choice. ``template``, ``keys``, ``values``: the task's wording and vocabularies (a name or a user's file,
    see ``tasks.load_template``); keys / values None: chosen automatically (names / colors first), said in the
    report's notes. ``transfer_values``: the value vocabulary of ``subspace_transfer``'s test facts (None: the
    task's own), to ask whether a basis learned on one vocabulary moves answers of another.
    ``min_clean_recall`` gates every attribution on the model's clean recall (4 candidates, chance 0.25):
    below it on the development or the confirmation sources only the experiments that attribute nothing
    (``NOT_ATTRIBUTING``) run, and the report says why; 0 turns the gate off. ``time_limit_s``: an experiment is
    not started once the seconds spent plus its ``cost_estimates`` entry (0 if none) would pass the limit; the
    report lists the ones left out. ``write_tokens_after``: the write edits of the lifecycle, the head interaction
    and the write/read Spearman cover each presentation of the fact and this many tokens after it (0: the fact's
    own tokens, as in the paper); for a model that writes a fact just after it, inside its short convolutions'
    reach (``write_reach`` finds that). ``write_reach`` itself always starts from the fact's own tokens.
    ``chunk``: edit sets per batched run in every experiment (None: chosen from the device's free memory, see
    ``linmem.memory.batching``); the report says what each experiment ran with."""

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
    only: tuple[str, ...] = ()
    component: str | None = None
    template: str = "code"
    keys: str | None = None
    values: str | None = None
    transfer_values: str | None = None
    min_clean_recall: float = CLEAN_RECALL_GATE
    time_limit_s: float | None = None
    cost_estimates: dict[str, float] = field(default_factory=dict)
    write_tokens_after: int = 0
    chunk: int | None = None


def pick_spec(tokenizer, spec: TaskSpec, notes: list[str] | None = None, keep: Iterable[str] = ()) -> TaskBuilder:
    """A builder for ``spec``, or for the first key / value vocabularies this tokenizer keeps single-token; a
    switch is said in ``notes`` (the probe's report carries them). A vocabulary the user asked for is never
    switched: name it in ``keep`` (``"keys"``, ``"values"``) and its rule's ``ValueError`` comes through."""
    errors = []
    for keys in [spec.keys] if "keys" in keep else [spec.keys, *KEY_WORDS]:
        for values in [spec.values] if "values" in keep else [spec.values, *VALUE_WORDS]:
            try:
                builder = TaskBuilder(tokenizer, replace(spec, keys=keys, values=values))
            except ValueError as e:
                errors.append(str(e))
                continue
            if errors and notes is not None:
                notes.append(f"vocabulary chosen automatically: keys {label(keys)!r}, values {label(values)!r} "
                             f"instead of {label(spec.keys)!r} / {label(spec.values)!r} ({errors[0]})")
            return builder
    if len(errors) == 1:
        raise ValueError(errors[0])
    raise ValueError(f"no vocabulary meets the task's rules for this tokenizer; first problem: {errors[0]}")


def task_builder(tokenizer, options: ProbeOptions, notes: list[str]) -> TaskBuilder:
    """The probe's task: the asked template and vocabularies (refused with the rule's ``ValueError`` when this
    tokenizer cannot meet them), the ones not asked chosen by ``pick_spec`` (a switch said in ``notes``)."""
    asked = {name: load_vocabulary(getattr(options, name), name) for name in ("keys", "values")
             if getattr(options, name) is not None}
    spec = TaskSpec(num_bindings=options.num_bindings, repeats=options.repeats, filler_tokens=options.filler_tokens,
                    template=load_template(options.template), **asked)
    return pick_spec(tokenizer, spec, notes, keep=asked)


def transfer_builder(tokenizer, builder: TaskBuilder, transfer_values: str | None) -> TaskBuilder:
    """The subspace transfer's test task: ``builder``'s, or the same with values from ``transfer_values`` (refused
    when it is the task's own vocabulary or this tokenizer cannot meet its rules)."""
    if transfer_values is None:
        return builder
    values = load_vocabulary(transfer_values, "values")
    if label(values) == label(builder.spec.values):
        raise ValueError(f"transfer values {label(values)!r} are the task's own values; name another vocabulary")
    return TaskBuilder(tokenizer, replace(builder.spec, values=values))


def shortened(asked: Iterable[int], kept: list[int], what: str, why: str) -> list[str]:
    """A note naming the sweep points left out (none when every asked point is kept)."""
    dropped = [v for v in asked if v not in kept]
    return [f"{what} sweep shortened: {dropped} left out ({why}); ran {kept}"] if dropped else []


def split_sources(documents: Iterable[Document], tokenizer, options: ProbeOptions):
    """Passages long enough for the filler, as ``(dev, confirm)`` lists (disjoint by source id)."""
    dev, confirm = [], []
    for doc in documents:  # stop reading as soon as both sets are full
        for found in passages([doc], tokenizer, options.filler_tokens + 16):
            (dev if found[1] == "dev" else confirm).append(found)
        if len(dev) >= options.dev_sources and len(confirm) >= options.confirm_sources:
            break
    dev, confirm = dev[: options.dev_sources], confirm[: options.confirm_sources]
    if len(dev) < 2 or len(confirm) < 2:
        raise ValueError(f"need >= 2 development and >= 2 confirmation passages of {options.filler_tokens + 16}+ "
                         f"tokens; found {len(dev)} and {len(confirm)}: add --sources or lower --filler")
    return dev, confirm


SWEEPS = ("sweep_num_bindings", "sweep_gap", "load_vs_gap", "overlap_sweep")
USE_LOADS = {"sweep_num_bindings", "load_vs_gap", "overlap_sweep"}  # the experiments that read --loads
USE_GAPS = {"sweep_gap", "load_vs_gap"}  # and --gaps
EXTRAS = ("write_reach", "overlap", "overlap_sweep", "logit_lens", "neutral_suppression", "joint_topk",
          "write_read_spearman", "corrector", "subspace_transfer")
NOT_ATTRIBUTING = ("logit_lens",)  # reads the clean run only: meaningful at any recall
NEEDS_COMPONENT = ("lifecycle", "write_reach", "head_interaction", "four_facts", "sweep_num_bindings", "sweep_gap",
                   "overlap", "overlap_sweep", "neutral_suppression", "corrector", "subspace_transfer")


def selected(options: ProbeOptions) -> list[str]:
    """The experiments to run, in protocol order: ``options.only`` (every one when empty) less the skipped
    sweeps / extras; the head scan too when a later one needs the frozen component and none is given."""
    only = options.only or EXPERIMENTS
    bad = [name for name in only if name not in EXPERIMENTS]
    if bad:
        raise ValueError(f"unknown experiment(s) {bad}; choose from {', '.join(EXPERIMENTS)}")
    names = [n for n in EXPERIMENTS if n in only and (options.sweeps or n not in SWEEPS)
             and (options.extras or n not in EXTRAS)]
    if options.component is None and any(n in NEEDS_COMPONENT for n in names) and "head_scan" not in names:
        names.insert(0, "head_scan")
    return names


@dataclass(frozen=True)
class Step:
    """One experiment of the protocol: ``function`` called with keyword arguments taken from the protocol's inputs
    (``reads``: argument name -> input name, see ``run_protocol``) and the ``fixed`` ones. A step that ``writes``
    returns ``(result, {input name: value})``, and those inputs are what the steps after it read."""

    name: str
    function: Callable[..., Any]
    reads: Mapping[str, str]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    writes: tuple[str, ...] = ()

    def run(self, inputs: dict[str, Any]) -> ex.Result:
        """The step's result on ``inputs``; the inputs it writes are set in ``inputs``."""
        out = self.function(**{argument: inputs[name] for argument, name in self.reads.items()}, **self.fixed)
        if not self.writes:
            return out
        result, written = out
        inputs.update({name: written[name] for name in self.writes})
        return result


def arguments(*same: str, **renamed: str) -> dict[str, str]:
    """A step's ``reads``: each argument of ``same`` from the input of its own name, each of ``renamed`` from the
    input its value names."""
    return {**{name: name for name in same}, **renamed}


def scan_heads(model, items, chosen: Component | None, min_clean_recall: float | None):
    """The head scan on ``items``, and what later steps read from it: the components by rank (best first) and the
    frozen choice (``chosen`` when the user gave one, else the top component)."""
    scan = ex.head_scan(model, items, min_clean_recall=min_clean_recall)
    ranking = [Component.parse(row["component"]) for row in sorted(scan.rows, key=itemgetter("rank"))]
    return scan, {"ranking": ranking, "chosen": chosen or ranking[0]}


def neutral_suppression(model, tokenizer, builder: TaskBuilder, sources, component: Component,
                        seed: int) -> ex.Result:
    """``experiments.neutral_suppression`` on items of ``builder``'s task in its ``neutral`` variant, built on
    ``sources``."""
    neutral = TaskBuilder(tokenizer, replace(builder.spec, variant="neutral"))
    return ex.neutral_suppression(model, build_items(neutral, sources, seed=seed), component)


def transferred_subspace(model, dev_items, test_items, sources, builder: TaskBuilder, transfer: TaskBuilder,
                         component: Component, seed: int, min_clean_recall: float | None) -> ex.Result:
    """``subspace_transfer`` with test facts of the ``transfer`` task: ``test_items`` when it is ``builder``'s own,
    else items of ``transfer`` built on ``sources``."""
    if transfer is not builder:
        test_items = build_items(transfer, sources, seed=seed)
    return subspace_transfer(model, dev_items, test_items, component, seed=seed,
                             vocabularies=(label(builder.spec.values), label(transfer.spec.values)),
                             min_clean_recall=min_clean_recall)


# Every experiment of ``EXPERIMENTS`` as a step over the inputs ``run_protocol`` builds: ``model``, ``tokenizer``,
# ``builder`` and ``spec`` (the task), ``transfer`` (the subspace transfer's task), ``confirm`` (the held-out
# passages), ``dev_items``, ``confirm_items``, ``write_items`` (the held-out items with their write spans widened),
# ``seed``, ``gated`` (the clean-recall gate of sweep points, None when off), ``loads``, ``gaps``, and ``chosen`` /
# ``ranking`` (the frozen component and the head scan's order, which the head scan writes).
STEPS = {step.name: step for step in (
    Step("head_scan", scan_heads, arguments("model", "chosen", items="dev_items", min_clean_recall="gated"),
         writes=("ranking", "chosen")),
    Step("lifecycle", ex.lifecycle, arguments("model", "seed", items="write_items", component="chosen",
                                              min_clean_recall="gated")),
    Step("write_reach", ex.write_reach, arguments("model", items="confirm_items", component="chosen")),
    Step("head_interaction", ex.head_interaction, arguments("model", "dev_items", "ranking", test_items="write_items",
                                                            component="chosen", min_clean_recall="gated")),
    Step("four_facts", ex.four_facts, arguments("model", "builder", "seed", sources="confirm", component="chosen")),
    Step("hybrid_attribution", ex.hybrid_attribution, arguments("model", items="confirm_items")),
    Step("s_vs_r", ex.s_vs_r, arguments("model", items="confirm_items")),
    Step("sweep_num_bindings", ex.sweep, arguments("model", "tokenizer", "seed", sources="confirm",
                                                   component="chosen", base="spec", values="loads",
                                                   min_clean_recall="gated"), fixed={"field_name": "num_bindings"}),
    Step("sweep_gap", ex.sweep, arguments("model", "tokenizer", "seed", sources="confirm", component="chosen",
                                          base="spec", values="gaps", min_clean_recall="gated"),
         fixed={"field_name": "gap"}),
    Step("load_vs_gap", ex.load_vs_gap, arguments("model", "tokenizer", "loads", "gaps", "seed", sources="confirm",
                                                  base="spec")),
    Step("overlap", ex.overlap, arguments("model", items="confirm_items", component="chosen")),
    Step("overlap_sweep", ex.overlap_sweep, arguments("model", "tokenizer", "loads", "seed", sources="confirm",
                                                      component="chosen", base="spec")),
    Step("logit_lens", ex.logit_lens, arguments("model", items="confirm_items")),
    Step("neutral_suppression", neutral_suppression, arguments("model", "tokenizer", "builder", "seed",
                                                               sources="confirm", component="chosen")),
    Step("joint_topk", ex.joint_topk, arguments("model", "dev_items", "ranking", test_items="confirm_items")),
    Step("write_read_spearman", ex.write_read_spearman, arguments("model", items="write_items")),
    Step("corrector", corrector, arguments("model", "seed", train_items="dev_items", test_items="confirm_items",
                                           component="chosen")),
    Step("subspace_transfer", transferred_subspace, arguments("model", "dev_items", "builder", "transfer", "seed",
                                                              test_items="confirm_items", sources="confirm",
                                                              component="chosen", min_clean_recall="gated")),
)}


def run_protocol(model, tokenizer, documents: Iterable[Document], options: ProbeOptions, out_dir: str | Path,
                 header: dict | None = None) -> dict:
    """Run the experiments of the default protocol (or ``options.only``), write ``report.html`` and
    ``results.json``; returns the results as a dict (``name -> summary``).

    The head scan runs on development sources and freezes its winner (or ``options.component`` is used); every
    other experiment runs on the held-out confirmation sources. Each experiment is a ``Step`` of ``STEPS``, run in
    protocol order on the inputs built here.
    """
    if not 0 <= options.min_clean_recall <= 1:
        raise ValueError(f"min_clean_recall must be in [0, 1]; got {options.min_clean_recall}")
    if options.write_tokens_after < 0:
        raise ValueError(f"write_tokens_after must be >= 0; got {options.write_tokens_after}")
    notes: list[str] = []
    if options.write_tokens_after:
        notes.append(f"write edits (lifecycle, head interaction, write/read Spearman) cover each fact and the "
                     f"{options.write_tokens_after} token(s) after it, not the fact's own tokens only")
    builder = task_builder(tokenizer, options, notes)
    names = selected(options)
    loads = [k for k in options.loads if k <= len(builder.keys)]
    gaps = [g for g in options.gaps if g <= options.filler_tokens]
    if "load_vs_gap" in names and (len(set(loads)) < 2 or len(set(gaps)) < 2):
        why = (f"load_vs_gap compares two loads and two gaps; the loads that fit are {loads} and the gaps "
               f"{gaps} (of --loads {list(options.loads)}, --gaps {list(options.gaps)})")
        if options.only and "load_vs_gap" in options.only:
            raise ValueError(why)
        names.remove("load_vs_gap")
        notes.append(f"{why}: not run")
    if USE_LOADS & set(names):
        notes += shortened(options.loads, loads, "load", f"keys {label(builder.spec.keys)!r} have "
                           f"{len(builder.keys)} single-token words with this tokenizer")
    if USE_GAPS & set(names):
        notes += shortened(options.gaps, gaps, "gap", f"a gap cannot exceed the {options.filler_tokens} filler tokens")
    if USE_LOADS & set(names):  # a load that does not fit fails now, not later
        ex.sweep_specs(tokenizer, builder.spec, "num_bindings", loads)
    transfer = transfer_builder(tokenizer, builder, options.transfer_values)
    chosen = None if options.component is None else Component.parse(options.component)
    if chosen is not None:
        check_component(model, chosen)
    dev, confirm = split_sources(documents, tokenizer, options)
    dev_items = build_items(builder, dev, seed=options.seed)
    confirm_items = build_items(builder, confirm, seed=options.seed)
    batches: dict[str, str | None] = {}
    clean_start = time.perf_counter()
    with batching.batch_size(options.chunk), batching.recorded() as batch_choices:
        recall = [ex.clean_recall(model, dev_items, "development"),
                  ex.clean_recall(model, confirm_items, "confirmation")]
    batches["clean_recall"] = batching.summary(batch_choices)
    clean_seconds = time.perf_counter() - clean_start
    gate = ex.recall_gate({r.rows[0]["split"]: r.rows[0]["mean"] for r in recall}, options.min_clean_recall,
                          {r.rows[1]["split"]: r.rows[1]["mean"] for r in recall if len(r.rows) > 1})
    skipped = [] if gate["passed"] else [n for n in names if n not in NOT_ATTRIBUTING]
    names = [n for n in names if n not in skipped]
    inputs = {"model": model, "tokenizer": tokenizer, "builder": builder, "spec": builder.spec,
              "transfer": transfer, "confirm": confirm, "dev_items": dev_items, "confirm_items": confirm_items,
              "write_items": [item.writes_widened(options.write_tokens_after) for item in confirm_items],
              "seed": options.seed, "gated": options.min_clean_recall or None,  # sweep points below the gate
              "loads": loads, "gaps": gaps, "chosen": None if skipped else chosen, "ranking": None}
    estimate = estimated_seconds([n for n in names if applies(model, n)], clean_seconds, len(heads(model)))
    if next(model.parameters()).device.type == "cpu":
        print(estimate_line(estimate, len(names), clean_seconds), flush=True)
    results, seconds, cpu_seconds, not_started, start = list(recall), {}, {}, [], time.monotonic()
    for name in tqdm(names, desc="probe", unit="experiment"):
        spent = time.monotonic() - start
        if ((options.time_limit_s is not None and spent + options.cost_estimates.get(name, 0.0) > options.time_limit_s)
                or (name in NEEDS_COMPONENT and inputs["chosen"] is None)):
            not_started.append(name)
            continue
        begin, cpu_begin = time.monotonic(), time.process_time()
        with batching.batch_size(options.chunk), batching.recorded() as batch_choices:
            results.append(STEPS[name].run(inputs))
        batches[name] = batching.summary(batch_choices)
        seconds[name] = round(time.monotonic() - begin, 2)
        cpu_seconds[name] = round(time.process_time() - cpu_begin, 2)
    chosen = inputs["chosen"]
    results = [r for r in results if r.rows]
    lifecycle = [r for r in results if r.name == "lifecycle"]
    header = {**(header or {}), "clean_recall_gate": gate["message"], "clean_recall_passed": gate["passed"],
              "clean_recall": gate["clean_recall"], "clean_recall_no_fact": gate["no_fact"],
              "min_clean_recall": options.min_clean_recall,
              "skipped_by_gate": skipped, "task": repr(builder.spec), "notes": notes,
              "dev_sources": [p[0] for p in dev],
              "confirm_sources": [p[0] for p in confirm], "chosen": None if chosen is None else str(chosen),
              "chosen_by": "option" if options.component else "head scan on development sources",
              "confirmed_on_held_out": confirmation(lifecycle[0].rows) if lifecycle else None,
              "loads": loads if USE_LOADS & set(names) else None,
              "gaps": gaps if USE_GAPS & set(names) else None,
              "attention_layers": attention_layers(model), "seed": options.seed, "seconds": seconds,
              "cpu_seconds": cpu_seconds, "clean_recall_seconds": float(f"{clean_seconds:.3g}"),
              "batch_choice": {name: text for name, text in batches.items() if text},
              "estimated_seconds": float(f"{sum(estimate.values()):.3g}"),  # 3 digits: a tiny model's are < 0.1 s
              "write_tokens_after": options.write_tokens_after,
              "time_limit_s": options.time_limit_s, "not_started_time_limit": not_started}
    write_report(results, out_dir, header, warning=None if gate["passed"] else gate["message"])
    summaries: dict[str, dict] = {}
    for r in results:  # the clean recall of both splits under one name
        summaries.setdefault(r.name, {}).update(r.summary)
    return summaries


# Each experiment's CPU seconds over those of the two clean-recall passes before it (development and confirmation
# items, each with its no-fact control: the probe's unit of work), measured on zoo:gdn with the default protocol
# and its 24 components on one thread (hybrid_attribution on zoo:gdn-hybrid, s_vs_r on zoo:rdn: gdn runs neither);
# SCALES_WITH_COMPONENTS grow with the model's component count.
COST_IN_CLEAN_PASSES = {
    "head_scan": 0.78, "lifecycle": 2.99, "write_reach": 4.75, "head_interaction": 0.89, "four_facts": 1.38,
    "hybrid_attribution": 0.66, "s_vs_r": 0.88, "sweep_num_bindings": 3.08, "sweep_gap": 2.27, "load_vs_gap": 0.89,
    "overlap": 0.50, "overlap_sweep": 1.46, "logit_lens": 0.23, "neutral_suppression": 0.55, "joint_topk": 0.55,
    "write_read_spearman": 6.41, "corrector": 0.98, "subspace_transfer": 1.42,
}
COST_COMPONENTS = 24
SCALES_WITH_COMPONENTS = ("head_scan", "write_read_spearman")


def estimated_seconds(names: Iterable[str], clean_seconds: float, components: int) -> dict[str, float]:
    """Each experiment's expected seconds on this machine: its ``COST_IN_CLEAN_PASSES`` times the clean-recall
    passes' ``clean_seconds`` (which grow with the sources, the prompt length and the model), scaled by
    ``components`` for the experiments that run one edit per component."""
    scale = {name: components / COST_COMPONENTS for name in SCALES_WITH_COMPONENTS}
    return {name: COST_IN_CLEAN_PASSES[name] * scale.get(name, 1.0) * clean_seconds for name in names}


def applies(model, name: str) -> bool:
    """Whether the experiment has work on this model: ``hybrid_attribution`` needs recurrent and attention layers,
    ``s_vs_r`` a residual memory; the others always run."""
    if name == "hybrid_attribution":
        return bool(attention_layers(model) and recurrent_layers(model))
    if name == "s_vs_r":
        return any(c.memory == "R" for c in heads(model))
    return True


def estimate_line(estimate: dict[str, float], experiments: int, clean_seconds: float) -> str:
    """The line a probe on a CPU prints before its experiments: the expected time and what it comes from."""
    total = sum(estimate.values())
    return (f"probe: {experiments} experiments, about {total / 60:.1f} min on this CPU (estimated from the "
            f"{clean_seconds:.1f} s of the clean-recall runs; other work on the machine makes it longer)")


def confirmation(lifecycle_rows: list[dict]) -> bool:
    """Whether the frozen choice's state swap beats its equal-norm random swap on held-out sources: the lower CI
    bound of its donor-margin shift above the random swap's upper bound."""
    pick = {r["target"]: r for r in lifecycle_rows
            if r["intervention"] == "state swap" and r["metric"] == "donor_margin_shift"}
    return bool(pick["chosen"]["low"] > pick["random"]["high"])


def load_model_dir(path: str | Path, device: str = "auto", backend: str = "auto"):
    """``(model, tokenizer)`` in float32 from a model folder, a run folder, an FLA checkpoint folder (with
    ``tokenizer.json``) or ``zoo:NAME``: ``linmem.models.loading.open_model``, strict and offline; its mixers on the
    op ``backend``."""
    from linmem.models.loading import open_model

    model, tokenizer, _ = open_model(path, device=device, dtype=torch.float32, backend=backend)
    return model, tokenizer
