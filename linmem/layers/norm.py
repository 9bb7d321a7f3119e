"""RMSNorm and the gated RMSNorm of FLA's output path (``o_norm`` / ``g_norm_swish_gate``).

Both compute in at least float32 (float64 stays float64, so tests can compare tightly) and return the input dtype
(or the dtype asked for). The arithmetic is ``linmem.ops.fused``'s: one Triton kernel each way on a GPU, which keeps
only the input and the inverse RMS for the backward; the same formulas in torch elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from linmem.ops.fused.norms import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """``y = x / rms(x) · weight`` over the last axis; ``weight [D]``.

    ``zero_centered``: the scale is ``1 + weight`` (weight initialised to 0), as in Qwen3-Next / Qwen3.5.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x [..., D]`` → ``y [..., D]`` in ``out_dtype`` (None: x's dtype).

        With ``residual`` (the residual stream, same shape) the add is fused: returns ``(y, h)`` with
        ``h = x + residual`` in residual's dtype, and ``y`` the norm of ``h``."""
        return rms_norm(x, self.weight, self.eps, residual=residual, zero_centered=self.zero_centered,
                        out_dtype=out_dtype)

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
        return gated_rms_norm(x, gate, self.weight, self.eps, self.activation)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}"
