"""``linmem data build``: sources -> tokenizer -> token shards + index + data card, in one folder.

The folder it writes::

    tokenizer.json, tokenizer_config.json   the tokenizer (AutoTokenizer.from_pretrained(folder) loads it)
    train-00000.bin ... test-00000.bin      token shards (see ``shards``)
    data_card.json                          what went in: documents, tokens and characters per source and split
    index.json                              written last: its presence means the build finished

A trained tokenizer sees only the training split. Documents that are empty after stripping are skipped (and
counted). Two documents with the same ``source_id`` stop the build: ids must be unique for the splits to mean
anything. A text file that is binary or not UTF-8 stops the build with the file named, or with
``skip_unreadable`` is left out, named in a warning and in the data card. Every document is tokenized in pieces
(``Document.pieces``), so one huge document costs no more memory than a piece.

The folder's files are the user's unless linmem wrote them: its marker's ``written`` list says so
(``linmem.io.folders``), or, in a folder without a marker, a linmem ``index.json`` lists them. A build refuses,
before any work, a folder holding a file it would replace that is not linmem's. It writes the new dataset into the
hidden staging folder ``.tmp-data-build`` inside the folder and renames its files in only when it is complete (the
index last, Ctrl-C held back meanwhile), then removes the old dataset's shards the new index does not list; an
interrupted or failed build leaves the old dataset as it was.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from linmem.data.shards import (
    DEFAULT_SHARD_TOKENS,
    INDEX_NAME,
    SHARD_FILE,
    ShardWriter,
    read_index,
    shard_files,
    token_dtype,
    write_index,
)
from linmem.data.sources import Document, FileDocument, Source, UnreadableText
from linmem.data.splits import SPLITS, SplitFractions, split_of
from linmem.data.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    find_eos,
    load_tokenizer,
    save_tokenizer,
    special_token_ids,
    token_id,
    tokenizer_hash,
    train_tokenizer,
    wrap_tokenizer,
)
from linmem.io import zoo_dir
from linmem.io.atomic import fsync_dir, write_json_atomic
from linmem.io.folders import MARKER, mark_output_folder, output_file, read_marker, short_list, written_names
from linmem.io.zoo_dir import ZOO_PREFIX

CARD_NAME = "data_card.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
BUILD_FILES = (INDEX_NAME, CARD_NAME, *TOKENIZER_FILES)  # besides the shards
STAGING_NAME = ".tmp-data-build"
STAGING_KIND = "data build staging"
ENCODE_BATCH = 256  # pieces per encode_batch call
ENCODE_CHARS = 1 << 20  # characters per encode_batch call, at most about this many


@dataclass
class BuildOptions:
    """How to build: ``tokenizer`` is ``"train"``, a path to a ``tokenizer.json`` (or a folder holding one) or
    ``zoo:NAME`` (the tokenizer of a shipped zoo model). ``skip_unreadable``: leave out text files that are binary
    or not UTF-8 (with a warning) instead of stopping."""

    tokenizer: str = "train"
    vocab_size: int = 8192
    min_frequency: int = 2
    fractions: SplitFractions = SplitFractions()
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    eos_token: str | None = None
    salt: str = "linmem"
    progress: bool = True
    skip_unreadable: bool = False


AnyDocument = Document | FileDocument


def _documents(sources: Sequence[Source], desc: str, progress: bool) -> Iterator[AnyDocument]:
    for source in sources:
        yield from tqdm(source.documents(), desc=f"{desc} {source.name}", unit=" docs", disable=not progress,
                        leave=False)


def _readable(doc: AnyDocument, opts: BuildOptions, warn: bool = False) -> bool:
    """Whether ``doc`` can be read as text; a file that cannot stops the build, or with ``skip_unreadable`` is
    left out (named on stderr with ``warn``)."""
    problem = doc.problem()
    if problem is None:
        return True
    if not opts.skip_unreadable:
        raise UnreadableText(f"{problem}, or pass --skip-unreadable to leave such files out")
    if warn:
        print(f"warning: {problem.split(';')[0]}; left out (--skip-unreadable)", file=sys.stderr, flush=True)
    return False


def _prepare_tokenizer(sources: Sequence[Source], out: Path, opts: BuildOptions) -> tuple[Tokenizer, dict]:
    """Train (on the training split) or load the tokenizer and save it into ``out``; returns the engine of the
    tokenizer as saved and its data-card entry."""
    start = time.perf_counter()
    if opts.tokenizer == "train":
        seen = {"documents": 0, "chars": 0}

        def texts() -> Iterator[str]:
            for doc in _documents(sources, "tokenizer", opts.progress):
                if split_of(doc.source_id, opts.fractions, opts.salt) != "train" or not _readable(doc, opts):
                    continue
                if not doc.blank():
                    seen["documents"] += 1
                    for piece in doc.pieces():
                        seen["chars"] += len(piece)
                        yield piece

        engine = train_tokenizer(texts(), opts.vocab_size, opts.min_frequency, show_progress=opts.progress)
        if seen["documents"] == 0:
            raise ValueError("no training documents to train a tokenizer on (sources empty, or every document "
                             "fell into validation/test): add data or change --splits")
        eos_token = opts.eos_token or EOS_TOKEN  # one of its special tokens (wrap_tokenizer checks it is there)
        entry = {"kind": "byte-level BPE, trained", "requested_vocab_size": opts.vocab_size,
                 "min_frequency": opts.min_frequency, "train_documents": seen["documents"],
                 "train_chars": seen["chars"]}
        specials = {}
    else:
        given = load_tokenizer(tokenizer_path(opts.tokenizer))
        engine = given.backend_tokenizer
        eos_token, _ = find_eos(given, opts.eos_token)
        specials = {"bos_token": given.bos_token, "pad_token": given.pad_token or PAD_TOKEN}  # keep its own
        entry = {"kind": "given", "path": str(opts.tokenizer)}
    seconds = time.perf_counter() - start
    saved = load_tokenizer(save_tokenizer(wrap_tokenizer(engine, eos_token, **specials), out))  # as written
    return saved.backend_tokenizer, {
        **entry, "vocab_size": len(saved), "eos_token": eos_token, "eos_id": token_id(saved, eos_token),
        "special_token_ids": special_token_ids(out), "hash": tokenizer_hash(saved), "seconds": round(seconds, 3)}


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


class Piece(NamedTuple):
    """A tokenized piece of a document: its ids, its length in characters, and whether it is the first or last."""

    doc: AnyDocument
    ids: list[int]
    chars: int
    first: bool
    last: bool


def _pieces(docs: Iterable[AnyDocument]) -> Iterator[tuple[AnyDocument, str, bool, bool]]:
    """``(document, piece text, first, last)`` for every piece of every document, in order."""
    for doc in docs:
        pieces = doc.pieces()
        piece, first = next(pieces, None), True
        while piece is not None:
            following = next(pieces, None)
            yield doc, piece, first, following is None
            piece, first = following, False


def _encoded(docs: Iterable[AnyDocument], tokenizer: Tokenizer) -> Iterator[Piece]:
    """Every piece of ``docs`` tokenized, in order, ``encode_batch`` by ``encode_batch`` (``ENCODE_BATCH`` pieces
    or ``ENCODE_CHARS`` characters, whichever comes first)."""
    batch: list[tuple[AnyDocument, str, bool, bool]] = []
    chars = 0
    for item in _pieces(docs):
        batch.append(item)
        chars += len(item[1])
        if len(batch) == ENCODE_BATCH or chars >= ENCODE_CHARS:
            yield from _encode(batch, tokenizer)
            batch, chars = [], 0
    yield from _encode(batch, tokenizer)


def _encode(batch: list[tuple[AnyDocument, str, bool, bool]], tokenizer: Tokenizer) -> Iterator[Piece]:
    encodings = tokenizer.encode_batch([text for _, text, _, _ in batch], add_special_tokens=False)
    for (doc, text, first, last), enc in zip(batch, encodings):
        yield Piece(doc, enc.ids, len(text), first, last)


class SplitWriters:
    """The shard writers of the three splits, and the counts of what went into them."""

    def __init__(self, out: Path, opts: BuildOptions, vocab_size: int, eos_id: int):
        self.opts, dtype = opts, token_dtype(vocab_size)
        self.writers = {s: ShardWriter(out, s, dtype, eos_id, opts.shard_tokens) for s in SPLITS}
        self.source_names: list[str] = []
        self.seen: dict[str, str] = {}
        self.counts = _count_tree()
        self.split, self.tokens, self.chars = "", 0, 0  # of the document being written

    def add(self, piece: Piece) -> None:
        """Append ``piece`` to its document's split (starting the document at its first piece)."""
        doc = piece.doc
        if piece.first:
            if doc.source_id in self.seen:
                raise ValueError(f"duplicate source_id {doc.source_id!r} (sources {self.seen[doc.source_id]!r} and "
                                 f"{doc.source!r}): give the sources distinct names or ids")
            self.seen[doc.source_id] = doc.source
            if doc.source not in self.source_names:
                self.source_names.append(doc.source)
            self.split = split_of(doc.source_id, self.opts.fractions, self.opts.salt)
            self.writers[self.split].start(doc.source_id, self.source_names.index(doc.source))
            self.tokens = self.chars = 0
        self.writers[self.split].extend(np.asarray(piece.ids))
        self.tokens, self.chars = self.tokens + len(piece.ids), self.chars + piece.chars
        if piece.last:
            self.writers[self.split].end()
            _count(self.counts[doc.source][self.split], tokens=self.tokens + 1, chars=self.chars)

    def close(self) -> dict[str, list[dict[str, Any]]]:
        return {s: w.close() for s, w in self.writers.items()}


