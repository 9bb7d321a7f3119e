"""Input checks shared by every backend: errors a user can act on, raised before any work is done."""

from __future__ import annotations

import torch


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_float(name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {t.dtype}")


# Write strengths β and γ are accepted in [0, 2]. [0, 1] is the usual range (a sigmoid gate); (1, 2] is legal: with
# unit keys the delta rule's transition I − β k kᵀ has the eigenvalue 1 − β ∈ [−1, 1], so the state stays bounded
# (FLA's ``allow_neg_eigval`` gates are 2·sigmoid, in this range). Outside [0, 2] that eigenvalue leaves [−1, 1] and
# the delta-rule state grows without bound; a negative additive write un-writes. Both point to a caller's bug, so
# they are refused, as NaN and infinities are.
STRENGTH_RANGE = (0.0, 2.0)


def check_gate_values(g: torch.Tensor | None, beta: torch.Tensor | None, gamma: torch.Tensor | None) -> None:
    """``g = log α`` must be ≤ 0 everywhere and not NaN (a positive value would make the memory grow); ``beta`` and
    ``gamma`` finite and in ``STRENGTH_RANGE``.

    All three are reduced to flags on their device and read back together: one host synchronisation per call on
    CUDA (the one the decay check alone costs), so checking β and γ adds no stall to a training step; the
    offending values are located only when a flag is set.
    """
    low, high = STRENGTH_RANGE
    bad = {}
    if g is not None:
        bad["g"] = ~(g <= 0)
    for name, t in (("beta", beta), ("gamma", gamma)):
        if t is not None:
            bad[name] = ~((t >= low) & (t <= high))
    if not bad:
        return
    flags = torch.stack([b.any() for b in bad.values()]).tolist()
    for (name, mask), flagged in zip(bad.items(), flags):
        if not flagged:
            continue
        t = {"g": g, "beta": beta, "gamma": gamma}[name]
        idx = tuple(int(i) for i in mask.nonzero()[0])
        first = f"first bad value {t[idx].item():.4g} at {list(idx)}"
        if name == "g":
            raise ValueError(f"g must be <= 0 (log decay, g = log alpha); got max {t.max().item():.4g}, {first}")
        raise ValueError(f"{name} must be finite and in [{low:g}, {high:g}] (a write strength; see "
                         f"linmem.ops.checks.STRENGTH_RANGE); {first}")


def check_fixed_decay(g_gamma: torch.Tensor, q: torch.Tensor, check_values: bool = True) -> None:
    """``g_gamma``: a fixed log decay per head, ``[H]``, ≤ 0 (the value is read back only with ``check_values``)."""
    check_float("g_gamma", g_gamma)
    heads = q.shape[-2] if q.dim() >= 2 else 0
    if g_gamma.shape != (heads,):
        raise ValueError(f"g_gamma must have shape [H] = [{heads}] (one log decay per head); got {_shape(g_gamma)}")
    if check_values and not bool((g_gamma <= 0).all()):
        raise ValueError(f"g_gamma must be <= 0 (log decay per head); got {g_gamma.tolist()}")


def check_sequence_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    gamma: torch.Tensor | None,
    rule: str,
    residual: bool,
    time_dim: bool = True,
    check_values: bool = True,
) -> None:
    """Shapes of the per-token inputs: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, gates ``[B, T, H]``
    (``g`` may be ``[B, T, H, K]`` for the additive rule). With ``time_dim=False`` the ``T`` axis is absent (a step).
    Shapes and dtypes are host metadata; the gates' values (``check_gate_values``, one host synchronisation) are
    checked only with ``check_values``.
    """
    lead = "[B, T, H, " if time_dim else "[B, H, "
    ndim = 4 if time_dim else 3
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("gamma", gamma)):
        check_float(name, t)
    if q.dim() != ndim:
        raise ValueError(f"q must have shape {lead}K]; got {_shape(q)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {lead}K] = {_shape(q)}; got {_shape(k)}")
    if v.dim() != ndim or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v must have shape {lead}V] with {lead[1:-2]} = {list(q.shape[:-1])}; got {_shape(v)}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"the key and value dims K and V must be >= 1; got K = {q.shape[-1]}, V = {v.shape[-1]}")
    heads = q.shape[:-1]
    for name, t in (("beta", beta), ("gamma", gamma)):
        if t is not None and t.shape != heads:
            raise ValueError(f"{name} must have shape {lead[:-2]}] = {list(heads)}; got {_shape(t)}")
    if g is not None:
        per_key = g.shape == q.shape
        if g.shape != heads and not per_key:
            raise ValueError(
                f"g must have shape {lead[:-2]}] = {list(heads)} (per head) or {lead}K] = {list(q.shape)} "
                f"(per key channel); got {_shape(g)}"
            )
        if per_key and rule == "delta":
            raise ValueError(f"g per key channel {lead}K] is only defined for rule='additive'; the delta rule "
                             f"takes one decay per head {lead[:-2]}]")
    if residual and gamma is None:
        raise ValueError("residual=True needs gamma, the residual write/read strength, of shape "
                         f"{lead[:-2]}] = {list(heads)}")
    if check_values:
        check_gate_values(g, beta, gamma if residual else None)


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int, bounds: list[int] | None = None) -> list[int]:
    """``cu_seqlens`` like flash-attention's: int tensor ``[N + 1]``, 0 first, total length last, non-decreasing;
    returns its boundaries as a host list.

    Reading them back is a host synchronisation. ``bounds``: this tensor's boundaries as read and checked before
    (``backend.Packed.of`` keeps them per tensor), so that only the host-side checks against ``batch`` and
    ``length`` run and nothing is read back.
    """
    if batch != 1:
        raise ValueError(f"cu_seqlens needs packed sequences in one row (B == 1); got B = {batch}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of sequence boundaries")
    fresh = bounds is None
    if fresh:
        bounds = [int(x) for x in cu_seqlens.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {length}; got {bounds}")
    if fresh and any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {bounds}")
    return bounds


def check_state(name: str, state: torch.Tensor | None, expected: tuple[int, ...], layout: str = "[N, H, V, K]") -> None:
    """A state must have the ``expected`` shape (``layout`` names its axes in the message)."""
    if state is None:
        return
    check_float(name, state)
    if tuple(state.shape) != expected:
        raise ValueError(f"{name} must have shape {layout} = {list(expected)}; got {_shape(state)}")


def split_state(initial_state, residual: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``initial_state`` is ``S0`` without a residual memory and ``(S0, R0)`` (either may be None) with one."""
    if initial_state is None:
        return None, None
    if residual:
        if not isinstance(initial_state, tuple | list) or len(initial_state) != 2:
            raise ValueError("with residual=True, initial_state must be a pair (S0, R0) of [N, H, V, K] tensors "
                             "(either may be None)")
        return initial_state[0], initial_state[1]
    if isinstance(initial_state, tuple | list):
        raise ValueError("with residual=False, initial_state must be one tensor S0 [N, H, V, K], not a pair")
    return initial_state, None
