"""The primitives every evaluation shares: token losses of windows, scored continuations, greedy generation.

Rows of a batch are left-padded with an ``attention_mask`` (the model keeps padding out of every memory), so a
batched score equals the score of the row alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from linmem.eval.loading import EvalModel
from linmem.models.decoding import StaticDecoder, check_decodable, hooks_attached
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
                    stop: Callable[[list[int]], bool] | None = None, *, static: bool | None = None) -> list[int]:
    """Greedy tokens after ``context`` until ``max_new_tokens``, the EOS token, or ``stop(generated)`` is true
    (the token that made it true is kept).

    ``static=None``: on CUDA, a model that captured decoding covers (``check_decodable``: linear-memory layers, plain
    MLPs, no hooks) decodes with a ``StaticDecoder`` kept per model, each token one replay of a CUDA graph; it makes
    all ``max_new_tokens`` (or up to EOS) and cuts at the first prefix ``stop`` accepts, which gives the same tokens
    as the step-by-step loop. Elsewhere the loop runs one cached forward per token. ``static=True`` / ``False``
    forces the path (True on the CPU runs the static step uncaptured: tests)."""
    if static is None:
        static = em.device.type == "cuda" and _captured_decoding_covers(em.model)
    if static:
        generated = _static_generate(em, context, max_new_tokens)
        if stop is not None:  # every prefix, as the loop asks: ``stop`` need not stay true once it is
            return next((generated[:n] for n in range(1, len(generated) + 1) if stop(generated[:n])), generated)
        return generated
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


def _captured_decoding_covers(model) -> bool:
    try:
        check_decodable(model)
    except ValueError:
        return False
    return not hooks_attached(model)


def _static_generate(em: EvalModel, context: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of a batch-1 ``StaticDecoder`` (built once per ``EvalModel`` and EOS id, kept in its
    ``decoders``), cut before the EOS token."""
    if max_new_tokens < 1:
        return []
    decoders = em.decoders
    if em.eos_id not in decoders:
        decoders[em.eos_id] = StaticDecoder(em.model, 1, eos_token_id=[em.eos_id], pad_token_id=em.eos_id,
                                            capture=em.device.type == "cuda")
    ids = torch.as_tensor([list(context)], dtype=torch.long, device=em.device)
    tokens = decoders[em.eos_id].generate(ids, max_new_tokens)[0, ids.shape[1]:].tolist()
    return tokens[:tokens.index(em.eos_id)] if em.eos_id in tokens else tokens
