"""The experiments of "How Linear Attention Remembers" (and the S-vs-R extension) as functions.

Each returns a ``Result``: ``rows`` (a tidy table: one dict per estimate, with its bootstrap CI, ``n`` and
``sources``), a ``summary`` dict and a matplotlib ``figure`` (see ``plots``). Items come from ``tasks``; every
estimate is over source passages (``stats.bootstrap``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from linmem.memory import batching, plots
from linmem.memory.components import Component, attention_layers, conv_width, heads, mixer, recurrent_layers
from linmem.memory.edits import (
    CacheSwap,
    DonorWrite,
    KeyAlign,
    OutputPatch,
    OutputRestore,
    StateAdd,
    StateSwap,
    WriteBlock,
)
from linmem.memory.evaluate import Batch, candidate_logits, make_batch, per_item
from linmem.memory.intervene import SharedPrefix, shared_prefix
from linmem.memory.metrics import break_rate, choice_logits, compare, donor_margin, target_margin
from linmem.memory.recording import backbone, on_model
from linmem.memory.stats import bootstrap, bootstrap_ratio, source_means
from linmem.memory.tasks import Item, TaskBuilder, TaskSpec, build_items
from linmem.models.cache import LinMemCache

METRICS = ("edited_correct", "donor_answer", "donor_margin_shift", "target_margin_change")


@dataclass
class Result:
    """One experiment's tidy ``rows``, ``summary`` and ``figure`` (None when nothing to draw)."""

    name: str
    rows: list[dict]
    summary: dict = field(default_factory=dict)
    figure: object | None = None


def estimate_rows(values: dict[str, torch.Tensor], sources: list[str], **labels) -> list[dict]:
    """One row per metric: ``labels``, ``metric`` and the bootstrap estimate over ``sources``."""
    return [{**labels, "metric": name, **bootstrap(v.cpu().numpy(), sources).as_dict()}
            for name, v in values.items()]


CHANCE = 0.25  # the 4-candidate choice of every query


def recall_warning(accuracy: float, min_clean_recall: float | None) -> dict:
    """``{"clean_recall_warning": text}`` when ``accuracy`` is below ``min_clean_recall``, else ``{}``."""
    if min_clean_recall is None or not accuracy < min_clean_recall:
        return {}
    return {"clean_recall_warning": f"clean recall {accuracy:.3f} is below the gate {min_clean_recall:g} (chance "
                                    f"{CHANCE:g}): the model does not recall these facts, so these effects "
                                    f"attribute nothing"}


def clean_recall(model: nn.Module, items: Sequence[Item], split: str = "items") -> Result:
    """Clean 4-choice accuracy of the unedited model on ``items``: a row with its source-bootstrap CI (the input
    of the probe's clean-recall gate) and, for items built with their no-fact prompts (``Item.no_fact``), a row of
    the no-fact control: the accuracy with the asked fact's presentations replaced by filler, what the text alone
    guesses (summary ``{split}_no_fact``)."""
    batch = make_batch(items)
    correct = (candidate_logits(model, batch, [[]])[0].argmax(-1) == batch.answer).double().numpy()
    rows = [{"split": split, "metric": "clean_correct", **bootstrap(correct, batch.sources).as_dict()}]
    summary = {split: rows[0]["mean"], "chance": CHANCE}
    if all(item.no_fact for item in items):
        prompts = torch.tensor([item.prompt(no_fact=True) for item in items], device=batch.recipient.device)
        without = replace(batch, recipient=prompts, donor=prompts)
        guessed = (candidate_logits(model, without, [[]])[0].argmax(-1) == batch.answer).double().numpy()
        rows.append({"split": split, "metric": "no_fact_correct", **bootstrap(guessed, batch.sources).as_dict()})
        summary[f"{split}_no_fact"] = rows[1]["mean"]
    return Result("clean_recall", rows, summary)


def recall_gate(recalls: dict[str, float], min_clean_recall: float, no_fact: dict[str, float] | None = None) -> dict:
    """The clean-recall gate over every split's accuracy (``{"development": 0.9, ...}``): ``passed`` when each is
    at least ``min_clean_recall`` (a NaN never passes), with a plain ``message`` that also gives the no-fact
    control's accuracy per split (``no_fact``, from ``clean_recall``) when measured."""
    low = {split: value for split, value in recalls.items() if not value >= min_clean_recall}
    measured = " and ".join(f"{value:.3f} on the {split} sources" for split, value in recalls.items())
    if no_fact:
        guessed = " and ".join(f"{value:.3f}" for value in no_fact.values())
        measured += (f" (with the asked fact replaced by filler, the text alone picks the answer in {guessed}: "
                     f"recall near that is the text's guess, not a memory)")
    if low:
        message = (f"Clean recall is too low to attribute anything: {measured}, below the gate --min-clean-recall "
                   f"{min_clean_recall:g} (chance is {CHANCE:g} with 4 candidates). A model that does not recall "
                   f"the facts holds no memory of them to locate, so the attributing experiments were not run. "
                   f"Lower --min-clean-recall (0 turns the gate off) to run them anyway.")
    else:
        message = f"Clean recall {measured}: at or above the gate {min_clean_recall:g} (chance {CHANCE:g})."
    return {"min_clean_recall": min_clean_recall, "chance": CHANCE, "clean_recall": recalls, "passed": not low,
            "message": message, "no_fact": no_fact or {}}