def _write_shards(sources: Sequence[Source], out: Path, opts: BuildOptions, tokenizer: Tokenizer, eos_id: int):
    """Tokenize every document into its split's shards; returns ``(shards per split, source names, counts,
    skipped: {"empty": count, "unreadable": [source ids]})``."""
    writers = SplitWriters(out, opts, tokenizer.get_vocab_size(with_added_tokens=True), eos_id)
    skipped: dict[str, Any] = {"empty": 0, "unreadable": []}

    def kept() -> Iterator[AnyDocument]:
        for doc in _documents(sources, "tokenize", opts.progress):
            if not _readable(doc, opts, warn=True):
                skipped["unreadable"].append(doc.source_id)
            elif doc.blank():
                skipped["empty"] += 1
            else:
                yield doc

    for piece in _encoded(kept(), tokenizer):
        writers.add(piece)
    return writers.close(), writers.source_names, writers.counts, skipped


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
    opts, out = options or BuildOptions(), Path(out_dir)
    if not sources:
        raise ValueError("no sources given")
    if opts.tokenizer != "train":
        load_tokenizer(tokenizer_path(opts.tokenizer))  # a bad path or name fails before any work
    out.mkdir(parents=True, exist_ok=True)
    refuse_foreign(out, [*BUILD_FILES, *(p.name for p in out.iterdir() if SHARD_FILE.fullmatch(p.name))])
    with _staging(out) as stage:
        card = _build_into(stage, sources, opts, source_specs)
        _install(stage, out)
    return card


