"""``kv-filler`` with generated formats: every training sample draws its own template, keys and values from frequent
words of the training text, never a token of the held-out formats the eval measures; or (``template: text``) cuts
its template from a stretch of the text itself, never one that holds a piece of a held-out template.

Samples are parsed back without the generator's help: the filler here shares no token with the formats, so the
format tokens form runs that split into facts at their closing mark; the last ``n`` facts (``n`` answers in the
mask) are the queries.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from linmem.data.shards import TokenShards
from linmem.data.synthetic import check_sample
from linmem.data.tokenizer import load_tokenizer
from linmem.eval.runner import EvalOptions
from linmem.memory.fact_formats import (
    FORMAT_PARTS,
    GENERATED,
    HELD_OUT,
    KEY_WORDS,
    TEMPLATES,
    TEXT,
    VALUE_WORDS,
    load_template,
    load_vocabulary,
)
from linmem.memory.generated_formats import (
    format_ids,
    format_words,
    held_out_tokens,
    punctuation_tokens,
    text_template_parts,
)
from linmem.memory.kv_filler import KeyValueFiller
from linmem.memory.tasks import TaskBuilder, TaskSpec
from linmem.train.data import resolve_generator

ROOT = Path(__file__).resolve().parents[1]
ZOO_TOKENIZER = ROOT / "linmem" / "zoo" / "models" / "gdn"  # the zoo's 4,096-token tokenizer
SEQ_LEN = 320  # 8 facts of the longest generated template, twice each, and 8 queries: 264 tokens


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return load_tokenizer(ZOO_TOKENIZER)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def held_out(tokenizer: PreTrainedTokenizerFast) -> tuple[set[int], set[str]]:
    """The held-out formats' token ids and lower-case words, listed here from ``HELD_OUT`` and the tables."""
    texts = [piece for name in HELD_OUT["template"] for piece in TEMPLATES[name]]
    texts += [" " + w for name in HELD_OUT["keys"] for w in KEY_WORDS[name].split()]
    texts += [" " + w for name in HELD_OUT["values"] for w in VALUE_WORDS[name].split()]
    ids = {i for t in texts for i in encode(tokenizer, t)}
    return ids, {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)}


@pytest.fixture(scope="module")
def stream(tokenizer) -> np.ndarray:
    """A token stream in which the held-out formats' tokens are the most frequent (so a pool that did not leave
    them out would hold them), the rest random ids."""
    rng = np.random.default_rng()
    vocab = len(tokenizer)
    banned = np.asarray(sorted(held_out(tokenizer)[0]))
    words = np.empty(80_000, dtype=np.int64)  # each random id followed by a comma: every one ends a word
    words[0::2], words[1::2] = rng.integers(0, vocab, 40_000), encode(tokenizer, ",")[0]
    return np.concatenate([words, np.repeat(banned, 200)])


def generator(tokenizer, stream, generated=FORMAT_PARTS, num_bindings=8, **fixed) -> KeyValueFiller:
    """A generator over ``stream``'s word pool whose filler shares no token with the formats (fixed parts from the
    lab's ``code`` / ``names`` / ``colors``)."""
    builder = TaskBuilder(tokenizer, TaskSpec(num_bindings=num_bindings, keys="letters", **fixed))
    words, marks = format_words(tokenizer, stream, 600), punctuation_tokens(tokenizer)
    used = {*words, *marks, *builder.keys, *builder.values, *builder.before, *builder.middle, *builder.after}
    filler = np.asarray([t for t in range(len(tokenizer)) if t not in used])
    return KeyValueFiller(filler, builder.keys, builder.values, builder.before, builder.middle, builder.after,
                          num_bindings=num_bindings, generated=generated, words=words, punctuation=marks)


def parse(g: KeyValueFiller, sample) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[int]]:
    """``(facts, queries, answer positions within each query)`` of a sample of ``g`` (filler disjoint from the
    formats; a fact ends at a punctuation mark or at the fixed template's last token)."""
    tokens, mask = sample.tokens.tolist(), sample.loss_mask.tolist()
    ends = set(g.punctuation) | ({g.after[-1]} if "template" not in g.generated else set())
    filler = set(g.filler.tolist())
    runs, run, starts = [], [], []
    for t, token in enumerate(tokens):
        if token in filler:
            assert not run, "a fact is cut by filler"
            continue
        if not run:
            starts.append(t)
        run.append(token)
        if token in ends:
            runs.append(tuple(run))
            run = []
    assert not run, "the sample ends inside a fact"
    n = sum(mask)
    answers = [t - starts[len(runs) - n + i] for i, t in enumerate(np.flatnonzero(mask))]
    return list(runs[:-n]), list(runs[-n:]), answers


