"""Hand-differentiated whole memories for the chunk backend (``chunk.py``), per-head decay only: the additive
state hand-over between chunks, and RLA (additive rule, residual memory with history fitting and output gates) in
one function.

RLA's two memories share their keys, decays and query scores, and its base writes ``u`` and states feed three
products each; under autograd each of those meetings costs a separate pass that adds gradients up. Here the
backward sums them inside the matrix products (``baddbmm_``, ``addcmul_``). Shapes: ``[n, C, D]`` per chunk with
``n = B·H·N``, and ``[m, N, V·K]`` per sequence (``m = B·H``) for the hand-over.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linmem.ops.chunk_reads import (
    decay_matrix,
    exponent_grads,
    flat,
    negated_product,
    residual_target,
    residual_target_grad,
    scaled_product,
)


def hand_over_weights(log_decay: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For chunk log decays ``c [m, N]``: the weights ``W_nm = e^{P_n − P_{m+1}}`` (m < n) that carry chunk m's
    increment to the start of chunk n, ``[m, N, N]``, and ``P_{n+1} = Σ_{j≤n} c_j`` (float64, so that differences
    of long sums stay exact)."""
    total = log_decay.double().cumsum(-1)
    before = F.pad(total[:, :-1], (1, 0))
    n = total.shape[-1]
    reach = torch.ones(n, n, dtype=torch.bool, device=total.device).tril(-1)
    weights = torch.where(reach, before.unsqueeze(-1) - total.unsqueeze(-2), float("-inf")).exp().to(dtype)
    return weights, total


def hand_over(increments, weights, total, log_decay, state, with_state: bool):
    """States ``S_{n+1} = e^{c_n} S_n + ΔS_n`` from ``S_0 = state`` without a loop: the start of every chunk
    ``[m, N, F]`` (``ΔS [m, N, F]``, ``state [m, F]``) and the final state ``[m, F]``. ``with_state=False`` drops
    the initial state's term (it is zero and needs no gradient)."""
    starts = weights @ increments
    if with_state:
        before = F.pad(total[:, :-1], (1, 0)).exp().to(increments.dtype)
        starts.addcmul_(before.unsqueeze(-1), state.unsqueeze(1))
    final = torch.addcmul(increments[:, -1], log_decay[:, -1:].exp(), starts[:, -1])
    return starts, final


def hand_over_backward(grad_starts, grad_final, starts, weights, total, log_decay, with_state: bool):
    """Gradients of ``hand_over`` for the increments, the chunk log decays and the initial state. The gradient that
    reaches the state after chunk n, ``λ_{n+1}``, is that of ``ΔS_n``; then ``dc_n = e^{c_n} ⟨λ_{n+1}, S_n⟩`` and
    ``dS_0 = dS_0' + e^{c_0} λ_1``: one product with ``Wᵀ`` and one pass, not the ``[N, N]`` weight gradient."""
    grad_increments = weights.mT @ grad_starts
    if grad_final is not None:
        to_last = (total[:, -1:] - total).exp().to(starts.dtype)  # e^{P_N − P_{m+1}}
        grad_increments.addcmul_(to_last.unsqueeze(-1), grad_final.unsqueeze(1))
    decay = log_decay.exp()
    grad_log_decay = (grad_increments * starts).sum(-1) * decay
    grad_state = torch.addcmul(grad_starts[:, 0], decay[:, :1], grad_increments[:, 0]) if with_state else None
    return grad_increments, grad_log_decay, grad_state


