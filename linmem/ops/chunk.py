"""The chunk backend: the chunk-parallel form of every memory in plain PyTorch (any device, autograd).

The sequence is cut into chunks of C tokens. Inside a chunk, with ``b_t = Σ_{s≤t} g_s`` the cumulative log decay
since the chunk start and ``S_0`` the state before the chunk, every memory is

    S_t = e^{b_t} S_0 + Σ_{s≤t} e^{b_t − b_s} u_s k_sᵀ

for effective writes ``u_s``. The additive rule has ``u_s = β_s v_s``. The delta rule has
``u_t = β_t (v_t − α_t S_{t−1} k_t)``, a unit lower-triangular system over the chunk (the WY/UT representation
of DeltaNet): ``(I + diag(β) A) U = diag(β)(V − diag(e^b) K S_0ᵀ)`` with ``A_ts = e^{b_t − b_s} k_tᵀ k_s`` (s < t).
So ``U = U' − W S_0ᵀ`` where ``U'`` and ``W`` need no state and are solved for all chunks at once; only the
``[V, K]`` state hand-over between chunks is sequential.

A read ``S_{t'} x_t`` (``t' = t`` inclusive, ``t − 1`` strict) is
``S_0 (x_t e^{e_t}) + Σ_s e^{e_t − b_s} (x_tᵀ k_s) u_s`` with ``e_t`` the read's own log decay; every exponent
is ≤ 0 where it is used, so nothing overflows.

RLA/RDN run two such memories: the base pass also yields ``S_{t−1} k_t`` (for r) and ``α_t S_{t−1} q_t``, then
the residual memory runs on values ``r`` with strength γ. Per-key-channel decay (GLA) uses a ``[C, C, K]`` decay
tensor and a smaller chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linmem.ops.config import MemoryConfig
from linmem.ops.step import residual_target

CHUNK_SIZE = 64
CHUNK_SIZE_PER_KEY_DECAY = 16


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H, *]`` → ``[B, H, N, C, *]``, zero-padded to ``N·C`` tokens (a zero token with g = β = 0 and
    k = 0 leaves every state unchanged)."""
    batch, length, heads = x.shape[:3]
    n = max(1, math.ceil(length / chunk))
    x = x.transpose(1, 2)
    pad = n * chunk - length
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(batch, heads, n, chunk, *x.shape[3:])


def from_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, H, N, C, *]`` → ``[B, T, H, *]``."""
    batch, heads, n, chunk = x.shape[:4]
    return x.reshape(batch, heads, n * chunk, *x.shape[4:])[:, :, :length].transpose(1, 2)


class ChunkedKeys:
    """Keys and decays of one sequence batch in chunk layout, with the decay-weighted score matrices that both
    memories of RLA/RDN share (computed once, on first use).

    k: ``[B, H, N, C, K]``; g, b: ``[B, H, N, C]`` (per head) or ``[B, H, N, C, K]`` (per key channel).
    """

    def __init__(self, k: torch.Tensor, g: torch.Tensor):
        self.k = k
        self.g = g
        self.b = g.cumsum(dim=3)
        self.per_key = g.dim() == k.dim()
        chunk = k.shape[3]
        self.causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
        self.strictly_causal = self.causal.tril(-1)
        self._cache: dict[str, torch.Tensor] = {}

    def exp_decay(self, e: torch.Tensor) -> torch.Tensor:
        """``e^{e}`` shaped to multiply a ``[.., C, D]`` tensor row-wise (per head) or elementwise (per key)."""
        return e.exp() if self.per_key else e.exp().unsqueeze(-1)

    def scores(self, x: torch.Tensor, e: torch.Tensor, strict: bool) -> torch.Tensor:
        """``M_ts = e^{e_t − b_s} x_tᵀ k_s`` for ``s ≤ t`` (``s < t`` if strict), else 0: ``[B, H, N, C, C]``."""
        mask = self.strictly_causal if strict else self.causal
        if self.per_key:
            diff = e.unsqueeze(-2) - self.b.unsqueeze(-3)  # [B, H, N, C, C, K]
            decay = torch.where(mask.unsqueeze(-1), diff, float("-inf")).exp()
            return torch.einsum("bhntk,bhnsk,bhntsk->bhnts", x, self.k, decay)
        diff = e.unsqueeze(-1) - self.b.unsqueeze(-2)
        decay = torch.where(mask, diff, float("-inf")).exp()
        return (x @ self.k.transpose(-1, -2)) * decay

    def cached_scores(self, name: str, x: torch.Tensor, e: torch.Tensor, strict: bool) -> torch.Tensor:
        """``scores`` kept under ``name`` (same x and e on every call): the inclusive matrix is kept and the strict
        one derived from it, so RLA/RDN's strict base read and inclusive residual read of q share one."""
        if name not in self._cache:
            self._cache[name] = self.scores(x, e, strict=False)
        inclusive = self._cache[name]
        return inclusive * self.strictly_causal if strict else inclusive

    def keys_to_chunk_end(self) -> torch.Tensor:
        """``e^{b_C − b_s} k_s``: how each key's write reaches the end of its chunk, ``[B, H, N, C, K]``."""
        if "to_end" not in self._cache:
            self._cache["to_end"] = self.exp_decay(self.b[:, :, :, -1:] - self.b) * self.k
        return self._cache["to_end"]

    def key_scores(self) -> torch.Tensor:
        """``A_ts = e^{b_t − b_s} k_tᵀ k_s`` for s < t: the delta rule's in-chunk interaction."""
        return self.cached_scores("keys", self.k, self.b, strict=True)


