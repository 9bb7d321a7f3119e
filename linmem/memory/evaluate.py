"""Batches of task items as tensors, and candidate logits of edited runs (the plumbing of the experiments)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from linmem.memory.edits import CacheEdit, Edit
from linmem.memory.intervene import SharedPrefix, run_many
from linmem.memory.metrics import choice_logits
from linmem.memory.tasks import Item


@dataclass
class Batch:
    """Items asked about one binding: ``recipient, donor [B, T]``, ``candidates [B, 4]``, ``answer, donor_answer
    [B]`` (indices into the candidates), ``sources`` (the items' source ids), ``boundary`` (first query token)."""

    recipient: torch.Tensor
    donor: torch.Tensor
    candidates: torch.Tensor
    answer: torch.Tensor
    donor_answer: torch.Tensor
    sources: list[str]
    boundary: int
    items: list[Item]

    @property
    def length(self) -> int:
        return self.recipient.shape[1]

    def subset(self, index: Sequence[int]) -> Batch:
        i = torch.as_tensor(list(index), dtype=torch.long)
        return Batch(self.recipient[i], self.donor[i], self.candidates[i], self.answer[i], self.donor_answer[i],
                     [self.sources[j] for j in index], self.boundary, [self.items[j] for j in index])


def make_batch(items: Sequence[Item], binding: str | int = "target", device: str | torch.device = "cpu") -> Batch:
    """Stack ``items`` (equal lengths) asked about ``binding``: ``"target"`` or a binding index."""
    if not items:
        raise ValueError("no items: check the sources and the split")
    queries = [it.queries[it.target if binding == "target" else binding] for it in items]
    recipient = [it.recipient + q.tokens for it, q in zip(items, queries)]
    donor = [it.donor + q.tokens for it, q in zip(items, queries)]
    if len({len(r) for r in recipient}) != 1:
        raise ValueError("items of one batch must have equal token lengths (one TaskSpec and template)")
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return Batch(as_tensor(recipient), as_tensor(donor), as_tensor([q.candidates for q in queries]),
                 as_tensor([q.answer for q in queries]), as_tensor([q.donor_answer for q in queries]),
                 [it.source_id for it in items], items[0].boundary, list(items))


def candidate_logits(model: nn.Module, batch: Batch, edit_sets: Sequence[Sequence[Edit]],
                     chunk: int | None = None, use_donor: bool = True,
                     prefix: SharedPrefix | None = None) -> torch.Tensor:
    """``[N, B, 4]`` candidate logits (float64, on the CPU like the batch's labels) at the last position under
    each of ``N`` edit sets (``chunk`` sets per batched run, on the model's device; None: as ``run_many``
    chooses); ``prefix``: as ``run_many``'s. Without ``prefix``, the sets run in the groups of
    ``shared_prefix_groups``, each from one unedited prefix. Each batch keeps only its candidates' logits."""
    groups = [(list(range(len(edit_sets))), list(edit_sets))] if prefix is not None else \
        shared_prefix_groups(edit_sets)
    candidates = lambda logits: choice_logits(  # noqa: E731  [n, B, 1, vocab] -> [n, B, 4]
        logits[:, :, 0], batch.candidates.expand(len(logits), -1, -1))
    out: list[torch.Tensor | None] = [None] * len(edit_sets)
    for index, sets in groups:
        choice = run_many(model, batch.recipient, batch.donor if use_donor else None, sets,
                          logits_at=[batch.length - 1], chunk=chunk, prefix=prefix, reduce=candidates)
        for i, c in zip(index, choice):
            out[i] = c
    return torch.stack(out).cpu()  # small: metrics on CPU


@dataclass(frozen=True)
class SplitAt(CacheEdit):
    """A cache edit that changes no state: it makes ``run_many`` run tokens ``[0, at)`` once, unedited, into a
    cache that every edit set continues from, and only ``[at, T)`` per set."""

    at: int
    components: tuple = ()


def first_edited(edits: Sequence[Edit]) -> int | None:
    """The first token a write or read-out edit of ``edits`` touches (None when none does)."""
    return min((p for e in edits for p in e.edited_positions()), default=None)


def shared_prefix_groups(edit_sets: Sequence[Sequence[Edit]]) -> list[tuple[list[int], list[list[Edit]]]]:
    """``(indices, edit sets)`` groups that run apart, each from a prefix computed once. The sets with cache edits
    split at their ``at``, joined by the sets that edit nothing before it (those of no edit among them); the other
    sets of write / read-out edits split at the first token any of them edits (``SplitAt``): before it each runs
    the clean prompt, so only the rest runs per set. One group of every set when there is nothing to split."""
    ats = {e.at for edits in edit_sets for e in edits if e.stage == "cache"}
    if len(ats) > 1:  # run_many says why
        return [(list(range(len(edit_sets))), [list(e) for e in edit_sets])]
    at = ats.pop() if ats else None
    firsts = [first_edited(edits) for edits in edit_sets]
    joined = [] if at is None else [i for i, edits in enumerate(edit_sets) if any(e.stage == "cache" for e in edits)
                                    or firsts[i] is None or firsts[i] >= at]
    rest = [i for i in range(len(edit_sets)) if i not in joined]
    split = min((firsts[i] for i in rest if firsts[i] is not None), default=0)
    if split < 1:
        return [(list(range(len(edit_sets))), [list(e) for e in edit_sets])]
    groups = [(joined, [list(edit_sets[i]) for i in joined])] if joined else []
    return groups + [(rest, [[*edit_sets[i], SplitAt(split)] for i in rest])]


def per_item(model: nn.Module, batch: Batch, make_edits, chunk: int | None = None) -> torch.Tensor:
    """``[N, B, 4]`` for edits that depend on the item (e.g. its fact spans): ``make_edits(item) -> N edit sets``,
    run one item at a time."""
    out = []
    for b, item in enumerate(tqdm(batch.items, desc="items", unit="item", leave=False, disable=None)):
        out.append(candidate_logits(model, batch.subset([b]), make_edits(item), chunk)[:, 0])
    return torch.stack(out, dim=1)
