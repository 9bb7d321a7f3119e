"""The ``niah`` training recall generator: samples in the NIAH eval's exact format (the eval's own trial code), a
training config that mixes them in, and option errors that name the config key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linmem.data.shards import TokenShards
from linmem.data.synthetic import FILLER_TOKENS, check_sample
from linmem.data.tokenizer import load_tokenizer
from linmem.eval.loading import EvalModel
from linmem.eval.niah import NAMES, NiahRecall, haystack_tokens, niah_prompt, niah_trial
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.train.config import parse_config
from linmem.train.data import open_train_data, resolve_generator
from linmem.train.distributed import Distributed
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def shards(dataset) -> TokenShards:
    return TokenShards(dataset)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (shown in assertion messages, to replay a failure)."""
    return int(np.random.SeedSequence().entropy % 2**32)


@pytest.fixture(scope="module")
def em(dataset, shards) -> EvalModel:
    """An ``EvalModel`` over the dataset's tokenizer (an untrained tiny model: only its tokenizer is used)."""
    tokenizer = load_tokenizer(dataset)
    config = LinMemConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_heads=2,
                          head_dim=8, hidden_ratio=2)
    return EvalModel(LinMemForCausalLM(config).eval(), tokenizer, dataset, torch.device("cpu"), shards.eos_id)


def find(tokens: list[int], piece: list[int]) -> list[int]:
    return [t for t in range(len(tokens) - len(piece) + 1) if tokens[t:t + len(piece)] == piece]


def test_samples_are_eval_trials_of_the_requested_length(shards, em, seed):
    """(a) exact length, answer " NNNN", one needle (same name and number) before the query, mask on the answer."""
    rng = np.random.default_rng(seed)
    spec = {"name": "niah", "min_length": int(rng.integers(70, 100)), "max_length": int(rng.integers(100, 127))}
    generator, weight, resolved = resolve_generator(spec, 0, shards, "test", seq_len=128)
    assert isinstance(generator, NiahRecall) and weight == 1.0
    assert resolved == {**spec, "weight": 1.0, "names": list(NAMES)}
    low, high = spec["min_length"], spec["max_length"]
    trial_lengths = set()
    for _ in range(40):
        draw = int(rng.integers(2**32))
        sample = generator.sample(np.random.default_rng(draw), 127)
        check_sample(sample, 127, shards.vocab_size)
        tokens, mask = sample.tokens.tolist(), sample.loss_mask
        answer_at = int(np.flatnonzero(mask)[0])
        assert mask[answer_at:].all() and not mask[:answer_at].any(), seed  # the answer closes the sample
        answer = em.decode(tokens[answer_at:])
        assert len(answer) == 5 and answer[0] == " " and answer[1:].isdigit() and answer[1] != "0", (seed, answer)
        query_text = em.decode(tokens[:answer_at]).rsplit("\n", 1)[1]
        assert query_text.startswith(" The secret number of ") and query_text.endswith(" is"), (seed, query_text)
        name = query_text[len(" The secret number of "):-len(" is")]
        assert name in NAMES, (seed, name)
        query = em.encode(f"\n The secret number of {name} is")
        needle = em.encode(f" The secret number of {name} is{answer}.")
        assert tokens[answer_at - len(query):answer_at] == query, seed
        assert len(find(tokens, needle)) == 1 and find(tokens, needle)[0] < answer_at - len(query), seed
        assert len(find(tokens, em.encode(" The secret number of"))) == 2, seed  # the needle and the query only
        length = int(np.random.default_rng(draw).integers(low, high + 1))  # the generator's first draw
        assert tokens[127 - length - 1] == shards.eos_id, (seed, draw)  # a shorter trial follows an end-of-text
        trial_lengths.add(length)
    assert len(trial_lengths) > 1, (seed, trial_lengths)


def test_default_trial_fills_the_sequence(shards, seed):
    generator, _, resolved = resolve_generator({"name": "niah", "weight": 2}, 1, shards, "test", seq_len=96)
    assert resolved["min_length"] == resolved["max_length"] == 95 and resolved["weight"] == 2.0
    _, _, explicit = resolve_generator({"name": "niah", "min_length": None, "max_length": None}, 1, shards, "test", 96)
    assert explicit["min_length"] == explicit["max_length"] == 95  # YAML nulls: the defaults, recorded
    rng = np.random.default_rng(seed)
    hay = haystack_tokens(shards.split("train"), FILLER_TOKENS)
    for _ in range(10):
        draw = int(rng.integers(2**32))
        sample = generator.sample(np.random.default_rng(draw), 95)
        check_sample(sample, 95, shards.vocab_size)
        replay = np.random.default_rng(draw)
        assert int(replay.integers(95, 96)) == 95
        trial = niah_trial(generator.encode, hay, 95, float(replay.random()), replay, with_answer=True)
        assert sample.tokens.tolist() == trial.context + trial.answer, (seed, draw)  # no lead: the trial fills it
    short = NiahRecall(generator.encode, hay, shards.eos_id, min_length=20, max_length=20)
    with pytest.raises(ValueError, match=r"niah: a trial of 20 tokens has no room for the needle, query and answer"):
        short.sample(rng, 95)
    with pytest.raises(ValueError, match=r"niah: the haystack \(20 tokens\) is shorter than the 30 tokens before"):
        NiahRecall(generator.encode, hay[:20], shards.eos_id, min_length=65, max_length=65).sample(rng, 95)
    with pytest.raises(ValueError, match=r"niah: min_length 95 and max_length 95 must satisfy .* <= 80"):
        generator.sample(rng, 80)  # resolved for seq_len 96, asked for a shorter sequence


