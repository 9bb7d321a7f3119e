"""Document sources: plain-text files or folders, JSONL, parquet, and ``datasets`` folders saved on disk.

Every document carries a stable ``source_id`` that does not depend on where the data lies on disk (a path relative
to the source's root, a row index, or an id field), because splits hash it and the memory lab splits sources into
development and confirmation sets by it. ``open_source(spec)`` turns a CLI spec (a built-in name or a path) into a
``Source``.

A document of any size is tokenized in pieces (``Document.pieces``): a text file is read in chunks and never held
whole, so that one huge single-line file costs no more memory than many small ones. A text file must be UTF-8
without NUL bytes: ``FileDocument.problem`` names a binary or non-UTF-8 file, and reading one raises that message.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol, runtime_checkable

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
PIECE_CHARS = 1 << 14  # characters per tokenized piece of a document: bounds the tokenizer's memory per piece
_LAST_CUT = re.compile(r"[\s\S]*\s(?=\S)")  # up to the last whitespace character that precedes a non-whitespace one


def text_pieces(chunks: Iterable[str], max_chars: int = PIECE_CHARS) -> Iterator[str]:
    """The text that ``chunks`` spell, cut into pieces of at most ``max_chars`` characters.

    A cut falls right before the last whitespace character of a run that is followed by a non-whitespace one (so a
    piece after the first starts like `` word`` or ``\\nword``). A byte-level BPE tokenizer (linmem's, GPT-2's)
    pre-splits text there anyway, so its tokens of the pieces equal its tokens of the whole text. Only a span of
    ``max_chars`` characters without such a place is cut hard, in the middle of a word, where the tokens may differ;
    a tokenizer that treats the start of every text specially (a SentencePiece prefix) may differ once per piece.
    """
    text, start = "", 0
    for chunk in chunks:
        text = text[start:] + chunk
        start = 0
        while len(text) - start > max_chars:
            found = _LAST_CUT.match(text, start + 1, start + max_chars + 1)
            cut = found.end() - 1 if found else start + max_chars
            yield text[start:cut]
            start = cut
    if len(text) > start:
        yield text[start:]


@dataclass(frozen=True)
class Document:
    """One document: ``source`` names its collection (for counts), ``source_id`` is unique and stable."""

    source: str
    source_id: str
    text: str

    def pieces(self, max_chars: int = PIECE_CHARS) -> Iterator[str]:
        """The text in pieces of at most ``max_chars`` characters (``text_pieces``)."""
        return text_pieces([self.text], max_chars)

    def problem(self) -> str | None:
        """Why the text cannot be read (never, for text in memory)."""
        return None

    def blank(self) -> bool:
        """Whether the text is empty or whitespace only."""
        return not self.text.strip()


class UnreadableText(ValueError):
    """A text file that is binary (NUL bytes) or not UTF-8; the message names the file."""


@dataclass(frozen=True)
class FileDocument:
    """One text file as one document, read only when used: ``pieces`` streams it in chunks, ``text`` reads it whole.

    A NUL byte (a binary file, or UTF-16 text) or bytes that are not UTF-8 raise ``UnreadableText``; ``problem``
    says so without raising.
    """

    source: str
    source_id: str
    path: Path

    def chunks(self, chars: int = PIECE_CHARS) -> Iterator[str]:
        """The file's text in chunks of about ``chars`` characters."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with open(self.path, "rb") as f:
            while data := f.read(chars):
                if (nul := data.find(0)) >= 0:
                    raise UnreadableText(f"{self.path}: NUL byte at offset {offset + nul}: a binary file (or UTF-16 "
                                         f"text), not UTF-8 text; remove it from the sources or convert it")
                try:
                    yield decoder.decode(data)
                except UnicodeDecodeError as e:
                    at = offset + len(data) - len(e.object) + e.start  # the decoder may hold a character's start
                    raise self._not_utf8(f"byte 0x{e.object[e.start]:02x} at offset {at}") from None
                offset += len(data)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise self._not_utf8("it ends inside a character") from None

    def _not_utf8(self, where: str) -> UnreadableText:
        return UnreadableText(f"{self.path}: not UTF-8 text ({where}); convert it to UTF-8 (iconv -f latin1 -t "
                              f"utf-8)")

    @property
    def text(self) -> str:
        return "".join(self.chunks())

    def pieces(self, max_chars: int = PIECE_CHARS) -> Iterator[str]:
        """The text in pieces of at most ``max_chars`` characters (``text_pieces``), read as they are asked for."""
        return text_pieces(self.chunks(max_chars), max_chars)

    @cached_property
    def _scan(self) -> tuple[str | None, bool]:
        blank = True
        try:
            for chunk in self.chunks():
                blank = blank and not chunk.strip()
        except UnreadableText as e:
            return str(e), blank
        return None, blank

    def problem(self) -> str | None:
        """Why the file cannot be read as text (``UnreadableText``'s message), or None; reads it through once."""
        return self._scan[0]

    def blank(self) -> bool:
        """Whether the file is empty or whitespace only."""
        return self._scan[1]


