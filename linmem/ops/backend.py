"""The contract between ``linear_memory`` and its backends: the inputs a backend takes and what it can run.

A backend's ``run(x, base_state, residual_state, config, scale)`` takes the per-token inputs ``x`` (``MemoryInputs``,
in the state dtype unless the backend takes ``native_inputs``) and the states before the first token
``[N, H, V, K]`` (``residual_state`` None without a residual memory), and returns ``o [B, T, H, V]``, the final base
state and the final residual state. ``step.memory_step`` takes the same arguments without the T axis.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from linmem.io.backend_names import BACKENDS
from linmem.ops.checks import check_cu_seqlens
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


class Packed:
    """Sequences packed in one row, as ``bounds``: the boundaries of ``cu_seqlens [N + 1]`` as a host list, and
    what a backend derives from them (``derived``: the Triton kernels' chunk layout, on the device).

    ``Packed.of`` reads the boundaries back (a host synchronisation) and checks them the first time it meets a
    ``cu_seqlens`` tensor, and afterwards hands back the same ``Packed`` for that tensor while it is unchanged: a
    model passes one ``cu_seqlens`` to every layer, which then costs one sync and one layout per forward, not one
    per layer. The same tensor means the same live object (held by a weak reference, and no ``Packed`` holds the
    tensor: the cache keeps no tensor alive and never takes a later tensor at a freed one's address for it), with
    the same version counter (which every in-place write through torch bumps, under ``no_grad`` too, also a write
    to a view or the base it shares storage with) and the same data pointer and shape (``set_``, ``resize_``).
    Writes that bypass the version counter (through ``.data``, ``.numpy()``, DLPack, a kernel of one's own) are not
    seen: pass a new tensor after such a write. Inference tensors (made under ``torch.inference_mode``) have no
    version counter and are read back at every call.
    """

    def __init__(self, bounds: list[int]):
        self.bounds = bounds
        self._derived: dict = {}

    def derived(self, key, build: Callable[[], object]):
        """``build()`` the first time ``key`` is asked for, the same object after that."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @classmethod
    def known(cls, cu_seqlens: torch.Tensor, bounds: list[int]) -> Packed:
        """Remember ``bounds`` as the boundaries of ``cu_seqlens``, for a caller that had them on the host when it
        made the tensor (``ops.packing.unpad``): the op then reads nothing back. They are checked here, on the
        host; that they equal the tensor's values is the caller's promise."""
        bounds = [int(b) for b in bounds]
        check_cu_seqlens(cu_seqlens, 1, bounds[-1] if bounds else 0, bounds)
        if len(bounds) != cu_seqlens.numel() or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"bounds must be the {cu_seqlens.numel()} non-decreasing values of cu_seqlens; got "
                             f"{bounds}")
        packed = cls(bounds)
        stamp = _stamp(cu_seqlens)
        if stamp is not None:
            _remember(cu_seqlens, stamp, packed)
        return packed

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, batch: int, length: int) -> Packed:
        """The checked ``Packed`` of ``cu_seqlens`` for a ``[batch, length, ...]`` row (``checks.check_cu_seqlens``),
        from the cache while ``cu_seqlens`` is unchanged."""
        stamp = _stamp(cu_seqlens)
        entry = _PACKED.get(id(cu_seqlens)) if stamp is not None else None
        if entry is not None and entry[0]() is cu_seqlens and entry[1] == stamp:
            packed = entry[2]
            check_cu_seqlens(cu_seqlens, batch, length, packed.bounds)
            return packed
        packed = cls(check_cu_seqlens(cu_seqlens, batch, length))
        if stamp is not None:
            _remember(cu_seqlens, stamp, packed)
        return packed


# id(cu_seqlens) -> (weak reference to it, its stamp when read, its Packed); the most recent last, at most
# PACKED_CACHE_SIZE entries (a training step needs one; a few more cover evaluation interleaved with training)
_PACKED: OrderedDict[int, tuple[weakref.ref, tuple, Packed]] = OrderedDict()
PACKED_CACHE_SIZE = 8


def _stamp(cu_seqlens) -> tuple | None:
    """What changes when the tensor's values may have: its version, data pointer and shape (None: not cached)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_inference():
        return None
    return cu_seqlens._version, cu_seqlens.data_ptr(), tuple(cu_seqlens.shape)


def _remember(cu_seqlens: torch.Tensor, stamp: tuple, packed: Packed) -> None:
    key = id(cu_seqlens)

    def forget(ref, key=key, cache=_PACKED):  # the tensor is freed: drop its entry (unless a newer one took it)
        if key in cache and cache[key][0] is ref:
            del cache[key]

    _PACKED[key] = (weakref.ref(cu_seqlens, forget), stamp, packed)
    _PACKED.move_to_end(key)
    while len(_PACKED) > PACKED_CACHE_SIZE:
        _PACKED.popitem(last=False)


class BackendRun(Protocol):
    def __call__(self, x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                 config: MemoryConfig, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


def _runs_everything(x: MemoryInputs, config: MemoryConfig) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    """One implementation of the op and its abilities.

    ``native_inputs``: ``run`` takes bf16 / fp16 ``q, k, v`` as they are, runs packed sequences itself
    (``packed=Packed.of(...)``) and manages its own precision; other backends get every input in the state dtype,
    one packed sequence at a time, with autocast off. ``unsupported(x, config)``: None when ``run`` takes these
    inputs, else why not, naming the input or switch (``"q is float64"``); ``linear_memory`` then runs the chunk
    backend where ``auto`` chose this one, and refuses with that reason where the caller named it.
    """

    name: str
    run: BackendRun
    native_inputs: bool = False
    unsupported: Callable[[MemoryInputs, MemoryConfig], str | None] = _runs_everything
