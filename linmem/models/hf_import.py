"""Import Hugging Face transformers 5.x Gated DeltaNet hybrids as ``LinMemForCausalLM`` models with the same logits:
``qwen3_next`` (Qwen3-Next), ``qwen3_5`` (Qwen3.5, dense; its text model), ``qwen3_5_moe`` (Qwen3.5-MoE) and
``olmo_hybrid`` (OLMo-Hybrid).

The converted model is linmem's one model class, so the memory lab (``linmem.memory``), its hook points and
``LinMemCache`` work on it unchanged. What maps to what:

- **recurrent layers** (``layer_types[i] == "linear_attention"``) → ``GatedDeltaNet`` with ``num_heads`` = the HF
  value heads (``linear_num_value_heads``; these are the lab's heads) and ``num_key_heads`` = the HF key heads
  (``linear_num_key_heads``), ``head_dim`` = ``linear_key_head_dim``, ``expand_v`` = value / key head width. HF's
  one depthwise conv over the concatenated ``[q | k | v]`` channels is split into ``q_conv1d``, ``k_conv1d`` and
  ``v_conv1d`` (a depthwise conv acts on each channel alone, so this is exact); Qwen3-Next's fused
  ``in_proj_qkvz`` / ``in_proj_ba`` (grouped by key head) and Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a`` become ``q_proj, k_proj, v_proj, g_proj`` (the output gate z), ``b_proj``,
  ``a_proj``; ``A_log``, ``dt_bias`` keep their names; the gated output norm ``norm`` / ``o_norm`` → ``o_norm``,
  ``out_proj`` → ``o_proj``. The math is the same: ``g = −exp(A_log)·softplus(a + dt_bias)``, ``β = sigmoid(b)``
  (OLMo-Hybrid's ``linear_allow_neg_eigval``: ``2·sigmoid(b)``), L2-normalised q and k, read-out scale ``K^-½``.
- **states**: HF keeps a recurrent state ``[B, H_v, K, V]`` and a conv state ``[B, 2·H_k·K + H_v·V, W]``; linmem keeps
  ``S [B, H_v, V, K]`` (the transpose) and one conv state ``[B, channels, W − 1]`` per q, k, v.
- **attention layers** → ``Attention`` with ``attention.head_dim`` = HF ``head_dim``, ``partial_rotary_factor``, q/k
  RMSNorm (per head for Qwen, over all heads for OLMo), and for Qwen the sigmoid output gate: HF's ``q_proj`` holds
  ``[query | gate]`` per head, split here into ``q_proj`` and ``g_proj``.
- **norms**: Qwen's RMSNorms scale by ``1 + w`` (``norm_zero_centered``); OLMo-Hybrid's attention blocks norm the
  outputs of attention and MLP (``attention.norm_placement="post"``: its ``post_attention_layernorm`` →
  ``attn_norm``, ``post_feedforward_layernorm`` → ``mlp_norm``).
- **MLPs**: SwiGLU, or ``SparseMoE`` (router ``gate``, stacked ``experts``, gated ``shared_expert``) for the MoE
  layers of ``qwen3_next`` (``decoder_sparse_step``, ``mlp_only_layers``) and every layer of ``qwen3_5_moe``.

A folder streams (``load_hf_folder``): the config comes from ``AutoConfig``; the conversion first runs on the
shapes of the safetensors headers into a model on the meta device, so weights that do not fit the config (a
vocabulary of 10^12) are one line before anything is allocated; then the linmem model is allocated on the target
device and each safetensors tensor is converted on its own (``hf_tensor_to_linmem``) and copied in, one shard open at
a time; the transformers model is never built.

Anything linmem cannot reproduce exactly raises a ``ValueError`` naming the model type and the reason (another
activation, a RoPE scaling type, ``kimi_linear``'s per-channel decay with the delta rule, ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from linmem.models.configuration import LinMemConfig
from linmem.models.fla_import import (
    WeightWriter,
    check_checkpoint_shapes,
    empty_model,
    safetensors_files,
    stored_dtype,
    stream_safetensors,
)
from linmem.models.modeling import LinMemForCausalLM
from linmem.models.sub_configs import AttentionConfig, MoEConfig

# text-model types (a composite Qwen3.5 config's text_config has the "_text" type)
QWEN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
HF_MODEL_TYPES = (*QWEN_TYPES, "olmo_hybrid")
REFUSED_MODEL_TYPES = {
    "kimi_linear": "its KDA layers use the delta rule with a per-key-channel decay, which linmem's op does not "
                   "compute (it has per-channel decay only with the additive rule)",
}
_ROPE_KEYS_WITHOUT_MATH = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


def _refuse(model_type: str, why: str) -> ValueError:
    return ValueError(f"model_type {model_type!r} cannot be imported into linmem: {why}")


def text_config(hf_config) -> Any:
    """The text model's config of a (possibly composite, vision + text) transformers config."""
    get = getattr(hf_config, "get_text_config", None)
    return get() if get is not None else hf_config


