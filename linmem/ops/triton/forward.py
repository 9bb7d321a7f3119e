"""The fused forward pass: one program per (sequence, head, block of value rows) walks the chunks in order and
carries both states, the base memory S and the residual memory R (``[BV, K]`` rows each, float32).

Per chunk, with ``KS = K S_0ᵀ`` (one product serves both base read-outs of the keys):

- base writes ``u = T_β diag(β)(V − diag(e^b) KS)`` (delta) or ``diag(β) V`` (additive);
- prediction error ``err_t = v_t − S_{t−1}k_t = V − diag(e^{bm}) KS − A' u``, target ``r = ρ(err)``;
- residual writes ``w = T_γ diag(γ)(r − diag(e^b) K R_0ᵀ)`` (delta) or ``diag(γ) r`` (additive);
- ``o = scale·(diag(e^b) Q S_0ᵀ + P_base u + γ ∘ (diag(e^b) Q R_0ᵀ + P_res w))``;
- hand-over ``S ← e^{b_C} S + uᵀ diag(e^{b_C − b}) K`` and the same for R with w.

Without a residual memory only S runs and ``o = scale·(diag(e^b) Q S_0ᵀ + P_base u)`` with the inclusive mask. With
``STORE`` the pass also writes what the backward pass needs: the states before every chunk, u, w, err, the residual
memory's own error ``ε = r − α_t R_{t−1}k_t`` (delta; r for the additive rule) and the residual read-out.
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
    residual_target,
    sequence_start,
    store_rows,
    store_state,
)


@triton.jit
def forward_kernel(
    q, k, v, b, g, beta, gamma, key_scores, base_scores, res_scores, inv_beta, inv_gamma,
    base0, res0, o, base_final, res_final,
    base_chunks, res_chunks, u_out, w_out, err_out, eps_out, res_read_out,
    cu_seqlens, chunk_offsets, scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
    TARGET: tl.constexpr, STORE: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    length = (eos - bos).to(tl.int32)
    q = sequence_start(q, bos, i_h, H, K)
    k = sequence_start(k, bos, i_h, H, K)
    v = sequence_start(v, bos, i_h, H, V)
    o = sequence_start(o, bos, i_h, H, V)
    u_out = sequence_start(u_out, bos, i_h, H, V)
    w_out = sequence_start(w_out, bos, i_h, H, V)
    err_out = sequence_start(err_out, bos, i_h, H, V)
    eps_out = sequence_start(eps_out, bos, i_h, H, V)
    res_read_out = sequence_start(res_read_out, bos, i_h, H, V)
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

    state = load_state(base0, i_n, i_h, H, V, K, rows, m_v, cols, m_k)
    if RESIDUAL:
        res_state = load_state(res0, i_n, i_h, H, V, K, rows, m_v, cols, m_k)

    for j in range(n_chunks):
        r = j * C + pos
        m_t = r < length
        last = tl.minimum(j * C + C, length) - 1
        b_last = tl.load(b + last * H)
        bb = load_decay(b, r, m_t, H, b_last)
        gg = load_gate(g, r, m_t, H)
        bm = bb - gg
        kb = load_tile(k, r, m_t, H, K, cols, m_k)
        vb = load_rows(v, r, m_t, H, V, rows, m_v)
        beta_t = load_gate(beta, r, m_t, H)
        if STORE:
            store_state(base_chunks, state, c0 + j, i_h, H, V, K, rows, m_v, cols, m_k)
            if RESIDUAL:
                store_state(res_chunks, res_state, c0 + j, i_h, H, V, K, rows, m_v, cols, m_k)

        ks = mm(kb, tl.trans(state), DT)  # [C, BV]: k_tᵀ-rows of S_0
        if DELTA:
            t_beta = load_tile(inv_beta, r, m_t, H, C, pos, all_c)
            u = mm(t_beta, beta_t[:, None] * (vb - tl.exp(bb)[:, None] * ks), DT)
        else:
            u = beta_t[:, None] * vb
        if RESIDUAL or (DELTA and STORE):
            a_prev = load_tile(key_scores, r, m_t, H, C, pos, all_c)
            err = vb - tl.exp(bm)[:, None] * ks - mm(a_prev, u, DT)
            if STORE:
                store_rows(err_out, err, r, m_t, H, V, rows, m_v)
        if RESIDUAL:
            gamma_t = load_gate(gamma, r, m_t, H)
            target = residual_target(err, clip, TARGET)
            if DELTA:
                kr = mm(kb, tl.trans(res_state), DT)
                t_gamma = load_tile(inv_gamma, r, m_t, H, C, pos, all_c)
                w = mm(t_gamma, gamma_t[:, None] * (target - tl.exp(bb)[:, None] * kr), DT)
                if STORE:
                    eps = target - tl.exp(bb)[:, None] * kr - tl.exp(gg)[:, None] * mm(a_prev, w, DT)
                    store_rows(eps_out, eps, r, m_t, H, V, rows, m_v)
            else:
                w = gamma_t[:, None] * target
                if STORE:
                    store_rows(eps_out, target, r, m_t, H, V, rows, m_v)

        qb = load_tile(q, r, m_t, H, K, cols, m_k)
        p_base = load_tile(base_scores, r, m_t, H, C, pos, all_c)
        if RESIDUAL and not OUTPUT_GATES:
            read_decay = tl.exp(bm)
        else:
            read_decay = tl.exp(bb)
        out = read_decay[:, None] * mm(qb, tl.trans(state), DT) + mm(p_base, u, DT)
        if RESIDUAL:
            p_res = load_tile(res_scores, r, m_t, H, C, pos, all_c)
            res_read = tl.exp(bb)[:, None] * mm(qb, tl.trans(res_state), DT) + mm(p_res, w, DT)
            if OUTPUT_GATES:
                out += gamma_t[:, None] * res_read
                if STORE:
                    store_rows(res_read_out, res_read, r, m_t, H, V, rows, m_v)
            else:
                out += res_read
        store_rows(o, scale * out, r, m_t, H, V, rows, m_v)
        if STORE:
            store_rows(u_out, u, r, m_t, H, V, rows, m_v)
            if RESIDUAL:
                store_rows(w_out, w, r, m_t, H, V, rows, m_v)

        k_end = kb * tl.exp(b_last - bb)[:, None]  # e^{b_C − b_s} k_s: each key's decay to the chunk end
        state = tl.exp(b_last) * state + mm(tl.trans(u), k_end, DT)
        if RESIDUAL:
            res_state = tl.exp(b_last) * res_state + mm(tl.trans(w), k_end, DT)

    store_state(base_final, state, i_n, i_h, H, V, K, rows, m_v, cols, m_k)
    if RESIDUAL:
        store_state(res_final, res_state, i_n, i_h, H, V, K, rows, m_v, cols, m_k)
