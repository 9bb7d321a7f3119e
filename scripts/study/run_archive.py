"""A study's shipped records as numbered archive parts, so that a session's new runs add a part of their own instead
of rewriting (and re-committing) every earlier run.

    python scripts/study/run_archive.py pack NAME      # runs/study/NAME (+ NAME-logs) -> docs/study/NAME/runs-NN.tar.xz
    python scripts/study/run_archive.py unpack NAME    # every part, in order, into runs/study
    python scripts/study/run_archive.py list NAME      # the parts and how many files each holds

A part holds what the study's tables read (configs, metrics.jsonl, items.json, evaluation JSON) and the queue logs,
never weights. ``pack`` writes only the files that no earlier part holds with the same bytes (a new run, a queue log
that grew, a record rewritten), so unpacking the parts in order rebuilds the folder as it was packed; it writes
nothing when nothing changed. Records are only ever added or rewritten: a file deleted here stays in the part
that holds it. ``--study-dir`` and ``--docs`` point elsewhere (tests).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PART = re.compile(r"runs-(\d+)\.tar\.xz")
WEIGHTS = (".safetensors", ".pt", ".bin")  # never packed: the records, not the models


def parts(folder: Path) -> list[Path]:
    """The archive parts in ``folder``, in the order they were written (runs-01, runs-02, ...)."""
    found = [(int(m.group(1)), p) for p in folder.glob("runs-*.tar.xz") if (m := PART.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def packed_digests(folder: Path) -> dict[str, str]:
    """Each member path's SHA-256 as the parts, unpacked in order, leave it (a later part's copy wins)."""
    digests: dict[str, str] = {}
    for part in parts(folder):
        with tarfile.open(part) as tar:
            for member in tar:
                if member.isfile():
                    digests[member.name] = hashlib.sha256(tar.extractfile(member).read()).hexdigest()
    return digests


def record_files(study_dir: Path, name: str) -> list[tuple[str, Path]]:
    """(archive path, file) for every record file of study ``name`` under ``study_dir``: its ``runs`` folder and its
    logs folder, weights left out."""
    files = []
    for root in (study_dir / name / "runs", study_dir / f"{name}-logs"):
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.name.endswith(WEIGHTS):
                files.append((path.relative_to(study_dir).as_posix(), path))
    return files


def pack(name: str, study_dir: Path, docs: Path) -> Path | None:
    """Write the next part of study ``name`` (the files no earlier part holds with these bytes); None when every
    file is already packed."""
    folder = docs / name
    files = record_files(study_dir, name)
    if not files:
        raise SystemExit(f"no records of {name!r} under {study_dir} (its runs folder and {name}-logs)")
    known = packed_digests(folder)
    new = [(arc, path) for arc, path in files if known.get(arc) != hashlib.sha256(path.read_bytes()).hexdigest()]
    if not new:
        return None
    existing = parts(folder)
    number = int(PART.fullmatch(existing[-1].name).group(1)) + 1 if existing else 1
    target = folder / f"runs-{number:02d}.tar.xz"
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with tarfile.open(partial, "w:xz") as tar:
        for arc, path in new:
            tar.add(path, arcname=arc, recursive=False)
    partial.replace(target)  # a crash mid-write leaves no half part behind a numbered name
    return target


def unpack(name: str, study_dir: Path, docs: Path) -> int:
    """Unpack every part of study ``name`` in order into ``study_dir``; returns the number of parts."""
    found = parts(docs / name)
    if not found:
        raise SystemExit(f"no archive parts in {docs / name} (runs-01.tar.xz, ...)")
    study_dir.mkdir(parents=True, exist_ok=True)
    for part in found:
        with tarfile.open(part) as tar:
            tar.extractall(study_dir, filter="data")
    return len(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("verb", choices=("pack", "unpack", "list"))
    parser.add_argument("name", help="the study's name (configs/study/NAME.yaml)")
    parser.add_argument("--study-dir", type=Path, default=REPO / "runs" / "study",
                        help="where the study's folders are (runs/study)")
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "study",
                        help="where each study's parts are kept (docs/study)")
    args = parser.parse_args(argv)
    if args.verb == "pack":
        target = pack(args.name, args.study_dir, args.docs)
        print(f"wrote {target}" if target else f"nothing new to pack for {args.name}")
    elif args.verb == "unpack":
        count = unpack(args.name, args.study_dir, args.docs)
        print(f"unpacked {count} part(s) of {args.name} into {args.study_dir}")
    else:
        for part in parts(args.docs / args.name):
            with tarfile.open(part) as tar:
                n = sum(1 for member in tar if member.isfile())
            print(f"{part.name}: {n} files, {part.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