def test_generator_and_eval_share_the_trial(shards, em, seed):
    """(b) a full-length training sample is token for token the eval's context and answer for the same draws."""
    rng = np.random.default_rng(seed)
    hay = haystack_tokens(shards.split("train"), FILLER_TOKENS)
    for _ in range(20):
        length = int(rng.integers(70, 200))
        generator, _, _ = resolve_generator({"name": "niah", "max_length": length}, 0, shards, "test")
        draw = int(rng.integers(2**32))
        # seq_len = length + 1: the trial follows one end-of-text, as the eval's context opens with it
        sample = generator.sample(np.random.default_rng(draw), length + 1)
        answer_len = int(sample.loss_mask.sum())
        replay = np.random.default_rng(draw)  # the generator draws the length, the depth, then the eval's trial
        assert int(replay.integers(length, length + 1)) == length
        depth = float(replay.random())
        context, answer = niah_prompt(em, hay, length + 1 - answer_len, depth, replay)
        assert sample.tokens.tolist() == context + answer, (seed, draw)
        assert sample.loss_mask.tolist() == [False] * len(context) + [True] * len(answer), (seed, draw)
    # the pieces, from the one shared function, with the generator's and the eval's encoders alike
    for _ in range(5):
        draw, depth = int(rng.integers(2**32)), float(rng.random())
        trial = niah_trial(generator.encode, hay, 150, depth, np.random.default_rng(draw), with_answer=True)
        via_eval = niah_trial(em.encode, hay, 150, depth, np.random.default_rng(draw), with_answer=True)
        assert trial == via_eval, (seed, draw)
        assert trial.needle == em.encode(f" The secret number of {trial.name} is {trial.number}.")
        assert trial.query == em.encode(f"\n The secret number of {trial.name} is")
        assert trial.answer == em.encode(f" {trial.number}")


def test_training_config_mixes_niah_in(dataset, em, seed):
    """(c) ``data.recall: [{name: niah}]`` opens and its synthetic rows end with the query and a labelled answer."""
    config = parse_config(tiny_config(dataset, data={"seq_len": 96, "recall_fraction": 0.5,
                                                     "recall": [{"name": "niah", "weight": 1}]}))
    data = open_train_data(config.data, seed % 1000, Distributed())
    assert data.generator_specs == [{"name": "niah", "weight": 1.0, "min_length": 95, "max_length": 95,
                                     "names": list(NAMES)}]
    rows = 0
    for step in range(4):
        batch = data.batch(step, 0, 1, 8, 0, 1)
        assert batch["input_ids"].shape == (8, 96)
        for ids, labels, synthetic in zip(batch["input_ids"], batch["labels"], batch["synthetic"]):
            if not synthetic:
                continue
            rows += 1
            answer = labels != -100
            text = em.decode(ids[~answer].tolist())
            assert ids[0] == em.eos_id and "\n The secret number of " in text and text.endswith(" is"), seed
            assert answer[-1] and em.decode(ids[answer].tolist())[1:].isdigit(), seed
    assert rows > 0, seed
    held_out = data.recall.batch(0, 4)  # the held-out recall stream (another seed) uses it too
    assert held_out["synthetic"].all() and ((held_out["labels"] != -100).sum(1) >= 2).all()


@pytest.mark.parametrize("options, error", [
    ({"min_length": 0}, r"data\.recall\[0\]\.min_length must be a positive integer"),
    ({"max_length": "long"}, r"data\.recall\[0\]\.max_length must be a positive integer"),
    ({"max_length": True}, r"data\.recall\[0\]\.max_length must be a positive integer"),
    ({"max_length": 96}, r"data\.recall\[0\]\.max_length 96 is longer than a sequence after its separator"),
    ({"min_length": 80, "max_length": 60}, r"data\.recall\[0\]\.min_length 80 is above data\.recall\[0\]\.max_length"),
    ({"names": []}, r"data\.recall\[0\]\.names must be a non-empty list"),
    ({"names": "Alice"}, r"data\.recall\[0\]\.names must be a non-empty list"),
    ({"names": ["Alice", " Bob"]}, r"data\.recall\[0\]\.names must be a non-empty list"),
    ({"depth": 0.5}, r"data\.recall\[0\]: unknown option\(s\) depth for niah"),
    ({"min_length": 8}, r"data\.recall\[0\]\.min_length 8 leaves no room for a trial: .* need \d+ tokens"),
    ({"max_length": 20}, r"data\.recall\[0\]\.max_length 20 leaves no room for a trial"),
])
def test_bad_options_name_the_key(dataset, options, error):
    """(d) errors name ``data.recall[i]`` and the option (or, for lengths that cannot fit, the sequence length)."""
    config = parse_config(tiny_config(dataset, data={"seq_len": 96, "recall": [{"name": "niah", **options}]}))
    with pytest.raises(ValueError, match=error):
        open_train_data(config.data, 0, Distributed())


def test_unknown_name_lists_niah(dataset):
    config = parse_config(tiny_config(dataset, data={"recall": [{"name": "niahh"}]}))
    with pytest.raises(ValueError, match=r"data\.recall\[0\]\.name 'niahh' is not a registered .*kv-filler.*niah"):
        open_train_data(config.data, 0, Distributed())


def test_names_option(shards, em, seed):
    names = ["Zed", "Yara"]
    generator, _, resolved = resolve_generator({"name": "niah", "names": names}, 0, shards, "test", seq_len=96)
    assert resolved["names"] == names
    rng = np.random.default_rng(seed)
    seen = {em.decode(generator.sample(rng, 95).tokens.tolist()).rsplit("\n", 1)[1].split()[4] for _ in range(30)}
    assert seen == set(names), seed
