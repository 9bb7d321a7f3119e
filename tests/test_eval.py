"""Evaluation: scoring primitives against direct computation, each task on a tiny trained model, MQAR with an
oracle model, the stability hooks, the memory-lab hand-off, the CLI report, and lm-evaluation-harness with local
task files (no downloads)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linmem.cli import main
from linmem.data.build import BuildOptions, build_dataset
from linmem.data.shards import TokenShards
from linmem.data.sources import open_path
from linmem.data.synthetic import MQAR
from linmem.data.windows import sequential_windows
from linmem.eval.cloze import build_cloze, cloze_candidates
from linmem.eval.loading import EvalModel, load_model, open_heldout
from linmem.eval.memory_recall import memory_recall
from linmem.eval.mqar import mqar, mqar_batch
from linmem.eval.niah import haystack_tokens, niah_prompt
from linmem.eval.perplexity import perplexity
from linmem.eval.scoring import score_continuations
from linmem.eval.stability import stability
from linmem.io.environment import environment
from linmem.train.config import parse_config
from linmem.train.trainer import train
from tests.test_train_support import build_tiny_dataset, tiny_config, write_corpus  # noqa: F401


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny GDN trained for 30 steps on the tiny corpus with MQAR and the memory lab's kv-filler mixed in."""
    root = tmp_path_factory.mktemp("eval")
    data = build_tiny_dataset(root)
    recall = [{"name": "mqar", "num_kv_pairs": 4}, {"name": "kv-filler", "num_bindings": 2}]
    config = tiny_config(data, data={"seq_len": 128, "recall": recall},
                         train={"steps": 30, "eval_interval": 0, "checkpoint_interval": 0})
    train(parse_config(config), root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def em(trained) -> EvalModel:
    return load_model(trained / "model", device="cpu")


# ---------------------------------------------------------------- scoring and perplexity


def test_scores_batched_equal_direct(em):
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(1, 300, size=n).tolist(), rng.integers(1, 300, size=m).tolist())
             for n, m in [(5, 1), (17, 3), (2, 2), (30, 4), (9, 1)]]
    batched = score_continuations(em, pairs, batch_size=4)
    for (context, continuation), (logprob, greedy) in zip(pairs, batched):
        ids = torch.tensor([context + continuation])
        logits = em.model(ids).logits[0, len(context) - 1:-1].log_softmax(-1)
        direct = logits.detach().gather(-1, torch.tensor(continuation)[:, None]).sum()
        assert logprob == pytest.approx(float(direct), abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == torch.tensor(continuation)).all())


def test_perplexity_equals_model_loss(em, trained):
    split = open_heldout(em, None, "test")
    result = perplexity(em, split, seq_len=64, max_tokens=64 * 6, batch_size=4)["metrics"]
    windows = torch.stack([w for _, w in zip(range(6), sequential_windows(split, 64))])
    with torch.no_grad():
        expected = float(em.model(windows, labels=windows).loss)
    assert result["windows"] == 6 and result["tokens"] == 6 * 63
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert result["ppl"] < 300 / 2  # trained: well below a uniform guess over the vocabulary


# ---------------------------------------------------------------- tasks


def test_cloze_candidates_follow_the_rules():
    text = "We saw gamma and then more words. Then gamma came back, and zeta ended; gamma went home, as gamma."
    # 'back', 'ended', 'home' end clauses but are new; 'gamma came' is mid-clause; only the last gamma counts
    assert cloze_candidates(text, context_chars=30) == [(len(text) - 6, "gamma")]
    assert cloze_candidates(text, context_chars=100) == []  # nothing has 100 characters before it


def test_cloze_examples_and_scores(em):
    split = open_heldout(em, None, "test")
    examples = build_cloze(em, split, count=12, context_chars=200)
    assert 0 < len(examples) <= 12
    for example in examples:
        assert example.target.startswith(" ") and example.target.strip().lower() in example.context.lower()


