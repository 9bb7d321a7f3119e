"""The gradients of the gates: dβ and dγ as sums of their partial sums, and dg from the gradients of the in-chunk
cumulative log decays.

``b_t = Σ_{s≤t} g_s`` and ``bm_t = b_t − g_t`` inside a chunk, so ``dg_s = Σ_{t≥s} db_t + Σ_{t>s} dbm_t``: reversed
cumulative sums per chunk, after adding up the partial sums (one per key block, one from the score kernel) and the
chunk-end term ``db_C`` at the chunk's last token. One program per (chunk, head).
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import at_token, chunk_at, given, store_token_gate


@triton.jit
def _part_sum(part, part_stride, tok, i_h, pos, m_t, H: tl.constexpr, PARTS: tl.constexpr):
    """Σ over the PARTS slots (``part_stride`` elements apart) of a ``[PARTS, N_tok, H]`` partial sum."""
    ptr = at_token(part, tok, i_h, H, 1)
    total = tl.load(ptr + pos * H, mask=m_t, other=0.0)
    for _ in tl.static_range(PARTS - 1):
        ptr += part_stride
        total += tl.load(ptr + pos * H, mask=m_t, other=0.0)
    return total


@triton.heuristics(given(RESIDUAL="dgamma"))
@triton.jit
def decay_grad_kernel(db_part, dbm_part, dbeta_part, dgamma_part, db_end_part, dg, dbeta, dgamma, part_stride,
                      cu_seqlens, chunk_indices, n_chunks_total,
                      H: tl.constexpr, C: tl.constexpr, PARTS: tl.constexpr, END_PARTS: tl.constexpr,
                      RESIDUAL: tl.constexpr):
    """dg, dβ and (where ``dgamma`` and ``dgamma_part`` are given: RLA/RDN) dγ of one chunk and head."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    pos = tl.arange(0, C)
    m_t = pos < n_valid
    d_b = _part_sum(db_part, part_stride, tok, i_h, pos, m_t, H, PARTS)
    d_bm = _part_sum(dbm_part, part_stride, tok, i_h, pos, m_t, H, PARTS)
    store_token_gate(dbeta, _part_sum(dbeta_part, part_stride, tok, i_h, pos, m_t, H, PARTS), tok, i_h, pos, m_t, H)
    if RESIDUAL:
        store_token_gate(dgamma, _part_sum(dgamma_part, part_stride, tok, i_h, pos, m_t, H, PARTS), tok, i_h, pos,
                         m_t, H)
    d_end = 0.0
    for p in tl.static_range(END_PARTS):
        d_end += tl.load(db_end_part + (i_c.to(tl.int64) + p * n_chunks_total) * H + i_h)
    d_b += tl.where(pos == n_valid - 1, d_end, 0.0)
    # dg_s = Σ_{t≥s} db_t + Σ_{t>s} dbm_t, as masked column sums (no cancellation between large partial sums)
    after = pos[:, None] >= pos[None, :]
    d_g = tl.sum(tl.where(after, d_b[:, None], 0.0), 0) + tl.sum(tl.where(after & (pos[:, None] != pos[None, :]),
                                                                          d_bm[:, None], 0.0), 0)
    store_token_gate(dg, d_g, tok, i_h, pos, m_t, H)