def check_model_type(model_type: str | None) -> None:
    """Raise ``ValueError`` unless linmem imports ``model_type`` (naming why for the ones it refuses)."""
    if model_type in REFUSED_MODEL_TYPES:
        raise _refuse(model_type, REFUSED_MODEL_TYPES[model_type])
    if model_type not in HF_MODEL_TYPES:
        raise _refuse(str(model_type), f"linmem imports the transformers model types {HF_MODEL_TYPES}")


def _rope(config, model_type: str) -> dict[str, Any]:
    """``rope_theta`` (None: no RoPE) and ``partial_rotary_factor`` of the attention layers (``AttentionConfig``
    fields)."""
    params = getattr(config, "rope_parameters", None)
    if params is None or params.get("rope_theta") is None:
        if model_type == "olmo_hybrid":
            return dict(rope_theta=None, partial_rotary_factor=1.0)  # OLMo-Hybrid's NoPE mode
        raise _refuse(model_type, "the config has no rope_parameters['rope_theta']")
    if params.get("rope_type", "default") != "default":
        raise _refuse(model_type, f"RoPE type {params['rope_type']!r}: linmem implements only the default RoPE "
                                  f"(no scaling)")
    extra = sorted(set(params) - _ROPE_KEYS_WITHOUT_MATH)
    if extra:
        raise _refuse(model_type, f"rope_parameters fields {extra} are not implemented in linmem")
    # Qwen3.5's multimodal RoPE (mrope_section) gives text tokens the same position on all three axes, which is the
    # plain RoPE linmem computes
    return dict(rope_theta=float(params["rope_theta"]), partial_rotary_factor=float(params.get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0)))


def _moe_config(config, model_type: str) -> MoEConfig | None:
    """The routed experts of a Qwen3-Next / Qwen3.5-MoE config (None: a dense model)."""
    if model_type in ("qwen3_5", "qwen3_5_text", "olmo_hybrid") or not getattr(config, "num_experts", 0):
        return None
    layers = list(range(config.num_hidden_layers))
    norm_topk = True  # Qwen3.5-MoE's router always renormalises the kept probabilities
    if model_type == "qwen3_next":
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
        layers = [i for i in layers if i not in dense and (i + 1) % step == 0]
        norm_topk = bool(config.norm_topk_prob)
    return MoEConfig(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                     intermediate_size=config.moe_intermediate_size,
                     shared_expert_intermediate_size=config.shared_expert_intermediate_size or None,
                     norm_topk_prob=norm_topk, layers=layers)


