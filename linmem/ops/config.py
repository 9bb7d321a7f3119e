"""The switches that pick one of the four memories (and the RLA paper's ablations), checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

RULES = ("additive", "delta")
RESIDUAL_TARGETS = ("clip", "tanh", "identity")
# how a layer makes the residual strength γ: its own projection, or γ = β (the paper's "w/o γ" ablation)
GAMMA_MODES = ("independent", "tied")


def check_gamma_mode(gamma: str) -> None:
    """A ``ValueError`` naming the choices unless ``gamma`` is one of ``GAMMA_MODES``."""
    if gamma not in GAMMA_MODES:
        raise ValueError(f"gamma must be one of {GAMMA_MODES}; got {gamma!r}")


def head_value_dim(head_dim: int, expand_v: float) -> int:
    """The value width per head ``V = K·expand_v``; a ``ValueError`` unless it is a positive integer."""
    width = head_dim * expand_v
    if not math.isclose(width, round(width)) or round(width) < 1:
        raise ValueError(f"head_dim * expand_v must be a positive integer; got {head_dim} * {expand_v}")
    return round(width)


@dataclass(frozen=True)
class MemoryConfig:
    """Which memory the op computes.

    ``rule``: ``"additive"`` (sGLA/GLA, and RLA with ``residual=True``) or ``"delta"`` (GDN, and RDN).
    ``residual``: add the second memory R that fits the base memory's clipped prediction error.
    ``residual_target``: ρ, one of ``"clip"`` (default), ``"tanh"``, ``"identity"``; ``clip`` is its threshold.
    ``fit_history``: False is the paper's "w/o fitting" ablation (R holds only the current step's correction).
    ``output_gates``: False is the "plain sum" ablation ``o = scale·(S_{t−1}q + R_t q)``.
    """

    rule: str = "additive"
    residual: bool = False
    residual_target: str = "clip"
    clip: float = 1.0
    fit_history: bool = True
    output_gates: bool = True

    def __post_init__(self) -> None:
        for name in ("residual", "fit_history", "output_gates"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # a tensor, a string or 0/1 would pick a memory by truthiness
                raise ValueError(f"{name} must be True or False; got {value!r} ({type(value).__name__})")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}; got {self.rule!r}")
        if self.residual_target not in RESIDUAL_TARGETS:
            raise ValueError(f"residual_target must be one of {RESIDUAL_TARGETS}; got {self.residual_target!r}")
        if self.residual_target != "identity" and not float(self.clip) > 0:
            raise ValueError(f"clip must be > 0 for residual_target={self.residual_target!r}; got {self.clip}")
