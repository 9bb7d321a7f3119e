"""Named hook points: identity modules that mark where the memory lab may read or replace a tensor.

A mixer calls ``x = self.hook_k(x)`` at each point of interest. Nothing happens unless someone registers a hook::

    seen = {}
    layer.hook_k.register_forward_hook(lambda module, args, out: seen.setdefault("k", out))   # read
    layer.hook_readout.register_forward_hook(lambda module, args, out: out * 0)              # replace

A forward hook that returns a value replaces the tensor for the rest of the run (PyTorch semantics), so an
intervention is a hook on a named point, never a patch of the mixer's code (as in TransformerLens).
"""

from __future__ import annotations

import torch
from torch import nn

# the hook points (``hook_<name>``) of a recurrent mixer that carry the op's per-token inputs, in the op's order
HOOK_INPUTS = ("q", "k", "v", "g", "beta", "gamma")


class HookPoint(nn.Module):
    """Identity ``x ↦ x``; exists only to be addressed by name (``model.layers.3.attn.hook_k``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
