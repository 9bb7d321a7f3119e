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
- **attention layers** → ``Attention`` with ``attn_head_dim`` = HF ``head_dim``, ``partial_rotary_factor``, q/k
  RMSNorm (per head for Qwen, over all heads for OLMo), and for Qwen the sigmoid output gate: HF's ``q_proj`` holds
  ``[query | gate]`` per head, split here into ``q_proj`` and ``g_proj``.
- **norms**: Qwen's RMSNorms scale by ``1 + w`` (``norm_zero_centered``); OLMo-Hybrid's attention blocks norm the
  outputs of attention and MLP (``attn_norm_placement="post"``: its ``post_attention_layernorm`` →
  ``attn_norm``, ``post_feedforward_layernorm`` → ``mlp_norm``).
- **MLPs**: SwiGLU, or ``SparseMoE`` (router ``gate``, stacked ``experts``, gated ``shared_expert``) for the MoE
  layers of ``qwen3_next`` (``decoder_sparse_step``, ``mlp_only_layers``) and every layer of ``qwen3_5_moe``.

Anything linmem cannot reproduce exactly raises a ``ValueError`` naming the model type and the reason (another
activation, a RoPE scaling type, ``kimi_linear``'s per-channel decay with the delta rule, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from linmem.models.configuration import LinMemConfig
from linmem.models.modeling import LinMemForCausalLM

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
    """``rope_theta`` (None: no RoPE) and ``partial_rotary_factor`` of the attention layers."""
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


def _moe_fields(config, model_type: str) -> dict[str, Any]:
    if model_type in ("qwen3_5", "qwen3_5_text", "olmo_hybrid") or not getattr(config, "num_experts", 0):
        return {}
    layers = list(range(config.num_hidden_layers))
    norm_topk = True  # Qwen3.5-MoE's router always renormalises the kept probabilities
    if model_type == "qwen3_next":
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
        layers = [i for i in layers if i not in dense and (i + 1) % step == 0]
        norm_topk = bool(config.norm_topk_prob)
    return dict(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                shared_expert_intermediate_size=config.shared_expert_intermediate_size or None,
                norm_topk_prob=norm_topk, moe_layers=layers)


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
        attn_layers=[i for i, kind in enumerate(config.layer_types) if kind == "full_attention"],
        attn_num_heads=attn_heads, attn_num_kv_heads=config.num_key_value_heads, attn_head_dim=attn_head_dim,
        attn_qkv_bias=bias, attn_o_bias=bias, attn_qk_norm=True, attn_qk_norm_over="head" if qwen else "all",
        attn_output_gate=qwen, **_rope(config, model_type),
        norm_zero_centered=qwen, norm_placement="pre", attn_norm_placement="pre" if qwen else "post",
        intermediate_size=_int_field(config, "intermediate_size"), hidden_ratio=None,
        **_moe_fields(config, model_type),
        norm_eps=config.rms_norm_eps, tie_word_embeddings=bool(tie),
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        backend=backend, pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=eos,
    )


