"""Does a zoo model learn to recall facts in a format it never trained on? Fine-tune it on facts in many formats and
measure clean recall on the memory lab's held-out formats as training goes on.

    python scripts/recall/transfer.py ARM [--model zoo:rdn] [--steps 3000] [--every 500] [--batch 32]
        [--seconds 320] [--lm-weight 1] [--text-tokens 400000] [--text-window 0] [--train-only .attn.]
        [--facts-first 0] [--then-text 0] [--lr 3e-4] [--seed 0] [--save DIR] [--device cuda] > ARM.jsonl
    python scripts/recall/plot_transfer.py docs/study/transfer/{text,gen,text8,text-lm,mix}.jsonl \
        --out docs/study/transfer/transfer.png

Arms (what the fine-tuning batches hold; every arm keeps the zoo's own format, code / names -> colours, at weight 1):
  text     facts whose template is a stretch of the training text, keys and values from its frequent words (weight 3)
  gen      facts in generated templates (random frequent words around the slots) instead of text templates
  text8    text templates with 8 facts per sample (288-token samples) instead of 4
  text-lm  text templates, plus as many windows of training text with the language-model loss
  mix      text templates, plus MQAR (4 pairs, ids 2-1025) and NIAH needles
  wide     text templates, plus MQAR with 4 and 8 pairs over every id but the lab's held-out words
  oracle   as wide, with the held-out words' ids drawn too (a diagnostic, not a recipe: is copying tied to ids?)
  ids      text templates whose keys and values are drawn from every token id (subword pieces and digits too)
           but the held-out tokens, the punctuation marks and end-of-text, instead of the text's 849 whole words
           (4,017 ids; kv-filler's ``word_pool: ids`` leaves out other spellings of held-out words too): does copying
           many more kinds of token in a sentence carry it to words never copied?
  ids8     as ids, with 8 facts per sample (as text8)
  ids-lm   as ids, plus as many windows of training text with the language-model loss (as text-lm)
  lm       training text alone with the language-model loss, no facts (not the zoo's format either): the control
           for what the text (--text-tokens, --text-window) and the optimizer do to the test loss on their own

Each line printed is JSON: the arm, the model, the text's loss weight (LM arms), the trained parameters
(--train-only), the phase (start, facts, or text after --then-text), the update, seconds so far, the
language-model loss on 32 windows of 512 tokens of the test split (``test_loss``, nats per token; also over the
positions within the fine-tuning samples' length and beyond it), and per held-out format the clean recall at 1, 4 and
8 facts (1 and 4 for names: 7 are single tokens), --items per load (128), 128 filler tokens. Held-out formats
(linmem.memory.fact_formats.HELD_OUT): went / roles -> directions and keeps / roles -> materials are new in template
and words; went / names -> colours only in template; code / roles -> directions only in words. AdamW at --lr (3e-4), no
weight decay, gradient clip 1, bf16 autocast on a GPU; the loss is the answers' cross-entropy (plus --lm-weight times
the text's, for text-lm and ids-lm, after the first --facts-first updates). --seed draws the fine-tune's batches
(facts and text windows); the held-out items are the lab's own whatever the seed. --save DIR writes the fine-tuned
model there at the end (bfloat16 safetensors, the tokenizer, and a train_info.json that records this fine-tune on top
of the source model's stages), a folder ``linmem eval`` and ``linmem probe`` open; given to --model, such a folder
continues the fine-tune (a fresh optimizer; use another --seed for other batches), and the records then say how many
updates came before (``prior_updates``), which plot_transfer.py adds to the steps of a chain ``A.jsonl+B.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from linmem.data.shards import TokenShards
from linmem.data.synthetic import RecallSample, power_law
from linmem.eval.loading import load_model, open_heldout
from linmem.eval.memory_recall import memory_recall
from linmem.io.atomic import write_json_atomic
from linmem.io.folders import check_replaceable, mark_output_folder, staged_folder
from linmem.io.run_info import TRAIN_INFO
from linmem.memory.generated_formats import held_out_tokens
from linmem.train.checkpoint import copy_tokenizer, write_model
from linmem.train.data import resolve_generator

TEXT = {"template": "text", "keys": "generated", "values": "generated", "num_bindings": 4, "weight": 3}
ZOO_FORMAT = {"template": "code", "keys": "names", "values": "colors", "num_bindings": 4, "weight": 1}
IDS_ARMS = ("ids", "ids8", "ids-lm")
LM_ARMS = ("text-lm", "ids-lm")  # facts and text, the text's loss weighted --lm-weight
TEXT_ARMS = (*LM_ARMS, "lm")  # every arm that trains on text (--text-tokens, --text-window)
TEXT_WINDOW = 513  # test windows and --then-text's: 512 inputs and their next tokens, the zoo's training length
FORMATS = [("went", "roles", "directions"), ("keeps", "roles", "materials"), ("went", "names", "colors"),
           ("code", "roles", "directions")]


class WideMQAR:
    """MQAR whose keys, values and filler come from ``allowed`` ids (keys and values distinct within a sample)."""

    def __init__(self, allowed: np.ndarray, pairs: int):
        self.allowed, self.pairs = allowed, pairs

    def sample(self, rng: np.random.Generator, seq_len: int) -> RecallSample:
        n, slots = self.pairs, (seq_len - 2 * self.pairs) // 2
        drawn = rng.choice(self.allowed, size=2 * n, replace=False)
        keys, values = drawn[:n], drawn[n:]
        tokens = rng.choice(np.setdiff1d(self.allowed, keys), size=seq_len)
        tokens[0:2 * n:2], tokens[1:2 * n:2] = keys, values
        asked = 2 * n + 2 * rng.choice(slots, size=n, replace=False, p=power_law(slots, 0.01))
        order = rng.permutation(n)
        tokens[asked], tokens[asked + 1] = keys[order], values[order]
        mask = np.zeros(seq_len, dtype=bool)
        mask[asked + 1] = True
        return RecallSample(tokens.astype(np.int64), mask)


def generators(arm: str, shards: TokenShards, tokenizer) -> tuple[list, np.ndarray, int]:
    """The arm's recall generators, their sampling weights and the sample length."""
    specs, seq_len = [dict(TEXT), dict(ZOO_FORMAT)], 160
    if arm == "gen":
        specs[0]["template"] = "generated"
    if arm in ("text8", "ids8"):
        specs[0]["num_bindings"], seq_len = 8, 288
    if arm == "mix":
        specs += [{"name": "mqar", "num_kv_pairs": 4, "vocab_range": [2, 1026], "weight": 1},
                  {"name": "niah", "min_length": 64, "max_length": 159, "weight": 1}]
    made = [resolve_generator({"name": "kv-filler", **s} if "name" not in s else s, i, shards, "transfer", seq_len)
            for i, s in enumerate(specs)]
    gens, weights = [m[0] for m in made], [m[1] for m in made]
    if arm in ("wide", "oracle", *IDS_ARMS):
        held, _ = held_out_tokens(tokenizer)
        allowed = np.asarray([i for i in range(shards.vocab_size)
                              if i != shards.eos_id and (arm == "oracle" or i not in held)])
    if arm in ("wide", "oracle"):
        gens += [WideMQAR(allowed, 4), WideMQAR(allowed, 8)]
        weights += [1, 1]
    if arm in IDS_ARMS:
        gens[0] = dataclasses.replace(gens[0], words=allowed)
    weights = np.asarray(weights, dtype=float)
    return gens, weights / weights.sum(), seq_len


