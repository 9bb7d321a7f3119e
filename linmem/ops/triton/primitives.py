"""Small Triton helpers every kernel of the package uses: where a chunk lives, tile loads and stores, the dot with an
explicit operand type, in-chunk decays, the states held as key blocks, and the residual target ρ with its derivative.

Addressing (the int32/int64 rule). Every per-token pointer is first moved to the first token of the chunk and to the
head (``at_token``, and the ``token_*`` helpers: ``ptr + (tok·H + h)·D`` with ``tok`` int64), and every per-chunk
state pointer to its ``[K, V]`` block (``state_at``: ``(c·H + h)·K·V`` in int64). Offsets inside a chunk (``row·H·D +
column`` with row < 64, or ``key·V + value`` inside one state) then fit int32 for any realistic width, so no element
offset is ever formed from a token index in 32 bits. Every load and store is masked on both axes: rows past the end
of the sequence (the last chunk of a sequence is usually partial), key columns past K, value columns past V.

States in registers. A sequential pass holds each state transposed, as up to four key blocks ``Sᵀ[i·BK:(i+1)·BK, v]``
of ``[BK, BV]`` (BK = 64 for K > 32: every dot then has 64 rows, the tensor-core shape). ``NK`` (constexpr) says how
many blocks exist; the helpers below take all four and touch only the first NK (callers pass block 0 for the rest).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# ρ, the residual memory's target (config.residual_target), as a compile-time code
TARGET_CODES = {"clip": 0, "tanh": 1, "identity": 2}

# Triton's interpreter converts float32 to bfloat16 by truncation (round toward zero), a GPU rounds to nearest even:
# under the interpreter every store rounds first (``stored``), so that CPU results carry the GPU's rounding errors
# rather than a systematic bias. Fixed when this module is imported, as the kernels' own mode is.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def given(**flags: str) -> dict:
    """``triton.heuristics`` rules that set each compile-time flag to whether its tensor argument was passed (not
    None): ``@triton.heuristics(given(HAS_X="x"))`` on a kernel with ``x`` and ``HAS_X: tl.constexpr`` lets a launch
    pass ``x=None`` where there is no such tensor, and the kernel read ``x`` only under ``if HAS_X``. An optional
    input is then one keyword at the launch and one entry here."""
    return {flag: (lambda args, name=name: args[name] is not None) for flag, name in flags.items()}


@triton.jit
def stored(value, dtype: tl.constexpr):
    """``value`` converted to the storage type ``dtype`` (round to nearest even)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = value.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        value = bits.to(tl.float32, bitcast=True)
    return value.to(dtype)


@triton.jit
def mm(a, b, DT: tl.constexpr):
    """``a @ b`` with both operands in ``DT`` and a float32 result."""
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def mm_acc(acc, a, b, DT: tl.constexpr):
    """``acc + a @ b`` (float32 accumulator)."""
    return tl.dot(a.to(DT), b.to(DT), acc)


# ------------------------------------------------------------------------------------------------ positions


