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
vocabularies (by name, or a user's ``Template`` / ``Vocabulary``: ``load_template``, ``load_vocabulary``); ``gap``
fixes the filler between the last fact and the query; ``num_bindings`` the load. ``HELD_OUT`` names the templates
and vocabularies no training configuration uses.

``KeyValueFiller`` (the ``kv-filler`` recall generator) puts facts of the same shape into training sequences. There
only, ``template`` / ``keys`` / ``values`` may be ``GENERATED``: every sample draws its own wording and words from
the training text's frequent single-token words, none of them a ``HELD_OUT`` token, so that a model learns to bind
and copy in any format rather than in a few memorised ones; the template may also be ``TEXT``, cut from a stretch
of the training text for every sample.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from linmem.data.shards import TokenShards
from linmem.data.sources import Document
from linmem.data.splits import unit_hash
from linmem.data.synthetic import FILLER_TOKENS, RecallSample, register_generator
from linmem.data.tokenizer import load_tokenizer

KEY_WORDS = {
    "names": "Alice Bob Carol David Emma Frank Grace Henry Jack Kate Laura Mark Nancy Oliver Paul Peter Rachel "
             "Sarah Thomas Victor Anna John James Mary Robert Linda Michael Susan William Lucy George Edward Helen "
             "Charles Richard Martin Simon Arthur Harry Alice Philip Henry Hugh Walter Roger Ralph",
    "letters": "A B C D E F G H J K L M N P Q R S T U V W X Y Z",
    "objects": "door house table chair book letter ring sword crown horse ship tree river field stone bell cup "
               "gate wall bed coat hat key lamp rose glass bread wine tower garden window mountain paper box fire",
    "roles": "king queen lord lady duke knight soldier captain judge priest servant master father mother brother "
             "sister son daughter friend prince bishop merchant",
}
VALUE_WORDS = {
    "colors": "red blue green yellow black white brown pink purple orange gray gold silver",
    "cities": "Paris London Rome Berlin Madrid Vienna Athens Dublin Lisbon Prague Oslo Cairo Tokyo Boston York",
    "animals": "cat dog horse cow lion bear wolf fox deer bird fish sheep goat mouse eagle",
    "numbers": "one two three four five six seven eight nine ten eleven twelve twenty hundred",
    "shapes": "circle square line cross star ring box ball point cube",
    "directions": "north south east west up down left right inside outside",
    "materials": "iron wood bread wine water stone paper glass salt steel copper cotton wool",
}
# (fact before key, between key and value, after value); the query is the fact cut after the middle piece
TEMPLATES = {
    "code": (" The code of", " is", "."),
    "lives": (" Remember that", " lives in", "."),
    "colon": (" Note,", ":", ";"),
    "likes": (" We know that", " likes the", " one."),
    "went": (" Later that day the", " went", " again."),
    "keeps": (" It is said that the", " keeps the", " safe."),
}
# Templates and vocabularies no training configuration uses (the zoo trained on "code", "names", "colors"): a
# model's recall on them measures memory of facts in a format it never saw (tests/test_memory_analyses.py checks
# configs/ against this list).
HELD_OUT = {"template": ("went", "keeps"), "keys": ("roles",), "values": ("directions", "materials")}
VARIANTS = ("retrieval", "latest", "neutral")
SPLIT_SALT = "linmem-memory-lab"
NO_FACT_SALT = "linmem-no-fact"  # seeds the filler that replaces the target fact in an item's no-fact prompt
# ``template`` / ``keys`` / ``values`` of the training generator ``kv-filler`` only: a fresh template or vocabulary
# for every sample, drawn from frequent words of the training text (``KeyValueFiller``). The lab and the eval
# measure recall in one fixed format, so they refuse it.
GENERATED = "generated"
TEXT = "text"  # template only: every training sample cuts its wording from a stretch of the training text
FORMAT_PARTS = ("template", "keys", "values")


@dataclass(frozen=True)
class Template:
    """A fact's wording: ``before`` key ``middle`` value ``after``; the query is the fact cut after ``middle``.
    ``name`` labels it in results (a file's path for a user's own)."""

    name: str
    before: str
    middle: str
    after: str

    def __post_init__(self) -> None:
        if not self.middle.strip():
            raise ValueError(f"rule 'query template': template {self.name!r} needs text between {{key}} and "
                             f"{{value}} (the query ends there); got {self.middle!r}")

    @property
    def pieces(self) -> tuple[str, str, str]:
        return self.before, self.middle, self.after

    @classmethod
    def parse(cls, text: str, name: str) -> Template:
        """A template from one line holding ``{key}`` then ``{value}`` once each, e.g. ``"The code of {key} is
        {value}."``. Keys and values are tokenized with a leading space, so the space before a placeholder is
        theirs; the fact starts with a space, as in ``TEMPLATES``."""
        line = " ".join(text.split())
        if line.count("{key}") != 1 or line.count("{value}") != 1 or line.index("{key}") > line.index("{value}"):
            raise ValueError(f"template {name!r} must hold {{key}} and then {{value}}, once each; got {text!r}")
        before, rest = line.split("{key}")
        middle, after = rest.split("{value}")
        return cls(name, " " + before.strip() if before.strip() else "", middle.rstrip(), after.rstrip())


@dataclass(frozen=True)
class Vocabulary:
    """Words for the keys or the values of a task (each must tokenize to one token, after a leading space)."""

    name: str
    words: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", tuple(self.words))
        if not self.words:
            raise ValueError(f"vocabulary {self.name!r} holds no words")


def _read_lines(path: Path) -> list[str]:
    """The lines of a user's file, stripped, without blank lines and ``#`` comments."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def refuse_generated(part: str, value: object) -> None:
    """``ValueError`` when ``value`` is ``GENERATED``: a per-sample format exists only in training data, so a task
    that measures recall (the lab, the eval) cannot take it for ``part`` (``template``, ``keys`` or ``values``)."""
    if isinstance(value, str) and (value == GENERATED or (part == "template" and value == TEXT)):
        raise ValueError(f"{part} {value!r} is a training-only choice (the kv-filler recall generator draws a "
                         f"fresh {part} for every sample); measuring recall needs one fixed {part}: a name of "
                         f"{sorted(_choices(part))} or a file")


def _choices(part: str) -> dict[str, Any]:
    return TEMPLATES if part == "template" else _vocabularies(part)


def load_template(value: str | Template) -> str | Template:
    """``--template NAME|FILE|TEXT``: a name of ``TEMPLATES`` (kept as the name), a text file whose first line is
    the template (see ``Template.parse``), or the template text itself (holding ``{key}`` and ``{value}``)."""
    refuse_generated("template", value)
    if isinstance(value, Template) or value in TEMPLATES:
        return value
    path = Path(value)
    if path.is_file():
        lines = _read_lines(path)
        if not lines:
            raise ValueError(f"template file {value!r} holds no template line")
        return Template.parse(lines[0], str(path))
    if "{key}" in value:
        return Template.parse(value, value)
    raise ValueError(f"template must be one of {sorted(TEMPLATES)}, a file or a text with {{key}} and {{value}}; "
                     f"got {value!r}")


def load_vocabulary(value: str | Vocabulary, kind: str) -> str | Vocabulary:
    """``--keys`` / ``--values NAME|FILE``: a name of ``KEY_WORDS`` / ``VALUE_WORDS`` (kept as the name) or a text
    file of words, one or more a line (blank lines and ``#`` comments skipped). ``kind``: ``"keys"`` or
    ``"values"``."""
    table = _vocabularies(kind)
    refuse_generated(kind, value)
    if isinstance(value, Vocabulary) or value in table:
        return value
    path = Path(value)
    if path.is_file():
        return Vocabulary(str(path), tuple(w for line in _read_lines(path) for w in line.split()))
    raise ValueError(f"{kind} must be one of {sorted(table)} or a word-list file; got {value!r}")


def _vocabularies(kind: str) -> dict[str, str]:
    if kind not in ("keys", "values"):
        raise ValueError(f"kind must be 'keys' or 'values'; got {kind!r}")
    return KEY_WORDS if kind == "keys" else VALUE_WORDS


def template_pieces(template: str | Template) -> tuple[str, str, str]:
    """``(before, middle, after)`` of a template name or ``Template``."""
    return template.pieces if isinstance(template, Template) else TEMPLATES[template]


def vocabulary_words(vocabulary: str | Vocabulary, kind: str) -> list[str]:
    """The words of a vocabulary name (of ``kind`` ``"keys"`` or ``"values"``) or ``Vocabulary``."""
    return list(vocabulary.words) if isinstance(vocabulary, Vocabulary) else _vocabularies(kind)[vocabulary].split()


def label(choice: str | Template | Vocabulary) -> str:
    """A template's or vocabulary's name for results."""
    return choice if isinstance(choice, str) else choice.name


class Tokenize:
    """``text -> list[int]`` for a ``tokenizers.Tokenizer`` or a transformers tokenizer (no special tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ``ids`` (special tokens dropped)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def single_tokens(tokenize: Tokenize, words: Iterable[str], rule: str, need: int, name: str = "") -> list[int]:
    """The ids of the distinct words (with a leading space) that are one token; ``ValueError`` naming ``rule``
    (and the vocabulary ``name``) when fewer than ``need``."""
    ids, seen = [], set()
    for word in words:
        pieces = tokenize(" " + word)
        if len(pieces) == 1 and pieces[0] not in seen:
            ids.append(pieces[0])
            seen.add(pieces[0])
    if len(ids) < need:
        of = f" of vocabulary {name!r}" if name else ""
        raise ValueError(f"rule '{rule}': only {len(ids)} distinct words{of} are a single token with this tokenizer "
                         f"(need {need}); choose another vocabulary or a tokenizer with whole-word tokens")
    return ids


def check_choice(part: str, value: object) -> None:
    """``ValueError`` naming ``part`` unless ``value`` is a name of its table (``TEMPLATES``, ``KEY_WORDS`` or
    ``VALUE_WORDS``) or a ``Template`` / ``Vocabulary``; ``GENERATED`` is refused (``refuse_generated``)."""
    refuse_generated(part, value)
    kind = Template if part == "template" else Vocabulary
    if not isinstance(value, kind) and value not in _choices(part):
        raise ValueError(f"{part} must be one of {sorted(_choices(part))} or a {kind.__name__}; got {value!r}")


def template_tokens(tokenize: Tokenize, template: str | Template) -> tuple[list[int], list[int], list[int]]:
    """The token ids of ``template``'s ``(before, middle, after)``; ``ValueError`` if ``middle`` is empty."""
    before, middle, after = (tokenize(p) for p in template_pieces(template))
    if not middle:
        raise ValueError(f"rule 'query template': template {label(template)!r} tokenizes to nothing")
    return before, middle, after


def vocabulary_tokens(tokenize: Tokenize, vocabulary: str | Vocabulary, kind: str, need: int) -> list[int]:
    """The single-token ids of ``vocabulary``'s words (``kind``: ``"keys"`` or ``"values"``), at least ``need``."""
    return single_tokens(tokenize, vocabulary_words(vocabulary, kind), f"single-token {kind}", need,
                         label(vocabulary))


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


def passages(documents: Iterable[Document], tokenize: Tokenize, min_tokens: int,
             confirm_fraction: float = 0.5) -> list[tuple[str, str, list[int]]]:
    """``(source_id, split, token ids)`` for each document with at least ``min_tokens`` tokens; ``split`` is
    ``"dev"`` or ``"confirm"`` by a hash of the source id, so the two sets never share a document."""
    out = []
    for doc in documents:
        ids = tokenize(" " + " ".join(doc.text.split()))
        if len(ids) >= min_tokens:
            split = "confirm" if unit_hash(doc.source_id, SPLIT_SALT) < confirm_fraction else "dev"
            out.append((doc.source_id, split, ids))
    return out


class TaskBuilder:
    """Builds ``Item``s for one tokenizer and ``TaskSpec`` (see the module docstring)."""

    def __init__(self, tokenizer, spec: TaskSpec = TaskSpec()):
        self.spec, self.tokenize = spec, Tokenize(tokenizer)
        self.keys = vocabulary_tokens(self.tokenize, spec.keys, "keys", spec.num_bindings)
        self.values = vocabulary_tokens(self.tokenize, spec.values, "values", 5 if spec.variant == "latest" else 4)
        self.before, self.middle, self.after = template_tokens(self.tokenize, spec.template)

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


KV_FILLER_DEFAULTS = {"template": "code", "values": "colors", "keys": "names", "num_bindings": 4, "repeats": 2}
# A generated template's words (fewest, most): before the key, between key and value, after the value; one mark of
# PUNCTUATION closes the fact. A training query repeats the whole fact with its value under the loss mask.
GENERATED_WORDS = {"before": (1, 4), "middle": (1, 2), "after": (0, 2)}
GENERATED_TEMPLATE_MOST = sum(most for _, most in GENERATED_WORDS.values())  # the longest template's words
PUNCTUATION = (".", ",", ";", ":", "!", "?")
WORD_POOL = 1000  # how many of the training text's most frequent single-token words generated formats draw from
# ``word_pool: ids``: generated parts draw from every token id instead (``format_ids``), subword pieces, marks and
# digits included, so that a model copies whatever token a fact holds rather than the text's frequent words only.
EVERY_ID = "ids"
WHOLE_WORD_SHARE = 0.9  # a pool word ends a word in the training text at least this share of its occurrences


def text_template_starts(filler: np.ndarray, word_starts: np.ndarray, word_continues: np.ndarray,
                        held_out_pieces: Sequence[Sequence[int]]) -> dict[tuple[int, int, int], np.ndarray]:
    """Per template shape ``(a, b, c)`` (tokens before the key, between key and value, after the value less one;
    ``GENERATED_WORDS``), the positions of ``filler`` where a stretch of that shape can be cut: both slots hold a
    word (``word_starts``) that the next token does not continue (``word_continues``), and no token of the
    stretch lies in an occurrence of a held-out template's piece."""
    covered = np.zeros(len(filler) + 1, dtype=np.int64)
    for piece in held_out_pieces:
        if 0 < len(piece) <= len(filler):
            windows = np.lib.stride_tricks.sliding_window_view(filler, len(piece))
            for start in np.flatnonzero((windows == np.asarray(piece)).all(axis=1)):
                covered[start:start + len(piece)] = 1
    covered_before = np.concatenate([[0], np.cumsum(covered[:-1])])  # covered tokens before each position
    slot = np.zeros(len(filler), dtype=bool)
    slot[:-1] = word_starts[filler[:-1]] & ~word_continues[filler[1:]]
    starts = {}
    (a_low, a_high), (b_low, b_high), (c_low, c_high) = GENERATED_WORDS.values()
    for a in range(a_low, a_high + 1):
        for b in range(b_low, b_high + 1):
            for c in range(c_low, c_high + 1):
                size = a + b + c + 3
                p = np.arange(max(0, len(filler) - size + 1))
                ok = slot[p + a] & slot[p + a + 1 + b] & (covered_before[p + size] == covered_before[p])
                starts[(a, b, c)] = np.flatnonzero(ok)
    return starts


def held_out_template_pieces() -> list[str]:
    """The pieces (before, middle, after) of every ``HELD_OUT`` template."""
    return [piece for name in HELD_OUT["template"] for piece in TEMPLATES[name]]


def word_continuations(tokenize: Tokenize, size: int) -> np.ndarray:
    """``[size]`` bool per token id: its text begins with a letter or a digit, so it continues the word before it."""
    return np.asarray([tokenize.decode([i])[:1].isalnum() for i in range(size)])


def text_template_parts(tokenize: Tokenize, size: int) -> dict[str, Any]:
    """``KeyValueFiller``'s text-template options for token ids below ``size``: the held-out templates' pieces as
    token runs, and per id whether it begins a word (a space and a letter) and whether it continues one."""
    return dict(text_template=True, held_out_pieces=[tokenize(piece) for piece in held_out_template_pieces()],
                word_starts=np.asarray([text[:1] == " " and text[1:2].isalpha()
                                        for text in (tokenize.decode([i]) for i in range(size))]),
                word_continues=word_continuations(tokenize, size))


def held_out_tokens(tokenize: Tokenize) -> tuple[set[int], set[str]]:
    """The token ids of every ``HELD_OUT`` template piece and vocabulary word (after a space), and the lower-case
    words they spell (with each such token's own text), so that training can leave out every case of them."""
    texts = held_out_template_pieces()
    texts += [" " + word for kind in ("keys", "values") for name in HELD_OUT[kind]
              for word in vocabulary_words(name, kind)]
    ids = {i for text in texts for i in tokenize(text)}
    words = {word.lower() for text in texts for word in re.findall(r"[A-Za-z]+", text)}
    words |= {tokenize.decode([i]).strip().lower() for i in ids}
    return ids, words


def word_endings(tokenize: Tokenize, stream: np.ndarray) -> np.ndarray:
    """Per token id, the share of its occurrences in ``stream`` (all but the last) that end a word: the next token
    does not continue it with a letter or a digit. ``[max id + 1]``, NaN for ids that do not occur."""
    continues = word_continuations(tokenize, int(stream.max()) + 1)
    current, following = stream[:-1], stream[1:]
    seen = np.bincount(current, minlength=len(continues)).astype(np.float64)
    ended = np.bincount(current, weights=~continues[following], minlength=len(continues))
    with np.errstate(invalid="ignore", divide="ignore"):
        return ended / seen


def format_words(tokenize: Tokenize, filler: Sequence[int], size: int = WORD_POOL) -> list[int]:
    """The ``size`` most frequent tokens of ``filler`` (ties: the lower id first) that are one whole alphabetic
    ASCII word after a space (`` the``, `` King``), encode back to that one token and end a word in ``filler`` at
    least ``WHOLE_WORD_SHARE`` of the times they occur (so that a word's first piece, `` mon`` of `` money``, is
    not taken for a word), leaving out every token and word of ``HELD_OUT`` in any case (``held_out_tokens``): the
    words generated formats draw from."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"word_pool must be an integer >= 1 (words generated formats draw from) or {EVERY_ID!r} "
                         f"(every token id); got {size!r}")
    banned_ids, banned_words = held_out_tokens(tokenize)
    stream = np.asarray(filler, dtype=np.int64)
    counts = np.bincount(stream)
    ends = word_endings(tokenize, stream)
    words: list[int] = []
    for token in (int(t) for t in np.argsort(-counts, kind="stable")):
        if counts[token] == 0 or len(words) == size:
            break
        text = tokenize.decode([token])
        word = text[1:]
        if (token in banned_ids or not text.startswith(" ") or not (word.isascii() and word.isalpha())
                or word.lower() in banned_words or not ends[token] >= WHOLE_WORD_SHARE or tokenize(text) != [token]):
            continue
        words.append(token)
    return words


def format_ids(tokenize: Tokenize, vocab_size: int, exclude: Sequence[int] = ()) -> list[int]:
    """Every token id below ``vocab_size`` but ``exclude`` (the end-of-text token, say) and ``HELD_OUT``'s: the ids
    of its pieces and words, and any token that spells a held-out word in another case or spacing (`` North``,
    ``north``): the pool of ``word_pool: ids``."""
    banned_ids, banned_words = held_out_tokens(tokenize)
    banned_ids |= {int(t) for t in exclude}
    return [i for i in range(vocab_size)
            if i not in banned_ids and tokenize.decode([i]).strip().lower() not in banned_words]


def punctuation_tokens(tokenize: Tokenize) -> list[int]:
    """The ids of the marks of ``PUNCTUATION`` that are one token and no token of ``HELD_OUT`` (its templates end
    in ``"."``, so generated facts do not)."""
    banned, _ = held_out_tokens(tokenize)
    marks = [tokenize(mark) for mark in PUNCTUATION]
    return list(dict.fromkeys(ids[0] for ids in marks if len(ids) == 1 and ids[0] not in banned))


def check_count(option: str, value: object) -> None:
    """``ValueError`` naming ``option`` unless ``value`` is an integer >= 1."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{option} must be an integer >= 1; got {value!r}")


@dataclass
class KeyValueFiller:
    """Recall generator for training (``linmem.data.synthetic``): key-value facts in natural filler, then queries
    with their answers under the loss mask. Built from token ids only: ``filler`` (a token stream), ``keys`` and
    ``values`` (single-token ids), the template pieces ``before``, ``middle``, ``after``.

    A sample of ``seq_len`` tokens: facts of ``n`` keys (``n`` uniform in 1..``num_bindings``, each fact ``repeats``
    times, shuffled) between filler stretches, then every key asked once (the whole fact again, its value the
    answer in the mask); the rest filler. Keys are distinct within a sample; values are drawn with replacement.

    ``generated`` names the parts (of ``"template"``, ``"keys"``, ``"values"``) that every sample draws afresh from
    ``words`` (single-token word ids, see ``format_words``), all distinct within the sample and none of them a token
    of the fixed parts or of ``punctuation``: a template of 1-4 words before the key, 1-2 between key and value, 0-2
    after the value and one mark of ``punctuation`` (``GENERATED_WORDS``); ``n`` keys; ``n`` values (distinct, so
    no key is also a value). A model trained so cannot rely on a wording or a vocabulary it has seen before.

    ``text_template`` (with generated keys and values): every sample cuts its template from a stretch of ``filler``
    instead (``_text_template``), so facts read like the text around them; ``held_out_pieces`` (token runs no
    template may hold), ``word_starts`` and ``word_continues`` (per token id) say which stretches may be cut.
    """

    filler: np.ndarray
    keys: Sequence[int] = ()
    values: Sequence[int] = ()
    before: Sequence[int] = ()
    middle: Sequence[int] = ()
    after: Sequence[int] = ()
    num_bindings: int = 4
    repeats: int = 2
    generated: Sequence[str] = ()
    words: Sequence[int] = ()
    punctuation: Sequence[int] = ()
    name: ClassVar[str] = "kv-filler"
    text_template: bool = False
    held_out_pieces: Sequence[Sequence[int]] = ()
    word_starts: Sequence[bool] = ()  # per token id: a space and a letter begin it (a slot for a key or value)
    word_continues: Sequence[bool] = ()  # per token id: a letter or digit begins it (it continues a word)
    free_words: np.ndarray = field(init=False, repr=False)  # ``words`` less the fixed parts' tokens
    text_starts: dict = field(init=False, repr=False)  # text templates: ``text_template_starts``

    def __post_init__(self) -> None:
        for option in ("num_bindings", "repeats"):
            check_count(option, getattr(self, option))
        self.generated = tuple(self.generated)
        if not set(self.generated) <= set(FORMAT_PARTS) or len(set(self.generated)) != len(self.generated):
            raise ValueError(f"generated must hold distinct parts of {FORMAT_PARTS}; got {list(self.generated)}")
        for part, ids in (("keys", self.keys), ("values", self.values)):
            if part not in self.generated and len(ids) == 0:
                raise ValueError(f"{part}: a fixed {part} needs its token ids (or name {part!r} in generated)")
        if self.text_template:
            if ("template" in self.generated or self.before or self.middle or self.after
                    or not {"keys", "values"} <= set(self.generated)):
                raise ValueError("text_template: the template comes from the filler (give no template parts) and "
                                 "the keys and values are generated (so none of them is a word of the template)")
            if min(len(self.word_starts), len(self.word_continues)) <= int(self.filler.max()):
                raise ValueError("text_template: word_starts and word_continues must cover every token id of the "
                                 "filler")
            self.text_starts = text_template_starts(self.filler, np.asarray(self.word_starts, dtype=bool),
                                                     np.asarray(self.word_continues, dtype=bool),
                                                     self.held_out_pieces)
            scarce = [shape for shape, starts in self.text_starts.items() if len(starts) == 0]
            if scarce:
                raise ValueError(f"rule 'text template': the filler holds no stretch of {len(scarce)} template "
                                 f"shapes (tokens before, between, after: {scarce[0]}, ...) with words in both "
                                 f"slots and no piece of a held-out template")
        if "template" in self.generated and len(self.punctuation) == 0:
            raise ValueError("rule 'generated template': punctuation holds no token id (a generated fact ends in one)")
        fixed = {int(t) for t in self.punctuation}
        for part, ids in (("template", [*self.before, *self.middle, *self.after]), ("keys", self.keys),
                          ("values", self.values)):
            if part not in self.generated:
                fixed |= {int(t) for t in ids}
        self.free_words = np.asarray([w for w in dict.fromkeys(int(w) for w in self.words) if w not in fixed],
                                     dtype=np.int64)
        need = self._drawn_words(int(self.num_bindings))
        if self.generated and len(self.free_words) < need:
            raise ValueError(f"rule 'generated formats': {self.num_bindings} bindings with a generated "
                             f"{', '.join(self.generated)} need {need} distinct words; the word pool holds "
                             f"{len(self.free_words)} besides the fixed parts' tokens (raise word_pool or lower "
                             f"num_bindings)")

    @classmethod
    def from_builder(cls, builder: TaskBuilder, filler: Sequence[int], **options) -> KeyValueFiller:
        return cls(np.asarray(filler, dtype=np.int64), builder.keys, builder.values, builder.before,
                   builder.middle, builder.after, **options)

    def _drawn_words(self, n: int) -> int:
        """The most words one sample of ``n`` bindings draws from ``free_words``."""
        template = GENERATED_TEMPLATE_MOST if "template" in self.generated else 0
        return template + n * (("keys" in self.generated) + ("values" in self.generated))

    def longest(self) -> int:
        """The most tokens the facts and queries of one sample take (``num_bindings`` facts, the longest template):
        a ``seq_len`` below it can fail on some sample."""
        if "template" in self.generated or self.text_template:
            fact = GENERATED_TEMPLATE_MOST + 3  # + key, value and a punctuation mark (or a third token after)
        else:
            fact = len(self.before) + len(self.middle) + len(self.after) + 2
        return int(self.num_bindings) * (int(self.repeats) + 1) * fact  # a query is the whole fact again

    def _format(self, rng: np.random.Generator, n: int) -> tuple[list[int], list[int], list[int], list[int],
                                                                   list[int]]:
        """``(before, middle, after, keys [n], values [n])`` of one sample: the fixed parts, and fresh draws for the
        generated ones (with nothing generated, the draws of the fixed keys and values only)."""
        free = self.free_words
        if self.text_template:
            before, middle, after = self._text_template(rng)
            free = free[~np.isin(free, before + middle + after)]
        sizes = ([int(rng.integers(low, high + 1)) for low, high in GENERATED_WORDS.values()]
                 if "template" in self.generated else [])
        count = sum(sizes) + n * (("keys" in self.generated) + ("values" in self.generated))
        drawn = [int(w) for w in rng.choice(free, count, replace=False)] if count else []
        if sizes:
            a, b, c = sizes
            before, middle = drawn[:a], drawn[a:a + b]
            after = drawn[a + b:a + b + c] + [int(rng.choice(np.asarray(self.punctuation)))]
            drawn = drawn[a + b + c:]
        elif not self.text_template:
            before, middle, after = list(self.before), list(self.middle), list(self.after)
        if "keys" in self.generated:
            keys, drawn = drawn[:n], drawn[n:]
        else:
            keys = [int(k) for k in rng.choice(np.asarray(self.keys), n, replace=False)]
        if "values" in self.generated:
            values = drawn[:n]
        else:
            values = [int(v) for v in rng.choice(np.asarray(self.values), n, replace=True)]
        return before, middle, after, keys, values

    def _text_template(self, rng: np.random.Generator) -> tuple[list[int], list[int], list[int]]:
        """``(before, middle, after)`` cut from a stretch of ``filler``: 1-4 tokens, the key's slot, 1-2 tokens, the
        value's slot, 1-3 tokens (the slots' own tokens are dropped), drawn among the stretches
        ``text_template_starts`` allows: a key or value never splits a word of the text, and no held-out template
        is ever trained on."""
        a, b, c = (int(rng.integers(low, high + 1)) for low, high in GENERATED_WORDS.values())
        candidates = self.text_starts[(a, b, c)]
        start = int(candidates[rng.integers(len(candidates))])
        span = [int(t) for t in self.filler[start:start + a + b + c + 3]]
        return span[:a], span[a + 1:a + 1 + b], span[a + 2 + b:]

    def sample(self, rng: np.random.Generator, seq_len: int) -> RecallSample:
        n = int(rng.integers(1, self.num_bindings + 1))
        before, middle, after, keys, values = self._format(rng, n)
        fact = lambda k, v: [*before, k, *middle, v, *after]  # noqa: E731
        facts = [fact(keys[b], values[b]) for b in rng.permutation(np.repeat(np.arange(n), self.repeats))]
        queries = [fact(keys[b], values[b]) for b in rng.permutation(n)]
        used = sum(map(len, facts)) + sum(map(len, queries))
        if used > seq_len:
            raise ValueError(f"rule 'sequence length': {n} bindings need {used} tokens; seq_len is {seq_len}")
        start = int(rng.integers(0, max(1, len(self.filler) - (seq_len - used))))
        filler = list(self.filler[start:start + seq_len - used])
        filler += [int(x) for x in rng.choice(self.filler, seq_len - used - len(filler))]
        cuts = [0, *np.sort(rng.integers(0, len(filler) + 1, len(facts))), len(filler)]
        tokens = []
        for i, f in enumerate(facts + [[]]):
            tokens += filler[cuts[i]:cuts[i + 1]] + f
        mask = [False] * len(tokens)
        answer_at = len(before) + 1 + len(middle)
        for q in queries:
            mask += [j == answer_at for j in range(len(q))]
            tokens += q
        return RecallSample(np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=bool))


def kv_filler_for_dataset(options: dict[str, Any], shards: TokenShards, seq_len: int | None,
                          key: str) -> KeyValueFiller:
    """``kv-filler`` for training on ``shards``: the lab's key-value facts and queries with this dataset's tokenizer,
    between stretches of the training split's first ``FILLER_TOKENS`` tokens.

    Options: ``template``, ``values``, ``keys`` (the lab's ``TaskSpec`` choices, or ``generated``: a fresh one for
    every sample, see ``KeyValueFiller``; the template may also be ``text``: cut from a stretch of the filler, with
    generated keys and values), ``num_bindings``, ``repeats``, and with a generated part ``word_pool``
    (how many of the filler's most frequent single-token words formats draw from, ``format_words``; or ``ids``:
    every token id of the vocabulary but the end-of-text token, ``format_ids``; never a token of ``HELD_OUT``).
    ``options`` is completed in place with the defaults used, so the model records them. A generated template varies
    in length, so its longest sample is checked against ``seq_len`` here.
    """
    for name, default in KV_FILLER_DEFAULTS.items():
        options.setdefault(name, default)
    generated = tuple(part for part in FORMAT_PARTS if options[part] == GENERATED)
    text = options["template"] == TEXT
    if generated:
        options.setdefault("word_pool", WORD_POOL)
    for part in FORMAT_PARTS:
        if part not in generated and not (part == "template" and text):
            check_choice(part, options[part])
    tokenize = Tokenize(load_tokenizer(shards.folder))
    filler = np.concatenate([np.asarray(s[:FILLER_TOKENS], dtype=np.int64) for s in shards.split("train").shards])
    filler = filler[:FILLER_TOKENS]
    parts: dict[str, Any] = {}
    if text:
        parts.update(text_template_parts(tokenize, int(filler.max()) + 1))
    elif "template" not in generated:
        parts.update(zip(("before", "middle", "after"), template_tokens(tokenize, options["template"])))
    if "keys" not in generated:
        check_count("num_bindings", options["num_bindings"])
        parts["keys"] = vocabulary_tokens(tokenize, options["keys"], "keys", options["num_bindings"])
    if "values" not in generated:
        parts["values"] = vocabulary_tokens(tokenize, options["values"], "values", 4)
    if generated:
        words = (format_ids(tokenize, shards.vocab_size, [shards.eos_id]) if options["word_pool"] == EVERY_ID
                 else format_words(tokenize, filler, options["word_pool"]))
        parts.update(generated=generated, words=words, punctuation=punctuation_tokens(tokenize))
    generator_options = {k: v for k, v in options.items() if k not in (*FORMAT_PARTS, "word_pool")}
    generator = KeyValueFiller(filler, **parts, **generator_options)
    if (generated or text) and seq_len is not None and generator.longest() > seq_len:
        raise ValueError(f"rule 'sequence length': {options['num_bindings']} bindings of a generated format take up "
                         f"to {generator.longest()} tokens; data.seq_len is {seq_len}")
    return generator


register_generator(KeyValueFiller.name, KeyValueFiller, kv_filler_for_dataset)