def hf_config_to_linmem(hf_config, *, backend: str = "auto", tie_word_embeddings: bool | None = None) -> LinMemConfig:
    """The ``LinMemConfig`` of a transformers ``Qwen3NextConfig``, ``Qwen3_5Config`` / ``Qwen3_5TextConfig``,
    ``Qwen3_5MoeConfig`` / ``Qwen3_5MoeTextConfig`` or ``OlmoHybridConfig``.

    Args:
        hf_config: the transformers config (a composite Qwen3.5 config's ``text_config`` is used).
        backend: the linmem op backend to record.
        tie_word_embeddings: whether ``lm_head`` shares the embedding (None: the config's field).
    Raises:
        ValueError: naming the model type and the reason, for anything linmem cannot reproduce exactly.
    """
    check_model_type(getattr(hf_config, "model_type", None))
    config = text_config(hf_config)
    model_type = config.model_type
    check_model_type(model_type)
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _refuse(model_type, f"hidden_act {act!r}: linmem's MLP and short convolutions use SiLU")
    kinds = set(config.layer_types) - {"linear_attention", "full_attention"}
    if kinds:
        raise _refuse(model_type, f"layer types {sorted(kinds)}: linmem builds 'linear_attention' (GDN) and "
                                  f"'full_attention' layers only")
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        raise _refuse(model_type, "sliding-window attention layers are not mapped")
    qwen = model_type in QWEN_TYPES
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    heads, attn_heads = config.linear_num_value_heads, config.num_attention_heads
    attn_head_dim = getattr(config, "head_dim", None) if qwen else None
    bias = bool(getattr(config, "attention_bias", False))
    tie = config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, (list, tuple)) else config.eos_token_id
    return LinMemConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        mixer="gdn", num_heads=heads, num_key_heads=config.linear_num_key_heads, head_dim=key_dim,
        expand_v=value_dim / key_dim, use_short_conv=True, conv_size=config.linear_conv_kernel_dim, conv_bias=False,
        allow_neg_eigval=bool(getattr(config, "linear_allow_neg_eigval", False)),
        mixer_norm_eps=config.rms_norm_eps if qwen else 1e-5,  # OLMo-Hybrid's o_norm has a fixed eps
        attention=AttentionConfig(
            layers=[i for i, kind in enumerate(config.layer_types) if kind == "full_attention"],
            num_heads=attn_heads, num_kv_heads=config.num_key_value_heads, head_dim=attn_head_dim, qkv_bias=bias,
            o_bias=bias, qk_norm=True, qk_norm_over="head" if qwen else "all", output_gate=qwen,
            norm_placement="pre" if qwen else "post", **_rope(config, model_type)),
        norm_zero_centered=qwen, norm_placement="pre",
        intermediate_size=_int_field(config, "intermediate_size"), hidden_ratio=None,
        moe=_moe_config(config, model_type),
        norm_eps=config.rms_norm_eps, tie_word_embeddings=bool(tie),
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        backend=backend, pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=eos,
    )


def _int_field(config, name: str) -> int | None:
    """An integer field of the config, None where the config class does not define it."""
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# Weights: each tensor of a transformers state dict or checkpoint converts on its own into pieces of linmem
# parameters ``(linmem name, index into it or None for all of it, value)``, so a folder streams one tensor at a time
# (``fla_import.WeightWriter``). A checkpoint may hold the names transformers converts on loading: per-expert MoE
# weights (``mlp.experts.{e}.{gate,up,down}_proj.weight``), OLMo-Hybrid's ``attention_layer_norm`` /
# ``feedforward_layer_norm`` and its separate ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``.
Piece = tuple[str, Any, torch.Tensor]

_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")  # vision and multi-token-prediction weights
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.([^.]+)\.(.+)")
_EXPERT_TENSOR = re.compile(r"experts\.(\d+)\.(gate|up|down)_proj\.weight")
_OLMO_CHECKPOINT_NORMS = {"attention_layer_norm": "input_layernorm",
                          "feedforward_layer_norm": "post_attention_layernorm"}
