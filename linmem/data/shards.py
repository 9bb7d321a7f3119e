"""Token shards on disk: flat ``.bin`` files of token ids, memory-mapped, described by ``index.json``.

A split is a list of shards; a shard is the token ids of whole documents, each followed by the end-of-text id
(``doc_0 EOS doc_1 EOS ...``), as raw little-endian ``uint16`` (vocabularies up to 65,536) or ``uint32``. The
index lists, per shard, its file, token count, SHA-256 and its documents (start, length without the EOS, source
id, source), plus the dtype, vocabulary size, EOS id and the tokenizer's hash. ``dataset_fingerprint`` hashes the
shards' checksums from the index: a trainer compares it to tell a dataset rebuilt at the same path.

Every shard is written whole and atomically, and ``index.json`` is written last: a folder without ``index.json``
is not a dataset, and a shard whose size disagrees with the index is reported, never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from linmem.data.splits import SPLITS
from linmem.io.atomic import create_new, fsync_dir, temp_path, write_json_atomic

INDEX_NAME = "index.json"
FORMAT = "linmem-token-shards"
VERSION = 1
DEFAULT_SHARD_TOKENS = 1 << 24  # 16M tokens: 32 MB of uint16


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` if every id fits, else ``uint32``."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.bin"


SHARD_FILE = re.compile(rf"(?:{'|'.join(SPLITS)})-[0-9]{{5}}\.bin")  # the names shard_name gives


def shard_files(index: dict[str, Any]) -> set[str]:
    """The shard files an index lists (only names ``shard_name`` gives: an index names no other file)."""
    return {e["file"] for entries in index["splits"].values() for e in entries
            if isinstance(e.get("file"), str) and SHARD_FILE.fullmatch(e["file"])}


class ShardWriter:
    """Collects the documents of one split and writes them as shards of about ``shard_tokens`` tokens.

    A document never straddles two shards (a document longer than ``shard_tokens`` gets a shard of its own).
    ``add`` takes the token ids of one document, without the EOS, which the writer appends; a document that comes
    in pieces goes through ``start``, ``extend`` per piece and ``end``. Tokens go to the shard's temporary file as
    each document ends (or, for a document longer than a shard, as they come), so memory holds at most one shard's
    worth of one document. ``shards`` lists the index entries of the shards written so far.
    """

    def __init__(self, folder: Path, split: str, dtype: np.dtype, eos_id: int,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS):
        self.folder, self.split, self.dtype, self.eos_id = Path(folder), split, np.dtype(dtype), eos_id
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: BinaryIO | None = None
        self._doc: tuple[str, int] | None = None  # (source_id, source) of the document being added
        self._start_shard()

    def _start_shard(self) -> None:
        self._docs: dict[str, list] = {"doc_starts": [], "doc_lengths": [], "source_ids": [], "sources": []}
        self._size = 0  # tokens in the shard's file
        self._hash = hashlib.sha256()

    def add(self, tokens: np.ndarray, source_id: str, source: int) -> None:
        """Append a document (``tokens [n]`` ids) from the source numbered ``source`` in the index."""
        self.start(source_id, source)
        self.extend(tokens)
        self.end()

    def start(self, source_id: str, source: int) -> None:
        """Begin a document whose tokens ``extend`` appends."""
        if self._doc is not None:
            raise RuntimeError(f"ShardWriter.start({source_id!r}): document {self._doc[0]!r} was not ended")
        self._doc, self._held, self._held_len, self._doc_start = (source_id, source), [], 0, None

    def extend(self, tokens: np.ndarray) -> None:
        """Append the next piece (``tokens [n]`` ids) of the open document."""
        self._held.append(np.ascontiguousarray(tokens, dtype=self.dtype))
        self._held_len += len(tokens)
        self._place(self._held_len)

    def end(self) -> None:
        """End the open document (the writer appends its EOS)."""
        self.extend(np.array([self.eos_id], dtype=self.dtype))
        if self._doc_start is None:
            self._doc_start = self._size
        length = self._size + self._held_len - self._doc_start - 1
        self._write_held()
        for key, value in zip(self._docs, (self._doc_start, length, *self._doc)):
            self._docs[key].append(value)
        self._doc = None

    def _place(self, doc_tokens: int) -> None:
        """Start a new shard when the open document no longer fits beside the shard's others; write its tokens
        through once it is alone in the shard and longer than a shard."""
        if self._doc_start is None and self._size and self._size + doc_tokens > self.shard_tokens:
            self.flush()
        if doc_tokens > self.shard_tokens:
            if self._doc_start is None:
                self._doc_start = self._size
            self._write_held()

    def _write_held(self) -> None:
        if self._file is None:
            self._file = open(temp_path(self.folder / shard_name(self.split, len(self.shards))), "wb",
                              opener=create_new)
        for part in self._held:
            self._file.write(memoryview(part).cast("B"))
            self._hash.update(part)
            self._size += len(part)
        self._held, self._held_len = [], 0

    def flush(self) -> None:
        """Complete the shard being written: fsync its file and rename it to its name (nothing if it is empty)."""
        if not self._size:
            return
        name = shard_name(self.split, len(self.shards))
        file, self._file = self._file, None
        try:
            file.flush()
            os.fsync(file.fileno())
            file.close()
            os.replace(file.name, self.folder / name)
        except BaseException:
            file.close()
            Path(file.name).unlink(missing_ok=True)
            raise
        fsync_dir(self.folder)
        self.shards.append({"file": name, "num_tokens": self._size, "sha256": self._hash.hexdigest(), **self._docs})
        self._start_shard()

    def close(self) -> list[dict[str, Any]]:
        """Write what is pending; returns the index entries of all shards."""
        if self._doc is not None:
            raise RuntimeError(f"ShardWriter.close: document {self._doc[0]!r} was not ended")
        self.flush()
        return self.shards


def read_index(folder: Path) -> dict[str, Any]:
    """The parsed ``index.json`` of a dataset folder; ``FileNotFoundError`` or ``ValueError`` (one line) if it is
    missing or not a linmem token index."""
    path = Path(folder) / INDEX_NAME
    if not path.is_file():
        hint = " (an interrupted build leaves no index: build again)" if any(Path(folder).glob("*.bin")) else ""
        raise FileNotFoundError(f"{folder}: no {INDEX_NAME}; not a linmem token dataset{hint}")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{path}: not valid JSON; not a linmem token dataset: build it again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        found = index if isinstance(index, dict) else {}
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} index (format {found.get('format')!r}, "
                         f"version {found.get('version')!r})")
    return index


def index_fingerprint(index: dict[str, Any]) -> str:
    """SHA-256 over the dtype, EOS id, tokenizer hash and every split's shard checksums and sizes, in order."""
    content = {"dtype": index["dtype"], "eos_id": index["eos_id"], "tokenizer_hash": index["tokenizer_hash"],
               "splits": {split: [[e["sha256"], e["num_tokens"]] for e in entries]
                          for split, entries in sorted(index["splits"].items())}}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dataset_fingerprint(data_dir: str | Path) -> str:
    """The content hash of the dataset in ``data_dir``: equal for the same tokens (same tokenizer, same splits),
    different once a rebuild changes any token. Read from ``index.json`` alone (its per-shard SHA-256s); no shard is
    read."""
    return index_fingerprint(read_index(Path(data_dir)))