@torch.no_grad()
def test_loss(em, windows: torch.Tensor, within: int) -> tuple[float, float]:
    """The language-model loss (nats per token) on ``windows`` [n, T] of test text: over the first ``within``
    positions of each window (the fine-tuning samples' length) and over the rest."""
    losses = torch.stack([F.cross_entropy(em.model(input_ids=w[None, :-1]).logits.float()[0], w[1:],
                                          reduction="none") for w in windows])
    return float(losses[:, :within].mean()), float(losses[:, within:].mean())


def held_out_recall(em, split, items: int, windows: torch.Tensor, seq_len: int) -> dict:
    """The test loss on ``windows`` (all of it, within ``seq_len`` and beyond) and the clean recall in each of
    ``FORMATS``."""
    em.model.eval()
    within, beyond = test_loss(em, windows, seq_len)
    record = {"test_loss": round((within * seq_len + beyond * (windows.shape[1] - 1 - seq_len)) /
                                 (windows.shape[1] - 1), 4),
              f"test_loss@<{seq_len}": round(within, 4), f"test_loss@>={seq_len}": round(beyond, 4)}
    for template, keys, values in FORMATS:
        loads = [1, 4] if keys == "names" else [1, 4, 8]
        metrics = memory_recall(em, split, items=items, filler_tokens=128, template=template, keys=keys,
                                values=values, loads=loads, batch_size=16)["metrics"]
        record[f"{template}/{keys}/{values}"] = [round(metrics[f"accuracy@{n}"], 3) for n in loads]
    em.model.train()
    return record


