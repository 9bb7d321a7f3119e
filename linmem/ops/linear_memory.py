"""``linear_memory``: the one op behind sGLA, GLA, GDN, RLA and RDN, and its one-token step for decoding.

The contract (names, argument order, shapes, state layout ``[B, H, V, K]``) is fixed by ``docs/math.md``. The
keyword arguments of flash-linear-attention's ``chunk_gated_delta_rule`` / ``chunk_simple_gla`` are accepted under
FLA's names (``state_v_first``, ``use_qk_l2norm_in_kernel``, ``g_gamma``), but the default layout is linmem's
``state_v_first=True`` while FLA's ops default to ``False``: an FLA caller passing states must say
``state_v_first=False`` (with K == V a ``[B, H, K, V]`` state has the same shape and cannot be told apart).
"""

from __future__ import annotations

import contextlib
import os

import torch

from linmem.ops.backend import Backend, MemoryInputs, Packed, check_backend
from linmem.ops.checks import (
    check_fixed_decay,
    check_sequence_inputs,
    check_state,
    split_state,
)
from linmem.ops.chunk import CHUNK
from linmem.ops.config import MemoryConfig
from linmem.ops.reference import REFERENCE
from linmem.ops.step import memory_step

State = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None

# ``auto`` picks the Triton kernels on CUDA (checked against the float64 reference by ``python -m linmem.bench.kernels``
# for every memory, dtype and switch) and ``chunk`` elsewhere, and ``chunk`` for inputs the kernels do not take
# (``Backend.unsupported``: float64, per-channel decay with a residual memory, K or V > 256). A caller who names
# ``triton`` gets the kernels or a ``ValueError`` saying why they cannot run, never another backend.


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """States accumulate in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _resolve_backend(name: str, x: MemoryInputs, config: MemoryConfig) -> Backend:
    """The backend ``name`` stands for on these inputs; ``triton`` named where it cannot run is a ``ValueError``."""
    check_backend(name)
    if name == "reference":
        return REFERENCE
    if name == "chunk":
        return CHUNK
    if name == "auto" and x.q.device.type != "cuda":
        return CHUNK
    why_not = _triton_unavailable(x.q.device)
    if why_not is None:
        from linmem.ops.triton import TRITON

        why_not = TRITON.unsupported(x, config)
        if why_not is None:
            return TRITON
    if name == "auto":
        return CHUNK
    raise ValueError(f"backend='triton' cannot run here: {why_not}; choose backend 'chunk' or 'auto' (which runs "
                     f"the chunk backend where the kernels cannot)")


def _triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None when they can)."""
    try:
        import linmem.ops.triton  # noqa: F401
    except ImportError as error:
        return f"the Triton kernels do not import ({error}); install triton"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"the tensors are on {device.type}, and the kernels run on CUDA (or on the CPU under "
                f"TRITON_INTERPRET=1, Triton's interpreter)")
    return None


def _memory_config(memory: MemoryConfig | None, *switches) -> MemoryConfig:
    """``memory`` as given, or the one the separate switches pick (both at once is refused)."""
    from_switches = MemoryConfig(*switches)
    if memory is None:
        return from_switches
    if not isinstance(memory, MemoryConfig):
        raise ValueError(f"memory must be a MemoryConfig; got {type(memory).__name__}")
    if from_switches != MemoryConfig():
        raise ValueError("give either memory (a MemoryConfig) or the switches rule, residual, residual_target, "
                         "clip, fit_history and output_gates, not both")
    return memory


