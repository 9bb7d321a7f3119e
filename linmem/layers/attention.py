"""Causal softmax attention with RoPE for hybrid models (FLA's ``fla/layers/attn.py`` names and math).

``head_dim = hidden_size / num_heads``; ``num_kv_heads < num_heads`` is grouped-query attention (query head h reads
kv head ``h // (num_heads / num_kv_heads)``); RoPE rotates the two halves of each head (GPT-NeoX style, FLA's
default); ``window_size`` w lets a query see itself and the w − 1 tokens before it. Positions come from the caller
(``position_ids``, counted over real tokens only, so left padding does not shift them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from linmem.layers.hooks import HookPoint
from linmem.layers.norm import RMSNorm
from linmem.layers.recurrent import padding_mask, zero_padding

if TYPE_CHECKING:
    from linmem.models.cache import AttentionLayerCache


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [B, T, H, d]`` by ``positions [B, T]``: pairs ``(x_i, x_{i+d/2})`` turn by ``pos · θ^{−2i/d}``."""
    half = x.shape[-1] // 2
    dtype = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, half, device=x.device, dtype=dtype) / half)
    angle = (positions.to(dtype)[..., None] * inv_freq)[:, :, None, :]  # [B, T, 1, d/2]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half].to(dtype), x[..., half:].to(dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention_mask_4d(
    key_padding: torch.Tensor | None,
    query_length: int,
    key_length: int,
    window_size: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Boolean ``[B or 1, 1, T, S]`` mask, True = may attend: causal, inside the window, key not padding.

    The queries are the last T of the S positions. A query always sees itself, so a padding query (whose keys
    are all padding) gets a finite, ignored output instead of NaN.
    """
    query_pos = torch.arange(key_length - query_length, key_length, device=device)[:, None]
    key_pos = torch.arange(key_length, device=device)[None, :]
    allowed = key_pos <= query_pos
    if window_size is not None:
        allowed = allowed & (key_pos > query_pos - window_size)
    allowed = allowed[None, None]
    if key_padding is not None:
        allowed = allowed & key_padding[:, None, None, :].bool()
    return allowed | (key_pos == query_pos)[None, None]


class Attention(nn.Module):
    """Softmax attention ``[B, T, D] → [B, T, D]``.

    Args:
        hidden_size: D. num_heads: H (head_dim = D / H, even). num_kv_heads: kv heads (None: H).
        qkv_bias: biases on q/k/v projections. qk_norm: per-head RMSNorm of q and k (``q_norm``, ``k_norm``).
        window_size: sliding window w (None: full causal). rope_theta: RoPE base. norm_eps: eps of qk norms.

    Hook points (``linmem.layers.hooks``): ``hook_q`` ``[B, T, H, d]`` and ``hook_k`` ``[B, T, H_kv, d]``, the
    queries and the new tokens' keys after RoPE, as the attention weights use them.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        window_size: int | None = None,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if hidden_size % num_heads or (hidden_size // num_heads) % 2 or num_heads % num_kv_heads:
            raise ValueError(f"attention needs hidden_size ({hidden_size}) = num_heads ({num_heads}) x an even "
                             f"head_dim, and num_heads divisible by num_kv_heads ({num_kv_heads})")
        if window_size is not None and window_size < 1:
            raise ValueError(f"window_size must be a positive integer or None; got {window_size}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.window_size, self.rope_theta, self.layer_idx = window_size, rope_theta, layer_idx
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.hook_q, self.hook_k = HookPoint(), HookPoint()
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: AttentionLayerCache | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """``hidden_states [B, T, D]`` → ``[B, T, D]``.

        Args:
            attention_mask: ``[B, past + T]`` 0/1 padding mask over the cached and the new tokens.
            cache: this layer's ``AttentionLayerCache`` (keys/values appended in place).
            position_ids: RoPE positions ``[B, T]`` (None: ``past, past + 1, ...``).
        """
        batch, length, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if position_ids is None:
            past = 0 if cache is None else cache.seen_tokens
            position_ids = torch.arange(past, past + length, device=q.device).expand(batch, length)
        q, k = apply_rope(q, position_ids, self.rope_theta), apply_rope(k, position_ids, self.rope_theta)
        q, k = self.hook_q(q), self.hook_k(k)
        new_padding = padding_mask(attention_mask, length)
        k, v = zero_padding(k, new_padding), zero_padding(v, new_padding)  # masked keys must not carry NaN either
        if cache is not None:
            k, v = cache.append(k, v)
        key_length = k.shape[1]
        if attention_mask is not None and attention_mask.shape[-1] != key_length:
            raise ValueError(f"attention_mask must cover the cached and new tokens: [B, {key_length}]; got "
                             f"{list(attention_mask.shape)}")
        mask = attention_mask_4d(attention_mask, length, key_length, self.window_size, q.device)
        groups = self.num_heads // self.num_kv_heads
        k, v = (x.repeat_interleave(groups, dim=2) if groups > 1 else x for x in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(batch, length, -1))
