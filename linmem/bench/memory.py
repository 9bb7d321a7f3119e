"""Benchmark of the memory lab's head scan: suffix-only re-runs from a shared prefix cache (``mm.run_many``) vs
re-running the whole prompt for each component, timed side by side in one run on the same prompts.

    python -m linmem.bench.memory                          # random GDN, 12 layers x 8 heads, 512-token filler
    python -m linmem.bench.memory --mixer rdn --layers 4 --filler 512 --device cuda --json out.json

Both paths swap each component's pre-query state for the donor's and read the last position's logits; the script
checks they agree (exit status 1 if not), then prints seconds per scan and the ratio. The ratio grows with the
number of components C: about ``C·T / (2·T + C·S)`` for prompts of T tokens and suffixes of S (the donor's prefix
runs once too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
from tqdm import tqdm

import linmem.memory as mm
from linmem.memory.evaluate import make_batch
from linmem.memory.intervene import apply_cache_edit
from linmem.memory.probe import pick_spec
from linmem.memory.recording import backbone, unembed
from linmem.memory.tasks import TaskSpec, build_items, passages
from linmem.models import LinMemCache, LinMemConfig, LinMemForCausalLM


def setup(args):
    """A tokenizer trained on the filler text, a random model of its vocabulary, and a batch of items."""
    from linmem.data.builtin import open_source
    from linmem.data.tokenizer import train_tokenizer, wrap_tokenizer

    docs = list(itertools.islice(open_source(args.source).documents(), 200))
    tokenizer = wrap_tokenizer(train_tokenizer((d.text for d in docs), vocab_size=args.vocab))
    spec = TaskSpec(num_bindings=4, repeats=3, filler_tokens=args.filler, keys="letters", values="numbers")
    builder = pick_spec(tokenizer, spec)
    found = passages(docs, tokenizer, args.filler + 16)[: args.prompts]
    batch = make_batch(build_items(builder, found, seed=0), device=args.device)
    torch.manual_seed(0)
    config = LinMemConfig(vocab_size=len(tokenizer), hidden_size=args.hidden,
                          num_hidden_layers=args.layers, num_heads=args.heads, head_dim=args.hidden // args.heads,
                          expand_v=1.0, mixer=args.mixer)
    return LinMemForCausalLM(config).to(args.device).eval(), batch


@torch.no_grad()
def full_reruns(model, batch, components) -> torch.Tensor:
    """Per component: the whole recipient prompt again (prefix into a fresh cache, swap, suffix); the donor's
    prefix cache is computed once. Returns the last logits ``[C, B, vocab]``."""
    at, out = batch.boundary, []
    donor = LinMemCache.from_config(model.config)
    backbone(model)(input_ids=batch.donor[:, :at], cache=donor, use_cache=True)
    for c in tqdm(components, desc="whole-prompt re-runs", leave=False):
        cache = LinMemCache.from_config(model.config)
        backbone(model)(input_ids=batch.recipient[:, :at], cache=cache, use_cache=True)
        apply_cache_edit(model, cache, donor, mm.StateSwap([c], at), slice(None))
        hidden = backbone(model)(input_ids=batch.recipient[:, at:], cache=cache, use_cache=True).last_hidden_state
        out.append(unembed(model, hidden[:, -1]))
    return torch.stack(out)


def suffix_only(model, batch, components, chunk: int) -> torch.Tensor:
    """``mm.run_many``: the recipient's and the donor's prefix once, then the components' suffixes batched
    ``chunk`` at a time."""
    edits = [[mm.StateSwap([c], batch.boundary)] for c in components]
    return mm.run_many(model, batch.recipient, batch.donor, edits, logits_at=[batch.length - 1], chunk=chunk)[:, :, 0]


def timed(fn, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return value, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixer", default="gdn")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8, help="12 x 8 = 96 heads, as in the paper's 340M models")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--filler", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=24, help="components per batched suffix run")
    parser.add_argument("--source", default="shakespeare")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model, batch = setup(args)
    components = mm.heads(model)
    suffix_only(model, batch.subset([0]), components[:2], args.chunk)  # warm-up (kernel compilation)
    full_reruns(model, batch.subset([0]), components[:1])
    fast, t_fast = timed(lambda: suffix_only(model, batch, components, args.chunk), args.device)
    slow, t_slow = timed(lambda: full_reruns(model, batch, components), args.device)
    error = (fast - slow).abs().max().item()
    tolerance = 1e-4 * max(slow.abs().max().item(), 1.0)  # float32 rounding of two orders of the same sums
    result = {"mixer": args.mixer, "components": len(components), "prompts": batch.recipient.shape[0],
              "prompt_tokens": batch.length, "suffix_tokens": batch.length - batch.boundary,
              "suffix_only_s": round(t_fast, 3), "whole_prompt_s": round(t_slow, 3),
              "speedup": round(t_slow / t_fast, 1), "max_abs_logit_diff": error, "agree": error <= tolerance,
              "device": args.device}
    print(f"{len(components)} components x {result['prompts']} prompts of {batch.length} tokens "
          f"(suffix {result['suffix_tokens']}), {args.mixer} on {args.device}")
    print(f"suffix-only scan {t_fast:.2f} s | whole-prompt re-runs {t_slow:.2f} s | "
          f"speedup {t_slow / t_fast:.1f}x | max |Δlogit| {error:.2e}")
    if not result["agree"]:
        print(f"MISMATCH: the two scans differ by {error:.2e} > {tolerance:.2e}: the timing compares different "
              f"computations")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["agree"] else 1)
