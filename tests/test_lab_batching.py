"""How many edit sets one batched run of the memory lab takes (``linmem.memory.batching``): planned from the free
memory measured on a first batch, halved on an out-of-memory error with the same results as a run that never
failed, a clear error when one unit does not fit, the caller's size as an override, and the choice said in the
head scan's summary, the probe's report and the benchmark's shapes."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import linmem.memory as mm
from linmem.bench import lab_scale
from linmem.cli import main
from linmem.data.builtin import open_source
from linmem.memory import batching, intervene
from linmem.memory import experiments as ex
from linmem.memory.edits import DonorWrite, OutputPatch, StateSwap, WriteBlock
from linmem.memory.evaluate import candidate_logits, make_batch
from linmem.memory.probe import ProbeOptions, run_protocol
from linmem.memory.tasks import build_items
from linmem.models import LinMemForCausalLM
from tests.test_memory_experiments import lab, tiny  # noqa: F401  (lab: a fixture)

GIB = 2**30


class FakeMemory:
    """A device of ``free`` bytes on which a batch of ``n`` units peaks at ``n * unit`` bytes and keeps
    ``n * kept`` of them (its outputs); a batch over ``limit`` units, or over the free bytes, runs out of memory."""

    def __init__(self, free: int, unit: int, kept: int = 0, limit: int | None = None):
        self.total, self.unit, self.kept, self.limit = free, unit, kept, limit
        self.held, self.peak, self.sizes = 0, 0, []

    def free(self) -> int:
        return self.total - self.held

    def start(self) -> None:
        self.peak = 0

    def used(self) -> int:
        return self.peak

    def release(self) -> None:
        pass

    def run(self, start: int, stop: int) -> list[int]:
        n = stop - start
        self.sizes.append(n)
        if n * self.unit > self.free() or (self.limit is not None and n > self.limit):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        self.peak, self.held = n * self.unit, self.held + n * self.kept
        return list(range(start, stop))


def test_measured_plan_fills_the_free_memory_after_a_first_batch_of_one(monkeypatch):
    memory = FakeMemory(free=100 * GIB, unit=3 * GIB)
    monkeypatch.setattr(batching, "memory_of", lambda device: memory)
    out, choice = batching.run_in_batches(memory.run, 100, "cuda")
    assert [i for part in out for i in part] == list(range(100))
    assert memory.sizes == [1, 26, 26, 26, 21]  # 0.8 x 100 GiB / 3 GiB = 26.7
    assert (choice.how, choice.largest, choice.free_bytes, choice.unit_bytes) == ("measured", 26, 100 * GIB, 3 * GIB)
    assert choice.describe() == "26 of 100 edit sets per batch (chosen from 100.0 GiB free, 3.00 GiB each)"


def test_measured_plan_shrinks_as_kept_outputs_take_memory(monkeypatch):
    memory = FakeMemory(free=10 * GIB, unit=GIB, kept=GIB // 4)
    monkeypatch.setattr(batching, "memory_of", lambda device: memory)
    out, _ = batching.run_in_batches(memory.run, 20, "cuda")
    assert [i for part in out for i in part] == list(range(20))
    assert memory.sizes == [1, 7, 6, 5, 1]  # each plan: 0.8 x (10 GiB less a quarter GiB per unit run) / 1 GiB


def test_out_of_memory_halves_the_batch_and_no_later_batch_is_larger(monkeypatch):
    memory = FakeMemory(free=100 * GIB, unit=3 * GIB, limit=10)  # larger batches need more than they measured
    monkeypatch.setattr(batching, "memory_of", lambda device: memory)
    out, choice = batching.run_in_batches(memory.run, 40, "cuda")
    assert [i for part in out for i in part] == list(range(40))
    assert memory.sizes[:4] == [1, 26, 13, 6] and max(memory.sizes[4:]) == 6
    assert choice.backed_off_from == [26, 13] and choice.largest == 6
    assert choice.describe().endswith("(chosen from 100.0 GiB free, 3.00 GiB each; backed off twice from 26)")


def test_given_size_is_kept_and_backs_off_too(monkeypatch):
    memory = FakeMemory(free=100 * GIB, unit=GIB, limit=4)
    monkeypatch.setattr(batching, "memory_of", lambda device: memory)
    with batching.batch_size(16), batching.recorded() as outer:
        with batching.recorded() as inner:
            out, choice = batching.run_in_batches(memory.run, 20, "cuda")
    assert memory.sizes == [16, 8, 4, 4, 4, 4, 4] and [i for part in out for i in part] == list(range(20))
    assert outer == inner == [choice] and choice.how == "given"
    assert choice.describe() == "4 of 20 edit sets per batch (as given; backed off twice from 16)"
    _, choice = batching.run_in_batches(memory.run, 3, "cuda", size=2)  # the caller's size over the default
    assert choice.largest == 2 and choice.how == "given"
    with pytest.raises(ValueError, match=">= 1"):
        batching.run_in_batches(memory.run, 3, "cuda", size=0)


def test_cpu_takes_the_default_and_other_errors_pass_through():
    calls = []

    def run(start, stop):
        calls.append(stop - start)
        return stop - start

    out, choice = batching.run_in_batches(run, 40, "cpu")
    assert out == [16, 16, 8] and choice.describe() == "16 of 40 edit sets per batch (the default on cpu)"

    def broken(start, stop):
        calls.append(stop - start)
        raise RuntimeError("shape mismatch")

    calls.clear()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        batching.run_in_batches(broken, 40, "cpu")
    assert calls == [16]  # not retried: only an allocation failure backs off
    assert batching.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))


def short_of_memory(monkeypatch, rows: int) -> list[int]:
    """Make the lab's forwards of more than ``rows`` rows run out of memory; returns the rows of each forward."""
    seen, real = [], intervene.forward

    def forward(model, ids, *args):
        seen.append(ids.shape[0])
        if ids.shape[0] > rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {ids.shape[0]} rows)")
        return real(model, ids, *args)

    monkeypatch.setattr(intervene, "forward", forward)
    return seen