@runtime_checkable
class Source(Protocol):
    """Anything with a ``name`` that yields documents in a deterministic order (and can do so again)."""

    name: str

    def documents(self) -> Iterator[Document | FileDocument]: ...


class SourceUnavailable(FileNotFoundError):
    """An optional source (a built-in corpus or a reader's extra) is not installed; the message says how."""


def _record_text(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object per line; got {type(record).__name__}")
    if text_field not in record:
        fields = ", ".join(sorted(map(str, record))[:12]) or "none"
        raise ValueError(f"{where}: no text field {text_field!r} (fields: {fields}); choose one with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} must be a string; got {type(text).__name__}")
    return text


def _record_id(record: dict, id_field: str | None, fallback: str, where: str) -> str:
    if id_field is None:
        return fallback
    if record.get(id_field) is None:
        raise ValueError(f"{where}: no id field {id_field!r}; choose one with --id-field or leave it out")
    return str(record[id_field])


@dataclass
class TextFile:
    """One plain-text file as one document (a ``FileDocument``, read when used); ``source_id`` is the file's name
    (or ``name`` when given)."""

    path: Path
    name: str = ""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.name = self.name or self.path.name

    def documents(self) -> Iterator[FileDocument]:
        yield FileDocument(self.name, self.name, self.path)


@dataclass
class RecordSource:
    """A file or folder of records (``path``) whose text is the field ``text_field`` and whose ids, when
    ``id_field`` is given, that field's values; documents count under ``name`` (default: the path's name)."""

    path: Path
    text_field: str = "text"
    id_field: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.name = self.name or self.path.name


@dataclass
class Folder(RecordSource):
    """Every known file under a folder (sorted, recursive): text files, JSONL and parquet, each read as by
    ``open_path``. Documents count under the folder's name; ids start with ``FOLDER/relative/path``.
    """

    def files(self) -> list[Path]:
        known = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
        return sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix.lower() in known)

    def documents(self) -> Iterator[Document | FileDocument]:
        for file in self.files():
            rel = file.relative_to(self.path).as_posix()
            for doc in open_path(file, self.text_field, self.id_field, name=f"{self.name}/{rel}").documents():
                yield dataclasses.replace(doc, source=self.name)


@dataclass
class JsonlFile(RecordSource):
    """JSON Lines: one object per line with a text field (``text_field``) and optionally an id field.

    ``source_id`` is ``NAME:LINE`` (1-based line number) or ``NAME:ID`` with ``id_field``. Blank lines are skipped.
    """

    def documents(self) -> Iterator[Document]:
        try:
            yield from self._records()
        except UnicodeDecodeError as e:
            raise UnreadableText(f"{self.path}: not UTF-8 ({e.reason}); convert it to UTF-8") from None

    def _records(self) -> Iterator[Document]:
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                text = _record_text(record, self.text_field, where)
                key = _record_id(record, self.id_field, str(lineno), where)
                yield Document(self.name, f"{self.name}:{key}", text)


