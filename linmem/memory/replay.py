"""Re-run one head's memory with edits: the op between special tokens, the equations of ``docs/math.md`` at them.

The model's op gives read-outs and final states but neither the per-memory parts of a read-out nor a way to give
the base memory S and the residual memory R different writes at one token. ``replay`` runs a batch of single heads
(``n`` of them, each from its own initial states) through ``linear_memory`` on the stretches between special tokens
and through ``edited_step`` at each special token, where it can override the writes and records what the lab needs:
the base-memory part of the read-out and the residual target ``r``. Between special tokens nothing differs from the
model's own computation, so an unedited replay equals the model's layer to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from linmem.layers.hooks import HOOK_INPUTS
from linmem.ops import MemoryConfig, linear_memory
from linmem.ops.backend import MemoryInputs
from linmem.ops.step import Write, memory_step_parts


class HeadInputs(MemoryInputs):
    """The op's inputs for ``n`` single heads: ``q, k [n, T, K]``, ``v [n, T, V]``, ``g [n, T]`` (or ``[n, T, K]``
    per key channel), ``beta [n, T]``, ``gamma [n, T]`` (None without a residual memory)."""

    __slots__ = ()

    @property
    def length(self) -> int:
        return self.q.shape[1]

    @classmethod
    def gather(cls, captured: dict[str, torch.Tensor], rows: torch.Tensor, heads: torch.Tensor) -> HeadInputs:
        """Pick ``(rows[i], heads[i])`` out of a layer's hook tensors ``[B, T, H, ...]``."""
        pick = lambda x: None if x is None else x[rows, :, heads]  # noqa: E731  [n, T, ...]
        return cls(*(pick(captured.get(name)) for name in HOOK_INPUTS))


@dataclass
class WriteOverrides:
    """Per-token writes that differ from the inputs (used at special tokens only), all ``[n, T, ...]``.

    Base memory S: ``base_k, base_v, base_beta``. Residual memory R: ``resid_k``, ``resid_gamma`` (write strength;
    the read keeps the input γ), ``resid_r`` where ``resid_r_set`` is True (else ``r = ρ(v − S_{t−1}k)`` as
    usual) plus ``resid_r_shift`` added to r.
    """

    base_k: torch.Tensor
    base_v: torch.Tensor
    base_beta: torch.Tensor
    resid_k: torch.Tensor
    resid_gamma: torch.Tensor | None
    resid_r: torch.Tensor
    resid_r_set: torch.Tensor
    resid_r_shift: torch.Tensor = field(default=None)

    @classmethod
    def none(cls, inputs: HeadInputs) -> WriteOverrides:
        """No override: every field a copy of the inputs."""
        zeros = torch.zeros_like(inputs.v)
        gamma = None if inputs.gamma is None else inputs.gamma.clone()
        return cls(inputs.k.clone(), inputs.v.clone(), inputs.beta.clone(), inputs.k.clone(), gamma, zeros.clone(),
                   torch.zeros(inputs.v.shape[:2], dtype=torch.bool, device=inputs.v.device), zeros)


@dataclass
class Replay:
    """``o [n, T, V]`` the read-outs; ``base_read [n, T, V]`` the base-memory part ``scale·α S_{t−1} q``
    (``scale·S_{t−1} q`` without output gates, ``scale·S_t q`` without a residual memory) and ``r [n, T, V]`` the
    residual target, both only filled at the special tokens (zero elsewhere); ``state`` the final ``S [n, V, K]``
    and ``R`` (None without one)."""

    o: torch.Tensor
    base_read: torch.Tensor
    r: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor | None]


def edited_step(x: HeadInputs, w: WriteOverrides, t: int, base: torch.Tensor, resid: torch.Tensor | None,
                config: MemoryConfig, scale: float):
    """One token ``t`` of both memories with the writes of ``w`` (``ops.step.memory_step_parts``); states
    ``[n, V, K]``.

    Returns ``(o, base_read, r, new_base, new_resid)`` with ``o, base_read, r [n, V]``.
    """
    one = lambda y: y[:, t].unsqueeze(1)  # noqa: E731  keep a head axis of 1: the step's [B, H, ...] layout
    token = x.map(one)
    base_write = Write(one(w.base_k), one(w.base_v), one(w.base_beta))
    residual_write, edit_target = None, None
    if config.residual:
        residual_write = Write(one(w.resid_k), token.v, one(w.resid_gamma))
        given, given_set, shift = one(w.resid_r), one(w.resid_r_set)[..., None], one(w.resid_r_shift)
        edit_target = lambda r: torch.where(given_set, given, r) + shift  # noqa: E731
    step = memory_step_parts(token, base.unsqueeze(1), None if resid is None else resid.unsqueeze(1), config, scale,
                             base_write, residual_write, edit_target)
    base_read = scale * step.base_read[:, 0]
    if not config.residual:
        return step.o[:, 0], base_read, torch.zeros_like(base_read), step.base_state[:, 0], None
    return step.o[:, 0], base_read, step.residual_target[:, 0], step.base_state[:, 0], step.residual_state[:, 0]


def _run_op(x: HeadInputs, a: int, b: int, base, resid, config: MemoryConfig, scale: float, backend: str):
    """The op over tokens ``[a, b)`` for single heads; returns ``o [n, b − a, V]`` and the final states."""
    span = x.map(lambda y: y[:, a:b].unsqueeze(2))
    initial = (base.unsqueeze(1), resid.unsqueeze(1)) if config.residual else base.unsqueeze(1)
    o, final = linear_memory(*span, memory=config, scale=scale, initial_state=initial, output_final_state=True,
                             backend=backend)
    if config.residual:
        return o[:, :, 0], final[0][:, 0], final[1][:, 0]
    return o[:, :, 0], final[:, 0], None


def replay(x: HeadInputs, config: MemoryConfig, scale: float, initial: tuple[torch.Tensor, torch.Tensor | None],
           special: list[int], overrides: WriteOverrides | None = None, backend: str = "auto") -> Replay:
    """Run ``n`` heads over ``T`` tokens from ``initial = (S0, R0)`` (``[n, V, K]``; R0 None without R), with the
    equations at the ``special`` tokens (sorted, unique, in ``[0, T)``) and the op elsewhere."""
    dtype = initial[0].dtype
    x = x.map(lambda y: y.to(dtype))
    w = WriteOverrides.none(x) if overrides is None else overrides
    w = replace(w, **{name: None if val is None else val.to(dtype) if val.is_floating_point() else val
                      for name, val in asdict_shallow(w).items()})
    length = x.length
    base, resid = initial
    o = torch.zeros_like(x.v)
    base_read, r = torch.zeros_like(x.v), torch.zeros_like(x.v)
    start = 0
    for t in [*special, length]:
        if t > start:
            o[:, start:t], base, resid = _run_op(x, start, t, base, resid, config, scale, backend)
        if t < length:
            o[:, t], base_read[:, t], r[:, t], base, resid = edited_step(x, w, t, base, resid, config, scale)
        start = t + 1
    return Replay(o, base_read, r, (base, resid))


def asdict_shallow(obj) -> dict:
    """A dataclass's fields as a dict without copying tensors (``dataclasses.asdict`` deep-copies)."""
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
