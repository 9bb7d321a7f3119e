"""``linear_memory``: the one op behind sGLA, GLA, GDN, RLA and RDN, and its one-token step for decoding.

The contract (names, argument order, shapes, state layout ``[B, H, V, K]``) is fixed by ``docs/math.md``.
"""

from __future__ import annotations

import contextlib
import os

import torch

from linmem.ops.checks import check_cu_seqlens, check_sequence_inputs, check_state, split_state
from linmem.ops.chunk import chunk_forward
from linmem.ops.config import MemoryConfig
from linmem.ops.reference import reference_forward
from linmem.ops.step import memory_step

BACKENDS = ("auto", "reference", "chunk", "triton")

State = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None

# ``auto`` picks the Triton kernels on CUDA. They passed every float64 check of ``python -m linmem.bench.kernels`` on
# an H200 (triton 3.6, 2026-11-29: every memory, bf16 and fp32, K = 64/128/256, packed sequences, ablation switches,
# extreme decays, 64-bit offsets; docs/benchmarks/kernels-status.md) and train a 124M model 2.8x (RDN) faster than
# ``chunk``. Inputs they do not cover (``triton_forward.covers``: per-channel decay, K or V > 256) run on ``chunk``.
AUTO_USES_TRITON = True


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """States accumulate in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_available(device: torch.device) -> bool:
    """The Triton backend runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``."""
    try:
        import linmem.ops.triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _resolve_backend(backend: str, device: torch.device):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "auto":
        use_triton = AUTO_USES_TRITON and device.type == "cuda" and triton_available(device)
        backend = "triton" if use_triton else "chunk"
    if backend == "reference":
        return reference_forward
    if backend == "chunk":
        return chunk_forward
    if not triton_available(device):
        raise ValueError("backend='triton' needs the linmem Triton kernels, triton installed and a CUDA tensor "
                         "(or TRITON_INTERPRET=1 for the CPU interpreter)")
    from linmem.ops.triton import triton_forward

    return triton_forward


def linear_memory(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    *,
    rule: str = "additive",
    residual: bool = False,
    residual_target: str = "clip",
    clip: float = 1.0,
    fit_history: bool = True,
    output_gates: bool = True,
    scale: float | None = None,
    initial_state: State = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, State]:
    """Run a linear memory over a sequence.

    Base memory: additive ``S_t = α_t S_{t−1} + β_t v_t k_tᵀ`` or delta ``S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) +
    β_t v_t k_tᵀ``; read-out ``o_t = scale·S_t q_t``. With ``residual=True`` a second memory R (same rule) learns
    ``r_t = ρ(v_t − S_{t−1}k_t)`` with strength γ_t and ``o_t = scale·(α_t S_{t−1} q_t + γ_t R_t q_t)``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        g: log decay ``[B, T, H]`` or, for the additive rule, ``[B, T, H, K]``; must be ≤ 0 (None: no decay).
        beta: base write strength ``[B, T, H]`` (None: 1). gamma: residual strength ``[B, T, H]``.
        rule: ``"additive"`` or ``"delta"``. residual, residual_target, clip, fit_history, output_gates: see
            ``MemoryConfig``. scale: read-out scale (None: ``K**-0.5``).
        initial_state: ``S0 [N, H, V, K]``, or ``(S0, R0)`` with ``residual=True``; N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: return the final state(s).
        cu_seqlens: ``[N + 1]`` boundaries of N sequences packed in one row (B must be 1).
        backend: ``"reference"``, ``"chunk"``, ``"triton"`` or ``"auto"`` (triton on CUDA when triton is
            installed, else chunk; see ``AUTO_USES_TRITON``).
    Returns:
        ``o [B, T, H, V]`` in q's dtype and ``None``, ``S_T`` or ``(S_T, R_T)`` (``[N, H, V, K]``, float32 or
        float64).
    """
    config = MemoryConfig(rule, residual, residual_target, clip, fit_history, output_gates)
    check_sequence_inputs(q, k, v, g, beta, gamma, rule, residual)
    forward = _resolve_backend(backend, q.device)
    if not getattr(forward, "covers", lambda *_: True)(q, v, g, config):
        forward = chunk_forward  # inputs the Triton kernels do not take (see ``covers``)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    bounds = check_cu_seqlens(cu_seqlens, batch, length) if cu_seqlens is not None else None
    num_seqs = batch if bounds is None else len(bounds) - 1
    base0, residual0 = split_state(initial_state, residual)
    check_state("initial_state (S0)", base0, (num_seqs, heads, value_dim, key_dim))
    check_state("initial_state (R0)", residual0, (num_seqs, heads, value_dim, key_dim))
    scale = key_dim**-0.5 if scale is None else float(scale)

    out_dtype = q.dtype
    # the triton backend takes bf16/fp16 q, k, v as they are and packed sequences natively
    native = getattr(forward, "native_inputs", False)
    q, k, v, g, beta, gamma = _in_state_dtype(q, k, v, g, beta, gamma, residual, keep_qkv=native)
    base0, residual0 = _states_or_zeros(base0, residual0, residual, g, (num_seqs, heads, value_dim, key_dim))

    # the PyTorch backends compute in the state dtype they were given: an enclosing autocast would hand their
    # matrix products bf16 inputs (and the hand-differentiated chunk reads mix them with float32 accumulators)
    exact = contextlib.nullcontext() if native else torch.autocast(q.device.type, enabled=False)
    with exact:
        if bounds is None:
            o, base_final, residual_final = forward(q, k, v, g, beta, gamma, base0, residual0, config, scale)
        elif native:
            o, base_final, residual_final = forward(q, k, v, g, beta, gamma, base0, residual0, config, scale,
                                                    cu_seqlens=cu_seqlens)
        else:
            o, base_final, residual_final = _run_varlen(forward, bounds, q, k, v, g, beta, gamma, base0,
                                                        residual0, config, scale)
    o = o.to(out_dtype)
    if not output_final_state:
        return o, None
    return o, ((base_final, residual_final) if residual else base_final)


def _in_state_dtype(q, k, v, g, beta, gamma, residual, keep_qkv=False):
    """Cast every per-token input to the state dtype (gates only, with ``keep_qkv``) and fill the defaults (no
    decay, β = 1)."""
    dtype = state_dtype_for(q.dtype)
    gate_like = q.new_empty(0, dtype=dtype)
    if not keep_qkv:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    g = gate_like.new_zeros(q.shape[:-1]) if g is None else g.to(dtype)
    beta = gate_like.new_ones(q.shape[:-1]) if beta is None else beta.to(dtype)
    gamma = gamma.to(dtype) if residual else None
    return q, k, v, g, beta, gamma


def _states_or_zeros(base, resid, residual, like, shape):
    """Given states in the state dtype, zeros where absent; no residual state without a residual memory."""
    base = like.new_zeros(shape) if base is None else base.to(like.dtype)
    if not residual:
        return base, None
    return base, like.new_zeros(shape) if resid is None else resid.to(like.dtype)


def _run_varlen(forward, bounds, q, k, v, g, beta, gamma, base0, residual0, config, scale):
    """Each packed sequence on its own, from its own initial state."""
    outputs, base_finals, residual_finals = [], [], []
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        part = slice(start, end)
        o, s, r = forward(
            q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part],
            None if gamma is None else gamma[:, part],
            base0[n : n + 1], None if residual0 is None else residual0[n : n + 1], config, scale,
        )
        outputs.append(o)
        base_finals.append(s)
        residual_finals.append(r)
    residual_final = torch.cat(residual_finals) if residual0 is not None else None
    return torch.cat(outputs, dim=1), torch.cat(base_finals), residual_final


def linear_memory_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    state: State = None,
    *,
    rule: str = "additive",
    residual: bool = False,
    residual_target: str = "clip",
    clip: float = 1.0,
    fit_history: bool = True,
    output_gates: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, State]:
    """One token of ``linear_memory`` for decoding.

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; g: ``[B, H]`` or ``[B, H, K]``; beta, gamma: ``[B, H]``.
        state: ``S [B, H, V, K]`` or ``(S, R)`` with ``residual=True``; None starts from zeros.
    Returns:
        ``o [B, H, V]`` in q's dtype and the new state (``S`` or ``(S, R)``, float32 or float64).
    """
    config = MemoryConfig(rule, residual, residual_target, clip, fit_history, output_gates)
    check_sequence_inputs(q, k, v, g, beta, gamma, rule, residual, time_dim=False)
    batch, heads, key_dim = q.shape
    base, resid = split_state(state, residual)
    check_state("state (S)", base, (batch, heads, v.shape[-1], key_dim))
    check_state("state (R)", resid, (batch, heads, v.shape[-1], key_dim))
    scale = key_dim**-0.5 if scale is None else float(scale)
    out_dtype = q.dtype
    q, k, v, g, beta, gamma = _in_state_dtype(q, k, v, g, beta, gamma, residual)
    base, resid = _states_or_zeros(base, resid, residual, q, (batch, heads, v.shape[-1], key_dim))
    o, base, resid = memory_step(q, k, v, g, beta, gamma, base, resid, config, scale)
    return o.to(out_dtype), ((base, resid) if residual else base)
