"""Tasks, metrics and statistics of the memory lab: prompt pairs obey their rules, metrics and CIs compute what
they say."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linmem.data.sources import Document
from linmem.data.synthetic import check_sample, make_generator
from linmem.data.tokenizer import train_tokenizer, wrap_tokenizer
from linmem.memory import metrics, stats
from linmem.memory.kv_filler import KeyValueFiller
from linmem.memory.tasks import TaskBuilder, TaskSpec, build_items, passages

WORDS = "the of and to in that is was he for it with as his on be at by had not are but from or have".split()


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(0)
    docs = [Document("toy", f"toy:{i}", " ".join(rng.choice(WORDS, 300))) for i in range(12)]
    spec = TaskSpec()
    extra = [f" The code of {k} is {v}." for k in "Alice Bob Carol David Emma Frank Grace Henry".split()
             for v in "red blue green yellow black white brown pink".split()] * 5
    tokenizer = wrap_tokenizer(train_tokenizer([d.text for d in docs] + extra, vocab_size=400))
    return docs, tokenizer, spec


def test_pairs_align_and_differ_only_in_the_target_value(corpus):
    docs, tokenizer, _ = corpus
    builder = TaskBuilder(tokenizer, TaskSpec(num_bindings=3, repeats=2, filler_tokens=64))
    sources = passages(docs, tokenizer, 80)
    assert {s[1] for s in sources} == {"dev", "confirm"}
    for item in build_items(builder, sources, seed=int(torch.randint(0, 1000, ()))):
        assert len(item.recipient) == len(item.donor)
        differ = [i for i, (a, b) in enumerate(zip(item.recipient, item.donor)) if a != b]
        assert differ == item.value_positions and len(differ) == 2
        query = item.queries[item.target]
        assert item.recipient[differ[0]] == query.candidates[query.answer]
        assert item.donor[differ[0]] == query.candidates[query.donor_answer] != query.candidates[query.answer]
        assert len(set(query.candidates)) == 4
        assert all(len(q.tokens) == len(query.tokens) for q in item.queries)


def test_variants(corpus):
    docs, tokenizer, _ = corpus
    sources = passages(docs, tokenizer, 80)
    latest = build_items(TaskBuilder(tokenizer, TaskSpec(variant="latest", repeats=3, filler_tokens=64)), sources)
    for item in latest:
        assert len(item.value_positions) == 1  # only the last presentation carries the answer
        q = item.queries[item.target]
        assert item.recipient[item.value_positions[0]] == q.candidates[q.answer]
    neutral = build_items(TaskBuilder(tokenizer, TaskSpec(variant="neutral", filler_tokens=64)), sources)
    for item in neutral:
        assert len(item.donor) == len(item.recipient)
        query = item.queries[item.target]
        assert query.donor_answer == query.answer  # the neutral donor has no value for the target
        key = item.queries[item.target].tokens[-2]
        assert key not in item.donor or item.donor.count(key) < item.recipient.count(key)
    builder = TaskBuilder(tokenizer, TaskSpec(gap=20, filler_tokens=64))
    item = build_items(builder, sources)[0]
    end = item.boundary - 20  # the last fact ends exactly 20 filler tokens before the query
    assert item.recipient[end - len(builder.after):end] == builder.after
    assert item.recipient[end - len(builder.after) - 1] in builder.values


def presentations(prompt: list[int], fact_start: list[int], fact_length: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every fact in ``prompt`` that begins with ``fact_start`` (the template's opening and a
    key) and is ``fact_length`` tokens long."""
    width = len(fact_start)
    return [(t, t + fact_length) for t in range(len(prompt) - width + 1) if prompt[t:t + width] == fact_start]


