"""nn.Modules around the op: one class per mixer, plus the blocks they are built from.

Linear memories: ``SimpleGatedLinearAttention`` (sGLA), ``GatedDeltaNet`` (GDN), ``ResidualLinearAttention`` (RLA),
``ResidualDeltaNet`` (RDN), all thin names for ``GatedMemoryMixer``; ``GatedLinearAttention`` (GLA). Softmax
``Attention`` for hybrids; ``SparseMoE``, the routed MLP of MoE hybrids. Every linear mixer exposes the ``hook_*``
points listed in ``linmem.layers.recurrent``.
"""

from linmem.layers.attention import Attention
from linmem.layers.conv import ShortConvolution
from linmem.layers.gated_memory import (
    GatedDeltaNet,
    GatedMemoryMixer,
    ResidualDeltaNet,
    ResidualLinearAttention,
    SimpleGatedLinearAttention,
)
from linmem.layers.gla import GatedLinearAttention
from linmem.layers.hooks import HookPoint
from linmem.layers.mlp import SwiGLU
from linmem.layers.moe import SparseMoE
from linmem.layers.norm import GatedRMSNorm, RMSNorm
from linmem.layers.recurrent import RecurrentMixer

__all__ = [
    "Attention",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "GatedMemoryMixer",
    "GatedRMSNorm",
    "HookPoint",
    "RMSNorm",
    "RecurrentMixer",
    "ResidualDeltaNet",
    "ResidualLinearAttention",
    "ShortConvolution",
    "SimpleGatedLinearAttention",
    "SparseMoE",
    "SwiGLU",
]
