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
``S_0 (x_t e^{e_t}) + Σ_s e^{e_t − b_s} (x_tᵀ k_s) u_s`` with ``e_t`` the read's own log decay.

Every decay factor is ``e^{Σ g}`` over its own segment of tokens, summed directly: ``b_t`` from the chunk start,
``b_{t−1}``, the suffix to the chunk end, the in-chunk ``Σ_{s<j≤t} g_j`` (``chunk_reads.segment_decay``), and
the hand-over one chunk after the other. No exponent is the difference of two cumulative sums, so no huge decay
cancels against another: ``g = −1e30`` and ``g = −∞`` (α = 0, a reset) are exact and leave the tokens before
them untouched, and nothing overflows. Gradients are formed for ``b`` and ``b_{t−1}`` (linear, no cancellation)
and mapped to g (``chunk_reads.log_decay_grad``); at ``g = −∞`` the gradient of g is what the product rule gives,
``e^{g}·(…) = 0``, as in ``reference``.

RLA/RDN run two such memories: the base pass also yields ``S_{t−1} k_t`` (for r) and ``α_t S_{t−1} q_t``, then
the residual memory runs on values ``r`` with strength γ, and one query read-out serves both memories. The score
matrices and the reads are hand-differentiated functions (``chunk_reads.py``), and so are the additive hand-over
and RLA with the paper's switches and per-head decay, as one function (``chunk_fused.py``); the rest is autograd.
Per-key-channel decay (GLA) uses ``[C, C, K]`` decays formed a slice of chunks at a time
(``chunk_reads.PerKeyDecayedScores``) and a smaller chunk: time and memory linear in T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linmem.ops.backend import Backend, MemoryInputs
from linmem.ops.chunk_fused import AdditiveHandOver, PerKeyAdditiveRead, ResidualAdditive
from linmem.ops.chunk_reads import (
    DecayedScores,
    KeyReadTarget,
    PerKeyDecayedScores,
    QueryRead,
    exclusive_cumsum,
    reverse_cumsum,
)
from linmem.ops.config import MemoryConfig

