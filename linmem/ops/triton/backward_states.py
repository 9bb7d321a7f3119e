"""The reverse passes over chunks: the gradient of one memory's state, carried backwards like the state was carried
forwards.

``reverse_pass_kernel``: one program per (sequence, head, block of BV value columns), chunks in reverse order,
holding ``dSᵀ`` as key blocks ``[BK, BV]`` (float32): the gradient of the state at the end of the chunk. The blocks
are those of the other sequential passes (up to four of 64 keys), or with the launch option ONE_KEY_BLOCK
(function.py) one of all K keys, so that each product below is one dot per chunk. For a memory
with write strength σ, read-out gradient ``ō`` (``scale·dO``, times γ for the gated residual read) read with decay
``e^e`` and score matrix P, and ``K̃ = diag(e^{b_C − b}) K``:

- gradient of the writes ``du = K̃ dSᵀ + Pᵀ ō`` (− ``A'ᵀ d_err`` with ERR_IN: the base memory of RLA/RDN, whose
  writes also enter the prediction error);
- ``dx = T_σᵀ du`` (delta; du for the additive rule): the gradient of the write's input ``σ ∘ (X − e^b K S_0ᵀ)``;
- (ERR_OUT, the residual memory, whose values are ``ρ(err)``) ``d_err = ρ'(err) ∘ σ ∘ dx``;
- state before the chunk: ``dSᵀ ← e^{b_C} dSᵀ + Qᵀ diag(e^e) ō − Kᵀ([delta] diag(σ e^b) dx + [ERR_IN]
  diag(e^{bm}) d_err)``.

RLA/RDN run it twice, the residual memory first (it emits d_err), then the base memory (it takes d_err): neither pass
holds both states. Each stores dS at the end of every chunk (for backward_keys.py) and dx (dy for the residual
memory) per token; every other gradient is chunk-parallel (backward_scores.py, backward_keys.py, decay_grad.py).

dx's in-chunk part precomputed chunk-parallel before the pass is slower on an H200: the pass is bound by the latency
of each chunk's dependent steps, not by its products. ``both_reverse_passes_kernel`` (the launch option FUSED) runs
both memories in one program with the base memory a chunk behind, so that the two chains do not wait on each other
within a step; it holds both states and two chunks' tiles, and at K = V = 256 on an H100 it was slower than the two
launches (docs/benchmarks/kernel-widths.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    at_token,
    chunk_of_sequence,
    given,
    load_decays,
    load_key_blocks,
    mm,
    read_blocks,
    read_loaded_blocks,
    rho_grad,
    sequential_program,
    state_at,
    store_blocks,
    store_token_rows,
    stored,
    token_gate,
    token_rows,
    token_scores,
    update_blocks,
    update_loaded_blocks,
    user_state_blocks,
    value_block_program,
)


@triton.jit
def _input_grad(keys_read, scores, d_read, key_scores, d_err, inverse, tok, i_h, pos, m_t, H: tl.constexpr,
                C: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, ERR_IN: tl.constexpr):
    """dx ([C, BV]), the gradient of one memory's write input in a chunk, from ``keys_read = diag(e^{b_C − b}) K
    dSᵀ``: ``du = keys_read + Pᵀ ō`` (− ``A'ᵀ d_err`` with ERR_IN; ``d_err`` is unused without it), then ``T_σᵀ du``
    (delta) or du."""
    du = keys_read + mm(tl.trans(token_scores(scores, tok, i_h, pos, m_t, H, C)), d_read, DT)
    if ERR_IN:
        du -= mm(tl.trans(token_scores(key_scores, tok, i_h, pos, m_t, H, C)), d_err, DT)
    dx = du
    if DELTA:
        dx = mm(tl.trans(token_scores(inverse, tok, i_h, pos, m_t, H, C)), du, DT)
    return dx


@triton.jit
def _reverse_chunk(s0, s1, s2, s3, j, d_err, q, k, do, b, g, strength, gamma, key_scores, scores, inverse, err,
                   write_keys, d_chunks, dx_out, d_err_out, bos, length, c0, i_h, vc, m_v, scale, clip,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   NK: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, READ_BM: tl.constexpr,
                   GATED: tl.constexpr, TARGET: tl.constexpr, ERR_IN: tl.constexpr, ERR_OUT: tl.constexpr,
                   KEYS_ONCE: tl.constexpr, PREFORMED: tl.constexpr):
    """One memory's reverse step over chunk ``j`` (module docstring), from ``dSᵀ`` at the chunk's end (the key
    blocks ``s0..s3``) to ``dSᵀ`` at its start, which it returns with the chunk's d_err ``[C, BV]`` (ERR_OUT: as
    stored in ``d_err_out``, 0 outside the chunk's rows and the value columns; else zeros). ``d_err`` (ERR_IN): the
    prediction error's gradient in this chunk, ``[C, BV]`` float32. PREFORMED (delta rule, ``write_keys`` the
    forward's ``W = T_σ diag(σ e^b) K``): stores du, not dx, into ``dx_out`` and takes ``Wᵀ du`` for ``Kᵀ diag(σ e^b)
    dx`` in the update; ``reverse_writes_kernel`` forms dx and d_err (ERR_OUT) after the pass."""
    pos = tl.arange(0, C)
    tok, n_valid = chunk_of_sequence(bos, length, j, C)
    m_t = pos < n_valid
    store_blocks(state_at(d_chunks, c0 + j, i_h, H, K * V), s0, s1, s2, s3, vc, m_v, V, 1, K, BK, NK)
    bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
    kp = at_token(k, tok, i_h, H, K)
    d_read = scale * token_rows(do, tok, i_h, pos, m_t, vc, m_v, H, V)
    if GATED:
        d_read = token_gate(gamma, tok, i_h, pos, m_t, H)[:, None] * d_read
    to_end = tl.exp(b_last - bb)[:, None]
    if KEYS_ONCE:
        k0, k1, k2, k3 = load_key_blocks(kp, pos, m_t, H, K, BK, NK)
        keys_read = read_loaded_blocks(k0, k1, k2, k3, s0, s1, s2, s3, NK, DT)
    else:
        keys_read = read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
    # du alone (PREFORMED: T_σᵀ is taken after the pass), else dx
    dx = _input_grad(to_end * keys_read, scores, d_read, key_scores, d_err, inverse, tok, i_h, pos, m_t, H, C,
                     DT, DELTA and not PREFORMED, ERR_IN)
    store_token_rows(dx_out, dx, tok, i_h, pos, m_t, vc, m_v, H, V)
    if (DELTA and not PREFORMED) or ERR_OUT:
        sigma = token_gate(strength, tok, i_h, pos, m_t, H)
    d_err_emitted = tl.zeros_like(dx)
    if ERR_OUT:
        err_grad = rho_grad(token_rows(err, tok, i_h, pos, m_t, vc, m_v, H, V), clip, TARGET)
        d_err_emitted = err_grad * sigma[:, None] * dx
        store_token_rows(d_err_out, d_err_emitted, tok, i_h, pos, m_t, vc, m_v, H, V)
        # as the base memory's pass reads it back from d_err_out
        d_err_emitted = tl.where(m_t[:, None] & m_v[None, :],
                                 stored(d_err_emitted, d_err_out.dtype.element_ty).to(tl.float32), 0.0)

    if READ_BM:
        read_decay = tl.exp(bm)
    else:
        read_decay = tl.exp(bb)
    s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, tl.exp(b_last), at_token(q, tok, i_h, H, K), pos, m_t,
                                   read_decay[:, None] * d_read, H, K, BK, NK, DT)
    if PREFORMED:  # Kᵀ diag(σ e^b) T_σᵀ du = Wᵀ du
        s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, 1.0, at_token(write_keys, tok, i_h, H, K), pos, m_t, -dx, H,
                                       K, BK, NK, DT)
    if (DELTA and not PREFORMED) or ERR_IN:
        if DELTA and not PREFORMED:
            through_keys = (sigma * tl.exp(bb))[:, None] * dx
            if ERR_IN:
                through_keys += tl.exp(bm)[:, None] * d_err
        else:
            through_keys = tl.exp(bm)[:, None] * d_err
        if KEYS_ONCE:
            s0, s1, s2, s3 = update_loaded_blocks(s0, s1, s2, s3, 1.0, k0, k1, k2, k3, -through_keys, NK, DT)
        else:
            s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, 1.0, kp, pos, m_t, -through_keys, H, K, BK, NK, DT)
    return s0, s1, s2, s3, d_err_emitted


@triton.heuristics(given(ERR_IN="d_err_in", ERR_OUT="d_err_out", HAS_FINAL="d_final", STORE_INITIAL="d_initial",
                         PREFORMED="write_keys"))
@triton.jit
def reverse_pass_kernel(
    q, k, do, b, g, strength, gamma, key_scores, scores, inverse, err, write_keys, d_err_in, d_final, d_initial,
    d_chunks, dx_out, d_err_out, cu_seqlens, chunk_offsets, scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, READ_BM: tl.constexpr, GATED: tl.constexpr,
    TARGET: tl.constexpr, ERR_IN: tl.constexpr, ERR_OUT: tl.constexpr, HAS_FINAL: tl.constexpr,
    STORE_INITIAL: tl.constexpr, KEYS_ONCE: tl.constexpr, PREFORMED: tl.constexpr,
):
    """One memory's reverse pass (module docstring). ``d_err_in`` (with ``key_scores``) for the base memory of
    RLA/RDN, ``d_err_out`` (with ``err``) for the residual memory, ``gamma`` only with GATED, ``inverse`` only with
    DELTA; from ``d_final``, or zeros where it is None; the initial state's gradient into ``d_initial`` where
    given. With ``write_keys`` (PREFORMED, delta rule) the chain is the read, ``du`` and the update ``Wᵀ du``;
    ``d_err_out`` is then left to ``reverse_writes_kernel``. KEYS_ONCE loads the chunk's key blocks once for the read
    ``K dSᵀ`` and the update ``Kᵀ(…)``
    (``load_key_blocks``): the same products, one shared-memory tile per key block in a pipelined loop instead of
    two, so that two stages fit at K = 256; at one stage the blocks stay live in registers between the two."""
    i_n, i_h, bos, length, c0, vc, m_v = sequential_program(cu_seqlens, chunk_offsets, H, V, BV)
    n_chunks = tl.cdiv(length, C)
    pos = tl.arange(0, C)
    s0, s1, s2, s3 = user_state_blocks(d_final, i_n, i_h, vc, m_v, H, K, V, BK, NK, BV, HAS_FINAL)
    for jj in range(n_chunks):
        j = n_chunks - 1 - jj
        d_err = tl.zeros([C, BV], dtype=tl.float32)  # unused without ERR_IN
        if ERR_IN:
            tok, n_valid = chunk_of_sequence(bos, length, j, C)
            d_err = token_rows(d_err_in, tok, i_h, pos, pos < n_valid, vc, m_v, H, V)
        s0, s1, s2, s3, _ = _reverse_chunk(
            s0, s1, s2, s3, j, d_err, q, k, do, b, g, strength, gamma, key_scores, scores, inverse, err, write_keys,
            d_chunks, dx_out, d_err_out, bos, length, c0, i_h, vc, m_v, scale, clip, H, K, V, C, BK, NK, DT, DELTA,
            READ_BM, GATED, TARGET, ERR_IN, ERR_OUT, KEYS_ONCE, PREFORMED)
    if STORE_INITIAL:
        store_blocks(state_at(d_initial, i_n, i_h, H, V * K), s0, s1, s2, s3, vc, m_v, 1, K, K, BK, NK)


@triton.heuristics(given(HAS_BASE_FINAL="d_base_final", HAS_RES_FINAL="d_res_final", STORE_BASE_INITIAL="d_base0",
                         STORE_RES_INITIAL="d_res0"))
@triton.jit
def both_reverse_passes_kernel(
    q, k, do, b, g, beta, gamma, key_scores, base_scores, res_scores, inv_beta, inv_gamma, err, d_base_final,
    d_res_final, d_base0, d_res0, d_base_chunks, d_res_chunks, dx_out, dy_out, d_err_out, cu_seqlens, chunk_offsets,
    scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, READ_BM: tl.constexpr, GATED: tl.constexpr,
    TARGET: tl.constexpr, HAS_BASE_FINAL: tl.constexpr, HAS_RES_FINAL: tl.constexpr, STORE_BASE_INITIAL: tl.constexpr,
    STORE_RES_INITIAL: tl.constexpr, KEYS_ONCE: tl.constexpr,
):
    """Both reverse passes of RLA/RDN in one program per value block (the launch option FUSED of backward_states),
    skewed by one chunk: each step runs the residual memory's chunk ``j`` beside the base memory's chunk ``j + 1``,
    which takes the d_err its residual step emitted one step before, from registers. The two chains do not wait on
    each other within a step, where the two launches run each memory's chain alone; the price is both ``dSᵀ`` held at
    once. The same products in the same order as the two launches (``reverse_pass_kernel``, the residual memory then
    the base memory), stored in the same buffers: ``dy_out`` and ``d_err_out`` the residual memory's, ``dx_out`` the
    base memory's. READ_BM: the base memory's read-out decay is ``e^{bm}`` (without output gates); GATED: the
    residual memory's read-out is gated by γ."""
    i_n, i_h, bos, length, c0, vc, m_v = sequential_program(cu_seqlens, chunk_offsets, H, V, BV)
    n_chunks = tl.cdiv(length, C)
    s0, s1, s2, s3 = user_state_blocks(d_base_final, i_n, i_h, vc, m_v, H, K, V, BK, NK, BV, HAS_BASE_FINAL)
    r0, r1, r2, r3 = user_state_blocks(d_res_final, i_n, i_h, vc, m_v, H, K, V, BK, NK, BV, HAS_RES_FINAL)
    unused = tl.zeros([C, BV], dtype=tl.float32)  # the residual memory takes no d_err
    d_err = unused
    if n_chunks > 0:  # the residual memory's last chunk, before the skewed steps
        r0, r1, r2, r3, d_err = _reverse_chunk(
            r0, r1, r2, r3, n_chunks - 1, unused, q, k, do, b, g, gamma, gamma, None, res_scores, inv_gamma, err,
            None, d_res_chunks, dy_out, d_err_out, bos, length, c0, i_h, vc, m_v, scale, clip, H, K, V, C, BK, NK,
            DT, DELTA, False, GATED, TARGET, False, True, KEYS_ONCE, False)
    for jj in range(1, n_chunks):
        j = n_chunks - 1 - jj
        r0, r1, r2, r3, d_err_next = _reverse_chunk(
            r0, r1, r2, r3, j, unused, q, k, do, b, g, gamma, gamma, None, res_scores, inv_gamma, err, None,
            d_res_chunks, dy_out, d_err_out, bos, length, c0, i_h, vc, m_v, scale, clip, H, K, V, C, BK, NK, DT,
            DELTA, False, GATED, TARGET, False, True, KEYS_ONCE, False)
        s0, s1, s2, s3, _ = _reverse_chunk(
            s0, s1, s2, s3, j + 1, d_err, q, k, do, b, g, beta, gamma, key_scores, base_scores, inv_beta, None,
            None, d_base_chunks, dx_out, None, bos, length, c0, i_h, vc, m_v, scale, clip, H, K, V, C, BK, NK, DT,
            DELTA, READ_BM, False, TARGET, True, False, KEYS_ONCE, False)
        d_err = d_err_next
    if n_chunks > 0:  # the base memory's first chunk, after them
        s0, s1, s2, s3, _ = _reverse_chunk(
            s0, s1, s2, s3, 0, d_err, q, k, do, b, g, beta, gamma, key_scores, base_scores, inv_beta, None,
            None, d_base_chunks, dx_out, None, bos, length, c0, i_h, vc, m_v, scale, clip, H, K, V, C, BK, NK, DT,
            DELTA, READ_BM, False, TARGET, True, False, KEYS_ONCE, False)
    if STORE_BASE_INITIAL:
        store_blocks(state_at(d_base0, i_n, i_h, H, V * K), s0, s1, s2, s3, vc, m_v, 1, K, K, BK, NK)
    if STORE_RES_INITIAL:
        store_blocks(state_at(d_res0, i_n, i_h, H, V * K), r0, r1, r2, r3, vc, m_v, 1, K, K, BK, NK)


@triton.heuristics(given(ERR_OUT="d_err_out"))
@triton.jit
def reverse_writes_kernel(
    dx, strength, inverse, err, d_err_out, cu_seqlens, chunk_indices, clip,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, TARGET: tl.constexpr,
    ERR_OUT: tl.constexpr,
):
    """After a PREFORMED reverse pass, program ``(value block, chunk, head)``: ``dx = T_σᵀ du`` in place of the du
    the pass stored in ``dx`` (``[N_tok, H, V]``, storage type), and with ERR_OUT (the residual memory, whose values
    are ``ρ(err)``) the prediction error's gradient ``ρ'(err) ∘ σ ∘ dx`` into ``d_err_out``: what
    ``_reverse_chunk`` forms on its chain without PREFORMED, here in parallel over chunks."""
    _, i_h, tok, _, pos, m_t, vc, m_v = value_block_program(cu_seqlens, chunk_indices, C, V, BV)
    du = token_rows(dx, tok, i_h, pos, m_t, vc, m_v, H, V)
    grad = mm(tl.trans(token_scores(inverse, tok, i_h, pos, m_t, H, C)), du, DT)
    store_token_rows(dx, grad, tok, i_h, pos, m_t, vc, m_v, H, V)
    if ERR_OUT:
        sigma = token_gate(strength, tok, i_h, pos, m_t, H)
        err_grad = rho_grad(token_rows(err, tok, i_h, pos, m_t, vc, m_v, H, V), clip, TARGET)
        store_token_rows(d_err_out, err_grad * sigma[:, None] * grad, tok, i_h, pos, m_t, vc, m_v, H, V)
