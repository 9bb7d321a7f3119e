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
import torch.nn.functional as F

from linmem.ops.step import rho


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


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``Σ_{j<t} x_j`` along ``dim``: a sum of the earlier terms only, never ``cumsum − x`` (which is NaN for an
    infinite term and loses the small terms next to a huge one)."""
    return F.pad(x.narrow(dim, 0, x.shape[dim] - 1).movedim(dim, -1), (1, 0)).movedim(-1, dim).cumsum(dim)


def reverse_cumsum(x: torch.Tensor, dim: int = -1, exclusive: bool = False) -> torch.Tensor:
    """``Σ_{j≥t} x_j`` (``Σ_{j>t}`` if exclusive) along ``dim``: the decay from a token to the chunk end, and the
    adjoint of ``cumsum``."""
    flipped = x.flip(dim)
    return (exclusive_cumsum(flipped, dim) if exclusive else flipped.cumsum(dim)).flip(dim)


def segment_decay(g: torch.Tensor) -> torch.Tensor:
    """``e^{Σ_{s<j≤t} g_j}`` for ``s ≤ t``, else 0: ``[.., C, C]`` (rows t, columns s) from log decays ``g [.., C]``.

    Each segment's log decay is summed on its own (a masked cumulative sum), never as the difference of two
    cumulative sums from the chunk start: every term is ≤ 0, so the sum has no cancellation, an infinite or huge
    decay (a reset, ``g = −∞``) gives exactly 0 for the segments it lies in and leaves the others untouched.
    """
    chunk = g.shape[-1]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).triu(1)  # [s, j]: j > s
    segments = torch.where(later, g.unsqueeze(-2), 0.0).cumsum(-1)  # [s, t]: Σ_{s<j≤t} g_j
    return segments.mT.exp().tril_()


def shift_rows_down(decay: torch.Tensor) -> torch.Tensor:
    """Row t of the result is row t − 1 of ``decay [.., C, C]`` (row 0 is zero): from ``e^{Σ_{s<j≤t} g_j}`` the
    strict read's ``e^{Σ_{s<j≤t−1} g_j}`` for s < t."""
    return F.pad(decay[..., :-1, :], (0, 0, 1, 0))


def kind_decay(decay: torch.Tensor, kind: str, strict: bool, scale: float) -> torch.Tensor:
    """The decay matrix of one read from the inclusive segment decay ``[.., C, C]``: ``"now"`` is ``S_t``'s
    (strict: without the diagonal), ``"before"`` is ``S_{t−1}``'s (always strict), times ``scale``."""
    if kind == "before":
        if not strict:
            raise ValueError("a read of S_{t-1} (kind='before') is strictly causal; pass strict=True")
        decay = shift_rows_down(decay)
    elif strict:
        decay = decay.tril(-1)
    return decay if scale == 1.0 else decay * scale


