"""Hand-differentiated pieces of the chunk backend (``chunk.py``): the decay-weighted score matrices and the reads
of the chunked memories.

Each is a ``torch.autograd.Function`` whose backward is written out, so that the several gradients that meet in one
tensor (the query read of both RLA/RDN memories, the strict key read and its residual target) are summed inside the
matrix products (``baddbmm``) instead of in separate passes, and no pass goes through masks, broadcasts or
``clamp``. Every tensor is ``[.., C, D]`` over batch dims ``[B, H, N]`` (chunk layout), per-head log decays are
``[.., C]`` and row scalings ``[.., C, 1]`` (per head) or ``[.., C, K]`` (per key channel).
"""

from __future__ import annotations

import torch


def flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, C, D]`` → ``[B·H·N, C, D]`` (contiguous) for ``bmm``/``baddbmm``."""
    return x.contiguous().flatten(0, -3)


def scaled_product(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · (a @ b)`` for ``[n, i, j] @ [n, j, l]``, the factor taken by the product itself."""
    return torch.baddbmm(a.new_zeros(()).expand(a.shape[0], a.shape[1], b.shape[2]), a, b, beta=0, alpha=scale)


def negated_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``−(a @ b)``, the sign taken by the product itself."""
    return scaled_product(a, b, -1.0)


def row_scale_grads(grad_scaled: torch.Tensor, x: torch.Tensor, scale: torch.Tensor):
    """Gradients of ``x · scale`` (``scale [.., C, 1]`` per head or ``[.., C, K]`` per key) from the gradient of the
    product."""
    grad_scale = grad_scaled * x
    if scale.shape[-1] == 1:
        grad_scale = grad_scale.sum(-1, keepdim=True)
    return grad_scaled * scale, grad_scale


def decay_matrix(e: torch.Tensor, b: torch.Tensor, strict: bool) -> torch.Tensor:
    """``e^{e_t − b_s}`` for ``s ≤ t`` (``s < t`` if strict), else 0: ``[.., C, C]`` from ``e, b [.., C]``. The
    masked entries are overwritten, never multiplied, so an overflow there does no harm."""
    return (e.unsqueeze(-1) - b.unsqueeze(-2)).exp_().tril_(-1 if strict else 0)


def exponent_grads(grad: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``M_ts = e^{e_t − b_s} P_ts`` and the gradient of M: the gradients of ``e`` (rows) and of ``−b``
    (columns)."""
    grad_exponent = grad * scores
    return grad_exponent.sum(-1), grad_exponent.sum(-2)


class DecayedScores(torch.autograd.Function):
    """``M_ts = e^{e_t − b_s} x_tᵀ k_s`` for ``s ≤ t`` (``s < t`` if strict), else 0, for per-head log decays
    ``e, b [.., C]`` and ``x, k [.., C, K]``: one ``[.., C, C]`` matrix per exponent ``e``, all from one product
    ``x kᵀ`` (``x = None`` means ``x = k``).

    Autograd's backward, through the masked exponential and the broadcast difference, makes about twice as many
    passes over the ``[C, C]`` matrices; and for ``x = k`` the product is symmetric, so ``dk = (dP + dPᵀ) k`` takes
    one matrix product instead of two.
    """

    @staticmethod
    def forward(ctx, x, k, b, strict, *exponents):
        keys_only = x is None
        x = k if keys_only else x
        product = torch.matmul(x, k.mT)
        decays = [decay_matrix(e, b, strict) for e in exponents]
        scores = [product.mul_(decays[0])] if len(decays) == 1 else [product * d for d in decays]
        ctx.keys_only = keys_only
        ctx.save_for_backward(x, k, *decays, *scores)
        return tuple(scores)

    @staticmethod
    def backward(ctx, *grads):
        x, k, *saved = ctx.saved_tensors
        decays, scores = saved[: len(grads)], saved[len(grads) :]
        grad_product = grads[0] * decays[0]
        for grad, decay in zip(grads[1:], decays[1:]):
            grad_product += grad * decay
        grad_exponents, grad_b = [], 0
        for grad, score in zip(grads, scores):
            grad_rows, grad_columns = exponent_grads(grad, score)
            grad_exponents.append(grad_rows)
            grad_b = grad_b - grad_columns
        if ctx.keys_only:
            grad_x, grad_k = None, (grad_product + grad_product.mT) @ k
        else:
            grad_x, grad_k = grad_product @ k, grad_product.mT @ x
        return grad_x, grad_k, grad_b, None, *grad_exponents


