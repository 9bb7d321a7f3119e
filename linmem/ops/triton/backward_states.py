"""The reverse passes over chunks: the gradient of one memory's state, carried backwards like the state was carried
forwards.

``reverse_pass_kernel``: one program per (sequence, head, block of BV value columns), chunks in reverse order,
holding ``dSᵀ`` as key blocks ``[BK, BV]`` (float32): the gradient of the state at the end of the chunk. For a memory
with write strength σ, read-out gradient ``ō`` (``scale·dO``, times γ for the gated residual read) read with decay
``e^e`` and score matrix P, and ``K̃ = diag(e^{b_C − b}) K``:

- gradient of the writes ``du = K̃ dSᵀ + Pᵀ ō`` (− ``A'ᵀ d_err`` with ERR_IN: the base memory of RLA/RDN, whose
  writes also enter the prediction error);
- ``dx = T_σᵀ du`` (delta; du for the additive rule): the gradient of the write's input ``σ ∘ (X − e^b K S_0ᵀ)``;
- (ERR_OUT, the residual memory, whose values are ``ρ(err)``) ``d_err = ρ'(err) ∘ σ ∘ dx``;
- state before the chunk: ``dSᵀ ← e^{b_C} dSᵀ + Qᵀ diag(e^e) ō − Kᵀ([delta] diag(σ e^b) dx + [ERR_IN]
  diag(e^{bm}) d_err)``.

RLA/RDN run it twice, the residual memory first (it emits d_err), then the base memory (it takes d_err): neither pass
holds both states; ``both_reverse_pass_kernel`` (launch option FUSED) runs both in one, chunk by chunk. Each
stores dS at the end of every chunk (for backward_keys.py) and dx (dy for the residual memory) per token; every
other gradient is chunk-parallel (backward_scores.py, backward_keys.py, decay_grad.py).

Only the read ``K̃ dSᵀ`` of dx depends on dS. With the launch option LOCAL, ``local_inputs_kernel`` (one program per
chunk and head, before each memory's pass) computes the rest chunk-parallel, ``dx_local = T_σᵀ(Pᵀ ō − A'ᵀ d_err)``,
and for the delta rule the read's keys ``W̃ = T_σᵀ K̃``; the pass then takes ``dx = W̃ dSᵀ + dx_local`` (``K̃ dSᵀ +
dx_local`` for the additive rule): per chunk one read and the two state-update products, without the three
``[C, C] × [C, BV]`` products and their ``[C, C]`` tile loads (the split of flash-linear-attention's delta-rule
backward).
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    at_token,
    chunk_at,
    chunk_of_sequence,
    key_block,
    load_blocks,
    load_decays,
    mm,
    read_blocks,
    residual_target_grad,
    sequential_program,
    state_at,
    store_blocks,
    store_rows,
    store_token_rows,
    token_gate,
    token_rows,
    token_scores,
    update_blocks,
)


@triton.jit
def _input_grad(kp, to_end, s0, s1, s2, s3, scores, d_read, key_scores, d_err, inverse, tok, i_h, pos, m_t,
                H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
                DT: tl.constexpr, DELTA: tl.constexpr, ERR_IN: tl.constexpr):
    """dx ([C, BV]), the gradient of one memory's write input in a chunk: ``du = diag(e^{b_C − b}) K dSᵀ + Pᵀ ō``
    (− ``A'ᵀ d_err`` with ERR_IN; ``d_err`` is unused without it), then ``T_σᵀ du`` (delta) or du."""
    du = to_end * read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
    du += mm(tl.trans(token_scores(scores, tok, i_h, pos, m_t, H, C)), d_read, DT)
    if ERR_IN:
        du -= mm(tl.trans(token_scores(key_scores, tok, i_h, pos, m_t, H, C)), d_err, DT)
    dx = du
    if DELTA:
        dx = mm(tl.trans(token_scores(inverse, tok, i_h, pos, m_t, H, C)), du, DT)
    return dx


@triton.jit
def local_inputs_kernel(
    k, do, b, g, gamma, key_scores, scores, inverse, d_err_in, keys_out, dx_out, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, GATED: tl.constexpr, ERR_IN: tl.constexpr,
):
    """The parts of one memory's reverse pass that do not depend on its state gradient, for chunk ``program_id(0)``
    and head ``program_id(1)`` (launch option LOCAL): ``dx_local = T_σᵀ(Pᵀ ō − A'ᵀ d_err)`` ([C, V]; without
    ``T_σᵀ`` for the additive rule; the A' term with ERR_IN) and, for the delta rule, the read's keys ``W̃ = T_σᵀ
    diag(e^{b_C − b}) K`` ([C, K])."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    pos = tl.arange(0, C)
    m_t = pos < n_valid
    scores_t = tl.trans(token_scores(scores, tok, i_h, pos, m_t, H, C))
    if DELTA:
        inverse_t = tl.trans(token_scores(inverse, tok, i_h, pos, m_t, H, C))
        bb, _, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
        to_end = tl.exp(b_last - bb)[:, None]
        kp = at_token(k, tok, i_h, H, K)
        keys_at = at_token(keys_out, tok, i_h, H, K)
        for i in tl.static_range(NK):
            cols = i * BK + tl.arange(0, BK)
            keys = mm(inverse_t, to_end * key_block(kp, pos, m_t, H, K, BK, i).to(tl.float32), DT)
            store_rows(keys_at, keys, pos, m_t, H, K, cols, cols < K)
    if ERR_IN:
        key_scores_t = tl.trans(token_scores(key_scores, tok, i_h, pos, m_t, H, C))
    read_scale = tl.full([C], scale, tl.float32)
    if GATED:
        read_scale *= token_gate(gamma, tok, i_h, pos, m_t, H)
    for i_v in range(tl.cdiv(V, BV)):
        vc = i_v * BV + tl.arange(0, BV)
        m_v = vc < V
        du = mm(scores_t, read_scale[:, None] * token_rows(do, tok, i_h, pos, m_t, vc, m_v, H, V), DT)
        if ERR_IN:
            du -= mm(key_scores_t, token_rows(d_err_in, tok, i_h, pos, m_t, vc, m_v, H, V), DT)
        if DELTA:
            du = mm(inverse_t, du, DT)
        store_token_rows(dx_out, du, tok, i_h, pos, m_t, vc, m_v, H, V)


@triton.jit
def reverse_pass_kernel(
    q, k, do, b, g, strength, gamma, key_scores, scores, inverse, err, d_err_in, local_keys, dx_local,
    d_final, d_initial, d_chunks, dx_out, d_err_out, cu_seqlens, chunk_offsets, scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, READ_BM: tl.constexpr, GATED: tl.constexpr,
    ERR_IN: tl.constexpr, ERR_OUT: tl.constexpr, TARGET: tl.constexpr, LOCAL: tl.constexpr,
):
    """One memory's reverse pass (module docstring); with LOCAL it reads ``dx_local`` and (delta) the keys ``W̃``
    from ``local_inputs_kernel`` instead of forming dx from the score matrices."""
    i_n, i_h, bos, length, c0, vc, m_v = sequential_program(cu_seqlens, chunk_offsets, H, V, BV)
    n_chunks = tl.cdiv(length, C)
    pos = tl.arange(0, C)

    # user states are [N, H, V, K] (key stride 1, value stride K); chunk states [NT, H, K, V]
    s0, s1, s2, s3 = load_blocks(state_at(d_final, i_n, i_h, H, V * K), vc, m_v, 1, K, K, BK, NK)
    for jj in range(n_chunks):
        j = n_chunks - 1 - jj
        tok, n_valid = chunk_of_sequence(bos, length, j, C)
        m_t = pos < n_valid
        store_blocks(state_at(d_chunks, c0 + j, i_h, H, K * V), s0, s1, s2, s3, vc, m_v, V, 1, K, BK, NK)
        bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
        kp = at_token(k, tok, i_h, H, K)
        d_read = scale * token_rows(do, tok, i_h, pos, m_t, vc, m_v, H, V)
        if GATED:
            d_read = token_gate(gamma, tok, i_h, pos, m_t, H)[:, None] * d_read

        d_err = d_read  # unused without ERR_IN
        if ERR_IN:
            d_err = token_rows(d_err_in, tok, i_h, pos, m_t, vc, m_v, H, V)
        to_end = tl.exp(b_last - bb)[:, None]
        if LOCAL:
            dx = token_rows(dx_local, tok, i_h, pos, m_t, vc, m_v, H, V)
            if DELTA:
                dx += read_blocks(at_token(local_keys, tok, i_h, H, K), pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
            else:
                dx += to_end * read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
        else:
            dx = _input_grad(kp, to_end, s0, s1, s2, s3, scores, d_read, key_scores, d_err, inverse, tok, i_h, pos,
                             m_t, H, K, C, BK, NK, DT, DELTA, ERR_IN)
        store_token_rows(dx_out, dx, tok, i_h, pos, m_t, vc, m_v, H, V)
        if DELTA or ERR_OUT:
            sigma = token_gate(strength, tok, i_h, pos, m_t, H)
        if ERR_OUT:
            err_grad = residual_target_grad(token_rows(err, tok, i_h, pos, m_t, vc, m_v, H, V), clip, TARGET)
            store_token_rows(d_err_out, err_grad * sigma[:, None] * dx, tok, i_h, pos, m_t, vc, m_v, H, V)

        if READ_BM:
            read_decay = tl.exp(bm)
        else:
            read_decay = tl.exp(bb)
        s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, tl.exp(b_last), at_token(q, tok, i_h, H, K), pos, m_t,
                                       read_decay[:, None] * d_read, H, K, BK, NK, DT)
        if DELTA or ERR_IN:
            if DELTA:
                through_keys = (sigma * tl.exp(bb))[:, None] * dx
                if ERR_IN:
                    through_keys += tl.exp(bm)[:, None] * d_err
            else:
                through_keys = tl.exp(bm)[:, None] * d_err
            s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, 1.0, kp, pos, m_t, -through_keys, H, K, BK, NK, DT)
    store_blocks(state_at(d_initial, i_n, i_h, H, V * K), s0, s1, s2, s3, vc, m_v, 1, K, K, BK, NK)


@triton.jit
def both_reverse_pass_kernel(
    q, k, do, b, g, beta, gamma, key_scores, base_scores, res_scores, inv_beta, inv_gamma, err,
    d_base_final, d_res_final, d_base0, d_res0, d_base_chunks, d_res_chunks, dx_out, dy_out, d_err_out,
    cu_seqlens, chunk_offsets, scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, GATED: tl.constexpr, TARGET: tl.constexpr,
):
    """Both reverse passes of RLA/RDN in one (the ``FUSED`` launch option): per chunk the residual memory's part
    first (dR, dy, d_err), then the base memory's, which takes this chunk's d_err from registers. The products are
    those of the two ``reverse_pass_kernel`` launches (the residual one with ERR_OUT, the base one with ERR_IN)."""
    i_n, i_h, bos, length, c0, vc, m_v = sequential_program(cu_seqlens, chunk_offsets, H, V, BV)
    n_chunks = tl.cdiv(length, C)
    pos = tl.arange(0, C)

    s0, s1, s2, s3 = load_blocks(state_at(d_base_final, i_n, i_h, H, V * K), vc, m_v, 1, K, K, BK, NK)
    r0, r1, r2, r3 = load_blocks(state_at(d_res_final, i_n, i_h, H, V * K), vc, m_v, 1, K, K, BK, NK)
    for jj in range(n_chunks):
        j = n_chunks - 1 - jj
        tok, n_valid = chunk_of_sequence(bos, length, j, C)
        m_t = pos < n_valid
        store_blocks(state_at(d_base_chunks, c0 + j, i_h, H, K * V), s0, s1, s2, s3, vc, m_v, V, 1, K, BK, NK)
        store_blocks(state_at(d_res_chunks, c0 + j, i_h, H, K * V), r0, r1, r2, r3, vc, m_v, V, 1, K, BK, NK)
        bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
        kp = at_token(k, tok, i_h, H, K)
        qp = at_token(q, tok, i_h, H, K)
        to_end = tl.exp(b_last - bb)[:, None]
        d_read = scale * token_rows(do, tok, i_h, pos, m_t, vc, m_v, H, V)
        gamma_t = token_gate(gamma, tok, i_h, pos, m_t, H)
        if GATED:
            d_res_read = gamma_t[:, None] * d_read
        else:
            d_res_read = d_read

        # the residual memory (values ρ(err), strength γ): dy, and d_err = ρ'(err) γ dy
        dy = _input_grad(kp, to_end, r0, r1, r2, r3, res_scores, d_res_read, key_scores, d_res_read, inv_gamma,
                         tok, i_h, pos, m_t, H, K, C, BK, NK, DT, DELTA, False)
        store_token_rows(dy_out, dy, tok, i_h, pos, m_t, vc, m_v, H, V)
        err_grad = residual_target_grad(token_rows(err, tok, i_h, pos, m_t, vc, m_v, H, V), clip, TARGET)
        d_err = err_grad * gamma_t[:, None] * dy
        store_token_rows(d_err_out, d_err, tok, i_h, pos, m_t, vc, m_v, H, V)

        # the base memory (values v, strength β), whose writes also enter the prediction error
        dx = _input_grad(kp, to_end, s0, s1, s2, s3, base_scores, d_read, key_scores, d_err, inv_beta,
                         tok, i_h, pos, m_t, H, K, C, BK, NK, DT, DELTA, True)
        store_token_rows(dx_out, dx, tok, i_h, pos, m_t, vc, m_v, H, V)

        decay_end = tl.exp(b_last)
        exp_b = tl.exp(bb)[:, None]
        r0, r1, r2, r3 = update_blocks(r0, r1, r2, r3, decay_end, qp, pos, m_t, exp_b * d_res_read,
                                       H, K, BK, NK, DT)
        if GATED:
            base_read_decay = exp_b
        else:
            base_read_decay = tl.exp(bm)[:, None]
        s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, decay_end, qp, pos, m_t, base_read_decay * d_read,
                                       H, K, BK, NK, DT)
        through_keys = tl.exp(bm)[:, None] * d_err
        if DELTA:
            r0, r1, r2, r3 = update_blocks(r0, r1, r2, r3, 1.0, kp, pos, m_t, -(gamma_t[:, None] * exp_b * dy),
                                           H, K, BK, NK, DT)
            through_keys += token_gate(beta, tok, i_h, pos, m_t, H)[:, None] * exp_b * dx
        s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, 1.0, kp, pos, m_t, -through_keys, H, K, BK, NK, DT)
    store_blocks(state_at(d_base0, i_n, i_h, H, V * K), s0, s1, s2, s3, vc, m_v, 1, K, K, BK, NK)
    store_blocks(state_at(d_res0, i_n, i_h, H, V * K), r0, r1, r2, r3, vc, m_v, 1, K, K, BK, NK)
