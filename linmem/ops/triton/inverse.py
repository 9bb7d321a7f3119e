"""The delta rule's in-chunk inverse ``T = (I + diag(σ) A)^{-1}`` (the WY/UT representation), for σ = β and σ = γ.

``A = diag(α) A'`` is strictly lower triangular (``A'`` from scores.py), so ``L = I + diag(σα) A'`` is unit lower
triangular. The chunk of 64 is cut into 4×4 blocks of 16: the four diagonal blocks are inverted together by forward
substitution in float32, and the blocks below the diagonal follow from ``T_ij = −T_ii Σ_{j≤m<i} L_im T_mj``
(float32 accumulation; the operands full float32 or tf32, see ``chunk_inverse``). One program per (chunk, head, σ).
Rows past the end of a sequence load as zero, so their rows of T are rows of the identity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from linmem.ops.triton.layout import CHUNK, SequenceLayout, new_buffer
from linmem.ops.triton.primitives import at_token, chunk_at, given, stored


@triton.jit
def _scaled_block(key_scores, len_left, H: tl.constexpr, C: tl.constexpr, scale_ptr, g, I: tl.constexpr,
                  J: tl.constexpr):
    """Block (I, J) of ``diag(σα) A'``: ``[16, 16]`` (pointers at the chunk's first token and the head)."""
    r = tl.arange(0, 16)
    row = I * 16 + r
    valid = row < len_left
    scale = tl.load(scale_ptr + row * H, mask=valid, other=0.0) * tl.exp(tl.load(g + row * H, mask=valid, other=0.0))
    block = tl.load(key_scores + row[:, None] * (H * C) + (J * 16 + r)[None, :], mask=valid[:, None], other=0.0)
    return block.to(tl.float32) * scale[:, None]


@triton.jit
def _diagonal_inverses(key_scores, len_left, H: tl.constexpr, C: tl.constexpr, scale_ptr, g):
    """``(I + n_i)^{-1}`` for the four strictly lower diagonal ``[16, 16]`` blocks ``n_i`` of ``diag(σα) A'``, all
    four at once as a ``[4, 16, 16]`` tensor, by forward substitution row by row (row i of every block is loaded
    from memory, where it is cached, rather than picked out of the tile by a reduction)."""
    blk = tl.arange(0, 4)[:, None]
    r = tl.arange(0, 16)
    eye = (r[:, None] == r[None, :]).to(tl.float32)[None, :, :]
    inv = eye + tl.zeros([4, 16, 16], dtype=tl.float32)
    for i in tl.static_range(1, 16):
        row = blk * 16 + i  # [4, 1]: row i of each block
        valid = row < len_left
        scale = tl.load(scale_ptr + row * H, mask=valid, other=0.0) * tl.exp(tl.load(g + row * H, mask=valid,
                                                                                    other=0.0))
        n_row = tl.load(key_scores + row * (H * C) + (blk * 16 + r[None, :]), mask=valid & (r[None, :] < i),
                        other=0.0).to(tl.float32) * scale  # n_b[i, :], [4, 16]
        new_row = -tl.sum(n_row[:, :, None] * inv, 1)  # −Σ_{j<i} n_b[i, j] inv_b[j, :]
        inv = tl.where(r[None, :, None] == i, new_row[:, None, :] + eye, inv)
    return inv


@triton.jit
def _block_of(blocks, I: tl.constexpr):
    """Block I of a ``[4, 16, 16]`` tensor."""
    return tl.sum(tl.where(tl.arange(0, 4)[:, None, None] == I, blocks, 0.0), 0)


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _store_block(out, block, len_left, H: tl.constexpr, C: tl.constexpr, I: tl.constexpr, J: tl.constexpr):
    r = tl.arange(0, 16)
    row = I * 16 + r
    tl.store(out + row[:, None] * (H * C) + (J * 16 + r)[None, :], stored(block, out.dtype.element_ty),
             mask=(row < len_left)[:, None])


@triton.heuristics(given(HAS_GAMMA="gamma"))
@triton.jit
def chunk_inverse_kernel(key_scores, g, beta, gamma, inv_beta, inv_gamma, cu_seqlens, chunk_indices,
                         H: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr, HAS_GAMMA: tl.constexpr):
    """``T_β`` (program_id(2) = 0) or, where ``gamma`` and ``inv_gamma`` are given, ``T_γ`` (1) of one chunk and
    head."""
    i_c, i_h, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, tok, left = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    strength, out = beta, inv_beta
    if HAS_GAMMA:
        if which == 1:
            strength, out = gamma, inv_gamma
    key_scores = at_token(key_scores, tok, i_h, H, C)
    out = at_token(out, tok, i_h, H, C)
    strength = at_token(strength, tok, i_h, H, 1)
    g = at_token(g, tok, i_h, H, 1)

    diagonal = _diagonal_inverses(key_scores, left, H, C, strength, g)
    d0 = _block_of(diagonal, 0)
    d1 = _block_of(diagonal, 1)
    d2 = _block_of(diagonal, 2)
    d3 = _block_of(diagonal, 3)
    n10 = _scaled_block(key_scores, left, H, C, strength, g, 1, 0)
    n20 = _scaled_block(key_scores, left, H, C, strength, g, 2, 0)
    n21 = _scaled_block(key_scores, left, H, C, strength, g, 2, 1)
    n30 = _scaled_block(key_scores, left, H, C, strength, g, 3, 0)
    n31 = _scaled_block(key_scores, left, H, C, strength, g, 3, 1)
    n32 = _scaled_block(key_scores, left, H, C, strength, g, 3, 2)

    t10 = -_mm(d1, _mm(n10, d0, PRECISION), PRECISION)
    t21 = -_mm(d2, _mm(n21, d1, PRECISION), PRECISION)
    t32 = -_mm(d3, _mm(n32, d2, PRECISION), PRECISION)
    t20 = -_mm(d2, _mm(n20, d0, PRECISION) + _mm(n21, t10, PRECISION), PRECISION)
    t31 = -_mm(d3, _mm(n31, d1, PRECISION) + _mm(n32, t21, PRECISION), PRECISION)
    t30 = -_mm(d3, _mm(n30, d0, PRECISION) + _mm(n31, t10, PRECISION) + _mm(n32, t20, PRECISION), PRECISION)

    # the diagonal blocks in one store, every block above the diagonal (zero) in another
    blk = tl.arange(0, 4)[:, None, None]
    r = tl.arange(0, 16)
    row = blk * 16 + r[None, :, None]
    tl.store(out + row * (H * C) + (blk * 16 + r[None, None, :]), stored(diagonal, out.dtype.element_ty),
             mask=row < left)
    pos = tl.arange(0, C)
    above = (pos[None, :] // 16) > (pos[:, None] // 16)
    tl.store(out + pos[:, None] * (H * C) + pos[None, :], tl.zeros([C, C], dtype=out.dtype.element_ty),
             mask=above & (pos < left)[:, None])
    _store_block(out, t10, left, H, C, 1, 0)
    _store_block(out, t20, left, H, C, 2, 0)
    _store_block(out, t21, left, H, C, 2, 1)
    _store_block(out, t30, left, H, C, 3, 0)
    _store_block(out, t31, left, H, C, 3, 1)
    _store_block(out, t32, left, H, C, 3, 2)


def chunk_inverse(key_scores, g, beta, gamma, layout: SequenceLayout, launch: dict | None = None,
                  precision: str | None = None):
    """``T_β`` and (with ``gamma``) ``T_γ``, each ``[N_tok, H, C]`` rows of the chunk's ``[C, C]`` inverse (in the
    type of ``key_scores``). ``precision``: of the block products (``tl.dot``'s ``input_precision``); None picks
    ``"ieee"`` (full float32) for float32 scores and ``"tf32"`` (tensor cores) for 16-bit ones, which are stored
    in 16 bits anyway (a tf32 product rounds to 10 mantissa bits, bfloat16 storage to 7)."""
    if precision is None:
        precision = "ieee" if key_scores.dtype == torch.float32 else "tf32"
    inv_beta = new_buffer(key_scores.shape, key_scores.device, key_scores.dtype)
    inv_gamma = new_buffer(key_scores.shape, key_scores.device, key_scores.dtype) if gamma is not None else None
    heads = key_scores.shape[1]
    chunk_inverse_kernel[(layout.num_chunks, heads, 1 if gamma is None else 2)](
        key_scores=key_scores, g=g, beta=beta, gamma=gamma, inv_beta=inv_beta, inv_gamma=inv_gamma,
        cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, H=heads, C=CHUNK, PRECISION=precision,
        **(launch or {}),
    )
    return inv_beta, inv_gamma
