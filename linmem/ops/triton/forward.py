"""The forward pass: a sequential pass that only carries the states, then a chunk-parallel read-out.

``forward_states_kernel``: one program per (sequence, head, block of BV value columns) walks the chunks in order and
carries the transposed states ``Sᵀ`` (and ``Rᵀ``) as key blocks ``[BK, BV]`` (float32). Per chunk, with
``KS = K S_0ᵀ`` (one product serves the delta write and the prediction error):

- base writes ``u = T_β diag(β)(V − diag(e^b) KS)`` (delta) or ``diag(β) V`` (additive);
- prediction error ``err_t = v_t − S_{t−1}k_t = V − diag(e^{bm}) KS − A' u``, target ``r = ρ(err)``;
- residual writes ``w = T_γ diag(γ)(r − diag(e^b) K R_0ᵀ)`` (delta) or ``diag(γ) r`` (additive);
- hand-over ``Sᵀ ← e^{b_C} Sᵀ + Kᵀ diag(e^{b_C − b}) u`` and the same for R with w.

Everything that does not depend on the state (b, the score rows A', P, the inverses T_β, T_γ) comes from the
chunk-parallel kernels before it (scores.py, inverse.py). The pass stores the states before every chunk (input type
for half-precision inputs, as the dots read them), the writes u (delta) and w, and (for the backward pass) err.

This is the WY/UT form with the state product taken first: ``u = T_β diag(β) V − (T_β diag(β e^b) K) S_0ᵀ`` with a
precomputed ``W = T_β diag(βe^b) K`` costs the same number of products per chunk (``W S_0ᵀ`` and ``M S_0ᵀ`` for the
error, against ``K S_0ᵀ``, ``T_β·`` and ``A'·``), and this form needs no W, M, u0 tensors written and read back.

``output_kernel``: one program per (chunk, head, block of value columns) reads the outputs from the stored states:
``o = scale·(diag(e^e) Q S_0ᵀ + P_base u + γ ∘ (diag(e^b) Q R_0ᵀ + P_res w))`` (``e = bm`` for the base read without
output gates, else b; without a residual memory ``o = scale·(diag(e^b) Q S_0ᵀ + P_base u)`` with the inclusive P).
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    at_token,
    chunk_at,
    chunk_of_sequence,
    key_block,
    load_block,
    load_decays,
    load_user_states,
    mm,
    mm_acc,
    read_blocks,
    residual_target,
    sequence_at,
    state_at,
    store_chunk_states,
    store_token_rows,
    store_user_states,
    token_gate,
    token_rows,
    token_scores,
    update_blocks,
)


@triton.jit
def forward_states_kernel(
    k, v, b, g, beta, gamma, key_scores, inv_beta, inv_gamma,
    base0, res0, base_final, res_final, base_chunks, res_chunks, u_out, w_out, err_out,
    cu_seqlens, chunk_offsets, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr, TARGET: tl.constexpr,
    STORE_ERR: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length = sequence_at(cu_seqlens, i_n)
    c0 = tl.load(chunk_offsets + i_n)
    pos = tl.arange(0, C)
    vc = i_v * BV + tl.arange(0, BV)
    m_v = vc < V

    s0, s1, s2, s3, r0, r1, r2, r3 = load_user_states(base0, res0, i_n, i_h, vc, m_v, H, K, V, BK, NK,
                                                      RESIDUAL)

    for j in range(tl.cdiv(length, C)):
        tok, n_valid = chunk_of_sequence(bos, length, j, C)
        m_t = pos < n_valid
        store_chunk_states(base_chunks, res_chunks, c0 + j, i_h, vc, m_v, s0, s1, s2, s3, r0, r1, r2, r3,
                           H, K, V, BK, NK, RESIDUAL)
        bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
        kp = at_token(k, tok, i_h, H, K)
        vb = token_rows(v, tok, i_h, pos, m_t, vc, m_v, H, V)
        beta_t = token_gate(beta, tok, i_h, pos, m_t, H)
        if DELTA or RESIDUAL:
            ks = read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)  # K S_0ᵀ
        if DELTA:
            t_beta = token_scores(inv_beta, tok, i_h, pos, m_t, H, C)
            u = mm(t_beta, beta_t[:, None] * (vb - tl.exp(bb)[:, None] * ks), DT)
            store_token_rows(u_out, u, tok, i_h, pos, m_t, vc, m_v, H, V)
        else:
            u = beta_t[:, None] * vb
        to_end = tl.exp(b_last - bb)[:, None]  # e^{b_C − b_s}: each write's decay to the chunk end
        chunk_decay = tl.exp(b_last)
        if RESIDUAL:
            err = vb - tl.exp(bm)[:, None] * ks - mm(token_scores(key_scores, tok, i_h, pos, m_t, H, C), u, DT)
            if STORE_ERR:
                store_token_rows(err_out, err, tok, i_h, pos, m_t, vc, m_v, H, V)
        # S is not needed again in this chunk: hand it over now (shorter live ranges)
        s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, chunk_decay, kp, pos, m_t, to_end * u, H, K, BK, NK, DT)
        if RESIDUAL:
            gamma_t = token_gate(gamma, tok, i_h, pos, m_t, H)
            target = residual_target(err, clip, TARGET)
            if DELTA:
                kr = read_blocks(kp, pos, m_t, H, K, BK, NK, r0, r1, r2, r3, DT)  # K R_0ᵀ
                t_gamma = token_scores(inv_gamma, tok, i_h, pos, m_t, H, C)
                w = mm(t_gamma, gamma_t[:, None] * (target - tl.exp(bb)[:, None] * kr), DT)
            else:
                w = gamma_t[:, None] * target
            store_token_rows(w_out, w, tok, i_h, pos, m_t, vc, m_v, H, V)
            r0, r1, r2, r3 = update_blocks(r0, r1, r2, r3, chunk_decay, kp, pos, m_t, to_end * w, H, K, BK, NK, DT)

    store_user_states(base_final, res_final, i_n, i_h, vc, m_v, s0, s1, s2, s3, r0, r1, r2, r3, H, K, V, BK, NK,
                      RESIDUAL)


@triton.jit
def _read_states(q, base_chunks, res_chunks, i_c, i_h, pos, m_t, vc, m_v, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
                 DT: tl.constexpr, RESIDUAL: tl.constexpr):
    """``Q S_0ᵀ`` and ``Q R_0ᵀ`` ([C, BV]) from the chunk's stored states ([NT, H, K, V])."""
    base_chunks = state_at(base_chunks, i_c, i_h, H, K * V)
    res_chunks = state_at(res_chunks, i_c, i_h, H, K * V)
    read_base = tl.zeros([C, BV], dtype=tl.float32)
    read_res = tl.zeros([C, BV], dtype=tl.float32)
    for i in tl.static_range(NK):
        rows = i * BK + tl.arange(0, BK)
        m_k = rows < K
        qb = key_block(q, pos, m_t, H, K, BK, i)
        read_base = mm_acc(read_base, qb, load_block(base_chunks, rows, m_k, V, vc, m_v, 1), DT)
        if RESIDUAL:
            read_res = mm_acc(read_res, qb, load_block(res_chunks, rows, m_k, V, vc, m_v, 1), DT)
    return read_base, read_res