def prior_updates(info: dict) -> int:
    """The updates of earlier fine-tunes in a chain: a model saved by --save records them (0 for any other model)."""
    return info.get("transfer_updates", 0)


def save_model(em, out: Path, args: argparse.Namespace, steps: int, tokens: int, data: TokenShards) -> None:
    """Write the fine-tuned ``em`` to ``out`` as a model folder (bfloat16 weights, tokenizer, ``train_info.json``
    with the source model's stages under ``init_from``), built aside and renamed into place whole
    (``linmem.io.folders.staged_folder``: a leftover of an interrupted save cannot fail the save after the
    fine-tune)."""
    source = em.info
    prior = prior_updates(source)
    with staged_folder(out) as tmp:
        mark_output_folder(tmp, "transfer")
        write_model(tmp, em.model.state_dict(), em.model.config, torch.bfloat16)
        copy_tokenizer(em.folder, tmp)
        write_json_atomic(tmp / TRAIN_INFO, {
            "name": source.get("name", em.folder.name) + ("" if prior else f"-{args.arm}"),  # a chain keeps its name
            "description": f"{args.model} fine-tuned by scripts/recall/transfer.py {args.arm}",
            "steps": steps, "transfer_updates": prior + steps, "tokens": tokens,
            "parameters": sum(p.numel() for p in em.model.parameters()),
            "dataset": os.path.relpath(Path(args.data).resolve(), out.resolve()),
            "tokenizer_hash": data.tokenizer_hash,
            "init_from": {"source": args.model, **{k: source[k] for k in ("name", "steps", "tokens") if k in source},
                          **({"init_from": source["init_from"]} if source.get("init_from") else {})},
            "transfer": {k: (None if v == float("inf") else v) for k, v in vars(args).items()  # JSON has no inf
                         if k not in ("device", "save")}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arm", choices=["text", "gen", "text8", "text-lm", "mix", "wide", "oracle", *IDS_ARMS, "lm"])
    parser.add_argument("--model", default="zoo:rdn")
    parser.add_argument("--data", default="data/zoo-4k")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--items", type=int, default=128, help="held-out items per format and load")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="stop (and measure) after this long")
    parser.add_argument("--lm-weight", type=float, default=1.0,
                        help="weight of the text's language-model loss beside the answers' (text-lm, ids-lm)")
    parser.add_argument("--text-tokens", type=int, default=400_000,
                        help="the text of text-lm, ids-lm and lm: the first this many tokens of the training split "
                             "(0: all of it)")
    parser.add_argument("--text-window", type=int, default=0,
                        help="tokens per window of that text (0: the fact samples' length)")
    parser.add_argument("--train-only", default=None,
                        help="comma-separated pieces of parameter names (.attn., layers.): only parameters whose "
                             "name holds one are trained, the rest frozen (default: all are trained)")
    parser.add_argument("--facts-first", type=int, default=0,
                        help="text-lm and ids-lm: the first this many updates on the facts alone, then facts and text "
                             "(does recall learned without the text's pull survive the language model's return?)")
    parser.add_argument("--then-text", type=int, default=0,
                        help="after the facts, this many updates on training text alone (language-model loss, "
                             "windows of 512 tokens): does the language model come back, and the recall stay?")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW's constant learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches (the held-out items are fixed)")
    parser.add_argument("--save", type=Path, default=None, help="write the fine-tuned model to this folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    if args.facts_first and args.arm not in LM_ARMS:
        parser.error(f"--facts-first applies to {' and '.join(LM_ARMS)} only")
    if args.save:
        check_replaceable(args.save)  # refuse a folder of the user's files before the fine-tune, not after
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    em = load_model(args.model, device=args.device)
    prior = prior_updates(em.info)
    split = open_heldout(em, None, "test")
    shards = TokenShards(args.data)
    gens, weights, seq_len = generators(args.arm, shards, em.tokenizer)
    text = np.concatenate([np.asarray(s[:args.text_tokens or None]) for s in shards.split("train").shards])
    text_window = args.text_window + 1 if args.text_window else seq_len  # inputs and their next tokens
    test = np.concatenate([np.asarray(s) for s in shards.split("test").shards])
    test_starts = np.linspace(0, len(test) - TEXT_WINDOW, 32).astype(int)
    test_windows = torch.tensor(np.stack([test[s:s + TEXT_WINDOW] for s in test_starts]).astype(np.int64),
                                device=args.device)
    trained = [p for name, p in em.model.named_parameters()
               if args.train_only is None or any(piece in name for piece in args.train_only.split(","))]
    if not trained:
        raise SystemExit(f"--train-only {args.train_only!r} matches no parameter name")
    for p in em.model.parameters():
        p.requires_grad_(any(p is q for q in trained))
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    cuda = args.device.startswith("cuda")
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=cuda)
    start = time.time()

    def report(step: int, phase: str) -> None:
        record = {"arm": args.arm, "model": args.model,
                  "lm_weight": args.lm_weight if args.arm in LM_ARMS else None,
                  "train_only": args.train_only, "lr": args.lr, "seed": args.seed, "batch": args.batch,
                  **({"facts_first": args.facts_first} if args.facts_first else {}),
                  **({"text_tokens": len(text), "text_window": text_window} if args.arm in TEXT_ARMS else {}),
                  **({"prior_updates": prior} if prior else {}), "step": step, "s": round(time.time() - start),
                  **held_out_recall(em, split, args.items, test_windows, seq_len), "phase": phase}
        print(json.dumps(record), flush=True)

    def text_loss(length: int) -> torch.Tensor:
        """The language-model loss on ``args.batch`` windows of ``length`` tokens of the training text."""
        starts = rng.integers(0, len(text) - length, args.batch)
        windows = torch.tensor(np.stack([text[s:s + length] for s in starts]).astype(np.int64), device=args.device)
        text_logits = em.model(input_ids=windows[:, :-1]).logits.float()
        return F.cross_entropy(text_logits.flatten(0, 1), windows[:, 1:].flatten())

    def facts_loss() -> torch.Tensor:
        """The answers' cross-entropy on ``args.batch`` fact samples of the arm."""
        samples = [gens[rng.choice(len(gens), p=weights)].sample(rng, seq_len) for _ in range(args.batch)]
        tokens = torch.tensor(np.stack([s.tokens for s in samples]), device=args.device)
        mask = torch.tensor(np.stack([s.loss_mask for s in samples]), device=args.device)[:, 1:]
        logits = em.model(input_ids=tokens[:, :-1]).logits.float()
        return F.cross_entropy(logits[mask], tokens[:, 1:][mask])

    def update(loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()

    def fine_tune() -> tuple[int, int]:
        """The updates (facts, then --then-text's text); returns the last update and the input tokens seen."""
        tokens = 0
        report(0, "start")
        for step in range(1, args.steps + 1):
            with_text = args.arm == "lm" or (args.arm in LM_ARMS and step > args.facts_first)
            with autocast:
                if args.arm == "lm":
                    loss = text_loss(text_window)
                elif with_text:
                    loss = facts_loss() + args.lm_weight * text_loss(text_window)
                else:
                    loss = facts_loss()
            update(loss)
            tokens += args.batch * ((seq_len - 1) * (args.arm != "lm") + (text_window - 1) * with_text)
            out_of_time = time.time() - start > args.seconds
            if step % args.every == 0 or out_of_time or step == args.steps:
                report(step, "facts")
            if out_of_time:
                return step, tokens
        for step in range(args.steps + 1, args.steps + args.then_text + 1):
            with autocast:
                loss = text_loss(TEXT_WINDOW)
            update(loss)
            tokens += args.batch * (TEXT_WINDOW - 1)
            if (step - args.steps) % args.every == 0 or step == args.steps + args.then_text:
                report(step, "text")
        return args.steps + args.then_text, tokens

    steps, tokens = fine_tune()
    if args.save:
        save_model(em, args.save, args, steps, tokens, shards)


if __name__ == "__main__":
    main()