CHUNK_SIZE = 64
CHUNK_SIZE_PER_KEY_DECAY = 16
# Longer sequences run as consecutive segments of this many tokens, the state handed from one to the next: the
# same math with smaller temporaries. At B = 1, H = 4, K = 64 a segment's float32 [B, H, N, C, C] scores are
# 8 MB; a whole 32K sequence's would be 32 MB, past glibc's largest heap-reuse size (32 MiB), so each such
# temporary would be mapped fresh from the OS and zero-filled on every call (the time per token then steps up).
SEGMENT_LENGTH = 8192


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

    k: ``[B, H, N, C, K]``; g, b (``Σ_{j≤t} g_j``), before_step (``Σ_{j<t} g_j``): ``[B, H, N, C]`` (per head) or
    ``[B, H, N, C, K]`` (per key channel), each summed from the chunk start (no differences, see the module).
    ``key_scores_needed`` names the strict key-key matrices that will be asked for (``"delta"``: the delta rule's
    in-chunk interaction; ``"read"``: the strict read ``S_{t−1} k_t`` of RLA/RDN), so that one product ``k kᵀ``
    gives them all.
    """

    def __init__(self, k: torch.Tensor, g: torch.Tensor, key_scores_needed: tuple[str, ...] = ()):
        self.k = k
        self.g = g
        self.b = g.cumsum(dim=3)
        self.per_key = g.dim() == k.dim()
        self.key_scores_needed = key_scores_needed
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def before_step(self) -> torch.Tensor:
        """``Σ_{j<t} g_j``, the log decay from the chunk start to t − 1 (formed when a strict read needs it)."""
        if "before_step" not in self._cache:
            self._cache["before_step"] = exclusive_cumsum(self.g, 3)
        return self._cache["before_step"]

    def exp_decay(self, e: torch.Tensor) -> torch.Tensor:
        """``e^{e}`` shaped to multiply a ``[.., C, D]`` tensor row-wise (per head) or elementwise (per key)."""
        return e.exp() if self.per_key else e.exp().unsqueeze(-1)

    def log_decay(self, kind: str) -> torch.Tensor:
        """The log decay from the chunk start of a read of ``S_t`` (kind ``"now"``: b) or ``S_{t−1}``
        (``"before"``)."""
        return self.b if kind == "now" else self.before_step

    def scores(self, x: torch.Tensor, kind: str, strict: bool, scale: float = 1.0) -> torch.Tensor:
        """``M_ts = scale · e^{e_t − b_s} x_tᵀ k_s`` for ``s ≤ t`` (``s < t`` if strict), else 0, with ``e = b``
        (kind ``"now"``) or ``b_{t−1}`` (``"before"``): ``[B, H, N, C, C]``."""
        if self.per_key:
            return PerKeyDecayedScores.apply(x, self.k, self.g, strict, scale, kind)
        return DecayedScores.apply(x, self.k, self.g, strict, scale, kind)[0]

    def keys_to_chunk_end(self) -> torch.Tensor:
        """``e^{b_C − b_s} k_s``: how each key's write reaches the end of its chunk, ``[B, H, N, C, K]``; the
        exponent is the sum of the later log decays, ``Σ_{j>s} g_j``."""
        if "to_end" not in self._cache:
            self._cache["to_end"] = self.exp_decay(reverse_cumsum(self.g, 3, exclusive=True)) * self.k
        return self._cache["to_end"]

    def _strict_key_scores(self, name: str) -> torch.Tensor:
        """Strict key-key matrices, all that this run needs from one product ``k kᵀ``: ``"delta"`` (``e = b``) and
        ``"read"`` (``e = b_{t−1}``, the decay up to t − 1)."""
        if name not in self._cache:
            kinds = {"delta": "now", "read": "before"}
            wanted = {n: kind for n, kind in kinds.items() if n == name or n in self.key_scores_needed}
            if self.per_key:
                found = {n: self.scores(self.k, kind, strict=True) for n, kind in wanted.items()}
            else:
                found = dict(zip(wanted, DecayedScores.apply(None, self.k, self.g, True, 1.0, *wanted.values())))
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
            self.starts, self.final = AdditiveHandOver.apply(increments, b[:, :, :, -1], state0)

    def _decay_state(self, state: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
        return state * (decay.unsqueeze(-2) if self.keys.per_key else decay[..., None, None])

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

    def read(self, x: torch.Tensor, kind: str, strict: bool, scale: float) -> torch.Tensor:
        """``scale · S_t x_t`` (kind ``"now"``), ``scale · α_t S_{t−1} x_t`` (``"now"``, strict) or
        ``scale · S_{t−1} x_t`` (``"before"``, strict): ``[B, H, N, C, V]``. See the module docstring."""
        keys = self.keys
        decay = keys.exp_decay(keys.log_decay(kind) + math.log(scale))
        return QueryRead.apply(x, decay, keys.scores(x, kind, strict, scale), self.starts, self.u)

    def residual_values(self, values: torch.Tensor, config: MemoryConfig) -> torch.Tensor:
        """``r = ρ(v − S_{t−1} k_t)``, the residual memory's values: ``[B, H, N, C, V]``."""
        keys = self.keys
        return KeyReadTarget.apply(keys.k, keys.exp_decay(keys.before_step), keys.key_read_scores(), self.starts,
                                   self.u, values, config.residual_target, config.clip)


