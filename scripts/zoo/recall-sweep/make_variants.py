"""Write the recall-recipe sweep's configs (docs/training.md, "Why this recall recipe") from a zoo config.

    python scripts/zoo/recall-sweep/make_variants.py BASE.yaml [BASE.yaml ...] --out runs/sweep-configs
    python scripts/zoo/recall-sweep/make_variants.py configs/zoo/gdn.yaml configs/zoo/rdn.yaml \
        --lrs 2e-3,4e-3,6e-3 --out runs/lr-configs      # the configs as they are, at each peak lr
    bash scripts/zoo/recall-sweep/sweep.sh runs/sweep-configs runs/sweep 290

Each variant changes one thing of the data recipe (recall fraction, answer weight, lr, generator mix) and evaluates
every 100 updates. The 2026-11-29 sweep ran it on the zoo's transformer and gdn configs as they were at commit
52987a9 (recall mix MQAR-8 : MQAR-32 : facts : wide facts = 2 : 1 : 2 : 1, 30% recall, weight 32, 1,600 updates).
"""

import argparse
import re
from pathlib import Path

MQAR8 = "{name: mqar, num_kv_pairs: 8, vocab_range: [2, 1026], weight: 1}"
VARIANTS = {
    "A-base": {},
    "B-f05w8": {"fraction": 0.5, "weight": 8},
    "C-pure": {"fraction": 1.0},
    "D-mqar8": {"recall": [MQAR8]},
    "E-lr1e3": {"lr": 1e-3},
    "F-f05w32": {"fraction": 0.5},
    "G-w128": {"weight": 128},
}


def variant(text: str, fraction=None, weight=None, lr=None, recall=None, seed=None) -> str:
    """``text`` (a zoo config) with the given data/optim keys (and the train seed) replaced and evaluation every 100
    updates."""
    if fraction is not None:
        text = re.sub(r"recall_fraction: [0-9.]+", f"recall_fraction: {fraction}", text)
    if weight is not None:
        text = re.sub(r"recall_loss_weight: [0-9.]+", f"recall_loss_weight: {weight}", text)
    if lr is not None:
        text = re.sub(r"\n  lr: [0-9.e-]+", f"\n  lr: {lr}", text)
        text = re.sub(r"min_lr: [0-9.e-]+", f"min_lr: {lr / 10:.3g}", text)
    if recall is not None:
        text = re.sub(r"  recall:\n(    .*\n)+", "  recall:\n" + "".join(f"    - {r}\n" for r in recall), text)
    if seed is not None:
        text, found = re.subn(r"(\ntrain:\n(?:  .*\n)*?  seed: )\d+", rf"\g<1>{int(seed)}", text)
        if not found:  # the config leaves the seed at its default: say it
            text, found = re.subn(r"\ntrain:\n", f"\ntrain:\n  seed: {int(seed)}\n", text)
        if not found:
            raise ValueError("no train section to set the seed in")
    text = re.sub(r"eval_interval: \d+", "eval_interval: 100", text)
    text = re.sub(r"eval_tokens: \d+", "eval_tokens: 16384", text)
    return re.sub(r"checkpoint_interval: \d+", "checkpoint_interval: 100000", text)


def main() -> None:
    parser = argparse.ArgumentParser(description="write the recall-recipe sweep's configs")
    parser.add_argument("bases", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lrs", default=None,
                        help="comma-separated peak learning rates (min lr a tenth): one variant each instead of the "
                             "recipe variants")
    args = parser.parse_args()
    variants = VARIANTS
    if args.lrs:
        variants = {f"lr{lr}": {"lr": float(lr)} for lr in args.lrs.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    for base in args.bases:
        text = base.read_text()
        for name, change in variants.items():
            (args.out / f"{base.stem}-{name}.yaml").write_text(variant(text, **change))


if __name__ == "__main__":
    main()
