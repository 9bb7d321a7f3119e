"""Next-token cross entropy straight from 16-bit logits: no float32 copy of the ``[N, vocab]`` logits, no saved
log-softmax.

``token_cross_entropy(logits, targets)`` gives each row's ``logsumexp(logits) − logits[target]`` in float32 (0 where
the target is ``ignore_index``). On a GPU one Triton program per row walks the vocabulary in blocks with a running
maximum and sum (the log-sum-exp in one pass) and keeps only ``lse [N]`` for the backward, which writes
``g · (softmax − onehot)`` in the logits' dtype. A target outside ``[0, V)`` (other than ``ignore_index``) gives a
NaN loss instead of an error, which would need a host synchronisation. The eager path (CPU, float64, the compiler) is
``F.cross_entropy`` in at least float32; both give the same values.

Memory of a training step at N tokens and vocabulary V: the bf16 logits ``[N, V]`` (kept for the backward) and, in
the backward, their gradient; the eager path holds float32 logits and a float32 log-softmax besides (6x the bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linmem.io.labels import IGNORE_INDEX
from linmem.ops.fused.optional_triton import jit, tl, triton

VOCAB_BLOCK = 4096  # vocabulary columns per step of a row's walk (a power of two)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX, *,
                        prefer_triton: bool | None = None) -> torch.Tensor:
    """Cross entropy of each row: ``logits [N, V]`` (any float dtype, last axis unit-stride), ``targets [N]``
    integer (``ignore_index`` rows give 0) → ``[N]`` in the wider of float32 and the logits' dtype.

    ``prefer_triton``: None picks the Triton kernels for 16-bit or float32 logits on a GPU outside
    ``torch.compile`` (the compiler fuses the eager version itself), True forces them (the CPU interpreter in
    tests), False the eager ``F.cross_entropy``."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] and targets [N]; got {list(logits.shape)} and {list(targets.shape)}")
    if targets.is_floating_point():
        raise ValueError(f"targets must be integer class indices; got dtype {targets.dtype}")
    if prefer_triton is None:
        prefer_triton = (triton is not None and logits.is_cuda
                         and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
                         and not torch.compiler.is_compiling())
    if not prefer_triton or logits.shape[0] == 0:
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(wide, targets, ignore_index=ignore_index, reduction="none")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _TokenCrossEntropy.apply(logits, targets, ignore_index)


class _TokenCrossEntropy(torch.autograd.Function):
    """The Triton path of ``token_cross_entropy``; saves the logits (as given) and ``lse [N]``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows, vocab = logits.shape
        losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
        lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
        block = min(VOCAB_BLOCK, triton.next_power_of_2(vocab))
        cross_entropy_forward_kernel[(rows,)](logits, targets, losses, lse, logits.stride(0), vocab, ignore_index,
                                              BLOCK=block, num_warps=8)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        block = min(VOCAB_BLOCK, triton.next_power_of_2(vocab))
        cross_entropy_backward_kernel[(rows,)](logits, targets, lse, grad_losses.float().contiguous(), grad,
                                               logits.stride(0), vocab, ctx.ignore_index, BLOCK=block, num_warps=8)
        return grad, None, None


@jit
def cross_entropy_forward_kernel(logits, targets, losses, lse_out, row_stride, vocab, ignore_index,
                                 BLOCK: tl.constexpr):
    """One row: the running maximum m and sum s of exp(x − m) over the vocabulary, block by block."""
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * row_stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane, merged at the end
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        # lanes that have seen only -inf keep s = 0 (exp(-inf - -inf) would be NaN)
        s = tl.where(new_m == float("-inf"), 0.0, s * tl.exp(m - new_m) + tl.exp(x - new_m))
        m = new_m
    row_max = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    lse = row_max + tl.log(total)
    target = tl.load(targets + row)
    ignored = target == ignore_index
    inside = (target >= 0) & (target < vocab)  # a target outside the vocabulary gives NaN (no host check)
    picked = tl.load(base + tl.where(inside, target, 0)).to(tl.float32)
    tl.store(lse_out + row, lse)
    tl.store(losses + row, tl.where(ignored, 0.0, tl.where(inside, lse - picked, float("nan"))))


@jit
def cross_entropy_backward_kernel(logits, targets, lse_in, grad_losses, grad, row_stride, vocab, ignore_index,
                                  BLOCK: tl.constexpr):
    """One row: ``g · (exp(x − lse) − [col == target])``, 0 for an ignored row."""
    row = tl.program_id(0)
    offset = row.to(tl.int64) * row_stride
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets + row)
    scale = tl.where(target == ignore_index, 0.0, tl.load(grad_losses + row))
    lse = tl.load(lse_in + row)
    for start in range(0, vocab, BLOCK):
        inside = start + cols < vocab
        x = tl.load(logits + offset + start + cols, mask=inside, other=0.0).to(tl.float32)
        d = scale * (tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0))
        tl.store(grad + row.to(tl.int64) * vocab + start + cols, d.to(grad.dtype.element_ty), mask=inside)
