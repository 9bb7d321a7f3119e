"""scripts/study/run_archive.py: a study's records in numbered parts, each holding only what earlier parts lack."""

from __future__ import annotations

import random
import tarfile
from pathlib import Path

import pytest

from tests.script_modules import load_script, printed

ROOT = Path(__file__).resolve().parents[1]
run_archive = load_script(ROOT / "scripts" / "study" / "run_archive.py", "run_archive")


def write_run(study_dir: Path, name: str, model: str, seed: int, rng: random.Random) -> None:
    run = study_dir / name / "runs" / model / f"seed-{seed}"
    (run / "eval").mkdir(parents=True)
    (run / "model").mkdir()
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "loss": {rng.random()}}}\n' for i in range(20)))
    (run / "eval" / "results.json").write_text(f'{{"ppl": {rng.uniform(20, 40)}}}')
    (run / "model" / "config.json").write_text('{"mixer": "rdn"}')
    (run / "model" / "model.safetensors").write_bytes(rng.randbytes(64))  # weights: never packed
    logs = study_dir / f"{name}-logs"
    logs.mkdir(exist_ok=True)
    with (logs / "queue.log").open("a") as log:
        log.write(f"start {model} seed {seed}\nend {model} seed {seed} rc 0\n")


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def members(part: Path) -> set[str]:
    with tarfile.open(part) as tar:
        return {m.name for m in tar if m.isfile()}


def test_each_part_holds_only_what_earlier_parts_lack_and_the_parts_rebuild_the_records(tmp_path):
    rng = random.Random()
    study, docs, name = tmp_path / "runs", tmp_path / "docs", "demo"
    for model in ("rdn", "gdn"):
        write_run(study, name, model, 0, rng)
    first = run_archive.pack(name, study, docs)
    assert first.name == "runs-01.tar.xz"
    assert not any(m.endswith(".safetensors") for m in members(first))
    assert run_archive.pack(name, study, docs) is None  # nothing changed: no empty part

    write_run(study, name, "rdn", 1, rng)  # a new run, and the queue log grows
    rewritten = study / name / "runs" / "gdn" / "seed-0" / "eval" / "results.json"
    rewritten.write_text('{"ppl": 1.0}')  # a record rewritten
    second = run_archive.pack(name, study, docs)
    assert second.name == "runs-02.tar.xz"
    assert members(second) == {
        "demo-logs/queue.log", "demo/runs/gdn/seed-0/eval/results.json",
        "demo/runs/rdn/seed-1/metrics.jsonl", "demo/runs/rdn/seed-1/eval/results.json",
        "demo/runs/rdn/seed-1/model/config.json"}
    assert [p.name for p in run_archive.parts(docs / name)] == ["runs-01.tar.xz", "runs-02.tar.xz"]

    fresh = tmp_path / "fresh"
    assert run_archive.unpack(name, fresh, docs) == 2
    expected = {k: v for k, v in tree(study).items() if not k.endswith(".safetensors")}
    assert tree(fresh) == expected


def test_the_parts_are_read_in_number_order_and_bad_input_says_what_is_missing(tmp_path):
    folder = tmp_path / "docs" / "demo"
    folder.mkdir(parents=True)
    for number in (10, 2, 1):
        (folder / f"runs-{number:02d}.tar.xz").write_bytes(b"")
    (folder / "runs.tar.xz").write_bytes(b"")  # not a numbered part
    assert [p.name for p in run_archive.parts(folder)] == ["runs-01.tar.xz", "runs-02.tar.xz", "runs-10.tar.xz"]
    with pytest.raises(SystemExit, match="no records"):
        run_archive.pack("other", tmp_path / "runs", tmp_path / "docs")
    with pytest.raises(SystemExit, match="no archive parts"):
        run_archive.unpack("other", tmp_path / "runs", tmp_path / "docs")


def test_the_shipped_studies_are_kept_as_numbered_parts():
    studies = [p for p in (ROOT / "docs" / "study").iterdir() if p.is_dir() and any(p.glob("*.tar.xz"))]
    assert studies
    for folder in studies:
        assert run_archive.parts(folder), folder
        assert sorted(p.name for p in folder.glob("*.tar.xz")) == [p.name for p in run_archive.parts(folder)]
        listed = printed(run_archive.main, "list", folder.name)
        assert listed.count("runs-") == len(run_archive.parts(folder))
