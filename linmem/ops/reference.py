"""The reference backend: a token loop over ``memory_step`` that reads like the equations (the spec in code).

Slow by design; supports float64 and every switch. Inputs arrive checked and in the state dtype
(see ``linmem.ops.linear_memory``).
"""

from __future__ import annotations

import torch

from linmem.ops.config import MemoryConfig
from linmem.ops.step import memory_step


def reference_forward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the recurrence over one batch of equal-length sequences.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` or ``[B, T, H, K]``; beta, gamma: ``[B, T, H]``;
        base_state, residual_state: ``[B, H, V, K]`` states before the first token.
    Returns:
        ``o [B, T, H, V]``, the final base state and the final residual state (``None`` without one).
    """
    outputs = []
    for t in range(q.shape[1]):
        o_t, base_state, residual_state = memory_step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], None if gamma is None else gamma[:, t],
            base_state, residual_state, config, scale,
        )
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, base_state, residual_state