@pytest.mark.parametrize("variant", ["retrieval", "latest"])
def test_no_fact_prompt_drops_every_presentation_of_the_asked_fact_and_nothing_else(corpus, variant):
    docs, tokenizer, _ = corpus
    spec = TaskSpec(num_bindings=3, repeats=3, filler_tokens=64, variant=variant)
    builder = TaskBuilder(tokenizer, spec)
    sources = passages(docs, tokenizer, 80)
    fact_length = len(builder.fact(0, 0))
    for item in build_items(builder, sources, seed=int(np.random.default_rng().integers(1000))):
        assert len(item.no_fact) == len(item.recipient)
        assert item.prompt(no_fact=True) == item.no_fact + item.queries[item.target].tokens
        with pytest.raises(ValueError, match="one prefix"):
            item.prompt(donor=True, no_fact=True)
        asked = item.queries[item.target].tokens  # the template's opening, the key and the middle
        spans = presentations(item.recipient, asked, fact_length)
        assert len(spans) == spec.repeats and not presentations(item.no_fact, asked, fact_length)
        inside = {t for a, b in spans for t in range(a, b)}
        assert all(item.no_fact[t] == item.recipient[t] for t in range(len(item.recipient)) if t not in inside)
        for b, query in enumerate(item.queries):  # every other fact is still there, as often
            if b != item.target:
                assert (presentations(item.no_fact, query.tokens, fact_length)
                        == presentations(item.recipient, query.tokens, fact_length))
        facts = {t for q in item.queries for a, b in presentations(item.recipient, q.tokens, fact_length)
                 for t in range(a, b)}
        filler = [token for t, token in enumerate(item.recipient) if t not in facts]  # the passage's stretch
        for a, b in spans:  # filler of the passage in the fact's place
            stretch = item.no_fact[a:b]
            assert any((filler * 2)[t:t + len(stretch)] == stretch for t in range(len(filler)))  # read on cyclically


def test_no_fact_filler_draws_leave_the_items_as_they_were(corpus, monkeypatch):
    """The no-fact prompt has a generator of its own: another seed for it changes that prompt and nothing else
    of the item (the recall measured on the items stays comparable with and without the control)."""
    import linmem.memory.tasks as tasks

    docs, tokenizer, _ = corpus
    builder = TaskBuilder(tokenizer, TaskSpec(num_bindings=2, repeats=2, filler_tokens=64))
    sources = passages(docs, tokenizer, 80)
    seed = int(np.random.default_rng().integers(1000))
    before = build_items(builder, sources, seed=seed)
    monkeypatch.setattr(tasks, "NO_FACT_SALT", "another salt")
    after = build_items(builder, sources, seed=seed)
    for a, b in zip(before, after, strict=True):
        assert (a.recipient, a.donor, a.queries, a.target, a.target_writes) == (
            b.recipient, b.donor, b.queries, b.target, b.target_writes)
    assert any(a.no_fact != b.no_fact for a, b in zip(before, after))


def test_filler_sits_between_the_last_fact_and_the_query_by_default(corpus):
    """``gap=None``: the stretch before the query is a stretch like the others (K·R + 1 equal shares of the
    filler), not an empty one that puts the last fact right before the query."""
    docs, tokenizer, _ = corpus
    sources = passages(docs, tokenizer, 80)
    builder = TaskBuilder(tokenizer, TaskSpec(num_bindings=2, repeats=2, filler_tokens=50))
    for item in build_items(builder, sources):
        end = item.boundary - 10  # 50 filler tokens in 5 stretches of 10
        assert item.recipient[end - len(builder.after):end] == builder.after
        assert item.recipient[end - len(builder.after) - 1] in builder.values
        assert len(item.recipient) == 50 + 4 * len(builder.fact(0, 0))


def test_rules_raise_clear_errors(corpus):
    docs, tokenizer, _ = corpus
    with pytest.raises(ValueError, match="rule 'single-token values'"):
        TaskBuilder(tokenizer, TaskSpec(values="cities"))
    with pytest.raises(ValueError, match="rule 'latest value'"):
        TaskSpec(variant="latest", repeats=1)
    builder = TaskBuilder(tokenizer, TaskSpec(filler_tokens=64))
    with pytest.raises(ValueError, match="rule 'filler length'"):
        builder.build("short", list(range(10)), np.random.default_rng(0))


