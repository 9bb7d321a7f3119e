"""Interventions: what to change, where, from which run, and how. ``linmem.memory.run`` applies them.

Every edit names components (see ``components.Component``) or layers and absolute token positions of the prompt.
Sources: "donor" (the donor prompt's run), "clean" (the unedited recipient run). The ``control`` field turns an edit
into its equal-norm random baseline: the same change in size (Frobenius / Euclidean norm of donor − recipient, per
component and prompt), in a Gaussian direction drawn from ``seed``.

Each edit is a frozen dataclass that carries its own behaviour, at one of three stages of a run (``Edit.stage``):
``"cache"`` edits change the cached states after tokens ``[0, at)`` (``apply_to_cache``); ``"write"`` edits change
the writes of the replayed heads (``override_writes``); ``"readout"`` edits replace a part of the heads' read-out
(``patch_readout``). A new edit is one new class here. Write and read-out edits see their layer through an
``EditContext`` (the layer, the chunk's first token, the recorded runs), which ``intervene`` builds; this module
imports nothing from ``intervene``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from linmem.layers.layer_cache import AttentionLayerCache
from linmem.memory.components import Component
from linmem.models.cache import LinMemCache

if TYPE_CHECKING:
    from linmem.memory.recording import Recording
    from linmem.memory.replay import HeadInputs, Replay, WriteOverrides

CONTROLS = ("donor", "random")
CACHE_KINDS = ("recurrent", "conv", "kv")


class Edit:
    """What every edit answers (the defaults: no token positions, no recorded run needed)."""

    stage = ""  # "cache", "write" or "readout"
    needs_donor_cache = False  # takes the donor's prefix cache

    def edited_positions(self) -> tuple[int, ...]:
        """The token positions a write or read-out edit touches (empty for cache edits)."""
        return ()

    @property
    def recordings(self) -> tuple[str, ...]:
        """The recorded runs (``"donor"``, ``"clean"``) the edit takes values from inside the layers."""
        return ()


@dataclass(frozen=True)
class PairEdit:
    """One write / read-out edit on one memory of one ``(row, head)``; ``batch`` is the prompt pair's index."""

    edit: Edit
    memory: str
    batch: int

    @property
    def positions(self) -> tuple[int, ...]:
        return self.edit.edited_positions()


@dataclass(frozen=True)
class EditContext:
    """What a write or read-out edit sees of the layer it acts in: the ``layer`` index, ``offset`` (the first
    token of the run chunk, so that chunk position ``p`` is prompt position ``p + offset``), whether the layer has a
    residual memory, and ``recording(name)``, the recorded run ``"donor"`` or ``"clean"``."""

    layer: int
    offset: int
    residual: bool
    recording: Callable[[str], Recording]

    def donor_inputs(self, pair: PairEdit, head: int, rel: list[int]) -> dict[str, torch.Tensor]:
        """The donor's write inputs ``k, v, beta`` (and ``gamma``) of ``pair`` and ``head`` at the chunk's tokens
        ``rel``: ``[P, ...]`` each."""
        record = self.recording("donor")
        b, h = torch.tensor([pair.batch]), torch.tensor([head])
        absolute = [p + self.offset for p in rel]
        names = ("k", "v", "beta", "gamma") if self.residual else ("k", "v", "beta")
        return {name: record.at(self.layer, name, b, absolute, h)[0] for name in names}


class CacheEdit(Edit):
    stage = "cache"

    def apply_to_cache(self, cache: LinMemCache, donor: LinMemCache | None, rows: slice) -> None:
        """Edit the cached states of ``rows`` (one edit set) in place; ``donor`` holds the donor's prefix."""
        for c in self.components:
            name = "base_state" if c.memory == "S" else "residual_state"
            states = getattr(cache.layers[c.layer], name)
            donor_states = None if donor is None else getattr(donor.layers[c.layer], name)[:, c.head]
            states[rows, c.head] = self.edited_state(states[rows, c.head], donor_states, c)

    def edited_state(self, current: torch.Tensor, donor: torch.Tensor | None, component: Component) -> torch.Tensor:
        """The new memory ``[B, V, K]`` of ``component`` from its ``current`` one and the ``donor``'s."""
        raise NotImplementedError


class WriteEdit(Edit):
    stage = "write"

    def edited_positions(self) -> tuple[int, ...]:
        return tuple(range(*self.span))

    def override_writes(self, context: EditContext, w: WriteOverrides, x: HeadInputs, i: int, head: int,
                        pair: PairEdit, rel: list[int]) -> None:
        """Set the writes of replayed pair ``i`` (``head``) at its chunk's tokens ``rel`` in ``w``."""
        raise NotImplementedError


