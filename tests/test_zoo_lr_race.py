"""scripts/zoo/lr_race.py: the learning-rate race that trained the zoo (its decision rule and config rewriting)."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_race():
    spec = importlib.util.spec_from_file_location("lr_race", ROOT / "scripts" / "zoo" / "lr_race.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lr_race"] = module
    spec.loader.exec_module(module)
    return module


race = load_race()


def entry(lr: float, steps: int, recall_loss: float, accuracy: dict[int, float], tmp_path: Path):
    """An Entry whose metrics say: ``steps`` updates at ``recall_loss`` (+ noise), evaluations ``accuracy``."""
    e = race.Entry("gdn", lr, tmp_path / f"gdn-lr{lr:g}")
    rng = random.Random(lr)
    e.rows = [{"step": s, "loss": 3.0, "recall_loss": recall_loss + rng.uniform(-0.01, 0.01), "tokens_per_s": 1.0,
               **({"val_loss": 3.5, "val_recall_acc": accuracy[s]} if s in accuracy else {})}
              for s in range(1, steps + 1)]
    return e


def test_recall_accuracy_decides_once_a_rate_clears_the_bar(tmp_path):
    slow = entry(2e-3, 720, 5.9, {100 * i: 0.02 for i in range(1, 8)}, tmp_path)
    fast = entry(5e-3, 705, 6.1, {100 * i: (0.02 if i < 7 else 0.30) for i in range(1, 8)}, tmp_path)
    winner, record = race.decide([slow, fast], recall_bar=0.05)
    assert winner is fast and record["decided_at_update"] == 705 and record["lr"] == 5e-3
    assert "accuracy" in record["rule"] and record["figures"][fast.label]["recall_acc"] == 0.30


def test_recall_loss_decides_on_the_plateau_and_compares_the_same_updates(tmp_path):
    low = entry(2e-3, 800, 5.80, {100 * i: 0.03 for i in range(1, 9)}, tmp_path)
    high = entry(5e-3, 700, 5.95, {100 * i: 0.03 for i in range(1, 8)}, tmp_path)
    for row in low.rows:  # the lower loss after update 700 must not count: the race is judged at update 700
        row["recall_loss"] = 6.2 if row["step"] <= 700 else 1.0
    winner, record = race.decide([low, high], recall_bar=0.05)
    assert winner is high and record["decided_at_update"] == 700
    assert record["rule"].startswith("lowest training recall loss over updates 601-700")
    assert math.isclose(record["figures"][low.label]["recall_loss"], 6.2)


def test_a_diverged_rate_loses(tmp_path):
    good = entry(2e-3, 300, 6.0, {100: 0.0, 200: 0.0, 300: 0.0}, tmp_path)
    nan = entry(5e-3, 300, 6.0, {100: 0.0, 200: 0.0, 300: 0.0}, tmp_path)
    nan.rows[-1]["recall_loss"] = float("nan")
    assert race.decide([nan, good], recall_bar=0.05)[0] is good
    assert nan.recall_loss_before(300) == math.inf


def test_rate_variants_change_only_the_schedule_and_the_evaluation():
    config = ROOT / "configs" / "zoo" / "rdn.yaml"
    text = race.variant(race.resolved_text(config), lr=5e-3)
    base, varied = yaml.safe_load(race.resolved_text(config)), yaml.safe_load(text)
    assert varied["optim"]["lr"] == 5e-3 and varied["optim"]["min_lr"] == pytest.approx(5e-4)
    assert varied["train"]["eval_interval"] == 100
    assert varied["model"] == base["model"] and varied["data"] == base["data"]
    assert varied["train"]["steps"] == base["train"]["steps"] and varied["train"]["seed"] == base["train"]["seed"]


def test_seed_variants_change_only_the_seed_and_the_evaluation():
    for config in (ROOT / "configs" / "zoo" / "rdn.yaml", ROOT / "configs" / "zoo" / "stage2" / "rdn.yaml"):
        base = yaml.safe_load(race.resolved_text(config))
        varied = yaml.safe_load(race.variant(race.resolved_text(config), lr=base["optim"]["lr"], seed=7))
        assert varied["train"]["seed"] == 7 != base["train"]["seed"]
        assert varied["model"] == base["model"] and varied["data"] == base["data"]
        assert {k: v for k, v in varied["train"].items() if k not in ("seed", "eval_interval", "eval_tokens",
                                                                       "checkpoint_interval")} == \
            {k: v for k, v in base["train"].items() if k not in ("seed", "eval_interval", "eval_tokens",
                                                                 "checkpoint_interval")}


def test_seed_variant_of_a_config_without_a_seed():
    varied = yaml.safe_load(race.variant(TINY_RACE_CONFIG, seed=5))
    assert varied["train"]["seed"] == 5 and varied["train"]["steps"] == 300


def test_seeded_runs_have_their_own_folders_and_seed_parsing(tmp_path):
    assert race.Entry("gdn", 2e-3, tmp_path, seed=3).label == "gdn-lr0.002-seed3"
    assert race.Entry("gdn", 2e-3, tmp_path).label == "gdn-lr0.002"
    assert race.parse_seeds("0,1,5") == [0, 1, 5]
    for bad in ("0,x", "1,1"):
        with pytest.raises(race.argparse.ArgumentTypeError):
            race.parse_seeds(bad)


def test_plan_parsing(tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\n")
    assert race.parse_plan(["a=2e-3,5e-3"], tmp_path) == {"a": [2e-3, 5e-3]}
    with pytest.raises(SystemExit, match="no config"):
        race.parse_plan(["b=1e-3"], tmp_path)
    with pytest.raises(SystemExit, match="expected NAME=LR"):
        race.parse_plan(["a=fast"], tmp_path)


def test_a_tie_on_accuracy_goes_to_the_lower_recall_loss(tmp_path):
    # the 2026-11-29 RDN race: both rates at the same held-out accuracy; listing order must not decide it
    first = entry(3e-3, 1000, 5.10, {100 * i: 0.25 for i in range(1, 11)}, tmp_path)
    second = entry(5e-3, 1000, 4.90, {100 * i: 0.25 for i in range(1, 11)}, tmp_path)
    winner, record = race.decide([first, second], recall_bar=0.2)
    assert winner is second and "accuracy" in record["rule"]


def test_plateau_accuracy_is_below_the_default_bar(tmp_path):
    # held-out accuracy on the plateau of the zoo's recall mix was 0.04-0.07 (2026-11-29): the recall loss decides
    low = entry(3e-3, 1000, 4.90, {100 * i: 0.056 for i in range(1, 11)}, tmp_path)
    high = entry(5e-3, 1000, 5.10, {100 * i: 0.07 for i in range(1, 11)}, tmp_path)
    winner, record = race.decide([low, high], recall_bar=race.RECALL_BAR)
    assert winner is low and record["rule"].startswith("lowest training recall loss")


TINY_RACE_CONFIG = """name: tiny
model: {mixer: gdn, hidden_size: 32, num_hidden_layers: 2, num_heads: 2, head_dim: 16, hidden_ratio: 2,
        tie_word_embeddings: true}
