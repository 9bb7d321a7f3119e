"""scripts/recall/value_prior.py: the language's guess at a format's value, checked against the same numbers
computed from whole query strings, on a shipped model."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from linmem.eval.loading import load_model
from linmem.memory.fact_formats import KEY_WORDS, TEMPLATES, VALUE_WORDS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "recall" / "value_prior.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("value_prior", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def single_token_ids(tokenizer, words: str) -> dict[str, int]:
    ids = {w: encode(tokenizer, " " + w) for w in words.split()}
    return {w: i[0] for w, i in ids.items() if len(i) == 1}


@pytest.mark.slow
def test_value_prior_matches_whole_query_strings(script, tmp_path, monkeypatch):
    em = load_model("zoo:gdn", device="cpu")
    got = script.value_prior(em, "went", "roles", "directions")
    keys, values = single_token_ids(em.tokenizer, KEY_WORDS["roles"]), single_token_ids(em.tokenizer,
                                                                                          VALUE_WORDS["directions"])
    before, middle, _ = TEMPLATES["went"]
    value_ids = list(values.values())
    shares, entropies, masses = [], [], []
    for key in keys:  # each query tokenized as one string, scored alone
        ids = [em.document_start, *encode(em.tokenizer, f"{before} {key}{middle}")]
        with torch.no_grad():
            p_all = torch.softmax(em.model(torch.tensor([ids])).logits[0, -1].double(), -1)
        p = p_all[value_ids] / p_all[value_ids].sum()
        shares.append(sorted(p.tolist())[-2:])
        entropies.append(-(p * p.log()).sum().item() / math.log(len(value_ids)))
        masses.append(p_all[value_ids].sum().item())
    assert (got["keys"], got["values"]) == (len(keys), len(values)) and got["uniform_top2_share"] == 2 / len(values)
    assert got["top2_share"] == pytest.approx(sum(map(sum, shares)) / len(keys), abs=1e-5)
    assert got["entropy_fraction"] == pytest.approx(sum(entropies) / len(keys), abs=1e-5)
    assert got["value_mass"] == pytest.approx(sum(masses) / len(keys), abs=1e-6)
    assert sum(got["likeliest"].values()) == len(keys) and set(got["likeliest"]) <= set(values)

    out = tmp_path / "prior.json"
    monkeypatch.setattr(sys, "argv", ["value_prior.py", str(out), "--models", "zoo:gdn", "--formats",
                                      "went/roles/directions", "keeps/roles/materials"])
    script.main()
    written = json.loads(out.read_text())
    assert list(written) == ["zoo:gdn went/roles/directions", "zoo:gdn keeps/roles/materials"]
    assert written["zoo:gdn went/roles/directions"]["top2_share"] == pytest.approx(got["top2_share"], abs=1e-9)
