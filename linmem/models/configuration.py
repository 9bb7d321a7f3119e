"""``LinMemConfig``: one configuration for every linmem model (sGLA, GLA, GDN, RLA, RDN, and hybrids)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig
from transformers.utils import logging

from linmem.models.sub_configs import (
    NORM_PLACEMENTS,
    AttentionConfig,
    MoEConfig,
    build_settings,
    check_choice,
    check_number,
    check_positive_int,
)
from linmem.ops.backend import check_backend
from linmem.ops.config import RESIDUAL_TARGETS, check_gamma_mode, head_value_dim

logger = logging.get_logger(__name__)

MIXERS = ("sgla", "gla", "gdn", "rla", "rdn")
NUMBER_FIELDS = ("expand_v", "clip", "gate_logit_normalizer", "norm_eps", "initializer_range")
OPTIONAL_NUMBER_FIELDS = ("clamp_min", "hidden_ratio", "mixer_norm_eps")
FLAG_FIELDS = ("fit_history", "output_gates", "use_short_conv", "conv_bias", "tie_word_embeddings",
               "allow_neg_eigval", "norm_zero_centered")
SUB_CONFIGS = {"attention": AttentionConfig, "moe": MoEConfig}  # LinMemConfig fields that are tables of settings
# The flat names older config.json files, weights records and keyword arguments use for the settings that now live
# in a sub-config: flat name -> (sub-config, its field). ``nest_flat_fields`` is the one place that reads them.
FLAT_FIELDS: dict[str, tuple[str, str]] = {
    "attn_layers": ("attention", "layers"), "attn_num_heads": ("attention", "num_heads"),
    "attn_num_kv_heads": ("attention", "num_kv_heads"), "attn_head_dim": ("attention", "head_dim"),
    "attn_qkv_bias": ("attention", "qkv_bias"), "attn_qk_norm": ("attention", "qk_norm"),
    "attn_qk_norm_over": ("attention", "qk_norm_over"), "attn_output_gate": ("attention", "output_gate"),
    "attn_o_bias": ("attention", "o_bias"), "attn_window_size": ("attention", "window_size"),
    "rope_theta": ("attention", "rope_theta"), "partial_rotary_factor": ("attention", "partial_rotary_factor"),
    "attn_norm_placement": ("attention", "norm_placement"),
    "num_experts": ("moe", "num_experts"), "num_experts_per_tok": ("moe", "num_experts_per_tok"),
    "moe_intermediate_size": ("moe", "intermediate_size"),
    "shared_expert_intermediate_size": ("moe", "shared_expert_intermediate_size"),
    "norm_topk_prob": ("moe", "norm_topk_prob"), "moe_layers": ("moe", "layers"),
}


def nest_flat_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` (config arguments, a ``config.json`` or a weights record) with every name of ``FLAT_FIELDS`` moved
    into its sub-config's table; each sub-config present becomes a plain dict (an ``AttentionConfig`` given as it is
    is read field by field). A flat name and its sub-config's field both given with different values is a
    ``ValueError`` naming both."""
    nested = {name: value for name, value in fields.items() if name not in FLAT_FIELDS}
    for sub in SUB_CONFIGS:
        value = nested.get(sub)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            nested[sub] = dataclasses.asdict(value)
        elif isinstance(value, Mapping):
            nested[sub] = dict(value)
    for flat, (sub, name) in FLAT_FIELDS.items():
        if flat not in fields:
            continue
        if nested.get(sub) is None:
            nested[sub] = {}
        table = nested[sub]
        if not isinstance(table, dict):
            raise ValueError(f"{sub} must be a table of its fields; got {table!r}")
        if name in table and table[name] != fields[flat]:
            raise ValueError(f"{flat} = {fields[flat]!r} and {sub}.{name} = {table[name]!r} are both given; keep "
                             f"{sub}.{name} only")
        table[name] = fields[flat]
    return nested


def attention_layers(fields: Mapping[str, Any]) -> list[int]:
    """The softmax attention layers a config's fields name (a ``config.json`` as a dict, flat or nested)."""
    return list((nest_flat_fields(fields).get("attention") or {}).get("layers") or [])