def read_queries_of_both(base: ChunkedMemory, residual: ChunkedMemory, q: torch.Tensor, gamma: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """``scale · (α_t S_{t−1} q_t + γ_t R_t q_t)``, ``[B, H, N, C, V]``, from one query score matrix: the strict
    base read drops its diagonal."""
    keys = base.keys
    scores = keys.scores(q, "now", strict=False, scale=scale)
    decay = keys.exp_decay(keys.b + math.log(scale))
    return QueryRead.apply(q, decay, scores, base.starts, base.u, residual.starts, residual.u, gamma)


def per_key_additive_read(keys: ChunkedKeys, values: torch.Tensor, strength: torch.Tensor, state0: torch.Tensor,
                          q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GLA: ``scale · S_t q_t`` ``[B, H, N, C, V]`` and the final state of an additive memory with per-key decay,
    its chunk states read and handed over chunk after chunk (``PerKeyAdditiveRead``) instead of stored."""
    writes = strength.unsqueeze(-1) * values
    queries = q * keys.exp_decay(keys.b + math.log(scale))
    o, final = PerKeyAdditiveRead.apply(queries, writes, keys.keys_to_chunk_end(), keys.b[:, :, :, -1], state0)
    return o + keys.scores(q, "now", strict=False, scale=scale) @ writes, final


def output(o: torch.Tensor, rest: float, length: int) -> torch.Tensor:
    """``rest · o`` in the ``[B, T, H, V]`` layout (``rest``: what the queries did not carry of the scale)."""
    return from_chunks(o if rest == 1.0 else rest * o, length)


def chunk_forward(x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                  config: MemoryConfig, scale: float,
                  chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``Backend`` contract (``backend.py``) in the chunk-parallel form; ``chunk_size`` overrides C.

    A sequence longer than ``SEGMENT_LENGTH`` runs segment after segment, each starting from the states the one
    before ended with.
    """
    length = x.q.shape[1]
    if length <= SEGMENT_LENGTH:
        return forward_segment(x, base_state, residual_state, config, scale, chunk_size)
    # ``split`` rather than slicing: its backward joins the segments' gradients in one concatenation.
    pieces = [None if t is None else t.split(SEGMENT_LENGTH, dim=1) for t in x]
    outputs = []
    for i in range(len(pieces[0])):
        part = MemoryInputs(*(None if p is None else p[i] for p in pieces))
        o, base_state, residual_state = forward_segment(part, base_state, residual_state, config, scale, chunk_size)
        outputs.append(o)
    return torch.cat(outputs, dim=1), base_state, residual_state


def forward_segment(x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                    config: MemoryConfig, scale: float,
                    chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One stretch of the sequence in the chunk-parallel form (``chunk_forward``'s arguments and results)."""
    q, k, v, g, beta, gamma = x
    length = q.shape[1]
    if length == 0:
        return v.new_zeros(v.shape), base_state, residual_state
    per_key = g.dim() == 4
    chunk = chunk_size or (CHUNK_SIZE_PER_KEY_DECAY if per_key else CHUNK_SIZE)
    qc, kc, vc, gc, betac = (to_chunks(t, chunk) for t in (q, k, v, g, beta))
    # A positive read-out scale rides in the queries' log decay (e^{e + log scale}), which saves a pass over o;
    # any other scale multiplies o at the end.
    read_scale, rest = (scale, 1.0) if scale > 0 else (1.0, scale)
    paper_rla = config.rule == "additive" and config.residual and config.fit_history and config.output_gates
    if paper_rla and not per_key:  # in one hand-differentiated function
        o, base_final, residual_final = ResidualAdditive.apply(
            qc, kc, vc, betac, to_chunks(gamma, chunk), gc, base_state, residual_state, read_scale,
            config.residual_target, config.clip)
        return output(o, rest, length), base_final, residual_final
    needed = ("delta",) * (config.rule == "delta") + ("read",) * config.residual
    keys = ChunkedKeys(kc, gc, needed)
    if per_key and not config.residual:
        o, final = per_key_additive_read(keys, vc, betac, base_state, qc, read_scale)
        return output(o, rest, length), final, None
    base = ChunkedMemory(keys, vc, betac, base_state, config.rule)
    if not config.residual:
        o = base.read(qc, "now", strict=False, scale=read_scale)
        return output(o, rest, length), base.final, None

    gammac = to_chunks(gamma, chunk)
    r = base.residual_values(vc, config)
    if config.fit_history:
        residual = ChunkedMemory(keys, r, gammac, residual_state, config.rule)
        residual_final = residual.final
        if config.output_gates:  # α_t S_{t−1} q_t + γ_t R_t q_t
            o = read_queries_of_both(base, residual, qc, gammac, read_scale)
        else:  # S_{t−1} q_t + R_t q_t
            o = base.read(qc, "before", True, read_scale) + residual.read(qc, "now", False, read_scale)
    else:  # R_t = r_t k_tᵀ: only this step's correction
        own = r * ((qc * kc).sum(-1, keepdim=True) * read_scale)  # R_t q_t
        if config.output_gates:
            o = torch.addcmul(base.read(qc, "now", True, read_scale), gammac.unsqueeze(-1), own)
        else:
            o = base.read(qc, "before", True, read_scale) + own
        last = from_chunks(r, length)[:, -1], from_chunks(kc, length)[:, -1]
        residual_final = torch.einsum("bhv,bhk->bhvk", *last)
    return output(o, rest, length), base.final, residual_final


CHUNK = Backend("chunk", chunk_forward)
