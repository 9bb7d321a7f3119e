"""A 200 MB text file that is one single line builds under a cap of 256 MB more address space: ``data build`` trains
its tokenizer on and tokenizes the document in pieces, so its memory does not grow with the document. Read and
tokenized whole, the line alone would take most of the cap and its tokenization about 300 times its size.
``tests/test_data_safety.py`` runs the same build on 2 MB in the fast suite; this is the size a user's dump of one
huge line may have."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from linmem.data.shards import TokenShards
from tests.test_data_safety import WORDS, build_under_memory_cap

SIZE = 200 << 20  # characters (ASCII: as many bytes)
BUDGET = 256 << 20  # bytes of address space the build may add


def write_one_line(path: Path, size: int, seed: int = 0) -> None:
    """``size`` characters of random words separated by single spaces, without a newline, written 1 MB at a time
    (one random block repeated: the tokenizer sees the same 16 words either way)."""
    rng = np.random.default_rng(seed)
    block = " ".join(rng.choice(WORDS, size=200_000))[:(1 << 20) - 1] + " "
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, size - 1, len(block)):
            f.write(block[:size - 1 - start])
        f.write("x")  # the line ends in a word, not in a space


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, forks, limits the address space")
def test_a_200_mb_line_builds_under_a_256_mb_cap(tmp_path: Path):
    source = tmp_path / "huge.txt"
    write_one_line(source, SIZE)
    assert source.stat().st_size == SIZE and b"\n" not in source.read_bytes()[-(1 << 20):]
    assert build_under_memory_cap(source, tmp_path / "out", budget=BUDGET) == 0
    card = json.loads((tmp_path / "out" / "data_card.json").read_text())
    assert card["chars"]["total"] == SIZE
    assert TokenShards(tmp_path / "out").split("train").num_documents == 1
