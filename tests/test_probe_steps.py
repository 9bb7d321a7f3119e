"""The probe's protocol as named steps (``linmem.memory.probe.STEPS``): one step per experiment, each reading
arguments its function takes from inputs the protocol provides, and the head scan's frozen choice and ranking
reaching the steps after it."""

from __future__ import annotations

import inspect

import pytest

from linmem.data.builtin import open_source
from linmem.memory import experiments as ex
from linmem.memory.components import Component
from linmem.memory.experiment_names import EXPERIMENTS
from linmem.memory.probe import NEEDS_COMPONENT, STEPS, ProbeOptions, Step, arguments, run_protocol
from tests.test_memory_experiments import lab, tiny  # noqa: F401  (lab: a fixture)

# What run_protocol's inputs hold (see the comment above STEPS); "ranking" and "chosen" the head scan writes.
INPUTS = {"model", "tokenizer", "builder", "spec", "transfer", "confirm", "dev_items", "confirm_items", "write_items",
          "seed", "gated", "loads", "gaps", "chosen", "ranking"}


def test_every_experiment_is_a_step_whose_arguments_its_function_takes():
    assert list(STEPS) == sorted(STEPS, key=EXPERIMENTS.index) and set(STEPS) == set(EXPERIMENTS)
    for name, step in STEPS.items():
        assert step.name == name
        assert set(step.reads.values()) <= INPUTS and set(step.writes) <= INPUTS, name
        inspect.signature(step.function).bind(**dict.fromkeys(step.reads), **step.fixed)  # all required, none unknown
    assert [name for name, step in STEPS.items() if step.writes] == ["head_scan"]


def test_a_step_passes_its_inputs_and_fixed_values_and_sets_what_it_writes():
    calls = []

    def function(items, field_name, component):
        calls.append((items, field_name, component))
        return "result", {"chosen": "L0H1S", "ranking": ["x"]}

    inputs = {"confirm_items": [1, 2], "chosen": None, "ranking": None}
    step = Step("demo", function, arguments("component", items="confirm_items"), fixed={"field_name": "gap"},
                writes=("chosen",))
    assert step.reads == {"component": "component", "items": "confirm_items"}
    with pytest.raises(KeyError):  # an input the protocol does not hold is an error, not a silent None
        step.run(inputs)
    step = Step("demo", function, arguments(items="confirm_items", component="chosen"), fixed={"field_name": "gap"},
                writes=("chosen",))
    assert step.run(inputs) == "result" and calls == [([1, 2], "gap", None)]
    assert inputs == {"confirm_items": [1, 2], "chosen": "L0H1S", "ranking": None}  # only what it writes


def test_the_head_scans_choice_and_ranking_reach_the_later_steps(lab, monkeypatch, tmp_path):  # noqa: F811
    """Every step replaced by a recorder: the steps run once each, in protocol order, and those after the head
    scan read its frozen component and ranking; the write edits' items are the held-out ones."""
    docs, tokenizer, _, _ = lab
    ranking = [Component(1, 0, "S"), Component(0, 1, "S")]
    seen: dict[str, dict] = {}

    def recorder(name):
        def record(**kwargs):
            seen[name] = kwargs
            empty = ex.Result(name, [])  # no rows: left out of the report
            return (empty, {"ranking": ranking, "chosen": kwargs["chosen"] or ranking[0]}) if STEPS[name].writes \
                else empty
        return record

    for name, step in STEPS.items():
        monkeypatch.setitem(STEPS, name, Step(name, recorder(name), step.reads, step.fixed, step.writes))
    options = ProbeOptions(dev_sources=3, confirm_sources=3, filler_tokens=24, num_bindings=2, repeats=2, loads=(1, 2),
                           gaps=(0, 8), min_clean_recall=0, write_tokens_after=1)
    (tmp_path / "texts").mkdir()
    for i, doc in enumerate(docs):  # as files, their source ids give 3 development and 3 held-out passages
        (tmp_path / "texts" / f"{i:02d}.txt").write_text(doc.text)
    documents = open_source(str(tmp_path / "texts")).documents()
    run_protocol(tiny(tokenizer, mixer="gdn").float(), tokenizer, documents, options, tmp_path / "out")
    assert list(seen) == list(EXPERIMENTS)
    assert all(seen[name]["component"] == ranking[0] for name in NEEDS_COMPONENT if "component" in seen[name])
    assert seen["head_interaction"]["ranking"] == seen["joint_topk"]["ranking"] == ranking
    assert seen["head_scan"]["chosen"] is None and seen["head_scan"]["min_clean_recall"] is None  # gate off
    lifecycle, confirm = seen["lifecycle"]["items"], seen["write_reach"]["items"]
    assert [item.source_id for item in lifecycle] == [item.source_id for item in confirm]
    assert all(w[1] == min(c[1] + 1, item.boundary) for widened, item in zip(lifecycle, confirm)
               for w, c in zip(widened.target_writes, item.target_writes))
    assert seen["sweep_gap"]["values"] == [0, 8] and seen["sweep_num_bindings"]["values"] == [1, 2]
