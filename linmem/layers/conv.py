"""Short causal depthwise convolution with a cache for decoding (the ``q/k/v_conv1d`` of FLA's layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linmem.ops.packing import check_packed_row, sequence_positions


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution over time, kernel width W, optional SiLU.

    ``y_t = act(Σ_{j<W} w[:, j] ⊙ x_{t−W+1+j} + b)``: the last tap multiplies the current token, positions before the
    start are zeros. Parameters are those of a depthwise ``nn.Conv1d`` (``weight [D, 1, W]``, ``bias [D]`` if
    ``bias``), so FLA's ``ShortConvolution`` weights load as they are.

    The cache ``state [B, D, W − 1]`` holds the last W − 1 inputs (oldest first); passing it back continues the
    sequence exactly, one token or many at a time.
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu"):
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation must be None, 'silu' or 'swish'; got {activation!r}")
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias, padding=0)
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(
        self,
        x: torch.Tensor,
        state: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve ``x [B, T, D]`` after ``state [B, D, W − 1]`` (None: zeros).

        ``mask [B, T]`` (True / 1 real, 0 padding) zeroes padded inputs first, so a left-padded sequence sees
        exactly the zeros it would see alone. ``cu_seqlens [N + 1]``: x is one row of N packed sequences
        (``linmem.ops.packing``), each convolved as if alone (taps reaching before its start read zeros; no
        ``state``). Returns ``y [B, T, D]`` and the new state ``[B, D, W − 1]``.
        """
        if mask is not None:
            x = torch.where(mask.bool().unsqueeze(-1), x, torch.zeros((), dtype=x.dtype))
        batch, length, dim = x.shape
        x = x.transpose(1, 2)
        if state is None:
            state = x.new_zeros(batch, dim, self.kernel_size[0] - 1)
        elif cu_seqlens is not None:
            raise ValueError("cu_seqlens: packed sequences start from zeros; pass state=None")
        full = torch.cat([state.to(x.dtype), x], dim=-1)
        if cu_seqlens is not None:
            check_packed_row(cu_seqlens, batch)
            y = self._taps(full, length, sequence_positions(cu_seqlens, length))
        elif torch.compiler.is_compiling():
            y = self._taps(full, length)  # element-wise, so the compiler fuses it with the activation
        else:
            y = F.conv1d(full, self.weight, self.bias, groups=dim)
        if self.activation is not None:
            y = F.silu(y)
        return y.transpose(1, 2), full[..., full.shape[-1] - (self.kernel_size[0] - 1):]

    def _taps(self, full: torch.Tensor, length: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution of ``full [B, D, W − 1 + T]`` as a sum over taps, ``[B, D, T]`` in ``full``'s dtype
        (products and sums in the wider of it and the weight's). Tap j reads ``W − 1 − j`` tokens back; with
        ``positions [T]`` (each token's place in its own sequence) it counts only where it stays in that sequence."""
        width = self.kernel_size[0]
        y = self.bias[:, None] if self.bias is not None else 0
        for j in range(width):
            tap = full[..., j:j + length] * self.weight[:, 0, j, None]
            if positions is not None:
                tap = tap * (positions >= width - 1 - j)
            y = y + tap
        return y.to(full.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, kernel_size={self.kernel_size[0]}, bias={self.bias is not None}, " \
               f"activation={self.activation}"
