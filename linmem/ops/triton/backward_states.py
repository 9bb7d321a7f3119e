"""The reverse pass over chunks: the gradients of the states, carried backwards like the states were carried forwards.

One program per (sequence, head, block of value rows), chunks in reverse order. With ``dS, dR`` the gradients of the
states at the end of the chunk (``[BV, K]``, float32), ``ō = scale·dO`` and ``d̄ = scale·γ∘dO`` (the gradients of
the base and residual read-outs; ``d̄ = scale·dO`` without output gates):

- residual writes: ``dw = K̃ dRᵀ + P_resᵀ d̄`` (``K̃ = diag(e^{b_C − b}) K``), ``dW_T = T_γᵀ dw`` (delta; dw for the
  additive rule), gradient of the target ``dr = γ ∘ dW_T``, of the error ``d_err = ρ'(err) ∘ dr``;
- base writes: ``du = K̃ dSᵀ + P_baseᵀ ō − A'ᵀ d_err``, ``dU_T = T_βᵀ du`` (delta; du for the additive rule);
- states before the chunk: ``dR ← e^{b_C} dR + d̄ᵀ diag(e^b) Q − [delta] drᵀ diag(e^b) K`` and
  ``dS ← e^{b_C} dS + ōᵀ diag(e^{e}) Q − d_errᵀ diag(e^{bm}) K − [delta] (β∘dU_T)ᵀ diag(e^b) K``.

It stores dS, dR at the end of every chunk and ``dU_T, dW_T, d_err`` per token for the parallel kernels that follow.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    load_decay,
    load_gate,
    load_rows,
    load_state,
    load_tile,
    mm,
    residual_target_grad,
    sequence_start,
    store_rows,
    store_state,
)


@triton.jit
def backward_states_kernel(
    q, k, do, b, g, beta, gamma, key_scores, base_scores, res_scores, inv_beta, inv_gamma, err_in,
    d_base_final, d_res_final, d_base0, d_res0, d_base_chunks, d_res_chunks, du_out, dw_out, derr_out,
    cu_seqlens, chunk_offsets, scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
    TARGET: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    length = (eos - bos).to(tl.int32)
    q = sequence_start(q, bos, i_h, H, K)
    k = sequence_start(k, bos, i_h, H, K)
    do = sequence_start(do, bos, i_h, H, V)
    err_in = sequence_start(err_in, bos, i_h, H, V)
    du_out = sequence_start(du_out, bos, i_h, H, V)
    dw_out = sequence_start(dw_out, bos, i_h, H, V)
    derr_out = sequence_start(derr_out, bos, i_h, H, V)
    b = sequence_start(b, bos, i_h, H, 1)
    g = sequence_start(g, bos, i_h, H, 1)
    beta = sequence_start(beta, bos, i_h, H, 1)
    gamma = sequence_start(gamma, bos, i_h, H, 1)
    key_scores = sequence_start(key_scores, bos, i_h, H, C)
    base_scores = sequence_start(base_scores, bos, i_h, H, C)
    res_scores = sequence_start(res_scores, bos, i_h, H, C)
    inv_beta = sequence_start(inv_beta, bos, i_h, H, C)
    inv_gamma = sequence_start(inv_gamma, bos, i_h, H, C)
    c0 = tl.load(chunk_offsets + i_n)
    n_chunks = tl.cdiv(length, C)

    pos = tl.arange(0, C)
    all_c = pos < C
    rows = i_v * BV + tl.arange(0, BV)
    m_v = rows < V
    cols = tl.arange(0, BK)
    m_k = cols < K

    d_state = load_state(d_base_final, i_n, i_h, H, V, K, rows, m_v, cols, m_k)
    if RESIDUAL:
        d_res_state = load_state(d_res_final, i_n, i_h, H, V, K, rows, m_v, cols, m_k)

    for jj in range(n_chunks):
        j = n_chunks - 1 - jj
        store_state(d_base_chunks, d_state, c0 + j, i_h, H, V, K, rows, m_v, cols, m_k)
        if RESIDUAL:
            store_state(d_res_chunks, d_res_state, c0 + j, i_h, H, V, K, rows, m_v, cols, m_k)
        r = j * C + pos
        m_t = r < length
        last = tl.minimum(j * C + C, length) - 1
        b_last = tl.load(b + last * H)
        bb = load_decay(b, r, m_t, H, b_last)
        gg = load_gate(g, r, m_t, H)
        bm = bb - gg
        kb = load_tile(k, r, m_t, H, K, cols, m_k)
        qb = load_tile(q, r, m_t, H, K, cols, m_k)
        d_out = load_rows(do, r, m_t, H, V, rows, m_v)
        d_base_read = scale * d_out
        k_end = kb * tl.exp(b_last - bb)[:, None]

        if RESIDUAL:
            gamma_t = load_gate(gamma, r, m_t, H)
            if OUTPUT_GATES:
                d_res_read = gamma_t[:, None] * d_base_read
            else:
                d_res_read = d_base_read
            p_res = load_tile(res_scores, r, m_t, H, C, pos, all_c)
            dw = mm(k_end, tl.trans(d_res_state), DT) + mm(tl.trans(p_res), d_res_read, DT)
            if DELTA:
                t_gamma = load_tile(inv_gamma, r, m_t, H, C, pos, all_c)
                dw = mm(tl.trans(t_gamma), dw, DT)
            store_rows(dw_out, dw, r, m_t, H, V, rows, m_v)
            d_target = gamma_t[:, None] * dw
            d_res_state = tl.exp(b_last) * d_res_state + mm(tl.trans(d_res_read), qb * tl.exp(bb)[:, None], DT)
            if DELTA:
                d_res_state -= mm(tl.trans(d_target), kb * tl.exp(bb)[:, None], DT)
            err = load_rows(err_in, r, m_t, H, V, rows, m_v)
            d_err = residual_target_grad(err, clip, TARGET) * d_target
            store_rows(derr_out, d_err, r, m_t, H, V, rows, m_v)

        p_base = load_tile(base_scores, r, m_t, H, C, pos, all_c)
        du = mm(k_end, tl.trans(d_state), DT) + mm(tl.trans(p_base), d_base_read, DT)
        if RESIDUAL:
            a_prev = load_tile(key_scores, r, m_t, H, C, pos, all_c)
            du -= mm(tl.trans(a_prev), d_err, DT)
        if DELTA:
            t_beta = load_tile(inv_beta, r, m_t, H, C, pos, all_c)
            du = mm(tl.trans(t_beta), du, DT)
        store_rows(du_out, du, r, m_t, H, V, rows, m_v)

        if RESIDUAL and not OUTPUT_GATES:
            read_decay = tl.exp(bm)
        else:
            read_decay = tl.exp(bb)
        d_state = tl.exp(b_last) * d_state + mm(tl.trans(d_base_read), qb * read_decay[:, None], DT)
        if RESIDUAL:
            d_state -= mm(tl.trans(d_err), kb * tl.exp(bm)[:, None], DT)
        if DELTA:
            beta_t = load_gate(beta, r, m_t, H)
            d_state -= mm(tl.trans(beta_t[:, None] * du), kb * tl.exp(bb)[:, None], DT)

    store_state(d_base0, d_state, i_n, i_h, H, V, K, rows, m_v, cols, m_k)
    if RESIDUAL:
        store_state(d_res0, d_res_state, i_n, i_h, H, V, K, rows, m_v, cols, m_k)