def _build_into(stage: Path, sources: Sequence[Source], opts: BuildOptions,
                source_specs: Sequence[str] | None) -> dict[str, Any]:
    """Write the whole dataset (tokenizer, shards, card, index last) into the folder ``stage``."""
    start = time.perf_counter()
    tokenizer, tok = _prepare_tokenizer(sources, stage, opts)
    splits, source_names, counts, skipped = _write_shards(sources, stage, opts, tokenizer, tok["eos_id"])
    card = {
        "created_by": "linmem data build",
        "sources": list(source_specs or [s.name for s in sources]),
        "split_fractions": opts.fractions.as_dict(),
        "split_salt": opts.salt,
        "tokenizer": tok,
        **_totals(counts),
        "by_source": {src: {s: dict(per[s]) for s in SPLITS} for src, per in counts.items()},
        "skipped_empty_documents": skipped["empty"],
        "skipped_unreadable_files": skipped["unreadable"],
        "shards": {s: len(entries) for s, entries in splits.items()},
        "python": sys.version.split()[0],
        "build_seconds": round(time.perf_counter() - start, 3),
    }
    write_json_atomic(stage / CARD_NAME, card)
    meta = {"dtype": token_dtype(tok["vocab_size"]).str, "vocab_size": tok["vocab_size"], "eos_id": tok["eos_id"],
            "special_token_ids": tok["special_token_ids"], "tokenizer_hash": tok["hash"],
            "tokenizer": "tokenizer.json", "source_names": source_names}
    write_index(stage, meta, splits)
    return card


