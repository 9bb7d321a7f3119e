"""Causal softmax attention with RoPE for hybrid models (FLA's ``fla/layers/attn.py`` names and math).

``head_dim = hidden_size / num_heads`` unless given; ``num_kv_heads < num_heads`` is grouped-query attention (query
head h reads kv head ``h // (num_heads / num_kv_heads)``); RoPE rotates the two halves of each head's first
``rotary_dim = head_dim · partial_rotary_factor`` channels (GPT-NeoX style, FLA's default; the rest pass unrotated);
``window_size`` w lets a query see itself and the w − 1 tokens before it. Positions come from the caller
(``position_ids``, counted over real tokens only, so left padding does not shift them).

Options of the Hugging Face hybrids (Qwen3-Next / Qwen3.5, OLMo-Hybrid): a sigmoid output gate per channel
(``g_proj``, Qwen's second half of each head of its ``q_proj``), q/k RMSNorm per head or over all heads at once
(OLMo), zero-centred norm weights (``1 + w``), a bias on ``o_proj``, and no rotary embedding (``rope_theta=None``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from linmem.layers.hooks import HookPoint
from linmem.layers.norm import RMSNorm
from linmem.layers.recurrent import padding_mask, zero_padding
from linmem.ops.packing import check_packed_row, sequence_ids

if TYPE_CHECKING:
    from linmem.layers.layer_cache import AttentionLayerCache


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate ``x [B, T, H, d]`` by ``positions [B, T]``: pairs ``(x_i, x_{i+r/2})`` of the first ``r = rotary_dim``
    channels (None: all d) turn by ``pos · θ^{−2i/r}``; channels from r on pass unchanged."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary_dim], positions, theta), x[..., rotary_dim:]], dim=-1)
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


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``softmax(q kᵀ / √d)`` over the keys allowed by ``mask`` (``[B or 1, 1, T, S]``, True = may attend), in at
    least float32: ``q [B, H, T, d]``, ``k [B, H, S, d]`` → ``[B, H, T, S]`` (the scaling of
    ``scaled_dot_product_attention``, so the weights are the ones the fused kernel applies)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


class Attention(nn.Module):
    """Softmax attention ``[B, T, D] → [B, T, D]``.

    Args:
        hidden_size: D. num_heads: H. num_kv_heads: kv heads (None: H).
        qkv_bias: biases on q/k/v projections. qk_norm: RMSNorm of q and k (``q_norm``, ``k_norm``).
        window_size: sliding window w (None: full causal). rope_theta: RoPE base (None: no rotary embedding).
        norm_eps: eps of qk norms. head_dim: d (None: D / H). partial_rotary_factor: share of each head's channels
        RoPE rotates (``rotary_dim = int(d · factor)``, even). output_gate: ``o = o_proj(attn · sigmoid(g_proj x))``.
        qk_norm_over: ``"head"`` (one norm of width d per head) or ``"all"`` (one norm over all H·d channels, before
        the split into heads, OLMo's). zero_centered_norms: q/k norm scales ``1 + w``. o_bias: bias on ``o_proj``.

    Hook points (``linmem.layers.hooks``): ``hook_q`` ``[B, T, H, d]`` and ``hook_k`` ``[B, T, H_kv, d]``, the
    queries and the new tokens' keys after RoPE, as the attention weights use them.

    ``forward(..., output_attentions=True)`` returns ``(output, weights)`` with the softmax weights
    ``[B, H, T, past + T]`` (0 where a key is masked and in the rows of padded queries), computed explicitly instead
    of by the fused kernel.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        window_size: int | None = None,
        rope_theta: float | None = 10000.0,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
        head_dim: int | None = None,
        partial_rotary_factor: float = 1.0,
        output_gate: bool = False,
        qk_norm_over: str = "head",
        zero_centered_norms: bool = False,
        o_bias: bool = False,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"attention needs hidden_size ({hidden_size}) divisible by num_heads ({num_heads}) "
                             f"when head_dim is not given")
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        rotary_dim = int(head_dim * partial_rotary_factor)
        if num_heads % num_kv_heads or (rope_theta is not None and (rotary_dim % 2 or not 0 < rotary_dim <= head_dim)):
            raise ValueError(f"attention needs num_heads ({num_heads}) divisible by num_kv_heads ({num_kv_heads}) "
                             f"and an even rotary width head_dim x partial_rotary_factor in (0, head_dim]; got "
                             f"{head_dim} x {partial_rotary_factor}")
        if window_size is not None and window_size < 1:
            raise ValueError(f"window_size must be a positive integer or None; got {window_size}")
        if qk_norm_over not in ("head", "all"):
            raise ValueError(f"qk_norm_over must be 'head' or 'all'; got {qk_norm_over!r}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.window_size, self.rope_theta, self.layer_idx = window_size, rope_theta, layer_idx
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.output_gate = output_gate
        if output_gate:
            self.g_proj = nn.Linear(hidden_size, q_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden_size, bias=o_bias)
        self.hook_q, self.hook_k = HookPoint(), HookPoint()
        self.qk_norm, self.qk_norm_over = qk_norm, qk_norm_over
        if qk_norm:
            widths = (head_dim, head_dim) if qk_norm_over == "head" else (q_dim, kv_dim)
            self.q_norm = RMSNorm(widths[0], eps=norm_eps, zero_centered=zero_centered_norms)
            self.k_norm = RMSNorm(widths[1], eps=norm_eps, zero_centered=zero_centered_norms)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: AttentionLayerCache | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states [B, T, D]`` → ``[B, T, D]`` (with ``output_attentions``: and the weights
        ``[B, H, T, past + T]``).

        Args:
            attention_mask: ``[B, past + T]`` 0/1 padding mask over the cached and the new tokens.
            cache: this layer's ``AttentionLayerCache`` (keys/values appended in place).
            position_ids: RoPE positions ``[B, T]`` (None: ``past, past + 1, ...``; packed rows: pass each
                sequence's own positions, ``linmem.ops.packing.sequence_positions``).
            cu_seqlens: ``[N + 1]``: one row (B == 1) of N packed sequences; a query sees only keys of its own
                sequence (block-diagonal causal attention; no cache, no attention_mask).
        """
        batch, length, _ = hidden_states.shape
        if cu_seqlens is not None:
            check_packed_row(cu_seqlens, batch)
            if cache is not None or attention_mask is not None:
                raise ValueError("cu_seqlens: packed sequences take no cache and no attention_mask")
        q, k = self.q_proj(hidden_states), self.k_proj(hidden_states)
        if self.qk_norm and self.qk_norm_over == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, length, self.num_heads, self.head_dim)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.qk_norm_over == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if position_ids is None:
            past = 0 if cache is None else cache.seen_tokens
            position_ids = torch.arange(past, past + length, device=q.device).expand(batch, length)
        if self.rope_theta is not None:
            q = apply_rope(q, position_ids, self.rope_theta, self.rotary_dim)
            k = apply_rope(k, position_ids, self.rope_theta, self.rotary_dim)
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
        if cu_seqlens is not None:
            sequence = sequence_ids(cu_seqlens, length)
            mask = mask & (sequence[:, None] == sequence[None, :])
        groups = self.num_heads // self.num_kv_heads
        k, v = (x.repeat_interleave(groups, dim=2) if groups > 1 else x for x in (k, v))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        weights = None
        if output_attentions:
            weights = attention_weights(q, k, mask)
            o = (weights @ v.to(weights.dtype)).to(v.dtype)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(1, 2).reshape(batch, length, -1)
        if self.output_gate:
            o = o * torch.sigmoid(self.g_proj(hidden_states))
        o = self.o_proj(o)
        if weights is None:
            return o
        if new_padding is not None:  # a padded query reads itself only to stay finite; report no weights for it
            weights = weights.masked_fill(~new_padding[:, None, :, None], 0.0)
        return o, weights.to(o.dtype)