def shifted_decay(product: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``product`` times the decay one row up, in place: with ``decay = e^{b_t − b_s}`` (s ≤ t) that is
    ``e^{b_{t−1} − b_s}`` for s < t, the strict key read's decay, and row 0 is zero."""
    product[:, 1:].mul_(decay[:, :-1])
    product[:, 0] = 0
    return product


class AdditiveHandOver(torch.autograd.Function):
    """``hand_over`` for ``[B, H, N, V, K]`` increments, ``[B, H, N]`` chunk log decays and a ``[B, H, V, K]``
    initial state: returns the chunk starts ``[B, H, N, V, K]`` and the final state."""

    @staticmethod
    def forward(ctx, increments, log_decay, state):
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.state_shape = increments.shape, state.shape
        increments = increments.contiguous().flatten(0, 1).flatten(-2)
        log_decay, state = log_decay.flatten(0, 1), state.flatten(0, 1).flatten(-2)
        ctx.with_state = ctx.needs_input_grad[2] or bool(state.any())
        weights, total = hand_over_weights(log_decay, increments.dtype)
        starts, final = hand_over(increments, weights, total, log_decay, state, ctx.with_state)
        ctx.save_for_backward(starts, weights, total, log_decay)
        return starts.view(ctx.shape), final.view(ctx.state_shape)

    @staticmethod
    def backward(ctx, grad_starts, grad_final):
        starts, weights, total, log_decay = ctx.saved_tensors
        grad_starts = starts.new_zeros(()).expand_as(starts) if grad_starts is None else flat(grad_starts.flatten(-2))
        if grad_final is not None:
            grad_final = grad_final.flatten(0, 1).flatten(-2)
        grad_increments, grad_log_decay, grad_state = hand_over_backward(
            grad_starts, grad_final, starts, weights, total, log_decay, ctx.with_state)
        return (grad_increments.view(ctx.shape), grad_log_decay.view(ctx.shape[:3]),
                None if grad_state is None else grad_state.view(ctx.state_shape))


class ResidualAdditive(torch.autograd.Function):
    """RLA over all chunks: base ``S`` (writes ``u = β v``) and residual ``R`` (writes ``w = γ ρ(v − S_{t−1} k_t)``),
    read out as ``o = α_t S_{t−1} q_t + γ_t R_t q_t``.

    Inputs in chunk layout: ``q, k [B, H, N, C, K]``, ``v [B, H, N, C, V]``; ``beta, gamma``, ``b`` (cumulative log
    decay since the chunk start) and ``before = b − g`` ``[B, H, N, C]``; initial states ``[B, H, V, K]``; a
    positive read-out ``scale``. Returns o ``[B, H, N, C, V]`` and the two final states. The key read's decay
    ``e^{b_{t−1} − b_s}`` is the query read's ``e^{b_t − b_s}`` one row up (``shifted_decay``), and the scale
    rides in the query products.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, gamma, b, before, base_state, residual_state, scale, target, clip):
        ctx.set_materialize_grads(False)
        ctx.shapes = q.shape, v.shape, b.shape, base_state.shape
        batch, heads, n, chunk = b.shape
        q, k, v = flat(q), flat(k), flat(v)
        b, before = b.reshape(-1, chunk), before.reshape(-1, chunk)
        beta, gamma = beta.reshape(-1, chunk, 1), gamma.reshape(-1, chunk, 1)
        log_chunk = b[:, -1].view(batch * heads, n)  # [m, N]
        state_shape = (batch * heads, n, -1)
        states0 = base_state.reshape(batch * heads, -1), residual_state.reshape(batch * heads, -1)
        ctx.with_states = [ctx.needs_input_grad[i] or bool(s.any()) for i, s in zip((7, 8), states0)]
        weights, total = hand_over_weights(log_chunk, q.dtype)

        to_end = (b[:, -1:] - b).exp().unsqueeze(-1)
        to_end_keys = k * to_end
        decay_q, decay_k = (b + math.log(scale)).exp().unsqueeze(-1), before.exp().unsqueeze(-1)
        query_decay = decay_matrix(b, b, strict=False)

        def memory(writes, state0, with_state):
            starts, final = hand_over((writes.mT @ to_end_keys).view(state_shape), weights, total, log_chunk,
                                      state0, with_state)
            return starts, final, starts.view(-1, *writes.shape[-1:], k.shape[-1])

        u = beta * v
        base_flat, base_final, base = memory(u, states0[0], ctx.with_states[0])
        key_scores = shifted_decay(k @ k.mT, query_decay)
        weighted_k = k * decay_k
        error = torch.baddbmm(v, weighted_k, base.mT, alpha=-1).baddbmm_(key_scores, u, alpha=-1)
        r, slope = residual_target(error, target, clip)
        w = gamma * r
        residual_flat, residual_final, residual = memory(w, states0[1], ctx.with_states[1])

        query_scores = scaled_product(q, k.mT, scale).mul_(query_decay)
        strict_scores = query_scores.tril(-1)
        weighted_q = q * decay_q
        o = torch.bmm(weighted_q, base.mT).baddbmm_(strict_scores, u)
        residual_read = torch.bmm(weighted_q, residual.mT).baddbmm_(query_scores, w)
        o.addcmul_(residual_read, gamma)

        ctx.target, ctx.clip, ctx.scale = target, clip, scale
        ctx.save_for_backward(q, k, v, beta, gamma, weights, total, log_chunk, to_end, to_end_keys, decay_q, decay_k,
                              u, base_flat, key_scores, weighted_k, slope, r, w, residual_flat,
                              query_decay, query_scores, strict_scores, weighted_q, residual_read)
        final_shape = ctx.shapes[3]
        return o.view(ctx.shapes[1]), base_final.view(final_shape), residual_final.view(final_shape)

    @staticmethod
    def backward(ctx, grad_o, grad_base_final, grad_residual_final):
        (q, k, v, beta, gamma, weights, total, log_chunk, to_end, to_end_keys, decay_q, decay_k, u, base_flat,
         key_scores, weighted_k, slope, r, w, residual_flat, query_decay, query_scores, strict_scores,
         weighted_q, residual_read) = ctx.saved_tensors
        value_key = (-1, v.shape[-1], k.shape[-1])
        base, residual = base_flat.view(value_key), residual_flat.view(value_key)
        finals = [None if g is None else g.reshape(log_chunk.shape[0], -1) for g in (grad_base_final,
                                                                                     grad_residual_final)]
        grad_o = torch.zeros_like(u) if grad_o is None else flat(grad_o)

        # query read: o = (q·E_q) Sᵀ + tril(M_q, −1) u + γ·((q·E_q) Rᵀ + M_q w)
        grad_residual_read = grad_o * gamma
        grad_gamma = (grad_o * residual_read).sum(-1)
        grad_weighted_q = torch.bmm(grad_o, base).baddbmm_(grad_residual_read, residual)
        grad_base = torch.bmm(grad_o.mT, weighted_q)
        grad_residual = torch.bmm(grad_residual_read.mT, weighted_q)
        grad_query_scores = torch.bmm(grad_o, u.mT).tril_(-1).baddbmm_(grad_residual_read, w.mT)
        grad_u = torch.bmm(strict_scores.mT, grad_o)
        grad_w = torch.bmm(query_scores.mT, grad_residual_read)

        # residual memory: R from ΔR = wᵀ (k·e^{b_C − b})
        grad_increments, grad_log_chunk, grad_residual0 = hand_over_backward(
            grad_residual.view(residual_flat.shape), finals[1], residual_flat, weights, total, log_chunk,
            ctx.with_states[1])
        grad_increments = grad_increments.view(value_key)
        grad_w.baddbmm_(to_end_keys, grad_increments.mT)
        grad_to_end_keys = torch.bmm(w, grad_increments)

        # w = γ ρ(v − (k·E_k) Sᵀ − M_k u)
        grad_gamma += (grad_w * r).sum(-1)
        grad_error = residual_target_grad(grad_w * gamma, slope, ctx.target, ctx.clip)
        grad_weighted_k = negated_product(grad_error, base)
        grad_base.baddbmm_(grad_error.mT, weighted_k, alpha=-1)
        grad_key_scores = negated_product(grad_error, u.mT)
        grad_u.baddbmm_(key_scores.mT, grad_error, alpha=-1)

        # base memory: S from ΔS = uᵀ (k·e^{b_C − b}), u = β v
        grad_increments, grad_log_chunk_base, grad_base0 = hand_over_backward(
            grad_base.view(base_flat.shape), finals[0], base_flat, weights, total, log_chunk, ctx.with_states[0])
        grad_log_chunk += grad_log_chunk_base
        grad_increments = grad_increments.view(value_key)
        grad_u.baddbmm_(to_end_keys, grad_increments.mT)
        grad_to_end_keys.baddbmm_(u, grad_increments)
        grad_v = grad_error.addcmul_(grad_u, beta)
        grad_beta = (grad_u * v).sum(-1)

        # score matrices M = (x kᵀ)·e^{e_t − b_s}, and the row scalings of q and k
        grad_before, grad_b = exponent_grads(grad_key_scores, key_scores)
        grad_product = shifted_decay(grad_key_scores, query_decay)
        grad_k = torch.bmm(grad_product + grad_product.mT, k)
        grad_query_exponent, grad_b_queries = exponent_grads(grad_query_scores, query_scores)
        grad_product = grad_query_scores.mul_(query_decay)
        grad_q = scaled_product(grad_product, k, ctx.scale).addcmul_(grad_weighted_q, decay_q)
        grad_k.baddbmm_(grad_product.mT, q, alpha=ctx.scale)
        grad_k.addcmul_(grad_weighted_k, decay_k).addcmul_(grad_to_end_keys, to_end)
        grad_query_exponent += (grad_weighted_q * q).sum(-1) * decay_q.squeeze(-1)
        grad_before += (grad_weighted_k * k).sum(-1) * decay_k.squeeze(-1)
        grad_to_end = (grad_to_end_keys * k).sum(-1) * to_end.squeeze(-1)  # d/d(b_C − b_s)
        grad_b = grad_query_exponent - grad_b - grad_b_queries - grad_to_end
        grad_b[:, -1] += grad_to_end.sum(-1) + grad_log_chunk.view(-1)

        q_shape, v_shape, gate_shape, state_shape = ctx.shapes
        states = [None if g is None else g.view(state_shape) for g in (grad_base0, grad_residual0)]
        return (grad_q.view(q_shape), grad_k.view(q_shape), grad_v.view(v_shape), grad_beta.view(gate_shape),
                grad_gamma.view(gate_shape), grad_b.view(gate_shape), grad_before.view(gate_shape), *states,
                None, None, None)
