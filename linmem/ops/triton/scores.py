"""Per-chunk preparation shared by both memories: the in-chunk cumulative log decay and the decayed score matrices.

For chunk-local positions t, s with ``b_t = Σ_{s'≤t} g_{s'}`` and ``bm_t = b_t − g_t`` (the decay up to t − 1):

- ``key_scores``   ``A'_ts = e^{bm_t − b_s} k_tᵀk_s`` (s < t): reads ``S_{t−1}k_t`` inside the chunk; the delta rule's
  ``A = diag(α) A'`` is built from it (inverse.py);
- ``base_scores``  ``e^{e_t − b_s} q_tᵀk_s`` on the base read's mask: s < t and ``e = b`` (``α_t S_{t−1}q_t``) with a
  residual memory, ``e = bm`` without output gates; s ≤ t and ``e = b`` without a residual memory (``S_t q_t``);
- ``res_scores``   ``e^{b_t − b_s} q_tᵀk_s`` (s ≤ t): the residual read ``R_t q_t``.

Each is stored as ``[N_tok, H, C]``: row t of its chunk's ``[C, C]`` matrix.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.layout import CHUNK, SequenceLayout, dot_dtype, key_block, new_buffer, score_dtype
from linmem.ops.triton.primitives import decay, load_gate, load_tile, mm, sequence_start, store_rows


@triton.jit
def chunk_scores_kernel(
    q, k, g, b_out, key_scores, base_scores, res_scores, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
    KEY_SCORES: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    length = (eos - bos).to(tl.int32)
    q = sequence_start(q, bos, i_h, H, K)
    k = sequence_start(k, bos, i_h, H, K)
    g = sequence_start(g, bos, i_h, H, 1)
    b_out = sequence_start(b_out, bos, i_h, H, 1)
    key_scores = sequence_start(key_scores, bos, i_h, H, C)
    base_scores = sequence_start(base_scores, bos, i_h, H, C)
    res_scores = sequence_start(res_scores, bos, i_h, H, C)
    pos = tl.arange(0, C)
    r = j * C + pos
    m_t = r < length

    gate = load_gate(g, r, m_t, H)
    b = tl.cumsum(gate, 0)
    bm = b - gate
    tl.store(b_out + r * H, b, mask=m_t)

    cols = tl.arange(0, BK)
    m_k = cols < K
    kb = load_tile(k, r, m_t, H, K, cols, m_k)
    qb = load_tile(q, r, m_t, H, K, cols, m_k)
    strict = pos[:, None] > pos[None, :]
    causal = pos[:, None] >= pos[None, :]
    all_c = pos < C
    if KEY_SCORES:
        kk = mm(kb, tl.trans(kb), DT)
        store_rows(key_scores, kk * decay(bm, b, strict), r, m_t, H, C, pos, all_c)
    qk = mm(qb, tl.trans(kb), DT)
    if RESIDUAL:
        if OUTPUT_GATES:
            store_rows(base_scores, qk * decay(b, b, strict), r, m_t, H, C, pos, all_c)
        else:
            store_rows(base_scores, qk * decay(bm, b, strict), r, m_t, H, C, pos, all_c)
        store_rows(res_scores, qk * decay(b, b, causal), r, m_t, H, C, pos, all_c)
    else:
        store_rows(base_scores, qk * decay(b, b, causal), r, m_t, H, C, pos, all_c)


def chunk_scores(q, k, g, layout: SequenceLayout, *, delta: bool, residual: bool, output_gates: bool,
                 launch: dict | None = None):
    """``q, k [N_tok, H, K]``, ``g [N_tok, H]`` float32 → ``b [N_tok, H]`` and the score rows (module docstring);
    ``key_scores`` is None when neither the delta rule nor a residual memory needs it, ``res_scores`` None without
    a residual memory."""
    n_tok, heads, key_dim = k.shape
    b = new_buffer((n_tok, heads), k.device)
    rows = lambda: new_buffer((n_tok, heads, CHUNK), k.device, score_dtype(k.dtype))  # noqa: E731
    key_scores = rows() if (delta or residual) else None
    base_scores = rows()
    res_scores = rows() if residual else None
    chunk_scores_kernel[(layout.num_chunks, heads)](
        q, k, g, b, key_scores if key_scores is not None else b, base_scores,
        res_scores if res_scores is not None else b, layout.cu_seqlens, layout.chunk_indices,
        H=heads, K=key_dim, C=CHUNK, BK=key_block(key_dim), DT=dot_dtype(k.dtype),
        KEY_SCORES=key_scores is not None, RESIDUAL=residual, OUTPUT_GATES=output_gates, **(launch or {}),
    )
    return b, key_scores, base_scores, res_scores