@triton.jit
def output_kernel(
    q, v, b, g, beta, gamma, base_scores, res_scores, base_chunks, res_chunks, u_in, w_in, o,
    cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    pos = tl.arange(0, C)
    m_t = pos < n_valid
    vc = i_v * BV + tl.arange(0, BV)
    m_v = vc < V
    bb, bm, _ = load_decays(b, g, tok, i_h, pos, n_valid, H)
    read_base, read_res = _read_states(at_token(q, tok, i_h, H, K), base_chunks, res_chunks, i_c, i_h, pos, m_t,
                                       vc, m_v, H, K, V, C, BK, NK, BV, DT, RESIDUAL)
    if DELTA:
        u = token_rows(u_in, tok, i_h, pos, m_t, vc, m_v, H, V)
    else:
        u = token_gate(beta, tok, i_h, pos, m_t, H)[:, None] * token_rows(v, tok, i_h, pos, m_t, vc, m_v, H, V)
    if RESIDUAL and not OUTPUT_GATES:
        read_decay = tl.exp(bm)
    else:
        read_decay = tl.exp(bb)
    out = read_decay[:, None] * read_base + mm(token_scores(base_scores, tok, i_h, pos, m_t, H, C), u, DT)
    if RESIDUAL:
        w = token_rows(w_in, tok, i_h, pos, m_t, vc, m_v, H, V)
        res_read = tl.exp(bb)[:, None] * read_res + mm(token_scores(res_scores, tok, i_h, pos, m_t, H, C), w, DT)
        if OUTPUT_GATES:
            out += token_gate(gamma, tok, i_h, pos, m_t, H)[:, None] * res_read
        else:
            out += res_read
    store_token_rows(o, scale * out, tok, i_h, pos, m_t, vc, m_v, H, V)
