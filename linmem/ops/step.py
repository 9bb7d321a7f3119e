"""One token of the linear-memory recurrence: the equations of ``docs/math.md`` written out once.

``reference.py`` loops this over time; the model's decoding path calls it for one new token. Everything here works
per head on column vectors: ``q, k [B, H, K]``, ``v [B, H, V]``, states ``[B, H, V, K]``.
"""

from __future__ import annotations

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


def memory_step(x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                config: MemoryConfig, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Advance both memories by one token.

    Args:
        x: one token of the inputs, ``q, k [B, H, K]``, ``v [B, H, V]``, ``g [B, H]`` or ``[B, H, K]`` log decay
            (≤ 0), ``beta, gamma [B, H]``; base_state, residual_state: ``[B, H, V, K]`` (residual ``None`` without
            one).
    Returns:
        ``o [B, H, V]``, the new base state and the new residual state (``None`` without a residual memory).
    """
    q, k, v, g, beta, gamma = x
    new_base = write(base_state, k, v, beta, g, config.rule)
    if not config.residual:
        return scale * read(new_base, q), new_base, None

    r = rho(v - read(base_state, k), config.residual_target, config.clip)
    if config.fit_history:
        new_residual = write(residual_state, k, r, gamma, g, config.rule)
    else:  # "w/o fitting": the residual memory only holds this step's correction
        new_residual = torch.einsum("bhv,bhk->bhvk", r, k)
    if config.output_gates:
        base_read = read(decay_state(base_state, g), q)
        residual_read = gamma[..., None] * read(new_residual, q)
    else:
        base_read = read(base_state, q)
        residual_read = read(new_residual, q)
    return scale * (base_read + residual_read), new_base, new_residual
