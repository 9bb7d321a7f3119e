"""Hand-differentiated whole memories for the chunk backend (``chunk.py``): the additive state hand-over between
chunks (per-head or per-key decay), and RLA (additive rule, residual memory with history fitting and output gates,
per-head decay) in one function.

RLA's two memories share their keys, decays and query scores, and its base writes ``u`` and states feed three
products each; under autograd each of those meetings costs a separate pass that adds gradients up. Here the
backward sums them inside the matrix products (``baddbmm_``, ``addcmul_``). Shapes: ``[n, C, D]`` per chunk with
``n = B·H·N``, and ``[m, N, V·K]`` per sequence (``m = B·H``) for the hand-over, which runs one chunk after the
other (linear in the length, exact at any decay).
"""

from __future__ import annotations

import math

import torch

from linmem.ops.chunk_reads import (
    exclusive_cumsum,
    exponent_grads,
    flat,
    log_decay_grad,
    negated_product,
    reverse_cumsum,
    rho_grad,
    rho_with_slope,
    scaled_product,
    segment_decay,
)


def hand_over(increments, log_decay, state):
    """States ``S_{n+1} = e^{c_n} S_n + ΔS_n`` from ``S_0 = state``, one chunk after the other: the start of every
    chunk ``[m, N, F]`` and the final state ``[m, F]`` for increments ``ΔS [m, N, F]`` and chunk log decays
    ``c [m, N, D]`` (D = 1 per head, or F's key channels per key, broadcast over the value rows). Each step only
    multiplies by ``e^{c_n} ∈ [0, 1]``, so a reset (``c = −∞``) or any decay is exact; the work is linear in N
    and the memory is the starts themselves."""
    decay = chunk_decay_factors(log_decay, increments.shape[-1])
    starts = torch.empty_like(increments)
    current = state
    for n, (increment, factor) in enumerate(zip(increments.unbind(1), decay.unbind(1))):
        starts[:, n] = current
        current = torch.addcmul(increment, current, factor)
    return starts, current