def shifts(choice: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Donor-margin shift ``[N − 1, B]`` of edit sets 1.. against set 0 (clean) from ``choice [N, B, 4]``."""
    margin = donor_margin(choice.flatten(0, 1), batch.answer.repeat(len(choice)),
                          batch.donor_answer.repeat(len(choice))).view(len(choice), -1)
    return margin[1:] - margin[:1]


def head_scan(model: nn.Module, items: Sequence[Item], components: Sequence[Component] | None = None,
              chunk: int | None = None, min_clean_recall: float | None = None) -> Result:
    """Swap one component's pre-query state at a time; rank components by the mean donor-margin shift.

    Rank stability: how many sources rank the winner first, and whether it still wins when each source is left
    out. Figure: mean shift per layer × head (one panel per memory). With ``min_clean_recall``, a clean accuracy
    below it is stated in the summary (``clean_recall_warning``): the ranking then locates no memory. ``chunk``:
    heads per batched run (None: chosen from the device's free memory, ``batching``); the summary's
    ``batch_choice`` says what ran.
    """
    batch = make_batch(items)
    comps = list(components or heads(model))
    with batching.recorded() as chosen:
        choice = candidate_logits(model, batch, [[]] + [[StateSwap([c], batch.boundary)] for c in comps], chunk)
    shift = shifts(choice, batch)
    per_source, names = zip(*[source_means(s.cpu().numpy(), batch.sources) for s in shift])
    table = np.stack(per_source)  # [C, S]
    rows = [{"component": str(c), "layer": c.layer, "head": c.head, "memory": c.memory,
             **bootstrap(s.cpu().numpy(), batch.sources).as_dict()} for c, s in zip(comps, shift)]
    order = np.argsort(-table.mean(1))
    for rank, i in enumerate(order, start=1):
        rows[i]["rank"] = rank
    best = int(order[0])
    loso = [int(np.argmax(np.delete(table, s, axis=1).mean(1))) == best for s in range(table.shape[1])]
    clean_correct = (choice[0].argmax(-1) == batch.answer).double().cpu().numpy()
    summary = {"chosen": str(comps[best]), "edit": repr(StateSwap([comps[best]], batch.boundary)),
               "top1_sources": int((table.argmax(0) == best).sum()),
               "sources": table.shape[1], "loso_agreement": int(sum(loso)),
               "clean_accuracy": bootstrap(clean_correct, batch.sources).as_dict(),
               "batch_choice": batching.summary(chosen)}
    summary.update(recall_warning(summary["clean_accuracy"]["mean"], min_clean_recall))
    return Result("head_scan", rows, summary, plots.head_scan(rows))


def control_component(model: nn.Module, chosen: Component, seed: int = 0) -> Component:
    """A control: another head of the same memory kind, in another layer where possible."""
    pool = [c for c in heads(model) if c.memory == chosen.memory and c != chosen]
    if not pool:
        raise ValueError(f"no control head: {chosen} is the model's only {chosen.memory} memory")
    other_layer = [c for c in pool if c.layer != chosen.layer] or pool
    return other_layer[np.random.default_rng(seed).integers(len(other_layer))]


def lifecycle_edits(item: Item, c: Component, control: Component, length: int, seed: int = 0) -> dict[str, list]:
    """The lifecycle's edit sets for one item: name → edits (write spans differ per item). ``seed`` draws the
    random controls' Gaussian directions: give each item its own, or every item gets the same direction."""
    at, query = item.boundary, range(item.boundary, length)
    block = lambda comp: [WriteBlock([comp], span) for span in item.target_writes]  # noqa: E731
    write = lambda comp, ctl: [DonorWrite([comp], span, ctl, seed) for span in item.target_writes]  # noqa: E731
    return {
        "write block|chosen": block(c), "write block|control head": block(control),
        "donor write|chosen": write(c, "donor"), "donor write|random": write(c, "random"),
        "donor write|control head": write(control, "donor"),
        "state swap|chosen": [StateSwap([c], at)], "state swap|random": [StateSwap([c], at, "random", seed)],
        "state swap|control head": [StateSwap([control], at)],
        "output patch|chosen": [OutputPatch([c], query)],
        "output patch|random": [OutputPatch([c], query, "random", seed)],
        "output patch|control head": [OutputPatch([control], query)],
        "output restore|chosen": [StateSwap([c], at), OutputRestore([c], query)],
        "output restore|control head": [StateSwap([c], at), OutputRestore([control], query)],
    }


def lifecycle(model: nn.Module, items: Sequence[Item], component: Component,
              control: Component | None = None, seed: int = 0, min_clean_recall: float | None = None) -> Result:
    """Write block, donor write, state swap, output patch and output restore on one component, each against the
    equal-norm random edit (a fresh Gaussian direction per item, from ``seed``) and a control head (Figs. 3-4).
    Besides the rates over all items, ``qualified_donor_answer`` is the donor-answer rate over the qualified items
    only: those whose recipient and donor prompts both give their own answer unedited (the paper's "qualified"
    rate, App. D.2; the summary counts them). Figure: donor-margin shift with CIs. ``min_clean_recall``: as in
    ``head_scan``."""
    batch = make_batch(items)
    control = control or control_component(model, component)
    names = list(lifecycle_edits(batch.items[0], component, control, batch.length))
    index = {id(item): i for i, item in enumerate(batch.items)}
    edits = lambda item: [[]] + list(lifecycle_edits(  # noqa: E731
        item, component, control, batch.length, seed * 1_000_003 + index[id(item)]).values())
    choice = per_item(model, batch, edits)
    clean = compare(choice[0], choice[0], batch.answer)["clean_correct"]
    donor_run = candidate_logits(model, replace(batch, recipient=batch.donor), [[]], use_donor=False)[0]
    qualified = clean.bool() & (donor_run.argmax(-1) == batch.donor_answer)
    qualified_sources = [s for s, q in zip(batch.sources, qualified.tolist()) if q]
    rows = []
    for i, name in enumerate(names, start=1):
        intervention, target = name.split("|")
        values = compare(choice[0], choice[i], batch.answer, batch.donor_answer)
        labels = {"intervention": intervention, "target": target,
                  "component": str(component if "control" not in target else control)}
        rows += estimate_rows({k: values[k] for k in METRICS}, batch.sources, **labels)
        if qualified_sources:
            rows += estimate_rows({"qualified_donor_answer": values["donor_answer"][qualified]}, qualified_sources,
                                  **labels)
    first = lifecycle_edits(batch.items[0], component, control, batch.length, seed * 1_000_003)
    summary = {"component": str(component), "control": str(control),
               "clean_accuracy": bootstrap(clean.cpu().numpy(), batch.sources).as_dict(),
               "qualified_items": len(qualified_sources), "items": len(batch.items),
               "edits_of_first_item": {name: [repr(e) for e in edits] for name, edits in first.items()}}
    summary.update(recall_warning(summary["clean_accuracy"]["mean"], min_clean_recall))
    return Result("lifecycle", rows, summary, plots.lifecycle(rows))


def write_reach(model: nn.Module, items: Sequence[Item], component: Component,
                control: Component | None = None) -> Result:
    """Where the fact's write lands: the lifecycle's write block and donor write widened past the fact. Over every
    presentation of the target fact and the ``d`` tokens after it, for ``d`` = 0 (the fact's own tokens: the
    lifecycle's spans) to W, W the width of the model's short convolutions (1 without them), the component's writes
    are blocked (is the write there needed?) or taken from the donor prompt (is it enough to carry the donor's
    value?), on the chosen and on a control head. The keys and values written at the W − 1 tokens after a fact are
    convolutions that still hold the fact's tokens, so a model may write the binding there; edits over the fact's
    tokens alone then leave recall as it was. ``d`` = W is one token past that reach. Rows (``intervention``,
    ``target``, ``tokens_after``): accuracy and target-margin change for the block, donor-answer rate and
    donor-margin shift for the donor write; summary: W and the chosen head's block accuracy and donor-answer rate
    at ``d`` = 0 and ``d`` = W − 1. Figure: the two by ``d``, both heads on one scale with chance."""
    batch = make_batch(items)
    control = control or control_component(model, component)
    width = conv_width(model)
    edit = {"write block": lambda comp, span: WriteBlock([comp], span),
            "donor write": lambda comp, span: DonorWrite([comp], span)}
    measured = {"write block": ("edited_correct", "target_margin_change"),
                "donor write": ("donor_answer", "donor_margin_shift")}
    cases = [(intervention, target, comp, d) for intervention in edit
             for target, comp in (("chosen", component), ("control head", control))
             for d in range(width + 1)]  # one edit set per case, in this order

    def edits(item: Item):
        return [[]] + [[edit[intervention](comp, span) for span in item.writes_widened(d).target_writes]
                       for intervention, _, comp, d in cases]

    choice = per_item(model, batch, edits)
    rows = []
    for i, (intervention, target, comp, d) in enumerate(cases, start=1):
        m = compare(choice[0], choice[i], batch.answer, batch.donor_answer)
        rows += estimate_rows({k: m[k] for k in measured[intervention]}, batch.sources,
                              intervention=intervention, target=target, component=str(comp), tokens_after=d)

    def chosen(metric: str, d: int) -> dict:
        row = next(r for r in rows if (r["target"], r["tokens_after"], r["metric"]) == ("chosen", d, metric))
        return {k: row[k] for k in ("mean", "low", "high")}

    clean = compare(choice[0], choice[0], batch.answer)["clean_correct"]
    summary = {"component": str(component), "control": str(control), "conv_width": width,
               "clean_accuracy": bootstrap(clean.cpu().numpy(), batch.sources).as_dict(),
               "blocked_fact_tokens": chosen("edited_correct", 0),
               "blocked_through_conv_reach": chosen("edited_correct", width - 1),
               "donor_fact_tokens": chosen("donor_answer", 0),
               "donor_through_conv_reach": chosen("donor_answer", width - 1)}
    return Result("write_reach", rows, summary, plots.write_reach(rows, width))


def ranking_of(model: nn.Module, dev_items: Sequence[Item], ranking: Sequence[Component] | None) -> list[Component]:
    """``ranking`` (best first), or the order of a head scan on ``dev_items`` when none is given."""
    if ranking is not None:
        return list(ranking)
    return [Component.parse(r["component"]) for r in sorted(head_scan(model, dev_items).rows, key=lambda r: r["rank"])]


def head_interaction(model: nn.Module, dev_items: Sequence[Item], test_items: Sequence[Item], component: Component,
                     ranking: Sequence[Component] | None = None, min_clean_recall: float | None = None) -> Result:
    """Do two heads act additively? Block the fact's writes into the chosen component (the hub), into the next
    component of the development ranking (the secondary), and into both, on test items (Fig. 3c).

    The interaction is ``change(both) − change(hub) − change(secondary)`` of the answer's margin over the other
    candidates, per item, with a bootstrap CI over sources: zero when the heads' effects add, negative when blocking
    both costs more than the two alone (they back each other up), positive when less (they share one role).
    Figure: each block's margin change on one scale, beside the sum of the two single blocks."""
    order = ranking_of(model, dev_items, ranking)
    secondary = next((c for c in order if c != component), None)
    if secondary is None:
        raise ValueError(f"no second component to pair with {component}: the ranking holds only it")
    batch = make_batch(test_items)
    sets = {"hub": [component], "secondary": [secondary], "both": [component, secondary]}
    edits = lambda item: [[]] + [[WriteBlock(comps, span) for span in item.target_writes]  # noqa: E731
                                 for comps in sets.values()]
    choice = per_item(model, batch, edits)
    blocked = {name: compare(choice[0], choice[i], batch.answer) for i, name in enumerate(sets, start=1)}
    change = {name: values["target_margin_change"] for name, values in blocked.items()}
    change["hub + secondary"] = change["hub"] + change["secondary"]
    change["interaction"] = change["both"] - change["hub + secondary"]
    what = {name: " + ".join(map(str, comps)) for name, comps in sets.items()}
    what.update({"hub + secondary": "", "interaction": ""})  # derived from the three blocks, not a block
    rows = [{"blocked": name, "components": what[name], "metric": "target_margin_change",
             **bootstrap(v.cpu().numpy(), batch.sources).as_dict()} for name, v in change.items()]
    rows += [{"blocked": name, "components": what[name], "metric": "edited_correct",
              **bootstrap(values["edited_correct"].cpu().numpy(), batch.sources).as_dict()}
             for name, values in blocked.items()]
    interaction = next(r for r in rows if r["blocked"] == "interaction")
    hub = next(r for r in rows if r["blocked"] == "hub" and r["metric"] == "target_margin_change")
    clean = compare(choice[0], choice[0], batch.answer)["clean_correct"]
    summary = {"hub": str(component), "secondary": str(secondary), "interaction": interaction["mean"],
               "low": interaction["low"], "high": interaction["high"], **additivity(interaction, hub),
               "clean_accuracy": bootstrap(clean.cpu().numpy(), batch.sources).as_dict()}
    summary.update(recall_warning(summary["clean_accuracy"]["mean"], min_clean_recall))
    return Result("head_interaction", rows, summary, plots.interaction(rows))


ADDITIVE_TOLERANCE = 0.1  # an interaction within ±10% of the hub's own margin change counts as additive


def additivity(interaction: dict, hub: dict, tolerance: float = ADDITIVE_TOLERANCE) -> dict:
    """Judge the head interaction against the hub's own effect: ``additive`` when the interaction's CI lies within
    ± ``tolerance`` × |the hub block's mean margin change| (a tight CI around a negligible interaction is additive),
    ``interacting`` when it lies wholly outside that band; neither: the sample cannot tell. ``interaction_share``
    is the interaction's mean over |the hub's change|."""
    band = tolerance * abs(hub["mean"])
    share = interaction["mean"] / abs(hub["mean"]) if hub["mean"] else float("nan")
    return {"additive": bool(-band <= interaction["low"] and interaction["high"] <= band),
            "interacting": bool(interaction["low"] > band or interaction["high"] < -band),
            "additive_tolerance": tolerance, "hub_change": hub["mean"], "interaction_share": share}


def states_at(model: nn.Module, ids: torch.Tensor, at: int, component: Component) -> torch.Tensor:
    """The component's memory after tokens ``[0, at)`` for each prompt of ``ids [B, T]``: ``[B, V, K]``."""
    cache = LinMemCache.from_config(model.config)
    with torch.no_grad():
        backbone(model)(input_ids=on_model(model, ids[:, :at]), cache=cache, use_cache=True)
    return cached_state(cache, component)


def cached_state(cache: LinMemCache, component: Component) -> torch.Tensor:
    """The component's memory ``[B, V, K]`` held in ``cache`` (a prefix run's, e.g. ``SharedPrefix.cache``)."""
    layer = cache.layers[component.layer]
    return (layer.base_state if component.memory == "S" else layer.residual_state)[:, component.head]


def fact_pairs(builder: TaskBuilder, sources, seed: int, split: str | None) -> tuple[list[Item], list[Item]]:
    """Two items per passage with one recipient prefix and different targets A and B."""
    if builder.spec.num_bindings < 2:
        raise ValueError("rule 'two facts': four_facts edits fact A and reads fact B; num_bindings must be >= 2")
    items_a, items_b = [], []
    for index, (source_id, source_split, ids) in enumerate(sources):
        if split is not None and source_split != split:
            continue
        a = builder.build(source_id, ids, np.random.default_rng([seed, index]), source_split)
        b_target = (a.target + 1) % builder.spec.num_bindings
        b = builder.build(source_id, ids, np.random.default_rng([seed, index]), source_split, target=b_target)
        if a.recipient != b.recipient:
            raise ValueError(f"rule 'shared recipient': facts A and B must be asked on one recipient prompt, but "
                             f"variant {builder.spec.variant!r} makes the prompt depend on the target; use "
                             f"variant='retrieval'")
        items_a.append(a)
        items_b.append(b)
    return items_a, items_b


def four_facts(model: nn.Module, builder: TaskBuilder, sources, component: Component, seed: int = 0,
               split: str | None = None) -> Result:
    """Edit fact A by the component's pre-query state swap: donor-answer rate on A, break rate on the other
    facts; then the Frobenius split of ``Δ_A`` into parts parallel and orthogonal to ``Δ_B`` (another fact's state
    difference), each added alone and against an equal-norm Gaussian, read on fact B (Fig. 5)."""
    items_a, items_b = fact_pairs(builder, sources, seed, split)
    rows, sources_a = [], [it.source_id for it in items_a]
    target = make_batch(items_a)
    edits = [[StateSwap([component], target.boundary)]]
    prefix = shared_prefix(model, target.recipient, target.donor, [[], *edits])  # the target's and the others'
    choice = candidate_logits(model, target, [[], *edits], prefix=prefix)
    values = compare(choice[0], choice[1], target.answer, target.donor_answer)
    rows += estimate_rows({k: values[k] for k in ("donor_answer", "donor_margin_shift")}, sources_a, fact="target")
    [(broken, owners, rate, denominator)] = non_target_breaks(model, items_a, edits, prefix)
    rows.append({"fact": "non-target", "metric": "break_rate", **bootstrap(broken.cpu().numpy(), owners).as_dict(),
                 "denominator": denominator})
    rows += frobenius_split(model, items_a, items_b, component, prefix=prefix)
    return Result("four_facts", rows, {"component": str(component), "break_rate": rate,
                                       "break_denominator": denominator}, plots.four_facts(rows))


def non_target_breaks(model: nn.Module, items: Sequence[Item], edit_sets: list[list],
                      prefix: SharedPrefix | None = None) -> list[tuple]:
    """Ask every non-target binding of ``items`` unedited and under each of ``edit_sets`` (applied on the target's
    donor). The prompts of all bindings share their prefix (facts and filler), so its runs are made once, or taken
    from ``prefix`` (``shared_prefix`` of these items in this order, made for ``[[], *edit_sets]``).

    Returns per edit set ``(broken [n], sources, rate, denominator)``: ``broken`` is 1 / 0 for queries right before
    the edit and NaN for the others (so a bootstrap over it is the break rate with its denominator as ``n``).
    """
    sets = [[], *edit_sets]
    if prefix is None:
        as_ids = lambda rows: torch.tensor(rows, dtype=torch.long)  # noqa: E731
        prefix = shared_prefix(model, as_ids([it.recipient for it in items]), as_ids([it.donor for it in items]),
                               sets)
    clean_right, edited_right, owners = [], [[] for _ in edit_sets], []
    for j in range(len(items[0].queries)):
        keep = [i for i, it in enumerate(items) if it.target != j]
        if not keep:
            continue
        sub = make_batch([items[i] for i in keep], binding=j)
        choice = candidate_logits(model, sub, sets, prefix=prefix.select(keep))
        marks = [compare(choice[0], edited, sub.answer) for edited in choice[1:]]
        clean_right.append(marks[0]["clean_correct"])
        for right, m in zip(edited_right, marks):
            right.append(m["edited_correct"])
        owners += sub.sources
    if not owners:  # one binding: no other fact to break
        return [(torch.zeros(0, dtype=torch.float64), [], float("nan"), 0) for _ in edit_sets]
    clean = torch.cat(clean_right)
    out = []
    for right in edited_right:
        edited = torch.cat(right)
        broken = torch.where(clean.bool(), 1.0 - edited, torch.full_like(edited, float("nan")))
        out.append((broken, owners, *break_rate(clean, edited)))
    return out


def frobenius_split(model, items_a: list[Item], items_b: list[Item], component: Component, seed: int = 0,
                    prefix: SharedPrefix | None = None):
    """Rows: B's target-margin change when ``Δ_A``, its part parallel to ``Δ_B``, its orthogonal part, and an
    equal-norm Gaussian for each are added to the recipient's pre-query state, fact B asked. ``prefix``: the
    prefix runs of items A's recipient and donor (``shared_prefix`` for a state swap), which the split then
    reads instead of running those prefixes again."""
    a, b = make_batch(items_a), make_batch(items_b)
    at = a.boundary
    if prefix is None:
        prefix = shared_prefix(model, a.recipient, a.donor, [[StateSwap([component], at)]])
    base = cached_state(prefix.cache, component)
    delta_a = cached_state(prefix.donor, component) - base
    delta_b = states_at(model, b.donor, at, component) - base
    dot = lambda x, y: (x * y).sum((-2, -1), keepdim=True)  # noqa: E731
    parallel = dot(delta_a, delta_b) / dot(delta_b, delta_b).clamp_min(1e-30) * delta_b
    parts = {"full": delta_a, "parallel": parallel, "orthogonal": delta_a - parallel}
    gen = torch.Generator().manual_seed(seed)
    edits = [[]]
    for delta in parts.values():
        noise = torch.randn(delta.shape, generator=gen, dtype=torch.float64).to(delta)
        noise = noise * dot(delta, delta).sqrt() / dot(noise, noise).sqrt()
        edits += [[StateAdd([component], at, delta)], [StateAdd([component], at, noise)]]
    query_b = _ask(items_a, items_b)
    choice = candidate_logits(model, query_b, edits, use_donor=False, prefix=prefix)  # A's recipient prefix
    rows = []
    for i, name in enumerate(parts):
        for j, kind in enumerate(("direction", "gaussian")):
            change = compare(choice[0], choice[1 + 2 * i + j], query_b.answer)["target_margin_change"]
            rows.append({"fact": "B", "part": name, "control": kind, "metric": "target_margin_change",
                         **bootstrap(change.cpu().numpy(), query_b.sources).as_dict()})
    return rows


def _ask(items_a: list[Item], items_b: list[Item]) -> Batch:
    """Items A's recipient prefix with fact B's query (B = items_b's target), one per passage."""
    asked = [Item(ia.source_id, ia.recipient, ia.recipient, ia.queries, ib.target, [], [], ia.split)
             for ia, ib in zip(items_a, items_b)]
    return make_batch(asked)


def hybrid_attribution(model: nn.Module, items: Sequence[Item]) -> Result:
    """Swap the pre-query recurrent caches (states + conv), the attention KV caches, or both; each's donor-margin
    shift as a share of both together (normalized donor effect, Fig. 6: a ratio of source means, its CI from
    resampled sources)."""
    rec, att = recurrent_layers(model), attention_layers(model)
    if not (rec and att):  # one kind of cache carries everything: a share of 1.0 would say nothing
        return Result("hybrid_attribution", [], {"note": "not a hybrid: the model has no "
                                                 f"{'attention' if rec else 'recurrent'} layers"}, None)
    batch = make_batch(items)
    at = batch.boundary
    sets = {"recurrent": [CacheSwap(rec, at, ("recurrent", "conv"))], "kv": [CacheSwap(att, at, "kv")],
            "both": [CacheSwap(rec + att, at)]}
    choice = candidate_logits(model, batch, [[]] + list(sets.values()))
    shift = shifts(choice, batch)
    rows = []
    full = shift[-1].cpu().numpy()
    for i, name in enumerate(sets):
        rows.append({"cache": name, "metric": "normalized_donor_effect",
                     **bootstrap_ratio(shift[i].cpu().numpy(), full, batch.sources).as_dict()})
        rows.append({"cache": name, "metric": "donor_margin_shift",
                     **bootstrap(shift[i].cpu().numpy(), batch.sources).as_dict()})
    return Result("hybrid_attribution", rows, {"attention_layers": att}, plots.hybrid(rows))


def s_vs_r(model: nn.Module, items: Sequence[Item]) -> Result:
    """Residual models: per layer, swap all heads' S, all heads' R, or both at the query boundary; donor-margin
    shift of each and its share of the layer's both-swap."""
    batch = make_batch(items)
    at, rows = batch.boundary, []
    layers = [i for i in recurrent_layers(model) if mixer(model, i).memory.residual]
    if not layers:
        return Result("s_vs_r", [], {"note": "no residual memory in this model"}, None)
    sets = []
    for layer in layers:
        comp = {m: [c for c in heads(model) if c.layer == layer and c.memory == m] for m in "SR"}
        sets += [[StateSwap(comp["S"], at)], [StateSwap(comp["R"], at)], [StateSwap(comp["S"] + comp["R"], at)]]
    shift = shifts(candidate_logits(model, batch, [[]] + sets), batch)
    for n, layer in enumerate(layers):
        both = shift[3 * n + 2]
        for m, memory in enumerate(("S", "R", "S+R")):
            s = shift[3 * n + m]
            rows.append({"layer": layer, "memory": memory, "metric": "donor_margin_shift",
                         **bootstrap(s.cpu().numpy(), batch.sources).as_dict()})
            rows.append({"layer": layer, "memory": memory, "metric": "share_of_layer",
                         **bootstrap_ratio(s.cpu().numpy(), both.cpu().numpy(), batch.sources).as_dict()})
    return Result("s_vs_r", rows, {"layers": layers}, plots.s_vs_r(rows))


def sweep_specs(tokenizer, base: TaskSpec, field_name: str, values: Sequence[int],
                fixed_length: bool = True) -> list[TaskSpec]:
    """The ``TaskSpec`` of each point of a sweep of ``field_name`` over ``values``.

    ``num_bindings`` with ``fixed_length`` (Fig. 7a): every prompt as long as the smallest load's with the base
    filler, the filler shortened by the added facts' tokens, so the load is not confounded with the length. ``gap``
    moves filler from before the facts to before the query: the length is fixed by construction.
    """
    if field_name not in ("num_bindings", "gap"):
        raise ValueError(f"field_name must be 'num_bindings' or 'gap'; got {field_name!r}")
    specs = [replace(base, **{field_name: value}) for value in values]
    if field_name != "num_bindings" or not fixed_length:
        return specs
    fact = len(TaskBuilder(tokenizer, base).fact(0, 0))
    fewest = min(values)
    out = []
    for spec in specs:
        filler = base.filler_tokens - (spec.num_bindings - fewest) * spec.repeats * fact
        if filler < (base.gap or 0):
            raise ValueError(f"rule 'fixed length': {spec.num_bindings} bindings x {spec.repeats} presentations "
                             f"of {fact} tokens leave {filler} filler tokens of {base.filler_tokens} (gap "
                             f"{base.gap or 0}); raise filler_tokens or lower the largest load")
        out.append(replace(spec, filler_tokens=filler))
    return out


def sweep(model: nn.Module, tokenizer, sources, component: Component, base: TaskSpec, field_name: str,
          values: Sequence[int], seed: int = 0, split: str | None = None, fixed_length: bool = True,
          min_clean_recall: float | None = None) -> Result:
    """Clean accuracy, the component's state-swap effect (vs the equal-norm random swap) and the non-target break
    rate as one field of the ``TaskSpec`` varies: ``num_bindings`` (load, at a fixed prompt length unless
    ``fixed_length=False``; see ``sweep_specs``) or ``gap`` (Figs. 7-8).

    With ``min_clean_recall``, the points whose clean accuracy falls below it are listed in the summary
    (``below_clean_recall``) and their attribution rows carry ``below_clean_recall = True``: the paper drops
    such conditions, where the model no longer holds the fact to be moved."""
    rows, below = [], []
    for value, spec in zip(values, sweep_specs(tokenizer, base, field_name, values, fixed_length)):
        batch = make_batch(build_items(TaskBuilder(tokenizer, spec), sources, seed=seed, split=split))
        at = batch.boundary
        edits = [[StateSwap([component], at, control)] for control in ("donor", "random")]
        prefix = shared_prefix(model, batch.recipient, batch.donor, [[], *edits])  # the target's and the others'
        choice = candidate_logits(model, batch, [[], *edits], prefix=prefix)
        point = len(rows)
        breaks = non_target_breaks(model, batch.items, edits, prefix)
        for i, kind in ((1, "chosen"), (2, "random")):
            m = compare(choice[0], choice[i], batch.answer, batch.donor_answer)
            rows += estimate_rows({"clean_correct": m["clean_correct"], "donor_margin_shift":
                                   m["donor_margin_shift"], "donor_answer": m["donor_answer"]},
                                  batch.sources, **{field_name: value}, edit=kind)
            broken, owners, _, _ = breaks[i - 1]
            if owners:
                rows.append({field_name: value, "edit": kind, "metric": "break_rate",
                             **bootstrap(broken.cpu().numpy(), owners).as_dict()})
        recall = compare(choice[0], choice[0], batch.answer)["clean_correct"].mean().item()
        if min_clean_recall is not None and recall < min_clean_recall:
            below.append(value)
            for row in rows[point:]:
                row["below_clean_recall"] = row["metric"] != "clean_correct"
    summary = {"component": str(component)}
    if min_clean_recall is not None:
        summary.update(min_clean_recall=min_clean_recall, below_clean_recall=below)
    return Result(f"sweep_{field_name}", rows, summary, plots.sweep(rows, field_name))


def load_vs_gap(model: nn.Module, tokenizer, sources, base: TaskSpec, loads: Sequence[int], gaps: Sequence[int],
                seed: int = 0, split: str | None = None) -> Result:
    """Fig. 7a-b's comparison: do more facts hurt recall more than a longer gap? Clean recall and the answer's
    target margin at the fewest and the most facts (at ``base``'s gap, prompts of one length as in ``sweep``) and
    at the shortest and the longest gap (at ``base``'s load); each drop (first point − last point) per source, and
    ``load drop − gap drop`` with a source-paired bootstrap interval: > 0 when adding facts costs more than
    lengthening the gap. The summary gives the difference for recall and for the margin (the continuous measure,
    which separates what 16 sources' 0/1 recall cannot) and whether each interval lies above zero.

    Every condition is built from the same ``sources`` with the same seed, so a source's four values are paired.
    Reads clean runs only (no edit, no component).
    """
    fewest, most, shortest, longest = min(loads), max(loads), min(gaps), max(gaps)
    if fewest == most or shortest == longest:
        raise ValueError(f"load_vs_gap needs two loads and two gaps; got loads {list(loads)}, gaps {list(gaps)}")
    by_load = sweep_specs(tokenizer, base, "num_bindings", [fewest, most])
    by_gap = sweep_specs(tokenizer, base, "gap", [shortest, longest])
    conditions = [("load", fewest, by_load[0]), ("load", most, by_load[1]),
                  ("gap", shortest, by_gap[0]), ("gap", longest, by_gap[1])]
    per_source: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    rows, names = [], None
    for field_name, value, spec in conditions:
        batch = make_batch(build_items(TaskBuilder(tokenizer, spec), sources, seed=seed, split=split))
        clean = candidate_logits(model, batch, [[]])[0]
        values = {"clean_correct": (clean.argmax(-1) == batch.answer.to(clean.device)).double(),
                  "target_margin": target_margin(clean, batch.answer).double()}
        rows += estimate_rows(values, batch.sources, condition=field_name, value=value)
        means = {}
        for metric, v in values.items():
            means[metric], found = source_means(v.cpu().numpy(), batch.sources)
            if names is not None and list(found) != list(names):
                raise RuntimeError("load_vs_gap: the conditions' items come from different sources")
            names = found
        per_source[(field_name, value)] = means
    summary = {"loads": [fewest, most], "gaps": [shortest, longest], "num_bindings_at_gaps": base.num_bindings,
               "gap_at_loads": base.gap or 0}
    for metric in ("clean_correct", "target_margin"):
        load_drop = per_source[("load", fewest)][metric] - per_source[("load", most)][metric]
        gap_drop = per_source[("gap", shortest)][metric] - per_source[("gap", longest)][metric]
        for name, drop in (("load drop", load_drop), ("gap drop", gap_drop),
                           ("load drop − gap drop", load_drop - gap_drop)):
            rows.append({"comparison": name, "metric": metric, **bootstrap(drop, list(names)).as_dict()})
    for metric, key in (("clean_correct", "recall"), ("target_margin", "margin")):
        d = next(r for r in rows if r.get("comparison") == "load drop − gap drop" and r["metric"] == metric)
        summary[f"{key}_difference"] = {"mean": d["mean"], "low": d["low"], "high": d["high"]}
        summary[f"more_facts_hurt_more_{key}"] = bool(d["low"] > 0)
    return Result("load_vs_gap", rows, summary, plots.load_vs_gap(rows))


def overlap(model: nn.Module, items: Sequence[Item], component: Component) -> Result:
    """Write-key overlap (Fig. 7, right): the component's write keys over the text after the target's last
    presentation turned toward the key it wrote the target's value with (``KeyAlign`` "align"), away from it
    ("orthogonal", the control), or the same on a control head; the target-margin change of each."""
    batch = make_batch(items)
    control = control_component(model, component)

    def edits(item: Item):
        toward, span = item.value_positions[-1], (item.value_positions[-1] + 1, item.boundary)
        return [[], [KeyAlign([component], span, toward)], [KeyAlign([component], span, toward, "orthogonal")],
                [KeyAlign([control], span, toward)]]

    choice = per_item(model, batch, edits)
    rows = []
    for i, name in enumerate(("align", "orthogonal", "align, control head"), start=1):
        m = compare(choice[0], choice[i], batch.answer)
        rows += estimate_rows({"target_margin_change": m["target_margin_change"], "edited_correct":
                               m["edited_correct"]}, batch.sources, edit=name)
    return Result("overlap", rows, {"component": str(component), "control": str(control)}, plots.overlap(rows))


def overlap_sweep(model: nn.Module, tokenizer, sources, component: Component, base: TaskSpec,
                  loads: Sequence[int], seed: int = 0, split: str | None = None, fixed_length: bool = True) -> Result:
    """The write-key overlap edits of ``overlap`` at each load (Fig. 7, right: align, orthogonalize, control head
    per number of bindings), prompts of one length across loads as in ``sweep``."""
    rows, control = [], control_component(model, component)
    for value, spec in zip(loads, sweep_specs(tokenizer, base, "num_bindings", loads, fixed_length)):
        items = build_items(TaskBuilder(tokenizer, spec), sources, seed=seed, split=split)
        rows += [{"num_bindings": value, **r} for r in overlap(model, items, component).rows]
    summary = {"component": str(component), "control": str(control)}
    return Result("overlap_sweep", rows, summary, plots.overlap(rows, ("num_bindings", "edit")))


def neutral_suppression(model: nn.Module, items: Sequence[Item], component: Component) -> Result:
    """Items of ``TaskSpec(variant="neutral")``: the component's pre-query state taken from the run where the
    target fact is replaced by filler; accuracy of the target and of the other facts, before and after (D.1)."""
    rows, owners = [], []
    bindings = len(items[0].queries)
    by_fact = {"target": [], "other": []}
    whole = make_batch(items)
    sets = [[], [StateSwap([component], whole.boundary)]]
    prefix = shared_prefix(model, whole.recipient, whole.donor, sets)  # every binding's prompts share it
    for j in range(bindings):
        for fact, keep in (("target", [i for i, it in enumerate(items) if it.target == j]),
                           ("other", [i for i, it in enumerate(items) if it.target != j])):
            if not keep:
                continue
            batch = make_batch([items[i] for i in keep], binding=j)
            choice = candidate_logits(model, batch, sets, prefix=prefix.select(keep))
            m = compare(choice[0], choice[1], batch.answer)
            by_fact[fact].append((m["clean_correct"], m["edited_correct"], batch.sources))
    for fact, parts in by_fact.items():
        clean = torch.cat([p[0] for p in parts])
        edited = torch.cat([p[1] for p in parts])
        owners = [s for p in parts for s in p[2]]
        rows += estimate_rows({"clean_correct": clean, "edited_correct": edited, "change": edited - clean}, owners,
                              fact=fact)
    return Result("neutral_suppression", rows, {"component": str(component)}, plots.neutral(rows))


@torch.no_grad()
def logit_lens(model: nn.Module, items: Sequence[Item]) -> Result:
    """4-choice accuracy of the answer read from the residual stream after each block (final norm + LM head at
    the last position): the layer where the answer becomes readable (C, Fig. 11)."""
    batch = make_batch(items)
    hidden = backbone(model)(input_ids=on_model(model, batch.recipient), output_hidden_states=True,
                             use_cache=False).hidden_states
    norm, rows = backbone(model).norm, []
    for layer in range(len(hidden) - 1):
        stream = hidden[layer + 1][:, -1]
        stream = stream if layer == len(hidden) - 2 else norm(stream)
        choice = choice_logits(model.lm_head(stream), batch.candidates).cpu()
        correct = (choice.argmax(-1) == batch.answer).double()
        rows += estimate_rows({"lens_accuracy": correct}, batch.sources, layer=layer)
    return Result("logit_lens", rows, {}, plots.lens(rows))


def joint_topk(model: nn.Module, dev_items: Sequence[Item], test_items: Sequence[Item],
               ks: Sequence[int] = (1, 2, 4, 8), ranking: Sequence[Component] | None = None) -> Result:
    """Rank components on development items (or take ``ranking``, e.g. a head scan's order, best first), then
    swap the top k jointly on test items; the share of the effect of swapping every state and conv cache (E.2,
    Fig. 14), a ratio of source means."""
    order = ranking_of(model, dev_items, ranking)
    batch = make_batch(test_items)
    at = batch.boundary
    ks = [k for k in ks if k <= len(order)]
    full = [StateSwap(order, at), CacheSwap(recurrent_layers(model), at, ("conv",))]
    choice = candidate_logits(model, batch, [[]] + [[StateSwap(order[:k], at)] for k in ks] + [full])
    shift = shifts(choice, batch)
    rows = [{"k": k, "metric": "share_of_full",
             **bootstrap_ratio(shift[i].cpu().numpy(), shift[-1].cpu().numpy(), batch.sources).as_dict()}
            for i, k in enumerate(ks)]
    return Result("joint_topk", rows, {"order": [str(c) for c in order[: max(ks)]]}, plots.topk(rows))


def write_read_spearman(model: nn.Module, items: Sequence[Item], draws: int = 500, seed: int = 0) -> Result:
    """Every component's write importance (donor write at the fact) and read importance (pre-query state swap),
    and their Spearman correlation across components with a bootstrap CI over sources (C, Fig. 10)."""
    from linmem.memory.stats import spearman

    batch = make_batch(items)
    comps = heads(model)
    writes = lambda item: [[]] + [[DonorWrite([c], s) for s in item.target_writes] for c in comps]  # noqa: E731
    write_shift = shifts(per_item(model, batch, writes), batch).cpu().numpy()  # [C, B]
    read_shift = shifts(candidate_logits(model, batch, [[]] + [[StateSwap([c], batch.boundary)] for c in comps]),
                        batch).cpu().numpy()
    names = sorted(set(batch.sources))
    index = {n: [i for i, s in enumerate(batch.sources) if s == n] for n in names}
    rho = lambda picks: spearman(write_shift[:, picks].mean(1), read_shift[:, picks].mean(1))  # noqa: E731
    rng = np.random.default_rng(seed)
    boots = [rho([i for n in rng.choice(names, len(names)) for i in index[n]]) for _ in range(draws)]
    low, high = np.nanpercentile(boots, [2.5, 97.5])
    rows = [{"component": str(c), "write_shift": float(w.mean()), "read_shift": float(r.mean())}
            for c, w, r in zip(comps, write_shift, read_shift)]
    summary = {"spearman": rho(list(range(len(batch.sources)))), "low": float(low), "high": float(high),
               "sources": len(names), "components": len(comps)}
    return Result("write_read_spearman", rows, summary, plots.write_read(rows, summary))
