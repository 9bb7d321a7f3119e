"""pyvene's module mapping for ``LinMemModel`` and ``LinMemForCausalLM``.

pyvene addresses a model's parts by abstract component names (``"block_output"``, ``"mlp_output"``, ...) that a
per-class table maps to module paths and hook kinds; linmem's classes are not in pyvene's tables, so
``register_pyvene()`` adds them. After it, ``pyvene.IntervenableModel({"layer": 0, "component": "block_output"},
model)`` works on a linmem model as on a Llama. pyvene itself is not a dependency of linmem (``pip install
pyvene``).

Components (layer ``i``; ``attn`` is the layer's mixer: a linear memory, or softmax attention in a hybrid's
attention layers):

- ``block_input`` / ``block_output``: the residual stream ``[B, T, D]`` entering / leaving block i;
- ``mlp_input`` / ``mlp_output``: the feed-forward block's input (after ``mlp_norm``) and output;
- ``attention_input`` / ``attention_output``: the mixer's input (after ``attn_norm``) and output (after ``o_proj``);
- ``attention_value_output``: the input of the mixer's ``o_proj``: every head's read-out side by side, after the
  mixer's output norm and gate;
- ``query_output`` / ``key_output`` / ``value_output``: the mixer's ``q_proj`` / ``k_proj`` / ``v_proj`` outputs
  (before short convolutions, activations and norms);
- ``mlp_activation``: the SwiGLU's input to ``down_proj``, ``silu(gate) · up`` ``[B, T, intermediate]`` (not in a
  mixture-of-experts layer, which has no single ``down_proj``).

Only the components of width ``hidden_size`` carry a dimension for pyvene's trainable interventions; the others
have widths that depend on the mixer and serve pyvene's vanilla (swap, collect, zero) interventions. The memory
lab's finer points (the per-head ``hook_readout``, the states) are hook points, ``linmem.layers.recurrent``.
"""

from __future__ import annotations

from typing import Any

from linmem.models import LinMemForCausalLM, LinMemModel

INPUT_HOOK, OUTPUT_HOOK = "register_forward_pre_hook", "register_forward_hook"  # pyvene's hook kinds

# component -> (module path inside LinMemModel, hook kind); %s is the layer index
BACKBONE_MODULES: dict[str, tuple[str, str]] = {
    "block_input": ("layers[%s]", INPUT_HOOK),
    "block_output": ("layers[%s]", OUTPUT_HOOK),
    "mlp_input": ("layers[%s].mlp", INPUT_HOOK),
    "mlp_output": ("layers[%s].mlp", OUTPUT_HOOK),
    "mlp_activation": ("layers[%s].mlp.down_proj", INPUT_HOOK),
    "attention_input": ("layers[%s].attn", INPUT_HOOK),
    "attention_output": ("layers[%s].attn", OUTPUT_HOOK),
    "attention_value_output": ("layers[%s].attn.o_proj", INPUT_HOOK),
    "query_output": ("layers[%s].attn.q_proj", OUTPUT_HOOK),
    "key_output": ("layers[%s].attn.k_proj", OUTPUT_HOOK),
    "value_output": ("layers[%s].attn.v_proj", OUTPUT_HOOK),
}

# component -> the config attributes pyvene reads its width from (components of hidden width only)
DIMENSIONS: dict[str, tuple[str, ...]] = {name: ("hidden_size",) for name in (
    "block_input", "block_output", "mlp_input", "mlp_output", "attention_input", "attention_output")}


def module_mapping(prefix: str = "") -> dict[str, tuple[str, str]]:
    """``BACKBONE_MODULES`` with the paths under ``prefix`` (``"model."`` for ``LinMemForCausalLM``)."""
    return {name: (prefix + path, hook) for name, (path, hook) in BACKBONE_MODULES.items()}


def register_pyvene() -> dict[type, dict[str, Any]]:
    """Add ``LinMemModel`` and ``LinMemForCausalLM`` to pyvene's module and dimension tables (safe to call
    again). Returns the module mapping per class. Raises ``ImportError`` with the install command without pyvene."""
    try:
        from pyvene.models import intervenable_modelcard as card
    except ImportError as error:
        raise ImportError("register_pyvene needs pyvene: pip install pyvene") from error
    mappings = {LinMemModel: module_mapping(), LinMemForCausalLM: module_mapping("model.")}
    for cls, mapping in mappings.items():
        card.type_to_module_mapping[cls] = mapping
        card.type_to_dimension_mapping[cls] = dict(DIMENSIONS)
    return mappings
