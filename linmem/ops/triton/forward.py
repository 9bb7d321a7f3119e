"""The forward pass: sequential passes that only carry a state, then a chunk-parallel read-out.

``state_pass_kernel``: one program per (sequence, head, block of BV value columns) walks the chunks in order and
carries one memory's transposed state ``Sᵀ`` as key blocks ``[BK, BV]`` (float32). A memory with values X and write
strength σ, per chunk (``KS = K S_0ᵀ``, one product for the delta write and the prediction error):

- writes ``u = T_σ diag(σ)(X − diag(e^b) KS)`` (delta) or ``diag(σ) X`` (additive);
- (ERR_OUT) prediction error ``err_t = x_t − S_{t−1}k_t = X − diag(e^{bm}) KS − A' u``;
- hand-over ``Sᵀ ← e^{b_C} Sᵀ + Kᵀ diag(e^{b_C − b}) u``.

RLA/RDN run it twice: the base memory (X = V, σ = β, emitting err), then the residual memory (X = ρ(err), σ = γ):
the residual memory depends on the base one only through err, so neither pass holds both states (half the live
registers of one pass over both, which with the same products was slower on an H200 at K = 128).
``both_state_passes_kernel`` is that one pass over both, a launch option (the forward's FUSED) for the widths where
loading the key blocks once for both memories may pay. Everything that does not
depend on the state (b, the score rows A', P, the inverses T_β, T_γ) comes from the chunk-parallel kernels before
(scores.py, inverse.py). Each pass stores its state before every chunk (in the input type for half-precision
inputs: the dots read them in that type) and its writes (u, w; not the additive base memory's, ``β∘v``).

This is the WY/UT form with the state product taken first. The launch option PREFORMED takes the other order, as
FLA's chunked delta rule does: ``preformed_writes_kernel`` forms ``W = T_σ diag(σ e^b) K`` and ``ũ = T_σ diag(σ) X``
for every chunk in parallel before the pass, whose chain is then ``u = ũ − W S_0ᵀ`` and the update (no ``T_σ·``, no
error on it), and ``preformed_error_kernel`` takes the base memory's error from its stored states and writes after its
pass, with the residual memory's ``ũ``: the same products and four per-token tensors more to write and read, for a
chain of two dependent products instead of three, and at K = 256 a [256, 64] state in 8 warps without a spill
(offline sm_90).

``output_kernel``: one program per (block of value columns, chunk, head) reads the outputs from the stored states:
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
    given,
    key_block,
    load_block,
    load_decays,
    load_key_blocks,
    mm,
    mm_acc,
    publish_count,
    read_blocks,
    read_loaded_blocks,
    rho,
    sequential_program,
    sequential_program_at,
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
    wait_for_count,
)


@triton.jit
def _writes(values, ks, strength, inverse, bb, tok, i_h, pos, m_t, H: tl.constexpr, C: tl.constexpr,
            DT: tl.constexpr, DELTA: tl.constexpr):
    """A memory's writes in one chunk ([C, BV]): ``T_σ diag(σ)(X − diag(e^b) K S_0ᵀ)`` with the delta rule
    (``ks = K S_0ᵀ``, ``inverse`` T_σ), else ``diag(σ) X`` (``ks`` and ``inverse`` unused)."""
    sigma = token_gate(strength, tok, i_h, pos, m_t, H)
    if DELTA:
        return mm(token_scores(inverse, tok, i_h, pos, m_t, H, C), sigma[:, None] * (values - tl.exp(bb)[:, None] * ks),
                  DT)
    else:
        return sigma[:, None] * values


@triton.heuristics(given(FROM_ERR="err", ERR_OUT="err_out", STORE_WRITES="writes_out", HAS_STATE0="state0",
                         FROM_WRITES="writes_in", PREFORMED="write_keys"))
@triton.jit
def state_pass_kernel(
    k, x, b, g, strength, key_scores, inverse, err, state0, state_final, state_chunks, writes_out, err_out, writes_in,
    write_keys, cu_seqlens, chunk_offsets, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, TARGET: tl.constexpr, FROM_ERR: tl.constexpr,
    ERR_OUT: tl.constexpr, STORE_WRITES: tl.constexpr, HAS_STATE0: tl.constexpr, KEYS_ONCE: tl.constexpr,
    FROM_WRITES: tl.constexpr, PREFORMED: tl.constexpr,
):
    """One memory's pass (``_state_pass``), program ``(value block, sequence·head)``."""
    _state_pass(k, x, b, g, strength, key_scores, inverse, err, state0, state_final, state_chunks, writes_out,
                err_out, writes_in, write_keys, cu_seqlens, chunk_offsets, clip, None, tl.program_id(0),
                tl.program_id(1), H, K, V, C, BK, NK, BV, DT, DELTA, TARGET, FROM_ERR, ERR_OUT, STORE_WRITES,
                HAS_STATE0, KEYS_ONCE, FROM_WRITES, PREFORMED, False, False, 1)