class ReadoutEdit(Edit):
    stage = "readout"
    source = "donor"  # the recorded run whose read-out is taken

    def edited_positions(self) -> tuple[int, ...]:
        return self.positions

    @property
    def recordings(self) -> tuple[str, ...]:
        return (self.source,)

    def patch_readout(self, context: EditContext, out: Replay, i: int, head: int, pair: PairEdit,
                      rel: list[int]) -> None:
        """Replace pair ``i``'s read-out part of ``pair.memory`` at ``rel`` in ``out.o`` (and ``out.base_read``)
        by the source run's."""
        derived = context.recording(self.source).derived(context.layer, tuple(p + context.offset for p in rel))
        src_o = derived["o"][pair.batch, head].to(out.o.dtype)
        src_base = derived["base_read"][pair.batch, head].to(out.o.dtype)
        if not context.residual:
            current, target = out.o[i, rel], src_o
        elif pair.memory == "S":
            current, target = out.base_read[i, rel], src_base
        else:
            current, target = out.o[i, rel] - out.base_read[i, rel], src_o - src_base
        if getattr(self, "control", "donor") == "random":
            target = current + equal_norm_noise(target - current, (self.seed, context.layer, head, pair.memory,
                                                                    pair.batch), dims=2)
        if not context.residual:
            out.o[i, rel] = target
        elif pair.memory == "S":
            out.o[i, rel] = out.o[i, rel] + target - current
            out.base_read[i, rel] = target
        else:
            out.o[i, rel] = out.base_read[i, rel] + target


def _components(value: Iterable) -> tuple[Component, ...]:
    if isinstance(value, (Component, str)) or (isinstance(value, tuple) and value and isinstance(value[0], int)):
        value = [value]
    out = tuple(Component.parse(c) for c in value)
    if not out:
        raise ValueError("an edit needs at least one component")
    return out


def _check_control(control: str) -> None:
    if control not in CONTROLS:
        raise ValueError(f"control must be one of {CONTROLS}; got {control!r}")


def _set_at(edit) -> None:
    """Check and normalize ``edit.at``: a token count >= 1 (the state after tokens ``[0, at)``)."""
    at = edit.at
    if isinstance(at, bool) or not hasattr(at, "__index__"):
        raise ValueError(f"at must be an integer token index (the state after tokens [0, at)); got {at!r}")
    if at.__index__() < 1:
        raise ValueError(f"at must be >= 1 (the state after at least one token); got {at}")
    object.__setattr__(edit, "at", at.__index__())


def _positions(value: Iterable[int] | int) -> tuple[int, ...]:
    out = (int(value),) if isinstance(value, int) else tuple(int(p) for p in value)
    if not out or min(out) < 0:
        raise ValueError(f"positions must be non-negative token indices (at least one); got {value!r}")
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class StateSwap(CacheEdit):
    """The memories of ``components`` after tokens ``[0, at)`` replaced by the donor's, then the run continues.

    ``control="random"``: recipient state + a Gaussian matrix with the norm of (donor − recipient) instead.
    """

    components: tuple[Component, ...]
    at: int
    control: str = "donor"
    seed: int = 0
    needs_donor_cache = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", _components(self.components))
        _check_control(self.control)
        _set_at(self)

    def edited_state(self, current: torch.Tensor, donor: torch.Tensor | None, component: Component) -> torch.Tensor:
        target = donor.to(current)
        if self.control == "random":
            c = component
            target = current + equal_norm_noise(target - current, (self.seed, c.layer, c.head, c.memory), dims=2)
        return target


@dataclass(frozen=True, eq=False)
class StateAdd(CacheEdit):
    """Add ``delta [B, V, K]`` (one matrix per prompt) to each component's memory after tokens ``[0, at)``; the
    Frobenius parallel / orthogonal edits and any hand-made state edit. Compared by identity (it holds a tensor)."""

    components: tuple[Component, ...]
    at: int
    delta: torch.Tensor = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", _components(self.components))
        _set_at(self)
        if not isinstance(self.delta, torch.Tensor) or self.delta.dim() != 3:
            shape = list(self.delta.shape) if isinstance(self.delta, torch.Tensor) else type(self.delta).__name__
            raise ValueError(f"StateAdd.delta must be a tensor [B, V, K] (prompts, value dim, key dim); got {shape}")
        if not bool(torch.isfinite(self.delta).all()):
            raise ValueError("StateAdd.delta must be finite; it holds NaN or infinite values")

    def edited_state(self, state: torch.Tensor, donor: torch.Tensor | None, component: Component) -> torch.Tensor:
        """``state + delta`` for ``state [B, V, K]``, the memory of ``component`` in B prompts; a ``ValueError``
        naming the expected shape when ``delta`` does not have it."""
        if self.delta.shape != state.shape:
            raise ValueError(f"StateAdd.delta must have shape [B, V, K] = {list(state.shape)} for {component} "
                             f"(prompts, value dim, key dim of its memory); got {list(self.delta.shape)}")
        return state + self.delta.to(state)

    def __repr__(self) -> str:
        return f"StateAdd(components={self.components}, at={self.at}, delta=<{list(self.delta.shape)}>)"