@pytest.fixture(scope="module")
def setup(lab):  # noqa: F811
    _, tokenizer, builder, sources = lab
    return tiny(tokenizer, mixer="gdn", num_hidden_layers=2, num_heads=3), build_items(builder, sources[:4], seed=0)


@pytest.mark.slow
def test_head_scan_that_backs_off_equals_one_that_did_not(setup, monkeypatch):
    """Backing off leaves nothing behind: the scan equals one run at the size it backed off to, exactly, and the
    one-batch scan to rounding (a batch's rows are computed alike at any size, up to the order of float sums)."""
    model, items = setup
    whole = ex.head_scan(model, items)  # 7 edit sets: the clean run and 6 heads, one batch on a CPU
    assert whole.summary["batch_choice"] == "7 of 7 edit sets per batch (the default on cpu)"
    threes = ex.head_scan(model, items, chunk=3)
    seen = short_of_memory(monkeypatch, rows=3 * len(items))  # three edit sets of the 4 items fit
    backed = ex.head_scan(model, items)
    assert seen == [4, 28, 12, 12, 4]  # the shared prefix; 7 sets fail; then 3, 3, 1
    assert backed.rows == threes.rows and backed.summary["chosen"] == whole.summary["chosen"]
    assert backed.summary["batch_choice"] == "3 of 7 edit sets per batch (the default on cpu; backed off once from 7)"
    for a, b in zip(backed.rows, whole.rows):
        assert a["component"] == b["component"] and a["mean"] == pytest.approx(b["mean"], rel=1e-12, abs=1e-14)


