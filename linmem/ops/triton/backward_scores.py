"""Per-chunk gradients that need a sum over the value dimension: dv, dβ, dγ, the in-chunk score gradients and their
share of the decay gradient.

One program per (chunk, head) loops over value blocks and accumulates four ``[C, C]`` products of row gradients
with writes (``ō uᵀ``, ``d̄ wᵀ``, ``(β∘dU_T) uᵀ + (γ∘dW_T) wᵀ`` for the delta rule's ``A``, ``d_err uᵀ`` for
``A'``). From them it stores

- ``E_Q = (ō uᵀ)∘Γ_base + (d̄ wᵀ)∘Γ_res`` with ``dQ += E_Q K`` and ``dK += E_Qᵀ Q``;
- ``E_K = −(β∘dU_T uᵀ + γ∘dW_T wᵀ)∘Γ(b) − (d_err uᵀ)∘Γ(bm)`` (strictly lower) with ``dK += (E_K + E_Kᵀ) K``;
- the decay gradient of these terms: each score ``e^{e_t − b_s} x_tᵀk_s`` with upstream gradient ``G_ts`` adds
  ``G_ts·score_ts`` to the gradient of ``e_t`` (b or bm) and subtracts it from that of ``b_s``.

Per token: ``dv = β∘dU_T + d_err``, ``dβ = dU_T·((1 − α)v + α·err)`` (delta; ``dU_T·v`` additive) and
``dγ = dW_T·ε + scale·dO·(R_t q_t)`` (the last term with output gates).
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import decay, load_decay, load_gate, load_rows, mm, sequence_start, store_rows


@triton.jit
def backward_scores_kernel(
    v, do, b, g, beta, gamma, key_scores, base_scores, res_scores, u_in, w_in, err_in, eps_in, res_read_in,
    du_in, dw_in, derr_in, dv, dbeta, dgamma, e_q, e_k, db_part, dbm_part, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr,
    RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    length = (eos - bos).to(tl.int32)
    v = sequence_start(v, bos, i_h, H, V)
    do = sequence_start(do, bos, i_h, H, V)
    u_in = sequence_start(u_in, bos, i_h, H, V)
    w_in = sequence_start(w_in, bos, i_h, H, V)
    err_in = sequence_start(err_in, bos, i_h, H, V)
    eps_in = sequence_start(eps_in, bos, i_h, H, V)
    res_read_in = sequence_start(res_read_in, bos, i_h, H, V)
    du_in = sequence_start(du_in, bos, i_h, H, V)
    dw_in = sequence_start(dw_in, bos, i_h, H, V)
    derr_in = sequence_start(derr_in, bos, i_h, H, V)
    dv = sequence_start(dv, bos, i_h, H, V)
    b = sequence_start(b, bos, i_h, H, 1)
    g = sequence_start(g, bos, i_h, H, 1)
    beta = sequence_start(beta, bos, i_h, H, 1)
    gamma = sequence_start(gamma, bos, i_h, H, 1)
    dbeta = sequence_start(dbeta, bos, i_h, H, 1)
    dgamma = sequence_start(dgamma, bos, i_h, H, 1)
    db_part = sequence_start(db_part, bos, i_h, H, 1)
    dbm_part = sequence_start(dbm_part, bos, i_h, H, 1)
    key_scores = sequence_start(key_scores, bos, i_h, H, C)
    base_scores = sequence_start(base_scores, bos, i_h, H, C)
    res_scores = sequence_start(res_scores, bos, i_h, H, C)
    e_q = sequence_start(e_q, bos, i_h, H, C)
    e_k = sequence_start(e_k, bos, i_h, H, C)
    pos = tl.arange(0, C)
    all_c = pos < C
    r = j * C + pos
    m_t = r < length
    last = tl.minimum(j * C + C, length) - 1
    bb = load_decay(b, r, m_t, H, tl.load(b + last * H))
    gg = load_gate(g, r, m_t, H)
    bm = bb - gg
    alpha = tl.exp(gg)
    beta_t = load_gate(beta, r, m_t, H)
    if RESIDUAL:
        gamma_t = load_gate(gamma, r, m_t, H)

    g_base = tl.zeros([C, C], dtype=tl.float32)
    g_res = tl.zeros([C, C], dtype=tl.float32)
    g_keys = tl.zeros([C, C], dtype=tl.float32)
    g_keys_prev = tl.zeros([C, C], dtype=tl.float32)
    d_beta = tl.zeros([C], dtype=tl.float32)
    d_gamma = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        rows = v0 + tl.arange(0, BV)
        m_v = rows < V
        d_base_read = scale * load_rows(do, r, m_t, H, V, rows, m_v)
        u = load_rows(u_in, r, m_t, H, V, rows, m_v)
        du = load_rows(du_in, r, m_t, H, V, rows, m_v)
        vb = load_rows(v, r, m_t, H, V, rows, m_v)
        g_base += mm(d_base_read, tl.trans(u), DT)
        dv_block = beta_t[:, None] * du
        if DELTA:
            err = load_rows(err_in, r, m_t, H, V, rows, m_v)
            d_beta += tl.sum(du * ((1.0 - alpha)[:, None] * vb + alpha[:, None] * err), 1)
            g_keys += mm(beta_t[:, None] * du, tl.trans(u), DT)
        else:
            d_beta += tl.sum(du * vb, 1)
        if RESIDUAL:
            if OUTPUT_GATES:
                d_res_read = gamma_t[:, None] * d_base_read
                res_read = load_rows(res_read_in, r, m_t, H, V, rows, m_v)
                d_gamma += tl.sum(d_base_read * res_read, 1)
            else:
                d_res_read = d_base_read
            w = load_rows(w_in, r, m_t, H, V, rows, m_v)
            dw = load_rows(dw_in, r, m_t, H, V, rows, m_v)
            eps = load_rows(eps_in, r, m_t, H, V, rows, m_v)
            d_err = load_rows(derr_in, r, m_t, H, V, rows, m_v)
            g_res += mm(d_res_read, tl.trans(w), DT)
            d_gamma += tl.sum(dw * eps, 1)
            if DELTA:
                g_keys += mm(gamma_t[:, None] * dw, tl.trans(w), DT)
            g_keys_prev += mm(d_err, tl.trans(u), DT)
            dv_block += d_err
        store_rows(dv, dv_block, r, m_t, H, V, rows, m_v)

    strict = pos[:, None] > pos[None, :]
    causal = pos[:, None] >= pos[None, :]
    # A score e^{e_t − b_s} x_tᵀk_s with gradient G_ts adds G∘score to de_t (row sums) and subtracts it from db_s
    # (column sums). Entries whose exponent is identically 0 (e = b on the diagonal, e = bm one below it) have no
    # decay to differentiate: leaving them out keeps their large, exactly cancelling terms out of dg.
    diag = pos[:, None] == pos[None, :]
    below = pos[:, None] == pos[None, :] + 1
    p_base = load_rows(base_scores, r, m_t, H, C, pos, all_c)
    if RESIDUAL:
        p_res = load_rows(res_scores, r, m_t, H, C, pos, all_c)
        m_res = tl.where(diag, 0.0, g_res * p_res)
        d_b = tl.sum(m_res, 1) - tl.sum(m_res, 0)
        eq = g_res * decay(bb, bb, causal)
        if OUTPUT_GATES:
            m_base = g_base * p_base  # strictly lower: no diagonal
            d_b += tl.sum(m_base, 1) - tl.sum(m_base, 0)
            d_bm = tl.zeros([C], dtype=tl.float32)
            eq += g_base * decay(bb, bb, strict)
        else:
            m_base = tl.where(below, 0.0, g_base * p_base)
            d_b -= tl.sum(m_base, 0)
            d_bm = tl.sum(m_base, 1)
            eq += g_base * decay(bm, bb, strict)
        a_prev = load_rows(key_scores, r, m_t, H, C, pos, all_c)
        m_prev = tl.where(below, 0.0, -g_keys_prev * a_prev)
        d_bm += tl.sum(m_prev, 1)
        d_b -= tl.sum(m_prev, 0)
        ek = -g_keys_prev * decay(bm, bb, strict)
    else:
        m_base = tl.where(diag, 0.0, g_base * p_base)
        d_b = tl.sum(m_base, 1) - tl.sum(m_base, 0)
        d_bm = tl.zeros([C], dtype=tl.float32)
        eq = g_base * decay(bb, bb, causal)
        ek = tl.zeros([C, C], dtype=tl.float32)
    if DELTA:
        if not RESIDUAL:
            a_prev = load_rows(key_scores, r, m_t, H, C, pos, all_c)
        m_keys = -g_keys * (alpha[:, None] * a_prev)  # strictly lower
        d_b += tl.sum(m_keys, 1) - tl.sum(m_keys, 0)
        ek -= g_keys * decay(bb, bb, strict)

    store_rows(e_q, eq, r, m_t, H, C, pos, all_c)
    store_rows(e_k, ek, r, m_t, H, C, pos, all_c)
    tl.store(db_part + r * H, d_b, mask=m_t)
    tl.store(dbm_part + r * H, d_bm, mask=m_t)
    tl.store(dbeta + r * H, d_beta, mask=m_t)
    if RESIDUAL:
        tl.store(dgamma + r * H, d_gamma, mask=m_t)