class QueryRead(torch.autograd.Function):
    """The query read-out of one memory, ``o = (x·E) Sᵀ + M u`` (any score matrix M), or of RLA/RDN's two memories
    with output gates, ``o = (x·E) Sᵀ + tril(M, −1) u + γ·((x·E) Rᵀ + M w)`` (``α_t S_{t−1} q_t + γ_t R_t q_t``
    for the inclusive query scores M). S, R ``[.., V, K]`` are the states before the chunk, u, w ``[.., C, V]``
    the writes, E the read's decay from the chunk start; γ ``[.., C]``."""

    @staticmethod
    def forward(ctx, x, decay, scores, state, writes, residual_state=None, residual_writes=None, gamma=None):
        inputs = (x, decay, scores, state, writes, residual_state, residual_writes, gamma)
        ctx.shapes = [None if t is None else t.shape for t in inputs]
        x, decay, scores, state, writes = map(flat, (x, decay, scores, state, writes))
        weighted = x * decay
        o = torch.bmm(weighted, state.mT)
        if residual_state is None:
            o.baddbmm_(scores, writes)
            ctx.save_for_backward(x, decay, weighted, scores, state, writes)
            return o.view(ctx.shapes[4])
        residual_state, residual_writes = flat(residual_state), flat(residual_writes)
        gamma = gamma.contiguous().flatten(0, -2).unsqueeze(-1)
        strict = scores.tril(-1)
        o.baddbmm_(strict, writes)
        residual = torch.bmm(weighted, residual_state.mT).baddbmm_(scores, residual_writes)
        o.addcmul_(residual, gamma)
        ctx.save_for_backward(x, decay, weighted, scores, state, writes, strict, residual_state, residual_writes,
                              gamma, residual)
        return o.view(ctx.shapes[4])

    @staticmethod
    def backward(ctx, grad):
        x, decay, weighted, scores, state, writes, *second = ctx.saved_tensors
        grad = flat(grad)
        grad_weighted = torch.bmm(grad, state)
        grad_state = torch.bmm(grad.mT, weighted)
        grad_scores = torch.bmm(grad, writes.mT)
        grads = [grad_state]
        if not second:
            grads.append(torch.bmm(scores.mT, grad))
        else:
            strict, residual_state, residual_writes, gamma, residual = second
            grad_residual = grad * gamma
            grad_weighted.baddbmm_(grad_residual, residual_state)
            grad_scores.tril_(-1).baddbmm_(grad_residual, residual_writes.mT)
            grads += [torch.bmm(strict.mT, grad), torch.bmm(grad_residual.mT, weighted),
                      torch.bmm(scores.mT, grad_residual), (grad * residual).sum(-1)]
        grad_x, grad_decay = row_scale_grads(grad_weighted, x, decay)
        grads = [grad_x, grad_decay, grad_scores, *grads]
        return tuple(g.view(shape) for g, shape in zip(grads, ctx.shapes)) + (None,) * (8 - len(grads))


def residual_target(error: torch.Tensor, target: str, clip: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``r = ρ(error)`` (see ``linmem.ops.step.residual_target``) and what its gradient needs: where the error was
    not clipped (the bounds included, as for ``clamp``), or r itself for ``"tanh"``."""
    if target == "clip":
        r = error.clamp(-clip, clip)
        return r, r == error
    if target == "tanh":
        r = torch.tanh(error / clip).mul_(clip)
        return r, r
    return error, None


def residual_target_grad(grad: torch.Tensor, slope: torch.Tensor | None, target: str, clip: float) -> torch.Tensor:
    """The error's gradient from r's (``grad`` itself for ``"identity"``)."""
    if target == "clip":
        return grad * slope
    if target == "tanh":  # d/dx c·tanh(x/c) = 1 − (r/c)²
        return grad - grad * slope * slope / clip**2
    return grad


class KeyReadTarget(torch.autograd.Function):
    """The residual memory's target ``r = ρ(v − (x·E) Sᵀ − M u)`` from the strict key read ``S_{t−1} k_t``
    (x = k, E = e^{b_{t−1}}, M the strict key scores), ρ one of ``"clip"``, ``"tanh"``, ``"identity"``. The error
    is formed inside the two matrix products."""

    @staticmethod
    def forward(ctx, x, decay, scores, state, writes, values, target, clip):
        ctx.shapes = [t.shape for t in (x, decay, scores, state, writes)]
        x, decay, scores, state, writes, values = map(flat, (x, decay, scores, state, writes, values))
        weighted = x * decay
        error = torch.baddbmm(values, weighted, state.mT, alpha=-1).baddbmm_(scores, writes, alpha=-1)
        r, slope = residual_target(error, target, clip)
        ctx.target, ctx.clip = target, clip
        ctx.save_for_backward(x, decay, weighted, scores, state, writes, slope)
        return r.view(ctx.shapes[4])

    @staticmethod
    def backward(ctx, grad):
        x, decay, weighted, scores, state, writes, slope = ctx.saved_tensors
        grad = residual_target_grad(flat(grad), slope, ctx.target, ctx.clip)
        grad_x, grad_decay = row_scale_grads(negated_product(grad, state), x, decay)
        grads = (grad_x, grad_decay, negated_product(grad, writes.mT), negated_product(grad.mT, weighted),
                 negated_product(scores.mT, grad))
        return *(g.view(shape) for g, shape in zip(grads, ctx.shapes)), grad.view(ctx.shapes[4]), None, None
