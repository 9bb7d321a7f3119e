"""Rank-k subspace transfer of a fact's edit direction (paper 2, App. D.2).

A fact's edit direction at one component is ``Δ = S_donor − S_recipient`` ``[V, K]``, the pre-query state
difference that the state swap adds. Two questions about its structure:

- **How many ranks carry the edit?** ``Δ``'s own rank-k truncation (SVD, ``U_k Σ_k V_kᵀ``) added to the recipient
  state; at full rank it is the state swap itself.
- **Does a shared answer subspace exist?** A rank-k basis of the value side (the read-out side: the head reads
  ``S q ∈ R^V``) learned from development items' ``Δ``s, and each held-out item's ``Δ`` projected onto it
  (``P_k Δ``, ``P_k = B_k B_kᵀ``) or onto its orthogonal complement (``Δ − P_k Δ``). If a fixed subspace carried
  every answer, ``P_k Δ`` would move the answer as the whole ``Δ`` does and the rest would do nothing; the paper
  finds a colour basis moves colours but not shapes (test items of another value vocabulary).

Every edit is compared with an equal-norm random rank-k matrix (a product of two Gaussians, scaled to the norm of
the rank-k truncation), drawn afresh per item.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from linmem.memory import plots
from linmem.memory.components import Component
from linmem.memory.edits import StateAdd
from linmem.memory.evaluate import Batch, candidate_logits, make_batch
from linmem.memory.experiments import Result, estimate_rows, recall_warning, states_at
from linmem.memory.metrics import compare
from linmem.memory.tasks import Item

RANKS = (1, 2, 4, 8)


def edit_directions(model: nn.Module, batch: Batch, component: Component) -> torch.Tensor:
    """``Δ = S_donor − S_recipient`` ``[B, V, K]`` (float64) of ``component`` after the prefix (the query
    boundary) of each prompt pair."""
    at = batch.boundary
    donor = states_at(model, batch.donor, at, component).double()
    return (donor - states_at(model, batch.recipient, at, component).double()).cpu()


def truncate(delta: torch.Tensor, k: int) -> torch.Tensor:
    """Each matrix's best rank-``k`` approximation (truncated SVD) for ``delta [B, V, K]``; ``k`` at or above
    ``min(V, K)`` returns ``delta``."""
    if k < 1:
        raise ValueError(f"rank k must be >= 1; got {k}")
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    k = min(k, s.shape[-1])
    return (u[..., :k] * s[..., None, :k]) @ vh[..., :k, :]


def value_basis(deltas: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(basis [V, k], energy [min(V, N·K)])``: the top-``k`` left singular vectors of the development items'
    unit-norm ``Δ``s side by side (``[V, N·K]``; each item weighs the same), and the share of their squared
    Frobenius norm each singular direction holds."""
    if deltas.dim() != 3 or not len(deltas):
        raise ValueError(f"deltas must be [N, V, K] with N >= 1; got {list(deltas.shape)}")
    norms = deltas.flatten(1).norm(dim=1).clamp_min(1e-30)
    side_by_side = (deltas / norms[:, None, None]).permute(1, 0, 2).reshape(deltas.shape[1], -1)
    u, s, _ = torch.linalg.svd(side_by_side, full_matrices=False)
    return u[:, :k], s.pow(2) / s.pow(2).sum()


def project(delta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``B Bᵀ Δ`` for ``delta [N, V, K]`` and an orthonormal ``basis [V, k]``: the part of each ``Δ`` whose
    read-out lies in the basis."""
    basis = basis.to(delta)
    return basis @ (basis.T @ delta)


def random_rank_k(shape: torch.Size, k: int, norms: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gaussian rank-``k`` matrices ``[B, V, K]`` (a ``[V, k] @ [k, K]`` product each) with Frobenius norms
    ``norms [B]``."""
    batch, rows, cols = shape
    k = min(k, rows, cols)
    left = torch.randn(batch, rows, k, generator=generator, dtype=torch.float64)
    right = torch.randn(batch, k, cols, generator=generator, dtype=torch.float64)
    noise = left @ right
    return noise * (norms / noise.flatten(1).norm(dim=1).clamp_min(1e-30))[:, None, None]


def subspace_transfer(model: nn.Module, dev_items: Sequence[Item], test_items: Sequence[Item],
                      component: Component, ranks: Sequence[int] = RANKS, seed: int = 0,
                      vocabularies: tuple[str, str] | None = None, min_clean_recall: float | None = None) -> Result:
    """Per rank k (and full rank): donor-answer rate and donor-margin shift on ``test_items`` when each item's
    ``Δ`` at ``component`` is replaced by its own rank-k truncation (``own``), its projection on the rank-k value
    basis learned from ``dev_items`` (``basis``), the rest of it (``orthogonal``), or an equal-norm random rank-k
    matrix (``random``), added to the recipient's pre-query state (``StateAdd``). ``test_items`` may use another
    value vocabulary than ``dev_items`` (the paper's colours → shapes); ``vocabularies`` names the two
    (development, test) in the summary. With ``min_clean_recall``, test facts recalled below it (clean
    4-choice accuracy) set the summary's ``below_clean_recall`` (with the lab's ``clean_recall_warning``) and mark
    every row: a model that does not recall the test facts has no answer for an edit to move (the paper drops such
    conditions)."""
    dev, test = make_batch(dev_items), make_batch(test_items)
    dev_delta, delta = edit_directions(model, dev, component), edit_directions(model, test, component)
    full = min(delta.shape[-2:])
    ks = sorted({k for k in ranks if 1 <= k < full}) + [full]
    generator = torch.Generator().manual_seed(seed)
    parts, labels = [], []
    for k in ks:
        own = truncate(delta, k)
        basis, _ = value_basis(dev_delta, k)
        projected = project(delta, basis)
        random = random_rank_k(delta.shape, k, own.flatten(1).norm(dim=1), generator)
        for name, part in (("own", own), ("basis", projected), ("orthogonal", delta - projected),
                           ("random", random)):
            if k == full and name in ("basis", "orthogonal"):  # a full basis projects Δ onto itself
                continue
            parts.append(part)
            labels.append((k, name))
    at = test.boundary
    edits = [[]] + [[StateAdd([component], at, part)] for part in parts]
    choice = candidate_logits(model, test, edits, use_donor=False)
    rows = []
    for i, (k, name) in enumerate(labels, start=1):
        values = compare(choice[0], choice[i], test.answer, test.donor_answer)
        norm_share = (parts[i - 1].flatten(1).norm(dim=1) / delta.flatten(1).norm(dim=1).clamp_min(1e-30))
        rows += estimate_rows({"donor_answer": values["donor_answer"],
                               "donor_margin_shift": values["donor_margin_shift"],
                               "norm_share": norm_share}, test.sources, rank=k, full=k == full, edit=name)
    _, energy = value_basis(dev_delta, full)
    summary = {"component": str(component), "ranks": ks, "full_rank": full, "dev_items": len(dev_items),
               "test_items": len(test_items),
               "basis_energy": {k: float(energy[:k].sum()) for k in ks},
               "clean_accuracy": float(compare(choice[0], choice[0], test.answer)["clean_correct"].mean())}
    if vocabularies is not None:
        summary["basis_values"], summary["test_values"] = vocabularies
    if min_clean_recall is not None:
        below = summary["clean_accuracy"] < min_clean_recall
        summary.update(min_clean_recall=min_clean_recall, below_clean_recall=below,
                       **recall_warning(summary["clean_accuracy"], min_clean_recall))
        for row in rows:
            row["below_clean_recall"] = below
    return Result("subspace_transfer", rows, summary, plots.subspace_transfer(rows))