class LinMemConfig(PretrainedConfig):
    """Configuration of ``LinMemModel`` / ``LinMemForCausalLM`` (``model_type = "linmem"``).

    Sizes: ``vocab_size``, ``hidden_size`` (D), ``num_hidden_layers``, ``num_heads`` (H) and ``head_dim`` (K, the key
    width per head) of the linear mixers, ``expand_v`` (value width per head ``V = K·expand_v``), the SwiGLU MLP
    (``intermediate_size``, or FLA's rule from ``hidden_ratio``).

    ``mixer``: ``"sgla"`` | ``"gla"`` | ``"gdn"`` | ``"rla"`` | ``"rdn"``. For ``"gla"`` the same H, K, V give FLA's
    ``expand_k = H·K / D`` and ``expand_v = H·V / D`` (FLA's GLA defaults 0.5 / 1.0 are ``K = D/(2H)``,
    ``expand_v = 2``); its gate uses ``gate_logit_normalizer``, ``gate_low_rank_dim`` and ``clamp_min``, and
    ``num_kv_heads`` (None: H; GLA only) shares k, v and the gate across groups of query heads (FLA's GQA option).

    Hybrids: ``attention`` (``AttentionConfig``, or a dict of its fields) holds the softmax attention layers:
    ``attention.layers`` lists their indices, with their heads, RoPE, norms, gates and biases. Mixture of experts:
    ``moe`` (``MoEConfig``, or a dict) with ``moe.num_experts`` > 0 replaces the MLP of ``moe.layers`` (None: every
    layer) by ``SparseMoE``. ``config.json`` saves both as tables. The flat names of older files and keyword
    arguments (``attn_layers``, ``attn_num_heads``, ``rope_theta``, ``num_experts``, ``moe_layers``, ...; the
    table ``FLAT_FIELDS``) are still read, into the same sub-configs: ``LinMemConfig(attn_layers=[1])`` is
    ``LinMemConfig(attention={"layers": [1]})``.

    Options of the Hugging Face GDN hybrids (``linmem.models.hf_import``; every default keeps the behaviour above):
    ``num_key_heads`` (None: H; the linear mixers other than GLA) gives q and k fewer heads than v, each key head
    serving ``num_heads / num_key_heads`` consecutive value heads (the H heads of the states are the value heads);
    ``allow_neg_eigval`` makes β = 2·sigmoid (in [0, 2]); ``mixer_norm_eps`` (None: ``norm_eps``) is the eps of the
    mixers' gated output norm. Norms: ``norm_zero_centered`` (every RMSNorm outside the mixers' gated output norm
    scales by ``1 + w``), ``norm_placement`` for the linear blocks (``attention.norm_placement`` for the attention
    blocks, None: the same): ``"pre"`` (``h + f(norm(h))``) or ``"post"`` (``h + norm(f(h))``).

    Memory switches (docs/math.md): ``residual_target`` (``"clip"`` | ``"tanh"`` | ``"identity"``), ``clip``,
    ``fit_history``, ``output_gates`` (RLA/RDN only) and ``gamma`` (``"independent"`` | ``"tied"``: γ = β).
    ``use_short_conv``, ``conv_size``, ``conv_bias``: the q/k/v short convolutions.

    ``backend`` (``linmem.ops.BACKENDS``) is a run-time choice, not part of the model: the backend a model built from
    this config starts on (``model.set_backend`` changes it). It is never written to ``config.json``, and one found
    in a ``config.json`` is not used: the model loads on ``"auto"``, or on the backend given to
    ``from_pretrained(..., backend=...)``, since the machine that saved a model says nothing about the one that runs
    it.

    Invalid values raise ``ValueError`` when the config is built.
    """

    model_type = "linmem"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_heads: int = 4,
        head_dim: int = 128,
        expand_v: float = 2.0,
        mixer: str = "rdn",
        num_kv_heads: int | None = None,
        attention: AttentionConfig | Mapping[str, Any] | None = None,
        moe: MoEConfig | Mapping[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        residual_target: str = "clip",
        clip: float = 1.0,
        fit_history: bool = True,
        output_gates: bool = True,
        gamma: str = "independent",
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        gate_logit_normalizer: float = 16,
        gate_low_rank_dim: int = 16,
        clamp_min: float | None = None,
        hidden_ratio: float | None = 4,
        intermediate_size: int | None = None,
        norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        backend: str = "auto",
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        num_key_heads: int | None = None,
        allow_neg_eigval: bool = False,
        mixer_norm_eps: float | None = None,
        norm_zero_centered: bool = False,
        norm_placement: str = "pre",
        **kwargs,
    ):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_heads, self.head_dim, self.expand_v, self.mixer = num_heads, head_dim, expand_v, mixer
        self.num_kv_heads = num_kv_heads
        self.max_position_embeddings = max_position_embeddings
        self.residual_target, self.clip, self.fit_history, self.output_gates = (residual_target, clip,
                                                                                fit_history, output_gates)
        self.gamma, self.backend = gamma, backend
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.gate_logit_normalizer, self.gate_low_rank_dim, self.clamp_min = (gate_logit_normalizer,
                                                                             gate_low_rank_dim, clamp_min)
        self.hidden_ratio, self.intermediate_size = hidden_ratio, intermediate_size
        self.norm_eps, self.initializer_range, self.use_cache = norm_eps, initializer_range, use_cache
        self.num_key_heads, self.allow_neg_eigval, self.mixer_norm_eps = num_key_heads, allow_neg_eigval, mixer_norm_eps
        self.norm_zero_centered, self.norm_placement = norm_zero_centered, norm_placement
        kwargs = nest_flat_fields({**kwargs, "attention": attention, "moe": moe})
        check_positive_int("num_heads", num_heads)  # the defaults of the attention layers' heads and placement
        check_choice("norm_placement", norm_placement, NORM_PLACEMENTS)
        self.attention = build_settings(AttentionConfig, kwargs.pop("attention"), "attention").resolved(
            num_heads, norm_placement)
        self.moe = build_settings(MoEConfig, kwargs.pop("moe"), "moe")
        check_backend(backend)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_architecture()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> LinMemConfig | tuple[LinMemConfig, dict[str, Any]]:
        """``PretrainedConfig.from_dict`` without the ``backend`` an older save recorded (a warning says so when it
        was not ``"auto"``); a ``backend`` in ``kwargs`` (``from_pretrained(path, backend="chunk")``) is checked like
        one given to ``__init__``. Sub-config settings in ``kwargs``, flat (``attn_window_size=3``) or as a table
        (``attention={"window_size": 3}``), replace those fields of the loaded sub-config."""
        saved = config_dict.get("backend", "auto")
        config_dict = {name: value for name, value in config_dict.items() if name != "backend"}
        if "backend" in kwargs:
            config_dict["backend"] = kwargs.pop("backend")
        elif saved != "auto":
            logger.warning(f"config.json's backend {saved!r} is not used: the backend is chosen when a model runs "
                           f"(--backend, from_pretrained(..., backend=...) or model.set_backend); running on 'auto'")
        overrides = {name: kwargs.pop(name) for name in list(kwargs) if name in FLAT_FIELDS or name in SUB_CONFIGS}
        if overrides:  # from_pretrained(path, attn_window_size=3) or (path, attention={...}): replace loaded fields
            config_dict = nest_flat_fields(config_dict)
            for name, value in nest_flat_fields(overrides).items():
                loaded = config_dict.get(name) or {}
                config_dict[name] = None if value is None else {**loaded, **value}
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The saved fields (``config.json``): every field but the run-time ``backend``, the sub-configs as
        tables."""
        fields = super().to_dict()
        fields.pop("backend", None)
        for name in SUB_CONFIGS:
            fields[name] = dataclasses.asdict(getattr(self, name))
        return fields

    def validate_architecture(self) -> None:
        """Raise ``ValueError`` naming the field for any value the model cannot be built with (run at the end of
        ``__init__``, so also when a config is loaded)."""
        self._validate_values()
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "conv_size",
                     "gate_low_rank_dim"):
            check_positive_int(name, getattr(self, name))
        check_choice("mixer", self.mixer, MIXERS)
        check_gamma_mode(self.gamma)
        check_choice("residual_target", self.residual_target, RESIDUAL_TARGETS)
        head_value_dim(self.head_dim, self.expand_v)
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0; got {self.clip}")
        if self.num_kv_heads is not None:
            check_positive_int("num_kv_heads", self.num_kv_heads)
            if self.mixer != "gla" or self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_kv_heads (grouped k/v heads) needs mixer='gla' and num_heads ({self.num_heads}) "
                                 f"divisible by it; got mixer={self.mixer!r}, num_kv_heads={self.num_kv_heads}")
        if self.num_key_heads is not None:
            check_positive_int("num_key_heads", self.num_key_heads)
            if self.mixer == "gla" or self.num_heads % self.num_key_heads:
                raise ValueError(f"num_key_heads (grouped key heads) needs a mixer other than 'gla' and num_heads "
                                 f"({self.num_heads}) divisible by it; got mixer={self.mixer!r}, "
                                 f"num_key_heads={self.num_key_heads}")
        if self.allow_neg_eigval and self.mixer == "gla":
            raise ValueError("allow_neg_eigval scales the write strength β, which mixer='gla' does not have")
        check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        for name, kind in SUB_CONFIGS.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}; got {getattr(self, name)!r}")
        self.attention.check_fits(self.hidden_size, self.num_hidden_layers)
        self.moe.check_fits(self.num_hidden_layers)

    def _validate_values(self) -> None:
        """Numbers are finite numbers and switches are true or false, in every field (a ``config.json`` edited by
        hand may hold ``"abc"``, ``NaN`` or ``Infinity``, which would otherwise fail mid-forward or silently)."""
        for name in NUMBER_FIELDS:
            check_number(name, getattr(self, name))
        for name in OPTIONAL_NUMBER_FIELDS:
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name))
        for name in FLAG_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        for name, value in vars(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number; got {value!r}")
        if self.intermediate_size is not None:
            check_positive_int("intermediate_size", self.intermediate_size)

