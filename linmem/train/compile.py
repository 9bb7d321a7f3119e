"""``torch.compile`` of a ``LinMemForCausalLM``'s decoder blocks, so that the elementwise work around the matrix
products (RMSNorms, gates, short convolutions, SiLU, SwiGLU, dtype casts) runs as fused kernels.

Each block is compiled part by part: its two norms, its mixer and its MLP (``nn.Module.compile`` on each, so the
parameter names and the state dict stay as they are). The parts, not the block's own call, because a block under
gradient checkpointing calls ``torch.utils.checkpoint`` inside its ``forward``: dynamo traces a checkpointed body
only when it has no graph break, and the memory op is one (``linmem.ops.linear_memory`` is marked
``torch.compiler.disable``), so a compiled block call would run the whole block eagerly. Compiled part by part, the
checkpoint stays outside the compiled code and both the forward pass and the backward pass's recomputation run
the compiled parts. Only the residual additions between the parts stay eager.

Call ``compile_blocks`` after ``enable_gradient_checkpointing`` and before FSDP2's ``fully_shard`` (its hooks stay
on the block, outside the compiled parts). Blocks of one shape share their compiled graphs, so a deep model
compiles each part once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by whoever passes a model; checking a config value needs no torch
    from torch import nn

# ``torch.compile`` modes (``train.compile: MODE``); ``true`` means "default".
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The parts of a ``LinMemBlock`` that are compiled, by attribute name.
BLOCK_PARTS = ("attn_norm", "attn", "mlp_norm", "mlp")


def compile_mode(value: bool | str | None, key: str = "train.compile") -> str | None:
    """The ``torch.compile`` mode that a config value asks for: None (off) for ``False`` / None, ``"default"``
    for ``True``, else one of ``COMPILE_MODES``; anything else is a ``ValueError`` naming ``key``."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise ValueError(f"{key} must be false, true or one of {', '.join(COMPILE_MODES)}; got {value!r}")


def compile_blocks(model: nn.Module, mode: str = "default", backend: str | Callable = "inductor") -> int:
    """Compile every part (``BLOCK_PARTS``) of every block of ``model.model.layers`` in place with
    ``torch.compile(mode=mode, backend=backend)``; returns the number of parts compiled. ``backend``:
    ``"inductor"`` (fused kernels) or any dynamo backend (``"aot_eager"`` checks tracing without a compiler).
    Nothing compiles until the first forward pass."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
    options = {} if mode == "default" else {"mode": mode}
    compiled = 0
    for block in model.model.layers:
        for name in BLOCK_PARTS:
            getattr(block, name).compile(backend=backend, **options)
            compiled += 1
    return compiled


def compiled_parts(model: nn.Module) -> int:
    """How many block parts of ``model`` are compiled (``compile_blocks``): 0 for an eager model."""
    return sum(getattr(getattr(block, name), "_compiled_call_impl", None) is not None
               for block in model.model.layers for name in BLOCK_PARTS)
