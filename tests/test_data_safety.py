"""Datasets are never lost or mangled: ``dataset_fingerprint`` tells a rebuilt dataset, a build never deletes or
replaces files linmem did not write and an interrupted rebuild leaves the old dataset whole, one huge document is
tokenized in bounded memory, and binary or non-UTF-8 text files are refused (or left out) with the file named."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from linmem.cli import main
from linmem.data import build
from linmem.data.build import BuildOptions, build_dataset
from linmem.data.shards import ShardWriter, TokenShards, dataset_fingerprint, write_index
from linmem.data.sources import open_path, text_pieces
from linmem.data.splits import SplitFractions
from linmem.data.tokenizer import train_tokenizer
from linmem.io.folders import MARKER, read_marker

META = {"dtype": "<u2", "vocab_size": 1000, "eos_id": 0, "special_token_ids": {}, "tokenizer_hash": "none",
        "tokenizer": "tokenizer.json", "source_names": ["s"]}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial bards".split()


def write_shards(folder: Path, docs: list[np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(folder, "train", np.dtype("<u2"), eos_id=0, shard_tokens=100)
    for i, doc in enumerate(docs):
        writer.add(doc, f"s:{i}", 0)
    write_index(folder, META, {"train": writer.close()})


def test_fingerprint_follows_the_tokens_and_reads_only_the_index(tmp_path: Path):
    docs = [np.arange(1, 40, dtype=np.uint16) + i for i in range(6)]
    write_shards(tmp_path / "a", docs)
    write_shards(tmp_path / "b", docs)
    assert dataset_fingerprint(tmp_path / "a") == dataset_fingerprint(tmp_path / "b")
    changed = [d.copy() for d in docs]
    changed[4][7] += 1
    write_shards(tmp_path / "b", changed)
    assert dataset_fingerprint(tmp_path / "a") != dataset_fingerprint(tmp_path / "b")
    before = dataset_fingerprint(tmp_path / "a")
    for shard in (tmp_path / "a").glob("*.bin"):
        shard.unlink()  # the index alone gives the fingerprint
    assert dataset_fingerprint(tmp_path / "a") == before


# ---------------------------------------------------------------- whose files a build may replace


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(12):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, size=60)), encoding="utf-8")
    return folder


def cli_build(corpus: Path, out: Path, *extra: str) -> int:
    return main(["data", "build", "--sources", str(corpus), "--out", str(out), "--vocab-size", "300",
                 "--splits", "0.6,0.2,0.2", "--no-progress", *extra])


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_overwrite_keeps_foreign_shards_and_index(corpus: Path, tmp_path: Path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.json").write_text('{"my": "own index"}', encoding="utf-8")
    (mine / "train-00000.bin").write_bytes(b"my own tokens")
    (mine / "validation-00003.bin").write_bytes(b"more of mine")
    before = contents(mine)
    assert cli_build(corpus, mine, "--overwrite") == 2
    assert contents(mine) == before | {MARKER: (mine / MARKER).read_bytes()}
    error = capsys.readouterr().err
    assert "holds index.json, train-00000.bin, validation-00003.bin, which linmem did not write" in error


def test_overwrite_keeps_a_foreign_linmem_dataset(corpus: Path, tmp_path: Path, capsys):
    """A dataset folder linmem did not write into (no marker), adopted with --overwrite: its index and shards
    are the user's, so the build refuses to replace them."""
    theirs = tmp_path / "theirs"
    build_dataset([open_path(corpus)], theirs, BuildOptions(vocab_size=300, progress=False))
    before = contents(theirs)
    assert cli_build(corpus, theirs, "--overwrite") == 2
    assert contents(theirs) == before | {MARKER: (theirs / MARKER).read_bytes()}
    TokenShards(theirs).verify()
    assert "which linmem did not write and a dataset build would replace" in capsys.readouterr().err


def test_rebuild_replaces_linmem_files_only(corpus: Path, tmp_path: Path):
    out = tmp_path / "out"
    assert cli_build(corpus, out, "--shard-tokens", "200") == 0
    old_shards = {p.name for p in out.glob("train-*.bin")}
    assert len(old_shards) > 1
    (out / "notes.txt").write_text("my notes", encoding="utf-8")
    assert cli_build(corpus, out) == 0  # one shard per split now
    assert {p.name for p in out.glob("train-*.bin")} == {"train-00000.bin"}
    assert (out / "notes.txt").read_text(encoding="utf-8") == "my notes"
    TokenShards(out).verify()
    written = set(read_marker(out)["written"])
    assert "train-00000.bin" in written and not (old_shards - {"train-00000.bin"}) & written
    assert not (out / build.STAGING_NAME).exists()


