"""``KeyValueFiller``, the ``kv-filler`` recall generator of ``linmem.data.synthetic``: key-value facts of the
memory lab's shape (``linmem.memory.tasks``) in natural filler, for training.

There only, ``template`` / ``keys`` / ``values`` may be ``GENERATED``: every sample draws its own wording and words
from the training text's frequent single-token words, none of them a ``HELD_OUT`` token, so that a model learns to
bind and copy in any format rather than in a few memorised ones; the template may also be ``TEXT``, cut from a
stretch of the training text for every sample (``linmem.memory.generated_formats``). ``kv_filler_for_dataset`` builds
the generator for a dataset's tokenizer and training text; importing this module registers both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from linmem.data.shards import TokenShards
from linmem.data.synthetic import FILLER_TOKENS, RecallSample, register_generator
from linmem.data.tokenizer import load_tokenizer
from linmem.memory.fact_formats import FORMAT_PARTS, GENERATED, TEXT, check_choice, template_tokens, vocabulary_tokens
from linmem.memory.generated_formats import (
    EVERY_ID,
    GENERATED_TEMPLATE_MOST,
    GENERATED_WORDS,
    WORD_POOL,
    format_ids,
    format_words,
    punctuation_tokens,
    text_template_parts,
    text_template_starts,
)

if TYPE_CHECKING:
    from linmem.memory.tasks import TaskBuilder

KV_FILLER_DEFAULTS = {"template": "code", "values": "colors", "keys": "names", "num_bindings": 4, "repeats": 2}


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
    tokenizer = load_tokenizer(shards.folder)
    filler = np.concatenate([np.asarray(s[:FILLER_TOKENS], dtype=np.int64) for s in shards.split("train").shards])
    filler = filler[:FILLER_TOKENS]
    parts: dict[str, Any] = {}
    if text:
        parts.update(text_template_parts(tokenizer, int(filler.max()) + 1))
    elif "template" not in generated:
        parts.update(zip(("before", "middle", "after"), template_tokens(tokenizer, options["template"])))
    if "keys" not in generated:
        check_count("num_bindings", options["num_bindings"])
        parts["keys"] = vocabulary_tokens(tokenizer, options["keys"], "keys", options["num_bindings"])
    if "values" not in generated:
        parts["values"] = vocabulary_tokens(tokenizer, options["values"], "values", 4)
    if generated:
        words = (format_ids(tokenizer, shards.vocab_size, [shards.eos_id]) if options["word_pool"] == EVERY_ID
                 else format_words(tokenizer, filler, options["word_pool"]))
        parts.update(generated=generated, words=words, punctuation=punctuation_tokens(tokenizer))
    generator_options = {k: v for k, v in options.items() if k not in (*FORMAT_PARTS, "word_pool")}
    generator = KeyValueFiller(filler, **parts, **generator_options)
    if (generated or text) and seq_len is not None and generator.longest() > seq_len:
        raise ValueError(f"rule 'sequence length': {options['num_bindings']} bindings of a generated format take up "
                         f"to {generator.longest()} tokens; data.seq_len is {seq_len}")
    return generator


register_generator(KeyValueFiller.name, KeyValueFiller, kv_filler_for_dataset)