@dataclass(frozen=True)
class WriteBlock(WriteEdit):
    """No write into ``components`` at positions ``span[0] .. span[1] − 1``; decay still applies.

    S: β = 0 for the base memory there. R: the residual write ``γ r kᵀ`` (and the delta rule's ``γ k kᵀ``
    correction) is dropped, while R is still read with γ at those tokens.
    """

    components: tuple[Component, ...]
    span: tuple[int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", _components(self.components))
        object.__setattr__(self, "span", _span(self.span))

    def override_writes(self, context, w, x, i, head, pair, rel) -> None:
        if pair.memory == "S":
            w.base_beta[i, rel] = 0
        else:
            w.resid_gamma[i, rel] = 0
            w.resid_r[i, rel], w.resid_r_set[i, rel] = 0, True


@dataclass(frozen=True)
class DonorWrite(WriteEdit):
    """The write into ``components`` at ``span`` taken from the donor: ``k, v, β`` for S; ``k, γ, r`` for R (the
    donor's own residual target ``r = ρ(v − S_{t−1}k)``). Decay and read-out stay the recipient's.

    ``control="random"``: the written value (v for S, r for R) moved by a Gaussian vector of the norm of
    (donor − recipient) instead.
    """

    components: tuple[Component, ...]
    span: tuple[int, int]
    control: str = "donor"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", _components(self.components))
        object.__setattr__(self, "span", _span(self.span))
        _check_control(self.control)

    @property
    def recordings(self) -> tuple[str, ...]:
        return ("donor", "clean") if self.control == "random" else ("donor",)  # the random R write needs clean r

    def override_writes(self, context, w, x, i, head, pair, rel) -> None:
        d = {k: v.to(x.q.dtype) for k, v in context.donor_inputs(pair, head, rel).items()}
        random = self.control == "random"
        seed = (self.seed, context.layer, head, pair.memory, pair.batch)
        if pair.memory == "S":
            if random:
                w.base_v[i, rel] = x.v[i, rel] + write_noise(d["beta"], d["v"], d["k"], x.beta[i, rel], x.v[i, rel],
                                                              x.k[i, rel], seed)
            else:
                w.base_k[i, rel], w.base_v[i, rel], w.base_beta[i, rel] = d["k"], d["v"], d["beta"]
            return
        absolute = tuple(p + context.offset for p in rel)
        donor_r = context.recording("donor").derived(context.layer, absolute)["r"][pair.batch, head].to(x.q.dtype)
        if random:
            clean_r = context.recording("clean").derived(context.layer, absolute)["r"][pair.batch, head].to(x.q.dtype)
            w.resid_r_shift[i, rel] = write_noise(d["gamma"], donor_r, d["k"], x.gamma[i, rel], clean_r,
                                                  x.k[i, rel], seed)
        else:
            w.resid_k[i, rel], w.resid_gamma[i, rel] = d["k"], d["gamma"]
            w.resid_r[i, rel], w.resid_r_set[i, rel] = donor_r, True


@dataclass(frozen=True)
class KeyAlign(WriteEdit):
    """The write keys of ``components`` at ``span`` turned toward (``mode="align"``) or away from
    (``"orthogonal"``) the key the same head wrote with at token ``toward``, each keeping its own norm: the
    write-overlap intervention of Fig. 7 (``"orthogonal"`` is its control). S: the base write key; R: the residual
    write key."""

    components: tuple[Component, ...]
    span: tuple[int, int]
    toward: int
    mode: str = "align"

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", _components(self.components))
        object.__setattr__(self, "span", _span(self.span))
        if self.mode not in ("align", "orthogonal"):
            raise ValueError(f"mode must be 'align' or 'orthogonal'; got {self.mode!r}")
        object.__setattr__(self, "toward", int(self.toward))
        if self.toward < 0:
            raise ValueError(f"toward must be a non-negative token index; got {self.toward}")
        if self.span[0] <= self.toward < self.span[1]:
            raise ValueError(f"toward ({self.toward}) must lie outside span {self.span}")

    def edited_positions(self) -> tuple[int, ...]:
        return (*range(*self.span), self.toward)

    def override_writes(self, context, w, x, i, head, pair, rel) -> None:
        toward = self.toward - context.offset
        if not 0 <= toward < x.length:
            raise ValueError(f"{self!r}: toward and span must fall in one run chunk (before or after `at`)")
        span = [p for p in rel if p != toward]
        direction = x.k[i, toward] / x.k[i, toward].norm().clamp_min(1e-12)
        k = x.k[i, span]
        if self.mode == "align":
            new = k.norm(dim=-1, keepdim=True) * direction
        else:
            rest = k - (k @ direction)[:, None] * direction
            new = rest * k.norm(dim=-1, keepdim=True) / rest.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        if pair.memory == "S":
            w.base_k[i, span] = new
        else:
            w.resid_k[i, span] = new


@dataclass(frozen=True)
class OutputPatch(ReadoutEdit):
    """The components' read-out at ``positions`` taken from the donor run (for RLA / RDN the part of the head's
    read-out that reads S, ``scale·α S_{t−1} q``, or R, ``scale·γ R_t q``).

    ``control="random"``: moved by a Gaussian vector of the norm of (donor − current) instead.
    """

    components: tuple[Component, ...]
    positions: tuple[int, ...]
    control: str = "donor"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", _components(self.components))
        object.__setattr__(self, "positions", _positions(self.positions))
        _check_control(self.control)


@dataclass(frozen=True)
class OutputRestore(ReadoutEdit):
    """The components' read-out at ``positions`` restored to the clean recipient run (undoes what other edits did
    to it)."""

    components: tuple[Component, ...]
    positions: tuple[int, ...]
    source = "clean"

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", _components(self.components))
        object.__setattr__(self, "positions", _positions(self.positions))


@dataclass(frozen=True)
class CacheSwap(CacheEdit):
    """Whole layer caches after tokens ``[0, at)`` replaced by the donor's: ``"recurrent"`` (S and R of every head),
    ``"conv"`` (the short-convolution inputs), ``"kv"`` (attention keys and values). Kinds a layer lacks are
    skipped."""

    layers: tuple[int, ...]
    at: int
    kinds: tuple[str, ...] = CACHE_KINDS
    needs_donor_cache = True

    def __post_init__(self) -> None:
        _set_at(self)
        layers = (self.layers,) if isinstance(self.layers, int) else tuple(int(i) for i in self.layers)
        object.__setattr__(self, "layers", layers)
        kinds = (self.kinds,) if isinstance(self.kinds, str) else self.kinds
        if not isinstance(kinds, (tuple, list)) or not kinds or any(k not in CACHE_KINDS for k in kinds):
            raise ValueError(f"kinds must be a non-empty subset of {CACHE_KINDS}; got {self.kinds!r}")
        object.__setattr__(self, "kinds", tuple(kinds))

    def apply_to_cache(self, cache: LinMemCache, donor: LinMemCache | None, rows: slice) -> None:
        """Copy the donor's ``kinds`` of each layer's cache into ``rows``."""
        for layer in self.layers:
            mine, theirs = cache.layers[layer], donor.layers[layer]
            if isinstance(mine, AttentionLayerCache):
                if "kv" in self.kinds:
                    mine.keys[rows], mine.values[rows] = theirs.keys, theirs.values
                continue
            if "recurrent" in self.kinds:
                mine.base_state[rows] = theirs.base_state
                if mine.residual_state is not None:
                    mine.residual_state[rows] = theirs.residual_state
            if "conv" in self.kinds:
                for name, state in mine.conv_states.items():
                    state[rows] = theirs.conv_states[name]


def _span(span) -> tuple[int, int]:
    start, end = (int(x) for x in span)
    if not 0 <= start < end:
        raise ValueError(f"span must be (start, end) with 0 <= start < end; got {span!r}")
    return start, end


def equal_norm_noise(delta: torch.Tensor, seed: tuple, dims: int) -> torch.Tensor:
    """A Gaussian tensor shaped like ``delta`` whose norm over the last ``dims`` axes equals ``delta``'s there
    (seeded by ``seed``; same draw on every device)."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    noise = torch.randn(delta.shape, generator=generator, dtype=torch.float64).to(delta)
    axes = tuple(range(-dims, 0))
    norm = lambda x: x.pow(2).sum(axes, keepdim=True).sqrt()  # noqa: E731
    return noise * norm(delta) / norm(noise).clamp_min(1e-30)


def write_noise(donor_s, donor_v, donor_k, s, v, k, seed: tuple) -> torch.Tensor:
    """A Gaussian change ``δ [P, V]`` of the written value such that ``s (v + δ) kᵀ`` differs from ``s v kᵀ`` by the
    Frobenius norm of the donor's change ``s_d v_d k_dᵀ − s v kᵀ``, token by token (``s [P]``, ``v [P, V]``,
    ``k [P, K]``)."""
    change = (donor_s[:, None, None] * donor_v[:, :, None] * donor_k[:, None, :]
              - s[:, None, None] * v[:, :, None] * k[:, None, :])
    target = change.flatten(1).norm(dim=1)
    per_unit = (s * k.norm(dim=1)).clamp_min(1e-12)
    noise = equal_norm_noise(torch.ones_like(v), seed, dims=1)  # unit-norm directions scaled below
    return noise / noise.norm(dim=1, keepdim=True) * (target / per_unit)[:, None]
