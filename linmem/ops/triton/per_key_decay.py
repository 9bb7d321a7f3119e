"""GLA's memory on Triton: the additive rule with a log decay per key channel, walked token after token.

With states ``S [V, K]`` (linmem's layout), per key-channel log decays ``g_t [K]`` (≤ 0) and ``u_t = β_t v_t``:

    S_t = S_{t−1} · diag(e^{g_t}) + u_t k_tᵀ,        o_t = scale · S_t q_t

One program holds the state of one sequence, one head and one block of value rows in registers and walks the
tokens. Nothing is formed from differences of cumulative log decays, so ``g = −∞`` (a reset) is exact, as in the
chunk backend. The chunk form of this memory needs ``[C, C, K]`` decays and a sequential hand-over of small
chunks, many small launches that leave a GPU idle; a walk over T tokens is one launch per pass.

Backward, with ``D_t`` the gradient of the loss with respect to ``S_t`` (``D_T`` starting from ``dS_T``):

    dq_t = scale · S_tᵀ do_t                                     (the forward walk again)
    D_t  = scale · do_t q_tᵀ + D_{t+1} · diag(e^{g_{t+1}})       (a walk backwards)
    dk_t = D_tᵀ u_t,   du_t = D_t k_t,   dS_0 = D_1 · diag(e^{g_1})
    dg_t = Σ_{s≥t} (q_s ⊙ dq_s − k_s ⊙ dk_s) + Σ_v (dS_T ⊙ S_T)[v, :]

The last line needs no earlier state: with ``P_t = Σ_v (D_t ⊙ S_t)[v, :]``, expanding ``S_t`` gives
``P_t = dg_t + k_t ⊙ dk_t`` and expanding ``D_t`` gives ``P_t = q_t ⊙ dq_t + dg_{t+1}`` (``P_T`` with
``Σ_v (dS_T ⊙ S_T)[v, :]`` in place of ``dg_{T+1}``); subtracting gives the recursion, summed from the end.

Inputs are ``[N_tok, H, D]`` rows of sequences bounded by ``cu_seqlens`` (``layout.SequenceLayout``); q, k, v may be
bfloat16 or float16 (read as they are, every product in float32), the decays, strengths and states are float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from linmem.ops.triton.layout import new_buffer
from linmem.ops.triton.primitives import sequence_at

# A program's launch by the padded key width: (the most float32 state elements its tile holds, its warps). The walk
# is bound by the latency of each token's loads; which tile hides it best was measured on an H200
# (docs/benchmarks/gla/launch.md, scripts/kernels/gla_launch_sweep.py): at K = 32, V = 64 (the zoo's heads) tiles
# of 512-2,048 elements on 2-4 warps are within 10% of each other, and at K = V = 128 a 4,096-element tile on one
# warp (32 value rows, 128 elements per thread) takes 52 ms for forward+backward where 1,024 on four took 275 ms.
NARROW_LAUNCH = (1024, 4)
WIDE_LAUNCH = (4096, 1)
WIDE_KEYS = 128  # padded key widths from here on take WIDE_LAUNCH


def tiling(key_dim: int, value_dim: int) -> tuple[int, int, int, int]:
    """(BK, BV, NV, warps): the padded key width, the value rows per program, the number of value blocks and each
    program's warps."""
    bk = triton.next_power_of_2(key_dim)
    elements, warps = WIDE_LAUNCH if bk >= WIDE_KEYS else NARROW_LAUNCH
    bv = min(triton.next_power_of_2(value_dim), max(1, elements // bk))
    return bk, bv, triton.cdiv(value_dim, bv), warps


@triton.jit
def _program(cu_seqlens, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """What a (value block, sequence, head) program walks: its value block, head, key columns and value rows with
    their masks, the sequence's first token and length, and where its ``[BV, BK]`` tile of a state lives."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kc = tl.arange(0, BK)
    vc = i_v * BV + tl.arange(0, BV)
    bos, length = sequence_at(cu_seqlens, i_n)
    at_state = (i_n * H + i_h).to(tl.int64) * V * K + vc[:, None] * K + kc[None, :]
    return i_v, i_h, kc, vc, kc < K, vc < V, bos, length, at_state


@triton.jit
def _write(k, g, v, beta, row, kc, vc, mk, mv, K: tl.constexpr, V: tl.constexpr):
    """Token ``row``'s write, in float32: its key ``k_t``, log decays ``g_t`` and written values ``u_t = β_t v_t``."""
    b_k = tl.load(k + row * K + kc, mask=mk, other=0.0).to(tl.float32)
    b_g = tl.load(g + row * K + kc, mask=mk, other=0.0)
    b_u = tl.load(v + row * V + vc, mask=mv, other=0.0).to(tl.float32) * tl.load(beta + row)
    return b_k, b_g, b_u


@triton.jit
def per_key_forward_kernel(q, k, v, g, beta, state0, o, final, cu_seqlens, scale,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """``o_t = scale · S_t q_t`` for every token and the final state, one (value block, sequence, head) each."""
    i_v, i_h, kc, vc, mk, mv, bos, length, at_state = _program(cu_seqlens, H, K, V, BK, BV)
    m_state = mv[:, None] & mk[None, :]
    state = tl.load(state0 + at_state, mask=m_state, other=0.0)
    for i in range(length):
        row = (bos + i) * H + i_h
        b_q = tl.load(q + row * K + kc, mask=mk, other=0.0).to(tl.float32)
        b_k, b_g, b_u = _write(k, g, v, beta, row, kc, vc, mk, mv, K, V)
        state = state * tl.exp(b_g)[None, :] + b_u[:, None] * b_k[None, :]
        tl.store(o + row * V + vc, tl.sum(state * b_q[None, :], axis=1) * scale, mask=mv)
    tl.store(final + at_state, state, mask=m_state)


@triton.jit
def per_key_query_grad_kernel(k, v, g, beta, state0, do, dq_parts, cu_seqlens, scale, num_tokens,
                              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """This value block's share of ``dq_t = scale · S_tᵀ do_t``, ``dq_parts [NV, N_tok, H, K]`` (the forward walk
    again; the blocks are summed afterwards)."""
    i_v, i_h, kc, vc, mk, mv, bos, length, at_state = _program(cu_seqlens, H, K, V, BK, BV)
    state = tl.load(state0 + at_state, mask=mv[:, None] & mk[None, :], other=0.0)
    part = dq_parts + i_v.to(tl.int64) * num_tokens * H * K
    for i in range(length):
        row = (bos + i) * H + i_h
        b_k, b_g, b_u = _write(k, g, v, beta, row, kc, vc, mk, mv, K, V)
        b_do = tl.load(do + row * V + vc, mask=mv, other=0.0).to(tl.float32)
        state = state * tl.exp(b_g)[None, :] + b_u[:, None] * b_k[None, :]
        tl.store(part + row * K + kc, tl.sum(state * b_do[:, None], axis=0) * scale, mask=mk)


@triton.jit
def per_key_state_grad_kernel(q, k, v, g, beta, do, d_final, dk_parts, du, d_state0, cu_seqlens, scale,
                              num_tokens, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr):
    """The walk backwards: ``D_t``, this value block's share of ``dk_t = D_tᵀ u_t`` (``dk_parts [NV, N_tok, H,
    K]``), ``du_t = D_t k_t`` (``du [N_tok, H, V]``) and ``dS_0``."""
    i_v, i_h, kc, vc, mk, mv, bos, length, at_state = _program(cu_seqlens, H, K, V, BK, BV)
    m_state = mv[:, None] & mk[None, :]
    carry = tl.load(d_final + at_state, mask=m_state, other=0.0)
    part = dk_parts + i_v.to(tl.int64) * num_tokens * H * K
    for i in range(length):
        row = (bos + length - 1 - i) * H + i_h
        b_q = tl.load(q + row * K + kc, mask=mk, other=0.0).to(tl.float32)
        b_k, b_g, b_u = _write(k, g, v, beta, row, kc, vc, mk, mv, K, V)
        b_do = tl.load(do + row * V + vc, mask=mv, other=0.0).to(tl.float32)
        grad = carry + (b_do * scale)[:, None] * b_q[None, :]
        tl.store(part + row * K + kc, tl.sum(grad * b_u[:, None], axis=0), mask=mk)
        tl.store(du + row * V + vc, tl.sum(grad * b_k[None, :], axis=1), mask=mv)
        carry = grad * tl.exp(b_g)[None, :]
    tl.store(d_state0 + at_state, carry, mask=m_state)


@triton.jit
def per_key_decay_grad_kernel(q, k, dq, dk, end_term, dg, cu_seqlens,
                              H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """``dg_t = Σ_{s≥t} (q_s ⊙ dq_s − k_s ⊙ dk_s)`` plus ``end_term [N, H, K] = Σ_v (dS_T ⊙ S_T)[v, :]``, summed
    from each sequence's end, one (sequence, head) each."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    kc = tl.arange(0, BK)
    mk = kc < K
    bos, length = sequence_at(cu_seqlens, i_n)
    acc = tl.load(end_term + (i_n * H + i_h).to(tl.int64) * K + kc, mask=mk, other=0.0)
    for i in range(length):
        at = ((bos + length - 1 - i) * H + i_h) * K + kc
        b_q = tl.load(q + at, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(k + at, mask=mk, other=0.0).to(tl.float32)
        acc += b_q * tl.load(dq + at, mask=mk, other=0.0) - b_k * tl.load(dk + at, mask=mk, other=0.0)
        tl.store(dg + at, acc, mask=mk)


class PerKeyDecayFunction(torch.autograd.Function):
    """Autograd over the four kernels. Inputs ``q, k [N_tok, H, K]``, ``v [N_tok, H, V]``, ``g [N_tok, H, K]``
    (float32), ``beta [N_tok, H]`` (float32), ``state0 [N, H, V, K]`` (float32), all contiguous; returns
    ``o [N_tok, H, V]`` (float32) and ``S_T [N, H, V, K]``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state0, scale: float, cu_seqlens: torch.Tensor):
        num_tokens, heads, key_dim = q.shape
        value_dim = v.shape[-1]
        num_seqs = cu_seqlens.numel() - 1
        bk, bv, nv, warps = tiling(key_dim, value_dim)
        o = new_buffer((num_tokens, heads, value_dim), q.device)
        final = new_buffer(state0.shape, q.device)
        per_key_forward_kernel[(nv, num_seqs, heads)](q=q, k=k, v=v, g=g, beta=beta, state0=state0, o=o,
                                                      final=final, cu_seqlens=cu_seqlens, scale=scale, H=heads,
                                                      K=key_dim, V=value_dim, BK=bk, BV=bv, num_warps=warps)
        ctx.save_for_backward(q, k, v, g, beta, state0, final, cu_seqlens)
        ctx.scale = scale
        return o, final

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, g, beta, state0, final, cu_seqlens = ctx.saved_tensors
        num_tokens, heads, key_dim = q.shape
        value_dim = v.shape[-1]
        num_seqs = cu_seqlens.numel() - 1
        bk, bv, nv, warps = tiling(key_dim, value_dim)
        do = do.float().contiguous()
        d_final = torch.zeros_like(final) if d_final is None else d_final.float().contiguous()
        # what every walk reads: the writes, the sequences and the widths
        walk = dict(k=k, v=v, g=g, beta=beta, do=do, cu_seqlens=cu_seqlens, scale=ctx.scale, num_tokens=num_tokens,
                    H=heads, K=key_dim, V=value_dim, BK=bk, BV=bv, num_warps=warps)
        grid = (nv, num_seqs, heads)
        dq_parts = new_buffer((nv, num_tokens, heads, key_dim), q.device)
        per_key_query_grad_kernel[grid](state0=state0, dq_parts=dq_parts, **walk)
        dk_parts = new_buffer((nv, num_tokens, heads, key_dim), q.device)
        du = new_buffer((num_tokens, heads, value_dim), q.device)
        d_state0 = new_buffer(state0.shape, q.device)
        per_key_state_grad_kernel[grid](q=q, d_final=d_final, dk_parts=dk_parts, du=du, d_state0=d_state0, **walk)
        dq, dk = dq_parts.sum(0), dk_parts.sum(0)
        end_term = (d_final * final).sum(2).contiguous()  # [N, H, K]
        dg = new_buffer((num_tokens, heads, key_dim), q.device)
        per_key_decay_grad_kernel[(num_seqs, heads)](q=q, k=k, dq=dq, dk=dk, end_term=end_term, dg=dg,
                                                     cu_seqlens=cu_seqlens, H=heads, K=key_dim, BK=bk)
        dv = du * beta.unsqueeze(-1)
        dbeta = (du * v.float()).sum(-1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, dbeta, d_state0, None, None