data:
  dir: DATA
  seq_len: 32
  recall_fraction: 0.25
  recall:
    - {name: mqar, num_kv_pairs: 4}
optim:
  lr: 3.0e-3
  min_lr: 3.0e-4
  warmup_steps: 2
train:
  steps: 300
  batch_size: 8
  eval_interval: 4
  eval_tokens: 512
  eval_recall_samples: 8
  checkpoint_interval: 4
  progress: false
  device: cpu
"""


@pytest.mark.slow
def test_a_tiny_race_end_to_end(dataset, tmp_path):
    """Two rates of one tiny config: the race is decided at update 4, the loser stops with a checkpoint, the winner
    trains to the end, and OUT/finished names it (the file a waiting caller polls for)."""
    import json
    import subprocess

    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "tiny.yaml").write_text(TINY_RACE_CONFIG.replace("DATA", str(dataset)))
    out = tmp_path / "race"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "zoo" / "lr_race.py"), "--out", str(out),
                           "--configs-dir", str(configs), "--decide-step", "4", "--device", "cpu",
                           "--poll-seconds", "0.5", "tiny=2e-3,4e-3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    choice = json.loads((out / "choices.json").read_text())["tiny"]
    winner = choice["winner"]
    assert winner in ("tiny-lr0.002", "tiny-lr0.004") and choice["decided_at_update"] >= 4
    assert json.loads((out / race.FINISHED).read_text()) == {"winners": [winner], "shipped": False}
    assert (out / winner / "model" / "model.safetensors").is_file()
    loser = ({"tiny-lr0.002", "tiny-lr0.004"} - {winner}).pop()
    assert not (out / loser / "model").exists() and any((out / loser / "checkpoints").iterdir())

    # the same config at one rate and two train seeds: one run per seed, each with its own seed, one kept
    seeded = tmp_path / "seeds"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "zoo" / "lr_race.py"), "--out", str(seeded),
                           "--configs-dir", str(configs), "--decide-step", "4", "--device", "cpu",
                           "--poll-seconds", "0.5", "--seeds", "3,4", "tiny=2e-3"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    choice = json.loads((seeded / "choices.json").read_text())["tiny"]
    assert choice["winner"] == f"tiny-lr0.002-seed{choice['seed']}" and choice["seed"] in (3, 4)
    for seed in (3, 4):
        config = yaml.safe_load((seeded / "configs" / f"tiny-lr0.002-seed{seed}.yaml").read_text())
        assert config["train"]["seed"] == seed
