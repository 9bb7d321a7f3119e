"""The mixer of sGLA, GDN, RLA and RDN: one implementation, two switches (``rule``, ``residual``).

===============================  ============  ==========  ==============================================
class                            rule          residual    memory (docs/math.md)
===============================  ============  ==========  ==============================================
``SimpleGatedLinearAttention``   additive      no          ``S_t = α S + β v kᵀ``
``GatedDeltaNet``                delta         no          ``S_t = α S (I − β k kᵀ) + β v kᵀ``
``ResidualLinearAttention``      additive      yes         + ``R_t = α R + γ r kᵀ``, ``r = clip(v − S_{t−1}k)``
``ResidualDeltaNet``             delta         yes         + ``R_t = α R (I − γ k kᵀ) + γ r kᵀ``
===============================  ============  ==========  ==============================================

Per token x (seed notes §2.2, Fig. 1; FLA's ``GatedDeltaNet`` layer):

- ``q, k = l2norm(silu(conv(W_q x)))``, ``l2norm(silu(conv(W_k x)))``; ``v = silu(conv(W_v x))`` (no conv: only SiLU);
- ``g = log α = −exp(A_log) · softplus(W_a x + dt_bias)`` (Mamba2), ``β = sigmoid(W_b x)``,
  ``γ = sigmoid(W_c x)`` (``gamma="independent"``, ``c_proj``: the correction gate) or ``γ = β`` (``"tied"``);
- ``o = W_o · gated_rmsnorm(read-out, W_g x)`` per head with a swish gate.

Parameter names and shapes equal FLA 0.6.0's ``GatedDeltaNet`` (``q_proj, k_proj, v_proj, a_proj, b_proj, A_log,
dt_bias, q_conv1d, k_conv1d, v_conv1d, g_proj, o_norm, o_proj``); the residual mixers add ``c_proj [H, D]`` for γ
(absent with ``gamma="tied"``).

Grouped key heads (``num_key_heads`` < H, Qwen3-Next / Qwen3.5 / FLA's ``num_v_heads > num_heads``): ``q_proj`` and
``k_proj`` (and their convs) have ``num_key_heads · K`` outputs; after the conv and the L2 norm each key head's q and k
are repeated for its ``H / num_key_heads`` consecutive value heads. The H heads (the hook points' heads, the states,
the memory lab's components) are the value heads. ``allow_neg_eigval``: ``β = 2·sigmoid(W_b x)`` in [0, 2]
(OLMo-Hybrid, FLA's option).

Padding (``attention_mask`` 0) never writes: there the conv inputs, q, k, v and ``g, β, γ`` are all zero.
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
from linmem.ops.config import check_gamma_mode, head_value_dim
from linmem.ops.fused.conv import short_conv
from linmem.ops.fused.norms import l2_norm

if TYPE_CHECKING:
    from linmem.layers.layer_cache import RecurrentLayerCache

class GatedMemoryMixer(RecurrentMixer):
    """sGLA / GDN / RLA / RDN mixer: ``[B, T, D] → [B, T, D]``.

    Args:
        hidden_size: D. num_heads: H. head_dim: K, the key width per head. expand_v: value width ``V = K·expand_v``.
        rule: ``"additive"`` or ``"delta"``. residual: add the residual memory R (RLA / RDN).
        gamma: ``"independent"`` (own projection ``c_proj``) or ``"tied"`` (γ = β; the paper's "w/o γ").
        residual_target, clip, fit_history, output_gates: the op's ablation switches (``MemoryConfig``).
        use_short_conv, conv_size, conv_bias: the q/k/v short convolutions.
        norm_eps: eps of the per-head output norm. backend: the op's backend.
        num_key_heads: heads of q and k (None: H), each serving ``H / num_key_heads`` value heads.
        allow_neg_eigval: β (and γ) = 2·sigmoid(...) instead of sigmoid(...).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        expand_v: float = 2.0,
        rule: str = "delta",
        residual: bool = False,
        gamma: str = "independent",
        residual_target: str = "clip",
        clip: float = 1.0,
        fit_history: bool = True,
        output_gates: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        norm_eps: float = 1e-5,
        backend: str = "auto",
        layer_idx: int | None = None,
        num_key_heads: int | None = None,
        allow_neg_eigval: bool = False,
    ):
        super().__init__(MemoryConfig(rule, residual, residual_target, clip, fit_history, output_gates), backend,
                         layer_idx)
        num_key_heads = num_heads if num_key_heads is None else num_key_heads
        if num_key_heads < 1 or num_heads % num_key_heads:
            raise ValueError(f"num_key_heads must divide num_heads ({num_heads}); got {num_key_heads}")
        check_gamma_mode(gamma)
        self.num_heads, self.head_k_dim, self.head_v_dim = num_heads, head_dim, head_value_dim(head_dim, expand_v)
        self.num_key_heads, self.allow_neg_eigval = num_key_heads, allow_neg_eigval
        self.gamma_mode = gamma
        self.use_short_conv = use_short_conv
        key_dim, value_dim = num_key_heads * self.head_k_dim, num_heads * self.head_v_dim

        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if residual and gamma == "independent":
            self.c_proj = nn.Linear(hidden_size, num_heads, bias=False)
        A_log, dt_bias = mamba2_decay_init(num_heads)
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self._make_convs({"q": key_dim, "k": key_dim, "v": value_dim}, conv_size, conv_bias)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="swish")
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def gate_projections(self) -> list[nn.Linear]:
        """``a_proj``, ``b_proj`` and, with a γ of its own, ``c_proj`` (each ``[H, D]``)."""
        own_gamma = self.memory.residual and self.gamma_mode == "independent"
        return [self.a_proj, self.b_proj] + ([self.c_proj] if own_gamma else [])

    def gate_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``W_a x``, ``W_b x`` (and ``W_c x``), each ``[B, T, H]``, from one product with the projections' weights
        stacked: x is read once and its gradient comes from one product, where a product per gate would read x again
        and add one more ``[B, T, D]`` gradient into x's per gate (the parameters stay the ``nn.Linear`` modules FLA
        names; their forward hooks do not run, the hook points ``hook_g``, ``hook_beta``, ``hook_gamma`` do)."""
        projections = self.gate_projections()
        stacked = stacked_weight(projections)
        return list(F.linear(x, stacked).split([projection.out_features for projection in projections], dim=-1))

    def gates(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``g, β, γ`` each ``[B, T, H]`` (γ None without a residual memory), zero at padding; computed in at least
        float32 (a bf16 decay would round ``log α`` coarsely)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        decay_input, beta_input, *gamma_input = self.gate_inputs(x)
        g = -self.A_log.to(dtype).exp() * F.softplus(decay_input.to(dtype) + self.dt_bias.to(dtype))
        beta = beta_input.to(dtype).sigmoid()
        gamma = None
        if self.memory.residual:
            gamma = gamma_input[0].to(dtype).sigmoid() if gamma_input else beta
        if self.allow_neg_eigval:
            beta, gamma = 2 * beta, None if gamma is None else 2 * gamma
        g, beta = zero_padding(g, mask), zero_padding(beta, mask)
        return g, beta, None if gamma is None else zero_padding(gamma, mask)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: RecurrentLayerCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """``hidden_states [B, T, D]`` → ``[B, T, D]``.

        Args:
            attention_mask: ``[B, past + T]``, 1 for real tokens and 0 for padding (only the last T columns are used).
            cache: this layer's ``RecurrentLayerCache``; read and updated in place (None: start from zeros).
            cu_seqlens: ``[N + 1]``: ``hidden_states`` is one row (B == 1) of N packed sequences, each mixed as if
                alone (``linmem.ops.packing``; no cache).
            kwargs: ignored (``position_ids`` for attention layers).
        """
        batch, length, _ = hidden_states.shape
        mask = padding_mask(attention_mask, length)
        heads, key_heads = (batch, length, self.num_heads, -1), (batch, length, self.num_key_heads, -1)
        q, k, v = self.queries_keys_values(hidden_states, mask, cache, cu_seqlens)
        q, k = l2_norm(q.reshape(key_heads)), l2_norm(k.reshape(key_heads))
        if self.num_key_heads != self.num_heads:  # each key head serves a group of consecutive value heads
            groups = self.num_heads // self.num_key_heads
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        v = v.reshape(heads)
        g, beta, gamma = self.gates(hidden_states, mask)
        o = self.run_memory(q, k, v, g, beta, gamma, cache, cu_seqlens)
        o = self.o_norm(o, self.g_proj(hidden_states).reshape(heads))
        return self.o_proj(o.reshape(batch, length, -1))

    def queries_keys_values(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        cache: RecurrentLayerCache | None,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k ``[B, T, num_key_heads·K]`` and v ``[B, T, H·V]`` after the projections and the short convolutions
        with SiLU (only SiLU without convolutions), zero at padding.

        Without a cache and padding (training, scoring, packed rows) the three projections run as one matrix
        product and the three convolutions as one fused convolution over the ``[B, T, 2·num_key_heads·K + H·V]``
        channels (``linmem.ops.fused.short_conv``); q, k and v are views of its output. With a cache (decoding,
        prefill into a cache) or padding, each goes through ``project``, which reads and writes the cache's windows."""
        if not (self.use_short_conv and cache is None and mask is None):
            inputs = dict(cache=cache, silu_without_conv=True, cu_seqlens=cu_seqlens)
            return tuple(self.project(name, x, mask, **inputs) for name in ("q", "k", "v"))
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        weight = stacked_weight([self.q_proj, self.k_proj, self.v_proj])
        taps = torch.cat([conv.weight[:, 0] for conv in convs])
        bias = None if convs[0].bias is None else torch.cat([conv.bias for conv in convs])
        y = short_conv(F.linear(x, weight), taps, bias, activation="silu", cu_seqlens=cu_seqlens)
        widths = [conv.hidden_size for conv in convs]
        return tuple(y.split(widths, dim=-1))


