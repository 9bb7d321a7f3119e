"""The reverse pass over chunks: the gradients of the states, carried backwards like the states were carried forwards.

One program per (sequence, head, block of BV value columns), chunks in reverse order, holding ``dSᵀ`` (and ``dRᵀ``)
as key blocks ``[BK, BV]`` (float32): the gradients of the states at the end of the chunk. With ``ō = scale·dO``,
``d̄ = γ∘ō`` (``ō`` without output gates) the gradients of the base and residual read-outs, ``K̃ = diag(e^{b_C − b}) K``:

- residual: ``dw = K̃ dRᵀ + P_resᵀ d̄``; ``dy = T_γᵀ dw`` (delta; dw for the additive rule) is the gradient of the
  residual memory's target-side input, and ``d_err = ρ'(err) ∘ γ ∘ dy`` that of the prediction error;
- base: ``du = K̃ dSᵀ + P_baseᵀ ō − A'ᵀ d_err``; ``dx = T_βᵀ du`` (delta; du for the additive rule);
- states before the chunk: ``dRᵀ ← e^{b_C} dRᵀ + Qᵀ diag(e^b) d̄ − [delta] Kᵀ diag(γ e^b) dy`` and
  ``dSᵀ ← e^{b_C} dSᵀ + Qᵀ diag(e^e) ō − Kᵀ ([delta] diag(β e^b) dx + [residual] diag(e^{bm}) d_err)``.

It stores dS, dR at the end of every chunk (for backward_keys.py) and ``dx``, ``dy``, ``d_err`` per token; every
other gradient is chunk-parallel (backward_scores.py, backward_keys.py, decay_grad.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    at_token,
    chunk_of_sequence,
    load_decays,
    load_user_states,
    mm,
    read_blocks,
    residual_target_grad,
    sequence_at,
    store_chunk_states,
    store_token_rows,
    store_user_states,
    token_gate,
    token_rows,
    token_scores,
    update_blocks,
)


@triton.jit
def backward_states_kernel(
    q, k, do, b, g, beta, gamma, key_scores, base_scores, res_scores, inv_beta, inv_gamma, err_in,
    d_base_final, d_res_final, d_base0, d_res0, d_base_chunks, d_res_chunks, dx_out, dy_out, derr_out,
    cu_seqlens, chunk_offsets, scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
    TARGET: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length = sequence_at(cu_seqlens, i_n)
    c0 = tl.load(chunk_offsets + i_n)
    n_chunks = tl.cdiv(length, C)
    pos = tl.arange(0, C)
    vc = i_v * BV + tl.arange(0, BV)
    m_v = vc < V

    s0, s1, s2, s3, r0, r1, r2, r3 = load_user_states(d_base_final, d_res_final, i_n, i_h, vc, m_v, H, K, V, BK, NK,
                                                      RESIDUAL)

    for jj in range(n_chunks):
        j = n_chunks - 1 - jj
        tok, n_valid = chunk_of_sequence(bos, length, j, C)
        m_t = pos < n_valid
        store_chunk_states(d_base_chunks, d_res_chunks, c0 + j, i_h, vc, m_v, s0, s1, s2, s3, r0, r1, r2, r3,
                           H, K, V, BK, NK, RESIDUAL)
        bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
        to_end = tl.exp(b_last - bb)[:, None]
        kp = at_token(k, tok, i_h, H, K)
        qp = at_token(q, tok, i_h, H, K)
        d_base_read = scale * token_rows(do, tok, i_h, pos, m_t, vc, m_v, H, V)
        chunk_decay = tl.exp(b_last)

        if RESIDUAL:
            gamma_t = token_gate(gamma, tok, i_h, pos, m_t, H)
            if OUTPUT_GATES:
                d_res_read = gamma_t[:, None] * d_base_read
            else:
                d_res_read = d_base_read
            p_res = token_scores(res_scores, tok, i_h, pos, m_t, H, C)
            dw = to_end * read_blocks(kp, pos, m_t, H, K, BK, NK, r0, r1, r2, r3, DT)
            dw += mm(tl.trans(p_res), d_res_read, DT)
            if DELTA:
                dy = mm(tl.trans(token_scores(inv_gamma, tok, i_h, pos, m_t, H, C)), dw, DT)
            else:
                dy = dw
            store_token_rows(dy_out, dy, tok, i_h, pos, m_t, vc, m_v, H, V)
            err = token_rows(err_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            d_err = residual_target_grad(err, clip, TARGET) * gamma_t[:, None] * dy
            store_token_rows(derr_out, d_err, tok, i_h, pos, m_t, vc, m_v, H, V)
            # dR is not needed again in this chunk: hand it over now (shorter live ranges)
            r0, r1, r2, r3 = update_blocks(r0, r1, r2, r3, chunk_decay, qp, pos, m_t,
                                           tl.exp(bb)[:, None] * d_res_read, H, K, BK, NK, DT)
            if DELTA:
                r0, r1, r2, r3 = update_blocks(r0, r1, r2, r3, 1.0, kp, pos, m_t,
                                               -(gamma_t * tl.exp(bb))[:, None] * dy, H, K, BK, NK, DT)

        du = to_end * read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
        du += mm(tl.trans(token_scores(base_scores, tok, i_h, pos, m_t, H, C)), d_base_read, DT)
        if RESIDUAL:
            du -= mm(tl.trans(token_scores(key_scores, tok, i_h, pos, m_t, H, C)), d_err, DT)
        if DELTA:
            dx = mm(tl.trans(token_scores(inv_beta, tok, i_h, pos, m_t, H, C)), du, DT)
        else:
            dx = du
        store_token_rows(dx_out, dx, tok, i_h, pos, m_t, vc, m_v, H, V)

        if RESIDUAL and not OUTPUT_GATES:
            read_decay = tl.exp(bm)
        else:
            read_decay = tl.exp(bb)
        s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, chunk_decay, qp, pos, m_t, read_decay[:, None] * d_base_read,
                                       H, K, BK, NK, DT)
        if DELTA or RESIDUAL:
            if DELTA:
                beta_t = token_gate(beta, tok, i_h, pos, m_t, H)
                through_keys = (beta_t * tl.exp(bb))[:, None] * dx
                if RESIDUAL:
                    through_keys += tl.exp(bm)[:, None] * d_err
            else:
                through_keys = tl.exp(bm)[:, None] * d_err
            s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, 1.0, kp, pos, m_t, -through_keys, H, K, BK, NK, DT)

    store_user_states(d_base0, d_res0, i_n, i_h, vc, m_v, s0, s1, s2, s3, r0, r1, r2, r3, H, K, V, BK, NK,
                      RESIDUAL)
