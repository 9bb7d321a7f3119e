"""RMSNorm and the gated RMSNorm of FLA's output path (``o_norm`` / ``g_norm_swish_gate``).

Both compute in at least float32 (float64 stays float64, so tests can compare tightly) and return the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last axis, in at least float32."""
    x = x.to(_compute_dtype(x.dtype))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``y = x / rms(x) · weight`` over the last axis; ``weight [D]``.

    ``zero_centered``: the scale is ``1 + weight`` (weight initialised to 0), as in Qwen3-Next / Qwen3.5.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_normalize(x, self.eps)
        if self.zero_centered:
            return (y * (1 + self.weight.to(y.dtype))).to(x.dtype)
        return (y * self.weight).to(x.dtype)

    def extra_repr(self) -> str:
        centered = ", zero_centered=True" if self.zero_centered else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{centered}"


class GatedRMSNorm(nn.Module):
    """``y = x / rms(x) · weight · act(gate)`` with ``act`` = swish (SiLU, default) or sigmoid; ``weight [D]``.

    This is FLA's ``FusedRMSNormGated`` written out: the norm runs over the last axis (one head's values when
    called on ``[B, T, H, V]``), the gate is elementwise.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "swish"):
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"activation must be 'swish', 'silu' or 'sigmoid'; got {activation!r}")
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x, gate [..., D]`` → ``[..., D]`` in x's dtype."""
        gate = gate.to(_compute_dtype(gate.dtype))
        gate = torch.sigmoid(gate) if self.activation == "sigmoid" else F.silu(gate)
        return (rms_normalize(x, self.eps) * self.weight * gate).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}"
