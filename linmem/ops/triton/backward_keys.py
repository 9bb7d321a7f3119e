"""Per-chunk gradients of the queries and keys, and the key-side parts of dβ, dγ and the decay gradient.

One program per (chunk, head, block of BK key columns) loops over value blocks. With ``S_0, R_0`` the states before
the chunk (forward passes) and ``dS, dR`` the gradients of the states after it (reverse passes), it accumulates
``[C, BK]`` products: ``ō S_0``, ``ō R_0``, ``Z S_0`` with ``Z = αβ∘dx + d_err`` (``dx`` without a residual memory,
``d_err`` for the additive rule), ``dy R_0`` (delta, residual) and ``u dS + w dR``. Then

- ``dQ = diag(e^e) ō S_0 + diag(γ e^b) ō R_0 + E_Q K`` (``e = bm`` for the base read without output gates, and no γ);
- ``dK = −diag(e^{bm}) Z S_0 − diag(γ e^b) dy R_0 + diag(e^{b_C − b})(u dS + w dR) + E_Qᵀ Q + (E_K + E_Kᵀ) K``
  (without a residual memory the first term is ``−diag(β e^b) dx S_0``), since ``β e^b dx + e^{bm} d_err =
  e^{bm} Z``;
- each state term's decay adds the row-wise dot of its own rows with the query or key rows to the gradient of its
  exponent (+ for a row decay ``e^{b_t}`` or ``e^{bm_t}``, − for ``e^{−b_s}``); the chunk end ``b_C`` also gets
  ``e^{b_C}(⟨S_0, dS⟩ + ⟨R_0, dR⟩)``;
- ``dγ += e^b q·(ō R_0) − e^b k·(dy R_0)``; ``dβ −= e^b k·(dx S_0)`` without a residual memory (with one,
  backward_scores.py has dβ whole).

The per-token sums are partial (one slot per key block); decay_grad.py adds them up.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    at_token,
    chunk_at,
    given,
    key_block,
    load_block,
    load_decays,
    mm,
    mm_acc,
    rho,
    state_at,
    store_token_gate,
    store_token_rows,
    token_gate,
    token_rows,
    token_scores,
)


@triton.jit
def _gated_term(acc, exponent, gate, keys):
    """A term ``diag(gate ∘ e^exponent) acc`` of dK: the term, its row-wise dots with the key rows without the gate
    (the gate's gradient) and with it (the exponent's)."""
    term = tl.exp(exponent)[:, None] * acc
    dots = tl.sum(keys * term, 1)
    return gate[:, None] * term, dots, gate * dots


@triton.heuristics(given(QUERIES="dq", KEYS="dk"))
@triton.jit
def backward_keys_kernel(
    q, k, v, do, b, g, beta, gamma, e_q, e_k, u_in, w_in, err_in, dx_in, dy_in, derr_in,
    base_chunks, res_chunks, d_base_chunks, d_res_chunks, dq, dk,
    db_part, dbm_part, dbeta_part, dgamma_part, db_end_part, part_stride, first_slot,
    cu_seqlens, chunk_indices, scale, clip, n_chunks_total,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, DELTA: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
    TARGET: tl.constexpr, QUERIES: tl.constexpr, KEYS: tl.constexpr,
):
    """dq (where ``dq`` is given) and dk (where ``dk`` is) of one chunk, head and key block, with their partial gate
    sums in slot ``first_slot + program_id(2)``; the launch option SPLIT runs the two as separate launches (two and
    three accumulators instead of five), the default as one. The tensors of a memory or rule the call does not have
    are None: ``u_in`` without DELTA, ``v`` with it; ``gamma``, ``w_in``, ``dy_in``, ``derr_in``, ``res_chunks``
    and ``d_res_chunks`` without RESIDUAL; ``err_in`` but with RESIDUAL and the additive rule; ``dx_in`` but with
    DELTA."""
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    base_chunks = state_at(base_chunks, i_c, i_h, H, K * V)
    d_base_chunks = state_at(d_base_chunks, i_c, i_h, H, K * V)
    if RESIDUAL:
        res_chunks = state_at(res_chunks, i_c, i_h, H, K * V)
        d_res_chunks = state_at(d_res_chunks, i_c, i_h, H, K * V)
    pos = tl.arange(0, C)
    m_t = pos < n_valid
    bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
    beta_t = token_gate(beta, tok, i_h, pos, m_t, H)
    if RESIDUAL:
        gamma_t = token_gate(gamma, tok, i_h, pos, m_t, H)
    kc = i_k * BK + tl.arange(0, BK)
    m_k = kc < K

    if RESIDUAL or DELTA:
        alpha_beta = tl.exp(bb - bm) * beta_t
    q_base = tl.zeros([C, BK], dtype=tl.float32)  # ō S_0
    q_res = tl.zeros([C, BK], dtype=tl.float32)  # ō R_0
    k_base = tl.zeros([C, BK], dtype=tl.float32)  # (αβ∘dx + d_err) S_0 with a residual memory, dx S_0 without
    k_res = tl.zeros([C, BK], dtype=tl.float32)  # dy R_0
    k_end = tl.zeros([C, BK], dtype=tl.float32)  # u dS + w dR
    state_dot = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m_v = vc < V
        # chunk states are [K, V]: the [BV, BK] tile has value stride 1, key stride V
        s0 = load_block(base_chunks, vc, m_v, 1, kc, m_k, V)
        if RESIDUAL:
            r0 = load_block(res_chunks, vc, m_v, 1, kc, m_k, V)
        if QUERIES:
            d_base_read = scale * token_rows(do, tok, i_h, pos, m_t, vc, m_v, H, V)
            q_base = mm_acc(q_base, d_base_read, s0, DT)
            if RESIDUAL:
                q_res = mm_acc(q_res, d_base_read, r0, DT)
        if KEYS:
            ds = load_block(d_base_chunks, vc, m_v, 1, kc, m_k, V)
            if DELTA:
                u = token_rows(u_in, tok, i_h, pos, m_t, vc, m_v, H, V)
            else:
                u = beta_t[:, None] * token_rows(v, tok, i_h, pos, m_t, vc, m_v, H, V)
            k_end = mm_acc(k_end, u, ds, DT)
            state_dot += tl.sum(s0.to(tl.float32) * ds.to(tl.float32), 0)
            if RESIDUAL:
                dr = load_block(d_res_chunks, vc, m_v, 1, kc, m_k, V)
                d_err = token_rows(derr_in, tok, i_h, pos, m_t, vc, m_v, H, V)
                if DELTA:
                    w = token_rows(w_in, tok, i_h, pos, m_t, vc, m_v, H, V)
                    dx = token_rows(dx_in, tok, i_h, pos, m_t, vc, m_v, H, V)
                    k_base = mm_acc(k_base, alpha_beta[:, None] * dx + d_err, s0, DT)
                    k_res = mm_acc(k_res, token_rows(dy_in, tok, i_h, pos, m_t, vc, m_v, H, V), r0, DT)
                else:
                    err = token_rows(err_in, tok, i_h, pos, m_t, vc, m_v, H, V)
                    w = gamma_t[:, None] * rho(err, clip, TARGET)
                    k_base = mm_acc(k_base, d_err, s0, DT)
                k_end = mm_acc(k_end, w, dr, DT)
                state_dot += tl.sum(r0.to(tl.float32) * dr.to(tl.float32), 0)
            elif DELTA:
                k_base = mm_acc(k_base, token_rows(dx_in, tok, i_h, pos, m_t, vc, m_v, H, V), s0, DT)

    # queries first (their accumulators die before the key terms are formed), then keys
    qb = key_block(at_token(q, tok, i_h, H, K), pos, m_t, H, K, BK, i_k)
    kb = key_block(at_token(k, tok, i_h, H, K), pos, m_t, H, K, BK, i_k)
    eq = token_scores(e_q, tok, i_h, pos, m_t, H, C)
    exp_b = tl.exp(bb)[:, None]
    d_b = tl.zeros([C], dtype=tl.float32)
    d_bm = tl.zeros([C], dtype=tl.float32)
    d_beta = tl.zeros([C], dtype=tl.float32)
    d_gamma = tl.zeros([C], dtype=tl.float32)
    if QUERIES:
        if RESIDUAL and not OUTPUT_GATES:
            dq_total = tl.exp(bm)[:, None] * q_base
            d_bm += tl.sum(qb.to(tl.float32) * dq_total, 1)
        else:
            dq_total = exp_b * q_base
            d_b += tl.sum(qb.to(tl.float32) * dq_total, 1)
        if RESIDUAL:
            res_term = exp_b * q_res
            res_dots = tl.sum(qb.to(tl.float32) * res_term, 1)
            if OUTPUT_GATES:
                d_gamma += res_dots
                d_b += gamma_t * res_dots
                dq_total += gamma_t[:, None] * res_term
            else:
                d_b += res_dots
                dq_total += res_term
        dq_total = mm_acc(dq_total, eq, kb, DT)
        store_token_rows(dq, dq_total, tok, i_h, pos, m_t, kc, m_k, H, K)

    if KEYS:
        ek = token_scores(e_k, tok, i_h, pos, m_t, H, C).to(tl.float32)
        dk_total = mm(tl.trans(eq), qb, DT)
        dk_total = mm_acc(dk_total, ek + tl.trans(ek), kb, DT)
        kf = kb.to(tl.float32)
        end_term = tl.exp(b_last - bb)[:, None] * k_end
        dk_total += end_term
        # the chunk's last key reaches the chunk end undecayed (e^0): it adds nothing to db, so leave it out of both
        # sides
        end_dots = tl.where(pos == n_valid - 1, 0.0, tl.sum(kf * end_term, 1))
        d_b -= end_dots
        d_end = tl.sum(end_dots, 0) + tl.exp(b_last) * tl.sum(state_dot, 0)
        if RESIDUAL:
            # all of it decays with e^{bm} = e^b / α; its β terms' share of dg_t alone is backward_scores.py's
            # ``direct``
            base_term = tl.exp(bm)[:, None] * k_base
            d_bm -= tl.sum(kf * base_term, 1)
            dk_total -= base_term
            if DELTA:
                term, dots, gated_dots = _gated_term(k_res, bb, gamma_t, kf)
                d_gamma -= dots
                d_b -= gated_dots
                dk_total -= term
        elif DELTA:
            term, dots, gated_dots = _gated_term(k_base, bb, beta_t, kf)
            d_beta -= dots
            d_b -= gated_dots
            dk_total -= term
        store_token_rows(dk, dk_total, tok, i_h, pos, m_t, kc, m_k, H, K)
        tl.store(db_end_part + (i_k.to(tl.int64) * n_chunks_total + i_c) * H + i_h, d_end)
    slot = (first_slot + i_k).to(tl.int64) * part_stride
    store_token_gate(db_part + slot, d_b, tok, i_h, pos, m_t, H)
    store_token_gate(dbm_part + slot, d_bm, tok, i_h, pos, m_t, H)
    store_token_gate(dbeta_part + slot, d_beta, tok, i_h, pos, m_t, H)
    if RESIDUAL:
        store_token_gate(dgamma_part + slot, d_gamma, tok, i_h, pos, m_t, H)
