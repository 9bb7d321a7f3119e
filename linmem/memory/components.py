"""What the memory lab can address in a model: components ``(layer, head, memory)`` and the mixers behind them.

A component is one recurrent memory matrix of one head: ``memory="S"`` the base memory, ``"R"`` the residual memory
of RLA / RDN layers. Components are frozen dataclasses, so they print, compare, sort and go into results as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from linmem.layers.recurrent import RecurrentMixer

MEMORIES = ("S", "R")


@dataclass(frozen=True, order=True)
class Component:
    """One memory of one head: ``layer`` and ``head`` from 0, ``memory`` ``"S"`` (base) or ``"R"`` (residual)."""

    layer: int
    head: int
    memory: str = "S"

    def __post_init__(self) -> None:
        if self.memory not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}; got {self.memory!r}")

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}{self.memory}"

    @classmethod
    def parse(cls, value: Component | tuple | str) -> Component:
        """A component from a ``Component``, a tuple ``(layer, head[, memory])`` or a string like ``"L3H1S"``."""
        if isinstance(value, Component):
            return value
        if isinstance(value, str):
            text = value.strip().upper()
            memory = text[-1] if text[-1] in MEMORIES else "S"
            body = text[:-1] if text[-1] in MEMORIES else text
            layer, _, head = body.removeprefix("L").partition("H")
            if not (layer.isdigit() and head.isdigit()):
                raise ValueError(f"a component string looks like 'L3H1S' or 'L3H1R'; got {value!r}")
            return cls(int(layer), int(head), memory)
        return cls(*value)


def blocks(model: nn.Module) -> nn.ModuleList:
    """The model's blocks (``model.model.layers`` of a ``LinMemForCausalLM``, or ``model.layers``)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise ValueError(f"{type(model).__name__} has no .layers / .model.layers: not a linmem model")
    return inner.layers


def mixer(model: nn.Module, layer: int) -> nn.Module:
    """The mixer (``attn``) of block ``layer``."""
    layers = blocks(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}); got {layer}")
    return layers[layer].attn


def is_recurrent(model: nn.Module, layer: int) -> bool:
    return isinstance(mixer(model, layer), RecurrentMixer)


def layers(model: nn.Module) -> list[int]:
    """Every layer index of the model, recurrent and attention."""
    return list(range(len(blocks(model))))


def recurrent_layers(model: nn.Module) -> list[int]:
    """The layer indices whose mixer is a linear memory."""
    return [i for i in layers(model) if is_recurrent(model, i)]


def attention_layers(model: nn.Module) -> list[int]:
    """The layer indices whose mixer is softmax attention."""
    return [i for i in layers(model) if not is_recurrent(model, i)]


def heads(model: nn.Module, memories: tuple[str, ...] = MEMORIES) -> list[Component]:
    """Every recurrent component: ``(layer, head, "S")`` for each head of each linear-memory layer, and
    ``(layer, head, "R")`` where the layer has a residual memory (restricted to ``memories``)."""
    out = []
    for i in recurrent_layers(model):
        m = mixer(model, i)
        kinds = ("S", "R") if m.memory.residual else ("S",)
        out += [Component(i, h, kind) for h in range(m.num_heads) for kind in kinds if kind in memories]
    return out


def check_component(model: nn.Module, component: Component) -> None:
    """Raise ``ValueError`` unless ``component`` exists in ``model``."""
    m = mixer(model, component.layer)
    if not isinstance(m, RecurrentMixer):
        raise ValueError(f"{component}: layer {component.layer} is softmax attention, not a recurrent memory")
    if not 0 <= component.head < m.num_heads:
        raise ValueError(f"{component}: head must be in [0, {m.num_heads})")
    if component.memory == "R" and not m.memory.residual:
        raise ValueError(f"{component}: layer {component.layer} has no residual memory R (only RLA / RDN do)")


def conv_width(model: nn.Module) -> int:
    """Kernel width W of the short convolutions (1 without them): a token reaches W − 1 tokens ahead."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "use_short_conv", False):
        return 1
    return int(config.conv_size)
