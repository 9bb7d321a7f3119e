"""Per-chunk gradients that need a sum over the value axis: dv, the value-side parts of dβ and dγ, the gradients of
the in-chunk score matrices and their share of the decay gradient.

One program per (chunk, head) loops over value blocks (``ō = scale·dO``, the reverse pass's ``dx, dy, d_err``, the
forward pass's u, w, err) and accumulates ``[C, C]`` products: ``G_b = ō uᵀ``, ``G_r = ō wᵀ``, ``G_x = dx uᵀ``
(delta), ``G_y = dy wᵀ`` (delta, residual), ``G_e = d_err uᵀ`` (residual). The score matrices' gradients are then

- ``P_base``: ``G_b``; ``P_res``: ``γ ∘ G_r`` (rows; ``G_r`` without output gates);
- ``A = diag(α) A'`` (the delta rule's in-chunk term of ``T = (I + diag(σ) A)^{-1}``): ``−β ∘ G_x − γ ∘ G_y``;
- ``A'`` (the in-chunk part of the prediction ``S_{t−1}k_t``): ``−G_e``.

Stored: ``E_Q`` with ``dQ += E_Q K`` and ``dK += E_Qᵀ Q`` (the P gradients times their decays), ``E_K`` (strictly
lower) with ``dK += (E_K + E_Kᵀ) K``, and, per token, ``dv = β ∘ dx + d_err`` and these partial sums:
``dβ = dx·v − (G_x ∘ A)1``, ``dγ = dy·r − (G_y ∘ A)1 + (G_r ∘ P_res)1`` (the last with output gates), and the
decay gradients ``db``/``dbm``: a score ``e^{e_t − b_s} x_tᵀk_s`` with upstream gradient ``G_ts`` adds ``G_ts·score_ts``
to the gradient of its row exponent ``e_t`` (b or bm) and subtracts it from that of ``b_s``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    chunk_at,
    decay,
    load_decays,
    mm_acc,
    residual_target,
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

    g_base = tl.zeros([C, C], dtype=tl.float32)
    g_res = tl.zeros([C, C], dtype=tl.float32)
    g_x = tl.zeros([C, C], dtype=tl.float32)
    g_y = tl.zeros([C, C], dtype=tl.float32)
    g_err = tl.zeros([C, C], dtype=tl.float32)
    d_beta = tl.zeros([C], dtype=tl.float32)
    d_gamma = tl.zeros([C], dtype=tl.float32)
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
        d_beta += tl.sum(dx * vb, 1)
        dv_block = beta_t[:, None] * dx
        if DELTA:
            g_x = mm_acc(g_x, dx, tl.trans(u), DT)
        if RESIDUAL:
            target = residual_target(token_rows(err_in, tok, i_h, pos, m_t, vc, m_v, H, V), clip, TARGET)
            if DELTA:
                w = token_rows(w_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            else:
                w = gamma_t[:, None] * target
            dy = token_rows(dy_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            d_err = token_rows(derr_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            g_res = mm_acc(g_res, d_base_read, tl.trans(w), DT)
            g_err = mm_acc(g_err, d_err, tl.trans(u), DT)
            d_gamma += tl.sum(dy * target, 1)
            if DELTA:
                g_y = mm_acc(g_y, dy, tl.trans(w), DT)
            dv_block += d_err
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

    ek = tl.zeros([C, C], dtype=tl.float32)
    if DELTA or RESIDUAL:
        a_prev = token_scores(key_scores, tok, i_h, pos, m_t, H, C).to(tl.float32)
    if RESIDUAL:
        row, col = _exponent_grads(-g_err, a_prev, below)
        d_bm += row
        d_b -= col
        ek -= g_err * decay(bm, bb, strict)
    if DELTA:
        a = tl.exp(bb - bm)[:, None] * a_prev  # A = diag(α) A' (strictly lower)
        d_beta -= tl.sum(g_x * a, 1)
        g_a = -beta_t[:, None] * g_x
        if RESIDUAL:
            d_gamma -= tl.sum(g_y * a, 1)
            g_a -= gamma_t[:, None] * g_y
        row, col = _exponent_grads(g_a, a, diag)
        d_b += row - col
        ek += g_a * decay(bb, bb, strict)
    store_token_rows(e_k, ek, tok, i_h, pos, m_t, pos, pos < C, H, C)
    store_token_gate(db_part, d_b, tok, i_h, pos, m_t, H)
    store_token_gate(dbm_part, d_bm, tok, i_h, pos, m_t, H)
    store_token_gate(dbeta_part, d_beta, tok, i_h, pos, m_t, H)
    if RESIDUAL:
        store_token_gate(dgamma_part, d_gamma, tok, i_h, pos, m_t, H)
