"""Routed mixture-of-experts feed-forward block with a gated shared expert (Qwen3-Next / Qwen3.5-MoE's MLP).

Per token x: router probabilities ``p = softmax(gate(x))`` over E experts; the top k are kept (renormalised to sum
to 1 with ``norm_topk_prob``); ``y = Σ_top p_e · expert_e(x)``, each expert a SwiGLU, plus
``sigmoid(shared_expert_gate(x)) · shared_expert(x)`` when a shared expert exists. Parameter names and layouts are
those of transformers 5.x: ``gate.weight [E, D]``, ``experts.gate_up_proj [E, 2I, D]`` (gate rows first, then up),
``experts.down_proj [E, D, I]``, ``shared_expert.{gate,up,down}_proj``, ``shared_expert_gate.weight [1, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linmem.layers.mlp import SwiGLU


class Experts(nn.Module):
    """E SwiGLU experts in two stacked weights: ``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [N, D]``, the chosen ``experts [N, k]`` and their ``weights [N, k]`` → ``Σ w · expert(x)`` ``[N, D]``."""
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            tokens, slot = (experts == expert).nonzero(as_tuple=True)
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Top-k routed experts plus an optional gated shared expert: ``[B, T, D] → [B, T, D]``.

    Args:
        hidden_size: D. num_experts: E. num_experts_per_tok: k, the experts each token goes to.
        intermediate_size: I of each expert. shared_expert_intermediate_size: I of the shared expert (None: no
        shared expert). norm_topk_prob: renormalise the k kept probabilities to sum to 1.
    """

    def __init__(self, hidden_size: int, num_experts: int, num_experts_per_tok: int, intermediate_size: int,
                 shared_expert_intermediate_size: int | None = None, norm_topk_prob: bool = True):
        super().__init__()
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts = {num_experts}]; got "
                             f"{num_experts_per_tok}")
        self.top_k, self.norm_topk_prob = num_experts_per_tok, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        if shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(hidden_size, intermediate_size=shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts ``[N, k]`` and their weights ``[N, k]`` (x's dtype) for tokens ``x [N, D]``;
        probabilities in at least float32."""
        logits = self.gate(x)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        out = self.experts(x, *self.route(x))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
