"""Where the attention layers of a shipped zoo model look when it must answer a NIAH trial.

For each attention layer and head: the share of the last query token's attention (the position that predicts the
first digit) that falls on the needle's number, averaged over trials of the eval's format, and how often the first
answer token is right. A retrieval head puts most of its attention there.

    python configs/zoo/niah_attention.py gdn-hybrid,transformer [--trials 16] [--length 256]
"""

import argparse
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

import linmem.layers.attention as attention
import linmem.zoo as zoo
from linmem.data.shards import TokenShards
from linmem.eval.niah import haystack_tokens, niah_trial


def sublist_at(ids: list[int], part: list[int]) -> int:
    """Where ``part`` starts in ``ids`` (the last match), or -1."""
    for start in range(len(ids) - len(part), -1, -1):
        if ids[start:start + len(part)] == part:
            return start
    return -1


class AttentionRecorder:
    """Stands in for ``F.scaled_dot_product_attention`` inside linmem's attention layer and keeps, per call, the
    attention weights of the last query position: ``[H, T]``."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []

    def __call__(self, q, k, v, attn_mask=None, **kwargs):
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        self.rows.append(scores[0, :, -1].softmax(-1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", help="comma-separated shipped models with attention layers")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="tokens per trial, the end-of-text included")
    args = parser.parse_args()
    recorder = AttentionRecorder()
    attention.F = type("F", (), {"scaled_dot_product_attention": recorder})  # linmem's attention layer only
    for name in args.models.split(","):
        model, tokenizer = zoo.load(name)
        if not model.config.attn_layers:
            raise SystemExit(f"{name} has no attention layers")
        heldout = next((zoo.path(name).parent / "_heldout").iterdir())
        hay = haystack_tokens(TokenShards(heldout).split("test"))
        encode = partial(tokenizer.encode, add_special_tokens=False)
        rng = np.random.default_rng(0)
        shares, right = [], 0
        for _ in range(args.trials):
            trial = niah_trial(encode, hay, args.length - 1, float(rng.random()), rng)
            ids = [tokenizer.eos_token_id] + trial.context
            needle_at = 1 + trial.cut
            number = sublist_at(trial.needle, trial.answer)
            if number < 0:  # the number merged with its neighbours: take the needle's last tokens but the full stop
                number = len(trial.needle) - len(trial.answer) - 1
            span = slice(needle_at + number, needle_at + number + len(trial.answer))
            recorder.rows.clear()
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            right += int(logits.argmax().item() == trial.answer[0])
            shares.append([row[:, span].sum(-1).tolist() for row in recorder.rows])
        mean = np.array(shares).mean(0)
        print(f"{name}: first answer token right in {right} of {args.trials} trials of {args.length} tokens")
        for layer, heads in zip(model.config.attn_layers, mean):
            print(f"  layer {layer}: attention on the needle's number, per head: "
                  + " ".join(f"{x:.2f}" for x in heads))


if __name__ == "__main__":
    main()
