"""Data at any size: ``linmem data build`` streams documents (never more than a batch alive) from JSONL, parquet and
``datasets`` Arrow folders into shards equal to an in-memory reference, and the trainer's windows read shards
memory-mapped (resident memory does not grow with the dataset)."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from linmem.data.build import ENCODE_BATCH, BuildOptions, build_dataset
from linmem.data.shards import ShardWriter, TokenShards, write_index
from linmem.data.sources import Document, open_path
from linmem.data.splits import SPLITS, SplitFractions, split_of
from linmem.data.tokenizer import load_tokenizer
from linmem.data.windows import TokenWindows
from tests.test_train_support import WORDS


def random_texts(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) for _ in range(count)]


class CountedSource:
    """Generates ``count`` documents lazily and records how many are alive at once (weak references)."""

    def __init__(self, count: int, seed: int):
        self.name, self.count, self.seed = "counted", count, seed
        self.alive = self.most_alive = 0

    def _gone(self) -> None:
        self.alive -= 1

    def documents(self) -> Iterator[Document]:
        rng = np.random.default_rng(self.seed)
        for i in range(self.count):
            doc = Document(self.name, f"counted:{i}", " ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))))
            self.alive += 1
            self.most_alive = max(self.most_alive, self.alive)
            weakref.finalize(doc, self._gone)
            yield doc


def test_build_holds_a_bounded_number_of_documents(tmp_path):
    source = CountedSource(12 * ENCODE_BATCH, seed=int(np.random.default_rng().integers(1 << 30)))
    card = build_dataset([source], tmp_path / "data", BuildOptions(vocab_size=300, progress=False,
                                                                   shard_tokens=4096))
    assert card["documents"]["total"] == 12 * ENCODE_BATCH  # every document went through (tokenizer, then shards)
    assert source.most_alive <= ENCODE_BATCH + 2, source.most_alive  # one encode batch, never the corpus


def write_arrow_folder(folder: Path, texts: list[str], files: int) -> None:
    """``texts`` the way ``datasets``' ``save_to_disk`` lays out a Dataset: Arrow stream files listed in
    ``state.json``, beside ``dataset_info.json``."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    names = []
    for i, part in enumerate(np.array_split(np.arange(len(texts)), files)):
        name = f"data-{i:05d}-of-{files:05d}.arrow"
        table = pa.table({"text": [texts[j] for j in part], "n": part.tolist()})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names}), encoding="utf-8")
    (folder / "dataset_info.json").write_text("{}", encoding="utf-8")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow"])
def test_streamed_shards_equal_the_in_memory_reference(tmp_path, kind):
    texts = random_texts(300, seed=int(np.random.default_rng().integers(1 << 30)))
    fractions = SplitFractions(0.8, 0.1, 0.1)
    tokenizer_folder = tmp_path / "tok"
    build_dataset([CountedSource(50, seed=1)], tokenizer_folder, BuildOptions(vocab_size=300, progress=False))
    if kind == "jsonl":
        path = tmp_path / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        ids = [f"corpus.jsonl:{i + 1}" for i in range(len(texts))]  # line numbers
    elif kind == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa

        path = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"text": texts}), str(path), row_group_size=37)
        ids = [f"corpus.parquet:{i}" for i in range(len(texts))]
    else:
        pytest.importorskip("pyarrow")
        path = tmp_path / "saved"
        write_arrow_folder(path, texts, files=3)
        ids = [f"saved:{i}" for i in range(len(texts))]
    shard_tokens = 600
    build_dataset([open_path(path)], tmp_path / "data", BuildOptions(
        tokenizer=str(tokenizer_folder / "tokenizer.json"), fractions=fractions, shard_tokens=shard_tokens,
        progress=False))

    tokenizer = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    data = TokenShards(tmp_path / "data")
    data.verify()
    expected: dict[str, list[int]] = {s: [] for s in SPLITS}
    for text, sid in zip(texts, ids):  # one document at a time, all in memory
        expected[split_of(sid, fractions)] += tokenizer.encode(text, add_special_tokens=False) + [data.eos_id]
    for name in SPLITS:
        split = data.split(name)
        got = np.concatenate([np.asarray(s) for s in split.shards]) if split.shards else np.zeros(0)
        assert got.tolist() == expected[name], name
        sizes = [len(s) for s in split.shards]
        assert all(n <= shard_tokens for n in sizes)
        assert name != "train" or len(sizes) > 2  # the bound split the training tokens into several shards
    assert [sid for _, sid, _ in data.split("train").documents()] == [s for s in ids if split_of(s, fractions)
                                                                      == "train"]


def private_resident_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``): what it holds itself, unlike file pages mapped
    from the page cache, which every rank shares and the kernel can drop."""
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def draw_and_measure(folder: Path, seed: int) -> tuple[int, int, list[np.ndarray]]:
    """In this process: the growth of its own memory while 200 batches are drawn from ``folder``'s shards, then
    while the shards are read whole, and the first 5 batches. Run in a fresh process, where no memory freed by
    earlier work can be reused unseen."""
    split = TokenShards(folder).split("train")
    windows = TokenWindows(split, seq_len=64, seed=seed)
    windows.batch(0, 8)  # the first batch also builds torch's own lazy state, which is not the dataset
    gc.collect()
    before = private_resident_bytes()
    drawn = [windows.batch(step, 8)["input_ids"].numpy() for step in range(200)]
    growth = private_resident_bytes() - before
    files = [np.fromfile(folder / e["file"], dtype="<u2") for e in split.entries]
    read_growth = private_resident_bytes() - before
    del files
    return growth, read_growth, drawn[:5]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads resident memory from /proc")
def test_training_windows_are_memory_mapped(tmp_path):
    """64 MB of shards, 200 batches drawn: the process's own memory grows by far less than the dataset (the
    shards stay file pages of the page cache, shared by every rank); every window equals the bytes on disk. The
    drawing runs in a fresh process, where memory freed by earlier tests cannot hide a read of the whole data."""
    import multiprocessing

    rng = np.random.default_rng()
    writer = ShardWriter(tmp_path, "train", np.dtype("<u2"), eos_id=0, shard_tokens=1 << 23)
    for i in range(4):
        writer.add(rng.integers(1, 1000, size=(1 << 23) - 1, dtype=np.uint16), f"big:{i}", 0)
    entries = writer.close()
    write_index(tmp_path, {"dtype": "<u2", "vocab_size": 1000, "eos_id": 0, "special_token_ids": {},
                           "tokenizer_hash": "none", "tokenizer": "tokenizer.json", "source_names": ["big"]},
                {"train": entries})
    dataset_bytes = sum(e["num_tokens"] * 2 for e in entries)
    assert dataset_bytes == 64 << 20
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        growth, read_growth, drawn = pool.apply(draw_and_measure, (tmp_path, int(rng.integers(1 << 30))))
    assert growth < 8 << 20, growth  # the batches themselves: 200 x 8 x 64 int64 = 800 KB
    assert read_growth > dataset_bytes // 2, read_growth  # reading the shards whole would show
    flat = np.concatenate([np.fromfile(tmp_path / e["file"], dtype="<u2") for e in entries])
    for batch in drawn:
        for row in batch:
            starts = np.flatnonzero(flat[:len(flat) - 63] == row[0])
            assert any(np.array_equal(flat[s:s + 64], row) for s in starts)
