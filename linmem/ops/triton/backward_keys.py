"""Per-chunk gradients of the queries and keys, and the decay gradient of the state terms.

One program per (chunk, head, block of key columns) loops over value blocks. With ``S_0, R_0`` the states before the
chunk and ``dS, dR`` the gradients of the states after it (both stored by the passes before):

- ``dQ = diag(e^b)(ō S_0 + d̄ R_0) + E_Q K`` (the base term decays with ``bm`` without output gates);
- ``dK = −diag(e^b)((β∘dU_T) S_0 + (γ∘dW_T) R_0) − diag(e^{bm}) d_err S_0 + diag(e^{b_C − b})(u dS + w dR)
  + E_Qᵀ Q + (E_K + E_Kᵀ) K`` (the first bracket for the delta rule only);
- the decay gradient of each state term is the row-wise dot of its own vector with its share of dQ or dK: +
  for a row decay ``e^{b_t}`` or ``e^{bm_t}``, − for a column decay ``e^{−b_s}``; the chunk end ``b_C`` also gets
  ``e^{b_C}(⟨S_0, dS⟩ + ⟨R_0, dR⟩)``.

The decay gradients are partial sums over key blocks; decay_grad.py adds them up.
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
    sequence_start,
    store_rows,
)


@triton.jit
def backward_keys_kernel(
    q, k, do, b, g, beta, gamma, e_q, e_k, u_in, w_in, du_in, dw_in, derr_in,
    base_chunks, res_chunks, d_base_chunks, d_res_chunks, dq, dk, db_part, dbm_part, db_end_part,
    cu_seqlens, chunk_indices, scale, n_tok, n_chunks_total,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
):
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    length = (eos - bos).to(tl.int32)
    q = sequence_start(q, bos, i_h, H, K)
    k = sequence_start(k, bos, i_h, H, K)
    dq = sequence_start(dq, bos, i_h, H, K)
    dk = sequence_start(dk, bos, i_h, H, K)
    do = sequence_start(do, bos, i_h, H, V)
    u_in = sequence_start(u_in, bos, i_h, H, V)
    w_in = sequence_start(w_in, bos, i_h, H, V)
    du_in = sequence_start(du_in, bos, i_h, H, V)
    dw_in = sequence_start(dw_in, bos, i_h, H, V)
    derr_in = sequence_start(derr_in, bos, i_h, H, V)
    b = sequence_start(b, bos, i_h, H, 1)
    g = sequence_start(g, bos, i_h, H, 1)
    beta = sequence_start(beta, bos, i_h, H, 1)
    gamma = sequence_start(gamma, bos, i_h, H, 1)
    db_part = sequence_start(db_part, bos, i_h, H, 1)
    dbm_part = sequence_start(dbm_part, bos, i_h, H, 1)
    e_q = sequence_start(e_q, bos, i_h, H, C)
    e_k = sequence_start(e_k, bos, i_h, H, C)
    pos = tl.arange(0, C)
    all_c = pos < C
    r = j * C + pos
    m_t = r < length
    last = tl.minimum(j * C + C, length) - 1
    b_last = tl.load(b + last * H)
    bb = load_decay(b, r, m_t, H, b_last)
    gg = load_gate(g, r, m_t, H)
    bm = bb - gg
    beta_t = load_gate(beta, r, m_t, H)
    if RESIDUAL:
        gamma_t = load_gate(gamma, r, m_t, H)
    cols = i_k * BK + tl.arange(0, BK)
    m_k = cols < K

    dq_b = tl.zeros([C, BK], dtype=tl.float32)  # row decay e^{b}
    dq_bm = tl.zeros([C, BK], dtype=tl.float32)  # row decay e^{bm}
    dk_b = tl.zeros([C, BK], dtype=tl.float32)
    dk_bm = tl.zeros([C, BK], dtype=tl.float32)
    dk_end = tl.zeros([C, BK], dtype=tl.float32)  # column decay e^{b_C − b_s}
    state_dot = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        rows = v0 + tl.arange(0, BV)
        m_v = rows < V
        s0 = load_state(base_chunks, i_c, i_h, H, V, K, rows, m_v, cols, m_k)
        ds = load_state(d_base_chunks, i_c, i_h, H, V, K, rows, m_v, cols, m_k)
        d_base_read = scale * load_rows(do, r, m_t, H, V, rows, m_v)
        u = load_rows(u_in, r, m_t, H, V, rows, m_v)
        if RESIDUAL and not OUTPUT_GATES:
            dq_bm += mm(d_base_read, s0, DT)
        else:
            dq_b += mm(d_base_read, s0, DT)
        dk_end += mm(u, ds, DT)
        state_dot += tl.sum(s0 * ds, 0)
        if DELTA:
            du = load_rows(du_in, r, m_t, H, V, rows, m_v)
            dk_b += mm(beta_t[:, None] * du, s0, DT)
        if RESIDUAL:
            r0 = load_state(res_chunks, i_c, i_h, H, V, K, rows, m_v, cols, m_k)
            dr = load_state(d_res_chunks, i_c, i_h, H, V, K, rows, m_v, cols, m_k)
            if OUTPUT_GATES:
                d_res_read = gamma_t[:, None] * d_base_read
            else:
                d_res_read = d_base_read
            w = load_rows(w_in, r, m_t, H, V, rows, m_v)
            d_err = load_rows(derr_in, r, m_t, H, V, rows, m_v)
            dq_b += mm(d_res_read, r0, DT)
            dk_end += mm(w, dr, DT)
            state_dot += tl.sum(r0 * dr, 0)
            dk_bm += mm(d_err, s0, DT)
            if DELTA:
                dw = load_rows(dw_in, r, m_t, H, V, rows, m_v)
                dk_b += mm(gamma_t[:, None] * dw, r0, DT)

    qb = load_tile(q, r, m_t, H, K, cols, m_k)
    kb = load_tile(k, r, m_t, H, K, cols, m_k)
    dq_b = dq_b * tl.exp(bb)[:, None]
    dq_bm = dq_bm * tl.exp(bm)[:, None]
    dk_b = -dk_b * tl.exp(bb)[:, None]
    dk_bm = -dk_bm * tl.exp(bm)[:, None]
    dk_end = dk_end * tl.exp(b_last - bb)[:, None]
    # the chunk's last key reaches the chunk end undecayed (e^0): it adds nothing to db, so leave it out of both sides
    end_terms = tl.where(r == last, 0.0, tl.sum(kb * dk_end, 1))
    d_b = tl.sum(qb * dq_b, 1) + tl.sum(kb * dk_b, 1) - end_terms
    d_bm = tl.sum(qb * dq_bm, 1) + tl.sum(kb * dk_bm, 1)
    d_end = tl.sum(end_terms, 0) + tl.exp(b_last) * tl.sum(state_dot, 0)

    eq = load_rows(e_q, r, m_t, H, C, pos, all_c)
    ek = load_rows(e_k, r, m_t, H, C, pos, all_c)
    dq_total = dq_b + dq_bm + mm(eq, kb, DT)
    dk_total = dk_b + dk_bm + dk_end + mm(tl.trans(eq), qb, DT) + mm(ek, kb, DT) + mm(tl.trans(ek), kb, DT)
    store_rows(dq, dq_total, r, m_t, H, K, cols, m_k)
    store_rows(dk, dk_total, r, m_t, H, K, cols, m_k)
    part = i_k.to(tl.int64) * n_tok * H
    tl.store(db_part + part + r * H, d_b, mask=m_t)
    tl.store(dbm_part + part + r * H, d_bm, mask=m_t)
    tl.store(db_end_part + (i_k.to(tl.int64) * n_chunks_total + i_c) * H + i_h, d_end)
