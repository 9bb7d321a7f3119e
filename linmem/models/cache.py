"""The decoding cache: per layer, what the next token needs, under names a reader (and the memory lab) can use.

``LinMemCache.layers[i]`` is a ``RecurrentLayerCache`` for a linear-memory layer and an ``AttentionLayerCache`` for
a softmax layer (``linmem.layers.layer_cache`` defines both, with their shapes).

``LinMemCache`` subclasses transformers' ``Cache`` so ``generate()`` passes it between steps; it is not compilable
and cannot be cropped (a recurrent state cannot be rolled back), which rules out assisted decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from linmem.layers.layer_cache import AttentionLayerCache, RecurrentLayerCache


class LinMemCache(Cache):
    """One cache entry per model layer: ``RecurrentLayerCache`` or ``AttentionLayerCache``.

    Args:
        attention_layers: which layer indices are softmax attention. num_layers: how many layers in all.
    """

    def __init__(self, num_layers: int, attention_layers: list[int] | tuple[int, ...] = ()):
        layers = [AttentionLayerCache() if i in attention_layers else RecurrentLayerCache() for i in range(num_layers)]
        super().__init__(layers=layers)

    @classmethod
    def from_config(cls, config) -> LinMemCache:
        """An empty cache for a ``LinMemConfig``."""
        return cls(config.num_hidden_layers, config.attention.layers)

    def __repr__(self) -> str:
        kinds = ["attention" if isinstance(layer, AttentionLayerCache) else "recurrent" for layer in self.layers]
        return f"LinMemCache(seen_tokens={self.get_seq_length()}, layers={kinds})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed so far (every layer sees the same tokens)."""
        return self.layers[layer_idx].seen_tokens if self.layers else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def batch_size(self) -> int:
        sizes = {layer.batch_size for layer in self.layers} - {None}
        return sizes.pop() if len(sizes) == 1 else -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.get_seq_length() > 0

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        return [isinstance(layer, RecurrentLayerCache) for layer in self.layers]

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    def update(self, *args, **kwargs):
        raise NotImplementedError("LinMemCache is filled by the linmem layers themselves (cache.layers[i])")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a recurrent state cannot be rolled back; LinMemCache cannot be cropped")

    def reset(self) -> None:
        """Forget everything (fresh layer caches of the same kinds)."""
        self.layers = [type(layer)() for layer in self.layers]

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for layer in self.layers:
            layer.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))