def test_cloze_contexts_are_mid_document_text_without_eos(em, monkeypatch):
    """A cloze context is cut from inside a document, so it goes to the model without the end-of-text token that
    starts documents and recall samples in training."""
    from linmem.eval import cloze as cloze_module

    seen = []

    def capture(model, pairs, batch_size):
        seen.extend(pairs)
        return [(-1.0, False)] * len(pairs)

    monkeypatch.setattr(cloze_module, "score_continuations", capture)
    result = cloze_module.cloze(em, open_heldout(em, None, "test"), count=6, context_tokens=32)
    assert seen and result["metrics"]["eos_before_context"] is False
    for context, target in seen:
        assert 0 < len(context) <= 32 and context[0] != em.eos_id and em.eos_id not in context and target


def test_training_record_holds_resolved_generators(em):
    mqar_spec, kv_spec = em.info["recall_generators"]
    data_vocab = TokenShards(em.info["dataset"]).vocab_size
    assert mqar_spec["name"] == "mqar" and mqar_spec["vocab_range"] == [em.eos_id + 1, data_vocab]
    assert kv_spec == {"name": "kv-filler", "weight": 1.0, "num_bindings": 2, "template": "code", "values": "colors",
                       "keys": "names", "repeats": 2}


class MQAROracle(nn.Module):
    """Logits that put all mass on the value bound to the current token if it is a key seen before (reads the
    ids, no learning): MQAR accuracy must be exactly 1."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=vocab_size, mixer="gdn")
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for b, row in enumerate(input_ids.tolist()):
            bound: dict[int, int] = {}
            for t in range(1, len(row) - 1, 2):  # bindings first (after EOS): the first pair of a key is its own
                bound.setdefault(row[t], row[t + 1])
            for t, token in enumerate(row):
                if token in bound:
                    logits[b, t, bound[token]] = 10.0
        return types.SimpleNamespace(logits=logits)


def test_mqar_oracle_scores_one_and_trained_model_runs(em):
    oracle = EvalModel(MQAROracle(320), em.tokenizer, em.folder, torch.device("cpu"), em.eos_id,
                       {"seq_len": 64, "recall_generators": [{"name": "mqar", "vocab_range": [1, 300]}]})
    vocab = em.model.config.vocab_size
    table = mqar(oracle, pairs=(2, 4, 8), samples=8)["table"]
    assert [r["pairs"] for r in table] == [2, 4, 8] and all(r["accuracy"] == 1.0 for r in table)
    ids, mask = mqar_batch(MQAR((1, 300), 4), 64, 3, seed=0, eos_id=0)
    assert ids.shape == (3, 64) and (ids[:, 0] == 0).all() and (mask.sum(1) == 4).all()
    result = mqar(em, pairs=(2, 4, 8, 64), seq_len=64, samples=8)
    assert [r["pairs"] for r in result["table"]] == [2, 4, 8]  # 64 pairs do not fit 64 tokens
    trained_range = em.info["recall_generators"][0]["vocab_range"]
    assert result["metrics"]["vocab_range"] == trained_range and trained_range[1] <= vocab


def test_niah_prompt_places_the_needle(em):
    split = open_heldout(em, None, "test")
    hay = haystack_tokens(split)
    positions = []
    for depth in (0.0, 0.5, 1.0):
        context, answer = niah_prompt(em, hay, 160, depth, np.random.default_rng(3))
        assert len(context) == 160 and context[0] == em.eos_id
        needle = em.encode(f" The secret number of {em.decode(context).split('of ')[1].split()[0]} is")
        starts = [t for t in range(len(context)) if context[t:t + len(needle)] == needle]
        assert len(starts) == 2 and em.decode(answer).strip().isdigit()  # the needle, then the question
        positions.append(starts[0])
    assert positions[0] == 1 and positions[0] < positions[1] < positions[2]  # depth 0: right after EOS
    assert niah_prompt(em, hay, 10, 0.5, np.random.default_rng(0)) is None  # no room for needle and question


def test_stability_hooks_measure_each_layer(em):
    split = open_heldout(em, None, "test")
    before = stability(em, split, seq_len=64, windows=2)["table"]
    layer = em.model.model.layers[1].attn
    with torch.no_grad():
        layer.o_proj.weight.mul_(10.0)
    try:
        after = stability(em, split, seq_len=64, windows=2)["table"]
    finally:
        with torch.no_grad():
            layer.o_proj.weight.div_(10.0)
    assert len(before) == 2 and before[0]["kind"] == "gdn"
    assert after[0]["output_norm_mean"] == pytest.approx(before[0]["output_norm_mean"], rel=1e-5)
    assert after[1]["output_norm_mean"] == pytest.approx(10 * before[1]["output_norm_mean"], rel=1e-4)
    assert after[1]["readout_norm_mean"] == pytest.approx(before[1]["readout_norm_mean"], rel=1e-5)


def test_stability_keeps_the_largest_read_out_norm_before_the_output_norm(em):
    """``max_layer_readout_norm`` is the largest per-layer mean read-out norm (docs/results.md row 18's measure), and
    a study reads it as ``readout_norm``, from the per-layer table where a record was evaluated before it was kept."""
    from linmem.study.tables import _log_readout_norm, _readout_norm

    split = open_heldout(em, None, "test")
    found = stability(em, split, seq_len=64, windows=2)
    readouts = [r["readout_norm_mean"] for r in found["table"]]
    assert found["metrics"]["max_layer_readout_norm"] == max(readouts) > 0
    layer = em.model.model.layers[0].attn.hook_readout
    handle = layer.register_forward_hook(lambda module, args, output: output * 50.0)  # the first read-out grows
    try:
        grown = stability(em, split, seq_len=64, windows=2)
    finally:
        handle.remove()
    assert grown["metrics"]["max_layer_readout_norm"] == pytest.approx(50 * readouts[0], rel=1e-4)
    assert grown["metrics"]["max_layer_output_norm"] > 0
    record = {"eval_metrics": {"stability": grown["metrics"]}, "eval_tables": {"stability": found["table"]}}
    assert _readout_norm(record, Path(".")) == grown["metrics"]["max_layer_readout_norm"]
    del record["eval_metrics"]["stability"]["max_layer_readout_norm"]  # an older record: from its table
    assert _readout_norm(record, Path(".")) == max(readouts)
    assert _log_readout_norm(record, Path(".")) == pytest.approx(math.log(max(readouts)))
    assert _readout_norm({"eval_metrics": {}, "eval_tables": {}}, Path(".")) is None
    assert _log_readout_norm({"eval_metrics": {}, "eval_tables": {}}, Path(".")) is None


class RecallOracle(nn.Module):
    """Reads the prompt: the query ends ``key middle``; the answer is the token after the last earlier
    ``key middle`` (the latest fact about the key). Clean memory-lab recall must be exactly 1. A prompt without
    such a fact gets the logits ``prior`` ``[V]`` (what a text prior would say), or no preference;
    ``memory=False`` always answers from ``prior``, facts or not."""

    def __init__(self, vocab_size: int, middle: list[int], distractor: int | None = None,
                 prior: torch.Tensor | None = None, memory: bool = True):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=vocab_size, mixer="gdn")
        self.vocab_size, self.middle, self.distractor = vocab_size, middle, distractor
        self.prior, self.memory = prior, memory

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        width = len(self.middle) + 1
        for b, row in enumerate(input_ids.tolist()):
            pattern = row[-width:]
            starts = [t for t in range(len(row) - width) if row[t:t + width] == pattern] if self.memory else []
            if starts:
                logits[b, -1, row[starts[-1] + width]] = 10.0
            elif self.prior is not None:
                logits[b, -1] = self.prior
            if self.distractor is not None:  # a token that is no candidate outranks the answer
                logits[b, -1, self.distractor] = 20.0
        return types.SimpleNamespace(logits=logits)


def test_memory_lab_recall_on_held_out_text(em):
    pytest.importorskip("linmem.memory.tasks")
    from linmem.memory.tasks import TaskBuilder, TaskSpec

    split = open_heldout(em, None, "test")
    result = memory_recall(em, split, items=8, num_bindings=2, filler_tokens=48)
    assert result["available"] is True, result
    metrics = result["metrics"]
    assert metrics["n"] == 8 and metrics["chance"] == 0.25 and 0 <= metrics["accuracy"] <= 1
    assert metrics["ci_low"] <= metrics["accuracy"] <= metrics["ci_high"]
    middle = TaskBuilder(em.tokenizer, TaskSpec(num_bindings=2)).middle
    oracle = EvalModel(RecallOracle(em.model.config.vocab_size, middle), em.tokenizer, em.folder,
                       torch.device("cpu"), em.eos_id, em.info)
    exact = memory_recall(oracle, split, items=8, num_bindings=2, filler_tokens=48)["metrics"]
    assert exact["accuracy"] == 1.0 and exact["top1"] == 1.0 and exact["top1@2"] == 1.0
    assert 0 <= metrics["top1"] <= metrics["accuracy"]  # first over the vocabulary implies first of the 4
    # right among the 4 candidates, never first over the vocabulary: 4-choice accuracy 1, top-1 0
    distracted = EvalModel(RecallOracle(em.model.config.vocab_size, middle, distractor=em.eos_id), em.tokenizer,
                           em.folder, torch.device("cpu"), em.eos_id, em.info)
    only_four = memory_recall(distracted, split, items=8, num_bindings=2, filler_tokens=48)["metrics"]
    assert only_four["accuracy"] == 1.0 and only_four["top1"] == 0.0 and only_four["top1_high"] == 0.0


def test_no_fact_control_separates_memory_from_the_texts_guess(em):
    """The no-fact prompts hold no presentation of the asked fact: an oracle that reads facts and otherwise answers
    from a fixed prior over the vocabulary scores there exactly the share of items whose answer is the prior's
    first choice among the candidates, and all of the items it had to overturn; a model that only ever answers
    from the prior scores that share with facts and without, and none of the items against it."""
    from linmem.eval.memory_recall import RecallFormat, filler_passages
    from linmem.memory.evaluate import make_batch
    from linmem.memory.tasks import TaskBuilder, TaskSpec, build_items

    split = open_heldout(em, None, "test")
    seed = int(np.random.default_rng().integers(1000))
    fmt = RecallFormat(filler_tokens=48)
    builder = TaskBuilder(em.tokenizer, TaskSpec(num_bindings=2, repeats=fmt.repeats, filler_tokens=48,
                                                 template=fmt.template, keys=fmt.keys, values=fmt.values))
    sources = filler_passages(em, split, 48)
    batch = make_batch(build_items(builder, sources, per_source=-(-12 // len(sources)), seed=seed)[:12])
    guessed = []
    while not 0 < sum(guessed) < len(guessed):  # a prior that guesses some of the items, not all
        prior = torch.randn(em.model.config.vocab_size)
        guessed = (prior[batch.candidates].argmax(-1) == batch.answer).tolist()
    share = sum(guessed) / len(guessed)
    run = lambda **kw: memory_recall(  # noqa: E731
        dataclasses.replace(em, model=RecallOracle(em.model.config.vocab_size, builder.middle, prior=prior, **kw)),
        split, items=12, num_bindings=2, filler_tokens=48, seed=seed)["metrics"]
    reader, guesser = run(), run(memory=False)
    assert reader["accuracy"] == 1.0 and reader["no_fact"] == pytest.approx(share) and reader["against_text"] == 1.0
    assert reader["against_text_n"] == len(guessed) - sum(guessed)
    assert guesser["accuracy"] == pytest.approx(share) and guesser["no_fact@2"] == pytest.approx(share)
    assert guesser["against_text@2"] == 0.0 and guesser["no_fact_low"] <= share <= guesser["no_fact_high"]


def test_memory_recall_hand_off(em):
    split = open_heldout(em, None, "test")
    result = memory_recall(em, split, keys="objects")  # too few object words are single tokens here
    assert result["available"] is False and "single-token keys" in result["reason"]


# ---------------------------------------------------------------- CLI and report


def test_eval_cli_writes_json_markdown_and_figures(trained, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["eval", str(trained), "--tasks", "all", "--out", str(out), "--device", "cpu", "--seq-len", "64",
                 "--max-tokens", "640", "--cloze-examples", "8", "--mqar-pairs", "2,4", "--mqar-samples", "4",
                 "--niah-lengths", "96,160", "--niah-depths", "0,1", "--niah-samples", "2",
                 "--stability-windows", "2"])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert list(report["tasks"]) == ["ppl", "cloze", "mqar", "niah", "recall", "stability"]
    assert report["environment"] == environment("cpu")  # what evaluated the model, beside its numbers
    assert 0 <= report["tasks"]["cloze"]["metrics"]["accuracy"] <= 1
    assert len(report["tasks"]["niah"]["grid"]["accuracy"]) == 2
    markdown = (out / "results.md").read_text()
    assert "## niah" in markdown and "| length | depth 0% | depth 100% |" in markdown
    if "matplotlib" in sys.modules or report["figures"]:
        assert {"niah.png", "stability.png", "mqar.png"} <= {p.name for p in out.iterdir()}
    assert "report:" in capsys.readouterr().out


def test_eval_errors_are_actionable(trained, tmp_path, capsys):
    assert main(["eval", str(trained), "--tasks", "ppl,bogus"]) == 2
    assert "unknown task(s) ['bogus']" in capsys.readouterr().err
    assert main(["eval", str(trained), "--tasks", "ppl", "--data", str(tmp_path)]) == 2
    assert "pass --data DIR" in capsys.readouterr().err
    other = tmp_path / "other"
    build_dataset([open_path(write_corpus(tmp_path / "corpus"))], other, BuildOptions(vocab_size=280, progress=False))
    assert main(["eval", str(trained), "--tasks", "ppl", "--data", str(other)]) == 2
    assert "tokenized with another tokenizer" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nothing"), "--tasks", "mqar"]) == 2
    assert "not a model folder" in capsys.readouterr().err


# ---------------------------------------------------------------- lm-evaluation-harness


def _harness_tasks(folder: Path) -> Path:
    """Three local tasks (loglikelihood, loglikelihood_rolling, generate_until) over local JSONL files."""
    folder.mkdir()
    with open(folder / "cloze.jsonl", "w") as f:
        for word in ("fox", "dog", "bards"):
            f.write(json.dumps({"context": "The quick brown fox jumps over the lazy dog while the", "target":
                                f" {word}"}) + "\n")
    with open(folder / "docs.jsonl", "w") as f:
        for n in (1, 3):
            f.write(json.dumps({"text": "Seven wizards quietly hex jovial bards. " * n}) + "\n")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\ntest_split: test\n"
    (folder / "cloze.yaml").write_text(
        "task: linmem_local_cloze\n" + common.format(file=folder / "cloze.jsonl")
        + "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\n"
        + "metric_list:\n  - metric: acc\n  - metric: perplexity\n")
    (folder / "rolling.yaml").write_text(
        "task: linmem_local_rolling\n" + common.format(file=folder / "docs.jsonl")
        + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        + "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (folder / "generate.yaml").write_text(
        "task: linmem_local_generate\n" + common.format(file=folder / "cloze.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\n"
        + "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n  do_sample: false\n"
        + "metric_list:\n  - metric: exact_match\n")
    return folder


def test_lm_eval_harness_runs_local_tasks_offline(em, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from linmem.eval.harness import LinMemLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert get_model("linmem") is LinMemLM
    lm = LinMemLM(em, batch_size=2, max_length=32)
    tasks = TaskManager(include_path=str(_harness_tasks(tmp_path / "tasks")), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["linmem_local_cloze", "linmem_local_rolling",
                                                   "linmem_local_generate"], task_manager=tasks, bootstrap_iters=0,
                                  log_samples=False)["results"]
    assert 0 <= out["linmem_local_cloze"]["acc,none"] <= 1 and out["linmem_local_cloze"]["perplexity,none"] > 1
    assert out["linmem_local_rolling"]["bits_per_byte,none"] > 0
    assert out["linmem_local_generate"]["exact_match,none"] in (0.0, 1 / 3, 2 / 3, 1.0)


def test_harness_rolling_equals_direct_sum(em):
    pytest.importorskip("lm_eval")
    from linmem.eval.harness import LinMemLM, split_trailing_space

    lm = LinMemLM(em, max_length=8)
    text = "Seven wizards quietly hex jovial bards near their old stone tower. " * 2
    request = types.SimpleNamespace(args=(text,))
    ids = [em.eos_id] + em.encode(text)
    assert len(ids) > 3 * 8  # several chunks of 8
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):  # every token scored once, with at most 8 tokens of context
            logits = em.model(torch.tensor([ids[max(0, t - 8):t]])).logits[0, -1]
            total += float(F.log_softmax(logits, -1)[ids[t]])
    rolled = lm.loglikelihood_rolling([request])[0]
    # chunks reuse one window for up to 8 targets, so contexts differ from the sliding sum: compare loosely,
    # and exactly against the chunk definition below
    chunks = [(ids[:s], ids[s:s + 8]) for s in range(1, len(ids), 8)]
    assert rolled == pytest.approx(sum(s[0] for s in score_continuations(em, chunks, 4, 8)), abs=1e-4)
    assert rolled == pytest.approx(total, rel=0.2)
    assert split_trailing_space("Hello there  ", "world") == ("Hello there", "  world")
    generated = lm.generate_until([types.SimpleNamespace(args=("The quick", {"until": ["."], "max_gen_toks": 5}))])
    assert isinstance(generated[0], str) and "." not in generated[0]


def test_requests_start_where_documents_start(em):
    """The harness and the NIAH prompts put the document start first: the end-of-text for linmem's own models, the
    tokenizer's BOS where one is configured (an imported checkpoint)."""
    pytest.importorskip("lm_eval")
    from dataclasses import replace

    from linmem.eval.harness import LinMemLM

    assert em.document_start == em.eos_id
    hay = haystack_tokens(open_heldout(em, None, "test"))
    with_bos = replace(em, start_id=em.eos_id + 7)
    assert LinMemLM(with_bos)._encode_context("Seven wizards") == [em.eos_id + 7] + em.encode("Seven wizards")
    assert niah_prompt(with_bos, hay, 160, 0.5, np.random.default_rng(3))[0][0] == em.eos_id + 7


def test_lm_eval_harness_on_a_shipped_model(tmp_path, monkeypatch):
    """The adapter as a user calls it: ``model="linmem"``, ``model_args="pretrained=<folder>"``, on a model the package
    ships, with local task files; on its own held-out text it must beat the uniform guess by far."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    import linmem.eval.harness  # noqa: F401  (registers --model linmem)
    from linmem import zoo
    from linmem.data.tokenizer import load_tokenizer
    from linmem.demo import heldout_documents

    if "gdn" not in zoo.names(zoo.PACKAGE_DIR):
        pytest.skip("the package ships no gdn model")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "tasks"
    _harness_tasks(folder)
    texts = [d.text[:800] for d in heldout_documents("gdn", zoo.PACKAGE_DIR)[:4]]
    with open(folder / "docs.jsonl", "w") as f:  # the rolling task now reads held-out documents
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tasks = TaskManager(include_path=str(folder), include_defaults=False)
    model_dir = zoo.path("gdn", zoo.PACKAGE_DIR)
    out = lm_eval.simple_evaluate(model="linmem", model_args=f"pretrained={model_dir},device=cpu",
                                  tasks=["linmem_local_cloze", "linmem_local_rolling"], task_manager=tasks,
                                  bootstrap_iters=0, log_samples=False)["results"]
    assert 0 <= out["linmem_local_cloze"]["acc,none"] <= 1
    tokenizer = load_tokenizer(model_dir)
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    uniform = tokens * math.log2(len(tokenizer)) / sum(len(t.encode()) for t in texts)
    assert 0 < out["linmem_local_rolling"]["bits_per_byte,none"] < 0.6 * uniform


def test_eval_cli_scores_the_whole_split_with_max_tokens_all(trained, tmp_path, capsys):
    """``--max-tokens all`` counts every window of the split, as a study's ``max_tokens: all`` does; a count the
    split holds fewer tokens than gives the same windows, and a count below 1 or a word is refused by name."""
    reports, printed = {}, {}
    for count in ("all", "64", str(10**9)):
        out = tmp_path / f"ppl-{count}"
        assert main(["eval", str(trained), "--tasks", "ppl", "--out", str(out), "--device", "cpu", "--seq-len",
                     "64", "--max-tokens", count]) == 0
        reports[count] = json.loads((out / "results.json").read_text())["tasks"]["ppl"]["metrics"]
        printed[count] = capsys.readouterr().out
    assert reports["all"] == reports[str(10**9)]
    assert reports["all"]["tokens"] > reports["64"]["tokens"]
    assert reports["all"]["whole_split"] and not reports["64"]["whole_split"]
    assert f"(the whole test split, {reports['all']['tokens']:,} tokens, 64-token windows)" in printed["all"]
    assert f"(first {reports['64']['tokens']:,} test tokens, 64-token windows)" in printed["64"]
    for bad in ("0", "-5", "lots"):
        with pytest.raises(SystemExit):
            main(["eval", str(trained), "--tasks", "ppl", "--max-tokens", bad])
        assert f"max_tokens must be a whole number >= 1 or all; got '{bad}'" in capsys.readouterr().err
