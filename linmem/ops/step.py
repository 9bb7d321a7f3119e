"""One token of the linear-memory recurrence: the equations of ``docs/math.md`` written out once.

``reference.py`` loops this over time; the model's decoding path calls it for one new token; the memory lab's replay
calls it at edited tokens with each memory's write given on its own (``memory_step_parts``). Everything here works
per head on column vectors: ``q, k [B, H, K]``, ``v [B, H, V]``, states ``[B, H, V, K]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from linmem.ops.backend import MemoryInputs
from linmem.ops.config import MemoryConfig


def rho(error: torch.Tensor, target: str, clip: float) -> torch.Tensor:
    """ρ(v − S_{t−1}k): the residual memory's regression target.

    ``"clip"`` clamps to ``[-clip, clip]`` (the gradient of a Huber loss), ``"tanh"`` is ``clip·tanh(x/clip)``
    (the gradient of a log-cosh loss; ``clip = 1`` gives plain ``tanh``), ``"identity"`` returns the raw error.
    """
    if target == "clip":
        return error.clamp(-clip, clip)
    if target == "tanh":
        return clip * torch.tanh(error / clip)
    return error


def decay_state(state: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """α ⊙ S for a log decay ``g`` of shape ``[B, H]`` (per head) or ``[B, H, K]`` (per key channel)."""
    if g.dim() == state.dim() - 1:  # per key channel: S · diag(α)
        return state * g.exp().unsqueeze(-2)
    return state * g.exp()[..., None, None]


def read(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``S x`` for ``S [B, H, V, K]`` and ``x [B, H, K]`` → ``[B, H, V]``."""
    return torch.einsum("bhvk,bhk->bhv", state, x)


def write(state: torch.Tensor, k: torch.Tensor, value: torch.Tensor, strength: torch.Tensor, g: torch.Tensor,
          rule: str) -> torch.Tensor:
    """One update of one memory.

    additive: ``S_t = α S_{t−1} + s v kᵀ``;  delta: ``S_t = α S_{t−1}(I − s k kᵀ) + s v kᵀ``.
    ``strength`` is β for the base memory and γ for the residual one, shape ``[B, H]``.
    """
    s = strength[..., None, None]
    if rule == "delta":
        state = state - s * torch.einsum("bhv,bhk->bhvk", read(state, k), k)
    return decay_state(state, g) + s * torch.einsum("bhv,bhk->bhvk", value, k)


class Write(NamedTuple):
    """What one memory is written with at one token: key ``k [B, H, K]``, value ``v [B, H, V]`` and ``strength
    [B, H]`` (β for the base memory, γ for the residual one). The residual memory writes ``ρ(v − S_{t−1}k)``, the
    base memory's error on this ``v``, rather than ``v`` itself."""

    k: torch.Tensor
    v: torch.Tensor
    strength: torch.Tensor


class StepParts(NamedTuple):
    """One token of both memories, with the parts of the read-out.

    ``o [B, H, V]`` the read-out, ``scale·(base_read + residual_read)``; ``base_read [B, H, V]`` the base memory's
    part before the scale (``α S_{t−1}q`` with output gates, ``S_{t−1}q`` without, ``S_t q`` without a residual
    memory); ``residual_target [B, H, V]`` the r written into R (None without a residual memory); the new states
    ``[B, H, V, K]``.
    """

    o: torch.Tensor
    base_read: torch.Tensor
    residual_target: torch.Tensor | None
    base_state: torch.Tensor
    residual_state: torch.Tensor | None


def memory_step_parts(x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                      config: MemoryConfig, scale: float, base_write: Write | None = None,
                      residual_write: Write | None = None,
                      edit_target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepParts:
    """Advance both memories by one token, each written with its own inputs: the equations, once.

    ``base_write`` defaults to ``(k, v, β)`` and ``residual_write`` to ``(k, v, γ)`` of ``x``; the memory lab gives
    them differently to edit one memory's write. ``edit_target(r)`` replaces the residual target r before R is
    written. The reads always use ``x``: ``q``, the decay ``g`` and the output gate γ.
    """
    q, k, v, g, beta, gamma = x
    base_k, base_v, base_strength = (k, v, beta) if base_write is None else base_write
    new_base = write(base_state, base_k, base_v, base_strength, g, config.rule)
    if not config.residual:
        base_read = read(new_base, q)
        return StepParts(scale * base_read, base_read, None, new_base, None)

    residual_k, residual_v, residual_strength = (k, v, gamma) if residual_write is None else residual_write
    r = rho(residual_v - read(base_state, residual_k), config.residual_target, config.clip)
    if edit_target is not None:
        r = edit_target(r)
    if config.fit_history:
        new_residual = write(residual_state, residual_k, r, residual_strength, g, config.rule)
    else:  # "w/o fitting": the residual memory only holds this step's correction
        new_residual = torch.einsum("bhv,bhk->bhvk", r, residual_k)
    if config.output_gates:
        base_read = read(decay_state(base_state, g), q)
        residual_read = gamma[..., None] * read(new_residual, q)
    else:
        base_read = read(base_state, q)
        residual_read = read(new_residual, q)
    return StepParts(scale * (base_read + residual_read), base_read, r, new_base, new_residual)


def memory_step(x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                config: MemoryConfig, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Advance both memories by one token, written with ``x`` (``memory_step_parts`` without overrides).

    Args:
        x: one token of the inputs, ``q, k [B, H, K]``, ``v [B, H, V]``, ``g [B, H]`` or ``[B, H, K]`` log decay
            (≤ 0), ``beta, gamma [B, H]``; base_state, residual_state: ``[B, H, V, K]`` (residual ``None`` without
            one).
    Returns:
        ``o [B, H, V]``, the new base state and the new residual state (``None`` without a residual memory).
    """
    parts = memory_step_parts(x, base_state, residual_state, config, scale)
    return parts.o, parts.base_state, parts.residual_state
