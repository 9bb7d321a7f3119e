"""Per-chunk preparation shared by both memories: the in-chunk cumulative log decay and the decayed score matrices.

For chunk-local positions t, s with ``b_t = Σ_{s'≤t} g_{s'}`` and ``bm_t = b_t − g_t`` (the decay up to t − 1):

- ``key_scores``   ``A'_ts = e^{bm_t − b_s} k_tᵀk_s`` (s < t): reads ``S_{t−1}k_t`` inside the chunk; the delta rule's
  ``A = diag(α) A'`` is built from it (inverse.py);
- ``base_scores``  ``e^{e_t − b_s} q_tᵀk_s`` on the base read's mask: s < t and ``e = b`` (``α_t S_{t−1}q_t``) with a
  residual memory, ``e = bm`` without output gates; s ≤ t and ``e = b`` without a residual memory (``S_t q_t``);
- ``res_scores``   ``e^{b_t − b_s} q_tᵀk_s`` (s ≤ t): the residual read ``R_t q_t``.

Each is stored as ``[N_tok, H, C]``: row t of its chunk's ``[C, C]`` matrix. One program per (chunk, head); the key
axis is summed in blocks of at most 64 columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.triton.layout import CHUNK, SequenceLayout, dot_dtype, key_tiling, new_buffer, score_dtype
from linmem.ops.triton.primitives import (
    at_token,
    chunk_at,
    decay,
    given,
    key_block,
    mm_acc,
    store_rows,
    store_token_gate,
    token_gate,
)


@triton.heuristics(given(KEY_SCORES="key_scores", RESIDUAL="res_scores"))
@triton.jit
def chunk_scores_kernel(
    q, k, g, b_out, key_scores, base_scores, res_scores, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, DT: tl.constexpr,
    KEY_SCORES: tl.constexpr, RESIDUAL: tl.constexpr, OUTPUT_GATES: tl.constexpr,
):
    """b and the score rows of one chunk and head: ``key_scores`` where given, ``res_scores`` (and the base read's
    masks of a memory with a residual one) where given."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, tok, n_valid = chunk_at(cu_seqlens, chunk_indices, i_c, C)
    q = at_token(q, tok, i_h, H, K)
    k = at_token(k, tok, i_h, H, K)
    pos = tl.arange(0, C)
    m_t = pos < n_valid

    gate = token_gate(g, tok, i_h, pos, m_t, H)
    b = tl.cumsum(gate, 0)
    bm = b - gate
    store_token_gate(b_out, b, tok, i_h, pos, m_t, H)

    kk = tl.zeros([C, C], dtype=tl.float32)
    qk = tl.zeros([C, C], dtype=tl.float32)
    for i in tl.static_range(NK):
        kb = key_block(k, pos, m_t, H, K, BK, i)
        if KEY_SCORES:
            kk = mm_acc(kk, kb, tl.trans(kb), DT)
        qk = mm_acc(qk, key_block(q, pos, m_t, H, K, BK, i), tl.trans(kb), DT)
    strict = pos[:, None] > pos[None, :]
    causal = pos[:, None] >= pos[None, :]
    all_c = pos < C
    if KEY_SCORES:
        store_rows(at_token(key_scores, tok, i_h, H, C), kk * decay(bm, b, strict), pos, m_t, H, C, pos, all_c)
    base_scores = at_token(base_scores, tok, i_h, H, C)
    if RESIDUAL:
        if OUTPUT_GATES:
            store_rows(base_scores, qk * decay(b, b, strict), pos, m_t, H, C, pos, all_c)
        else:
            store_rows(base_scores, qk * decay(bm, b, strict), pos, m_t, H, C, pos, all_c)
        store_rows(at_token(res_scores, tok, i_h, H, C), qk * decay(b, b, causal), pos, m_t, H, C, pos, all_c)
    else:
        store_rows(base_scores, qk * decay(b, b, causal), pos, m_t, H, C, pos, all_c)


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
    bk, nk = key_tiling(key_dim)
    chunk_scores_kernel[(layout.num_chunks, heads)](
        q=q, k=k, g=g, b_out=b, key_scores=key_scores, base_scores=base_scores, res_scores=res_scores,
        cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices,
        H=heads, K=key_dim, C=CHUNK, BK=bk, NK=nk, DT=dot_dtype(k.dtype), OUTPUT_GATES=output_gates,
        **(launch or {}),
    )
    return b, key_scores, base_scores, res_scores