_GDN_NAMES_COMMON = {"A_log": "A_log", "dt_bias": "dt_bias"}
_GDN_NAMES_QWEN = {**_GDN_NAMES_COMMON, "norm.weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}
_GDN_NAMES = {  # HF linear_attn.<name> → linmem attn.<name>, for the tensors that convert alone
    "qwen3_next": _GDN_NAMES_QWEN,
    "qwen3_5": {**_GDN_NAMES_QWEN, "in_proj_z.weight": "g_proj.weight", "in_proj_b.weight": "b_proj.weight",
                "in_proj_a.weight": "a_proj.weight"},
    "olmo_hybrid": {**_GDN_NAMES_COMMON, **{f"{name}.weight": f"{name}.weight" for name in (
        "q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "o_norm")}},
}


def _gdn_family(hf_type: str) -> str:
    return hf_type if hf_type in ("qwen3_next", "olmo_hybrid") else "qwen3_5"  # Qwen3.5, dense and MoE


def _conv_pieces(name: str, w: torch.Tensor, key_dim: int, value_dim: int) -> list[Piece]:
    """Pieces of linmem's ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` from HF's depthwise conv over the ``[q | k | v]``
    channels (``conv1d.weight``) or from one of OLMo-Hybrid's checkpoint convs ``{q,k,v}_conv1d.weight``: each of its
    own width, or each a third of the channels, as transformers' ``save_pretrained`` splits ``conv1d``."""
    widths, total = (key_dim, key_dim, value_dim), 2 * key_dim + value_dim
    if name == "conv1d.weight":
        start, width = 0, total
    else:
        part = "qkv".index(name[0])
        start, width = (sum(widths[:part]), widths[part]) if w.shape[0] == widths[part] else \
            (part * total // 3, total // 3)
    if w.shape[0] != width:
        raise ValueError(f"linear_attn.{name} has {w.shape[0]} channels; expected {width} (q and k {key_dim}, v "
                         f"{value_dim})")
    pieces, low = [], 0
    for part, size in zip("qkv", widths):  # the part of each linmem conv that this tensor's channels cover
        first, stop = max(start, low), min(start + width, low + size)
        if first < stop:
            pieces.append((f"{part}_conv1d.weight", slice(first - low, stop - low), w[first - start:stop - start]))
        low += size
    return pieces


def _gdn_pieces(name: str, w: torch.Tensor, config: LinMemConfig, hf_type: str) -> list[Piece] | None:
    """A recurrent layer's tensor ``linear_attn.<name>`` as pieces of linmem ``attn.*`` (None: not a known name)."""
    h_v, h_k = config.num_heads, config.num_key_heads
    d_k, d_v = config.head_dim, round(config.head_dim * config.expand_v)
    key_dim, value_dim, group = h_k * d_k, h_v * d_v, h_v // h_k
    olmo_convs = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight") if hf_type == "olmo_hybrid" else ()
    if name == "conv1d.weight" or name in olmo_convs:
        return _conv_pieces(name, w, key_dim, value_dim)
    parts = {}
    if hf_type == "qwen3_next" and name == "in_proj_qkvz.weight":  # per key head: [q | k | v (group) | z (group)]
        split = torch.split(w.reshape(h_k, 2 * d_k + 2 * group * d_v, -1), [d_k, d_k, group * d_v, group * d_v], 1)
        parts = {f"{p}_proj.weight": part.reshape(-1, w.shape[-1]) for p, part in zip("qkvg", split)}
    elif hf_type == "qwen3_next" and name == "in_proj_ba.weight":  # per key head: [b (group) | a (group)]
        split = torch.split(w.reshape(h_k, 2 * group, -1), [group, group], 1)
        parts = {f"{p}_proj.weight": part.reshape(-1, w.shape[-1]) for p, part in zip("ba", split)}
    elif _gdn_family(hf_type) == "qwen3_5" and name == "in_proj_qkv.weight":
        parts = dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                         torch.split(w, [key_dim, key_dim, value_dim])))
    elif name in _GDN_NAMES[_gdn_family(hf_type)]:
        parts = {_GDN_NAMES[_gdn_family(hf_type)][name]: w}
    return [(target, None, value) for target, value in parts.items()] or None


def _attention_tensor(name: str, w: torch.Tensor, config: LinMemConfig, hf_type: str) -> dict[str, torch.Tensor]:
    """An attention layer's tensor ``self_attn.<name>`` as linmem ``attn.*`` tensors: Qwen's ``q_proj`` rows are per
    head ``[query (d) | gate (d)]``, split into ``q_proj`` and ``g_proj``; every other name is linmem's."""
    if hf_type not in QWEN_TYPES or name not in ("q_proj.weight", "q_proj.bias"):
        return {name: w}
    heads, head_dim, suffix = config.attention.num_heads, config.attention.head_dim, name.split(".")[1]
    pairs = w.reshape(heads, 2, head_dim, *w.shape[1:])
    return {f"q_proj.{suffix}": pairs[:, 0].reshape(heads * head_dim, *w.shape[1:]),
            f"g_proj.{suffix}": pairs[:, 1].reshape(heads * head_dim, *w.shape[1:])}


def _mlp_pieces(name: str, w: torch.Tensor, config: LinMemConfig) -> list[Piece]:
    """An MLP tensor ``mlp.<name>`` as pieces of linmem ``mlp.*``: names are linmem's, except one expert's
    weight, which is its slice of the stacked ``experts.gate_up_proj [E, 2I, D]`` (gate rows first) or
    ``experts.down_proj [E, D, I]``."""
    expert = _EXPERT_TENSOR.fullmatch(name)
    if expert is None:
        return [(name, None, w)]
    e, kind, size = int(expert[1]), expert[2], config.moe.intermediate_size
    if kind == "down":
        return [("experts.down_proj", e, w)]
    return [("experts.gate_up_proj", (e, slice(0, size) if kind == "gate" else slice(size, 2 * size)), w)]


def _norm_name(name: str, layer: int, config: LinMemConfig, hf_type: str) -> str | None:
    """linmem's name of a block's norm ``<name>.weight`` (None: not a norm of this block)."""
    if hf_type != "olmo_hybrid":
        return {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}.get(name)
    name = _OLMO_CHECKPOINT_NORMS.get(name, name)
    if layer in config.attention.layers:  # OLMo-Hybrid norms the outputs of attention and MLP
        return {"post_attention_layernorm": "attn_norm", "post_feedforward_layernorm": "mlp_norm"}.get(name)
    return {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}.get(name)


def _layer_pieces(layer: int, block: str, rest: str, w: torch.Tensor, config: LinMemConfig,
                  hf_type: str) -> list[Piece] | None:
    """A tensor ``model.layers.<layer>.<block>.<rest>`` as pieces of linmem parameters (None: not a known name)."""
    attention = layer in config.attention.layers
    if block == "mlp":
        pieces = _mlp_pieces(rest, w, config)
        return [(f"model.layers.{layer}.mlp.{name}", index, value) for name, index, value in pieces]
    if block in ("linear_attn", "self_attn"):
        if attention != (block == "self_attn"):
            return None
        if attention:
            pieces = [(name, None, value) for name, value in _attention_tensor(rest, w, config, hf_type).items()]
        else:
            pieces = _gdn_pieces(rest, w, config, hf_type)
        return None if pieces is None else [(f"model.layers.{layer}.attn.{n}", i, t) for n, i, t in pieces]
    norm = _norm_name(block, layer, config, hf_type)
    return None if norm is None or rest != "weight" else [(f"model.layers.{layer}.{norm}.weight", None, w)]


def hf_tensor_to_linmem(name: str, tensor: torch.Tensor, config: LinMemConfig, hf_type: str) -> list[Piece] | None:
    """Where one tensor of a transformers model of type ``hf_type`` (its state dict's or its checkpoint's name) goes
    in ``LinMemForCausalLM(config)``: pieces ``(linmem name, index or None, value)``; ``[]`` for a tensor linmem
    leaves out (vision, multi-token prediction, an ``lm_head`` tied to the embedding); None for a name it does not
    know. A composite Qwen3.5 keeps its text model under ``model.language_model.*``."""
    if name.startswith(_SKIPPED_PREFIXES):
        return []
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    if name == "lm_head.weight":
        return [] if config.tie_word_embeddings else [(name, None, tensor)]
    top = {"model.embed_tokens.weight": "model.embeddings.weight", "model.norm.weight": "model.norm.weight"}
    if name in top:
        return [(top[name], None, tensor)]
    match = _LAYER_TENSOR.fullmatch(name)
    return None if match is None else _layer_pieces(int(match[1]), match[2], match[3], tensor, config, hf_type)


def fill_from_hf(model: LinMemForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], hf_type: str,
                 what: str) -> None:
    """Write ``(name, tensor)`` of a transformers model of type ``hf_type`` into ``empty_model`` ``model``.

    Raises:
        ValueError: naming ``what`` and the missing, unknown or misshapen tensors.
    """
    writer = WeightWriter(model)
    with torch.no_grad():
        write_from_hf(writer, tensors, hf_type)
    writer.finish(what)


def write_from_hf(writer: WeightWriter, tensors: Iterable[tuple[str, torch.Tensor]], hf_type: str) -> None:
    """Write ``(name, tensor)`` of a transformers model of type ``hf_type`` through ``writer``, each tensor as the
    pieces ``hf_tensor_to_linmem`` makes of it (a name it does not know is recorded as unexpected)."""
    for name, tensor in tensors:
        pieces = hf_tensor_to_linmem(name, tensor, writer.model.config, hf_type)
        if pieces is None:
            writer.reject(name)
            continue
        for target, index, value in pieces:
            writer.write(name, target, value, index)


def _is_tied(hf_model: nn.Module) -> bool:
    head, embed = getattr(hf_model, "lm_head", None), hf_model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


def hf_to_linmem(hf_model: nn.Module, *, backend: str = "auto") -> LinMemForCausalLM:
    """A ``LinMemForCausalLM`` (eval mode, same device and dtype) computing what the transformers causal LM
    ``hf_model`` computes. Raises ``ValueError`` for a model type or setting linmem cannot reproduce."""
    config = hf_config_to_linmem(hf_model.config, backend=backend, tie_word_embeddings=_is_tied(hf_model))
    hf_type = text_config(hf_model.config).model_type
    like = hf_model.get_input_embeddings().weight
    model = empty_model(config, like.dtype, like.device)
    fill_from_hf(model, hf_model.state_dict().items(), hf_type, f"the {hf_type} model")
    return model


def _folder_dtype(dtype: torch.dtype | str | None, hf_config, files: list[Path]) -> torch.dtype:
    """The parameter dtype: ``dtype``, or for "auto" / None what transformers picks: the config's ``dtype``, else
    the dtype the embedding is stored in."""
    if dtype in (None, "auto"):
        dtype = getattr(hf_config, "dtype", None)
        if dtype is None:
            return stored_dtype(files, ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"))
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"dtype must be a torch.dtype, its name, 'auto' or None; got {dtype!r}")


def load_hf_folder(path: str | Path, *, dtype: torch.dtype | str | None = "auto",
                   device: torch.device | str | None = None, backend: str = "auto") -> LinMemForCausalLM:
    """Stream a transformers GDN hybrid's folder (``config.json`` and safetensors weights, one file or shards) into a
    ``LinMemForCausalLM`` built on ``device`` (None: the CPU), one tensor at a time: the transformers model is never
    built, host memory holds one checkpoint tensor beyond the model, and device memory the weights only."""
    from transformers import AutoConfig

    path = Path(path)
    hf_config = AutoConfig.from_pretrained(str(path))
    # the tie of the class that holds lm_head: a composite Qwen3.5's own field, not its text config's
    config = hf_config_to_linmem(hf_config, backend=backend,
                                 tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
    files = safetensors_files(path)
    hf_type = text_config(hf_config).model_type
    check_checkpoint_shapes(config, files, lambda writer, tensors: write_from_hf(writer, tensors, hf_type),
                            str(path / "config.json"))
    model = empty_model(config, _folder_dtype(dtype, hf_config, files), device or "cpu")
    fill_from_hf(model, stream_safetensors(files), hf_type, str(path))
    return model


def hf_model_type(path: str | Path) -> str | None:
    """The ``model_type`` in ``path/config.json`` (None without a readable one)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return None


def load_hf_hybrid(
    path_or_model: str | Path | nn.Module,
    *,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str | None = None,
    backend: str = "auto",
) -> LinMemForCausalLM:
    """Load a transformers GDN hybrid (a ``save_pretrained`` folder, a Hub id, or a model instance) as a
    ``LinMemForCausalLM`` in eval mode.

    Args:
        path_or_model: a folder with ``config.json`` and safetensors weights of model type ``qwen3_next``,
            ``qwen3_5``, ``qwen3_5_moe`` or ``olmo_hybrid``; a Hugging Face Hub id ``ORG/NAME[@REVISION]`` of such a
            model, fetched into the Hugging Face cache (``linmem.io.hub``; an existing folder of that name wins); or
            such a transformers model.
        dtype: parameter dtype (``"auto"`` / None: the checkpoint's or the model's).
        device: where the model lives (None: the CPU for a folder, the model's device for a model).
        backend: the linmem op backend.
    Raises:
        ValueError: an unsupported model type or setting (naming the model type and why), or weights that do not
            match the config.
    """
    if isinstance(path_or_model, nn.Module):
        model = hf_to_linmem(path_or_model, backend=backend)
    else:
        from linmem.io.models import local_or_hub_folder
        from linmem.models.loading import check_hub_config

        path = local_or_hub_folder(path_or_model, check_hub_config)
        model_type = hf_model_type(path)
        if model_type is None:
            raise ValueError(f"{path} has no readable config.json with a model_type")
        check_model_type(model_type)
        return load_hf_folder(path, dtype=dtype, device=device, backend=backend)
    if dtype not in (None, "auto"):
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model.to(device) if device is not None else model
