"""Where the attention layers of a model look when it must answer a NIAH trial, and how much of the number it gets.

For each attention layer and head: the share of the last query token's attention (the position that predicts the
first digit) that falls on the needle's number, averaged over trials of the eval's format; how often the first
answer token is right, and how often every answer token is (teacher-forced: the eval's exact match). A retrieval
head puts most of its attention there; a model can find the number's first token and still not copy the rest.

    python scripts/zoo/niah_attention.py gdn-hybrid,transformer [--trials 16] [--length 256]
    python scripts/zoo/niah_attention.py runs/study/remember/runs/gdn-hybrid/seed-2/model --data data/zoo-4k

MODELS: comma-separated shipped names or model folders (``linmem.eval.loading.load_model``), with attention layers.
"""

import argparse

import numpy as np
import torch

from linmem.eval.loading import load_model, open_heldout
from linmem.eval.niah import haystack_tokens, niah_trial
from linmem.layers.attention import Attention


def sublist_at(ids: list[int], part: list[int]) -> int:
    """Where ``part`` starts in ``ids`` (the last match), or -1."""
    for start in range(len(ids) - len(part), -1, -1):
        if ids[start:start + len(part)] == part:
            return start
    return -1


def query_weights(model, query: dict) -> list[torch.Tensor]:
    """Forward hooks on every attention layer's ``hook_q`` and ``hook_k``: after a forward pass of one sequence, the
    returned list holds, per layer, the attention weights ``[H, at + 1]`` of query position ``at = query["at"]``
    over the keys it sees (with full causal attention, as in the zoo, every key up to it: no other mask)."""
    rows, seen = [], {}
    for layer in model.model.layers:
        attn = layer.attn
        if not isinstance(attn, Attention):
            continue

        def keep_q(module, args, q):
            seen["q"] = q

        def weights(module, args, k, attn=attn):
            at = query["at"]
            q = seen.pop("q")[0, at]  # [H, d]
            k = k[0, :at + 1].repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1)  # [at + 1, H, d]
            rows.append(torch.einsum("hd,thd->ht", q, k).mul(attn.head_dim ** -0.5).softmax(-1))

        attn.hook_q.register_forward_hook(keep_q)
        attn.hook_k.register_forward_hook(weights)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", help="comma-separated shipped models or model folders with attention layers")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="tokens per trial, the end-of-text included")
    parser.add_argument("--data", default=None, help="dataset folder for the haystack (default: the model's record)")
    args = parser.parse_args()
    for name in args.models.split(","):
        em = load_model(name if "/" in name else f"zoo:{name}", device="cpu")
        model = em.model
        if not model.config.attention.layers:
            raise SystemExit(f"{name} has no attention layers")
        query = {}
        rows = query_weights(model, query)
        hay = haystack_tokens(open_heldout(em, args.data, "test"))
        rng = np.random.default_rng(0)
        shares, first_right, all_right = [], 0, 0
        for _ in range(args.trials):
            trial = niah_trial(em.encode, hay, args.length - 1, float(rng.random()), rng)
            ids = [em.eos_id] + trial.context
            needle_at = 1 + trial.cut
            number = sublist_at(trial.needle, trial.answer)
            if number < 0:  # the number merged with its neighbours: take the needle's last tokens but the full stop
                number = len(trial.needle) - len(trial.answer) - 1
            span = slice(needle_at + number, needle_at + number + len(trial.answer))
            rows.clear()
            query["at"] = len(ids) - 1  # the context's last position: it predicts the first answer token
            with torch.no_grad():
                # the context and the answer but its last token: every answer token's prediction, teacher-forced
                picked = model(torch.tensor([ids + trial.answer[:-1]])).logits[0, len(ids) - 1:].argmax(-1).tolist()
            shares.append([row[:, span].sum(-1).tolist() for row in rows])
            first_right += int(picked[0] == trial.answer[0])
            all_right += int(picked == trial.answer)
        mean = np.array(shares).mean(0)
        print(f"{name}: in {args.trials} trials of {args.length} tokens, the first answer token right in "
              f"{first_right}, every answer token in {all_right}")
        for layer, heads in zip(model.config.attention.layers, mean):
            print(f"  layer {layer}: attention on the needle's number, per head: "
                  + " ".join(f"{x:.2f}" for x in heads))


if __name__ == "__main__":
    main()
