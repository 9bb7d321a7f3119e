"""Key-value bindings in natural-text filler: donor / recipient prompt pairs for the memory lab.

An item is built from one source passage (the statistical unit): ``K`` bindings (single-token key → single-token
value), each presented ``R`` times in shuffled order between stretches of the passage's own text, optionally a
controlled gap of filler before the query, then a query of one binding. Its donor prompt differs only in the target
binding's value (same token length, token for token). Every binding also has its own query, so edits can be checked
for what they break in the other facts. Text pieces are tokenized one by one and concatenated, so keys and values
are exactly one token each and donor and recipient align.

Variants (``TaskSpec``): ``variant="retrieval"`` (default); ``"latest"`` (the target key is first bound to an old
value, later re-bound: the answer is the latest value); ``"neutral"`` (the donor has every presentation of the target
fact replaced by filler of equal length); ``template`` / ``values`` / ``keys`` pick the wording, punctuation and
vocabularies (``linmem.memory.fact_formats``: by name, or a user's ``Template`` / ``Vocabulary``); ``gap`` fixes the
filler between the last fact and the query; ``num_bindings`` the load.

Training sequences with facts of the same shape come from ``linmem.memory.kv_filler``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from linmem.data.sources import Document
from linmem.data.splits import unit_hash
from linmem.memory.fact_formats import Template, Vocabulary, check_choice, template_tokens, vocabulary_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

VARIANTS = ("retrieval", "latest", "neutral")
SPLIT_SALT = "linmem-memory-lab"
NO_FACT_SALT = "linmem-no-fact"  # seeds the filler that replaces the target fact in an item's no-fact prompt


@dataclass(frozen=True)
class TaskSpec:
    """The shape of every item: ``num_bindings`` K, ``repeats`` R, ``filler_tokens`` in all, ``gap`` (filler
    tokens right before the query; None: like any other stretch), ``variant``, ``template``, ``values``, ``keys``
    (names of ``TEMPLATES`` / ``VALUE_WORDS`` / ``KEY_WORDS``, or a user's ``Template`` / ``Vocabulary``: see
    ``load_template`` and ``load_vocabulary``)."""

    num_bindings: int = 4
    repeats: int = 3
    filler_tokens: int = 512
    gap: int | None = None
    variant: str = "retrieval"
    template: str | Template = "code"
    values: str | Vocabulary = "colors"
    keys: str | Vocabulary = "names"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}; got {self.variant!r}")
        for name in ("template", "values", "keys"):
            check_choice(name, getattr(self, name))
        if self.variant == "latest" and self.repeats < 2:
            raise ValueError("rule 'latest value': the latest-value variant needs repeats >= 2 (an old value first)")
        if self.num_bindings < 1 or self.repeats < 1:
            raise ValueError(f"num_bindings and repeats must be >= 1; got {self.num_bindings}, {self.repeats}")
        if self.gap is not None and not 0 <= self.gap <= self.filler_tokens:
            raise ValueError(f"gap must be in [0, filler_tokens = {self.filler_tokens}]; got {self.gap}")


@dataclass
class Query:
    """One binding asked at the end: ``tokens`` (the query suffix), ``candidates`` (4 value ids), ``answer`` and
    ``donor_answer`` (indices into candidates; equal to ``answer`` for a non-target binding and for the target of
    a neutral item, whose donor has no value for it)."""

    binding: int
    tokens: list[int]
    candidates: list[int]
    answer: int
    donor_answer: int


@dataclass
class Item:
    """One source passage's prompt pair. ``recipient`` / ``donor`` are the prefixes (facts and filler, same
    length); ``queries[target]`` asks the edited binding. ``target_writes``: ``(start, end)`` token spans of each
    presentation of the target fact in the prefix (the value token is ``end − 2`` or earlier). ``no_fact``: the
    recipient with every presentation of the target binding replaced by filler of the same length (the prompt of
    the no-fact control: what the text alone suggests as the target's value; empty when not built)."""

    source_id: str
    recipient: list[int]
    donor: list[int]
    queries: list[Query]
    target: int
    target_writes: list[tuple[int, int]]
    value_positions: list[int]
    split: str = "dev"
    extra: dict = field(default_factory=dict)
    no_fact: list[int] = field(default_factory=list)

    def prompt(self, binding: int | None = None, donor: bool = False, no_fact: bool = False) -> list[int]:
        """The full prompt: prefix (the recipient's, the donor's, or with ``no_fact`` the no-fact control's) + the
        query of ``binding`` (default: the target)."""
        if donor and no_fact:
            raise ValueError("a prompt has one prefix: the donor's or the no-fact control's, not both")
        query = self.queries[self.target if binding is None else binding]
        return (self.no_fact if no_fact else self.donor if donor else self.recipient) + query.tokens

    @property
    def boundary(self) -> int:
        """The first query token: states at this point are the "pre-query" states."""
        return len(self.recipient)

    def writes_widened(self, tokens_after: int) -> Item:
        """This item with each of its ``target_writes`` spans extended over the ``tokens_after`` tokens after it
        (never into the query): the write edits then also reach writes that short convolutions make from the
        fact's tokens just after them."""
        if tokens_after < 0:
            raise ValueError(f"tokens_after must be >= 0; got {tokens_after}")
        return replace(self, target_writes=[(start, min(end + tokens_after, self.boundary))
                                            for start, end in self.target_writes])


def passages(documents: Iterable[Document], tokenizer: PreTrainedTokenizerFast, min_tokens: int,
             confirm_fraction: float = 0.5) -> list[tuple[str, str, list[int]]]:
    """``(source_id, split, token ids)`` for each document with at least ``min_tokens`` tokens; ``split`` is
    ``"dev"`` or ``"confirm"`` by a hash of the source id, so the two sets never share a document."""
    out = []
    for doc in documents:
        ids = tokenizer.encode(" " + " ".join(doc.text.split()), add_special_tokens=False)
        if len(ids) >= min_tokens:
            split = "confirm" if unit_hash(doc.source_id, SPLIT_SALT) < confirm_fraction else "dev"
            out.append((doc.source_id, split, ids))
    return out


class TaskBuilder:
    """Builds ``Item``s for one tokenizer and ``TaskSpec`` (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, spec: TaskSpec = TaskSpec()):
        self.spec = spec
        self.keys = vocabulary_tokens(tokenizer, spec.keys, "keys", spec.num_bindings)
        self.values = vocabulary_tokens(tokenizer, spec.values, "values", 5 if spec.variant == "latest" else 4)
        self.before, self.middle, self.after = template_tokens(tokenizer, spec.template)

    def fact(self, key: int, value: int) -> list[int]:
        return self.before + [key] + self.middle + [value] + self.after

    def query(self, key: int) -> list[int]:
        return self.before + [key] + self.middle

    def build(self, source_id: str, filler: Sequence[int], rng: np.random.Generator, split: str = "dev",
              target: int | None = None) -> Item:
        """One item from ``filler`` (the passage's token ids; ``ValueError`` if shorter than ``filler_tokens``).
        The recipient prefix depends on ``rng`` only, not on ``target``: items drawn with the same ``rng`` state
        and different targets share it."""
        spec = self.spec
        if len(filler) < spec.filler_tokens:
            raise ValueError(f"rule 'filler length': passage {source_id} has {len(filler)} tokens; the task needs "
                             f"filler_tokens = {spec.filler_tokens}")
        start = int(rng.integers(0, len(filler) - spec.filler_tokens + 1))
        filler = list(filler[start:start + spec.filler_tokens])
        keys = [int(k) for k in rng.choice(self.keys, spec.num_bindings, replace=False)]
        values = [int(v) for v in rng.choice(self.values, spec.num_bindings, replace=True)]
        events = [(b, "fact") for b in range(spec.num_bindings) for _ in range(spec.repeats)]
        order = [events[i] for i in rng.permutation(len(events))]
        draw = np.random.default_rng(rng.integers(2**63))
        target = int(draw.integers(spec.num_bindings)) if target is None else target
        donor_value = int(draw.choice([v for v in self.values if v != values[target]]))
        old_value = None
        if spec.variant == "latest":  # the target's first presentations carry an old value, the last the answer
            old_value = int(draw.choice([v for v in self.values if v not in (values[target], donor_value)]))
        # the no-fact filler has a generator of its own, so that building it leaves every other draw as it was
        own = np.random.default_rng(int(unit_hash(f"{source_id}:{start}:{keys}:{target}", NO_FACT_SALT) * 2**63))
        return self._assemble(source_id, split, filler, keys, values, target, donor_value, old_value, order, draw,
                              own)

    def _stretches(self, filler: list[int], slots: int) -> list[list[int]]:
        """The filler cut into ``slots`` stretches before the facts and a last one before the query: the ``gap``
        last tokens, or with ``gap=None`` a stretch of the same share as the others."""
        gap = self.spec.gap
        if gap is None:
            cuts = np.linspace(0, len(filler), slots + 2).round().astype(int)
            return [filler[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        body = filler[: len(filler) - gap]
        cuts = np.linspace(0, len(body), slots + 1).round().astype(int)
        return [body[a:b] for a, b in zip(cuts[:-1], cuts[1:])] + [filler[len(filler) - gap:]]

    def _assemble(self, source_id, split, filler, keys, values, target, donor_value, old_value, order, rng,
                  no_fact_rng) -> Item:
        stretches = self._stretches(filler, len(order))
        recipient, donor, no_fact, writes, value_positions = [], [], [], [], []
        last_target = max(i for i, (b, _) in enumerate(order) if b == target)
        for i, (stretch, (b, _)) in enumerate(zip(stretches, order)):
            recipient, donor, no_fact = recipient + stretch, donor + stretch, no_fact + stretch
            value, donor_fact_value = values[b], values[b]
            if b == target:
                old = old_value is not None and i != last_target  # latest-value: only the last one is the answer
                value = old_value if old else values[b]
                donor_fact_value = value if old else donor_value
            start = len(recipient)
            recipient += self.fact(keys[b], value)
            no_fact += (self._filler_stretch(filler, len(recipient) - start, no_fact_rng) if b == target
                        else recipient[start:])
            if b == target and self.spec.variant == "neutral":
                donor += self._neutral(filler, len(recipient) - start, rng)
            else:
                donor += self.fact(keys[b], donor_fact_value)
            if b == target and value != old_value:
                writes.append((start, len(recipient)))
                value_positions.append(start + len(self.before) + 1 + len(self.middle))
        recipient, donor, no_fact = recipient + stretches[-1], donor + stretches[-1], no_fact + stretches[-1]
        queries = [self._query(b, keys, values, b == target and self.spec.variant != "neutral", donor_value,
                               old_value if b == target else None, rng) for b in range(len(keys))]
        return Item(source_id, recipient, donor, queries, target, writes, value_positions, split, no_fact=no_fact)

    def _neutral(self, filler: list[int], length: int, rng) -> list[int]:
        start = int(rng.integers(0, len(filler) - length + 1))
        return filler[start:start + length]

    @staticmethod
    def _filler_stretch(filler: list[int], length: int, rng: np.random.Generator) -> list[int]:
        """``length`` tokens of ``filler`` from a random start, read on from its beginning past its end (a fact
        may be longer than a short filler)."""
        start = int(rng.integers(len(filler)))
        return [filler[(start + i) % len(filler)] for i in range(length)]

    def _query(self, b, keys, values, is_donor_target, donor_value, old_value, rng) -> Query:
        """The 4 balanced candidates: the answer, the donor value (target) or a random value, and others; the
        latest-value variant always includes the old value."""
        answer = values[b]
        chosen = [answer] + ([donor_value] if is_donor_target else []) + ([] if old_value is None else [old_value])
        rest = [v for v in self.values if v not in chosen]
        chosen += [int(v) for v in rng.choice(rest, 4 - len(chosen), replace=False)]
        order = rng.permutation(4)
        candidates = [chosen[i] for i in order]
        answer_index = candidates.index(answer)
        donor_index = candidates.index(donor_value) if is_donor_target else answer_index
        return Query(b, self.query(keys[b]), candidates, answer_index, donor_index)


def build_items(builder: TaskBuilder, sources: Sequence[tuple[str, str, list[int]]], per_source: int = 1,
                seed: int = 0, split: str | None = None) -> list[Item]:
    """``per_source`` items from each passage (``passages()`` output) of ``split`` (None: every split), seeded by
    ``seed`` and the passage's position."""
    items = []
    for index, (source_id, source_split, ids) in enumerate(sources):
        if split is not None and source_split != split:
            continue
        rng = np.random.default_rng([seed, index])
        items += [builder.build(source_id, ids, rng, source_split) for _ in range(per_source)]
    return items
