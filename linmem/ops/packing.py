"""Sequences packed into one row, as ``cu_seqlens [N + 1]`` (flash-attention's and FLA's convention).

A packed row ``[1, T, ...]`` holds N sequences back to back; ``cu_seqlens`` gives their boundaries (``0 = c_0 <= c_1
<= ... <= c_N = T``). Every mixer given ``cu_seqlens`` treats each sequence as if it ran alone: the memories start
from zeros at each boundary, the short convolutions see zeros before it, softmax attention is block-diagonal, and
RoPE positions restart at 0. ``unpad`` / ``pad`` turn a padded batch ``[B, T]`` with a 0/1 mask into such a row and
back; ``document_starts`` cuts token windows at a separator token.
"""

from __future__ import annotations

import torch

from linmem.ops.backend import Packed


def check_packed_row(cu_seqlens: torch.Tensor, batch: int) -> None:
    """Shape checks that need no host sync (the op checks the boundaries' values): a 1-D integer tensor and
    one packed row (``B == 1``)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of sequence boundaries")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed in one row (B == 1); got B = {batch}")


def sequence_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``[T]`` int64: the index of the sequence each position of the packed row belongs to."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)


def sequence_positions(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``[T]`` int64: each position's offset from the start of its own sequence (RoPE positions, conv reach)."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return positions - cu_seqlens.long()[sequence_ids(cu_seqlens, length)]


def unpad(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [total], cu_seqlens [B + 1] int32)`` of a 0/1 mask ``[B, T]``: the flat positions of the real
    tokens, row by row, and the boundaries of the rows' real tokens once packed (padding may sit anywhere).

    One host synchronisation: the boundaries are read back once, they size ``indices`` (``nonzero_static``, which
    reads nothing), and the op is handed them with the tensor (``Packed.known``), so that no layer reads them again.
    """
    real = attention_mask.bool()
    lengths = real.sum(-1, dtype=torch.int32)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
    bounds = cu_seqlens.tolist()
    indices = torch.nonzero_static(real.flatten(), size=bounds[-1]).flatten()
    Packed.known(cu_seqlens, bounds)
    return indices, cu_seqlens


def pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """``packed [1, total, ...]`` back to ``[B, T, ...]`` at ``indices`` (from ``unpad``), zeros at padding."""
    out = packed.new_zeros(batch * length, *packed.shape[2:])
    out[indices] = packed[0]
    return out.view(batch, length, *packed.shape[2:])


def document_starts(input_ids: torch.Tensor, separator_id: int) -> torch.Tensor:
    """``cu_seqlens [N + 1]`` int32 of the rows of ``input_ids [B, T]`` packed into one row ``[1, B·T]``, cut after
    every ``separator_id`` (a document ends with its separator, the next one starts after it) and at every row
    start, so that no token reads across a document or a row.

    ``nonzero`` waits for the device (its size depends on the values); the boundaries are then read back while the
    queue is empty and handed to the op with the tensor (``Packed.known``), so that no layer reads them again."""
    batch, length = input_ids.shape
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == separator_id
    bounds = starts.flatten().nonzero().flatten().to(torch.int32)
    cu_seqlens = torch.cat([bounds, bounds.new_tensor([batch * length])])
    Packed.known(cu_seqlens, cu_seqlens.tolist())
    return cu_seqlens
