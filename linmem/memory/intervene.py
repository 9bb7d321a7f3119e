"""``run``: the recipient prompt's logits with edits applied, through the hook points and the cache.

How a call runs (``N`` edit sets on ``B`` prompt pairs become ``N·B`` rows, row ``n·B + b``, run in batches of
edit sets whose size ``batching.run_in_batches`` chooses from the device's free memory):

1. Cache edits (``StateSwap``, ``StateAdd``, ``CacheSwap``) split the prompt at their common ``at``: the prefix
   ``[0, at)`` runs once for the recipient (once per row only if some edit touches the prefix) and once for the
   donor, each into a ``LinMemCache``; each row's cached states are then edited; only the suffix ``[at, T)`` runs
   again, for all rows at once, from the edited cache.
2. Write and read-out edits act inside the layers that hold them: hooks capture the head inputs, the edited
   ``(row, head)`` pairs are replayed (``replay.replay``) with their overrides, and the replay's read-outs and
   final states replace the op's through ``hook_readout``, ``hook_state`` and ``hook_residual_state``.

Nothing is written to the model or to the caller's tensors; hooks are removed when the call ends.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from linmem.layers.layer_cache import AttentionLayerCache
from linmem.memory.batching import run_in_batches
from linmem.memory.components import check_component, mixer
from linmem.memory.edits import Edit, EditContext, PairEdit
from linmem.memory.recording import Recording, backbone, head_scale, on_model, record_inputs, unembed
from linmem.memory.replay import HeadInputs, WriteOverrides, replay
from linmem.models.cache import LinMemCache
from linmem.ops.linear_memory import state_dtype_for


class Plan:
    """The write and read-out edits of every row, by layer and ``(row, head)``."""

    def __init__(self, edit_sets: Sequence[Sequence[Edit]], batch: int):
        self.batch = batch
        self.by_layer: dict[int, dict[tuple[int, int], list[PairEdit]]] = defaultdict(lambda: defaultdict(list))
        for n, edits in enumerate(edit_sets):
            for edit in edits:
                if edit.stage == "cache":
                    continue
                for c in edit.components:
                    for b in range(batch):
                        self.by_layer[c.layer][(n * batch + b, c.head)].append(PairEdit(edit, c.memory, b))

    def in_chunk(self, layer: int, start: int, end: int) -> dict[tuple[int, int], list[PairEdit]]:
        """The pairs of ``layer`` with an edit that touches tokens ``[start, end)``."""
        pairs = {}
        for key, items in self.by_layer.get(layer, {}).items():
            hit = [e for e in items if any(start <= p < end for p in e.positions)]
            if hit:
                pairs[key] = hit
        return pairs

    def layers_in_chunk(self, start: int, end: int) -> list[int]:
        return [layer for layer in sorted(self.by_layer) if self.in_chunk(layer, start, end)]


class Sources:
    """The runs edits take values from, recorded on first use: ``"donor"`` and ``"clean"`` (the recipient)."""

    def __init__(self, model: nn.Module, recipient: torch.Tensor, donor: torch.Tensor | None):
        self.model, self.ids = model, {"clean": recipient, "donor": donor}
        self.records: dict[str, Recording] = {}

    def prepare(self, edit_sets: Sequence[Sequence[Edit]]) -> None:
        """Record every run the edits will need now: a hook cannot start a forward of the model it is in."""
        for name in sorted({run for edits in edit_sets for e in edits for run in e.recordings}):
            self[name]

    def __getitem__(self, name: str) -> Recording:
        if name not in self.records:
            if self.ids[name] is None:
                raise ValueError("this edit takes values from the donor run: pass donor_ids [B, T]")
            self.records[name] = Recording.of(self.model, self.ids[name])
        return self.records[name]


def split_point(edit_sets: Sequence[Sequence[Edit]]) -> int | None:
    """The ``at`` shared by every cache edit (None without cache edits); different ``at`` values raise."""
    ats = {e.at for edits in edit_sets for e in edits if e.stage == "cache"}
    if len(ats) > 1:
        raise ValueError(f"all cache edits of one run must share one `at`; got {sorted(ats)}")
    return ats.pop() if ats else None


def validate(model: nn.Module, edit_sets: Sequence[Sequence[Edit]], length: int) -> None:
    """Raise ``ValueError`` for an unknown component or layer, or a position outside the prompt."""
    for edits in edit_sets:
        for e in edits:
            for c in getattr(e, "components", ()):
                check_component(model, c)
            for layer in getattr(e, "layers", ()):
                mixer(model, layer)
            bad = [p for p in e.edited_positions() if p >= length] + ([e.at] if getattr(e, "at", 0) >= length else [])
            if bad:
                raise ValueError(f"{e!r}: positions {bad} are outside the prompt of {length} tokens")


@torch.no_grad()
def run_many(model: nn.Module, recipient_ids: torch.Tensor, donor_ids: torch.Tensor | None = None,
             edit_sets: Sequence[Sequence[Edit]] = ((),), logits_at: Sequence[int] | None = None,
             chunk: int | None = None, prefix: SharedPrefix | None = None,
             reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits of the recipient under each edit set, in batched runs that share the prefix.

    Args:
        recipient_ids, donor_ids: ``[B, T]`` (or ``[T]``) token ids; donors only where an edit needs them.
        edit_sets: ``N`` lists of edits (``linmem.memory.edits``).
        logits_at: the positions to return logits for (default: all ``T``).
        chunk: edit sets per batched forward (default: chosen from the device's free memory, see
            ``linmem.memory.batching``; an out-of-memory error halves it either way); the unedited prefix and the
            donor's cache are computed once for all batches.
        prefix: the prefix runs made beforehand (``shared_prefix``, rows picked with ``SharedPrefix.select``) for
            prompts whose tokens before the cache edits' ``at`` are these; by default made here.
        reduce: applied to each batch's logits ``[n, B, P, vocab]`` as it is made, so that only what it returns
            (``[n, ...]``, e.g. the logits of a few candidates) is kept; the batches' results are concatenated.
    Returns:
        ``[N, B, P, vocab]`` (or the concatenated ``reduce`` results).
    """
    recipient_ids = on_model(model, recipient_ids.unsqueeze(0) if recipient_ids.dim() == 1 else recipient_ids)
    if donor_ids is not None:
        donor_ids = on_model(model, donor_ids.unsqueeze(0) if donor_ids.dim() == 1 else donor_ids)
        if donor_ids.shape != recipient_ids.shape:
            raise ValueError(f"donor_ids must have the recipient's shape {list(recipient_ids.shape)} (pairs of equal "
                             f"token length); got {list(donor_ids.shape)}")
    edit_sets = [list(edits) for edits in edit_sets]
    batch, length = recipient_ids.shape
    validate(model, edit_sets, length)
    positions = logit_positions(logits_at, length)
    sources = Sources(model, recipient_ids, donor_ids)
    sources.prepare(edit_sets)
    at = split_point(edit_sets)
    if prefix is None:
        shared = SharedPrefix(model, recipient_ids, donor_ids, edit_sets, at)
    elif (prefix.at, prefix.rows) != (at, batch):
        raise ValueError(f"the shared prefix is of {prefix.rows} prompts split at {prefix.at}; this call has {batch} "
                         f"split at {at}")
    else:
        shared = prefix
    progress = tqdm(total=len(edit_sets), desc="edit sets", unit="set", leave=False,
                    disable=None if len(edit_sets) > 1 else True)

    def run_sets(start: int, stop: int) -> torch.Tensor:
        group = edit_sets[start:stop]
        plan = Plan(group, batch)
        if at is None:
            hidden = forward(model, recipient_ids.repeat(len(group), 1), None, plan, (0, length), sources)
            logits = unembed(model, hidden[:, positions])
        else:
            logits = _split_run(model, recipient_ids, group, plan, at, positions, sources, shared)
        logits = logits.reshape(len(group), batch, len(positions), -1)
        kept = logits if reduce is None else reduce(logits)
        progress.update(len(group))
        return kept

    with progress:
        out, _ = run_in_batches(run_sets, len(edit_sets), recipient_ids.device, chunk)
    return torch.cat(out)