def stacked_weight(projections: list[nn.Linear]) -> torch.Tensor:
    """The weights of ``projections`` (linear maps of one input width) stacked along their outputs, ``[Σ out, D]``,
    for one product in place of one per map. Under autocast each weight is cast to autocast's type before the stack,
    as autocast would cast it for its own product: the stack then copies 16-bit weights once, where stacking the
    float32 weights would copy them and then cast the copy (at GDN-1.3B's q, k, v that is 50 MB more written per
    layer and step)."""
    weights = [projection.weight for projection in projections]
    device_type = weights[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        weights = [weight.to(dtype) for weight in weights]
    return torch.cat(weights)


def mamba2_decay_init(num_heads: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 / FLA initialisation of ``(A_log, dt_bias)``, each ``[H]``: ``A ~ U(0, 16)``; ``dt`` log-uniform in
    [1e-3, 0.1] (floor 1e-4) and ``dt_bias = softplus⁻¹(dt)``, so the initial decays ``exp(−A·dt)`` spread over many
    time scales."""
    A = torch.empty(num_heads, device=device).uniform_(0, 16)
    u = torch.rand(num_heads, device=device)
    dt = (u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).exp().clamp(min=1e-4)
    return A.log(), dt + torch.log(-torch.expm1(-dt))


class SimpleGatedLinearAttention(GatedMemoryMixer):
    """sGLA: additive rule, normalised q/k, scalar α and β per head (the RLA paper's baseline)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, rule="additive", residual=False, **kwargs)


class GatedDeltaNet(GatedMemoryMixer):
    """GDN: delta rule with scalar decay per head (FLA's ``GatedDeltaNet`` layer)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, rule="delta", residual=False, **kwargs)


class ResidualLinearAttention(GatedMemoryMixer):
    """RLA: sGLA plus a residual memory that fits the clipped prediction error (additive rule for both)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, rule="additive", residual=True, **kwargs)


class ResidualDeltaNet(GatedMemoryMixer):
    """RDN: GDN plus a residual memory, the delta rule for both memories."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, rule="delta", residual=True, **kwargs)
