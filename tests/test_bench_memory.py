"""``python -m linmem.bench.lab_scale``: its naive scan (the whole prompt re-run per head) and the lab's head scan
(suffix-only re-runs from one prefix cache) measure the same per-head effects, so the benchmark compares two ways of
one computation; and its quick mode writes its JSON and markdown table."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
import torch

import linmem.memory as mm
from linmem.bench import lab_scale
from linmem.data.sources import Document
from linmem.data.tokenizer import train_tokenizer, wrap_tokenizer
from linmem.memory import experiments as ex
from tests.test_memory_experiments import KEYS, VALUES, WORDS


@pytest.fixture(scope="module")
def texts():
    rng = torch.Generator().manual_seed(0)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (16 * 150,), generator=rng).tolist()]
    docs = [Document("toy", f"toy:{i}", " ".join(words[150 * i: 150 * (i + 1)])) for i in range(16)]
    facts = [f" The code of {k} is {v}." for k, v in itertools.product(KEYS, VALUES)] * 5
    return docs, train_tokenizer([d.text for d in docs] + facts, vocab_size=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(lab_scale.MODELS))
def test_naive_and_fast_head_scans_measure_the_same_effects(name, texts):
    docs, engine = texts
    tokenizer = wrap_tokenizer(engine)
    config = lab_scale.MODELS[name](quick=True)
    config.vocab_size = len(tokenizer)
    seed = int(torch.randint(0, 2**31, ()).item())
    model = lab_scale.build_model(config, "cpu", torch.float32, seed=seed)
    batch = lab_scale.task_batch(tokenizer, docs, lab_scale.Sizes(items=3, filler=24))
    components = lab_scale.spread(mm.heads(model), 4)  # both layer kinds' first and last heads
    fast = {r["component"]: r["mean"] for r in ex.head_scan(model, batch.items, components, chunk=5).rows}
    slow = lab_scale.naive_scan(model, batch, components)
    effects = torch.tensor([fast[str(c)] for c in components], dtype=torch.float64)
    assert effects.abs().max() > 1e-3  # the swaps move the margins: the comparison is not of zeros
    assert (effects - slow).abs().max() <= 1e-4 * max(effects.abs().max().item(), 1.0)


def test_quick_mode_writes_json_and_table(tmp_path, texts, monkeypatch):
    docs, engine = texts
    monkeypatch.setattr("linmem.memory.commands.documents", lambda specs: docs)
    monkeypatch.setattr("linmem.data.tokenizer.train_tokenizer", lambda texts, vocab_size: engine)
    probe = replace(lab_scale.QUICK.probe, filler_tokens=24)
    monkeypatch.setattr(lab_scale, "QUICK", lab_scale.Sizes(items=2, filler=24, probe=probe))
    results = lab_scale.main(["--quick", "--models", "gdn-1.3b", "--probe", "gated", "--naive-heads", "3",
                              "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "lab_scale.json").read_text())
    row = saved["models"][0]
    assert row["model"] == "gdn-1.3b" and row["heads"] == 16 and row["naive_heads_timed"] == 3
    assert row["naive_extrapolated"] and row["speedup"] > 0 and row["relative_effect_difference"] < 1e-4
    gated = row["probe"]["gated"]
    assert set(gated["clean_recall"]) >= {"development", "confirmation"}
    assert (gated["warning"] is None) == (min(gated["clean_recall"]["development"],
                                              gated["clean_recall"]["confirmation"]) >= 0.5)
    table = (tmp_path / "lab_scale.md").read_text()
    assert "| gdn-1.3b |" in table and "extrapolated" in table and results["total_s"] > 0
    assert row["head_scan_batch"] == "16 of 17 edit sets per batch (the default on cpu)"  # the clean run, 16 heads
    assert f"gdn-1.3b: head scan (a) ran {row['head_scan_batch']}" in table
