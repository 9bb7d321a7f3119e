"""The language's own guess at a fact's value: with no fact in context, the model's next-token probabilities over a
format's value words (the single-token ones) after the query "BEFORE KEY MIDDLE", for every single-token key.

A format whose query the text itself answers (" Later that day the king went" -> "up") makes a copied value compete
with that guess; this measures how strong the guess is, per format: the share of the two likeliest values, the
entropy over the values as a fraction of its maximum (1: no preference), and which value is likeliest how often.

    python scripts/recall/value_prior.py docs/study/value-prior.json --models zoo:gdn zoo:gla zoo:rdn \
        [--formats went/roles/directions keeps/roles/materials code/roles/colors] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import torch

from linmem.eval.loading import load_model
from linmem.memory.fact_formats import template_tokens, vocabulary_tokens


def value_prior(em, template: str, keys: str, values: str) -> dict:
    """The guess over ``values`` after ``template``'s query, for each single-token word of ``keys``."""
    before, middle, _ = template_tokens(em.tokenizer, template)
    key_ids = vocabulary_tokens(em.tokenizer, keys, "keys", 1)
    value_ids = vocabulary_tokens(em.tokenizer, values, "values", 2)
    prompts = torch.tensor([[em.document_start, *before, key, *middle] for key in key_ids], device=em.device)
    with torch.no_grad():
        logits = em.model(prompts).logits[:, -1].double()
    p = torch.softmax(logits[:, value_ids], dim=-1)  # [keys, values]
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(len(value_ids))
    likeliest = Counter(em.tokenizer.decode([value_ids[i]], skip_special_tokens=True).strip()
                        for i in p.argmax(-1).tolist())
    return dict(keys=len(key_ids), values=len(value_ids), top2_share=p.topk(2, dim=-1).values.sum(-1).mean().item(),
                uniform_top2_share=2 / len(value_ids), entropy_fraction=entropy.mean().item(),
                value_mass=torch.softmax(logits, -1)[:, value_ids].sum(-1).mean().item(),
                likeliest=dict(likeliest.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--models", nargs="+", default=["zoo:gdn", "zoo:gla", "zoo:rdn"])
    parser.add_argument("--formats", nargs="+", default=["went/roles/directions", "keeps/roles/materials",
                                                          "code/roles/colors"], help="TEMPLATE/KEYS/VALUES")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    out = {}
    for spec in args.models:
        em = load_model(spec, device=args.device)
        for fmt in args.formats:
            template, keys, values = fmt.split("/")
            out[f"{spec} {fmt}"] = row = value_prior(em, template, keys, values)
            print(f"{spec:24s} {fmt:24s} top-2 share {row['top2_share']:.2f} (uniform {row['uniform_top2_share']:.2f})"
                  f", entropy {row['entropy_fraction']:.2f} of its maximum, likeliest {row['likeliest']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
