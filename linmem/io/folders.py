"""Output folders: a command writes only into a folder it made, an empty one, or one the user lets it write into.

Every linmem command that writes into a folder the user names (``train --out``, ``demo --out``, ``eval --out``,
``probe --out``, ``data build --out``, ``zoo ship``'s zoo folder, FLA conversion) first calls
``prepare_output_folder``. It creates the folder, or accepts it when it is empty or holds the marker file
``.linmem-output.json`` that linmem writes into the folders it creates (naming the command kind). Any other
non-empty folder is refused unless ``overwrite``; then linmem writes its own files by name and the files that were
there before are recorded in the marker as ``foreign`` and never deleted.

Subfolders a command replaces as a whole (a run's ``model/``, a zoo model) go through ``replace_folder``, which
removes the old folder only when everything in it is linmem's: files its manifest lists or that the new version
also writes, and subfolders linmem made without foreign files. ``staged_folder`` builds such a folder aside and
hands it to ``replace_folder`` once complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from linmem.io.atomic import fsync_dir, write_json_atomic
from linmem.io.manifest import MANIFEST_NAME, read_manifest

MARKER = ".linmem-output.json"


def read_marker(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of a folder linmem made (``{"kind": ..., "foreign": [...]}``), or None."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("kind"), str) else None


def mark_output_folder(folder: str | os.PathLike, kind: str, foreign: Iterable[str] = ()) -> None:
    """Write the marker that makes ``folder`` command ``kind``'s own (``foreign``: entries that are not)."""
    write_json_atomic(Path(folder) / MARKER, {"kind": kind, "written_by": f"linmem {kind}", "foreign": sorted(foreign)})


def prepare_output_folder(path: str | os.PathLike, *, overwrite: bool, kind: str) -> Path:
    """Make ``path`` ready for command ``kind`` (``"train"``, ``"eval"``, ...) to write into, and return it.

    Creates it (with parents) when absent; accepts an empty folder or one linmem made for the same ``kind``.
    Refuses (``ValueError``) a file, a folder made by another linmem command, or a non-empty folder linmem did not
    make, unless ``overwrite``: then the folder is adopted, its present entries recorded as foreign (never removed
    by ``replace_folder``). Never deletes anything."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder}: is a file, not a folder; choose another output folder")
    if not folder.exists():
        folder.mkdir(parents=True)
        mark_output_folder(folder, kind)
        return folder
    marker = read_marker(folder)
    entries = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    if marker is not None and marker["kind"] == kind:
        return folder
    if not entries:
        mark_output_folder(folder, kind, marker.get("foreign", []) if marker else [])
        return folder
    if not overwrite:
        owner = (f"was written by linmem {marker['kind']}, not linmem {kind}" if marker is not None else
                 f"is not empty ({short_list(entries)}) and was not made by linmem (no {MARKER})")
        raise ValueError(f"{folder}: {owner}; choose a new or empty folder, or pass --overwrite to write "
                         f"linmem's files into it (other files are kept)")
    foreign = set(marker.get("foreign", [])) if marker is not None else set(entries)
    mark_output_folder(folder, kind, foreign)
    return folder


def short_list(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def foreign_entries(folder: str | os.PathLike, names: Iterable[str] = ()) -> list[str]:
    """Entries of ``folder`` linmem may not delete: files that are neither in ``names`` (what the replacement
    writes) nor listed in the folder's manifest, and subfolders that are not linmem-made without foreign files."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    own = set(names) | {MANIFEST_NAME, MARKER}
    if (folder / MANIFEST_NAME).is_file():
        try:
            own |= set(read_manifest(folder))
        except ValueError:
            pass  # a damaged manifest vouches for nothing
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            marker = read_marker(entry)
            if marker is None or marker.get("foreign") or foreign_entries(entry):
                found.append(entry.name)
        elif entry.name not in own:
            found.append(entry.name)
    return found


def check_replaceable(folder: str | os.PathLike, names: Iterable[str] = ()) -> None:
    """``ValueError`` if ``folder`` exists and holds anything ``foreign_entries`` would keep (so that a command
    can refuse before it starts work, not after)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder}: is a file where linmem writes a folder; move it away")
    foreign = foreign_entries(folder, names)
    if foreign:
        raise ValueError(f"{folder}: holds files linmem did not write ({short_list(foreign)}); linmem replaces this "
                         f"folder as a whole and never deletes such files: move them away or choose another folder")


def replace_folder(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Rename the complete folder ``tmp`` onto ``final``; an old ``final`` is removed only if everything in it is
    linmem's (``check_replaceable`` with the names ``tmp`` holds), else ``ValueError`` and nothing changes."""
    tmp, final = Path(tmp), Path(final)
    check_replaceable(final, (p.name for p in tmp.iterdir()))
    return swap_folder(tmp, final)


def staging_path(final: str | os.PathLike) -> Path:
    """Where ``staged_folder`` builds ``final``: the hidden folder ``.tmp-NAME`` beside it."""
    final = Path(final)
    return final.with_name(f".tmp-{final.name}")


@contextmanager
def staged_folder(final: str | os.PathLike) -> Iterator[Path]:
    """Build the folder ``final`` aside: yields an empty staging folder ``.tmp-NAME`` beside it to write into, and
    when the block ends renames it onto ``final`` with ``replace_folder``, so that ``final`` appears whole or not at
    all. A staging folder left by an interrupted earlier build is removed first, so it cannot fail this one. If the
    block raises, the staging folder is removed and ``final`` is left as it was (absent, or the previous version)."""
    tmp = staging_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:  # an interrupt too: a half-written folder is of no use to the next build
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_folder(tmp, final)


def swap_folder(tmp: Path, final: Path) -> Path:
    """Rename the complete folder ``tmp`` onto ``final``; an old ``final`` is first renamed aside (``.old-NAME``)
    and removed only once ``tmp`` is in place, so ``final`` is always a whole folder."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)
    return final
