"""Where every sequence and chunk lives on the flattened token axis, and the launch choices all kernels share.

Every kernel sees its inputs as ``[N_tok, H, D]`` with ``N_tok = B·T`` (a fixed-length batch is a packed batch whose
``cu_seqlens`` are ``0, T, 2T, …``). Chunks never cross a sequence boundary: sequence ``n`` owns the global chunks
``chunk_offsets[n] … chunk_offsets[n] + ceil(len_n / C) − 1``; ``chunk_indices[c] = (n, j)`` names chunk ``c`` as
chunk ``j`` of sequence ``n``. Per-chunk tensors (states, the ``[C, C]`` score rows) are indexed by ``c``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk; the in-chunk inverse (inverse.py) is written for 4 blocks of 16


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the CPU interpreter: no autotuning, no bf16 dots)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(dtype: torch.dtype):
    """The operand type of ``tl.dot``: the input type on a GPU (bf16/fp16 tensor cores, tf32 for float32), float32
    under the interpreter, whose bf16 dots are wrong (seen with triton 3.9)."""
    if interpreting() or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage type of everything that only ever feeds dots in the input type (the ``[C, C]`` score rows and
    inverses, the per-chunk states, the effective writes u and w, as in flash-linear-attention): the input type,
    float32 for float32 inputs. Quantities that enter elementwise float32 arithmetic (errors, gradients of rows) stay
    float32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def key_block(key_dim: int) -> int:
    """The padded width of a tile that holds all ``key_dim`` columns (powers of two, at least 16 for ``tl.dot``)."""
    return max(16, triton.next_power_of_2(key_dim))


MAX_WIDTH = 256  # K and V up to this; wider heads run on the chunk backend


def key_tiling(key_dim: int) -> tuple[int, int]:
    """(BK, NK): the key axis of a state in NK ≤ 4 blocks of BK ≤ 64 columns (the sequential passes hold one state
    as NK register tiles ``[BK, BV]``; the parallel kernels loop over the same blocks or run one program each)."""
    bk = min(64, key_block(key_dim))
    return bk, triton.cdiv(key_dim, bk)


@dataclass(frozen=True)
class SequenceLayout:
    """Sequences and chunks of one call. ``cu_seqlens`` int32 ``[N + 1]``, ``chunk_indices`` int32 ``[NT, 2]``,
    ``chunk_offsets`` int32 ``[N]``."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    num_seqs: int
    num_chunks: int
    num_tokens: int

    @classmethod
    def fixed(cls, batch: int, length: int, device: torch.device, chunk: int = CHUNK) -> SequenceLayout:
        """``batch`` sequences of ``length`` tokens each (no host synchronisation).

        Built once per shape and device and shared after that (the kernels only read a layout), so that the layers
        of a model do not each launch its small constructions again; except while a CUDA graph is being captured,
        where a new layout's tensors would be filled only when the graph is replayed.
        """
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing:
            return cls._build_fixed(batch, length, device, chunk)
        return _shared_fixed(batch, length, device, chunk)

    @classmethod
    def _build_fixed(cls, batch: int, length: int, device: torch.device, chunk: int) -> SequenceLayout:
        per_seq = triton.cdiv(length, chunk)
        seqs = torch.arange(batch, device=device, dtype=torch.int32)
        indices = torch.stack([seqs.repeat_interleave(per_seq),
                               torch.arange(per_seq, device=device, dtype=torch.int32).repeat(batch)], dim=1)
        bounds = torch.arange(batch + 1, device=device, dtype=torch.int32) * length
        return cls(bounds, indices.contiguous(), seqs * per_seq, batch, batch * per_seq, batch * length)

    @classmethod
    def packed(cls, bounds: list[int], device: torch.device, chunk: int = CHUNK) -> SequenceLayout:
        """Sequences packed in one row with the boundaries ``bounds`` (a host list, ``cu_seqlens``'s values), from
        which the chunks are counted; the tensors are copied to ``device`` without a host synchronisation."""
        counts = [triton.cdiv(end - start, chunk) for start, end in zip(bounds, bounds[1:])]
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        indices = [index for n, count in enumerate(counts) for j in range(count) for index in (n, j)]
        return cls(to_device(bounds, device), to_device(indices, device).reshape(-1, 2),
                   to_device(offsets[:-1], device), len(counts), offsets[-1], bounds[-1])


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int32 tensor on ``device``. A plain copy to a GPU from pageable memory would wait for the
    GPU to finish its queue; from pinned memory it is queued like a kernel (the caching host allocator keeps the
    pinned buffer until the copy has run)."""
    host = torch.tensor(values, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=32)
def _shared_fixed(batch: int, length: int, device: torch.device, chunk: int) -> SequenceLayout:
    return SequenceLayout._build_fixed(batch, length, device, chunk)


# Tests set this to fill every kernel output buffer with NaN, so that an element no kernel writes shows up.
POISON_BUFFERS = False


def new_buffer(shape, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output buffer for a kernel (uninitialised; NaN-filled under ``POISON_BUFFERS``)."""
    out = torch.empty(shape, device=device, dtype=dtype)
    return out.fill_(float("nan")) if POISON_BUFFERS else out