@dataclass
class ParquetFile(RecordSource):
    """A parquet file (needs ``pyarrow``): one document per row; ``source_id`` is ``NAME:ROW`` or ``NAME:ID``."""

    def documents(self) -> Iterator[Document]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SourceUnavailable(f"reading {self.path} needs pyarrow: pip install 'linmem[data]'") from None
        table = pq.ParquetFile(self.path)
        columns = table.schema_arrow.names
        wanted = [self.text_field] + ([self.id_field] if self.id_field else [])
        for col in wanted:
            if col not in columns:
                raise ValueError(f"{self.path}: no column {col!r} (columns: {', '.join(columns)}); "
                                 f"choose one with --text-field / --id-field")
        row = 0
        for batch in table.iter_batches(columns=wanted, batch_size=1024):
            for record in batch.to_pylist():
                where = f"{self.path}: row {row}"
                text = _record_text(record, self.text_field, where)
                yield Document(self.name, f"{self.name}:{_record_id(record, self.id_field, str(row), where)}", text)
                row += 1


@dataclass
class DiskDataset(RecordSource):
    """A Hugging Face ``datasets`` folder written by ``save_to_disk`` (needs ``pyarrow``), read straight from its
    Arrow files in record batches: memory holds one batch of rows, whatever the dataset's size.

    A ``DatasetDict`` (``dataset_dict.json``) yields its splits in sorted order; each split's ``state.json``
    lists its Arrow files in order. ``source_id`` is ``NAME[/SPLIT]:ROW`` or ``...:ID``. The dataset's own splits
    are not kept: linmem splits every source by document hash.
    """

    def parts(self) -> list[tuple[str | None, Path]]:
        """``(split or None, folder)`` of each saved dataset, splits sorted."""
        index = self.path / "dataset_dict.json"
        if index.is_file():
            splits = json.loads(index.read_text(encoding="utf-8"))["splits"]
            return [(split, self.path / split) for split in sorted(splits)]
        return [(None, self.path)]

    def documents(self) -> Iterator[Document]:
        try:
            import pyarrow as pa
        except ImportError:
            raise SourceUnavailable(f"reading {self.path} needs pyarrow: pip install 'linmem[data]'") from None
        wanted = [self.text_field] + ([self.id_field] if self.id_field else [])
        for split, folder in self.parts():
            prefix = self.name if split is None else f"{self.name}/{split}"
            state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
            row = 0
            for entry in state["_data_files"]:
                with pa.memory_map(str(folder / entry["filename"])) as file:
                    reader = pa.ipc.open_stream(file)
                    columns = reader.schema.names
                    for col in wanted:
                        if col not in columns:
                            raise ValueError(f"{self.path} ({split or 'dataset'}): no column {col!r} (columns: "
                                             f"{', '.join(columns)}); choose one with --text-field / --id-field")
                    for batch in reader:
                        for record in batch.select(wanted).to_pylist():
                            where = f"{self.path} ({prefix}): row {row}"
                            text = _record_text(record, self.text_field, where)
                            key = _record_id(record, self.id_field, str(row), where)
                            yield Document(self.name, f"{prefix}:{key}", text)
                            row += 1


def is_disk_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json",
                                                                "state.json"))


def open_path(path: str | Path, text_field: str = "text", id_field: str | None = None, name: str = "") -> Source:
    """The reader for a path: a ``datasets`` folder, a folder of files, or a file chosen by its suffix."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"source {str(path)!r}: no such file or folder")
    if is_disk_dataset(path):
        return DiskDataset(path, text_field, id_field, name)
    if path.is_dir():
        return Folder(path, text_field, id_field, name)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return JsonlFile(path, text_field, id_field, name)
    if suffix in PARQUET_SUFFIXES:
        return ParquetFile(path, text_field, id_field, name)
    if suffix in TEXT_SUFFIXES:
        return TextFile(path, name)
    known = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise ValueError(f"source {str(path)!r}: unknown file type {suffix or '(none)'!r}; expected one of {known}, "
                     f"a folder of text files, or a datasets folder")
