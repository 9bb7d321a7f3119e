"""``LinMemConfig``: one configuration for every linmem model (sGLA, GLA, GDN, RLA, RDN, and hybrids)."""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig
from transformers.utils import logging

from linmem.ops.backend import check_backend
from linmem.ops.config import RESIDUAL_TARGETS, check_gamma_mode, head_value_dim

logger = logging.get_logger(__name__)

MIXERS = ("sgla", "gla", "gdn", "rla", "rdn")
NORM_PLACEMENTS = ("pre", "post")
QK_NORM_SCOPES = ("head", "all")
NUMBER_FIELDS = ("expand_v", "clip", "gate_logit_normalizer", "norm_eps", "initializer_range", "partial_rotary_factor")
OPTIONAL_NUMBER_FIELDS = ("rope_theta", "clamp_min", "hidden_ratio", "mixer_norm_eps")
FLAG_FIELDS = ("fit_history", "output_gates", "use_short_conv", "conv_bias", "attn_qkv_bias", "attn_qk_norm",
               "tie_word_embeddings", "allow_neg_eigval", "attn_output_gate", "attn_o_bias", "norm_zero_centered",
               "norm_topk_prob")


class LinMemConfig(PretrainedConfig):
    """Configuration of ``LinMemModel`` / ``LinMemForCausalLM`` (``model_type = "linmem"``).

    Sizes: ``vocab_size``, ``hidden_size`` (D), ``num_hidden_layers``, ``num_heads`` (H) and ``head_dim`` (K, the key
    width per head) of the linear mixers, ``expand_v`` (value width per head ``V = K·expand_v``), the SwiGLU MLP
    (``intermediate_size``, or FLA's rule from ``hidden_ratio``).

    ``mixer``: ``"sgla"`` | ``"gla"`` | ``"gdn"`` | ``"rla"`` | ``"rdn"``. For ``"gla"`` the same H, K, V give FLA's
    ``expand_k = H·K / D`` and ``expand_v = H·V / D`` (FLA's GLA defaults 0.5 / 1.0 are ``K = D/(2H)``,
    ``expand_v = 2``); its gate uses ``gate_logit_normalizer``, ``gate_low_rank_dim`` and ``clamp_min``, and
    ``num_kv_heads`` (None: H; GLA only) shares k, v and the gate across groups of query heads (FLA's GQA option).

    Hybrids: ``attn_layers`` lists the layer indices that are softmax attention, with ``attn_num_heads`` (None: H;
    head_dim = D / attn_num_heads), ``attn_num_kv_heads`` (None: attn_num_heads), ``attn_qkv_bias`` (biases on the
    q/k/v projections), ``attn_qk_norm``, ``attn_window_size`` and ``rope_theta``.

    Options of the Hugging Face GDN hybrids (``linmem.models.hf_import``; every default keeps the behaviour above):
    ``num_key_heads`` (None: H; the linear mixers other than GLA) gives q and k fewer heads than v, each key head
    serving ``num_heads / num_key_heads`` consecutive value heads (the H heads of the states are the value heads);
    ``allow_neg_eigval`` makes β = 2·sigmoid (in [0, 2]); ``mixer_norm_eps`` (None: ``norm_eps``) is the eps of the
    mixers' gated output norm. Attention: ``attn_head_dim`` (None: D / attn_num_heads), ``partial_rotary_factor``
    (RoPE on the first ``attn_head_dim · factor`` channels of each head), ``rope_theta=None`` (no RoPE),
    ``attn_output_gate`` (``o_proj(attn · sigmoid(g_proj x))``), ``attn_qk_norm_over`` (``"head"``: a norm per head,
    ``"all"``: one over all heads' channels), ``attn_o_bias``. Norms: ``norm_zero_centered`` (every RMSNorm outside
    the mixers' gated output norm scales by ``1 + w``), ``norm_placement`` / ``attn_norm_placement`` (None: the same)
    for the linear and the attention blocks: ``"pre"`` (``h + f(norm(h))``) or ``"post"`` (``h + norm(f(h))``, OLMo's
    attention blocks). Mixture of experts: ``num_experts`` > 0 replaces the MLP of ``moe_layers`` (None: every layer)
    by ``SparseMoE`` with ``num_experts_per_tok`` routed experts of width ``moe_intermediate_size``,
    ``norm_topk_prob`` and a gated shared expert of width ``shared_expert_intermediate_size`` (None: none).

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
        attn_layers: list[int] | tuple[int, ...] = (),
        attn_num_heads: int | None = None,
        attn_num_kv_heads: int | None = None,
        attn_qkv_bias: bool = False,
        attn_qk_norm: bool = False,
        attn_window_size: int | None = None,
        rope_theta: float = 10000.0,
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
        attn_head_dim: int | None = None,
        partial_rotary_factor: float = 1.0,
        attn_output_gate: bool = False,
        attn_qk_norm_over: str = "head",
        attn_o_bias: bool = False,
        norm_zero_centered: bool = False,
        norm_placement: str = "pre",
        attn_norm_placement: str | None = None,
        num_experts: int = 0,
        num_experts_per_tok: int = 1,
        moe_intermediate_size: int | None = None,
        shared_expert_intermediate_size: int | None = None,
        norm_topk_prob: bool = True,
        moe_layers: list[int] | tuple[int, ...] | None = None,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_heads, self.head_dim, self.expand_v, self.mixer = num_heads, head_dim, expand_v, mixer
        self.num_kv_heads = num_kv_heads
        self.attn_layers = list(attn_layers)
        self.attn_num_heads = num_heads if attn_num_heads is None else attn_num_heads
        self.attn_num_kv_heads = self.attn_num_heads if attn_num_kv_heads is None else attn_num_kv_heads
        self.attn_qkv_bias = attn_qkv_bias
        self.attn_qk_norm, self.attn_window_size, self.rope_theta = attn_qk_norm, attn_window_size, rope_theta
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
        self.attn_head_dim, self.partial_rotary_factor = attn_head_dim, partial_rotary_factor
        self.attn_output_gate, self.attn_qk_norm_over, self.attn_o_bias = (attn_output_gate, attn_qk_norm_over,
                                                                           attn_o_bias)
        self.norm_zero_centered, self.norm_placement = norm_zero_centered, norm_placement
        self.attn_norm_placement = norm_placement if attn_norm_placement is None else attn_norm_placement
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.moe_intermediate_size, self.shared_expert_intermediate_size = (moe_intermediate_size,
                                                                            shared_expert_intermediate_size)
        self.norm_topk_prob = norm_topk_prob
        self.moe_layers = None if moe_layers is None else list(moe_layers)
        check_backend(backend)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_architecture()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> LinMemConfig | tuple[LinMemConfig, dict[str, Any]]:
        """``PretrainedConfig.from_dict`` without the ``backend`` an older save recorded (a warning says so when it
        was not ``"auto"``); a ``backend`` in ``kwargs`` (``from_pretrained(path, backend="chunk")``) is checked like
        one given to ``__init__``."""
        saved = config_dict.get("backend", "auto")
        config_dict = {name: value for name, value in config_dict.items() if name != "backend"}
        if "backend" in kwargs:
            config_dict["backend"] = kwargs.pop("backend")
        elif saved != "auto":
            logger.warning(f"config.json's backend {saved!r} is not used: the backend is chosen when a model runs "
                           f"(--backend, from_pretrained(..., backend=...) or model.set_backend); running on 'auto'")
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The saved fields (``config.json``): every field but the run-time ``backend``."""
        fields = super().to_dict()
        fields.pop("backend", None)
        return fields

    def validate_architecture(self) -> None:
        """Raise ``ValueError`` naming the field for any value the model cannot be built with (run at the end of
        ``__init__``, so also when a config is loaded)."""
        self._validate_values()
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "conv_size",
                     "attn_num_heads", "attn_num_kv_heads", "gate_low_rank_dim"):
            _check_positive_int(name, getattr(self, name))
        _check_choice("mixer", self.mixer, MIXERS)
        check_gamma_mode(self.gamma)
        _check_choice("residual_target", self.residual_target, RESIDUAL_TARGETS)
        head_value_dim(self.head_dim, self.expand_v)
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0; got {self.clip}")
        if self.num_kv_heads is not None:
            _check_positive_int("num_kv_heads", self.num_kv_heads)
            if self.mixer != "gla" or self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_kv_heads (grouped k/v heads) needs mixer='gla' and num_heads ({self.num_heads}) "
                                 f"divisible by it; got mixer={self.mixer!r}, num_kv_heads={self.num_kv_heads}")
        if self.num_key_heads is not None:
            _check_positive_int("num_key_heads", self.num_key_heads)
            if self.mixer == "gla" or self.num_heads % self.num_key_heads:
                raise ValueError(f"num_key_heads (grouped key heads) needs a mixer other than 'gla' and num_heads "
                                 f"({self.num_heads}) divisible by it; got mixer={self.mixer!r}, "
                                 f"num_key_heads={self.num_key_heads}")
        if self.allow_neg_eigval and self.mixer == "gla":
            raise ValueError("allow_neg_eigval scales the write strength β, which mixer='gla' does not have")
        _check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _check_choice("attn_norm_placement", self.attn_norm_placement, NORM_PLACEMENTS)
        self._validate_attention()
        self._validate_experts()

    def _validate_values(self) -> None:
        """Numbers are finite numbers and switches are true or false, in every field (a ``config.json`` edited by
        hand may hold ``"abc"``, ``NaN`` or ``Infinity``, which would otherwise fail mid-forward or silently)."""
        for name in NUMBER_FIELDS:
            _check_number(name, getattr(self, name))
        for name in OPTIONAL_NUMBER_FIELDS:
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name))
        for name in FLAG_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        for name, value in vars(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number; got {value!r}")
        if self.intermediate_size is not None:
            _check_positive_int("intermediate_size", self.intermediate_size)

    def _validate_experts(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"num_experts must be a non-negative integer; got {self.num_experts!r}")
        if not self.num_experts:
            return
        _check_positive_int("moe_intermediate_size", self.moe_intermediate_size)
        _check_positive_int("num_experts_per_tok", self.num_experts_per_tok)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok must be <= num_experts ({self.num_experts}); got "
                             f"{self.num_experts_per_tok}")
        if self.shared_expert_intermediate_size is not None:
            _check_positive_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        layers = self.moe_layers
        if layers is not None and (any(not isinstance(i, int) or not 0 <= i < self.num_hidden_layers for i in layers)
                                   or len(set(layers)) != len(layers)):
            raise ValueError(f"moe_layers must be distinct layer indices in [0, {self.num_hidden_layers}); got "
                             f"{layers}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is the routed ``SparseMoE``."""
        return self.num_experts > 0 and (self.moe_layers is None or layer_idx in self.moe_layers)

    def _validate_attention(self) -> None:
        layers = self.attn_layers
        if any(not isinstance(i, int) or isinstance(i, bool) for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"attn_layers must be distinct integer layer indices; got {layers}")
        if layers and not 0 <= min(layers) <= max(layers) < self.num_hidden_layers:
            raise ValueError(f"attn_layers must lie in [0, num_hidden_layers = {self.num_hidden_layers}); got {layers}")
        if self.attn_head_dim is not None:
            _check_positive_int("attn_head_dim", self.attn_head_dim)
        _check_choice("attn_qk_norm_over", self.attn_qk_norm_over, QK_NORM_SCOPES)
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1]; got {self.partial_rotary_factor}")
        if self.attn_head_dim is None:
            if layers and (self.hidden_size % self.attn_num_heads or (self.hidden_size // self.attn_num_heads) % 2
                           or self.attn_num_heads % self.attn_num_kv_heads):
                raise ValueError(f"attention layers need hidden_size ({self.hidden_size}) = attn_num_heads "
                                 f"({self.attn_num_heads}) x an even head dim, and attn_num_heads divisible by "
                                 f"attn_num_kv_heads ({self.attn_num_kv_heads})")
        elif layers and self.attn_num_heads % self.attn_num_kv_heads:
            raise ValueError(f"attn_num_heads ({self.attn_num_heads}) must be divisible by attn_num_kv_heads "
                             f"({self.attn_num_kv_heads})")
        head_dim = self.attn_head_dim or self.hidden_size // self.attn_num_heads
        if layers and self.rope_theta is not None and int(head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"the rotary width attn_head_dim x partial_rotary_factor = {head_dim} x "
                             f"{self.partial_rotary_factor} must be even")
        if self.attn_window_size is not None:
            _check_positive_int("attn_window_size", self.attn_window_size)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")
