"""SHA-256 manifests: ``manifest.json`` lists every file of a folder with its size and hash.

The format, shared by training checkpoints and model folders::

    {"files": {"model.safetensors": {"bytes": 123, "sha256": "ab12..."}, ...}, ...}

Other top-level keys (a checkpoint's ``"step"``) are kept and ignored by ``verify_manifest``. The manifest is
written atomically after the files it lists, so a folder with a manifest was written completely; a later
mismatch means a file was damaged (or replaced) on disk.

``python -m linmem.io.manifest write FOLDER...`` (re)writes the manifests of folders whose files were edited by
hand; ``python -m linmem.io.manifest verify FOLDER...`` checks them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from linmem.io.atomic import write_json_atomic

MANIFEST_NAME = "manifest.json"
BLOCK = 1 << 20


class DamagedFileError(ValueError):
    """A file differs from its folder's manifest (size or SHA-256), or is missing."""


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file at ``path`` (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def has_manifest(folder: str | os.PathLike) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def folder_files(folder: Path) -> list[str]:
    """Names of the regular files directly in ``folder``, the manifest and hidden temp files left out."""
    return sorted(p.name for p in folder.iterdir()
                  if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith("."))


def write_manifest(folder: str | os.PathLike, files: Iterable[str] | None = None,
                   extra: dict[str, Any] | None = None) -> Path:
    """Hash ``files`` (names in ``folder``; default: every file of the folder but the manifest) and write
    ``folder/manifest.json`` atomically; ``extra`` adds top-level keys (e.g. a checkpoint's step)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder, no manifest written")
    names = folder_files(folder) if files is None else sorted(files)
    entries = {}
    for name in names:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: listed for the manifest but not a file")
        entries[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    path = folder / MANIFEST_NAME
    write_json_atomic(path, {**(extra or {}), "files": entries})
    return path


def read_manifest(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The ``files`` table of ``folder``'s manifest (``DamagedFileError`` if the manifest is not readable)."""
    path = Path(folder) / MANIFEST_NAME
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{path}: the manifest is damaged ({error})") from error
    if not isinstance(files, dict):
        raise DamagedFileError(f"{path}: the manifest is damaged ('files' is not a table)")
    return files


def verify_manifest(folder: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> None:
    """Check every file ``folder``'s manifest lists: present, same size, same SHA-256. Raises
    ``DamagedFileError`` naming the first file that is missing or damaged; ``FileNotFoundError`` without a
    manifest. ``share=(i, n)`` checks only every ``n``-th listed file from the ``i``-th (``n`` processes split
    the reading)."""
    folder = Path(folder)
    for name, entry in list(read_manifest(folder).items())[share[0]::share[1]]:
        path = folder / name
        if not path.is_file():
            raise DamagedFileError(f"{path}: missing (listed in {folder / MANIFEST_NAME}); the folder is incomplete")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise DamagedFileError(f"{path}: damaged (size {size} bytes, the manifest says {entry.get('bytes')})")
        if sha256_file(path) != entry.get("sha256"):
            raise DamagedFileError(f"{path}: damaged (SHA-256 differs from {folder / MANIFEST_NAME})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linmem.io.manifest",
                                     description="Write or verify the SHA-256 manifest of folders.")
    parser.add_argument("action", choices=("write", "verify"))
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for folder in args.folders:
        try:
            if args.action == "write":
                print(write_manifest(folder))
            else:
                verify_manifest(folder)
                print(f"{folder}: ok")
        except (ValueError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