# A graph-break boundary for ``torch.compile``: the elementwise code around the op (projections, convolutions,
# gates, norms) compiles, while the op itself runs as it is (its input checks read values back to the host and the
# Triton kernels launch from autograd Functions that dynamo does not trace).
@torch.compiler.disable
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
    state_v_first: bool = True,
    use_qk_l2norm_in_kernel: bool = False,
    g_gamma: torch.Tensor | None = None,
    memory: MemoryConfig | None = None,
    check_values: bool = True,
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
            sequences with ``cu_seqlens``. ``[N, H, K, V]`` with ``state_v_first=False``.
        output_final_state: return the final state(s) (a new tensor, never ``initial_state`` itself).
        cu_seqlens: ``[N + 1]`` boundaries of N sequences packed in one row (B must be 1).
        backend: ``"reference"``, ``"chunk"``, ``"triton"`` or ``"auto"`` (triton on CUDA when triton is
            installed and the kernels take the inputs, else chunk). ``"triton"`` where the kernels cannot run (no
            CUDA tensor without ``TRITON_INTERPRET=1``, float64, ``fit_history=False``, ...) is a ``ValueError``
            naming why.
        state_v_first: True (default, linmem's layout): states are ``[N, H, V, K]``; False: FLA's ops' default
            ``[N, H, K, V]``, for the initial state(s) taken and the final state(s) returned. FLA's ops default to
            False, linmem to True: with K == V both layouts have the same shape, so pass it explicitly when the
            states come from FLA.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first (``x / sqrt(Σx² + 1e-6)``, FLA's epsilon).
        g_gamma: a fixed log decay per head ``[H]`` (≤ 0; sGLA's data-independent decay, FLA's ``g_gamma``), used
            at every token; only one of ``g`` and ``g_gamma`` may be given.
        memory: the memory as one ``MemoryConfig``, in place of the switches rule .. output_gates.
        check_values: check the gates' values: ``g`` and ``g_gamma`` ≤ 0, ``beta`` and ``gamma`` finite and in
            [0, 2]. The check reduces them to flags on their device and reads those back, one device→host
            synchronisation per call (per layer of every forward), which stalls the host until the GPU catches up.
            False skips only it (shapes and dtypes are host metadata, always checked), for a caller whose gates
            are in range by construction: the linmem mixers build ``g = −exp(A)·softplus(·) ≤ 0`` (GLA:
            ``logsigmoid(·)/c``), ``β, γ = sigmoid(·)`` or ``2·sigmoid(·)``, and pass False unless a hook could
            rewrite them. Any other caller keeps the default.
    Returns:
        ``o [B, T, H, V]`` in q's dtype and ``None``, ``S_T`` or ``(S_T, R_T)`` (``[N, H, V, K]``, or ``[N, H, K,
        V]`` with ``state_v_first=False``; float32 or float64).
    """
    config = _memory_config(memory, rule, residual, residual_target, clip, fit_history, output_gates)
    residual = config.residual
    if not isinstance(state_v_first, bool) or not isinstance(use_qk_l2norm_in_kernel, bool):
        raise ValueError(f"state_v_first and use_qk_l2norm_in_kernel must be bools; got {state_v_first!r} and "
                         f"{use_qk_l2norm_in_kernel!r}")
    _check_bool("check_values", check_values)
    if g_gamma is not None:
        if g is not None:
            raise ValueError("give either g (per token) or g_gamma (fixed per head), not both")
        check_fixed_decay(g_gamma, q, check_values)
        g = g_gamma.to(q.device).expand(q.shape[:-1])
    check_sequence_inputs(q, k, v, g, beta, gamma, config.rule, residual, check_values=check_values)
    if use_qk_l2norm_in_kernel:
        q, k = _l2_normalize(q), _l2_normalize(k)
    backend = _resolve_backend(backend, MemoryInputs(q, k, v, g, beta, gamma), config)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    packed = None if cu_seqlens is None else Packed.of(cu_seqlens, batch, length)
    num_seqs = batch if packed is None else len(packed.bounds) - 1
    base0, residual0 = split_state(initial_state, residual)
    layout = "[N, H, V, K]" if state_v_first else "[N, H, K, V] (state_v_first=False)"
    state_shape = (num_seqs, heads, value_dim, key_dim) if state_v_first else (num_seqs, heads, key_dim, value_dim)
    check_state("initial_state (S0)", base0, state_shape, layout)
    check_state("initial_state (R0)", residual0, state_shape, layout)
    if not state_v_first:
        base0, residual0 = (None if s is None else s.transpose(-1, -2).contiguous() for s in (base0, residual0))
    scale = key_dim**-0.5 if scale is None else float(scale)

    out_dtype = q.dtype
    native = backend.native_inputs
    x = _in_state_dtype(MemoryInputs(q, k, v, g, beta, gamma), residual, keep_qkv=native)
    base0, residual0 = _states_or_zeros(base0, residual0, residual, x.g, (num_seqs, heads, value_dim, key_dim))

    # the PyTorch backends compute in the state dtype they were given: an enclosing autocast would hand their
    # matrix products bf16 inputs (and the hand-differentiated chunk reads mix them with float32 accumulators)
    exact = contextlib.nullcontext() if native else torch.autocast(q.device.type, enabled=False)
    with exact:
        if packed is None:
            o, base_final, residual_final = backend.run(x, base0, residual0, config, scale)
        elif native:
            o, base_final, residual_final = backend.run(x, base0, residual0, config, scale, packed=packed)
        else:
            o, base_final, residual_final = _run_varlen(backend, packed.bounds, x, base0, residual0, config, scale)
    o = o.to(out_dtype)
    if not output_final_state:
        return o, None
    if length == 0:  # no token ran: the backends hand back the initial state, which may be the caller's tensor
        base_final, residual_final = (None if s is None else s.clone() for s in (base_final, residual_final))
    if not state_v_first:
        base_final, residual_final = (None if s is None else s.transpose(-1, -2).contiguous()
                                      for s in (base_final, residual_final))
    return o, ((base_final, residual_final) if residual else base_final)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool; got {value!r}")


# FLA's l2norm epsilon, so that ``use_qk_l2norm_in_kernel=True`` gives the numbers FLA's kernels give
L2NORM_EPS = 1e-6


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(Σ x² + 1e-6)`` over the last axis, computed in the state dtype, returned in ``x``'s dtype."""
    wide = x.to(state_dtype_for(x.dtype))
    return (wide * torch.rsqrt((wide * wide).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def _in_state_dtype(x: MemoryInputs, residual: bool, keep_qkv: bool = False) -> MemoryInputs:
    """Every per-token input cast to the state dtype (gates only, with ``keep_qkv``), the defaults filled in (no
    decay, β = 1)."""
    q, k, v, g, beta, gamma = x
    dtype = state_dtype_for(q.dtype)
    gate_like = q.new_empty(0, dtype=dtype)
    if not keep_qkv:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    g = gate_like.new_zeros(q.shape[:-1]) if g is None else g.to(dtype)
    beta = gate_like.new_ones(q.shape[:-1]) if beta is None else beta.to(dtype)
    gamma = gamma.to(dtype) if residual else None
    return MemoryInputs(q, k, v, g, beta, gamma)


def _states_or_zeros(base, resid, residual, like, shape):
    """Given states in the state dtype, zeros where absent; no residual state without a residual memory."""
    base = like.new_zeros(shape) if base is None else base.to(like.dtype)
    if not residual:
        return base, None
    return base, like.new_zeros(shape) if resid is None else resid.to(like.dtype)


def _run_varlen(backend: Backend, bounds: list[int], x: MemoryInputs, base0, residual0, config, scale):
    """Each packed sequence on its own, from its own initial state."""
    outputs, base_finals, residual_finals = [], [], []
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        part = slice(start, end)
        o, s, r = backend.run(x.map(lambda t, part=part: t[:, part]), base0[n : n + 1],
                              None if residual0 is None else residual0[n : n + 1], config, scale)
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
    memory: MemoryConfig | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, State]:
    """One token of ``linear_memory`` for decoding.

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; g: ``[B, H]`` or ``[B, H, K]``; beta, gamma: ``[B, H]``.
        state: ``S [B, H, V, K]`` or ``(S, R)`` with ``residual=True``; None starts from zeros.
        memory: the memory as one ``MemoryConfig``, in place of the switches rule .. output_gates.
        check_values: check the gates' values (one host synchronisation); False skips that check only, for
            gates in range by construction (see ``linear_memory``).
    Returns:
        ``o [B, H, V]`` in q's dtype and the new state (``S`` or ``(S, R)``, float32 or float64).
    """
    config = _memory_config(memory, rule, residual, residual_target, clip, fit_history, output_gates)
    residual = config.residual
    _check_bool("check_values", check_values)
    check_sequence_inputs(q, k, v, g, beta, gamma, config.rule, residual, time_dim=False, check_values=check_values)
    batch, heads, key_dim = q.shape
    base, resid = split_state(state, residual)
    check_state("state (S)", base, (batch, heads, v.shape[-1], key_dim), "[B, H, V, K]")
    check_state("state (R)", resid, (batch, heads, v.shape[-1], key_dim), "[B, H, V, K]")
    scale = key_dim**-0.5 if scale is None else float(scale)
    out_dtype = q.dtype
    x = _in_state_dtype(MemoryInputs(q, k, v, g, beta, gamma), residual)
    base, resid = _states_or_zeros(base, resid, residual, x.q, (batch, heads, v.shape[-1], key_dim))
    o, base, resid = memory_step(x, base, resid, config, scale)
    return o.to(out_dtype), ((base, resid) if residual else base)