def test_generated_samples_never_hold_a_held_out_token(tokenizer, stream):
    banned_ids, banned_words = held_out(tokenizer)
    g = generator(tokenizer, stream)
    pool = set(g.words)
    assert len(pool) == 600 and not pool & banned_ids
    for token in pool:  # whole words, one token each, in no case a held-out word
        text = decode(tokenizer, [token])
        assert text[0] == " " and text[1:].isalpha() and encode(tokenizer, text) == [token]
        assert text[1:].lower() not in banned_words, text
    assert not set(g.punctuation) & banned_ids and encode(tokenizer, ".")[0] in banned_ids
    seen = set()
    for seed in range(300):
        sample = g.sample(np.random.default_rng(seed), SEQ_LEN)
        check_sample(sample, SEQ_LEN, len(tokenizer))
        facts, queries, _ = parse(g, sample)
        words = {t for f in facts + queries for t in f}
        assert words <= pool | set(g.punctuation) and not words & banned_ids
        seen |= words
    assert len(seen & pool) > 300  # the draws cover the pool


def structure(fact: tuple[int, ...], other: tuple[int, ...]) -> tuple[int, int]:
    """``(key position, value position)``: where two facts of different keys and values differ."""
    differ = [i for i, (a, b) in enumerate(zip(fact, other)) if a != b]
    assert len(fact) == len(other) and len(differ) == 2, (fact, other)
    return differ[0], differ[1]


def test_the_pool_takes_whole_words_not_first_pieces(tokenizer):
    """A token the text mostly continues with letters (the first piece of a longer word) is no pool word; the same
    kind of token followed by punctuation is."""
    piece, word, suffix, comma = (encode(tokenizer, text)[0] for text in (" file", " name", "s", ","))
    ends_word = np.tile([piece, suffix, word, comma], 100)
    assert format_words(tokenizer, ends_word, 10) == [word]  # " file" always continues as " files"
    mostly = np.concatenate([np.tile([piece, comma], 95), np.tile([piece, suffix], 5), np.tile([word, comma], 50)])
    assert format_words(tokenizer, mostly, 10) == [piece, word]  # 95 % of " file" end a word: kept


def test_answers_are_the_values_bound_to_the_queried_keys_and_templates_vary(tokenizer, stream):
    g = generator(tokenizer, stream)
    middles, loads = set(), set()
    for seed in range(200):
        facts, queries, answers = parse(g, g.sample(np.random.default_rng(seed), SEQ_LEN))
        n = len(queries)
        loads.add(n)
        assert len(facts) == n * g.repeats and sorted(set(facts)) == sorted(queries)  # each key asked once
        for query, answer in zip(queries, answers):
            stem = query[:answer]  # before, key, middle: the facts that share it carry the answer
            bound = [f for f in facts if f[:answer] == stem]
            assert len(bound) == g.repeats and all(f[answer] == query[answer] for f in bound)
        if n < 2:
            continue
        key_at, value_at = structure(queries[0], queries[1])
        assert answers == [value_at] * n
        before, middle, after = queries[0][:key_at], queries[0][key_at + 1:value_at], queries[0][value_at + 1:]
        assert 1 <= len(before) <= 4 and 1 <= len(middle) <= 2 and 1 <= len(after) <= 3
        keys, values = {q[key_at] for q in queries}, {q[value_at] for q in queries}
        template = set(before + middle + after)
        assert len(keys) == len(values) == n and not keys & values and not template & (keys | values)
        assert len(template) == len(before + middle + after)  # distinct words
        middles.add(middle)
    assert loads == set(range(1, 9)) and len(middles) > 100


