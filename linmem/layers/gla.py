"""Gated Linear Attention (Yang et al., 2023) as FLA 0.6.0 computes it, on the linmem op.

Per token x, with ``H`` heads, ``K = hidden·expand_k / H`` and ``V = hidden·expand_v / H``:

- ``q, k, v = W_q x, W_k x, W_v x`` (with ``use_short_conv``: each through a short conv + SiLU); no feature map;
- per key channel gate ``g = max(logsigmoid(gk_proj(x)) / gate_logit_normalizer, clamp_min)`` (``gk_proj`` is a
  low-rank pair ``D → 16 → K·H``, the second with bias), additive rule ``S_t = S_{t−1}·diag(e^{g_t}) + v_t k_tᵀ``,
  read-out ``S_t q_t · K^-½``;
- ``o = W_o · gated_rmsnorm(read-out, W_g x)`` per head with a swish gate (``g_norm_swish_gate``).

``num_kv_heads < num_heads`` shares k, v and the gate across groups of query heads (FLA's MQA/GQA option).
Parameter names and shapes equal FLA's ``GatedLinearAttention`` with ``fuse_norm=True`` (its default).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from linmem.layers.norm import GatedRMSNorm
from linmem.layers.recurrent import RecurrentMixer, padding_mask, zero_padding
from linmem.ops import MemoryConfig

if TYPE_CHECKING:
    from linmem.layers.layer_cache import RecurrentLayerCache


def _width(hidden_size: int, expand: float, name: str) -> int:
    width = hidden_size * expand
    if not math.isclose(width, round(width)) or round(width) < 1:
        raise ValueError(f"hidden_size * {name} must be a positive integer; got {hidden_size} * {expand}")
    return round(width)


class GatedLinearAttention(RecurrentMixer):
    """GLA mixer: ``[B, T, D] → [B, T, D]``.

    Args:
        hidden_size: D. num_heads: H. expand_k, expand_v: total key / value widths as fractions of D (FLA's
            defaults 0.5 and 1.0). num_kv_heads: heads of k/v/gate (None: H).
        use_short_conv, conv_size, conv_bias: optional short convolutions (off by default, as in FLA).
        gate_logit_normalizer, gate_low_rank_dim, clamp_min: the gate (16, 16, None in FLA).
        norm_eps: eps of the per-head output norm. backend: the op's backend.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        num_kv_heads: int | None = None,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        gate_logit_normalizer: float = 16,
        gate_low_rank_dim: int = 16,
        clamp_min: float | None = None,
        norm_eps: float = 1e-5,
        backend: str = "auto",
        layer_idx: int | None = None,
    ):
        super().__init__(MemoryConfig("additive"), backend, layer_idx)
        key_dim, value_dim = _width(hidden_size, expand_k, "expand_k"), _width(hidden_size, expand_v, "expand_v")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if key_dim % num_heads or value_dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"key width {key_dim} and value width {value_dim} must divide into num_heads = "
                             f"{num_heads} heads, and num_heads into num_kv_heads = {num_kv_heads} groups")
        # both keep the decay g = max(logsigmoid(·) / normalizer, clamp_min) <= 0 by construction, which lets
        # run_memory skip the op's value check (a host sync) while no hook is on hook_g
        if clamp_min is not None and clamp_min > 0:
            raise ValueError(f"clamp_min must be <= 0 (a log decay floor); got {clamp_min}")
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer must be > 0 (it divides a log decay); got "
                             f"{gate_logit_normalizer}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_k_dim, self.head_v_dim = key_dim // num_heads, value_dim // num_heads
        self.use_short_conv = use_short_conv
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        groups = num_heads // num_kv_heads

        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim // groups, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim // groups, bias=False)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
        if use_short_conv:
            self._make_convs({"q": key_dim, "k": key_dim // groups, "v": value_dim // groups}, conv_size, conv_bias)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, key_dim // groups, bias=True))
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self.g_norm_swish_gate = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="swish")

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``[B, T, heads·d]`` → ``[B, T, H, d]``, repeating each kv head for its group of query heads."""
        x = x.reshape(*x.shape[:2], heads, -1)
        return x.repeat_interleave(self.num_heads // heads, dim=2) if heads != self.num_heads else x

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: RecurrentLayerCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """``hidden_states [B, T, D]`` → ``[B, T, D]``; ``attention_mask [B, past + T]`` (1 real, 0 padding),
        ``cache`` this layer's ``RecurrentLayerCache`` (updated in place). Padding never writes (g = β = 0).
        ``cu_seqlens [N + 1]``: one row (B == 1) of N packed sequences, each mixed as if alone (no cache)."""
        batch, length, _ = hidden_states.shape
        mask = padding_mask(attention_mask, length)
        inputs = dict(cache=cache, silu_without_conv=False, cu_seqlens=cu_seqlens)
        q = self._heads(self.project("q", hidden_states, mask, **inputs), self.num_heads)
        k = self._heads(self.project("k", hidden_states, mask, **inputs), self.num_kv_heads)
        v = self._heads(self.project("v", hidden_states, mask, **inputs), self.num_kv_heads)
        gate_logits = self.gk_proj(hidden_states).to(torch.promote_types(hidden_states.dtype, torch.float32))
        g = F.logsigmoid(self._heads(gate_logits, self.num_kv_heads)) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            g = g.clamp_min(self.clamp_min)
        beta = zero_padding(hidden_states.new_ones(batch, length, self.num_heads), mask)
        g = zero_padding(g, mask)
        o = self.run_memory(q, k, v, g, beta, None, cache, cu_seqlens)
        o = self.g_norm_swish_gate(o, self.g_proj(hidden_states).reshape(batch, length, self.num_heads, -1))
        return self.o_proj(o.reshape(batch, length, -1))