def _int_field(config, name: str) -> int | None:
    """An integer field of the config, None where the config class does not define it."""
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _split_rows(weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [w.contiguous() for w in torch.split(weight, sizes, dim=0)]


def _gdn_weights(get, config: LinMemConfig, hf_type: str) -> dict[str, torch.Tensor]:
    """One recurrent layer's linmem parameters from ``get(name)`` (the HF layer's ``linear_attn.<name>``)."""
    h_v, h_k = config.num_heads, config.num_key_heads
    d_k, d_v = config.head_dim, round(config.head_dim * config.expand_v)
    key_dim, value_dim, group = h_k * d_k, h_v * d_v, h_v // h_k
    out = {}
    if hf_type == "qwen3_next":  # per key head: [q (d_k) | k (d_k) | v (group·d_v) | z (group·d_v)] and [b | a]
        qkvz = get("in_proj_qkvz.weight").reshape(h_k, 2 * d_k + 2 * group * d_v, -1)
        q, k, v, z = torch.split(qkvz, [d_k, d_k, group * d_v, group * d_v], dim=1)
        ba = get("in_proj_ba.weight").reshape(h_k, 2 * group, -1)
        b, a = torch.split(ba, [group, group], dim=1)
        out.update({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "g_proj.weight": z,
                    "b_proj.weight": b, "a_proj.weight": a})
        out = {name: w.reshape(-1, w.shape[-1]).contiguous() for name, w in out.items()}
        out["o_norm.weight"], out["o_proj.weight"] = get("norm.weight"), get("out_proj.weight")
    elif hf_type == "olmo_hybrid":
        for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "o_norm"):
            out[f"{name}.weight"] = get(f"{name}.weight")
    else:  # Qwen3.5 (dense and MoE)
        q, k, v = _split_rows(get("in_proj_qkv.weight"), [key_dim, key_dim, value_dim])
        out.update({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
                    "g_proj.weight": get("in_proj_z.weight"), "b_proj.weight": get("in_proj_b.weight"),
                    "a_proj.weight": get("in_proj_a.weight"),
                    "o_norm.weight": get("norm.weight"), "o_proj.weight": get("out_proj.weight")})
    conv = get("conv1d.weight")
    if conv.shape[0] != 2 * key_dim + value_dim:
        raise ValueError(f"conv1d.weight has {conv.shape[0]} channels; expected 2 * {key_dim} + {value_dim}")
    for name, w in zip("qkv", _split_rows(conv, [key_dim, key_dim, value_dim])):
        out[f"{name}_conv1d.weight"] = w
    out["A_log"], out["dt_bias"] = get("A_log"), get("dt_bias")
    return out


def _attention_weights(get, config: LinMemConfig, hf_type: str) -> dict[str, torch.Tensor]:
    """One attention layer's linmem parameters from ``get(name)`` (the HF layer's ``self_attn.<name>``)."""
    out = {}
    names = ["k_proj", "v_proj", "o_proj"] + ([] if hf_type in QWEN_TYPES else ["q_proj"])
    for name in names:
        out[f"{name}.weight"] = get(f"{name}.weight")
        if (config.attn_o_bias if name == "o_proj" else config.attn_qkv_bias):
            out[f"{name}.bias"] = get(f"{name}.bias")
    if hf_type in QWEN_TYPES:  # q_proj rows: per head [query (d) | gate (d)]
        heads, head_dim = config.attn_num_heads, config.attn_head_dim
        for suffix in ("weight", "bias") if config.attn_qkv_bias else ("weight",):
            w = get(f"q_proj.{suffix}")
            w = w.reshape(heads, 2, head_dim, *w.shape[1:])
            out[f"q_proj.{suffix}"] = w[:, 0].reshape(heads * head_dim, *w.shape[3:]).contiguous()
            out[f"g_proj.{suffix}"] = w[:, 1].reshape(heads * head_dim, *w.shape[3:]).contiguous()
    out["q_norm.weight"], out["k_norm.weight"] = get("q_norm.weight"), get("k_norm.weight")
    return out


def _mlp_weights(get, config: LinMemConfig, layer: int) -> dict[str, torch.Tensor]:
    if not config.is_moe_layer(layer):
        return {f"{name}.weight": get(f"{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")}
    out = {"gate.weight": get("gate.weight"), "experts.gate_up_proj": get("experts.gate_up_proj"),
           "experts.down_proj": get("experts.down_proj")}
    if config.shared_expert_intermediate_size:
        out["shared_expert_gate.weight"] = get("shared_expert_gate.weight")
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_expert.{name}.weight"] = get(f"shared_expert.{name}.weight")
    return out


