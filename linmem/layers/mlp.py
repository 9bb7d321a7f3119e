"""SwiGLU feed-forward block with FLA's names (``gate_proj``, ``up_proj``, ``down_proj``) and size rule."""

from __future__ import annotations

import torch
from torch import nn

from linmem.ops.fused.swiglu import swiglu_linear


def swiglu_intermediate_size(hidden_size: int, hidden_ratio: float = 4) -> int:
    """FLA's rule: ``2/3 · hidden_ratio · hidden_size`` rounded up to a multiple of 256 (≈ ``hidden_ratio · D²``
    parameters in all three matrices)."""
    size = int(hidden_size * hidden_ratio * 2 / 3)
    return 256 * ((size + 255) // 256)


class SwiGLU(nn.Module):
    """``y = down_proj(silu(gate_proj(x)) ⊙ up_proj(x))``; ``x [..., D]`` → ``[..., D]``.

    ``intermediate_size`` wins over ``hidden_ratio`` when given (see ``swiglu_intermediate_size``). The product
    ``silu(gate) ⊙ up`` is not kept for the backward but recomputed there (``linmem.ops.fused.swiglu_linear``): the
    block keeps two ``[..., I]`` tensors instead of four.
    """

    def __init__(self, hidden_size: int, hidden_ratio: float | None = 4, intermediate_size: int | None = None):
        super().__init__()
        if intermediate_size is None:
            intermediate_size = swiglu_intermediate_size(hidden_size, 4 if hidden_ratio is None else hidden_ratio)
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_linear(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)