def chunk_decay_factors(log_decay: torch.Tensor, width: int) -> torch.Tensor:
    """``e^{c}`` for ``c [m, N, D]`` as a ``[m, N, F]``-broadcastable factor: D = 1 (per head) or the key
    channels of a flattened ``[V, K]`` state (per key, repeated over the V rows)."""
    factor = log_decay.exp()
    return factor if factor.shape[-1] == 1 else factor.repeat(1, 1, width // factor.shape[-1])


def hand_over_backward(grad_starts, grad_final, starts, log_decay, with_state: bool):
    """Gradients of ``hand_over`` for the increments, the chunk log decays and the initial state, one chunk after
    the other backwards. ``λ_{n+1}``, the gradient that reaches the state after chunk n, is that of ``ΔS_n``;
    ``dc_n = e^{c_n} ⟨λ_{n+1}, S_n⟩`` (summed per key channel for per-key decay), ``λ_n = dS_n + e^{c_n} λ_{n+1}``
    and ``dS_0 = λ_0``."""
    decay = chunk_decay_factors(log_decay, starts.shape[-1])
    grad_increments = torch.empty_like(starts)
    reaching = torch.zeros_like(starts[:, 0]) if grad_final is None else grad_final
    for n in range(starts.shape[1] - 1, -1, -1):
        grad_increments[:, n] = reaching
        reaching = torch.addcmul(grad_starts[:, n], reaching, decay[:, n])
    through = grad_increments * starts * decay
    per_channel = log_decay.shape[-1]
    grad_log_decay = through.view(*through.shape[:2], -1, per_channel).sum(-2) if per_channel > 1 else \
        through.sum(-1, keepdim=True)
    return grad_increments, grad_log_decay, reaching if with_state else None


def shifted_decay(product: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``product`` times the decay one row up, in place: with ``decay = e^{b_t − b_s}`` (s ≤ t) that is
    ``e^{b_{t−1} − b_s}`` for s < t, the strict key read's decay, and row 0 is zero."""
    product[:, 1:].mul_(decay[:, :-1])
    product[:, 0] = 0
    return product


class AdditiveHandOver(torch.autograd.Function):
    """``hand_over`` for ``[B, H, N, V, K]`` increments, chunk log decays ``[B, H, N]`` (per head) or
    ``[B, H, N, K]`` (per key channel) and a ``[B, H, V, K]`` initial state: returns the chunk starts
    ``[B, H, N, V, K]`` and the final state."""

    @staticmethod
    def forward(ctx, increments, log_decay, state):
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.state_shape, ctx.decay_shape = increments.shape, state.shape, log_decay.shape
        increments = increments.contiguous().flatten(0, 1).flatten(-2)
        log_decay = log_decay.reshape(increments.shape[0], increments.shape[1], -1)
        state = state.flatten(0, 1).flatten(-2)
        ctx.with_state = ctx.needs_input_grad[2]
        starts, final = hand_over(increments, log_decay, state)
        ctx.save_for_backward(starts, log_decay)
        return starts.view(ctx.shape), final.view(ctx.state_shape)

    @staticmethod
    def backward(ctx, grad_starts, grad_final):
        starts, log_decay = ctx.saved_tensors
        grad_starts = starts.new_zeros(()).expand_as(starts) if grad_starts is None else flat(grad_starts.flatten(-2))
        if grad_final is not None:
            grad_final = grad_final.flatten(0, 1).flatten(-2)
        grad_increments, grad_log_decay, grad_state = hand_over_backward(
            grad_starts, grad_final, starts, log_decay, ctx.with_state)
        return (grad_increments.view(ctx.shape), grad_log_decay.view(ctx.decay_shape),
                None if grad_state is None else grad_state.view(ctx.state_shape))


class ResidualAdditive(torch.autograd.Function):
    """RLA over all chunks: base ``S`` (writes ``u = β v``) and residual ``R`` (writes ``w = γ ρ(v − S_{t−1} k_t)``),
    read out as ``o = α_t S_{t−1} q_t + γ_t R_t q_t``.

    Inputs in chunk layout: ``q, k [B, H, N, C, K]``, ``v [B, H, N, C, V]``; ``beta, gamma`` and the log decays
    ``g [B, H, N, C]``; initial states ``[B, H, V, K]``; a positive read-out ``scale``. Returns o
    ``[B, H, N, C, V]`` and the two final states. Every decay is a sum of log decays over its own segment
    (``b`` from the chunk start, ``b_{t−1}``, the suffix to the chunk end, ``segment_decay`` within the chunk),
    so resets and huge decays are exact; the backward forms the gradients of ``b`` and ``b_{t−1}`` and returns
    g's (``log_decay_grad``). The key read's decay ``e^{b_{t−1} − b_s}`` is the query read's ``e^{b_t − b_s}``
    one row up (``shifted_decay``), and the scale rides in the query products.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, gamma, g, base_state, residual_state, scale, target, clip):
        ctx.set_materialize_grads(False)
        ctx.shapes = q.shape, v.shape, g.shape, base_state.shape
        batch, heads, n, chunk = g.shape
        q, k, v = flat(q), flat(k), flat(v)
        g = g.reshape(-1, chunk)
        b, before = g.cumsum(-1), exclusive_cumsum(g, -1)
        beta, gamma = beta.reshape(-1, chunk, 1), gamma.reshape(-1, chunk, 1)
        log_chunk = b[:, -1].view(batch * heads, n, 1)  # [m, N, 1]
        state_shape = (batch * heads, n, -1)
        states0 = base_state.reshape(batch * heads, -1), residual_state.reshape(batch * heads, -1)
        ctx.with_states = [ctx.needs_input_grad[i] for i in (6, 7)]  # base_state, residual_state

        to_end = reverse_cumsum(g, exclusive=True).exp_().unsqueeze(-1)
        to_end_keys = k * to_end
        decay_q, decay_k = (b + math.log(scale)).exp().unsqueeze(-1), before.exp().unsqueeze(-1)
        query_decay = segment_decay(g)

        def memory(writes, state0):
            starts, final = hand_over((writes.mT @ to_end_keys).view(state_shape), log_chunk, state0)
            return starts, final, starts.view(-1, *writes.shape[-1:], k.shape[-1])

        u = beta * v
        base_flat, base_final, base = memory(u, states0[0])
        key_scores = shifted_decay(k @ k.mT, query_decay)
        weighted_k = k * decay_k
        error = torch.baddbmm(v, weighted_k, base.mT, alpha=-1).baddbmm_(key_scores, u, alpha=-1)
        r, slope = rho_with_slope(error, target, clip)
        w = gamma * r
        residual_flat, residual_final, residual = memory(w, states0[1])

        query_scores = scaled_product(q, k.mT, scale).mul_(query_decay)
        strict_scores = query_scores.tril(-1)
        weighted_q = q * decay_q
        o = torch.bmm(weighted_q, base.mT).baddbmm_(strict_scores, u)
        residual_read = torch.bmm(weighted_q, residual.mT).baddbmm_(query_scores, w)
        o.addcmul_(residual_read, gamma)

        ctx.target, ctx.clip, ctx.scale = target, clip, scale
        ctx.save_for_backward(q, k, v, beta, gamma, log_chunk, to_end, to_end_keys, decay_q, decay_k,
                              u, base_flat, key_scores, weighted_k, slope, r, w, residual_flat,
                              query_decay, query_scores, strict_scores, weighted_q, residual_read)
        final_shape = ctx.shapes[3]
        return o.view(ctx.shapes[1]), base_final.view(final_shape), residual_final.view(final_shape)

    @staticmethod
    def backward(ctx, grad_o, grad_base_final, grad_residual_final):
        (q, k, v, beta, gamma, log_chunk, to_end, to_end_keys, decay_q, decay_k, u, base_flat,
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
            grad_residual.view(residual_flat.shape), finals[1], residual_flat, log_chunk, ctx.with_states[1])
        grad_increments = grad_increments.view(value_key)
        grad_w.baddbmm_(to_end_keys, grad_increments.mT)
        grad_to_end_keys = torch.bmm(w, grad_increments)

        # w = γ ρ(v − (k·E_k) Sᵀ − M_k u)
        grad_gamma += (grad_w * r).sum(-1)
        grad_error = rho_grad(grad_w * gamma, slope, ctx.target, ctx.clip)
        grad_weighted_k = negated_product(grad_error, base)
        grad_base.baddbmm_(grad_error.mT, weighted_k, alpha=-1)
        grad_key_scores = negated_product(grad_error, u.mT)
        grad_u.baddbmm_(key_scores.mT, grad_error, alpha=-1)

        # base memory: S from ΔS = uᵀ (k·e^{b_C − b}), u = β v
        grad_increments, grad_log_chunk_base, grad_base0 = hand_over_backward(
            grad_base.view(base_flat.shape), finals[0], base_flat, log_chunk, ctx.with_states[0])
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
        grad_g = log_decay_grad(grad_b, grad_before)

        q_shape, v_shape, gate_shape, state_shape = ctx.shapes
        states = [None if g is None else g.view(state_shape) for g in (grad_base0, grad_residual0)]
        return (grad_q.view(q_shape), grad_k.view(q_shape), grad_v.view(v_shape), grad_beta.view(gate_shape),
                grad_gamma.view(gate_shape), grad_g.view(gate_shape), *states,
                None, None, None)


class PerKeyAdditiveRead(torch.autograd.Function):
    """The state part of an additive memory's read with per-key decay (GLA), chunk after chunk, without storing
    the state of every chunk: ``o_n = Q_n S_nᵀ`` and ``S_{n+1} = S_n·diag(e^{c_n}) + W_nᵀ K_n``.

    Inputs ``Q [B, H, N, C, K]`` (queries times their decay from the chunk start and the scale), writes
    ``W [B, H, N, C, V]``, keys times their decay to the chunk end ``K [B, H, N, C, K]``, chunk log decays
    ``c [B, H, N, K]`` and ``S_0 [B, H, V, K]``; returns ``o [B, H, N, C, V]`` and the final state. Forward keeps
    one state in every ``√N`` chunks; backward recomputes the states of one such stretch at a time and runs the
    adjoint recurrence through it, so the extra memory is ``O(√N)`` states, the time linear in N.
    """

    @staticmethod
    def forward(ctx, queries, writes, keys_to_end, log_decay, state):
        ctx.set_materialize_grads(False)
        ctx.shapes = queries.shape, writes.shape, log_decay.shape, state.shape
        q, w, keys = (x.flatten(0, 1) for x in (queries, writes, keys_to_end))  # [m, N, C, D]
        decay = log_decay.flatten(0, 1).exp().unsqueeze(-2)  # [m, N, 1, K]
        current = state.flatten(0, 1)
        count = q.shape[1]
        ctx.every = max(1, math.isqrt(count))
        checkpoints, o = [], w.new_empty(w.shape)
        for n in range(count):
            if n % ctx.every == 0:
                checkpoints.append(current)
            o[:, n] = torch.bmm(q[:, n], current.mT)
            current = torch.baddbmm(current * decay[:, n], w[:, n].mT, keys[:, n])
        ctx.save_for_backward(q, w, keys, decay, *checkpoints)
        return o.view(ctx.shapes[1]), current.view(ctx.shapes[3])

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        q, w, keys, decay, *checkpoints = ctx.saved_tensors
        count, every = q.shape[1], ctx.every
        grad_q, grad_w, grad_keys = torch.zeros_like(q), torch.empty_like(w), torch.empty_like(keys)
        grad_log_decay = decay.new_empty(decay.shape[0], count, decay.shape[-1])
        grad_o = None if grad_o is None else grad_o.flatten(0, 1)
        reaching = torch.zeros_like(checkpoints[0]) if grad_final is None else grad_final.flatten(0, 1)
        for first in reversed(range(0, count, every)):
            last = min(count, first + every)
            states = [checkpoints[first // every]]
            for n in range(first, last - 1):
                states.append(torch.baddbmm(states[-1] * decay[:, n], w[:, n].mT, keys[:, n]))
            for n in reversed(range(first, last)):  # reaching: the gradient of S_{n+1}
                state = states[n - first]
                grad_w[:, n] = torch.bmm(keys[:, n], reaching.mT)
                grad_keys[:, n] = torch.bmm(w[:, n], reaching)
                grad_log_decay[:, n] = (reaching * state).sum(-2) * decay[:, n, 0]
                reaching = reaching * decay[:, n]
                if grad_o is not None:
                    grad_q[:, n] = torch.bmm(grad_o[:, n], state)
                    reaching = reaching.baddbmm(grad_o[:, n].mT, q[:, n])
        q_shape, w_shape, decay_shape, state_shape = ctx.shapes
        return (grad_q.view(q_shape), grad_w.view(w_shape), grad_keys.view(q_shape),
                grad_log_decay.view(decay_shape), reaching.view(state_shape))
