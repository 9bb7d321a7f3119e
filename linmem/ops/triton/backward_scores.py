"""Per-chunk gradients that need a sum over the value axis: dv, the value-side parts of dβ and dγ, the gradients of
the in-chunk score matrices and their share of the decay gradient.

One program per (chunk, head) loops over value blocks (``ō = scale·dO``, the reverse passes' ``dx, dy, d_err``, the
forward passes' u, w, err) and accumulates ``[C, C]`` products: ``G_b = ō uᵀ``, ``G_r = ō wᵀ`` (residual) and
``G_k = (αβ∘dx + d_err) uᵀ + (αγ∘dy) wᵀ`` (the terms each exist for the delta rule / a residual memory), whose
``T_γ`` term ``G_y = dy wᵀ`` (without a residual memory the ``T_β`` term ``G_x = dx uᵀ``) has row dots with A that
dγ (dβ) needs, ``dy·(A w) = (G_y ∘ A) 1`` (``dx·(A u)``): ``G_y`` is accumulated on its own and its row dots and
its share of ``G_k`` come after the value loop (one product per value block instead of two). The score matrices'
gradients are then

- ``P_base``: ``G_b``; ``P_res``: ``γ ∘ G_r`` (rows; ``G_r`` without output gates);
- the key scores: ``A = diag(α) A'`` (inside ``T_β, T_γ``) gets ``−β ∘ G_x − γ ∘ G_y`` (``G_x = dx uᵀ``,
  ``G_y = dy wᵀ``) and ``A'`` (inside the prediction error) ``−G_e`` (``G_e = d_err uᵀ``): together ``−G_k ∘ A'``.

Stored: ``E_Q`` with ``dQ += E_Q K`` and ``dK += E_Qᵀ Q`` (the P gradients times their decays), ``E_K = −G_k ∘ Γ'``
(strictly lower) with ``dK += (E_K + E_Kᵀ) K``, and, per token, ``dv = β ∘ dx + d_err`` and these partial sums:
``dβ = dx·v − dx·(A u)`` (``dx·((1 − α) v + α err)``, complete, with a residual memory), ``dγ = dy·r − dy·(A w) +
(G_r ∘ P_res) 1`` (the last with output gates), and the decay gradients ``db``/``dbm``: a score
``e^{e_t − b_s} x_tᵀk_s`` with upstream gradient ``G_ts`` adds ``G_ts·score_ts`` to the gradient of its row exponent
``e_t`` (b or bm) and subtracts it from that of ``b_s``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    chunk_at,
    decay,
    load_decays,
    mm_acc,
    rho,
    store_token_gate,
    store_token_rows,
    token_gate,
    token_rows,
    token_scores,
)


@triton.jit
def _exponent_grads(grad, scores, row_exclude):
    """Row sums (to the row exponent) and column sums (subtracted from ``b_s``) of ``grad ∘ scores``, leaving out the
    entries whose exponent is identically 0 (``row_exclude``): their large, exactly cancelling terms stay out of dg."""
    m = tl.where(row_exclude, 0.0, grad * scores)
    return tl.sum(m, 1), tl.sum(m, 0)


@triton.jit
def backward_scores_kernel(
    v, do, b, g, beta, gamma, key_scores, base_scores, res_scores, u_in, w_in, err_in,
    dx_in, dy_in, derr_in, dv, e_q, e_k, db_part, dbm_part, dbeta_part, dgamma_part,
    cu_seqlens, chunk_indices, scale, clip,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr,
    RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr, TARGET: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    pos = tl.arange(0, C)
    m_t = pos < n_valid
    bb, bm, _ = load_decays(b, g, tok, i_h, pos, n_valid, H)
    beta_t = token_gate(beta, tok, i_h, pos, m_t, H)
    if RESIDUAL:
        gamma_t = token_gate(gamma, tok, i_h, pos, m_t, H)

    alpha = tl.exp(bb - bm)
    g_base = tl.zeros([C, C], dtype=tl.float32)  # ō uᵀ
    g_res = tl.zeros([C, C], dtype=tl.float32)  # ō wᵀ
    g_keys = tl.zeros([C, C], dtype=tl.float32)  # (αβ∘dx + d_err) uᵀ + (αγ∘dy) wᵀ
    # the delta rule's write gradient through T_γ (G_y = dy wᵀ, residual) or T_β (G_x = dx uᵀ, no residual
    # memory) accumulated whole, so that its row dots with A = diag(α) A' (dy·(A w) = (G_y ∘ A) 1,
    # dx·(A u) = (G_x ∘ A) 1) and its share of g_keys (diag(αγ) G_y, diag(αβ) G_x) come after the value loop, from
    # one product per value block instead of two
    g_write = tl.zeros([C, C], dtype=tl.float32)
    d_beta = tl.zeros([C], dtype=tl.float32)
    d_gamma = tl.zeros([C], dtype=tl.float32)
    direct = tl.zeros([C], dtype=tl.float32)  # decay-gradient terms of g_t alone (see below)
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m_v = vc < V
        d_base_read = scale * token_rows(do, tok, i_h, pos, m_t, vc, m_v, H, V)
        vb = token_rows(v, tok, i_h, pos, m_t, vc, m_v, H, V)
        if DELTA:
            u = token_rows(u_in, tok, i_h, pos, m_t, vc, m_v, H, V)
        else:
            u = beta_t[:, None] * vb
        dx = token_rows(dx_in, tok, i_h, pos, m_t, vc, m_v, H, V)
        g_base = mm_acc(g_base, d_base_read, tl.trans(u), DT)
        dv_block = beta_t[:, None] * dx
        if RESIDUAL:
            err = token_rows(err_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            target = rho(err, clip, TARGET)
            if DELTA:
                w = token_rows(w_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            else:
                w = gamma_t[:, None] * target
            dy = token_rows(dy_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            d_err = token_rows(derr_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            g_res = mm_acc(g_res, d_base_read, tl.trans(w), DT)
            d_gamma += tl.sum(dy * target, 1)
            dv_block += d_err
            if DELTA:
                # dβ_t = dx_t·(v_t − α_t S_{t−1}k_t) = dx_t·((1 − α_t) v_t + α_t err_t) (every β term at once)
                d_beta += tl.sum(dx * ((1.0 - alpha)[:, None] * vb + alpha[:, None] * err), 1)
                direct -= beta_t * alpha * tl.sum(dx * (vb - err), 1)
                g_keys = mm_acc(g_keys, (alpha * beta_t)[:, None] * dx + d_err, tl.trans(u), DT)
                g_write = mm_acc(g_write, dy, tl.trans(w), DT)
            else:
                d_beta += tl.sum(dx * vb, 1)
                g_keys = mm_acc(g_keys, d_err, tl.trans(u), DT)
        else:
            d_beta += tl.sum(dx * vb, 1)
            if DELTA:
                g_write = mm_acc(g_write, dx, tl.trans(u), DT)
        store_token_rows(dv, dv_block, tok, i_h, pos, m_t, vc, m_v, H, V)

    strict = pos[:, None] > pos[None, :]
    causal = pos[:, None] >= pos[None, :]
    # entries whose exponent is identically 0: e = b on the diagonal, e = bm one below it
    diag = pos[:, None] == pos[None, :]
    below = pos[:, None] == pos[None, :] + 1
    d_b = tl.zeros([C], dtype=tl.float32)
    d_bm = tl.zeros([C], dtype=tl.float32)

    # the query scores (E_Q) first, so that their gradients die before the key scores' are formed
    p_base = token_scores(base_scores, tok, i_h, pos, m_t, H, C).to(tl.float32)
    if RESIDUAL and not OUTPUT_GATES:
        row, col = _exponent_grads(g_base, p_base, below)
        d_bm += row
        eq = g_base * decay(bm, bb, strict)
    else:
        row, col = _exponent_grads(g_base, p_base, diag)  # (strictly lower with a residual memory)
        d_b += row
        eq = g_base * decay(bb, bb, strict if RESIDUAL else causal)
    d_b -= col
    if RESIDUAL:
        p_res = token_scores(res_scores, tok, i_h, pos, m_t, H, C).to(tl.float32)
        if OUTPUT_GATES:
            d_gamma += tl.sum(g_res * p_res, 1)
            g_res = gamma_t[:, None] * g_res
        row, col = _exponent_grads(g_res, p_res, diag)
        d_b += row - col
        eq += g_res * decay(bb, bb, causal)
    store_token_rows(e_q, eq, tok, i_h, pos, m_t, pos, pos < C, H, C)

    # The key scores: A = diag(α) A' enters T_β, T_γ (gradient −β∘G_x − γ∘G_y), A' the prediction error (−G_e);
    # with e^{b_t − b_s} = α_t e^{bm_t − b_s} both are one matrix −G_k ∘ A' (G_k accumulated above) whose row sums
    # all go to bm. The A part's exponent is really b_t = bm_t + g_t: its row sums (−β dx·(A u) − γ dy·(A w)) also count
    # for g_t alone, as do the keys kernel's β terms of its S_0 product, which it also sends to bm; ``direct``
    # holds both (for RDN, −β α dx·(v − err) = −β e^b k·(dx S_0) + β dx·(A u), from e^{bm} K S_0ᵀ = V − err − A'u).
    # A term for g_t alone is db_t += X with dbm_t −= X (decay_grad.py sums db over t ≥ s, dbm over t > s).
    ek = tl.zeros([C, C], dtype=tl.float32)
    if DELTA or RESIDUAL:
        a_prev = token_scores(key_scores, tok, i_h, pos, m_t, H, C).to(tl.float32)
        if DELTA:
            write_dot = tl.sum(g_write * a_prev, 1) * alpha  # dy·(A w) with a residual memory, else dx·(A u)
            if RESIDUAL:
                d_gamma -= write_dot
                direct -= gamma_t * write_dot
                g_keys += (alpha * gamma_t)[:, None] * g_write
            else:
                d_beta -= write_dot
                direct -= beta_t * write_dot
                g_keys += (alpha * beta_t)[:, None] * g_write
        row, col = _exponent_grads(-g_keys, a_prev, below)
        d_bm += row - direct
        d_b += direct - col
        ek -= g_keys * decay(bm, bb, strict)
    store_token_rows(e_k, ek, tok, i_h, pos, m_t, pos, pos < C, H, C)
    store_token_gate(db_part, d_b, tok, i_h, pos, m_t, H)
    store_token_gate(dbm_part, d_bm, tok, i_h, pos, m_t, H)
    store_token_gate(dbeta_part, d_beta, tok, i_h, pos, m_t, H)
    if RESIDUAL:
        store_token_gate(dgamma_part, d_gamma, tok, i_h, pos, m_t, H)
