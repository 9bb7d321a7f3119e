"""Named hook points: identity modules that mark where the memory lab may read or replace a tensor.

A mixer calls ``x = self.hook_k(x)`` at each point of interest. Nothing happens unless someone registers a hook::

    seen = {}
    layer.hook_k.register_forward_hook(lambda module, args, out: seen.setdefault("k", out))   # read
    layer.hook_readout.register_forward_hook(lambda module, args, out: out * 0)              # replace

A forward hook that returns a value replaces the tensor for the rest of the run (PyTorch semantics), so an
intervention is a hook on a named point, never a patch of the mixer's code (as in TransformerLens).

A point's name is its module path, as ``named_modules()`` gives it: ``model.layers.3.attn.hook_state`` in a
``LinMemForCausalLM``. ``hook_points`` lists them, ``select`` turns a user's choice (names, a glob or dotted prefix,
a predicate) into names, and ``caching`` / ``attached`` add hooks by name for the length of a ``with`` block; the
models' ``run_with_cache`` and ``run_with_hooks`` are built on these. A point without hooks reports it
(``HookPoint.is_hooked``), so a mixer can skip the copies and final states that only a hook would read.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules import module as torch_module

# the hook points (``hook_<name>``) of a recurrent mixer that carry the op's per-token inputs, in the op's order
HOOK_INPUTS = ("q", "k", "v", "g", "beta", "gamma")

# which hook points a call means: a name, a glob (``*.hook_state``), a dotted prefix (``model.layers.3``), a list
# of those, or a predicate on the name; None means every point
Names = str | Sequence[str] | Callable[[str], bool] | None
# a hook by name: ``fn(tensor, name)`` returns the tensor that replaces the point's, or None to keep it
HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]


class HookPoint(nn.Module):
    """Identity ``x ↦ x``; exists only to be addressed by name (``model.layers.3.attn.hook_k``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @property
    def is_hooked(self) -> bool:
        """Whether a forward hook or pre-hook would fire here: one of this point's, or a global one
        (``torch.nn.modules.module.register_module_forward_hook``)."""
        return bool(self._forward_hooks or self._forward_pre_hooks or torch_module._global_forward_hooks
                    or torch_module._global_forward_pre_hooks)


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of ``model`` by its module path, in the order the modules were registered."""
    return {name: module for name, module in model.named_modules() if isinstance(module, HookPoint)}


def _matches(pattern: str, name: str) -> bool:
    """``pattern`` names ``name``: equal, a glob matching it, or a dotted prefix of it."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".")


def _unknown(pattern: str, known: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(pattern, known, n=4, cutoff=0.5)
    hint = f"close matches: {', '.join(close)}" if close else f"names look like {known[0]!r}" if known else ""
    return ValueError(f"no hook point matches {pattern!r}; {hint} (model.hook_names() lists them all)")


def select(known: Sequence[str], names: Names) -> list[str]:
    """The names in ``known`` that ``names`` means, in ``known``'s order; ``ValueError`` naming close matches when
    a name, glob or prefix (or a predicate) matches none."""
    if names is None:
        return list(known)
    if callable(names):
        chosen = [name for name in known if names(name)]
        if not chosen:
            raise ValueError("the names predicate accepts no hook point (model.hook_names() lists them all)")
        return chosen
    patterns = [names] if isinstance(names, str) else list(names)
    for pattern in patterns:
        if not any(_matches(pattern, name) for name in known):
            raise _unknown(pattern, known)
    return [name for name in known if any(_matches(pattern, name) for pattern in patterns)]


@contextmanager
def attached(model: nn.Module, hooks: Sequence[tuple[Names, HookFn]]) -> Iterator[None]:
    """While inside, each ``(names, fn)`` of ``hooks`` runs ``fn(tensor, name)`` at every point ``names`` selects
    (in the order given, where several hooks share a point); every hook is removed on exit, also on an error."""
    points = hook_points(model)
    known = list(points)
    handles = []
    try:
        for names, fn in hooks:
            if not callable(fn):
                raise TypeError(f"a hook is (names, fn) with fn(tensor, name) -> tensor or None; got fn={fn!r}")
            for name in select(known, names):
                handles.append(points[name].register_forward_hook(
                    lambda module, args, out, name=name, fn=fn: fn(out, name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def caching(model: nn.Module, names: Names = None) -> Iterator[dict[str, torch.Tensor]]:
    """While inside, the points ``names`` selects store the tensor they carry (as the run goes on, autograd graph
    kept) into the yielded ``{name: tensor}``; a point that fires twice keeps its last tensor."""
    store: dict[str, torch.Tensor] = {}
    with attached(model, [(names, lambda tensor, name: store.__setitem__(name, tensor))]):
        yield store
