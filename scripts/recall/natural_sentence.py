"""The second paper's F.2 test on the shipped models: one evidence sentence in natural wording (" Remember that
{name} lives in {animal}."), asked once after 128 or 512 filler tokens, scored over the 4 candidates and as the
model's first choice over the whole vocabulary (the paper's 80 % gate is on the latter).

    python scripts/recall/natural_sentence.py docs/study/natural-sentence.json [--models gla gdn ...]
"""

from __future__ import annotations

import argparse
import json

from linmem.eval.loading import load_model, open_heldout
from linmem.eval.memory_recall import memory_recall

KEEP = ("accuracy", "ci_low", "ci_high", "top1", "top1_low", "top1_high", "n", "sources", "prompt_tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--models", nargs="+", default=["gla", "gdn", "gdn-hybrid", "sgla", "rla", "rdn"])
    parser.add_argument("--fillers", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--items", type=int, default=128)
    args = parser.parse_args()
    out = {}
    for name in args.models:
        em = load_model(f"zoo:{name}", device="cpu")
        split = open_heldout(em, None, "test")
        for filler in args.fillers:
            metrics = memory_recall(em, split, items=args.items, filler_tokens=filler, template="lives", keys="names",
                                    values="animals", loads=[1], repeats=1, batch_size=16)["metrics"]
            out[f"{name}/{filler}"] = row = {k: metrics[k] for k in KEEP}
            print(name, filler, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
