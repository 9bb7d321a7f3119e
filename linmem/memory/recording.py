"""Record what a run wrote and read: the hook inputs of recurrent layers, and quantities derived by replay.

A ``Recording`` keeps, per recurrent layer, the tensors at ``hook_q .. hook_gamma`` ``[B, T, H, ...]`` of one
forward from zero states. From them ``derived`` replays the layer to get per-memory read-outs and residual targets
at chosen tokens, for every prompt and head at once.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from linmem.layers.hooks import HOOK_INPUTS
from linmem.memory.components import blocks, mixer, recurrent_layers
from linmem.memory.replay import HeadInputs, replay
from linmem.ops.linear_memory import state_dtype_for


def head_scale(mix: nn.Module) -> float:
    """The read-out scale the layer's op uses (``K**-0.5``)."""
    return mix.head_k_dim ** -0.5


def record_inputs(mix: nn.Module, store: dict[str, torch.Tensor]) -> list[RemovableHandle]:
    """Hooks that store what each of the mixer's ``HOOK_INPUTS`` points carries into ``store[name]``; the caller
    removes the returned handles."""
    points = [(name, getattr(mix, f"hook_{name}", None)) for name in HOOK_INPUTS]
    return [point.register_forward_hook(lambda module, args, out, name=name: store.__setitem__(name, out))
            for name, point in points if point is not None]


@contextmanager
def capture(model: nn.Module, layer_ids: list[int], stores: dict[int, dict[str, torch.Tensor]]):
    """While inside, each forward stores the hook inputs of ``layer_ids`` into ``stores[layer][name]``."""
    handles = []
    try:
        for layer in layer_ids:
            handles += record_inputs(mixer(model, layer), stores.setdefault(layer, {}))
        yield stores
    finally:
        for handle in handles:
            handle.remove()


def on_model(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` on the device of the model's weights (task batches are built on the CPU)."""
    device = next(model.parameters()).device
    return ids if ids.device == device else ids.to(device)


def backbone(model: nn.Module) -> nn.Module:
    """The part of a causal LM that returns hidden states (``model.model``), or the model itself."""
    return getattr(model, "model", model)


def unembed(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``lm_head(hidden)``: ``[..., D]`` → ``[..., vocab]``."""
    head = getattr(model, "lm_head", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no lm_head: pass a causal LM (LinMemForCausalLM)")
    return head(hidden)


@dataclass
class Recording:
    """Hook inputs of one run of ``ids [B, T]`` from zero states, per recurrent layer."""

    model: nn.Module
    ids: torch.Tensor
    inputs: dict[int, dict[str, torch.Tensor]]
    _derived: dict = field(default_factory=dict, repr=False)

    @classmethod
    @torch.no_grad()
    def of(cls, model: nn.Module, ids: torch.Tensor, layer_ids: list[int] | None = None) -> Recording:
        """Run ``ids`` once and keep the hook inputs of ``layer_ids`` (default: every recurrent layer)."""
        layer_ids = recurrent_layers(model) if layer_ids is None else layer_ids
        ids = on_model(model, ids)
        stores: dict[int, dict[str, torch.Tensor]] = {}
        with capture(model, layer_ids, stores):
            backbone(model)(input_ids=ids, use_cache=False)
        return cls(model, ids, stores)

    def at(self, layer: int, name: str, batch: torch.Tensor, positions: list[int], heads: torch.Tensor):
        """Input ``name`` of prompts ``batch [n]``, heads ``heads [n]`` at ``positions``: ``[n, P, ...]``."""
        x = self.inputs[layer][name]
        index = torch.as_tensor(positions, device=x.device)[None, :]
        return x[batch.to(x.device)[:, None], index, heads.to(x.device)[:, None]]

    def derived(self, layer: int, positions: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """``o``, ``base_read`` (the base memory's part of the read-out) and ``r`` (residual target), each
        ``[B, H, P, V]`` at ``positions``, from a replay of every prompt and head of ``layer``."""
        key = (layer, tuple(positions))
        if key not in self._derived:
            self._derived[key] = self._replay(layer, list(positions))
        return self._derived[key]

    def _replay(self, layer: int, positions: list[int]) -> dict[str, torch.Tensor]:
        mix, captured = mixer(self.model, layer), self.inputs[layer]
        batch, _, heads = captured["q"].shape[:3]
        rows = torch.arange(batch).repeat_interleave(heads)
        head_ids = torch.arange(heads).repeat(batch)
        x = HeadInputs.gather(captured, rows, head_ids)
        dtype = state_dtype_for(x.q.dtype)
        zeros = x.v.new_zeros(len(rows), x.v.shape[-1], x.k.shape[-1], dtype=dtype)
        initial = (zeros, zeros.clone() if mix.memory.residual else None)
        out = replay(x, mix.memory, head_scale(mix), initial, sorted(set(positions)), backend=mix.backend)
        index = torch.as_tensor(positions)
        shape = (batch, heads, len(positions), -1)
        return {"o": out.o[:, index].reshape(shape), "base_read": out.base_read[:, index].reshape(shape),
                "r": out.r[:, index].reshape(shape)}


def num_layers(model: nn.Module) -> int:
    return len(blocks(model))