def test_kv_filler_generator(corpus):
    docs, tokenizer, _ = corpus
    builder = TaskBuilder(tokenizer, TaskSpec())
    stream = tokenizer.encode(docs[0].text, add_special_tokens=False)
    generator = KeyValueFiller.from_builder(builder, stream, num_bindings=3)
    assert isinstance(make_generator("kv-filler", filler=np.array(stream), keys=builder.keys,
                                     values=builder.values), KeyValueFiller)
    sample = generator.sample(np.random.default_rng(int(torch.randint(0, 999, ()))), 120)
    check_sample(sample, 120, len(tokenizer))
    answers = sample.tokens[sample.loss_mask]
    assert 1 <= len(answers) <= 3 and set(answers) <= set(builder.values)
    for t in np.flatnonzero(sample.loss_mask):  # each answer follows "... key is" and that binding was shown before
        key = sample.tokens[t - 1 - len(builder.middle)]
        fact = [*builder.before, key, *builder.middle, sample.tokens[t]]
        first = sample.tokens[: t - len(fact) + 1].tolist()
        assert any(first[i:i + len(fact)] == fact for i in range(len(first)))


def test_metrics():
    choice = torch.randn(6, 4, dtype=torch.float64)
    answer, donor = torch.randint(0, 4, (6,)), torch.randint(0, 4, (6,))
    edited = choice.clone()
    edited[torch.arange(6), donor] += 100
    m = metrics.compare(choice, edited, answer, donor)
    assert torch.equal(m["donor_answer"], torch.ones(6, dtype=torch.float64))
    same = donor == answer
    assert torch.allclose(m["donor_margin_shift"][~same], torch.full(((~same).sum(),), 100.0, dtype=torch.float64))
    assert torch.equal(m["clean_correct"], (choice.argmax(-1) == answer).double())
    rate, n = metrics.break_rate(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert (rate, n) == (1 / 3, 3)


def test_bootstrap_over_sources():
    rng = np.random.default_rng(int(torch.randint(0, 999, ())))
    values = rng.normal(1.0, 1.0, 200)
    sources = [f"s{i % 20}" for i in range(200)]
    e = stats.bootstrap(values, sources)
    assert e.n == 200 and e.sources == 20 and e.low < e.mean < e.high
    assert abs(e.mean - values.mean()) < 1e-12  # equal-size sources: mean of means = mean
    assert stats.bootstrap([np.nan, 1.0], ["a", "b"]).n == 1
    uneven = stats.bootstrap([0.0] * 9 + [1.0], ["a"] * 9 + ["b"])  # the unit is the source, not the item
    assert uneven.mean == pytest.approx(0.5) and (uneven.n, uneven.sources) == (10, 2)
    assert uneven.low == 0.0 and uneven.high == 1.0


def test_ratio_of_means_over_sources():
    """The normalized donor effect is a ratio of source means: an item whose full effect is near zero does not
    blow it up (a mean of per-item ratios would be about 1e6 here)."""
    full = np.array([2.0] * 40 + [4.0, 1e-6])
    part = np.array([1.0] * 40 + [2.0, 1.0])
    names = [f"s{i // 2}" for i in range(40)] + ["a", "b"]  # 20 sources of two items, then two of one
    e = stats.bootstrap_ratio(part, full, names)
    assert e.mean == pytest.approx(23 / (44 + 1e-6)) and (e.n, e.sources) == (42, 22)
    assert e.low <= e.mean <= e.high < 1
    same = stats.bootstrap_ratio([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], ["a", "b", "c"])
    assert same.mean == same.low == same.high == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one length"):
        stats.bootstrap_ratio([1.0], [1.0, 2.0], ["a"])
    assert stats.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert stats.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