@pytest.mark.parametrize("generated", [("template",), ("keys",), ("values",), ("keys", "values")])
def test_fixed_parts_stay_and_generated_ones_avoid_them(tokenizer, stream, generated):
    g = generator(tokenizer, stream, generated, num_bindings=4)
    pool, fixed_keys, fixed_values = set(g.words), set(g.keys), set(g.values)
    for seed in range(60):
        facts, queries, answers = parse(g, g.sample(np.random.default_rng(seed), SEQ_LEN))
        for query, answer in zip(queries, answers):
            value = query[answer]
            assert [f[answer] for f in facts if f[:answer] == query[:answer]] == [value] * g.repeats
            if "template" in generated:  # template words are neither keys nor values: one fixed key before it
                assert [t for t in query[:answer] if t in fixed_keys] and not set(query) - pool - fixed_keys \
                    - fixed_values - set(g.punctuation)
                assert len([t for t in query[:answer] if t in fixed_keys]) == 1 and value in fixed_values
                continue
            key = query[answer - 1 - len(g.middle)]
            assert query[:len(g.before)] == tuple(g.before) and query[answer + 1:] == tuple(g.after)
            assert query[answer - len(g.middle):answer] == tuple(g.middle)
            assert value != key and key not in query[:answer - 1 - len(g.middle)] + query[answer - len(g.middle):]
            assert value in (pool if "values" in generated else fixed_values)
            assert key in (pool if "keys" in generated else fixed_keys)
            if "keys" not in generated or "values" not in generated:  # a generated part avoids the fixed one
                assert value not in fixed_keys and key not in fixed_values


def test_same_seed_same_sample(tokenizer, stream):
    g = generator(tokenizer, stream)
    seed = int(np.random.default_rng().integers(2**31))
    a, b = (g.sample(np.random.default_rng(seed), SEQ_LEN) for _ in range(2))
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss_mask, b.loss_mask)
    c = g.sample(np.random.default_rng(seed + 1), SEQ_LEN)
    assert not np.array_equal(a.tokens, c.tokens)


def test_training_config_builds_generated_formats_and_records_the_pool(dataset):
    spec = {"name": "kv-filler", "template": GENERATED, "keys": GENERATED, "values": GENERATED, "num_bindings": 3}
    g, _, resolved = resolve_generator(spec, 0, TokenShards(dataset), "test", seq_len=128)
    assert resolved == {**spec, "weight": 1.0, "repeats": 2, "word_pool": 1000}
    assert set(g.generated) == set(FORMAT_PARTS) and len(g.free_words) >= 14
    tokenizer = load_tokenizer(dataset)
    assert all(decode(tokenizer, [w])[1:].isalpha() for w in g.free_words)
    counts = np.bincount(g.filler, minlength=max(g.free_words) + 1)
    assert list(counts[g.free_words]) == sorted(counts[g.free_words], reverse=True)  # the most frequent first
    for seed in range(20):
        sample = g.sample(np.random.default_rng(seed), 127)
        check_sample(sample, 127)
        assert 1 <= sample.loss_mask.sum() <= 3
    fixed, _, resolved = resolve_generator({"name": "kv-filler"}, 0, TokenShards(dataset), "test", seq_len=128)
    assert fixed.generated == () and "word_pool" not in resolved  # a fixed format records no pool


@pytest.mark.parametrize(("options", "match"), [
    ({"template": GENERATED, "word_pool": 0}, r"data\.recall\[0\]: word_pool must be an integer >= 1"),
    ({"keys": GENERATED, "num_bindings": 400}, r"rule 'generated formats': 400 bindings"),
    ({"template": GENERATED, "num_bindings": 8}, r"rule 'sequence length': 8 bindings of a generated format"),
    ({"keys": "generate"}, r"keys must be one of"),
])
def test_training_refuses_bad_generated_options(dataset, options, match):
    with pytest.raises(ValueError, match=match):
        resolve_generator({"name": "kv-filler", **options}, 0, TokenShards(dataset), "test", seq_len=128)


def test_generator_refuses_bad_parts():
    filler = np.arange(100)
    with pytest.raises(ValueError, match=r"generated must hold distinct parts"):
        KeyValueFiller(filler, [1, 2], [3, 4], generated=("template", "layout"), words=range(10, 60))
    with pytest.raises(ValueError, match=r"rule 'generated template': punctuation"):
        KeyValueFiller(filler, [1, 2], [3, 4], generated=("template",), words=range(10, 60))
    with pytest.raises(ValueError, match=r"keys: a fixed keys needs its token ids"):
        KeyValueFiller(filler, [], [3, 4], generated=("values",), words=range(10, 60))
    with pytest.raises(ValueError, match=r"repeats must be an integer >= 1"):
        KeyValueFiller(filler, [1, 2], [3, 4], repeats=0)