def _text_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors under ``model.*`` / ``lm_head.*`` (a composite Qwen3.5 keeps them under
    ``model.language_model.*``; vision and multi-token-prediction weights are left out)."""
    out = {}
    for name, tensor in state_dict.items():
        if name.startswith("model.language_model."):
            out["model." + name.removeprefix("model.language_model.")] = tensor
        elif name.startswith(("model.visual.", "mtp.", "model.mtp.")):
            continue
        else:
            out[name] = tensor
    return out


def hf_state_dict_to_linmem(state_dict: Mapping[str, torch.Tensor], config: LinMemConfig,
                            hf_type: str) -> dict[str, torch.Tensor]:
    """The parameters of ``LinMemForCausalLM(config)`` from the state dict of a transformers model of type
    ``hf_type`` (the text config's model type). Raises ``ValueError`` naming a missing tensor."""
    weights = _text_state_dict(state_dict)

    def getter(prefix: str):
        def get(name: str) -> torch.Tensor:
            key = f"{prefix}{name}"
            if key not in weights:
                raise ValueError(f"the {hf_type} state dict has no {key!r}")
            return weights[key]
        return get

    out = {"model.embeddings.weight": getter("model.")("embed_tokens.weight"),
           "model.norm.weight": getter("model.")("norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = getter("")("lm_head.weight")
    post = hf_type == "olmo_hybrid"
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"model.layers.{i}."
        get = getter(hf)
        if i in config.attn_layers:
            mixer = _attention_weights(getter(hf + "self_attn."), config, hf_type)
            norms = ("post_attention_layernorm", "post_feedforward_layernorm") if post else \
                ("input_layernorm", "post_attention_layernorm")
        else:
            mixer = _gdn_weights(getter(hf + "linear_attn."), config, hf_type)
            norms = ("input_layernorm", "post_attention_layernorm")
        out.update({f"{ours}attn.{name}": w for name, w in mixer.items()})
        out.update({f"{ours}mlp.{name}": w for name, w in _mlp_weights(getter(hf + "mlp."), config, i).items()})
        out[f"{ours}attn_norm.weight"], out[f"{ours}mlp_norm.weight"] = get(f"{norms[0]}.weight"), \
            get(f"{norms[1]}.weight")
    return out


def _is_tied(hf_model: nn.Module) -> bool:
    head, embed = getattr(hf_model, "lm_head", None), hf_model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


def hf_to_linmem(hf_model: nn.Module, *, backend: str = "auto") -> LinMemForCausalLM:
    """A ``LinMemForCausalLM`` (eval mode, same device and dtype) computing what the transformers causal LM
    ``hf_model`` computes. Raises ``ValueError`` for a model type or setting linmem cannot reproduce."""
    config = hf_config_to_linmem(hf_model.config, backend=backend, tie_word_embeddings=_is_tied(hf_model))
    hf_type = text_config(hf_model.config).model_type
    weights = hf_state_dict_to_linmem(hf_model.state_dict(), config, hf_type)
    like = weights["model.embeddings.weight"]
    with _no_init_weights(), torch.device(like.device):
        model = LinMemForCausalLM(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    wrong = sorted(n for n in set(expected) & set(weights) if weights[n].shape != expected[n])
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected or wrong:
        raise ValueError(f"the converted {hf_type} weights do not match linmem's model: missing {missing}, "
                         f"unexpected {unexpected}, wrong shapes {wrong}")
    model.load_state_dict(weights, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(like.dtype).eval()


def _no_init_weights():
    from contextlib import nullcontext

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return nullcontext()
    return no_init_weights()


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
    """Load a transformers GDN hybrid (a ``save_pretrained`` folder, a Hub snapshot, or a model instance) as a
    ``LinMemForCausalLM`` in eval mode.

    Args:
        path_or_model: a folder with ``config.json`` and safetensors weights of model type ``qwen3_next``,
            ``qwen3_5``, ``qwen3_5_moe`` or ``olmo_hybrid``, or such a transformers model.
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
        path = Path(path_or_model)
        model_type = hf_model_type(path)
        if model_type is None:
            raise ValueError(f"{path} has no readable config.json with a model_type")
        check_model_type(model_type)
        from transformers import AutoModelForCausalLM

        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        hf_model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype or "auto",
                                                              use_safetensors=True, output_loading_info=True)
        problems = {kind: info.get(kind) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        problems = {kind: sorted(map(str, keys)) for kind, keys in problems.items() if keys}
        if problems:  # transformers would fill missing weights randomly: refuse instead
            raise ValueError(f"{path}: the weights do not fit its config.json ({problems}); the model would be "
                             f"partly random, so it is not loaded")
        model = hf_to_linmem(hf_model, backend=backend)
        del hf_model
    if dtype not in (None, "auto"):
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model.to(device) if device is not None else model
