"""The contract between ``linear_memory`` and its backends: the inputs a backend takes and what it can run.

A backend's ``run(x, base_state, residual_state, config, scale)`` takes the per-token inputs ``x`` (``MemoryInputs``,
in the state dtype unless the backend takes ``native_inputs``) and the states before the first token
``[N, H, V, K]`` (``residual_state`` None without a residual memory), and returns ``o [B, T, H, V]``, the final base
state and the final residual state. ``step.memory_step`` takes the same arguments without the T axis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from linmem.io.backend_names import BACKENDS
from linmem.ops.config import MemoryConfig


def check_backend(backend: str) -> None:
    """A ``ValueError`` naming the choices unless ``backend`` is one of ``BACKENDS``: the one check of a backend
    name, called where a name is chosen (``linear_memory``'s argument, ``LinMemConfig(backend=...)``,
    ``model.set_backend``); the mixers hold a name one of those checked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")


class MemoryInputs(NamedTuple):
    """The per-token inputs: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, log decay ``g [B, T, H]`` (or
    ``[B, T, H, K]`` per key channel), write strengths ``beta, gamma [B, T, H]`` (``gamma`` None without a residual
    memory). One token (``memory_step``) has no T axis."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    gamma: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        """``fn`` applied to every input that is present (of this class or a subclass)."""
        return type(self)(*(None if t is None else fn(t) for t in self))


class Packed(NamedTuple):
    """Sequences packed in one row: ``cu_seqlens [N + 1]`` as given (kept on its device) and the same boundaries as
    a host list, read once by ``checks.check_cu_seqlens``."""

    cu_seqlens: torch.Tensor
    bounds: list[int]


class BackendRun(Protocol):
    def __call__(self, x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                 config: MemoryConfig, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


def _runs_everything(x: MemoryInputs, config: MemoryConfig) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    """One implementation of the op and its abilities.

    ``native_inputs``: ``run`` takes bf16 / fp16 ``q, k, v`` as they are, runs packed sequences itself
    (``packed=Packed(...)``) and manages its own precision; other backends get every input in the state dtype,
    one packed sequence at a time, with autocast off. ``unsupported(x, config)``: None when ``run`` takes these
    inputs, else why not, naming the input or switch (``"q is float64"``); ``linear_memory`` then runs the chunk
    backend where ``auto`` chose this one, and refuses with that reason where the caller named it.
    """

    name: str
    run: BackendRun
    native_inputs: bool = False
    unsupported: Callable[[MemoryInputs, MemoryConfig], str | None] = _runs_everything
