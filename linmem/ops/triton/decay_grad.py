"""The gradient of the log decay g from the gradients of its in-chunk cumulative sums.

``b_t = Σ_{s≤t} g_s`` and ``bm_t = b_t − g_t`` inside a chunk, so ``dg_s = Σ_{t≥s} db_t + Σ_{t>s} dbm_t``: reversed
cumulative sums per chunk, after adding up the partial sums (one per key block, one from the score kernel)
and the chunk-end term ``db_{C}`` at the chunk's last token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.primitives import sequence_start


@triton.jit
def decay_grad_kernel(db_part, dbm_part, db_end_part, dg, cu_seqlens, chunk_indices, n_tok, n_chunks_total,
                      H: tl.constexpr, C: tl.constexpr, PARTS: tl.constexpr, END_PARTS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    length = (eos - bos).to(tl.int32)
    db_part = sequence_start(db_part, bos, i_h, H, 1)
    dbm_part = sequence_start(dbm_part, bos, i_h, H, 1)
    dg = sequence_start(dg, bos, i_h, H, 1)
    pos = tl.arange(0, C)
    r = j * C + pos
    m_t = r < length
    last = tl.minimum(j * C + C, length) - 1
    d_b = tl.zeros([C], dtype=tl.float32)
    d_bm = tl.zeros([C], dtype=tl.float32)
    for p in tl.static_range(PARTS):
        d_b += tl.load(db_part + p * n_tok * H + r * H, mask=m_t, other=0.0)
        d_bm += tl.load(dbm_part + p * n_tok * H + r * H, mask=m_t, other=0.0)
    d_end = 0.0
    for p in tl.static_range(END_PARTS):
        d_end += tl.load(db_end_part + (p * n_chunks_total + i_c) * H + i_h)
    d_b += tl.where(r == last, d_end, 0.0)
    # dg_s = Σ_{t≥s} db_t + Σ_{t>s} dbm_t, as masked column sums (no cancellation between large partial sums)
    after = pos[:, None] >= pos[None, :]
    d_g = tl.sum(tl.where(after, d_b[:, None], 0.0), 0) + tl.sum(tl.where(after & (pos[:, None] != pos[None, :]),
                                                                          d_bm[:, None], 0.0), 0)
    tl.store(dg + r * H, d_g, mask=m_t)
