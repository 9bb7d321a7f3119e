"""Atomic file writes: a crash never leaves a half-written file under its final name.

The bytes go to a hidden temporary file in the same folder, are flushed and fsynced, and only then renamed onto
the final name (``os.replace`` is atomic on POSIX and Windows within one file system). A reader therefore sees the
old file, no file, or the complete new one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMP_MARK = ".tmp."


def temp_path(path: Path) -> Path:
    """The hidden temporary name used while ``path`` is written (``.NAME.tmp.PID``)."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file for writing; on normal exit fsync it and rename it onto ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was. A ``path`` that is a symbolic
    link is refused (``ValueError``): the write would replace the link, and its target would not change.
    """
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"{path}: is a symbolic link; linmem does not write through links: remove it or write "
                         f"elsewhere")
    tmp = temp_path(path)
    kwargs = {"encoding": "utf-8"} if "b" not in mode else {}
    try:
        with open(tmp, mode, opener=create_new, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_new(path: str, flags: int) -> int:
    """``open``'s opener for a temporary file: a leftover of that name (a crashed writer's, or a link someone put
    there) is removed, and the file is created anew, never followed through a link."""
    if os.path.lexists(path):
        os.unlink(path)
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)


def fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def write_bytes_atomic(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_write(path, "wb") as f:
        f.write(data)
