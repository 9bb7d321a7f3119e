"""Recall of shipped zoo models on training-format samples, task by task.

For each model: the share of answer tokens predicted right (teacher-forced, as in the training loss) and of
samples with every answer token right, on fresh samples of each recall generator of the model's config, and on
NIAH trials of fixed lengths. Tells "never learned this task" apart from "learned it, but not in the eval's form".

    python scripts/zoo/recall_by_task.py gdn,sgla,rla,rdn [--samples 32] [--data data/zoo-4k]
    python scripts/zoo/recall_by_task.py runs/proxy/sgla-niah      # a run folder: its config.yaml and model/
"""

import argparse
from pathlib import Path

import numpy as np
import torch
import yaml
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401  (registers the model class)
import linmem.zoo as zoo
from linmem.data.shards import TokenShards
from linmem.train.data import resolve_generator

ROOT = Path(__file__).resolve().parents[2]
NIAH_LENGTHS = (128, 256, 511)


def task_label(resolved: dict) -> str:
    keys = ("num_kv_pairs", "min_length", "max_length")
    return resolved["name"] + "".join(f" {k}={resolved[k]}" for k in keys if k in resolved)


def config_and_model(name: str) -> tuple[dict, Path]:
    """A zoo name's config and shipped folder, or a run folder's ``config.yaml`` and ``model/``."""
    run = Path(name)
    if (run / "config.yaml").is_file():
        return yaml.safe_load((run / "config.yaml").read_text()), run / "model"
    return yaml.safe_load((ROOT / f"configs/zoo/{name}.yaml").read_text()), zoo.path(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", help="comma-separated zoo names (configs/zoo/NAME.yaml, linmem.zoo.path(NAME)) "
                                       "or run folders")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--data", type=Path, default=ROOT / "data/zoo-4k")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shards = TokenShards(args.data)
    for name in args.models.split(","):
        config, folder = config_and_model(name)
        seq_len = config["data"]["seq_len"]
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        lengths = [n for n in NIAH_LENGTHS if n < seq_len]
        specs = config["data"]["recall"] + [{"name": "niah", "min_length": n, "max_length": n} for n in lengths]
        for i, spec in enumerate(specs):
            generator, _, resolved = resolve_generator(dict(spec), i, shards, name, seq_len)
            rng = np.random.default_rng(1234 + i)
            samples = [generator.sample(rng, seq_len - 1) for _ in range(args.samples)]
            # every training sequence starts with the end-of-text separator
            tokens = torch.tensor(np.stack([np.concatenate([[shards.eos_id], s.tokens]) for s in samples]))
            answers = torch.tensor(np.stack([np.concatenate([[False], s.loss_mask]) for s in samples]))[:, 1:]
            with torch.no_grad():
                logits = torch.cat([model(tokens[j:j + 8]).logits for j in range(0, len(samples), 8)])
            right = logits[:, :-1].argmax(-1) == tokens[:, 1:]
            token_acc = (right & answers).sum().item() / answers.sum().item()
            sample_acc = (right | ~answers).all(1).float().mean().item()
            print(f"{Path(name).name:12} {task_label(resolved):34} answer tokens {token_acc:.3f}  "
                  f"whole samples {sample_acc:.3f}", flush=True)


if __name__ == "__main__":
    main()
