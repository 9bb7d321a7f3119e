"""The primitives every evaluation shares: token losses of windows, scored continuations, greedy generation.

Rows of a batch are left-padded with an ``attention_mask`` (the model keeps padding out of every memory), so a
batched score equals the score of the row alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from linmem.eval.loading import EvalModel
from linmem.models.modeling import CACHE_FIELD
from linmem.ops.fused.cross_entropy import token_cross_entropy


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, L], attention_mask [B, L])`` with each row right-aligned."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, length - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, length - len(row):] = 1
    return ids, mask


@torch.no_grad()
def logits_of(em: EvalModel, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits ``[B, L, vocab]`` on the CPU."""
    mask = None if mask is None else mask.to(em.device)
    out = em.model(input_ids=ids.to(em.device), attention_mask=mask, use_cache=False)
    return out.logits.float().cpu()


@torch.no_grad()
def window_losses(em: EvalModel, windows: torch.Tensor) -> torch.Tensor:
    """Next-token losses ``[B, T-1]`` (nats) of full windows ``[B, T]``."""
    logits = logits_of(em, windows)
    return token_cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).view(windows.shape[0], -1)


def score_continuations(em: EvalModel, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 16,
                        max_length: int | None = None) -> list[tuple[float, bool]]:
    """``(log p(continuation | context), greedy)`` per ``(context ids, continuation ids)`` pair.

    ``greedy``: every continuation token is the argmax. Contexts are cut on the left so that context +
    continuation fit ``max_length`` tokens; a continuation must be non-empty and a context at least one token.
    """
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        rows, widths = [], []
        for i in chunk:
            context, continuation = list(pairs[i][0]), list(pairs[i][1])
            if not continuation or not context:
                raise ValueError("score_continuations needs a non-empty context and continuation")
            full = context + continuation
            if max_length is not None:
                full = full[-(max_length + 1):]
            rows.append(full[:-1])
            widths.append(len(continuation))
        ids, mask = left_pad(rows, em.eos_id)
        logprobs = torch.log_softmax(logits_of(em, ids, mask), dim=-1)
        for row, (i, width) in enumerate(zip(chunk, widths)):
            targets = torch.as_tensor(list(pairs[i][1]), dtype=torch.long)
            scores = logprobs[row, -width:]
            picked = scores.gather(-1, targets[:, None])[:, 0]
            results[i] = (float(picked.sum()), bool((scores.argmax(-1) == targets).all()))
    return results


@torch.no_grad()
def greedy_generate(em: EvalModel, context: Sequence[int], max_new_tokens: int,
                    stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Greedy tokens after ``context`` (recurrent cache, one token per step) until ``max_new_tokens``, the EOS
    token, or ``stop(generated)`` is true."""
    ids = torch.as_tensor([list(context)], dtype=torch.long, device=em.device)
    out = em.model(input_ids=ids, use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        if token == em.eos_id:
            break
        generated.append(token)
        if stop is not None and stop(generated):
            break
        out = em.model(input_ids=torch.tensor([[token]], device=em.device), cache=getattr(out, CACHE_FIELD),
                       use_cache=True)
    return generated