def logit_positions(logits_at: Sequence[int] | None, length: int) -> list[int]:
    """``logits_at`` as non-negative positions in the caller's order (negative ones count from the end, as in
    Python indexing); every position of the prompt when None. ``ValueError`` for a position outside the prompt."""
    if logits_at is None:
        return list(range(length))
    positions = [int(p) for p in logits_at]
    bad = [p for p in positions if not -length <= p < length]
    if bad or not positions:
        raise ValueError(f"logits_at must be positions of the {length}-token prompt (at least one); got {bad or []}")
    return [p % length for p in positions]


def run(model: nn.Module, recipient_ids: torch.Tensor, donor_ids: torch.Tensor | None = None,
        edits: Sequence[Edit] = ()) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` of the recipient prompt ``[B, T]`` with ``edits`` applied (values taken from the
    donor prompt ``[B, T]`` where an edit needs them). Weights and the given tensors are left unchanged."""
    return run_many(model, recipient_ids, donor_ids, [list(edits)])[0]


def shared_prefix(model: nn.Module, recipient_ids: torch.Tensor, donor_ids: torch.Tensor | None,
                  edit_sets: Sequence[Sequence[Edit]]) -> SharedPrefix:
    """The prefix runs ``run_many`` makes for these edit sets, made once for several calls whose prompts share
    their tokens before the cache edits' ``at`` (the same passages asked about different facts): pass
    ``.select(rows)`` as each call's ``prefix``. ``recipient_ids, donor_ids``: ``[B, ≥ at]``."""
    recipient_ids = on_model(model, recipient_ids)
    donor_ids = None if donor_ids is None else on_model(model, donor_ids)
    edit_sets = [list(edits) for edits in edit_sets]
    return SharedPrefix(model, recipient_ids, donor_ids, edit_sets, split_point(edit_sets))


def _map_cache(config, cache: LinMemCache | None, fn) -> LinMemCache | None:
    """A new cache holding ``fn`` of every tensor of ``cache`` (``fn`` maps the batch dimension, dim 0)."""
    if cache is None:
        return None
    out = LinMemCache.from_config(config)
    for new, old in zip(out.layers, cache.layers):
        if isinstance(old, AttentionLayerCache):
            new.keys, new.values = fn(old.keys), fn(old.values)
        else:
            new.base_state, new.residual_state = fn(old.base_state), fn(old.residual_state)
            new.conv_states = {name: fn(state) for name, state in old.conv_states.items()}
            new.seen_tokens = old.seen_tokens
    return out


class SharedPrefix:
    """What every chunk of a split run shares: the donor's prefix cache and, when no edit touches the prefix, the
    recipient's prefix cache and hidden states (computed once, copied per chunk)."""

    def __init__(self, model, recipient_ids, donor_ids, edit_sets, at: int | None):
        self.model, self.cache, self.hidden, self.donor = model, None, None, None
        self.at, self.rows = at, recipient_ids.shape[0]
        if at is None:
            return
        if any(e.needs_donor_cache for edits in edit_sets for e in edits):
            if donor_ids is None:
                raise ValueError("StateSwap / CacheSwap take the donor's cache: pass donor_ids [B, T]")
            self.donor = LinMemCache.from_config(model.config)
            backbone(model)(input_ids=donor_ids[:, :at], cache=self.donor, use_cache=True)
        if not Plan(edit_sets, recipient_ids.shape[0]).layers_in_chunk(0, at):
            self.cache = LinMemCache.from_config(model.config)
            self.hidden = forward(model, recipient_ids[:, :at], self.cache, None, (0, at), None)

    def tiled(self, times: int) -> tuple[LinMemCache, torch.Tensor]:
        """A fresh copy of the recipient's prefix cache and hidden states, repeated ``times`` along the batch."""
        repeat = lambda t: None if t is None else t.repeat(times, *([1] * (t.dim() - 1)))  # noqa: E731
        return _map_cache(self.model.config, self.cache, repeat), repeat(self.hidden)

    def select(self, rows: Sequence[int]) -> SharedPrefix:
        """The prefix runs of these prompts (indices into this one's ``B``), in this order."""
        index = torch.tensor(list(rows), dtype=torch.long)
        take = lambda t: None if t is None else t.index_select(0, index.to(t.device))  # noqa: E731
        out = copy.copy(self)
        out.rows = len(index)
        out.cache = _map_cache(self.model.config, self.cache, take)
        out.donor = _map_cache(self.model.config, self.donor, take)
        out.hidden = take(self.hidden)
        return out


def _split_run(model, recipient_ids, edit_sets, plan, at, positions, sources, shared: SharedPrefix) -> torch.Tensor:
    """Prefix into a cache (or the shared one), edit the cache per row, then only the suffix for all rows."""
    rows, (batch, length) = len(edit_sets), recipient_ids.shape
    if shared.cache is not None:
        cache, hidden_prefix = shared.tiled(rows)
    else:
        cache = LinMemCache.from_config(model.config)
        hidden_prefix = forward(model, recipient_ids[:, :at].repeat(rows, 1), cache, plan, (0, at), sources)
    for n, edits in enumerate(edit_sets):
        for e in edits:
            if e.stage == "cache":
                e.apply_to_cache(cache, shared.donor, slice(n * batch, (n + 1) * batch))
    hidden_suffix = forward(model, recipient_ids[:, at:].repeat(rows, 1), cache, plan, (at, length), sources)
    before, after = [p for p in positions if p < at], [p - at for p in positions if p >= at]
    hidden = torch.cat([hidden_prefix[:, before], hidden_suffix[:, after]], dim=1)
    first, second = iter(range(len(before))), iter(range(len(before), len(positions)))
    return unembed(model, hidden[:, [next(first) if p < at else next(second) for p in positions]])  # caller's order


def forward(model, ids, cache, plan: Plan | None, chunk: tuple[int, int], sources: Sources) -> torch.Tensor:
    """Hidden states ``[R, T_chunk, D]`` of ``ids`` (tokens ``chunk`` of the prompt) with the plan's edits."""
    handles = []
    try:
        if plan is not None:
            for layer in plan.layers_in_chunk(*chunk):
                handles += LayerEditor(model, layer, plan.in_chunk(layer, *chunk), chunk[0], sources).install()
        out = backbone(model)(input_ids=ids, cache=cache, use_cache=cache is not None)
        return out.last_hidden_state
    finally:
        for handle in handles:
            handle.remove()


def apply_cache_edit(model, cache: LinMemCache, donor: LinMemCache | None, edit: Edit, rows: slice) -> None:
    """Edit the cached states of ``rows`` (one edit set) in place: states of components, or whole layer caches."""
    edit.apply_to_cache(cache, donor, rows)


class LayerEditor:
    """The hooks that apply one layer's write and read-out edits to one chunk of the prompt.

    ``pairs`` maps ``(row, head)`` to its edits; ``offset`` is the chunk's first token in the prompt.
    """

    def __init__(self, model, layer: int, pairs: dict[tuple[int, int], list[PairEdit]], offset: int,
                 sources: Sources):
        self.model, self.layer, self.offset, self.sources = model, layer, offset, sources
        self.mix = mixer(model, layer)
        self.residual = self.mix.memory.residual
        self.context = EditContext(layer, offset, self.residual, sources.__getitem__)
        self.keys = sorted(pairs)
        self.pairs = pairs
        self.captured: dict[str, torch.Tensor] = {}
        self.initial = (None, None)
        self.result = None

    def install(self) -> list:
        mix = self.mix
        handles = [mix.register_forward_pre_hook(self._before, with_kwargs=True), *record_inputs(mix, self.captured)]
        handles.append(mix.hook_state.register_forward_hook(lambda m, a, out: self._replace_state(out, 0)))
        if mix.memory.residual:
            handles.append(mix.hook_residual_state.register_forward_hook(lambda m, a, out: self._replace_state(out, 1)))
        handles.append(mix.hook_readout.register_forward_hook(lambda m, a, out: self._replace_readout(out)))
        return handles

    def _before(self, module, args, kwargs) -> None:
        cache = kwargs.get("cache")
        self.initial = (None, None) if cache is None else (cache.base_state, cache.residual_state)

    def _index(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.captured["q"].device
        rows = torch.tensor([r for r, _ in self.keys], device=device)
        return rows, torch.tensor([h for _, h in self.keys], device=device)

    def _replace_state(self, out: torch.Tensor, which: int) -> torch.Tensor:
        if which == 0:  # hook_state fires first, after the op: replay the edited pairs now
            self.result = self._replay()
        rows, heads = self._index()
        new = out.clone()
        new[rows, heads] = self.result.state[which].to(out.dtype)
        return new

    def _replace_readout(self, out: torch.Tensor) -> torch.Tensor:
        rows, heads = self._index()
        new = out.clone()
        new[rows, :, heads] = self.result.o.to(out.dtype)
        return new

    def _initial_states(self, rows, heads, x: HeadInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        dtype = state_dtype_for(x.q.dtype)
        zeros = x.v.new_zeros(len(rows), x.v.shape[-1], x.k.shape[-1], dtype=dtype)
        pick = lambda s: zeros.clone() if s is None else s[rows, heads].to(dtype)  # noqa: E731
        base = pick(self.initial[0])
        return base, pick(self.initial[1]) if self.residual else None

    def _relative(self, edit: PairEdit, length: int) -> list[int]:
        return [p - self.offset for p in edit.positions if self.offset <= p < self.offset + length]

    def _replay(self):
        rows, heads = self._index()
        x = HeadInputs.gather(self.captured, rows, heads)
        initial = self._initial_states(rows, heads, x)
        x = x.map(lambda y: y.to(initial[0].dtype))
        overrides, special = WriteOverrides.none(x), set()
        for i, key in enumerate(self.keys):
            for pair in self.pairs[key]:
                rel = self._relative(pair, x.length)
                special.update(rel)
                if pair.edit.stage == "write":
                    pair.edit.override_writes(self.context, overrides, x, i, key[1], pair, rel)
        out = replay(x, self.mix.memory, head_scale(self.mix), initial, sorted(special), overrides, self.mix.backend)
        for i, key in enumerate(self.keys):
            for pair in self.pairs[key]:
                if pair.edit.stage == "readout":
                    pair.edit.patch_readout(self.context, out, i, key[1], pair, self._relative(pair, x.length))
        return out