@pytest.mark.slow
def test_write_and_readout_edits_that_back_off_give_the_same_logits(setup, monkeypatch):
    model, items = setup
    batch = make_batch(items[:2])
    heads = mm.heads(model)[:3]
    item, at = batch.items[0], batch.boundary
    sets = [[]] + [[DonorWrite([c], span) for span in item.target_writes] for c in heads] \
        + [[WriteBlock([c], span) for span in item.target_writes] for c in heads] \
        + [[OutputPatch([c], tuple(range(at, batch.length)))] for c in heads] + [[StateSwap([heads[0]], at)]]
    whole, ones = candidate_logits(model, batch, sets), candidate_logits(model, batch, sets, chunk=1)
    short_of_memory(monkeypatch, rows=len(items[:2]))  # one edit set of the 2 items fits
    with batching.recorded() as chosen:
        backed = candidate_logits(model, batch, sets)
    assert torch.equal(backed, ones)  # two groups, each from its prefix: the writes, and the rest (5 sets)
    assert [c.backed_off_from for c in chosen] == [[5, 2], [6, 3]]
    torch.testing.assert_close(backed, whole, rtol=1e-12, atol=1e-14)


def test_a_batch_of_one_that_does_not_fit_raises_a_clear_error(setup, monkeypatch):
    model, items = setup

    def no_room(model, recipient_ids, edit_sets, *args):
        raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {len(edit_sets)} edit sets)")

    monkeypatch.setattr(intervene, "_split_run", no_room)
    with pytest.raises(torch.OutOfMemoryError, match=r"a batch of one of the 7 edit sets does not fit in the memory "
                                                     r"of cpu \(backed off from 7\)") as raised:
        ex.head_scan(model, items)
    assert "simulated: 1 edit sets" in str(raised.value.__cause__)


def test_probe_reports_each_experiments_batches(lab, tmp_path):  # noqa: F811
    docs, tokenizer, _, _ = lab
    (tmp_path / "texts").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "texts" / f"{i:02d}.txt").write_text(doc.text)
    options = ProbeOptions(dev_sources=3, confirm_sources=3, filler_tokens=24, num_bindings=2, repeats=2,
                           only=("head_scan",), min_clean_recall=0, chunk=3)
    documents = open_source(str(tmp_path / "texts")).documents()
    run_protocol(tiny(tokenizer, mixer="gdn").float(), tokenizer, documents, options, tmp_path / "out")
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    chosen = payload["header"]["batch_choice"]
    assert chosen["head_scan"] == "3 of 5 edit sets per batch (as given)"
    assert payload["experiments"]["head_scan"]["summary"]["batch_choice"] == chosen["head_scan"]
    assert chosen["clean_recall"].startswith("1 of 1 edit sets per batch (as given)")
    assert "3 of 5 edit sets per batch (as given)" in (tmp_path / "out" / "report.html").read_text()


def test_probe_command_refuses_a_chunk_below_one(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "zoo:gdn", "--chunk", "0"])
    assert "--chunk: must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "parameters", "tied"), [("qwen3.5-4b", 4.21e9, True), ("qwen3.5-9b", 8.95e9, False)])
def test_benchmark_qwen_shapes(name, parameters, tied):
    """The full shapes, built on the meta device: the model cards' parameter counts, 768 recurrent heads in 24 GDN
    layers, attention in every fourth layer; the quick copies keep the embedding tying."""
    config = lab_scale.MODELS[name](quick=False)
    with torch.device("meta"):
        model = LinMemForCausalLM(config)
    assert abs(sum(p.numel() for p in model.parameters()) / parameters - 1) < 0.005
    assert len(mm.heads(model)) == 768 and list(config.attention.layers) == list(range(3, 32, 4))
    assert config.tie_word_embeddings is tied and lab_scale.MODELS[name](quick=True).tie_word_embeddings is tied


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
def test_cuda_head_scan_measures_its_batches(setup):
    model, items = setup
    model = copy.deepcopy(model).float().cuda()
    batching.reset_peak("cuda")
    measured = ex.head_scan(model, items)
    assert "GiB free" in measured.summary["batch_choice"]
    assert batching.peak_allocated("cuda") >= torch.cuda.max_memory_allocated()
    given = ex.head_scan(model, items, chunk=1)
    for a, b in zip(measured.rows, given.rows):
        assert a["mean"] == pytest.approx(b["mean"], rel=1e-4, abs=1e-5)