def linmem_files(out: Path) -> set[str]:
    """The names in ``out`` that linmem wrote, which a build may replace: those its marker's ``written`` lists, or
    in a folder without a marker those a linmem ``index.json`` vouches for (itself, its shards, the tokenizer files
    and the data card). A symbolic link never counts."""
    marker = read_marker(out)
    if marker is not None:
        names = written_names(out, marker)
    else:
        try:
            names = {*BUILD_FILES, *shard_files(read_index(out))}
        except (FileNotFoundError, ValueError):  # no index, or one that is not linmem's: it vouches for nothing
            names = set()
    return {name for name in names if not (out / name).is_symlink()}


def refuse_foreign(out: Path, names: Iterable[str]) -> None:
    """``ValueError`` if any of ``names`` exists in ``out`` and is not linmem's (``linmem_files``)."""
    own = linmem_files(out)
    clashes = sorted({n for n in names if os.path.lexists(out / n) and n not in own})
    if clashes:
        raise ValueError(f"{out}: holds {short_list(clashes)}, which linmem did not write and a dataset build would "
                         f"replace; move them away or choose another output folder")


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """The empty staging folder ``out/.tmp-data-build`` (one left by a killed build is removed first), removed
    with what is left in it when the block ends."""
    stage = out / STAGING_NAME
    if os.path.lexists(stage):
        marker = read_marker(stage) if stage.is_dir() and not stage.is_symlink() else None
        if marker is None or marker["kind"] != STAGING_KIND:
            raise ValueError(f"{stage}: not a staging folder of linmem's, where a dataset build stages its files; "
                             f"move it away")
        shutil.rmtree(stage)
    stage.mkdir()
    mark_output_folder(stage, STAGING_KIND)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _install(stage: Path, out: Path) -> None:
    """Rename the complete dataset in ``stage`` into ``out`` (the index last; the old index goes first, so that
    no moment shows an index beside shards it does not describe), then remove the old dataset's shards the new one
    does not have. Ctrl-C waits until this is done."""
    new = sorted(p.name for p in stage.iterdir() if p.name != MARKER)
    refuse_foreign(out, new)  # again: a file may have appeared in the meantime
    old_shards = _old_shards(out) - set(new)
    if read_marker(out) is not None:
        for name in new:
            output_file(out, name)  # recorded in the marker's written list before the rename
    with _interrupts_held():
        (out / INDEX_NAME).unlink(missing_ok=True)
        for name in sorted(new, key=lambda n: n == INDEX_NAME):
            os.replace(stage / name, out / name)
        fsync_dir(out)
        for name in old_shards:
            (out / name).unlink(missing_ok=True)
    _forget(out, old_shards)


def _old_shards(out: Path) -> set[str]:
    """The shards of the dataset in ``out`` that are linmem's (none if its index is not)."""
    own = linmem_files(out)
    if INDEX_NAME not in own:
        return set()
    try:
        return shard_files(read_index(out)) & own
    except (FileNotFoundError, ValueError):
        return set()


def _forget(out: Path, names: set[str]) -> None:
    """Drop ``names`` (files removed) from the marker's ``written`` list, so that a user's later file of the same
    name is not taken for linmem's."""
    marker = read_marker(out)
    if marker is not None and names:
        mark_output_folder(out, marker["kind"], marker.get("foreign", []), written_names(out, marker) - names)


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block ends, then raise it: the renames of a build are not cut in two.
    Outside the main thread, where no signal arrives, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
