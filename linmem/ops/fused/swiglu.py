"""The tail of a SwiGLU feed-forward block, ``down(silu(gate) ⊙ up)``, keeping only its inputs: ``swiglu_linear``.

Autograd on the plain formula keeps four ``[N, I]`` tensors for the backward (gate, silu(gate), up and the product h
in the matmul dtype). ``swiglu_linear`` keeps gate and up only and recomputes h in the backward, where it is needed
for the weight gradient: one ``[N, I]`` tensor less per block at the cost of one element-wise pass. On CUDA the
product and its backward are one Triton kernel each (float32 arithmetic); elsewhere they are torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linmem.ops.fused.optional_triton import jit, tl, triton

AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)  # the dtypes autocast recasts (never float64)
TILE = (16, 256, 8)  # (rows, columns, warps) of one element-wise program: 16 elements a thread


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, *,
                  prefer_triton: bool | None = None) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight)`` with down's ``weight [D, I]``; ``gate, up [..., I]`` → ``[..., D]``.

    The product ``silu(gate) * up`` is recomputed in the backward instead of being kept: the autograd Function saves
    gate, up and the weight only. Under autocast the matmul runs in the autocast dtype (gate and up stay as given,
    the product is rounded once to that dtype), so the result has the dtype and, to rounding, the values of the
    plain formula; outside autocast the product has the wider of gate's and up's dtypes, which must be the weight's.

    ``prefer_triton``: None runs the element-wise kernels on CUDA outside ``torch.compile``, True forces them (the CPU
    interpreter in tests), False uses torch ops (any dtype, float64 included).
    """
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"gate and up must have the same shape [..., I]; got {list(gate.shape)} and {list(up.shape)}")
    if weight.dim() != 2 or weight.shape[1] != gate.shape[-1]:
        raise ValueError(f"weight must be [D, I] with I = {gate.shape[-1]}; got shape {list(weight.shape)}")
    product_dtype = torch.promote_types(gate.dtype, up.dtype)
    device_type = gate.device.type
    if torch.is_autocast_enabled(device_type):
        autocast_dtype = torch.get_autocast_dtype(device_type)
        if product_dtype in AUTOCAST_ELIGIBLE:
            product_dtype = autocast_dtype
        if weight.dtype in AUTOCAST_ELIGIBLE:
            weight = weight.to(autocast_dtype)
    if prefer_triton is None:
        prefer_triton = (triton is not None and gate.is_cuda and product_dtype in AUTOCAST_ELIGIBLE
                         and not torch.compiler.is_compiling())
    return _SwiGLULinear.apply(gate, up, weight, product_dtype, prefer_triton)


class _SwiGLULinear(torch.autograd.Function):
    """Saves gate, up (as given) and the weight; the backward recomputes h = silu(gate) ⊙ up for dweight."""

    @staticmethod
    def forward(ctx, gate, up, weight, product_dtype, use_triton):
        h = _product(_rows(gate), _rows(up), product_dtype, use_triton)
        with torch.autocast(gate.device.type, enabled=False):
            y = F.linear(h, weight)
        ctx.save_for_backward(gate, up, weight)
        ctx.product_dtype, ctx.use_triton = product_dtype, use_triton
        return y.reshape(*gate.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dy = dy.reshape(-1, weight.shape[0])
        with torch.autocast(gate.device.type, enabled=False):
            dh = dy @ weight
            d_gate, d_up, h = _product_backward(_rows(gate), _rows(up), dh, ctx.product_dtype, ctx.use_triton)
            dweight = dy.t() @ h
        return d_gate.reshape(gate.shape), d_up.reshape(up.shape), dweight, None, None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., I]`` as ``[N, I]`` rows with a unit-stride last axis (a view where possible)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def _product(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype, use_triton: bool) -> torch.Tensor:
    """``h = silu(gate) ⊙ up`` ``[N, I]`` in ``dtype``, computed in float32 at least."""
    if not use_triton or gate.numel() == 0:
        wide = torch.promote_types(dtype, torch.float32)
        g = gate.to(wide)
        return (F.silu(g) * up.to(wide)).to(dtype)
    h = torch.empty(gate.shape, device=gate.device, dtype=dtype)
    rows, cols = gate.shape
    block_rows, block_cols, warps = TILE
    swiglu_forward_kernel[(triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))](
        gate, up, h, rows, cols, gate.stride(0), up.stride(0), BR=block_rows, BC=block_cols, num_warps=warps)
    return h


def _product_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, dtype: torch.dtype,
                      use_triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_gate, d_up, h)`` from ``dh [N, I]``: d_gate = dh ⊙ up ⊙ silu'(gate), d_up = dh ⊙ silu(gate) in the
    dtypes of gate and up, and the recomputed h in ``dtype``."""
    if not use_triton or gate.numel() == 0:
        wide = torch.promote_types(dtype, torch.float32)
        g, u, d = gate.to(wide), up.to(wide), dh.to(wide)
        sig = torch.sigmoid(g)
        silu = g * sig
        d_gate = d * u * sig * (1 + g * (1 - sig))
        return d_gate.to(gate.dtype), (d * silu).to(up.dtype), (silu * u).to(dtype)
    rows, cols = gate.shape
    dh = dh.contiguous()
    d_gate = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    d_up = torch.empty(up.shape, device=up.device, dtype=up.dtype)
    h = torch.empty(gate.shape, device=gate.device, dtype=dtype)
    block_rows, block_cols, warps = TILE
    swiglu_backward_kernel[(triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))](
        gate, up, dh, d_gate, d_up, h, rows, cols, gate.stride(0), up.stride(0),
        BR=block_rows, BC=block_cols, num_warps=warps)
    return d_gate, d_up, h


@jit
def swiglu_forward_kernel(gate, up, h, rows, cols, stride_gate, stride_up, BR: tl.constexpr,
                          BC: tl.constexpr):
    """One tile ``[BR, BC]``: h = silu(gate) · up, stored contiguous in h's dtype."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (r < rows)[:, None] & (c < cols)[None, :]
    g = tl.load(gate + r[:, None] * stride_gate + c[None, :], mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up + r[:, None] * stride_up + c[None, :], mask=inside, other=0.0).to(tl.float32)
    tl.store(h + r[:, None] * cols + c[None, :], (g * tl.sigmoid(g) * u).to(h.dtype.element_ty), mask=inside)


@jit
def swiglu_backward_kernel(gate, up, dh, d_gate, d_up, h, rows, cols, stride_gate, stride_up,
                           BR: tl.constexpr, BC: tl.constexpr):
    """One tile ``[BR, BC]``: d_gate = dh·up·σ(g)(1 + g(1 − σ(g))), d_up = dh·silu(g), h = silu(g)·up, each
    stored contiguous in its own dtype."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (r < rows)[:, None] & (c < cols)[None, :]
    g = tl.load(gate + r[:, None] * stride_gate + c[None, :], mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up + r[:, None] * stride_up + c[None, :], mask=inside, other=0.0).to(tl.float32)
    out = r[:, None] * cols + c[None, :]
    d = tl.load(dh + out, mask=inside, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(d_gate + out, (d * u * sig * (1.0 + g * (1.0 - sig))).to(d_gate.dtype.element_ty), mask=inside)
    tl.store(d_up + out, (d * silu).to(d_up.dtype.element_ty), mask=inside)
    tl.store(h + out, (silu * u).to(h.dtype.element_ty), mask=inside)