@triton.jit
def sequence_at(cu_seqlens, i_n):
    """First token (int64) and length (int32) of sequence ``i_n``."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos, (eos - bos).to(tl.int32)


@triton.jit
def sequential_program(cu_seqlens, chunk_offsets, H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """What program ``(value block, sequence·head)`` of a sequential pass works on: sequence ``i_n``, head ``i_h``,
    the sequence's first token (int64) and length, its first global chunk ``c0``, value columns ``vc`` and their
    mask."""
    return sequential_program_at(tl.program_id(0), tl.program_id(1), cu_seqlens, chunk_offsets, H, V, BV)


@triton.jit
def sequential_program_at(i_v, i_nh, cu_seqlens, chunk_offsets, H: tl.constexpr, V: tl.constexpr,
                          BV: tl.constexpr):
    """``sequential_program`` for value block ``i_v`` and sequence·head ``i_nh`` given (a program that chose its
    work itself)."""
    i_n = i_nh // H
    bos, length = sequence_at(cu_seqlens, i_n)
    vc = i_v * BV + tl.arange(0, BV)
    return i_n, i_nh % H, bos, length, tl.load(chunk_offsets + i_n), vc, vc < V


@triton.jit
def chunk_at(cu_seqlens, chunk_indices, i_c, C: tl.constexpr):
    """Global chunk ``i_c``: its sequence, its first token (int64) and its number of tokens (1..C)."""
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos, length = sequence_at(cu_seqlens, i_n)
    tok = bos + j.to(tl.int64) * C
    return i_n, tok, tl.minimum(length - j * C, C)


@triton.jit
def value_block_program(cu_seqlens, chunk_indices, C: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """What program ``(value block, chunk, head)`` of a chunk-parallel kernel works on: chunk ``i_c``, head ``i_h``,
    the chunk's first token (int64) and number of tokens, its rows ``pos`` and their mask, value columns ``vc`` and
    their mask."""
    i_c, i_h = tl.program_id(1), tl.program_id(2)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    pos = tl.arange(0, C)
    vc = tl.program_id(0) * BV + tl.arange(0, BV)
    return i_c, i_h, tok, n_valid, pos, pos < n_valid, vc, vc < V


@triton.jit
def at_token(ptr, tok, i_h, H: tl.constexpr, WIDTH: tl.constexpr):
    """``ptr`` moved to token ``tok`` (int64) and head ``i_h`` of a ``[N_tok, H, WIDTH]`` tensor."""
    return ptr + (tok * H + i_h) * WIDTH


@triton.jit
def state_at(ptr, index, i_h, H: tl.constexpr, SIZE: tl.constexpr):
    """``ptr`` moved to state ``index`` and head ``i_h`` of a ``[*, H, …]`` tensor of ``SIZE`` elements per state."""
    return ptr + (index.to(tl.int64) * H + i_h) * SIZE


# ------------------------------------------------------------------------------------------------ tiles


# Under TRITON_INTERPRET=1 every call of a jit helper re-patches triton.language (about 0.2 ms), so the per-token tile
# helpers (the most called) are flat: each computes its offsets itself instead of calling another helper.


@triton.jit
def _offsets(rows, m_r, ROW: tl.constexpr, cols, m_c, COL: tl.constexpr):
    if COL == 1:
        offs = rows[:, None] * ROW + cols[None, :]
    elif ROW == 1:
        offs = rows[:, None] + cols[None, :] * COL
    else:
        offs = rows[:, None] * ROW + cols[None, :] * COL
    return offs, m_r[:, None] & m_c[None, :]


@triton.jit
def load_block(ptr, rows, m_r, ROW: tl.constexpr, cols, m_c, COL: tl.constexpr):
    """The ``[rows, cols]`` tile at ``ptr + row·ROW + col·COL`` in the tensor's own type (0 where masked)."""
    offs, mask = _offsets(rows, m_r, ROW, cols, m_c, COL)
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def store_block(ptr, value, rows, m_r, ROW: tl.constexpr, cols, m_c, COL: tl.constexpr):
    offs, mask = _offsets(rows, m_r, ROW, cols, m_c, COL)
    tl.store(ptr + offs, stored(value, ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_rows(ptr, value, pos, m_t, H: tl.constexpr, WIDTH: tl.constexpr, cols, m_c):
    offs = pos[:, None] * (H * WIDTH) + cols[None, :]
    tl.store(ptr + offs, stored(value, ptr.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def token_rows(ptr, tok, i_h, pos, m_t, cols, m_c, H: tl.constexpr, WIDTH: tl.constexpr):
    """Rows ``pos`` of the chunk starting at token ``tok`` (int64) of a ``[N_tok, H, WIDTH]`` tensor, head ``i_h``,
    as float32 (0 outside the masks)."""
    offs = pos[:, None] * (H * WIDTH) + cols[None, :]
    ptr += (tok * H + i_h) * WIDTH
    return tl.load(ptr + offs, mask=m_t[:, None] & m_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_token_rows(ptr, value, tok, i_h, pos, m_t, cols, m_c, H: tl.constexpr, WIDTH: tl.constexpr):
    offs = pos[:, None] * (H * WIDTH) + cols[None, :]
    ptr += (tok * H + i_h) * WIDTH
    tl.store(ptr + offs, stored(value, ptr.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def token_gate(ptr, tok, i_h, pos, m_t, H: tl.constexpr):
    """A per-token gate ``[N_tok, H]`` at rows ``pos`` of the chunk starting at token ``tok``, head ``i_h``, as
    float32 (0 past the end)."""
    return tl.load(ptr + (tok * H + i_h) + pos * H, mask=m_t, other=0.0).to(tl.float32)


@triton.jit
def store_token_gate(ptr, value, tok, i_h, pos, m_t, H: tl.constexpr):
    tl.store(ptr + (tok * H + i_h) + pos * H, value, mask=m_t)


@triton.jit
def token_scores(ptr, tok, i_h, pos, m_t, H: tl.constexpr, C: tl.constexpr):
    """The ``[C, C]`` matrix of the chunk starting at token ``tok``, stored as rows ``[N_tok, H, C]`` (rows past
    the end are 0), in its own type."""
    offs = pos[:, None] * (H * C) + pos[None, :]
    ptr += (tok * H + i_h) * C
    return tl.load(ptr + offs, mask=m_t[:, None], other=0.0)


@triton.jit
def load_decays(b, g, tok, i_h, pos, n_valid, H: tl.constexpr):
    """In-chunk log decays at rows ``pos`` of the chunk starting at token ``tok``: ``b`` (cumulative, inclusive),
    ``bm = b − g`` and ``b_C`` (b of the chunk's last token). Rows past the end repeat ``b_C`` with g = 0, the values
    a zero-padded g gives, so that no decay exponent between rows is ever positive."""
    start = tok * H + i_h
    m_t = pos < n_valid
    b_last = tl.load(b + start + (n_valid - 1) * H)
    bb = tl.where(m_t, tl.load(b + start + pos * H, mask=m_t, other=0.0), b_last)
    return bb, bb - tl.load(g + start + pos * H, mask=m_t, other=0.0), b_last


@triton.jit
def chunk_of_sequence(bos, length, j, C: tl.constexpr):
    """First token (int64) and number of tokens of chunk ``j`` of the sequence at ``bos`` with ``length`` tokens."""
    return bos + j * C, tl.minimum(length - j * C, C)


@triton.jit
def decay(row_exp, col_exp, mask):
    """``e^{row_exp_t − col_exp_s}`` where ``mask``, else 0 (the masked exponent never reaches ``exp``)."""
    return tl.exp(tl.where(mask, row_exp[:, None] - col_exp[None, :], float("-inf")))


# ------------------------------------------------------------------------------------------------ state blocks


@triton.jit
def key_block(ptr, pos, m_t, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, I):
    """Key block I of a per-token ``[N_tok, H, K]`` tensor at the chunk: ``[C, BK]``."""
    cols = I * BK + tl.arange(0, BK)
    offs = pos[:, None] * (H * K) + cols[None, :]
    return tl.load(ptr + offs, mask=m_t[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def key_block_t(ptr, pos, m_t, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, I):
    """``key_block`` transposed: ``[BK, C]``."""
    cols = I * BK + tl.arange(0, BK)
    offs = cols[:, None] + pos[None, :] * (H * K)
    return tl.load(ptr + offs, mask=(cols < K)[:, None] & m_t[None, :], other=0.0)


@triton.jit
def read_blocks(ptr, pos, m_t, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
                s0, s1, s2, s3, DT: tl.constexpr):
    """``X Sᵀ`` ([C, BV]) for the chunk rows X of a per-token ``[N_tok, H, K]`` tensor and a state in key blocks."""
    acc = mm(key_block(ptr, pos, m_t, H, K, BK, 0), s0, DT)
    if NK > 1:
        acc = mm_acc(acc, key_block(ptr, pos, m_t, H, K, BK, 1), s1, DT)
    if NK > 2:
        acc = mm_acc(acc, key_block(ptr, pos, m_t, H, K, BK, 2), s2, DT)
    if NK > 3:
        acc = mm_acc(acc, key_block(ptr, pos, m_t, H, K, BK, 3), s3, DT)
    return acc


@triton.jit
def update_blocks(s0, s1, s2, s3, scale, ptr, pos, m_t, x, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                  NK: tl.constexpr, DT: tl.constexpr):
    """``Sᵀ ← scale·Sᵀ + Xᵀ x`` for the chunk rows X of a per-token ``[N_tok, H, K]`` tensor and ``x`` ([C, BV])."""
    s0 = mm_acc(scale * s0, key_block_t(ptr, pos, m_t, H, K, BK, 0), x, DT)
    if NK > 1:
        s1 = mm_acc(scale * s1, key_block_t(ptr, pos, m_t, H, K, BK, 1), x, DT)
    if NK > 2:
        s2 = mm_acc(scale * s2, key_block_t(ptr, pos, m_t, H, K, BK, 2), x, DT)
    if NK > 3:
        s3 = mm_acc(scale * s3, key_block_t(ptr, pos, m_t, H, K, BK, 3), x, DT)
    return s0, s1, s2, s3


@triton.jit
def load_key_blocks(ptr, pos, m_t, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr):
    """The chunk's key blocks ``X_i`` ([C, BK] each, in the tensor's own type) of a per-token ``[N_tok, H, K]``
    tensor, loaded once for several products (``read_loaded_blocks``, ``update_loaded_blocks``): one tile per block
    in a pipelined loop's shared memory, where ``read_blocks`` and ``update_blocks`` on the same rows load it twice.
    Blocks past NK repeat block 0."""
    x0 = key_block(ptr, pos, m_t, H, K, BK, 0)
    x1 = x0
    x2 = x0
    x3 = x0
    if NK > 1:
        x1 = key_block(ptr, pos, m_t, H, K, BK, 1)
    if NK > 2:
        x2 = key_block(ptr, pos, m_t, H, K, BK, 2)
    if NK > 3:
        x3 = key_block(ptr, pos, m_t, H, K, BK, 3)
    return x0, x1, x2, x3


@triton.jit
def read_loaded_blocks(x0, x1, x2, x3, s0, s1, s2, s3, NK: tl.constexpr, DT: tl.constexpr):
    """``read_blocks`` from key blocks already loaded (``load_key_blocks``): ``X Sᵀ`` ([C, BV])."""
    acc = mm(x0, s0, DT)
    if NK > 1:
        acc = mm_acc(acc, x1, s1, DT)
    if NK > 2:
        acc = mm_acc(acc, x2, s2, DT)
    if NK > 3:
        acc = mm_acc(acc, x3, s3, DT)
    return acc


@triton.jit
def update_loaded_blocks(s0, s1, s2, s3, scale, x0, x1, x2, x3, x, NK: tl.constexpr, DT: tl.constexpr):
    """``update_blocks`` from key blocks already loaded (``load_key_blocks``): ``Sᵀ_i ← scale·Sᵀ_i + X_iᵀ x``."""
    s0 = mm_acc(scale * s0, tl.trans(x0), x, DT)
    if NK > 1:
        s1 = mm_acc(scale * s1, tl.trans(x1), x, DT)
    if NK > 2:
        s2 = mm_acc(scale * s2, tl.trans(x2), x, DT)
    if NK > 3:
        s3 = mm_acc(scale * s3, tl.trans(x3), x, DT)
    return s0, s1, s2, s3


@triton.jit
def _state_block(ptr, vc, m_v, KEY_STRIDE: tl.constexpr, VALUE_STRIDE: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, I: tl.constexpr):
    rows = I * BK + tl.arange(0, BK)
    return load_block(ptr, rows, rows < K, KEY_STRIDE, vc, m_v, VALUE_STRIDE).to(tl.float32)


@triton.jit
def load_blocks(ptr, vc, m_v, KEY_STRIDE: tl.constexpr, VALUE_STRIDE: tl.constexpr, K: tl.constexpr,
                BK: tl.constexpr, NK: tl.constexpr):
    """A state's key blocks ``Sᵀ_i`` ([BK, BV] float32) for value columns ``vc``; ``ptr`` at the state, whose
    element (value, key) lies at ``key·KEY_STRIDE + value·VALUE_STRIDE``. Blocks past NK repeat block 0."""
    s0 = _state_block(ptr, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 0)
    s1 = s0
    s2 = s0
    s3 = s0
    if NK > 1:
        s1 = _state_block(ptr, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 1)
    if NK > 2:
        s2 = _state_block(ptr, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 2)
    if NK > 3:
        s3 = _state_block(ptr, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 3)
    return s0, s1, s2, s3


@triton.jit
def user_state_blocks(state, i_n, i_h, vc, m_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr, GIVEN: tl.constexpr):
    """Sequence ``i_n``'s state of head ``i_h`` in a user's ``[N, H, V, K]`` tensor (key stride 1, value stride K)
    as key blocks ``[BK, BV]`` (``load_blocks``), or zeros where it is not GIVEN: a pass's initial state, or a
    reverse pass's final-state gradient."""
    if GIVEN:
        s0, s1, s2, s3 = load_blocks(state_at(state, i_n, i_h, H, V * K), vc, m_v, 1, K, K, BK, NK)
    else:
        s0 = tl.zeros([BK, BV], dtype=tl.float32)
        s1, s2, s3 = s0, s0, s0
    return s0, s1, s2, s3


@triton.jit
def _store_state_block(ptr, s, vc, m_v, KEY_STRIDE: tl.constexpr, VALUE_STRIDE: tl.constexpr, K: tl.constexpr,
                       BK: tl.constexpr, I: tl.constexpr):
    rows = I * BK + tl.arange(0, BK)
    store_block(ptr, s, rows, rows < K, KEY_STRIDE, vc, m_v, VALUE_STRIDE)


@triton.jit
def store_blocks(ptr, s0, s1, s2, s3, vc, m_v, KEY_STRIDE: tl.constexpr, VALUE_STRIDE: tl.constexpr,
                 K: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr):
    """Store a state held as key blocks (the layout of ``load_blocks``)."""
    _store_state_block(ptr, s0, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 0)
    if NK > 1:
        _store_state_block(ptr, s1, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 1)
    if NK > 2:
        _store_state_block(ptr, s2, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 2)
    if NK > 3:
        _store_state_block(ptr, s3, vc, m_v, KEY_STRIDE, VALUE_STRIDE, K, BK, 3)


# ------------------------------------------------------------------------------------------------ residual target


@triton.jit
def _tanh(x):
    # tanh from exp, stable for any |x| (e^{−2|x|} ≤ 1)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def rho(err, clip, TARGET: tl.constexpr):
    """ρ(err): clip to ``[−clip, clip]`` (0), ``clip·tanh(err/clip)`` (1) or the identity (2)."""
    if TARGET == 0:
        return tl.minimum(tl.maximum(err, -clip), clip)
    elif TARGET == 1:
        return clip * _tanh(err / clip)
    else:
        return err


@triton.jit
def rho_grad(err, clip, TARGET: tl.constexpr):
    """ρ'(err), with clip's derivative 1 on the closed interval ``[−clip, clip]`` as ``torch.clamp`` has it."""
    if TARGET == 0:
        return tl.where(tl.abs(err) <= clip, 1.0, 0.0)
    elif TARGET == 1:
        t = _tanh(err / clip)
        return 1.0 - t * t
    else:
        return tl.full(err.shape, 1.0, tl.float32)


@triton.jit
def publish_count(counter, count):
    """Sets the int32 at ``counter`` to ``count`` once every thread of the program has stored what came before
    (release: a program that reads the count reads those stores too)."""
    tl.debug_barrier()
    tl.atomic_xchg(counter, count, sem="release")


@triton.jit
def wait_for_count(counter, count):
    """Spins until the int32 at ``counter`` (``publish_count``'s, from another program of the launch) reaches
    ``count`` (acquire: the loads after it read what that program stored before the count)."""
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < count:
        seen = tl.atomic_add(counter, 0, sem="acquire")
    tl.debug_barrier()
