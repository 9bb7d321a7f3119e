"""The two groups of ``LinMemConfig`` settings that only some layers use: ``AttentionConfig`` (the softmax attention
layers of a hybrid) and ``MoEConfig`` (the routed experts that replace some layers' MLP).

Each is a small dataclass that checks its own values when built; what depends on the rest of the model (layer
indices against the number of layers, head widths against ``hidden_size``) is checked by ``check_fits``, which
``LinMemConfig`` runs. ``layer_arguments()`` gives the keyword arguments of the module the settings build
(``linmem.layers.attention.Attention``, ``linmem.layers.moe.SparseMoE``), whose argument names the fields share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

NORM_PLACEMENTS = ("pre", "post")
QK_NORM_SCOPES = ("head", "all")

Settings = TypeVar("Settings", "AttentionConfig", "MoEConfig")


@dataclass
class AttentionConfig:
    """The softmax attention layers of a hybrid (``config.json``: the ``attention`` table).

    ``layers``: the indices of the layers whose mixer is attention (empty: none). ``num_heads`` (None: the linear
    mixers' ``num_heads``), ``num_kv_heads`` (None: ``num_heads``; fewer is grouped-query attention), ``head_dim``
    (None: ``hidden_size / num_heads``). ``qkv_bias``: biases on the q/k/v projections (and the output gate's);
    ``o_bias``: on ``o_proj``. ``qk_norm``: RMSNorm of q and k, per head (``qk_norm_over="head"``) or over all heads'
    channels (``"all"``, OLMo's). ``output_gate``: ``o_proj(attn · sigmoid(g_proj x))`` (Qwen's). ``window_size``:
    a sliding window of that many tokens (None: full causal). ``rope_theta``: the RoPE base (None: no rotary
    embedding), rotating the first ``head_dim · partial_rotary_factor`` channels of each head. ``norm_placement``
    (None: the model's ``norm_placement``): ``"pre"`` (``h + f(norm(h))``) or ``"post"`` (``h + norm(f(h))``, OLMo's
    attention blocks) for the blocks of these layers.

    ``LinMemConfig`` fills the None of ``num_heads``, ``num_kv_heads`` and ``norm_placement`` (``resolved``), so a
    saved config names the values it was built with.
    """

    layers: list[int] = field(default_factory=list)
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_over: str = "head"
    output_gate: bool = False
    o_bias: bool = False
    window_size: int | None = None
    rope_theta: float | None = 10000.0
    partial_rotary_factor: float = 1.0
    norm_placement: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (list, tuple)):
            raise ValueError(f"attention.layers must be a list of layer indices; got {self.layers!r}")
        self.layers = list(self.layers)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in self.layers) or \
                len(set(self.layers)) != len(self.layers):
            raise ValueError(f"attention.layers must be distinct integer layer indices; got {self.layers}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "window_size"):
            if getattr(self, name) is not None:
                check_positive_int(f"attention.{name}", getattr(self, name))
        for name in ("qkv_bias", "qk_norm", "output_gate", "o_bias"):
            check_flag(f"attention.{name}", getattr(self, name))
        check_choice("attention.qk_norm_over", self.qk_norm_over, QK_NORM_SCOPES)
        if self.norm_placement is not None:
            check_choice("attention.norm_placement", self.norm_placement, NORM_PLACEMENTS)
        if self.rope_theta is not None:
            check_number("attention.rope_theta", self.rope_theta)
        check_number("attention.partial_rotary_factor", self.partial_rotary_factor)
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"attention.partial_rotary_factor must be in (0, 1]; got {self.partial_rotary_factor}")

    def resolved(self, num_heads: int, norm_placement: str) -> AttentionConfig:
        """These settings with the None of ``num_heads`` (→ ``num_heads``), ``num_kv_heads`` (→ the heads) and
        ``norm_placement`` (→ ``norm_placement``) filled in."""
        heads = num_heads if self.num_heads is None else self.num_heads
        return dataclasses.replace(
            self, num_heads=heads, num_kv_heads=heads if self.num_kv_heads is None else self.num_kv_heads,
            norm_placement=norm_placement if self.norm_placement is None else self.norm_placement)

    def check_fits(self, hidden_size: int, num_hidden_layers: int) -> None:
        """Raise ``ValueError`` unless the layers exist and the heads fit a model of width ``hidden_size`` (run on
        resolved settings)."""
        layers = self.layers
        if layers and not 0 <= min(layers) <= max(layers) < num_hidden_layers:
            raise ValueError(f"attention.layers must lie in [0, num_hidden_layers = {num_hidden_layers}); got "
                             f"{layers}")
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.head_dim is None:
            if layers and (hidden_size % heads or (hidden_size // heads) % 2 or heads % kv_heads):
                raise ValueError(f"attention layers need hidden_size ({hidden_size}) = attention.num_heads ({heads}) "
                                 f"x an even head dim, and attention.num_heads divisible by attention.num_kv_heads "
                                 f"({kv_heads})")
        elif layers and heads % kv_heads:
            raise ValueError(f"attention.num_heads ({heads}) must be divisible by attention.num_kv_heads "
                             f"({kv_heads})")
        head_dim = self.head_dim or hidden_size // heads
        if layers and self.rope_theta is not None and int(head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"the rotary width attention.head_dim x attention.partial_rotary_factor = {head_dim} x "
                             f"{self.partial_rotary_factor} must be even")

    def layer_arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``Attention`` these settings give (all but ``layers`` and
        ``norm_placement``, which place the layers in the model)."""
        return {name: value for name, value in dataclasses.asdict(self).items()
                if name not in ("layers", "norm_placement")}


@dataclass
class MoEConfig:
    """Routed experts in place of some layers' MLP (``config.json``: the ``moe`` table; Qwen3-Next's and
    Qwen3.5-MoE's ``SparseMoE``).

    ``num_experts`` > 0 turns them on (0: every layer has the SwiGLU MLP) for ``layers`` (None: every layer): each
    token goes to ``num_experts_per_tok`` of them, each a SwiGLU of width ``intermediate_size``, weighted by the
    router's probabilities (renormalised over the chosen ones with ``norm_topk_prob``), plus a gated shared expert
    of width ``shared_expert_intermediate_size`` (None: none). Without experts the other fields are not checked.
    """

    num_experts: int = 0
    num_experts_per_tok: int = 1
    intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    layers: list[int] | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and isinstance(self.layers, (list, tuple)):
            self.layers = list(self.layers)
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"moe.num_experts must be a non-negative integer; got {self.num_experts!r}")
        check_flag("moe.norm_topk_prob", self.norm_topk_prob)
        if not self.num_experts:
            return
        check_positive_int("moe.intermediate_size", self.intermediate_size)
        check_positive_int("moe.num_experts_per_tok", self.num_experts_per_tok)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"moe.num_experts_per_tok must be <= moe.num_experts ({self.num_experts}); got "
                             f"{self.num_experts_per_tok}")
        if self.shared_expert_intermediate_size is not None:
            check_positive_int("moe.shared_expert_intermediate_size", self.shared_expert_intermediate_size)

    def check_fits(self, num_hidden_layers: int) -> None:
        """Raise ``ValueError`` unless ``layers`` are distinct indices of a model of ``num_hidden_layers``."""
        layers = self.layers
        if self.num_experts and layers is not None and (
                not isinstance(layers, list) or len(set(layers)) != len(layers)
                or any(not isinstance(i, int) or not 0 <= i < num_hidden_layers for i in layers)):
            raise ValueError(f"moe.layers must be distinct layer indices in [0, {num_hidden_layers}); got {layers}")

    def routes(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is the routed ``SparseMoE``."""
        return self.num_experts > 0 and (self.layers is None or layer_idx in self.layers)

    def layer_arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``SparseMoE`` these settings give (all but ``layers``)."""
        return {name: value for name, value in dataclasses.asdict(self).items() if name != "layers"}


def build_settings(kind: type[Settings], value: Settings | Mapping[str, Any] | None, name: str) -> Settings:
    """``value`` as ``kind``: an instance as it is, a mapping (a ``config.json`` table) by its fields, None as the
    defaults. ``ValueError`` in one line for anything else or a field ``kind`` does not have."""
    if isinstance(value, kind):
        return value
    if value is None:
        return kind()
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a table of its fields; got {value!r}")
    known = [f.name for f in dataclasses.fields(kind)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name} has no field {', '.join(map(repr, unknown))}; its fields: {', '.join(known)}")
    return kind(**value)


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {value!r}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")
