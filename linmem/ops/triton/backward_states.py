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

Two memories in one pass, and dx's in-chunk part precomputed chunk-parallel before the pass, are both slower on an
H200: the pass is bound by the latency of each chunk's dependent steps, not by its products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import (
    at_token,
    chunk_of_sequence,
    given,
    load_blocks,
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
    token_gate,
    token_rows,
    token_scores,
    update_blocks,
    update_loaded_blocks,
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


@triton.heuristics(given(ERR_IN="d_err_in", ERR_OUT="d_err_out", HAS_FINAL="d_final", STORE_INITIAL="d_initial"))
@triton.jit
def reverse_pass_kernel(
    q, k, do, b, g, strength, gamma, key_scores, scores, inverse, err, d_err_in, d_final, d_initial, d_chunks,
    dx_out, d_err_out, cu_seqlens, chunk_offsets, scale, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, READ_BM: tl.constexpr, GATED: tl.constexpr,
    TARGET: tl.constexpr, ERR_IN: tl.constexpr, ERR_OUT: tl.constexpr, HAS_FINAL: tl.constexpr,
    STORE_INITIAL: tl.constexpr, KEYS_ONCE: tl.constexpr,
):
    """One memory's reverse pass (module docstring). ``d_err_in`` (with ``key_scores``) for the base memory of
    RLA/RDN, ``d_err_out`` (with ``err``) for the residual memory, ``gamma`` only with GATED, ``inverse`` only with
    DELTA; from ``d_final``, or zeros where it is None; the initial state's gradient into ``d_initial`` where
    given. KEYS_ONCE loads the chunk's key blocks once for the read ``K dSᵀ`` and the update ``Kᵀ(…)``
    (``load_key_blocks``): the same products, one shared-memory tile per key block in a pipelined loop instead of
    two, so that two stages fit at K = 256; at one stage the blocks stay live in registers between the two."""
    i_n, i_h, bos, length, c0, vc, m_v = sequential_program(cu_seqlens, chunk_offsets, H, V, BV)
    n_chunks = tl.cdiv(length, C)
    pos = tl.arange(0, C)

    # user states are [N, H, V, K] (key stride 1, value stride K); chunk states [NT, H, K, V]
    if HAS_FINAL:
        s0, s1, s2, s3 = load_blocks(state_at(d_final, i_n, i_h, H, V * K), vc, m_v, 1, K, K, BK, NK)
    else:
        s0 = tl.zeros([BK, BV], dtype=tl.float32)
        s1, s2, s3 = s0, s0, s0
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
        if KEYS_ONCE:
            k0, k1, k2, k3 = load_key_blocks(kp, pos, m_t, H, K, BK, NK)
            keys_read = read_loaded_blocks(k0, k1, k2, k3, s0, s1, s2, s3, NK, DT)
        else:
            keys_read = read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
        dx = _input_grad(to_end * keys_read, scores, d_read, key_scores, d_err, inverse, tok, i_h, pos, m_t, H, C,
                         DT, DELTA, ERR_IN)
        store_token_rows(dx_out, dx, tok, i_h, pos, m_t, vc, m_v, H, V)
        if DELTA or ERR_OUT:
            sigma = token_gate(strength, tok, i_h, pos, m_t, H)
        if ERR_OUT:
            err_grad = rho_grad(token_rows(err, tok, i_h, pos, m_t, vc, m_v, H, V), clip, TARGET)
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
            if KEYS_ONCE:
                s0, s1, s2, s3 = update_loaded_blocks(s0, s1, s2, s3, 1.0, k0, k1, k2, k3, -through_keys, NK, DT)
            else:
                s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, 1.0, kp, pos, m_t, -through_keys, H, K, BK, NK, DT)
    if STORE_INITIAL:
        store_blocks(state_at(d_initial, i_n, i_h, H, V * K), s0, s1, s2, s3, vc, m_v, 1, K, K, BK, NK)
