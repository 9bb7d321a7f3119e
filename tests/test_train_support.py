"""Helpers shared by the trainer and evaluation tests (no tests here): a tiny corpus and dataset, tiny configs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from linmem.data.build import BuildOptions, build_dataset
from linmem.data.sources import open_path
from linmem.data.splits import SplitFractions

# Plain words, plus names and colours often enough that the tokenizer learns them whole (the memory lab's
# recall task needs single-token keys and values).
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial bards near "
         "their old stone tower and every morning bright birds sing Alice Bob Carol David Emma Frank Grace "
         "Henry red blue green yellow black white").split()


def write_corpus(folder: Path, documents: int = 60, seed: int = 0) -> Path:
    """``documents`` text files of random sentences (40-80 words each, clauses ending in punctuation)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        sentences = [" ".join(rng.choice(WORDS, size=rng.integers(4, 10))).capitalize() + rng.choice([".", ",", ";"])
                     for _ in range(rng.integers(40, 80))]
        (folder / f"doc{i:03d}.txt").write_text(" ".join(sentences), encoding="utf-8")
    return folder


def build_tiny_dataset(root: Path) -> Path:
    """A dataset folder (vocab 600, splits 0.7 / 0.15 / 0.15) of ``write_corpus`` documents."""
    corpus = write_corpus(root / "corpus")
    out = root / "data"
    options = BuildOptions(vocab_size=600, progress=False, fractions=SplitFractions(0.7, 0.15, 0.15))
    build_dataset([open_path(corpus)], out, options)
    return out


TINY: dict[str, Any] = {
    "name": "tiny",
    "model": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16, "mixer": "gdn",
              "tie_word_embeddings": True, "hidden_ratio": 2},
    "data": {"seq_len": 32, "recall_fraction": 0.25, "recall": [{"name": "mqar", "num_kv_pairs": 4}]},
    "optim": {"lr": "3e-3", "warmup_steps": 2, "min_lr": "3e-4"},
    "train": {"steps": 6, "batch_size": 8, "micro_batch_size": 4, "eval_interval": 3, "eval_tokens": 512,
              "eval_recall_samples": 8, "checkpoint_interval": 2, "keep_checkpoints": 5, "progress": False,
              "device": "cpu"},
}


def tiny_config(data_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """``TINY`` on ``data_dir`` with ``sections`` merged in (``train={"steps": 4}``)."""
    config = copy.deepcopy(TINY)
    config["data"]["dir"] = str(data_dir)
    for name, values in sections.items():
        if isinstance(config.get(name), dict):
            config[name].update(values)
        else:
            config[name] = values
    return config