@pytest.mark.parametrize("part", FORMAT_PARTS)
def test_recall_measurement_refuses_generated(part):
    """The lab and the eval measure one fixed format: ``generated`` is a training-only choice, refused by name."""
    match = rf"{part} 'generated' is a training-only choice"
    with pytest.raises(ValueError, match=match):
        TaskSpec(**{part: GENERATED})
    with pytest.raises(ValueError, match=match):
        load_template(GENERATED) if part == "template" else load_vocabulary(GENERATED, part)
    with pytest.raises(ValueError, match=rf"recall_{part}: {match}"):
        EvalOptions(**{f"recall_{part}": GENERATED})


# ---------------------------------------------------------------- templates cut from the text


@pytest.fixture(scope="module")
def text_stream(tokenizer) -> np.ndarray:
    """Words and marks of the zoo tokenizer in random order, the held-out templates' pieces spliced in often (so a
    generator that did not refuse them would cut templates holding them)."""
    rng = np.random.default_rng()
    vocab = len(tokenizer)
    texts = [decode(tokenizer, [i]) for i in range(vocab)]
    plain = [i for i, t in enumerate(texts) if (t[:1] == " " and t[1:].isalpha()) or t in (",", ".", ";")]
    pieces = [encode(tokenizer, p) for name in HELD_OUT["template"] for p in TEMPLATES[name]]
    chunks = [list(rng.choice(plain, 14)) + pieces[int(rng.integers(len(pieces)))] for _ in range(3000)]
    return np.asarray([t for c in chunks for t in c], dtype=np.int64)


def text_generator(tokenizer, stream, num_bindings=4) -> KeyValueFiller:
    return KeyValueFiller(stream, generated=("keys", "values"), words=format_words(tokenizer, stream, 600),
                          num_bindings=num_bindings, **text_template_parts(tokenizer, int(stream.max()) + 1))


def test_text_templates_are_stretches_of_the_text_without_held_out_pieces(tokenizer, text_stream):
    g = text_generator(tokenizer, text_stream)
    pieces = [encode(tokenizer, p) for name in HELD_OUT["template"] for p in TEMPLATES[name]]
    text = " ".join(map(str, text_stream.tolist())) + " "
    wordings = set()
    for seed in range(300):
        rng = np.random.default_rng(seed)
        before, middle, after, keys, values = g._format(rng, 4)
        assert 1 <= len(before) <= 4 and 1 <= len(middle) <= 2 and 1 <= len(after) <= 3
        for part in (before, middle, after):
            assert not any(_run_in(part, piece) for piece in pieces), (part, seed)
        # the template and its two slots are one stretch of the text; the slots held words, followed by no letter
        slots = re.findall(" ".join([*map(str, before), r"(\d+)", *map(str, middle), r"(\d+)", *map(str, after)])
                           + " ", " " + text)
        assert slots and any(g.word_starts[int(k)] and g.word_starts[int(v)] for k, v in slots)
        assert not g.word_continues[middle[0]] and not g.word_continues[after[0]]
        template = {*before, *middle, *after}
        assert len(set(keys)) == len(set(values)) == 4 and not template & {*keys, *values}
        assert {*keys, *values} <= set(g.free_words)
        wordings.add((tuple(before), tuple(middle), tuple(after)))
    assert len(wordings) > 250


def _run_in(tokens, piece) -> bool:
    return any(list(tokens[i:i + len(piece)]) == list(piece) for i in range(len(tokens) - len(piece) + 1))


def test_text_template_samples_ask_the_bound_values(tokenizer, text_stream):
    """Each query (the last ``n`` facts, one after another) repeats a fact whose stem appears ``repeats`` times
    before it, always followed by the value the mask asks for."""
    g = text_generator(tokenizer, text_stream)
    checked = 0
    for seed in range(150):
        sample = g.sample(np.random.default_rng(seed), SEQ_LEN)
        check_sample(sample, SEQ_LEN, len(tokenizer))
        tokens, answers = sample.tokens.tolist(), np.flatnonzero(sample.loss_mask)
        if len(answers) < 2:
            continue
        length = int(answers[1] - answers[0])  # queries are back to back: one fact's length apart
        offset = int(answers[-1]) - (len(tokens) - length)  # the answer's place within a query
        body = tokens[:int(answers[0]) - offset]
        for at in answers:
            stem, value = tokens[at - offset:at], tokens[at]
            found = [i for i in range(len(body) - offset) if body[i:i + offset] == stem]
            assert len(found) == g.repeats and all(body[i + offset] == value for i in found)
            checked += 1
    assert checked > 200