@triton.heuristics(given(HAS_BASE0="base0", HAS_RES0="res0", STORE_U="u_out", STORE_W="w_out", U_IN="u_in",
                         W_IN="w_in"))
@triton.jit
def pipelined_state_passes_kernel(
    k, v, b, g, beta, gamma, key_scores, inv_beta, inv_gamma, base0, res0, base_final, res_final, base_chunks,
    res_chunks, u_out, w_out, err_out, u_in, w_in, cu_seqlens, chunk_offsets, clip, sync,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, TARGET: tl.constexpr, HAS_BASE0: tl.constexpr,
    HAS_RES0: tl.constexpr, STORE_U: tl.constexpr, STORE_W: tl.constexpr, U_IN: tl.constexpr, W_IN: tl.constexpr,
    KEYS_ONCE: tl.constexpr, GROUP: tl.constexpr,
):
    """Both memories of RLA/RDN in one launch of two programs per value block (the forward's launch option
    PIPELINED): ``_state_pass``'s base pass and its residual pass, each holding one state as the two launches do, the
    residual program GROUP chunks behind the base one instead of a whole pass. Grid ``(value blocks, N·H, 2)``; ``sync``
    (int32, zeros: a ticket counter, then one chunk counter per base program) orders them: each program takes a
    ticket as it starts, the first half of the tickets run the base memory, so that a residual program only waits on
    a base program already running (no order of dispatch can deadlock them), and it reads a group of chunks' error
    once that program has counted the group stored (counted every GROUP chunks, so that the loop over a group's
    chunks holds no wait and no count and keeps its software pipelining). The same products in the same order as the
    two launches, into the same buffers: the same bits."""
    programs = tl.num_programs(0) * tl.num_programs(1)
    ticket = tl.atomic_add(sync, 1)
    i_v = (ticket % programs) % tl.num_programs(0)
    i_nh = (ticket % programs) // tl.num_programs(0)
    if ticket < programs:  # the base memory (values v, strength β), counting its stored error every GROUP chunks
        _state_pass(k, v, b, g, beta, key_scores, inv_beta, None, base0, base_final, base_chunks, u_out, err_out,
                    u_in, None, cu_seqlens, chunk_offsets, clip, sync + 1 + ticket, i_v, i_nh,
                    H, K, V, C, BK, NK, BV, DT, DELTA, TARGET, False, True, STORE_U, HAS_BASE0, KEYS_ONCE, U_IN,
                    False, False, True, GROUP)
    else:  # the residual memory (values ρ(err), strength γ), waiting for each group's error
        _state_pass(k, None, b, g, gamma, None, inv_gamma, err_out, res0, res_final, res_chunks, w_out, None, w_in,
                    None, cu_seqlens, chunk_offsets, clip, sync + 1 + ticket - programs, i_v, i_nh,
                    H, K, V, C, BK, NK, BV, DT, DELTA, TARGET, True, False, STORE_W, HAS_RES0, KEYS_ONCE, W_IN,
                    False, not W_IN, False, GROUP)