def test_interrupted_rebuild_leaves_the_old_dataset(corpus: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out"
    opts = BuildOptions(vocab_size=300, progress=False, fractions=SplitFractions(0.6, 0.2, 0.2))
    build_dataset([open_path(corpus)], out, opts)
    before = contents(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "train_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_dataset([open_path(corpus)], out, opts)
    assert contents(out) == before and sorted(p.name for p in out.iterdir()) == sorted(before)
    TokenShards(out).verify()


def test_ctrl_c_while_renaming_in_waits_for_the_whole_dataset(corpus: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out"
    opts = BuildOptions(vocab_size=300, progress=False, shard_tokens=200)
    build_dataset([open_path(corpus)], out, opts)
    real_replace, renamed_in = os.replace, []

    def replace_and_interrupt(src, dst):
        real_replace(src, dst)
        if Path(dst).parent == out:
            renamed_in.append(Path(dst).name)
            if len(renamed_in) == 1:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C right after the first file is renamed in

    monkeypatch.setattr(os, "replace", replace_and_interrupt)
    with pytest.raises(KeyboardInterrupt):
        build_dataset([open_path(corpus)], out, BuildOptions(vocab_size=290, progress=False, shard_tokens=200))
    monkeypatch.undo()
    assert len(renamed_in) > 3 and renamed_in[-1] == "index.json"
    assert json.loads((out / "data_card.json").read_text())["tokenizer"]["requested_vocab_size"] == 290
    TokenShards(out).verify()


# ---------------------------------------------------------------- huge documents, unreadable files


def build_under_memory_cap(source: Path, out: Path, budget: int) -> int:
    """Build ``source`` in a forked child whose address space may grow by ``budget`` bytes at most; its exit
    status (0: built)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: no per-thread heaps in the budget
            size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                        if line.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (size + budget, resource.RLIM_INFINITY))
            build_dataset([open_path(source)], out, BuildOptions(vocab_size=300, progress=False,
                                                                 fractions=SplitFractions(1.0, 0.0, 0.0)))
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, forks, limits the address space")
def test_one_huge_line_builds_in_bounded_memory(tmp_path: Path):
    """A 2 MB single-line file, tokenizer trained and text tokenized under a cap of 256 MB more address space.
    Tokenized whole, the document needs about 300 times its size (the process aborts); in pieces, about 70 MB
    whatever its size."""
    rng = np.random.default_rng(1)
    line = " ".join(rng.choice(WORDS, size=420_000))[:2 << 20]
    (tmp_path / "huge.txt").write_text(line, encoding="utf-8")
    assert build_under_memory_cap(tmp_path / "huge.txt", tmp_path / "out", budget=256 << 20) == 0
    data = TokenShards(tmp_path / "out")
    card = json.loads((tmp_path / "out" / "data_card.json").read_text())
    assert card["chars"]["total"] == len(line) and data.split("train").num_documents == 1


@pytest.mark.parametrize("text", ["the quick  brown\n\n\tfox\r\njumps,  over\u00a0the lazy dog's " * 40,
                                  "x" * 500 + " tail"])
def test_pieces_tokenize_as_the_whole_text(text: str):
    tokenizer = train_tokenizer([" ".join(WORDS)] * 20 + [text], vocab_size=300)
    pieces = list(text_pieces([text[:100], text[100:]], max_chars=37))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 37 and len(pieces) > len(text) // 37
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    cut_hard = text.startswith("x")  # no whitespace to cut at: pieces of 37 characters, split inside the word
    joined = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False).ids]
    assert (joined != whole) if cut_hard else (joined == whole)


def test_document_in_pieces_is_written_as_when_whole(tmp_path: Path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 900, size=n) for n in (30, 250, 5, 90, 700, 12)]  # shards of 100: two written through
    write_shards(tmp_path / "whole", docs)
    (tmp_path / "pieces").mkdir()
    writer = ShardWriter(tmp_path / "pieces", "train", np.dtype("<u2"), eos_id=0, shard_tokens=100)
    for i, doc in enumerate(docs):
        writer.start(f"s:{i}", 0)
        for part in np.array_split(doc, 7):
            writer.extend(part)
        writer.end()
    write_index(tmp_path / "pieces", META, {"train": writer.close()})
    assert contents(tmp_path / "pieces") == contents(tmp_path / "whole")


def test_binary_and_latin1_files_are_named(tmp_path: Path, capsys):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "good.txt").write_text("plain words " * 20, encoding="utf-8")
    (folder / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (folder / "latin.txt").write_bytes("un café au lait, s'il vous plaît".encode("latin-1"))
    for name, problem in (("image.txt", "NUL byte at offset 8: a binary file"),
                          ("latin.txt", "not UTF-8 text (byte 0xe9 at offset 6)")):
        single = tmp_path / name
        single.write_bytes((folder / name).read_bytes())
        assert cli_build(single, tmp_path / f"out-{name}", "--splits", "1,0,0") == 2
        error = capsys.readouterr().err
        assert f"{single}: {problem}" in error and "--skip-unreadable" in error and error.count("\n") == 1
    assert cli_build(folder, tmp_path / "out", "--splits", "1,0,0", "--skip-unreadable") == 0
    warnings = capsys.readouterr().err
    assert f"{folder / 'image.txt'}: NUL byte" in warnings and f"{folder / 'latin.txt'}: not UTF-8" in warnings
    card = json.loads((tmp_path / "out" / "data_card.json").read_text())
    assert card["skipped_unreadable_files"] == ["texts/image.txt", "texts/latin.txt"]
    assert card["documents"]["total"] == 1