def exponent_grads(grad: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``M_ts = e^{e_t − b_s} P_ts`` and the gradient of M: the gradients of ``e`` (rows) and of ``−b``
    (columns)."""
    grad_exponent = grad * scores
    return grad_exponent.sum(-1), grad_exponent.sum(-2)


def log_decay_grad(grad_b: torch.Tensor, grad_before: torch.Tensor | None = None, dim: int = -1) -> torch.Tensor:
    """The gradient of the log decays g from those of ``b_t = Σ_{j≤t} g_j`` and ``b_{t−1} = Σ_{j<t} g_j``: the
    adjoints of the two cumulative sums. Exponents such as ``e^{b_t − b_s}`` are computed from segment sums
    (``segment_decay``), but their gradients are linear in these two and carry no cancellation."""
    grad = reverse_cumsum(grad_b, dim)
    return grad if grad_before is None else grad + reverse_cumsum(grad_before, dim, exclusive=True)


def exponent_grads_by_kind(grads, scores, kinds) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``b`` and ``b_{t−1}`` from those of score matrices ``M = P·e^{e_t − b_s}`` whose row exponent
    ``e`` is ``b`` (kind ``"now"``) or ``b_{t−1}`` (kind ``"before"``)."""
    grad_b, grad_before = 0, None
    for grad, score, kind in zip(grads, scores, kinds):
        grad_rows, grad_columns = exponent_grads(grad, score)
        grad_b = grad_b - grad_columns
        if kind == "now":
            grad_b = grad_b + grad_rows
        else:
            grad_before = grad_rows if grad_before is None else grad_before + grad_rows
    return grad_b, grad_before


class DecayedScores(torch.autograd.Function):
    """``M_ts = scale · e^{e_t − b_s} x_tᵀ k_s`` for ``s ≤ t`` (``s < t`` if strict), else 0, for per-head log
    decays ``g [.., C]`` (``b`` their cumulative sum) and ``x, k [.., C, K]``: one ``[.., C, C]`` matrix per read
    kind (``"now"``: ``e = b``; ``"before"``: ``e = b_{t−1}``), all from one product ``x kᵀ`` (``x = None`` means
    ``x = k``). The decays come from segment sums (``segment_decay``); the gradient is that of ``g``.

    Autograd's backward, through the masked exponential and the broadcast difference, makes about twice as many
    passes over the ``[C, C]`` matrices; and for ``x = k`` the product is symmetric, so ``dk = (dP + dPᵀ) k`` takes
    one matrix product instead of two.
    """

    @staticmethod
    def forward(ctx, x, k, g, strict, scale, *kinds):
        keys_only = x is None
        x = k if keys_only else x
        product = torch.matmul(x, k.mT)
        inclusive = segment_decay(g)
        decays = [kind_decay(inclusive, kind, strict, scale) for kind in kinds]
        scores = [product.mul_(decays[0])] if len(decays) == 1 else [product * d for d in decays]
        ctx.keys_only, ctx.kinds = keys_only, kinds
        ctx.save_for_backward(x, k, *decays, *scores)
        return tuple(scores)

    @staticmethod
    def backward(ctx, *grads):
        x, k, *saved = ctx.saved_tensors
        decays, scores = saved[: len(grads)], saved[len(grads) :]
        grad_product = grads[0] * decays[0]
        for grad, decay in zip(grads[1:], decays[1:]):
            grad_product += grad * decay
        grad_g = log_decay_grad(*exponent_grads_by_kind(grads, scores, ctx.kinds))
        if ctx.keys_only:
            grad_x, grad_k = None, (grad_product + grad_product.mT) @ k
        else:
            grad_x, grad_k = grad_product @ k, grad_product.mT @ x
        return grad_x, grad_k, grad_g, None, None, *(None,) * len(ctx.kinds)


# elements of one [n, K, C, C] per-key decay slice: bounds the extra memory of per-key scores whatever T is
PER_KEY_SLICE_ELEMENTS = 1 << 22


class PerKeyDecayedScores(torch.autograd.Function):
    """``M_ts = scale · Σ_c x_tc k_sc e^{Σ_{s<j≤t'} g_jc}`` for per-key-channel log decays ``g [.., C, K]``
    (``t' = t`` for kind ``"now"``, ``t − 1`` for ``"before"``; ``s ≤ t``, or ``s < t`` if strict): ``[.., C, C]``.

    The ``[C, C, K]`` decays of a chunk are formed slice by slice of chunks, in forward and again in backward,
    and never stored: the extra memory is that of one slice (``PER_KEY_SLICE_ELEMENTS``), whatever the length.
    """

    @staticmethod
    def forward(ctx, x, k, g, strict, scale, kind):
        ctx.shape, ctx.strict, ctx.scale, ctx.kind = x.shape, strict, scale, kind
        x, k, g = flat(x), flat(k), flat(g)
        ctx.save_for_backward(x, k, g)
        scores = x.new_empty(x.shape[0], x.shape[1], x.shape[1])
        for part, decay in PerKeyDecayedScores.slices(g, strict, scale, kind):
            scores[part] = torch.einsum("ntc,nsc,ncts->nts", x[part], k[part], decay)
        return scores.view(*ctx.shape[:-1], ctx.shape[-2])

    @staticmethod
    def slices(g, strict, scale, kind):
        """``(slice, decay [n, K, C, C])`` over the flattened chunks of ``g [n, C, K]``."""
        count = max(1, PER_KEY_SLICE_ELEMENTS // (g.shape[1] * g[0].numel()))
        for start in range(0, g.shape[0], count):
            part = slice(start, start + count)
            yield part, kind_decay(segment_decay(g[part].mT), kind, strict, scale)

    @staticmethod
    def backward(ctx, grad):
        x, k, g = ctx.saved_tensors
        grad = flat(grad)
        grad_x, grad_k, grad_g = torch.empty_like(x), torch.empty_like(k), torch.empty_like(g)
        for part, decay in PerKeyDecayedScores.slices(g, ctx.strict, ctx.scale, ctx.kind):
            weighted = decay.mul_(grad[part].unsqueeze(1))  # [n, K, C, C]
            grad_x[part] = torch.einsum("ncts,nsc->ntc", weighted, k[part])
            grad_k[part] = torch.einsum("ncts,ntc->nsc", weighted, x[part])
            exponent = weighted.mul_(x[part].mT.unsqueeze(-1)).mul_(k[part].mT.unsqueeze(-2))
            rows, columns = exponent.sum(-1).mT, exponent.sum(-2).mT  # [n, C, K]
            grad_before = rows if ctx.kind == "before" else None
            grad_b = -columns if ctx.kind == "before" else rows - columns
            grad_g[part] = log_decay_grad(grad_b, grad_before, dim=1)
        shape = ctx.shape
        return grad_x.view(shape), grad_k.view(shape), grad_g.view(shape), None, None, None


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


def rho_with_slope(error: torch.Tensor, target: str, clip: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``r = ρ(error)`` (``linmem.ops.step.rho``) and what its gradient needs: where the error was not clipped
    (the bounds included, as for ``clamp``), or r itself for ``"tanh"``."""
    r = rho(error, target, clip)
    return r, (r == error if target == "clip" else r if target == "tanh" else None)


def rho_grad(grad: torch.Tensor, slope: torch.Tensor | None, target: str, clip: float) -> torch.Tensor:
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
        r, slope = rho_with_slope(error, target, clip)
        ctx.target, ctx.clip = target, clip
        ctx.save_for_backward(x, decay, weighted, scores, state, writes, slope)
        return r.view(ctx.shapes[4])

    @staticmethod
    def backward(ctx, grad):
        x, decay, weighted, scores, state, writes, slope = ctx.saved_tensors
        grad = rho_grad(flat(grad), slope, ctx.target, ctx.clip)
        grad_x, grad_decay = row_scale_grads(negated_product(grad, state), x, decay)
        grads = (grad_x, grad_decay, negated_product(grad, writes.mT), negated_product(grad.mT, weighted),
                 negated_product(scores.mT, grad))
        return *(g.view(shape) for g, shape in zip(grads, ctx.shapes)), grad.view(ctx.shapes[4]), None, None