def write_index(folder: Path, meta: dict[str, Any], splits: dict[str, list[dict[str, Any]]]) -> Path:
    """Write ``index.json`` (atomically, last): ``meta`` (dtype, vocab_size, eos_id, tokenizer_hash, ...) and the
    shards of each split as ``ShardWriter.close`` returns them."""
    index = {"format": FORMAT, "version": VERSION, **meta, "splits": splits}
    write_json_atomic(folder / INDEX_NAME, index)
    return folder / INDEX_NAME


class SplitTokens:
    """The shards of one split, memory-mapped on first use: ``shards[i]`` is a read-only ``[num_tokens_i]`` array.

    Pickles as paths, not data (a DataLoader worker maps the files itself).
    """

    def __init__(self, name: str, folder: Path, dtype: np.dtype, entries: list[dict[str, Any]],
                 source_names: list[str], eos_id: int):
        self.name, self.folder, self.dtype, self.entries = name, Path(folder), np.dtype(dtype), entries
        self.source_names, self.eos_id = source_names, eos_id
        self._shards: list[np.ndarray] | None = None

    @property
    def shards(self) -> list[np.ndarray]:
        if self._shards is None:
            self._shards = [np.memmap(self.folder / e["file"], dtype=self.dtype, mode="r") for e in self.entries]
        return self._shards

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_shards": None}

    @property
    def num_tokens(self) -> int:
        return sum(e["num_tokens"] for e in self.entries)

    @property
    def num_documents(self) -> int:
        return sum(len(e["doc_starts"]) for e in self.entries)

    def documents(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """Yield ``(source, source_id, tokens [n])`` for every document in order (tokens without the EOS)."""
        for shard, entry in zip(self.shards, self.entries):
            for start, length, sid, src in zip(entry["doc_starts"], entry["doc_lengths"], entry["source_ids"],
                                               entry["sources"]):
                yield self.source_names[src], sid, shard[start:start + length]


class TokenShards:
    """A dataset folder written by ``linmem data build``: its index, and each split's shards memory-mapped.

    Opening checks that every shard exists with the size the index gives; ``verify()`` also checks checksums.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.index = read_index(self.folder)
        self.dtype = np.dtype(self.index["dtype"])
        for entries in self.index["splits"].values():
            for entry in entries:
                self._check_size(entry)

    def _check_size(self, entry: dict[str, Any]) -> None:
        path = self.folder / entry["file"]
        expected = entry["num_tokens"] * self.dtype.itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            found = "missing" if actual is None else f"{actual} bytes"
            raise ValueError(f"{path}: {found}, but the index says {expected} bytes; the folder changed after "
                             f"the build: build again")

    @property
    def splits(self) -> list[str]:
        return list(self.index["splits"])

    @property
    def eos_id(self) -> int:
        return int(self.index["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    @property
    def tokenizer_hash(self) -> str:
        return self.index["tokenizer_hash"]

    @property
    def fingerprint(self) -> str:
        """``dataset_fingerprint`` of this folder."""
        return index_fingerprint(self.index)

    def split(self, name: str) -> SplitTokens:
        """The memory-mapped shards of split ``name``."""
        if name not in self.index["splits"]:
            raise KeyError(f"{self.folder}: no split {name!r}; splits: {', '.join(self.splits)}")
        return SplitTokens(name, self.folder, self.dtype, self.index["splits"][name], self.index["source_names"],
                           self.eos_id)

    def verify(self) -> None:
        """Recompute every shard's SHA-256 and compare it with the index (reads every byte)."""
        for entries in self.index["splits"].values():
            for entry in entries:
                digest = hashlib.sha256((self.folder / entry["file"]).read_bytes()).hexdigest()
                if digest != entry["sha256"]:
                    raise ValueError(f"{self.folder / entry['file']}: checksum differs from the index; build again")
