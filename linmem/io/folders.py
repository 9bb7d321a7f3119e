"""Output folders: a command writes only into a folder it made, an empty one, or one the user lets it write into.

Every linmem command that writes into a folder the user names (``train --out``, ``demo --out``, ``eval --out``,
``probe --out``, ``data build --out``, ``zoo ship``'s zoo folder, FLA conversion) first calls
``prepare_output_folder``. It creates the folder, or accepts it when it is empty or holds the marker file
``.linmem-output.json`` that linmem writes into the folders it creates (naming the command kind). Any other
non-empty folder is refused unless ``overwrite``; then linmem writes its own files by name and the files that were
there before are recorded in the marker as ``foreign`` and never deleted.

Every file a command writes inside its output folder gets its path from ``output_file``, which refuses a name that
is (or passes through) a symbolic link or leads out of the folder, and refuses to replace an existing file that the
marker's ``written`` list does not name as linmem's (a user's ``results.json`` in a folder adopted with
``--overwrite`` stays untouched); it records the name in ``written`` before the write (a marker of an older linmem,
without ``written``, vouches for every entry it does not list as foreign). ``output_subfolder`` does the same for a
subfolder that another command fills. A command that knows its file names passes them to
``check_output_folder(files=...)`` (which writes nothing, so it can run before torch is imported) or
``prepare_output_folder(files=...)``, so that a refusal comes before any work. ``output_folder`` wraps a whole
run: if the run fails, a folder it created is removed, and a folder that existed keeps what it had and loses only
the files this run wrote.

Subfolders a command replaces as a whole (a run's ``model/``, a zoo model) go through ``replace_folder``, which
removes the old folder only when everything in it is linmem's: files its manifest or marker lists or that the new
version also writes, and subfolders linmem made without foreign files; a folder that is a symbolic link is refused.
``staged_folder`` builds such a folder aside and hands it to ``replace_folder`` once complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from linmem.io.atomic import fsync_dir, write_bytes_atomic, write_json_atomic
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


def mark_output_folder(folder: str | os.PathLike, kind: str, foreign: Iterable[str] = (),
                       written: Iterable[str] = ()) -> None:
    """Write the marker that makes ``folder`` command ``kind``'s own (``foreign``: entries that are not; ``written``:
    names linmem wrote there and may replace)."""
    write_json_atomic(Path(folder) / MARKER, {"kind": kind, "written_by": f"linmem {kind}", "foreign": sorted(foreign),
                                              "written": sorted(written)})


def written_names(folder: str | os.PathLike, marker: dict[str, Any]) -> set[str]:
    """The names ``marker`` (``folder``'s) vouches for as linmem's: its ``written`` list. A marker without one (an
    older linmem's) vouches for every present entry it does not list as foreign, which is what it meant."""
    if isinstance(marker.get("written"), list):
        return {name for name in marker["written"] if isinstance(name, str)}
    foreign = set(marker.get("foreign", []))
    return {p.name for p in Path(folder).iterdir() if p.name not in foreign and p.name != MARKER}


def prepare_output_folder(path: str | os.PathLike, *, overwrite: bool, kind: str, files: Iterable[str] = ()) -> Path:
    """Make ``path`` ready for command ``kind`` (``"train"``, ``"eval"``, ...) to write into, and return it.

    Creates it (with parents) when absent; accepts an empty folder or one linmem made for the same ``kind``.
    Refuses (``ValueError``) a file, a folder made by another linmem command, or a non-empty folder linmem did not
    make, unless ``overwrite``: then the folder is adopted, its present entries recorded as foreign (never removed
    by ``replace_folder``, never replaced by ``output_file``). ``files``: the names the command will write, each
    checked as ``output_file`` checks it, so that a refusal comes before any work. Never deletes anything."""
    folder = Path(path)
    marker = planned_marker(folder, overwrite=overwrite, kind=kind, files=files)
    folder.mkdir(parents=True, exist_ok=True)
    if marker is not None:
        mark_output_folder(folder, kind, *marker)
    return folder


def check_output_folder(path: str | os.PathLike, *, overwrite: bool, kind: str, files: Iterable[str] = ()) -> Path:
    """``ValueError`` wherever ``prepare_output_folder`` would refuse, writing nothing: a command checks its output
    folder with it before its slow imports and its work, and makes the folder only when it starts writing."""
    folder = Path(path)
    planned_marker(folder, overwrite=overwrite, kind=kind, files=files)
    return folder


def planned_marker(folder: Path, *, overwrite: bool, kind: str,
                   files: Iterable[str]) -> tuple[list[str], set[str]] | None:
    """The ``(foreign, written)`` names ``prepare_output_folder`` marks ``folder`` with (None: its marker stays as
    it is), or its ``ValueError``."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder}: is a file, not a folder; choose another output folder")
    if not folder.exists():
        return [], set()
    marker = read_marker(folder)
    entries = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    if marker is not None and marker["kind"] == kind:
        own = written_names(folder, marker)
        check_output_names(folder, files, own)
        return None if "written" in marker else (marker.get("foreign", []), own)
    if not entries:
        return (marker.get("foreign", []) if marker else []), set()
    if not overwrite:
        owner = (f"was written by linmem {marker['kind']}, not linmem {kind}" if marker is not None else
                 f"is not empty ({short_list(entries)}) and was not made by linmem (no {MARKER})")
        raise ValueError(f"{folder}: {owner}; choose a new or empty folder, or pass --overwrite to write "
                         f"linmem's files into it (other files are kept)")
    foreign = marker.get("foreign", []) if marker is not None else entries
    own = written_names(folder, marker) if marker is not None else set()
    check_output_names(folder, files, own)
    return foreign, own


def output_file(folder: str | os.PathLike, name: str) -> Path:
    """The path to write file ``name`` (``"results.json"``, ``"figures/niah.png"``) at inside the output folder
    ``folder`` (prepared by ``prepare_output_folder``), its parent folders made.

    Refuses (``ValueError``, one line) a name that is or passes through a symbolic link, leads out of the folder,
    is a folder, or is an existing file the marker does not list as linmem's (``written``), so that a write never
    lands in a user's file. Records ``name`` in the marker's ``written`` before returning: call it right before
    the write. Inside ``output_folder`` the write counts as this run's (removed if the run fails)."""
    path = record_output(Path(folder), name, folder_wanted=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def output_subfolder(folder: str | os.PathLike, name: str) -> Path:
    """The subfolder ``name`` of the output folder ``folder``, made if absent, for a command that fills it as a
    whole (another command's output folder, a ``staged_folder``). Refuses a name that is or passes through a
    symbolic link, leads out of the folder, or is a file; records ``name`` in the marker's ``written``. Inside
    ``output_folder`` a subfolder this call made is removed if the run fails."""
    path = record_output(Path(folder), name, folder_wanted=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def record_output(folder: Path, name: str, *, folder_wanted: bool) -> Path:
    """``folder / name`` once checked (``checked_output_path``), noted for the runs in progress and recorded in the
    marker's ``written``."""
    marker = read_marker(folder)
    if marker is None:
        raise ValueError(f"{folder}: holds no {MARKER}; linmem writes only into a folder prepare_output_folder made "
                         f"ready")
    own = written_names(folder, marker)
    path = checked_output_path(folder, name, own, folder_wanted=folder_wanted)
    name = path.relative_to(folder).as_posix()
    made = first_missing(path if folder_wanted else path.parent)
    for run in _RUNS:
        run.note(folder, name, path, made)
    if name not in own or "written" not in marker:
        write_json_atomic(folder / MARKER, {**marker, "written": sorted(own | {name})})
    return path


def check_output_subfolder(folder: str | os.PathLike, name: str) -> Path:
    """``folder / name`` once ``output_subfolder`` would accept it (no link on the way, inside ``folder``, not a
    file); writes nothing, so a command can check before its work."""
    return checked_output_path(Path(folder), name, set(), folder_wanted=True)


def check_output_names(folder: Path, names: Iterable[str], own: set[str]) -> None:
    """``ValueError`` for the first of ``names`` that ``output_file`` would refuse (``own``: the marker's names)."""
    for name in names:
        checked_output_path(folder, name, own)


def checked_output_path(folder: Path, name: str, own: set[str], *, folder_wanted: bool = False) -> Path:
    """``folder / name`` once it is known to be a safe place for linmem's file (see ``output_file``), or for its
    subfolder with ``folder_wanted`` (see ``output_subfolder``)."""
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or any(part in (".", "..") for part in parts):
        raise ValueError(f"{name!r}: not a file name inside the output folder {folder}")
    path = folder
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise ValueError(f"{path}: is a symbolic link; linmem does not write through links in its output "
                             f"folder: remove the link or choose another output folder")
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{path}: lies outside the output folder {folder}; choose another output folder")
    if folder_wanted:
        if path.exists() and not path.is_dir():
            raise ValueError(f"{path}: is a file where linmem writes a folder; move it away or choose another output "
                             f"folder")
        return path
    if path.is_dir():
        raise ValueError(f"{path}: is a folder where linmem writes a file; move it away or choose another output "
                         f"folder")
    if path.exists() and not any("/".join(parts[:i]) in own for i in range(1, len(parts) + 1)):
        raise ValueError(f"{path}: was not written by linmem (its {MARKER} does not list it), and linmem never "
                         f"replaces such a file: move it away or choose another output folder")
    return path


def first_missing(folder: Path) -> Path | None:
    """The outermost folder of ``folder`` and its parents that does not exist yet (None: ``folder`` exists)."""
    missing = None
    for candidate in (folder, *folder.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing = candidate
    return missing


def file_signature(path: Path) -> tuple[int, int, int] | None:
    """``(inode, mtime_ns, size)`` of ``path`` (a link itself, not its target), None when absent: a write changes
    it."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@dataclass(eq=False)
class OutputRun:
    """What one run in ``output_folder`` wrote into ``folder``: each name's signature before the run touched it,
    and the subfolders it made."""

    folder: Path
    before: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)
    made: list[Path] = field(default_factory=list)

    def note(self, folder: Path, name: str, path: Path, made: Path | None) -> None:
        if Path(os.path.abspath(folder)) != self.folder:
            return
        self.before.setdefault(name, file_signature(path))
        if made is not None:
            self.made.append(made)

    def undo(self) -> None:
        """Remove the files this run wrote (those whose signature changed) and the subfolders it made."""
        for name, before in self.before.items():
            path = self.folder / name
            if file_signature(path) != before and not path.is_dir():
                path.unlink(missing_ok=True)
        for made in reversed(self.made):
            shutil.rmtree(made, ignore_errors=True)


_RUNS: list[OutputRun] = []  # the runs of output_folder in progress in this process


@contextmanager
def output_folder(path: str | os.PathLike, *, overwrite: bool, kind: str, files: Iterable[str] = ()) -> Iterator[Path]:
    """``prepare_output_folder`` for a whole run: yields the folder; if the block raises (an interrupt too), a
    folder this call created is removed with everything in it, and a folder that existed keeps what it had: only
    the files the run wrote through ``output_file`` go, and the marker returns to what it was."""
    folder = Path(path)
    created = first_missing(Path(os.path.abspath(folder)))
    marker = folder / MARKER
    marker_before = marker.read_bytes() if created is None and marker.is_file() else None
    prepare_output_folder(folder, overwrite=overwrite, kind=kind, files=files)
    run = OutputRun(Path(os.path.abspath(folder)))
    _RUNS.append(run)
    try:
        yield folder
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:
            run.undo()
            if marker_before is None:
                marker.unlink(missing_ok=True)
            else:
                write_bytes_atomic(marker, marker_before)
        raise
    finally:
        _RUNS.remove(run)


def short_list(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def foreign_entries(folder: str | os.PathLike, names: Iterable[str] = ()) -> list[str]:
    """Entries of ``folder`` linmem may not delete: files that are neither in ``names`` (what the replacement
    writes) nor listed in the folder's manifest or its marker's ``written``, and subfolders that are not linmem-made
    without foreign files."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    own = set(names) | {MANIFEST_NAME, MARKER}
    marker = read_marker(folder)
    if marker is not None:
        own |= written_names(folder, marker)
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
    """``ValueError`` if ``folder`` is a symbolic link, or exists and holds anything ``foreign_entries`` would keep
    (so that a command can refuse before it starts work, not after)."""
    folder = Path(folder)
    if folder.is_symlink():
        raise ValueError(f"{folder}: is a symbolic link where linmem writes a folder; linmem does not replace links "
                         f"or write through them: remove the link or choose another folder")
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
