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
the residual memory runs on values ``r`` with strength γ, and one query read-out serves both memories. The score
matrices and the reads are hand-differentiated functions (``chunk_reads.py``), and so are the additive hand-over
and RLA with the paper's switches and per-head decay, as one function (``chunk_fused.py``); the rest is autograd.
Per-key-channel decay (GLA) uses a ``[C, C, K]`` decay tensor and a smaller chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linmem.ops.chunk_fused import AdditiveHandOver, ResidualAdditive
from linmem.ops.chunk_reads import DecayedScores, KeyReadTarget, QueryRead
from linmem.ops.config import MemoryConfig

CHUNK_SIZE = 64
CHUNK_SIZE_PER_KEY_DECAY = 16


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H, *]`` → ``[B, H, N, C, *]``, zero-padded to ``N·C`` tokens (a zero token with g = β = 0 and
    k = 0 leaves every state unchanged). Contiguous: one copy here instead of one in every matrix product."""
    batch, length, heads = x.shape[:3]
    n = max(1, math.ceil(length / chunk))
    x = x.transpose(1, 2)
    pad = n * chunk - length
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(batch, heads, n, chunk, *x.shape[3:]).contiguous()


def from_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, H, N, C, *]`` → ``[B, T, H, *]``."""
    batch, heads, n, chunk = x.shape[:4]
    return x.reshape(batch, heads, n * chunk, *x.shape[4:])[:, :, :length].transpose(1, 2)


