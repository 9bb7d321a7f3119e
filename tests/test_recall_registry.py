"""Every training recall generator goes through ``linmem.data.synthetic``'s registry, and building them there draws
the same samples as the generators training used before they registered themselves.

The hashes below were recorded from the tiny test dataset (``tests.test_train_support.build_tiny_dataset``) with the
training code that special-cased ``kv-filler`` and ``niah``: eight samples of 255 tokens per generator, seeds 0-7.
They pin the samples (and with them the zoo's training data) bit for bit.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from linmem.data import synthetic
from linmem.data.shards import TokenShards
from linmem.train.data import resolve_generator

RECORDED = {
    "mqar": ({"num_kv_pairs": 4}, {"vocab_range": [1, 475]},
             "8e3875e9aae940465830dcf6e8a6e1dfa9fed6653e41bb2b677a9fd0e6bd8d71"),
    "kv-filler": ({}, {"template": "code", "values": "colors", "keys": "names", "num_bindings": 4, "repeats": 2},
                  "b2ab5ebb49951451c6caaa5b3ca5dbd13274facc1da5f995274c9ae7605e9aad"),
    "niah": ({"min_length": 200}, {"max_length": 255},
             "8d86e1d632b916692858bdbef9ccc7b66311045a58af5f5f85cfe575a79f00e9"),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_samples_match_the_recorded_ones(dataset, name):
    options, defaults, digest = RECORDED[name]
    generator, weight, resolved = resolve_generator({"name": name, **options}, 0, TokenShards(dataset), "test",
                                                    seq_len=256)
    assert weight == 1.0 and {k: resolved[k] for k in defaults} == defaults
    hashed = hashlib.sha256()
    for seed in range(8):
        sample = generator.sample(np.random.default_rng(seed), 255)
        hashed.update(sample.tokens.astype(np.int64).tobytes())
        hashed.update(sample.loss_mask.astype(np.bool_).tobytes())
    assert hashed.hexdigest() == digest


def test_training_registers_the_generators_defined_above_data(dataset):
    """Importing the training data module registers the lab's and the eval's generators with their dataset
    builders; an unknown name is one error that lists them."""
    assert {"mqar", "kv-filler", "niah"} <= set(synthetic.known_generators())
    assert {"mqar", "kv-filler", "niah"} <= set(synthetic.DATASET_BUILDERS)
    synthetic.generator_for_dataset("niah", {"min_length": 200}, TokenShards(dataset), 256, "key")
    with pytest.raises(ValueError, match=r"key.name 'no-such' is not a registered recall generator .*kv-filler"):
        synthetic.generator_for_dataset("no-such", {}, TokenShards(dataset), 256, "key")
