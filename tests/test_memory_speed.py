"""How much the memory lab runs: edit sets continue one shared unedited prefix instead of re-running the prompt,
experiments reuse the prefix runs they already made, and a probe on a CPU says how long it will take. Each test
counts the tokens the model is run on (a hook on the backbone) and checks the numbers against the one-run path."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from linmem.data.builtin import open_source
from linmem.memory import experiments as ex
from linmem.memory.components import Component
from linmem.memory.corrector import state_features
from linmem.memory.edits import DonorWrite, OutputPatch, StateSwap, WriteBlock
from linmem.memory.evaluate import candidate_logits, make_batch
from linmem.memory.intervene import run_many
from linmem.memory.metrics import choice_logits
from linmem.memory.probe import ProbeOptions, run_protocol
from linmem.memory.recording import backbone
from linmem.memory.tasks import TaskBuilder, build_items
from tests.test_memory_experiments import lab, tiny  # noqa: F401  (lab: a fixture)

L1H0 = Component(1, 0)


class Runs:
    """The ``[rows, tokens]`` shape of every backbone forward while inside."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.shapes = model, []

    def __enter__(self) -> Runs:
        hook = lambda module, args, kwargs: self.shapes.append(tuple(kwargs["input_ids"].shape))  # noqa: E731
        self.handle = backbone(self.model).register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


@pytest.fixture(scope="module")
def setup(lab):  # noqa: F811
    docs, tokenizer, builder, sources = lab
    return tiny(tokenizer, mixer="gdn"), build_items(builder, sources[:4], seed=0), builder, sources[:4]


def test_write_edit_sets_run_only_the_tokens_after_their_first_edit(setup):
    """Write and read-out edit sets continue one unedited prefix up to the first token any of them edits; the cache
    edits' sets and the read-out sets after their ``at`` share the clean prefix up to it; the logits are those of
    one run of every set."""
    model, items, _, _ = setup
    batch = make_batch(items[:1])
    item, at = items[0], batch.boundary
    first = min(start for start, _ in item.target_writes)
    sets = [[], [WriteBlock([L1H0], span) for span in item.target_writes],
            [DonorWrite([L1H0], span) for span in item.target_writes], [StateSwap([L1H0], at)],
            [OutputPatch([L1H0], tuple(range(at, batch.length)))]]
    with Runs(model) as runs:
        grouped = candidate_logits(model, batch, sets)
    one_run = run_many(model, batch.recipient, batch.donor, sets, logits_at=[batch.length - 1])
    expected = torch.stack([choice_logits(logits[:, 0], batch.candidates) for logits in one_run])
    torch.testing.assert_close(grouped, expected, rtol=1e-9, atol=1e-9)
    per_set = sorted(shape for shape in runs.shapes if shape[0] > 1)  # the runs of every set's row: suffixes only
    assert per_set == sorted([(3, batch.length - at), (2, batch.length - first)]), runs.shapes


def test_neutral_suppression_and_four_facts_run_each_prefix_once(setup, lab):  # noqa: F811
    """Every binding's queries continue one prefix run per prompt kind: the neutral suppression's recipient and
    donor prefixes once for all bindings, four facts' recipient and two donor prefixes once for the swap, the
    break rates and the Frobenius split."""
    model, _, builder, sources = setup
    neutral = build_items(TaskBuilder(lab[1], replace(builder.spec, variant="neutral")), sources, seed=0)
    at = neutral[0].boundary
    with Runs(model) as runs:
        ex.neutral_suppression(model, neutral, L1H0)
    assert [shape for shape in runs.shapes if shape[1] == at] == [(len(neutral), at)] * 2
    with Runs(model) as runs:
        ex.four_facts(model, builder, sources, L1H0)
    assert len([shape for shape in runs.shapes if shape[1] == at]) == 3


def test_corrector_features_continue_each_items_prefix(setup):
    """The corrector's queries run from the prefix of their item (computed once), not as whole prompts."""
    model, items, _, _ = setup
    with Runs(model) as runs:
        state_features(model, items, L1H0)
    length, at = len(items[0].recipient) + len(items[0].queries[0].tokens), items[0].boundary
    assert (len(items), at) in runs.shapes and all(tokens < length for _, tokens in runs.shapes)


def test_probe_on_a_cpu_says_how_long_it_will_take(lab, tmp_path, capsys):  # noqa: F811
    """Before its experiments a probe on a CPU prints one line with the expected minutes; results.json keeps the
    estimate, the clean-recall passes' seconds and each experiment's CPU seconds beside its wall seconds."""
    docs, tokenizer, _, _ = lab
    (tmp_path / "texts").mkdir()
    for i, doc in enumerate(docs):  # one file a document, as ``linmem probe --sources FOLDER`` reads them
        (tmp_path / "texts" / f"{i:02d}.txt").write_text(doc.text)
    options = ProbeOptions(dev_sources=3, confirm_sources=3, filler_tokens=24, num_bindings=2, repeats=2,
                           only=("logit_lens",), min_clean_recall=0)
    documents = open_source(str(tmp_path / "texts")).documents()
    run_protocol(tiny(tokenizer, mixer="gdn").float(), tokenizer, documents, options, tmp_path / "out")
    lines = [line for line in capsys.readouterr().out.splitlines() if "min on this CPU" in line]
    assert len(lines) == 1 and "1 experiments" in lines[0], lines
    header = json.loads((tmp_path / "out" / "results.json").read_text())["header"]
    assert set(header["cpu_seconds"]) == set(header["seconds"]) == {"logit_lens"}
    assert header["estimated_seconds"] > 0 and header["clean_recall_seconds"] > 0