class ChunkedMemory:
    """One memory run over all chunks: effective writes ``u [B, H, N, C, V]`` and the state before each chunk
    ``starts [B, H, N, V, K]``; ``final [B, H, V, K]`` is the state after the last token."""

    def __init__(self, keys: ChunkedKeys, values: torch.Tensor, strength: torch.Tensor, state0: torch.Tensor,
                 rule: str):
        self.keys = keys
        k, b = keys.k, keys.b
        writes = strength.unsqueeze(-1) * values
        to_end = keys.keys_to_chunk_end()
        chunk_decay = b[:, :, :, -1].exp()  # [B, H, N] or [B, H, N, K]
        if rule == "delta":
            system = torch.eye(k.shape[3], dtype=k.dtype, device=k.device) + strength.unsqueeze(-1) * keys.key_scores()
            solved = torch.linalg.solve_triangular(
                system, torch.cat([writes, strength.unsqueeze(-1) * keys.exp_decay(b) * k], dim=-1),
                upper=False, unitriangular=True,
            )
            writes, state_weights = solved.split([values.shape[-1], k.shape[-1]], dim=-1)
            self.u, self.starts, self.final = self._hand_over_delta(writes, state_weights, to_end, chunk_decay, state0)
        else:
            increments = writes.transpose(-1, -2) @ to_end  # [B, H, N, V, K]
            self.u = writes
            self.starts, self.final = self._hand_over_additive(increments, b[:, :, :, -1], state0)

    def _decay_state(self, state: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
        return state * (decay.unsqueeze(-2) if self.keys.per_key else decay[..., None, None])

    def _hand_over_additive(self, increments, chunk_decay_log, state):
        """Additive states need no loop: ``S_n = e^{P_n} S_0 + Σ_{m<n} e^{P_n − P_{m+1}} ΔS_m`` with ``P_n`` the log
        decay of chunks ``0..n−1``, one small ``[N+1, N]`` weight matrix. ``P`` is summed in float64 so that
        differences of long sums stay exact."""
        total = chunk_decay_log.double().cumsum(dim=2)  # P_{m+1}: [B, H, N] or [B, H, N, K]
        before = torch.cat([torch.zeros_like(total[:, :, :1]), total], dim=2)  # P_n for n = 0..N
        n = total.shape[2]
        reach = torch.ones(n + 1, n, dtype=torch.bool, device=total.device).tril(-1)  # chunk m before state n
        if self.keys.per_key:
            diff = before.unsqueeze(3) - total.unsqueeze(2)  # [B, H, N+1, N, K]
            weights = torch.where(reach.unsqueeze(-1), diff, float("-inf")).exp().to(increments.dtype)
            states = torch.einsum("bhnmk,bhmvk->bhnvk", weights, increments)
            states = states + before.exp().to(state.dtype).unsqueeze(-2) * state.unsqueeze(2)
        else:
            diff = before.unsqueeze(3) - total.unsqueeze(2)  # [B, H, N+1, N]
            weights = torch.where(reach, diff, float("-inf")).exp().to(increments.dtype)
            states = torch.einsum("bhnm,bhmvk->bhnvk", weights, increments)
            states = states + before.exp().to(state.dtype)[..., None, None] * state.unsqueeze(2)
        return states[:, :, :-1], states[:, :, -1]

    # The delta hand-over loop unbinds its inputs along the chunk axis once: indexing chunk n inside the loop
    # would make autograd scatter every chunk's gradient into a full-size zero tensor (quadratic in chunk count).
    def _hand_over_delta(self, writes, state_weights, to_end, chunk_decay, state):
        starts, us = [], []
        chunks = zip(writes.unbind(2), state_weights.unbind(2), to_end.unbind(2), chunk_decay.unbind(2))
        for write, weight, reach, decay in chunks:
            starts.append(state)
            u = write - weight @ state.transpose(-1, -2)  # U = U' − W S_0ᵀ
            us.append(u)
            state = self._decay_state(state, decay) + u.transpose(-1, -2) @ reach
        return torch.stack(us, dim=2), torch.stack(starts, dim=2), state

    def read(self, x: torch.Tensor, e: torch.Tensor, strict: bool, cache_as: str | None = None) -> torch.Tensor:
        """``S_{t'} x_t`` scaled by ``e^{e_t − b_t'}``: ``[B, H, N, C, V]``. See the module docstring."""
        keys = self.keys
        scores = keys.cached_scores(cache_as, x, e, strict) if cache_as else keys.scores(x, e, strict)
        from_start = torch.einsum("bhnck,bhnvk->bhncv", keys.exp_decay(e) * x, self.starts)
        return from_start + scores @ self.u


def read_queries_of_both(base: ChunkedMemory, residual: ChunkedMemory, q: torch.Tensor):
    """``α_t S_{t−1} q_t`` and ``R_t q_t`` (``[B, H, N, C, V]`` each) in one pass over the shared query scores: the
    two memories' states and writes are stacked along V, and the strict base read drops the diagonal term."""
    keys = base.keys
    scores = keys.cached_scores("queries", q, keys.b, strict=False)
    starts = torch.cat([base.starts, residual.starts], dim=-2)
    writes = torch.cat([base.u, residual.u], dim=-1)
    both = torch.einsum("bhnck,bhnvk->bhncv", keys.exp_decay(keys.b) * q, starts) + scores @ writes
    base_read, residual_read = both.split(base.u.shape[-1], dim=-1)
    own_write = scores.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * base.u  # s = t: not yet in S_{t−1}
    return base_read - own_write, residual_read


def chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor | None,
    base_state: torch.Tensor,
    residual_state: torch.Tensor | None,
    config: MemoryConfig,
    scale: float,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as ``reference_forward``: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, gates ``[B, T, H]``
    (``g`` may be ``[B, T, H, K]``), states ``[B, H, V, K]``; returns ``o [B, T, H, V]`` and the final states."""
    length = q.shape[1]
    if length == 0:
        return v.new_zeros(v.shape), base_state, residual_state
    per_key = g.dim() == 4
    chunk = chunk_size or (CHUNK_SIZE_PER_KEY_DECAY if per_key else CHUNK_SIZE)
    qc, kc, vc, gc, betac = (to_chunks(t, chunk) for t in (q, k, v, g, beta))
    keys = ChunkedKeys(kc, gc)
    base = ChunkedMemory(keys, vc, betac, base_state, config.rule)
    if not config.residual:
        o = base.read(qc, keys.b, strict=False, cache_as="queries")
        return from_chunks(scale * o, length), base.final, None

    gammac = to_chunks(gamma, chunk)
    before_step = keys.b - gc  # log decay from the chunk start to t − 1
    r = residual_target(vc - base.read(kc, before_step, strict=True), config.residual_target, config.clip)
    if config.fit_history:
        residual = ChunkedMemory(keys, r, gammac, residual_state, config.rule)
        residual_final = residual.final
        if config.output_gates:
            base_read, residual_read = read_queries_of_both(base, residual, qc)
        else:
            base_read = base.read(qc, before_step, strict=True)  # S_{t−1} q_t
            residual_read = residual.read(qc, keys.b, strict=False, cache_as="queries")
    else:  # R_t = r_t k_tᵀ: only this step's correction
        if config.output_gates:
            base_read = base.read(qc, keys.b, strict=True, cache_as="queries")  # α_t S_{t−1} q_t
        else:
            base_read = base.read(qc, before_step, strict=True)  # S_{t−1} q_t
        residual_read = r * (qc * kc).sum(-1, keepdim=True)
        last = from_chunks(r, length)[:, -1], from_chunks(kc, length)[:, -1]
        residual_final = torch.einsum("bhv,bhk->bhvk", *last)
    if config.output_gates:
        residual_read = gammac.unsqueeze(-1) * residual_read
    return from_chunks(scale * (base_read + residual_read), length), base.final, residual_final
