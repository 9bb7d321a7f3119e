"""``linmem data build``: sources -> tokenizer -> token shards + index + data card, in one folder.

The folder it writes::

    tokenizer.json, tokenizer_config.json   the tokenizer (AutoTokenizer.from_pretrained(folder) loads it)
    train-00000.bin ... test-00000.bin      token shards (see ``shards``)
    data_card.json                          what went in: documents, tokens and characters per source and split
    index.json                              written last: its presence means the build finished

A trained tokenizer sees only the training split. Documents that are empty after stripping are skipped (and
counted). Two documents with the same ``source_id`` stop the build: ids must be unique for the splits to mean
anything.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from linmem.data.shards import DEFAULT_SHARD_TOKENS, ShardWriter, remove_shards, token_dtype, write_index
from linmem.data.sources import Document, Source
from linmem.data.splits import SPLITS, SplitFractions, split_of
from linmem.data.tokenizer import (
    configured_tokens,
    find_eos,
    load_tokenizer,
    save_tokenizer,
    special_token_ids,
    tokenizer_hash,
    train_tokenizer,
)
from linmem.io import zoo_dir
from linmem.io.atomic import write_json_atomic
from linmem.io.zoo_dir import ZOO_PREFIX

CARD_NAME = "data_card.json"
ENCODE_BATCH = 256


@dataclass
class BuildOptions:
    """How to build: ``tokenizer`` is ``"train"``, a path to a ``tokenizer.json`` (or a folder holding one) or
    ``zoo:NAME`` (the tokenizer of a shipped zoo model)."""

    tokenizer: str = "train"
    vocab_size: int = 8192
    min_frequency: int = 2
    fractions: SplitFractions = SplitFractions()
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    eos_token: str | None = None
    salt: str = "linmem"
    progress: bool = True


def _documents(sources: Sequence[Source], desc: str, progress: bool) -> Iterator[Document]:
    for source in sources:
        yield from tqdm(source.documents(), desc=f"{desc} {source.name}", unit=" docs", disable=not progress,
                        leave=False)


def _prepare_tokenizer(sources: Sequence[Source], out: Path, opts: BuildOptions) -> tuple[Tokenizer, dict]:
    """Train (on the training split) or load the tokenizer and save it into ``out``; returns the tokenizer as
    saved and its data-card entry."""
    start = time.perf_counter()
    if opts.tokenizer == "train":
        seen = {"documents": 0, "chars": 0}

        def texts() -> Iterator[str]:
            for doc in _documents(sources, "tokenizer", opts.progress):
                if doc.text.strip() and split_of(doc.source_id, opts.fractions, opts.salt) == "train":
                    seen["documents"] += 1
                    seen["chars"] += len(doc.text)
                    yield doc.text

        tokenizer = train_tokenizer(texts(), opts.vocab_size, opts.min_frequency, show_progress=opts.progress)
        if seen["documents"] == 0:
            raise ValueError("no training documents to train a tokenizer on (sources empty, or every document "
                             "fell into validation/test): add data or change --splits")
        eos_token, _ = find_eos(tokenizer, opts.eos_token)
        entry = {"kind": "byte-level BPE, trained", "requested_vocab_size": opts.vocab_size,
                 "min_frequency": opts.min_frequency, "train_documents": seen["documents"],
                 "train_chars": seen["chars"]}
        configured = {}
    else:
        path = tokenizer_path(opts.tokenizer)
        tokenizer = load_tokenizer(path)
        eos_token, _ = find_eos(tokenizer, opts.eos_token, path)
        configured = configured_tokens(path)  # keep a given tokenizer's own BOS and pad tokens
        entry = {"kind": "given", "path": str(opts.tokenizer)}
    seconds = time.perf_counter() - start
    written = save_tokenizer(tokenizer, out, eos_token=eos_token, **configured)
    saved = load_tokenizer(written)  # hash what was written
    return saved, {**entry, "vocab_size": saved.get_vocab_size(with_added_tokens=True), "eos_token": eos_token,
                   "eos_id": saved.token_to_id(eos_token), "special_token_ids": special_token_ids(out),
                   "hash": tokenizer_hash(saved), "seconds": round(seconds, 3)}


def tokenizer_path(spec: str) -> Path:
    """The tokenizer ``BuildOptions.tokenizer`` names: ``zoo:NAME`` is the tokenizer of the shipped zoo model
    ``NAME`` (``linmem.zoo``), anything else a ``tokenizer.json`` or a folder holding one."""
    if spec.startswith(ZOO_PREFIX):
        return zoo_dir.path(spec[len(ZOO_PREFIX):])
    return Path(spec)


def _count_tree() -> defaultdict:
    return defaultdict(lambda: defaultdict(lambda: {"documents": 0, "tokens": 0, "chars": 0}))


def _count(entry: dict[str, int], tokens: int, chars: int) -> None:
    entry["documents"] += 1
    entry["tokens"] += tokens
    entry["chars"] += chars


def _write_shards(sources: Sequence[Source], out: Path, opts: BuildOptions, tokenizer: Tokenizer, eos_id: int):
    """Tokenize every document into its split's shards; returns ``(shards per split, source names, counts,
    skipped)``."""
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    writers = {s: ShardWriter(out, s, dtype, eos_id, opts.shard_tokens) for s in SPLITS}
    source_names: list[str] = []
    seen: dict[str, str] = {}
    counts, skipped = _count_tree(), 0
    docs = _documents(sources, "tokenize", opts.progress)
    while batch := list(islice(docs, ENCODE_BATCH)):
        kept = [d for d in batch if d.text.strip()]
        skipped += len(batch) - len(kept)
        for doc, enc in zip(kept, tokenizer.encode_batch([d.text for d in kept], add_special_tokens=False)):
            if doc.source_id in seen:
                raise ValueError(f"duplicate source_id {doc.source_id!r} (sources {seen[doc.source_id]!r} and "
                                 f"{doc.source!r}): give the sources distinct names or ids")
            seen[doc.source_id] = doc.source
            if doc.source not in source_names:
                source_names.append(doc.source)
            split = split_of(doc.source_id, opts.fractions, opts.salt)
            writers[split].add(np.asarray(enc.ids), doc.source_id, source_names.index(doc.source))
            _count(counts[doc.source][split], tokens=len(enc.ids) + 1, chars=len(doc.text))
        del batch, kept  # one batch of documents in memory at a time, not two
    return {s: w.close() for s, w in writers.items()}, source_names, counts, skipped


def _totals(counts) -> dict[str, Any]:
    """Documents / tokens / chars: total, by split and by source (tokens include one EOS per document)."""
    out: dict[str, Any] = {}
    for key in ("documents", "tokens", "chars"):
        by_split = {s: sum(per[s][key] for per in counts.values()) for s in SPLITS}
        by_source = {src: sum(c[key] for c in per.values()) for src, per in counts.items()}
        out[key] = {"total": sum(by_split.values()), "by_split": by_split, "by_source": by_source}
    return out


def build_dataset(sources: Sequence[Source], out_dir: str | Path, options: BuildOptions | None = None,
                  source_specs: Sequence[str] | None = None) -> dict[str, Any]:
    """Build the dataset folder ``out_dir`` from ``sources`` (see the module docstring); returns the data card."""
    opts, out, start = options or BuildOptions(), Path(out_dir), time.perf_counter()
    if not sources:
        raise ValueError("no sources given")
    if opts.tokenizer != "train":
        load_tokenizer(tokenizer_path(opts.tokenizer))  # a bad path or name fails before the old dataset goes
    out.mkdir(parents=True, exist_ok=True)
    remove_shards(out)  # the index goes first: from here until the end the folder is not a dataset
    (out / CARD_NAME).unlink(missing_ok=True)
    tokenizer, tok = _prepare_tokenizer(sources, out, opts)
    splits, source_names, counts, skipped = _write_shards(sources, out, opts, tokenizer, tok["eos_id"])
    card = {
        "created_by": "linmem data build",
        "sources": list(source_specs or [s.name for s in sources]),
        "split_fractions": opts.fractions.as_dict(),
        "split_salt": opts.salt,
        "tokenizer": tok,
        **_totals(counts),
        "by_source": {src: {s: dict(per[s]) for s in SPLITS} for src, per in counts.items()},
        "skipped_empty_documents": skipped,
        "shards": {s: len(entries) for s, entries in splits.items()},
        "python": sys.version.split()[0],
        "build_seconds": round(time.perf_counter() - start, 3),
    }
    write_json_atomic(out / CARD_NAME, card)
    meta = {"dtype": token_dtype(tok["vocab_size"]).str, "vocab_size": tok["vocab_size"], "eos_id": tok["eos_id"],
            "special_token_ids": tok["special_token_ids"], "tokenizer_hash": tok["hash"],
            "tokenizer": "tokenizer.json", "source_names": source_names}
    write_index(out, meta, splits)
    return card