class ChunkedKeys:
    """Keys and decays of one sequence batch in chunk layout, with the decay-weighted score matrices that both
    memories of RLA/RDN share (computed once, on first use).

    k: ``[B, H, N, C, K]``; g, b: ``[B, H, N, C]`` (per head) or ``[B, H, N, C, K]`` (per key channel).
    ``key_scores_needed`` names the strict key-key matrices that will be asked for (``"delta"``: the delta rule's
    in-chunk interaction; ``"read"``: the strict read ``S_{t−1} k_t`` of RLA/RDN), so that one product ``k kᵀ``
    gives them all.
    """

    def __init__(self, k: torch.Tensor, g: torch.Tensor, key_scores_needed: tuple[str, ...] = ()):
        self.k = k
        self.g = g
        self.b = g.cumsum(dim=3)
        self.before_step = self.b - g  # log decay from the chunk start to t − 1
        self.per_key = g.dim() == k.dim()
        self.key_scores_needed = key_scores_needed
        chunk = k.shape[3]
        self.causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
        self.strictly_causal = self.causal.tril(-1)
        self._cache: dict[str, torch.Tensor] = {}

    def exp_decay(self, e: torch.Tensor) -> torch.Tensor:
        """``e^{e}`` shaped to multiply a ``[.., C, D]`` tensor row-wise (per head) or elementwise (per key)."""
        return e.exp() if self.per_key else e.exp().unsqueeze(-1)

    def scores(self, x: torch.Tensor, e: torch.Tensor, strict: bool) -> torch.Tensor:
        """``M_ts = e^{e_t − b_s} x_tᵀ k_s`` for ``s ≤ t`` (``s < t`` if strict), else 0: ``[B, H, N, C, C]``."""
        if self.per_key:
            mask = self.strictly_causal if strict else self.causal
            diff = e.unsqueeze(-2) - self.b.unsqueeze(-3)  # [B, H, N, C, C, K]
            decay = torch.where(mask.unsqueeze(-1), diff, float("-inf")).exp()
            return torch.einsum("bhntk,bhnsk,bhntsk->bhnts", x, self.k, decay)
        return DecayedScores.apply(x, self.k, self.b, strict, e)[0]

    def keys_to_chunk_end(self) -> torch.Tensor:
        """``e^{b_C − b_s} k_s``: how each key's write reaches the end of its chunk, ``[B, H, N, C, K]``."""
        if "to_end" not in self._cache:
            self._cache["to_end"] = self.exp_decay(self.b[:, :, :, -1:] - self.b) * self.k
        return self._cache["to_end"]

    def _strict_key_scores(self, name: str) -> torch.Tensor:
        """Strict key-key matrices, all that this run needs from one product ``k kᵀ``: ``"delta"`` (``e = b``) and
        ``"read"`` (``e = b − g``, the decay up to t − 1)."""
        if name not in self._cache:
            exponents = {"delta": self.b, "read": self.before_step}
            wanted = {n: e for n, e in exponents.items() if n == name or n in self.key_scores_needed}
            if self.per_key:
                found = {n: self.scores(self.k, e, strict=True) for n, e in wanted.items()}
            else:
                found = dict(zip(wanted, DecayedScores.apply(None, self.k, self.b, True, *wanted.values())))
            self._cache.update(found)
        return self._cache[name]

    def key_scores(self) -> torch.Tensor:
        """``A_ts = e^{b_t − b_s} k_tᵀ k_s`` for s < t: the delta rule's in-chunk interaction."""
        return self._strict_key_scores("delta")

    def key_read_scores(self) -> torch.Tensor:
        """``e^{b_{t−1} − b_s} k_tᵀ k_s`` for s < t: the in-chunk part of the strict read ``S_{t−1} k_t``."""
        return self._strict_key_scores("read")


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
            increments = writes.mT @ to_end  # [B, H, N, V, K]
            self.u = writes
            if keys.per_key:
                self.starts = self._hand_over_per_key(increments, b[:, :, :, -1], state0)
                self.final = self._decay_state(self.starts[:, :, -1], chunk_decay[:, :, -1]) + increments[:, :, -1]
            else:
                self.starts, self.final = AdditiveHandOver.apply(increments, b[:, :, :, -1], state0)

    def _decay_state(self, state: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
        return state * (decay.unsqueeze(-2) if self.keys.per_key else decay[..., None, None])

    def _hand_over_per_key(self, increments, chunk_decay_log, state):
        """Additive states with per-key decay need no loop either: ``S_n = e^{P_n} S_0 + Σ_{m<n} e^{P_n − P_{m+1}}
        ΔS_m`` per key channel, with ``P_n`` the log decay of chunks ``0..n−1`` summed in float64 (see
        ``chunk_fused.hand_over`` for per-head decay)."""
        total = chunk_decay_log.double().cumsum(dim=2)  # P_{m+1}: [B, H, N, K]
        before = torch.cat([torch.zeros_like(total[:, :, :1]), total[:, :, :-1]], dim=2)  # P_n for n = 0..N-1
        n = total.shape[2]
        reach = torch.ones(n, n, dtype=torch.bool, device=total.device).tril(-1)  # chunk m before state n
        diff = before.unsqueeze(3) - total.unsqueeze(2)  # [B, H, N, N, K]
        weights = torch.where(reach.unsqueeze(-1), diff, float("-inf")).exp().to(increments.dtype)
        states = torch.einsum("bhnmk,bhmvk->bhnvk", weights, increments)
        if not state.requires_grad and not state.any():  # no initial state: its term is zero
            return states
        return states + self._decay_state(state.unsqueeze(2), before.exp().to(state.dtype))

    # The delta hand-over loop unbinds its inputs along the chunk axis once: indexing chunk n inside the loop
    # would make autograd scatter every chunk's gradient into a full-size zero tensor (quadratic in chunk count).
    def _hand_over_delta(self, writes, state_weights, to_end, chunk_decay, state):
        starts, us = [], []
        chunks = zip(writes.unbind(2), state_weights.unbind(2), to_end.unbind(2), chunk_decay.unbind(2))
        for write, weight, reach, decay in chunks:
            starts.append(state)
            u = write - weight @ state.mT  # U = U' − W S_0ᵀ
            us.append(u)
            state = self._decay_state(state, decay) + u.mT @ reach
        return torch.stack(us, dim=2), torch.stack(starts, dim=2), state

    def read(self, x: torch.Tensor, e: torch.Tensor, strict: bool) -> torch.Tensor:
        """``S_{t'} x_t`` scaled by ``e^{e_t − b_t'}``: ``[B, H, N, C, V]``. See the module docstring."""
        keys = self.keys
        return QueryRead.apply(x, keys.exp_decay(e), keys.scores(x, e, strict), self.starts, self.u)

    def residual_target(self, values: torch.Tensor, config: MemoryConfig) -> torch.Tensor:
        """``r = ρ(v − S_{t−1} k_t)``, the residual memory's values: ``[B, H, N, C, V]``."""
        keys = self.keys
        return KeyReadTarget.apply(keys.k, keys.exp_decay(keys.before_step), keys.key_read_scores(), self.starts,
                                   self.u, values, config.residual_target, config.clip)


def read_queries_of_both(base: ChunkedMemory, residual: ChunkedMemory, q: torch.Tensor, e: torch.Tensor,
                         gamma: torch.Tensor) -> torch.Tensor:
    """``α_t S_{t−1} q_t + γ_t R_t q_t`` (times ``e^{e_t − b_t}``), ``[B, H, N, C, V]``, from one query score
    matrix: the strict base read drops its diagonal."""
    keys = base.keys
    scores = keys.scores(q, e, strict=False)
    return QueryRead.apply(q, keys.exp_decay(e), scores, base.starts, base.u, residual.starts, residual.u, gamma)


def output(o: torch.Tensor, rest: float, length: int) -> torch.Tensor:
    """``rest · o`` in the ``[B, T, H, V]`` layout (``rest``: what the queries did not carry of the scale)."""
    return from_chunks(o if rest == 1.0 else rest * o, length)


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
    # A positive read-out scale rides in the queries' log decay (e^{e + log scale}), which saves a pass over o;
    # any other scale multiplies o at the end.
    read_scale, rest = (scale, 1.0) if scale > 0 else (1.0, scale)
    log_scale = math.log(read_scale)
    paper_rla = config.rule == "additive" and config.residual and config.fit_history and config.output_gates
    if paper_rla and not per_key:  # in one hand-differentiated function
        b = gc.cumsum(dim=3)
        o, base_final, residual_final = ResidualAdditive.apply(
            qc, kc, vc, betac, to_chunks(gamma, chunk), b, b - gc, base_state, residual_state, read_scale,
            config.residual_target, config.clip)
        return output(o, rest, length), base_final, residual_final
    needed = ("delta",) * (config.rule == "delta") + ("read",) * config.residual
    keys = ChunkedKeys(kc, gc, needed)
    now, before = keys.b + log_scale, keys.before_step + log_scale  # S_t q_t (α_t S_{t−1} q_t if strict), S_{t−1} q_t
    base = ChunkedMemory(keys, vc, betac, base_state, config.rule)
    if not config.residual:
        o = base.read(qc, now, strict=False)
        return output(o, rest, length), base.final, None

    gammac = to_chunks(gamma, chunk)
    r = base.residual_target(vc, config)
    if config.fit_history:
        residual = ChunkedMemory(keys, r, gammac, residual_state, config.rule)
        residual_final = residual.final
        if config.output_gates:  # α_t S_{t−1} q_t + γ_t R_t q_t
            o = read_queries_of_both(base, residual, qc, now, gammac)
        else:  # S_{t−1} q_t + R_t q_t
            o = base.read(qc, before, strict=True) + residual.read(qc, now, strict=False)
    else:  # R_t = r_t k_tᵀ: only this step's correction
        own = r * ((qc * kc).sum(-1, keepdim=True) * read_scale)  # R_t q_t
        if config.output_gates:
            o = torch.addcmul(base.read(qc, now, strict=True), gammac.unsqueeze(-1), own)
        else:
            o = base.read(qc, before, strict=True) + own
        last = from_chunks(r, length)[:, -1], from_chunks(kc, length)[:, -1]
        residual_final = torch.einsum("bhv,bhk->bhvk", *last)
    return output(o, rest, length), base.final, residual_final
