"""Small Triton helpers every kernel of the package uses: tile loads and stores on the ``[N_tok, H, D]`` layout,
the dot with an explicit operand type, in-chunk decay matrices, and the residual target ρ with its derivative.

Kernels first move each per-token pointer to its sequence's first token and their head (``ptr += (bos·H + h)·D``,
64-bit, once); the helpers then address rows ``r`` of the sequence with 32-bit offsets ``r·H·D + column``, which
keeps the per-element address arithmetic (and the registers it takes) small."""

from __future__ import annotations

import triton
import triton.language as tl

# ρ, the residual memory's target (config.residual_target), as a compile-time code
TARGET_CODES = {"clip": 0, "tanh": 1, "identity": 2}


@triton.jit
def mm(a, b, DT: tl.constexpr):
    """``a @ b`` with both operands in ``DT`` and a float32 result."""
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def load_rows(ptr, r, mask_t, H: tl.constexpr, WIDTH: tl.constexpr, cols, mask_c):
    """Rows ``r`` of a ``[N_tok, H, WIDTH]`` tensor (pointer at the sequence start and head), columns ``cols``, as
    float32 (0 outside)."""
    offs = r[:, None] * (H * WIDTH) + cols[None, :]
    return tl.load(ptr + offs, mask=mask_t[:, None] & mask_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def load_tile(ptr, r, mask_t, H: tl.constexpr, WIDTH: tl.constexpr, cols, mask_c):
    """As ``load_rows`` but in the tensor's own type (for tiles that only feed dots)."""
    offs = r[:, None] * (H * WIDTH) + cols[None, :]
    return tl.load(ptr + offs, mask=mask_t[:, None] & mask_c[None, :], other=0.0)


@triton.jit
def store_rows(ptr, value, r, mask_t, H: tl.constexpr, WIDTH: tl.constexpr, cols, mask_c):
    offs = r[:, None] * (H * WIDTH) + cols[None, :]
    tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def load_gate(ptr, r, mask_t, H: tl.constexpr):
    """A per-token gate ``[N_tok, H]`` at rows ``r`` (0 outside the sequence)."""
    return tl.load(ptr + r * H, mask=mask_t, other=0.0).to(tl.float32)


@triton.jit
def load_decay(b, r, mask_t, H: tl.constexpr, b_last):
    """The in-chunk cumulative log decay ``b`` at rows ``r``; rows past the sequence end repeat ``b_last`` (the
    value a zero-padded g gives), so that no decay exponent between rows is ever positive."""
    return tl.where(mask_t, tl.load(b + r * H, mask=mask_t, other=0.0), b_last)


@triton.jit
def load_state(ptr, index, i_h, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, rows, mask_r, cols, mask_c):
    """Block ``[rows, cols]`` of state ``index`` of a ``[*, H, V, K]`` float32 tensor."""
    start = ptr + (index * H + i_h).to(tl.int64) * (V * K)
    offs = rows[:, None] * K + cols[None, :]
    return tl.load(start + offs, mask=mask_r[:, None] & mask_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_state(ptr, value, index, i_h, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, rows, mask_r, cols,
                mask_c):
    start = ptr + (index * H + i_h).to(tl.int64) * (V * K)
    offs = rows[:, None] * K + cols[None, :]
    tl.store(start + offs, value.to(ptr.dtype.element_ty), mask=mask_r[:, None] & mask_c[None, :])


@triton.jit
def sequence_start(ptr, bos, i_h, H: tl.constexpr, WIDTH: tl.constexpr):
    """``ptr`` moved to token ``bos`` (int64) and head ``i_h`` of a ``[N_tok, H, WIDTH]`` tensor."""
    return ptr + (bos * H + i_h) * WIDTH


@triton.jit
def decay(row_exp, col_exp, mask):
    """``e^{row_exp_t − col_exp_s}`` where ``mask``, else 0 (the masked exponent never reaches ``exp``)."""
    return tl.exp(tl.where(mask, row_exp[:, None] - col_exp[None, :], float("-inf")))


@triton.jit
def _tanh(x):
    # tanh from exp, stable for any |x| (e^{−2|x|} ≤ 1)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def residual_target(err, clip, TARGET: tl.constexpr):
    """ρ(err): clip to ``[−clip, clip]`` (0), ``clip·tanh(err/clip)`` (1) or the identity (2)."""
    if TARGET == 0:
        return tl.minimum(tl.maximum(err, -clip), clip)
    elif TARGET == 1:
        return clip * _tanh(err / clip)
    else:
        return err


@triton.jit
def residual_target_grad(err, clip, TARGET: tl.constexpr):
    """ρ'(err), with clip's derivative 1 on the closed interval ``[−clip, clip]`` as ``torch.clamp`` has it."""
    if TARGET == 0:
        return tl.where(tl.abs(err) <= clip, 1.0, 0.0)
    elif TARGET == 1:
        t = _tanh(err / clip)
        return 1.0 - t * t
    else:
        return tl.full(err.shape, 1.0, tl.float32)
