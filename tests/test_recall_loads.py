"""The eval's memory-lab recall with a chosen format and loads, its study items and tables, and the ``remember``
study's recipe: many trained formats, the held-out one measured.

Models: a reading oracle (answers from the prompt's own facts: recall 1 whatever the format) to check what is
built, and a tiny random GDN in float64 (off the ceiling) to check the aggregates, both with the zoo's shipped
tokenizer and held-out text."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401  (registers the model classes)
from linmem.cli import main
from linmem.eval.loading import EvalModel, load_model, open_heldout
from linmem.eval.memory_recall import RecallFormat, builders, memory_recall
from linmem.eval.runner import EvalOptions, evaluate
from linmem.memory.fact_formats import GENERATED, HELD_OUT, KEY_WORDS, TEMPLATES, TEXT, VALUE_WORDS
from linmem.memory.kv_filler import KeyValueFiller
from linmem.memory.tasks import TaskBuilder, TaskSpec
from linmem.models import LinMemConfig
from linmem.study.definition import load_study, resolve_model
from linmem.study.items import agreement, item_records, ratio
from linmem.study.tables import metrics_of
from tests.test_eval import RecallOracle

ROOT = Path(__file__).resolve().parents[1]
ZOO_MODEL = ROOT / "linmem" / "zoo" / "models" / "gdn"
REMEMBER = ROOT / "configs" / "study" / "remember.yaml"


class ReadingOracle(RecallOracle):
    """The eval tests' reading oracle (recall 1 from the prompt's own facts) that keeps every prompt it is given
    (``seen``), so a test can read what was measured."""

    def __init__(self, vocab_size: int, middle: list[int]):
        super().__init__(vocab_size, middle)
        self.seen = []

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        self.seen += input_ids.tolist()
        return super().forward(input_ids, attention_mask, use_cache)


@pytest.fixture(scope="module")
def zoo():
    """The shipped GDN with its tokenizer and held-out test split."""
    em = load_model(ZOO_MODEL, device="cpu")
    return em, open_heldout(em, None, "test")


def with_model(em: EvalModel, model: nn.Module) -> EvalModel:
    return dataclasses.replace(em, model=model)


def random_gdn(vocab_size: int) -> nn.Module:
    torch.manual_seed(int(np.random.default_rng().integers(2**31)))
    config = LinMemConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
                          expand_v=2.0, hidden_ratio=2)
    return AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


def count(row: list[int], pattern: list[int]) -> int:
    return sum(row[t:t + len(pattern)] == pattern for t in range(len(row) - len(pattern) + 1))


# ---------------------------------------------------------------- the eval task


def test_the_format_and_loads_choose_what_is_measured(zoo):
    em, split = zoo
    fmt = RecallFormat("likes", "letters", "numbers", filler_tokens=64)
    by_load = builders(em.tokenizer, fmt, [1, 3])
    first = by_load[1]
    oracle = ReadingOracle(em.model.config.vocab_size, first.middle)
    result = memory_recall(with_model(em, oracle), split, items=6, filler_tokens=64, template="likes",
                           keys="letters", values="numbers", loads=[1, 3])
    assert result["available"] is True
    assert [row["num_bindings"] for row in result["table"]] == [1, 3]
    assert all(row["accuracy"] == 1.0 and row["n"] == 6 for row in result["table"])
    assert result["metrics"]["accuracy@3"] == 1.0 and result["metrics"]["num_bindings"] == [1, 3]
    assert len(oracle.seen) == 24  # per load: the 6 items, then their 6 no-fact prompts
    code = TaskBuilder(em.tokenizer, TaskSpec(num_bindings=1))  # the default format's pieces
    for index, row in enumerate(oracle.seen):
        k, no_fact = (1 if index < 12 else 3), index % 12 >= 6
        facts = sum(count(row, first.before + [key] + first.middle) for key in first.keys)
        assert facts == 2 * (k - no_fact) + 1  # every fact twice (repeats 2; not the asked one without it), the query
        if no_fact and k == 1:
            continue  # no fact left to read the values of
        assert row[-len(first.middle) - 1] in first.keys and row[-len(first.middle):] == first.middle
        assert sum(count(row, code.before + [key] + code.middle) for key in code.keys) == 0
        fact_starts = [t for t in range(len(row) - len(first.before)) if row[t:t + len(first.before)] == first.before
                       and row[t + len(first.before)] in first.keys]
        values = [row[t + len(first.before) + 1 + len(first.middle)] for t in fact_starts[:-1]]  # the last: the query
        assert values and set(values) <= set(first.values)  # the facts carry number values


def test_loads_are_measured_alike_and_pooled_as_their_mean(zoo):
    em, split = zoo
    model = with_model(em, random_gdn(em.model.config.vocab_size))
    common = dict(items=8, filler_tokens=48, template="colon", keys="objects", values="animals", seed=3)
    both = memory_recall(model, split, loads=[2, 5], **common)
    alone = memory_recall(model, split, loads=[5], **common)
    assert both["table"][1] == alone["table"][0]  # a load's items do not depend on the other loads
    assert alone["metrics"]["accuracy"] == alone["metrics"]["accuracy@5"]
    per_load = [row["accuracy"] for row in both["table"]]
    assert both["metrics"]["accuracy"] == pytest.approx(float(np.mean(np.array(per_load, dtype=np.float64))))
    assert both["metrics"]["n"] == 16


def test_a_load_beyond_the_vocabulary_is_refused_by_name(zoo, tmp_path, capsys):
    em, split = zoo
    supplied = len(builders(em.tokenizer, RecallFormat(), [1])[1].keys)  # single-token names in the zoo's vocabulary
    loads = [4, supplied + 1, 16]
    with pytest.raises(ValueError, match=rf"loads \[{supplied + 1}, 16\] are refused.*'names' has {supplied}"):
        memory_recall(em, split, loads=loads)
    with pytest.raises(ValueError, match=r"loads \[16\] are refused"):  # before any task runs
        evaluate(ZOO_MODEL, ["ppl", "recall"], EvalOptions(recall_bindings=(4, 16), device="cpu"),
                 out_dir=tmp_path / "eval", progress=False)
    assert not (tmp_path / "eval").exists()
    code = main(["eval", str(ZOO_MODEL), "--tasks", "recall", "--out", str(tmp_path / "cli"), "--device", "cpu",
                 "--recall-keys", "names", "--recall-bindings", f"2,{supplied + 3}"])
    assert code == 2 and f"loads [{supplied + 3}] are refused" in capsys.readouterr().err


@pytest.mark.parametrize("options, error", [
    ({"recall_template": "sang"}, "recall_template: template must be one of"),
    ({"recall_keys": "planets"}, "recall_keys: keys must be one of"),
    ({"recall_values": "names"}, "recall_values: values must be one of"),
    ({"recall_bindings": ()}, "recall_bindings must be a non-empty list"),
    ({"recall_bindings": (4, 0)}, "recall_bindings must hold integers >= 1"),
    ({"recall_bindings": (4, 4)}, "recall_bindings must be distinct"),
])
def test_recall_options_are_checked(options, error):
    with pytest.raises(ValueError, match=error):
        EvalOptions(**options)


def test_default_recall_is_the_single_load_task():
    o = EvalOptions()
    assert (o.recall_template, o.recall_keys, o.recall_values, o.recall_bindings) == ("code", "names", "colors", (4,))


# ---------------------------------------------------------------- the study's items and tables


def test_study_recall_items_and_tables_per_load(zoo):
    em, split = zoo
    model = with_model(em, random_gdn(em.model.config.vocab_size))
    study = load_study(REMEMBER)
    study.eval_options = dataclasses.replace(study.eval_options, recall_items=6, recall_filler=48,
                                             recall_bindings=(1, 4), batch_size=4)
    o = study.eval_options
    records = item_records(model, split, ["recall"], o)
    columns = records["recall"]
    assert sorted(set(columns["group"])) == ["1", "4"] and len(columns["unit"]) == 12
    report = memory_recall(model, split, o.recall_items, filler_tokens=o.recall_filler, template=o.recall_template,
                           keys=o.recall_keys, values=o.recall_values, loads=o.recall_bindings, seed=o.seed,
                           batch_size=o.batch_size)
    assert agreement(records, {"tasks": {"recall": report}})["recall"] < 1e-12
    metrics = {m.name: m for m in metrics_of(study, {"m": {0: {"records": records}}})}
    assert {"lab_recall", "recall@1", "recall@4"} <= set(metrics)
    for row in report["table"]:
        items = metrics[f"recall@{row['num_bindings']}"].read({"records": records}, Path("."))
        assert items.n == 6 and items.value() == pytest.approx(row["accuracy"])
    assert ratio(columns) == pytest.approx(report["metrics"]["accuracy"])


# ---------------------------------------------------------------- the remember study's recipe


def test_remember_trains_many_formats_and_measures_a_held_out_one(zoo):
    em, _ = zoo
    study = load_study(REMEMBER)
    base = load_study(ROOT / "configs" / "study" / "rla-paper.yaml").recipe["data"]["recall"]
    held = {"template": set(HELD_OUT["template"]), "keys": set(HELD_OUT["keys"]), "values": set(HELD_OUT["values"])}
    for model in study.models:
        for seed in study.seeds:
            config = resolve_model(study, model, seed)
            assert config.data.recall == study.recipe_config.data.recall
    recall = study.recipe_config.data.recall
    assert [r for r in recall if r["name"] != "kv-filler"] == [r for r in base if r["name"] != "kv-filler"]
    facts = [r for r in recall if r["name"] == "kv-filler"]
    assert sum(r["weight"] for r in facts) == pytest.approx(4, abs=0.5)
    generated = [r for r in facts if r["keys"] == r["values"] == GENERATED and r["template"] in (GENERATED, TEXT)]
    assert sum(r["weight"] for r in generated) > sum(r["weight"] for r in facts) / 2  # mostly drawn formats
    seq_len = study.recipe_config.data.seq_len
    rng = np.random.default_rng()
    for entry in facts:
        if entry in generated:  # tests/test_recall_generated.py checks what these draw
            continue
        for field, table in (("template", TEMPLATES), ("keys", KEY_WORDS), ("values", VALUE_WORDS)):
            assert entry[field] in table and entry[field] not in held[field], entry
        assert 4 <= entry["num_bindings"] <= 8, entry
        spec = TaskSpec(num_bindings=entry["num_bindings"], template=entry["template"], keys=entry["keys"],
                        values=entry["values"])
        builder = TaskBuilder(em.tokenizer, spec)  # refuses a load the vocabulary cannot supply
        generator = KeyValueFiller.from_builder(builder, rng.integers(0, 4096, 4096), num_bindings=spec.num_bindings,
                                                repeats=entry["repeats"])
        sample = generator.sample(rng, seq_len)
        assert len(sample.tokens) == seq_len and 1 <= sample.loss_mask.sum() <= spec.num_bindings
    o = study.eval_options
    assert (o.recall_template in held["template"] and o.recall_keys in held["keys"]
            and o.recall_values in held["values"])
    assert "recall" in study.tasks and max(o.recall_bindings) >= 16 and o.recall_items >= 256
    largest = builders(em.tokenizer, o.recall_format(), o.recall_bindings)[max(o.recall_bindings)]
    item = largest.build("test", list(range(o.recall_filler)), np.random.default_rng(0))
    assert len(item.prompt()) <= seq_len  # every load stays within the training length


def test_study_draws_recall_by_load_when_several_loads_were_measured(tmp_path):
    """``recall.png``: clean recall against the load, one line per model with its seed interval and the 0.25
    chance line, drawn when the tables hold two or more loads; a single load gives no curve."""
    from linmem.study import figures

    study = load_study(REMEMBER)

    def tables(loads):
        estimate = {"seed_bootstrap": {"mean": 0.6, "low": 0.5, "high": 0.7}}
        return {"metrics": {f"recall@{k}": {} for k in loads},
                "models": {"gdn": {"seeds": [], "metrics": {f"recall@{k}": estimate for k in loads}}},
                "comparisons": []}

    several, single = tmp_path / "several", tmp_path / "single"
    several.mkdir(), single.mkdir()
    assert figures.keys_of(tables([16, 1, 4]), "recall") == [1, 4, 16]
    assert figures.draw_figures(tables([1, 4, 16]), study, several, several) == {"recall": "recall.png"}
    assert (several / "recall.png").read_bytes().startswith(b"\x89PNG")
    assert "recall" not in figures.draw_figures(tables([4]), study, single, single)