@triton.jit
def _state_pass(
    k, x, b, g, strength, key_scores, inverse, err, state0, state_final, state_chunks, writes_out, err_out, writes_in,
    write_keys, cu_seqlens, chunk_offsets, clip, chunks_done, i_v, i_nh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, TARGET: tl.constexpr, FROM_ERR: tl.constexpr,
    ERR_OUT: tl.constexpr, STORE_WRITES: tl.constexpr, HAS_STATE0: tl.constexpr, KEYS_ONCE: tl.constexpr,
    FROM_WRITES: tl.constexpr, PREFORMED: tl.constexpr, WAIT: tl.constexpr, SIGNAL: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One memory (S, or R) over the chunks of one sequence, for value columns ``vc``. Values ``x``, or ``ρ(err)``
    where ``err`` is given (x None), strength σ; the prediction error into ``err_out`` and the writes into
    ``writes_out`` where given; from ``state0``, or zeros where it is None. ``key_scores`` only with ``err_out``,
    ``inverse`` only with DELTA. KEYS_ONCE loads the chunk's key blocks once for the read ``K S_0ᵀ`` (DELTA or
    ERR_OUT) and the update ``Kᵀ(…)`` (``load_key_blocks``): the same products, one shared-memory tile per key block
    in a pipelined loop instead of two; at one stage the blocks stay live in registers between the two.

    With ``writes_in`` (FROM_WRITES: the writes an earlier pass stored) the pass takes its writes from there instead
    of forming them: the state's chain is then the update alone, and the read ``K S_0ᵀ`` is made only for the error
    (ERR_OUT; ``x`` or ``err`` unused without it, ``inverse`` unused). A pass that stores its writes updates its
    state with them as stored (rounded to ``writes_out``'s type), so that a pass from them gives its states bit for
    bit. With ``write_keys`` too (PREFORMED, the delta rule: ``W = T_σ diag(σ e^b) K`` per token) ``writes_in`` holds
    ``ũ = T_σ diag(σ) X`` and the pass forms its writes ``u = ũ − W S_0ᵀ`` (``_writes`` with its state-free products
    taken before the pass, ``preformed_writes_kernel``): one read and one update on the chain.

    ``chunks_done`` (an int32 counter; None outside PIPELINED): with SIGNAL the pass counts there the chunks whose
    error it has stored, every GROUP chunks; with WAIT it reads the error ``err`` of the next GROUP chunks only once
    the counter has reached their end."""
    i_n, i_h, bos, length, c0, vc, m_v = sequential_program_at(i_v, i_nh, cu_seqlens, chunk_offsets, H, V, BV)
    s0, s1, s2, s3 = user_state_blocks(state0, i_n, i_h, vc, m_v, H, K, V, BK, NK, BV, HAS_STATE0)
    n_chunks = tl.cdiv(length, C)
    if WAIT or SIGNAL:
        # GROUP chunks between counts: the inner loop holds no wait and no count, so that it keeps its stages
        for j0 in range(0, n_chunks, GROUP):
            j1 = tl.minimum(j0 + GROUP, n_chunks)
            if WAIT:
                wait_for_count(chunks_done, j1)
            for j in range(j0, j1):
                s0, s1, s2, s3 = _chunk_step(
                    j, s0, s1, s2, s3, k, x, b, g, strength, key_scores, inverse, err, state_chunks, writes_out,
                    err_out, writes_in, write_keys, clip, i_h, bos, length, c0, vc, m_v, H, K, V, C, BK, NK, BV, DT,
                    DELTA, TARGET, FROM_ERR, ERR_OUT, STORE_WRITES, KEYS_ONCE, FROM_WRITES, PREFORMED)
            if SIGNAL:
                publish_count(chunks_done, j1)
    else:
        for j in range(n_chunks):  # chunk states are [NT, H, K, V]
            s0, s1, s2, s3 = _chunk_step(
                j, s0, s1, s2, s3, k, x, b, g, strength, key_scores, inverse, err, state_chunks, writes_out, err_out,
                writes_in, write_keys, clip, i_h, bos, length, c0, vc, m_v, H, K, V, C, BK, NK, BV, DT, DELTA, TARGET,
                FROM_ERR, ERR_OUT, STORE_WRITES, KEYS_ONCE, FROM_WRITES, PREFORMED)
    store_blocks(state_at(state_final, i_n, i_h, H, V * K), s0, s1, s2, s3, vc, m_v, 1, K, K, BK, NK)


@triton.jit
def _chunk_step(
    j, s0, s1, s2, s3, k, x, b, g, strength, key_scores, inverse, err, state_chunks, writes_out, err_out, writes_in,
    write_keys, clip, i_h, bos, length, c0, vc, m_v,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, TARGET: tl.constexpr, FROM_ERR: tl.constexpr,
    ERR_OUT: tl.constexpr, STORE_WRITES: tl.constexpr, KEYS_ONCE: tl.constexpr, FROM_WRITES: tl.constexpr,
    PREFORMED: tl.constexpr,
):
    """``_state_pass`` at chunk ``j``: stores the state before it (key blocks ``s0``-``s3``), the writes and the
    error where asked, and returns the state after it."""
    pos = tl.arange(0, C)
    tok, n_valid = chunk_of_sequence(bos, length, j, C)
    m_t = pos < n_valid
    store_blocks(state_at(state_chunks, c0 + j, i_h, H, K * V), s0, s1, s2, s3, vc, m_v, V, 1, K, BK, NK)
    bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
    kp = at_token(k, tok, i_h, H, K)
    if FROM_WRITES:
        u = token_rows(writes_in, tok, i_h, pos, m_t, vc, m_v, H, V)
        if PREFORMED:  # ũ − W S_0ᵀ
            u -= read_blocks(at_token(write_keys, tok, i_h, H, K), pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
    values = tl.zeros([C, BV], dtype=tl.float32)  # unused unless formed below
    if not FROM_WRITES or ERR_OUT:
        if FROM_ERR:
            values = rho(token_rows(err, tok, i_h, pos, m_t, vc, m_v, H, V), clip, TARGET)
        else:
            values = token_rows(x, tok, i_h, pos, m_t, vc, m_v, H, V)
    ks = values  # unused unless DELTA or ERR_OUT
    if KEYS_ONCE:
        k0, k1, k2, k3 = load_key_blocks(kp, pos, m_t, H, K, BK, NK)
    if (DELTA and not FROM_WRITES) or ERR_OUT:  # K S_0ᵀ
        if KEYS_ONCE:
            ks = read_loaded_blocks(k0, k1, k2, k3, s0, s1, s2, s3, NK, DT)
        else:
            ks = read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
    if not FROM_WRITES:
        u = _writes(values, ks, strength, inverse, bb, tok, i_h, pos, m_t, H, C, DT, DELTA)
    if STORE_WRITES:
        store_token_rows(writes_out, u, tok, i_h, pos, m_t, vc, m_v, H, V)
        u = stored(u, writes_out.dtype.element_ty).to(tl.float32)  # the writes as a pass from them reads them
    if ERR_OUT:
        a_prev = token_scores(key_scores, tok, i_h, pos, m_t, H, C)
        error = values - tl.exp(bm)[:, None] * ks - mm(a_prev, u, DT)
        store_token_rows(err_out, error, tok, i_h, pos, m_t, vc, m_v, H, V)
    chunk_decay = tl.exp(b_last)
    decayed_writes = tl.exp(b_last - bb)[:, None] * u  # each write decayed to the chunk end, e^{b_C − b_s}
    if KEYS_ONCE:
        return update_loaded_blocks(s0, s1, s2, s3, chunk_decay, k0, k1, k2, k3, decayed_writes, NK, DT)
    return update_blocks(s0, s1, s2, s3, chunk_decay, kp, pos, m_t, decayed_writes, H, K, BK, NK, DT)


@triton.heuristics(given(HAS_BASE0="base0", HAS_RES0="res0", FROM_WRITES="w_in"))
@triton.jit
def both_state_passes_kernel(
    k, v, b, g, beta, gamma, key_scores, inv_beta, inv_gamma, base0, res0, base_final, res_final, base_chunks,
    res_chunks, u_out, w_out, err_out, u_in, w_in, cu_seqlens, chunk_offsets, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, DELTA: tl.constexpr, TARGET: tl.constexpr, HAS_BASE0: tl.constexpr,
    HAS_RES0: tl.constexpr, KEYS_ONCE: tl.constexpr, FROM_WRITES: tl.constexpr,
):
    """Both memories of RLA/RDN in one pass (the forward's launch option FUSED): ``state_pass_kernel``'s base pass
    (values v, strength β, emitting the error) and its residual pass (values ρ(err), strength γ) chunk by chunk in
    one program, for value columns ``vc``. The residual memory reads the error of its own columns from registers
    instead of from ``err_out``, the chunk's key blocks are loaded once for both (KEYS_ONCE: for all four products),
    and its read ``K R_0ᵀ`` does not wait on the base memory's chain; the price is both states held at once. The
    same products in the same order as the two launches: the same values, stored in the same buffers (``u_out`` only
    with DELTA).

    With ``w_in`` (FROM_WRITES, and ``u_in`` with DELTA: the writes the forward stored) both states are rebuilt from
    them, ``state_pass_kernel``'s FROM_WRITES for both memories at once: two chains of updates that do not wait on
    each other, the base memory's read only for the error, nothing of the residual memory's write formed, no write
    stored."""
    i_n, i_h, bos, length, c0, vc, m_v = sequential_program(cu_seqlens, chunk_offsets, H, V, BV)
    pos = tl.arange(0, C)
    s0, s1, s2, s3 = user_state_blocks(base0, i_n, i_h, vc, m_v, H, K, V, BK, NK, BV, HAS_BASE0)
    r0, r1, r2, r3 = user_state_blocks(res0, i_n, i_h, vc, m_v, H, K, V, BK, NK, BV, HAS_RES0)
    for j in range(tl.cdiv(length, C)):
        tok, n_valid = chunk_of_sequence(bos, length, j, C)
        m_t = pos < n_valid
        store_blocks(state_at(base_chunks, c0 + j, i_h, H, K * V), s0, s1, s2, s3, vc, m_v, V, 1, K, BK, NK)
        store_blocks(state_at(res_chunks, c0 + j, i_h, H, K * V), r0, r1, r2, r3, vc, m_v, V, 1, K, BK, NK)
        bb, bm, b_last = load_decays(b, g, tok, i_h, pos, n_valid, H)
        kp = at_token(k, tok, i_h, H, K)
        values = token_rows(v, tok, i_h, pos, m_t, vc, m_v, H, V)
        kr = values  # the residual memory's read K R_0ᵀ: only its delta write needs it
        if KEYS_ONCE:
            k0, k1, k2, k3 = load_key_blocks(kp, pos, m_t, H, K, BK, NK)
            ks = read_loaded_blocks(k0, k1, k2, k3, s0, s1, s2, s3, NK, DT)
            if DELTA and not FROM_WRITES:
                kr = read_loaded_blocks(k0, k1, k2, k3, r0, r1, r2, r3, NK, DT)
        else:
            ks = read_blocks(kp, pos, m_t, H, K, BK, NK, s0, s1, s2, s3, DT)
            if DELTA and not FROM_WRITES:
                kr = read_blocks(kp, pos, m_t, H, K, BK, NK, r0, r1, r2, r3, DT)
        if FROM_WRITES and DELTA:
            u = token_rows(u_in, tok, i_h, pos, m_t, vc, m_v, H, V)
        else:
            u = _writes(values, ks, beta, inv_beta, bb, tok, i_h, pos, m_t, H, C, DT, DELTA)
        if DELTA and not FROM_WRITES:
            store_token_rows(u_out, u, tok, i_h, pos, m_t, vc, m_v, H, V)
            u = stored(u, u_out.dtype.element_ty).to(tl.float32)  # as state_pass_kernel updates with it
        a_prev = token_scores(key_scores, tok, i_h, pos, m_t, H, C)
        error = values - tl.exp(bm)[:, None] * ks - mm(a_prev, u, DT)
        store_token_rows(err_out, error, tok, i_h, pos, m_t, vc, m_v, H, V)
        if FROM_WRITES:
            w = token_rows(w_in, tok, i_h, pos, m_t, vc, m_v, H, V)
        else:
            # ρ(err) as the residual pass reads it back: 0 outside the chunk's rows and the value columns
            res_values = tl.where(m_t[:, None] & m_v[None, :], rho(error, clip, TARGET), 0.0)
            w = _writes(res_values, kr, gamma, inv_gamma, bb, tok, i_h, pos, m_t, H, C, DT, DELTA)
            store_token_rows(w_out, w, tok, i_h, pos, m_t, vc, m_v, H, V)
            w = stored(w, w_out.dtype.element_ty).to(tl.float32)
        chunk_decay = tl.exp(b_last)
        to_end = tl.exp(b_last - bb)[:, None]  # each write decayed to the chunk end, e^{b_C − b_s}
        if KEYS_ONCE:
            s0, s1, s2, s3 = update_loaded_blocks(s0, s1, s2, s3, chunk_decay, k0, k1, k2, k3, to_end * u, NK, DT)
            r0, r1, r2, r3 = update_loaded_blocks(r0, r1, r2, r3, chunk_decay, k0, k1, k2, k3, to_end * w, NK, DT)
        else:
            s0, s1, s2, s3 = update_blocks(s0, s1, s2, s3, chunk_decay, kp, pos, m_t, to_end * u, H, K, BK, NK, DT)
            r0, r1, r2, r3 = update_blocks(r0, r1, r2, r3, chunk_decay, kp, pos, m_t, to_end * w, H, K, BK, NK, DT)
    store_blocks(state_at(base_final, i_n, i_h, H, V * K), s0, s1, s2, s3, vc, m_v, 1, K, K, BK, NK)
    store_blocks(state_at(res_final, i_n, i_h, H, V * K), r0, r1, r2, r3, vc, m_v, 1, K, K, BK, NK)


@triton.heuristics(given(RES_KEYS="res_keys_out", VALUES="base_values_out"))
@triton.jit
def preformed_writes_kernel(
    k, v, b, g, beta, gamma, inv_beta, inv_gamma, base_keys_out, res_keys_out, base_values_out,
    cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, RES_KEYS: tl.constexpr, VALUES: tl.constexpr,
):
    """The delta writes' state-free products of one chunk and head (the forward's PREFORMED, and W alone for the
    reverse passes' PREFORMED), program ``(column block, chunk, head)``: the first NKB blocks are BK key columns of
    ``W = T_β diag(β e^b) K`` (into ``base_keys_out``, and of ``T_γ diag(γ e^b) K`` into ``res_keys_out`` with
    RES_KEYS), the others (VALUES) BV value columns of ``ũ = T_β diag(β) V`` (``base_values_out``). All
    ``[N_tok, H, ·]``, stored in their buffers' types (``function._preformed_passes``: W in the storage type, ũ in
    float32)."""
    i_blk, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    pos = tl.arange(0, C)
    m_t = pos < n_valid
    beta_t = token_gate(beta, tok, i_h, pos, m_t, H)
    if i_blk < NKB:
        bb = load_decays(b, g, tok, i_h, pos, n_valid, H)[0]
        kc = i_blk * BK + tl.arange(0, BK)
        m_k = kc < K
        decayed = tl.exp(bb)[:, None] * token_rows(k, tok, i_h, pos, m_t, kc, m_k, H, K)
        store_token_rows(base_keys_out, mm(token_scores(inv_beta, tok, i_h, pos, m_t, H, C), beta_t[:, None] * decayed,
                                           DT), tok, i_h, pos, m_t, kc, m_k, H, K)
        if RES_KEYS:
            gamma_t = token_gate(gamma, tok, i_h, pos, m_t, H)
            store_token_rows(res_keys_out, mm(token_scores(inv_gamma, tok, i_h, pos, m_t, H, C),
                                              gamma_t[:, None] * decayed, DT), tok, i_h, pos, m_t, kc, m_k, H, K)
    elif VALUES:
        vc = (i_blk - NKB) * BV + tl.arange(0, BV)
        m_v = vc < V
        values = token_rows(v, tok, i_h, pos, m_t, vc, m_v, H, V)
        store_token_rows(base_values_out, mm(token_scores(inv_beta, tok, i_h, pos, m_t, H, C),
                                             beta_t[:, None] * values, DT), tok, i_h, pos, m_t, vc, m_v, H, V)


@triton.heuristics(given(RES_VALUES="res_values_out"))
@triton.jit
def preformed_error_kernel(
    k, v, b, g, gamma, key_scores, inv_gamma, base_chunks, u_in, err_out, res_values_out,
    cu_seqlens, chunk_indices, clip,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BV: tl.constexpr, DT: tl.constexpr, TARGET: tl.constexpr, RES_VALUES: tl.constexpr,
):
    """The base memory's prediction error after its pass (the forward's PREFORMED), program ``(value block, chunk,
    head)``: ``err = V − diag(e^{bm}) K S_0ᵀ − A' u`` from the stored state before the chunk and the stored writes
    (what ``_state_pass`` computes on its chain with ERR_OUT, here off it), into ``err_out``; with RES_VALUES the
    residual memory's state-free write ``T_γ diag(γ) ρ(err)`` into ``res_values_out``."""
    i_c, i_h, tok, n_valid, pos, m_t, vc, m_v = value_block_program(cu_seqlens, chunk_indices, C, V, BV)
    _, bm, _ = load_decays(b, g, tok, i_h, pos, n_valid, H)
    ks, _ = _read_states(at_token(k, tok, i_h, H, K), base_chunks, None, i_c, i_h, pos, m_t, vc, m_v, H, K, V, C, BK,
                         NK, BV, DT, False)
    u = token_rows(u_in, tok, i_h, pos, m_t, vc, m_v, H, V)
    error = (token_rows(v, tok, i_h, pos, m_t, vc, m_v, H, V) - tl.exp(bm)[:, None] * ks
             - mm(token_scores(key_scores, tok, i_h, pos, m_t, H, C), u, DT))
    store_token_rows(err_out, error, tok, i_h, pos, m_t, vc, m_v, H, V)
    if RES_VALUES:
        res_values = tl.where(m_t[:, None] & m_v[None, :], rho(error, clip, TARGET), 0.0)
        gamma_t = token_gate(gamma, tok, i_h, pos, m_t, H)
        store_token_rows(res_values_out, mm(token_scores(inv_gamma, tok, i_h, pos, m_t, H, C),
                                            gamma_t[:, None] * res_values, DT), tok, i_h, pos, m_t, vc, m_v, H, V)


@triton.jit
def _read_states(q, base_chunks, res_chunks, i_c, i_h, pos, m_t, vc, m_v, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
                 DT: tl.constexpr, RESIDUAL: tl.constexpr):
    """``Q S_0ᵀ`` and ``Q R_0ᵀ`` ([C, BV]) from the chunk's stored states ([NT, H, K, V]; ``res_chunks`` only with
    RESIDUAL)."""
    base_chunks = state_at(base_chunks, i_c, i_h, H, K * V)
    if RESIDUAL:
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
    """The read-outs of one chunk and head for value columns ``vc``. ``u_in`` only with DELTA; ``gamma``,
    ``res_scores``, ``res_chunks`` and ``w_in`` only with RESIDUAL (None without)."""
    i_c, i_h, tok, n_valid, pos, m_t, vc, m_v = value_block_program(cu_seqlens, chunk_indices, C, V, BV)
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