def test_training_config_builds_text_templates(dataset):
    spec = {"name": "kv-filler", "template": TEXT, "keys": GENERATED, "values": GENERATED, "num_bindings": 3}
    g, _, resolved = resolve_generator(spec, 0, TokenShards(dataset), "test", seq_len=128)
    assert g.text_template and resolved == {**spec, "weight": 1.0, "repeats": 2, "word_pool": 1000}
    for seed in range(20):
        check_sample(g.sample(np.random.default_rng(seed), 127), 127)
    with pytest.raises(ValueError, match=r"keys and values are generated"):
        resolve_generator({**spec, "keys": "names"}, 0, TokenShards(dataset), "test", seq_len=128)
    with pytest.raises(ValueError, match=r"template 'text' is a training-only choice"):
        TaskSpec(template=TEXT)


def test_word_pool_ids_draws_keys_and_values_from_every_token_but_the_held_out_ones(dataset):
    """``word_pool: ids``: keys and values come from the whole vocabulary (subword pieces and marks too) except the
    end-of-text token and every token of ``HELD_OUT``, whatever its case or spacing; the choice is recorded."""
    shards = TokenShards(dataset)
    tokenizer = load_tokenizer(dataset)
    spec = {"name": "kv-filler", "template": TEXT, "keys": GENERATED, "values": GENERATED, "num_bindings": 3,
            "word_pool": "ids"}
    g, _, resolved = resolve_generator(spec, 0, shards, "test", seq_len=128)
    assert resolved == {**spec, "weight": 1.0, "repeats": 2}
    banned_ids, banned_words = held_out_tokens(tokenizer)
    pool = set(format_ids(tokenizer, shards.vocab_size, [shards.eos_id]))
    assert set(g.free_words.tolist()) == pool - set(g.punctuation)  # the pool, less the generator's fixed marks
    assert shards.eos_id not in pool and not pool & banned_ids
    assert not {decode(tokenizer, [i]).strip().lower() for i in pool} & banned_words
    assert len(pool) > 2 * len(format_words(tokenizer, g.filler, 10**6))  # far more than the whole words
    spelled = {i for i in range(shards.vocab_size) if decode(tokenizer, [i]).strip().lower() in banned_words}
    assert spelled - banned_ids <= set(range(shards.vocab_size)) - pool  # other spellings of held-out words too
    answers = set()
    for seed in range(40):
        sample = g.sample(np.random.default_rng(seed), 127)
        check_sample(sample, 127)
        answers |= set(sample.tokens[sample.loss_mask].tolist())
    assert answers <= pool
    words = set(format_words(tokenizer, g.filler, 10**6))
    assert answers - words  # tokens that are no whole word are asked for as well
    with pytest.raises(ValueError, match=r"word_pool must be an integer >= 1 .* or 'ids'"):
        resolve_generator({**spec, "word_pool": "every"}, 0, shards, "test", seq_len=128)


def test_text_templates_are_drawn_however_rare_their_stretches(tokenizer):
    """A filler of marks with a few stretches of words spliced in: every draw is one of those stretches (none fails
    for want of trying), and a filler without any is refused when the generator is built."""
    rng = np.random.default_rng()
    marks = [encode(tokenizer, m)[0] for m in ("(", ")", "=", "[", "]")]
    words = [encode(tokenizer, " " + w)[0] for w in ("river", "stone", "light", "water", "house", "bread", "field",
                                                     "glass", "horse", "paper", "chair", "table", "sword", "crown")]
    stream = list(rng.choice(marks, 50_000))
    for at in rng.choice(49_000, 30, replace=False):
        stream[at:at + 12] = list(rng.choice(words, 12))
    stream = np.asarray(stream, dtype=np.int64)
    g = text_generator(tokenizer, np.concatenate([stream, [max(words + marks)]]), num_bindings=2)
    g.free_words = np.arange(3000, 3400)  # keys and values from elsewhere in the vocabulary
    text = " " + " ".join(map(str, stream.tolist())) + " "
    for seed in range(2000):
        before, middle, after, _, _ = g._format(np.random.default_rng(seed), 2)
        assert re.search(" ".join([*map(str, before), r"\d+", *map(str, middle), r"\d+", *map(str, after)]), text)
        assert set(before + middle + after) <= set(words) | set(marks)
    with pytest.raises(ValueError, match=r"rule 'text template': the filler holds no stretch"):
        text_generator(tokenizer, np.asarray(rng.choice(marks, 5_000), dtype=np.int64))
