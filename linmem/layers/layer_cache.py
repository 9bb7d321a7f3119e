"""What one layer keeps between forward calls: the per-layer entries of a decoding cache, beside the layers that
read and fill them (``linmem.models.cache.LinMemCache`` holds one per layer).

``RecurrentLayerCache`` for a linear-memory layer::

    base_state      S  [B, H, V, K]   (float32, or float64 for a float64 model)
    residual_state  R  [B, H, V, K]   (RLA / RDN; None otherwise)
    conv_states     {"q": [B, D_q, W − 1], "k": ..., "v": ...}   last W − 1 conv inputs (empty without short convs)
    seen_tokens     tokens processed so far (padding included)

``AttentionLayerCache`` for a softmax layer (``keys``, ``values`` ``[B, S, H_kv, d]``, keys after RoPE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def _map(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    return None if value is None else fn(value)


@dataclass
class RecurrentLayerCache:
    """States of one linear-memory layer (see the module docstring for shapes)."""

    base_state: torch.Tensor | None = None
    residual_state: torch.Tensor | None = None
    conv_states: dict[str, torch.Tensor] = field(default_factory=dict)
    seen_tokens: int = 0

    def memory_state(self, residual: bool):
        """The op's ``initial_state``: None before the first token, else ``S`` or ``(S, R)``."""
        if self.base_state is None:
            return None
        return (self.base_state, self.residual_state) if residual else self.base_state

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every tensor (all have the batch first): reorder, select, repeat."""
        self.base_state, self.residual_state = _map(self.base_state, fn), _map(self.residual_state, fn)
        self.conv_states = {name: fn(state) for name, state in self.conv_states.items()}

    @property
    def batch_size(self) -> int | None:
        return None if self.base_state is None else self.base_state.shape[0]


@dataclass
class AttentionLayerCache:
    """Keys (after RoPE) and values ``[B, S, H_kv, d]`` of one attention layer."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def seen_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``[B, T, H_kv, d]`` keys/values; return all cached ones ``[B, S, H_kv, d]``."""
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=1), torch.cat([self.values, values], dim=1)
        self.keys, self.values = keys, values
        return keys, values

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values = _map(self.keys, fn), _map(self.values, fn)

    @property
    def batch_size(self) -> int | None:
        return None if self.keys is None else self.keys.shape[0]
