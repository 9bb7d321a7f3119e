"""Depthwise causal short convolution with its SiLU in one op: ``short_conv``.

The q/k/v convolutions of a mixer (``linmem.layers.conv.ShortConvolution`` without a cache) as one call over
``x [B, T, D]``, where D may hold the q, k and v channels side by side. On CUDA one Triton kernel reads x in place
(no zero-padded copy), sums the W taps in float32 and applies SiLU; its backward recomputes the pre-activation from
x instead of keeping it. Elsewhere (CPU, float64, ``torch.compile``) the same math runs as torch ops.

Packed sequences (``cu_seqlens``) are handled through each token's position in its own sequence: tap j, which reads
``W − 1 − j`` tokens back, counts only where that position is at least ``W − 1 − j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linmem.ops.fused.optional_triton import jit, tl, triton
from linmem.ops.packing import sequence_positions

ACTIVATIONS = (None, "silu", "swish")
MAX_KERNEL_WIDTH = 8  # the Triton kernels unroll the taps; wider kernels run on the torch path

# Tiles [tokens, channels] of one program, 16 to 32 elements a thread. The forward and the backward's dx pass load W
# shifted tiles each; the backward's first pass (d_pre and the dweight partial sums) loads 2W + 1 and reduces over
# its tokens, hence its smaller tile.
FORWARD_TILE = (64, 128, 8)  # (BT, BD, warps); also the backward's dx pass
BACKWARD_TILE = (64, 64, 8)  # the backward's d_pre pass


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    prefer_triton: bool | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution over time, then SiLU (``activation`` None: none).

    ``x [B, T, D]`` (any strides along B and T; a last axis that is not unit-stride is copied), ``weight [D, W]``
    (a depthwise ``nn.Conv1d`` weight ``[D, 1, W]`` squeezed), ``bias [D]`` or None::

        y[b, t, d] = act(bias[d] + Σ_{j<W} weight[d, j] · x[b, t − (W − 1) + j, d])

    where taps before the sequence start read 0. ``cu_seqlens [N + 1]`` (integer, B == 1): x is one row of N packed
    sequences and no tap crosses a sequence start (the boundaries are not read back to the host).

    ``prefer_triton``: None runs the Triton kernels for 16-bit or float32 x on CUDA outside ``torch.compile`` (the
    compiler fuses the torch version itself), True forces them (the CPU interpreter in tests), False the torch path.
    Returns ``y [B, T, D]`` in x's dtype, computed in float32 (float64 for float64 inputs on the torch path).
    """
    _check_inputs(x, weight, bias, activation, cu_seqlens)
    positions = None if cu_seqlens is None else sequence_positions(cu_seqlens, x.shape[1]).to(torch.int32)
    silu = activation is not None
    if prefer_triton is None:
        prefer_triton = (triton is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
                         and weight.shape[1] <= MAX_KERNEL_WIDTH and not torch.compiler.is_compiling())
    if prefer_triton and weight.shape[1] > MAX_KERNEL_WIDTH:
        raise ValueError(f"the Triton short convolution takes kernel widths up to {MAX_KERNEL_WIDTH}; got "
                         f"{weight.shape[1]} (use prefer_triton=False)")
    if not prefer_triton or x.numel() == 0:
        return _short_conv_torch(x, weight, bias, positions, silu)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _ShortConv.apply(x, weight.contiguous(), None if bias is None else bias.contiguous(), positions, silu)


def _check_inputs(x, weight, bias, activation, cu_seqlens) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D]; got shape {list(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D, W] with D = {x.shape[-1]}; got shape {list(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must be [D] = [{x.shape[-1]}]; got shape {list(bias.shape)}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of sequence boundaries")
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs the sequences packed in one row (B == 1); got B = {x.shape[0]}")


def _short_conv_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      positions: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """The torch path: a zero-padded ``F.conv1d`` or, for packed or empty rows and under the compiler (which fuses
    element-wise work), a sum over taps; in float32 at least, outside autocast."""
    batch, length, dim = x.shape
    width = weight.shape[1]
    dtype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        wide, w = x.to(dtype), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        if positions is None and length > 0 and not torch.compiler.is_compiling():
            y = F.conv1d(wide.transpose(1, 2), w[:, None], b, padding=width - 1, groups=dim)[..., :length]
            y = y.transpose(1, 2)
        else:
            full = F.pad(wide, (0, 0, width - 1, 0))
            y = 0 if b is None else b
            for j in range(width):
                tap = full[:, j:j + length] * w[:, j]
                if positions is not None:
                    tap = tap * (positions >= width - 1 - j)[:, None]
                y = y + tap
        if silu:
            y = F.silu(y)
    return y.to(x.dtype)


class _ShortConv(torch.autograd.Function):
    """The Triton path of ``short_conv``: saves x (as given), weight, bias and the token positions."""

    @staticmethod
    def forward(ctx, x, weight, bias, positions, silu):
        batch, length, dim = x.shape
        y = torch.empty(batch, length, dim, device=x.device, dtype=x.dtype)
        block_t, block_d, warps = FORWARD_TILE
        grid = (triton.cdiv(length, block_t), triton.cdiv(dim, block_d), batch)
        short_conv_forward_kernel[grid](
            x, weight, bias, positions, y, length, dim, x.stride(0), x.stride(1),
            WIDTH=weight.shape[1], HAS_BIAS=bias is not None, PACKED=positions is not None, SILU=silu,
            BT=block_t, BD=block_d, num_warps=warps)
        ctx.save_for_backward(x, weight, bias, positions)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        """Two passes over the tokens: the pre-activation's gradient ``d_pre [B, T, D]`` (float32) with each
        program's partial sums of dweight and dbias, then dx from d_pre. Each pass loads W shifted tiles per tile,
        where one pass computing dx straight from dy would recompute the pre-activation at W shifted rows (W² tile
        loads)."""
        x, weight, bias, positions = ctx.saved_tensors
        batch, length, dim = x.shape
        width = weight.shape[1]
        dy = dy.contiguous()
        block_t, block_d, warps = BACKWARD_TILE
        time_blocks = triton.cdiv(length, block_t)
        programs = batch * time_blocks
        d_pre = torch.empty(batch, length, dim, device=x.device, dtype=torch.float32)
        dweight_parts = torch.empty(programs, dim, width, device=x.device, dtype=torch.float32)
        dbias_parts = None if bias is None else torch.empty(programs, dim, device=x.device, dtype=torch.float32)
        short_conv_backward_pre_kernel[(time_blocks, triton.cdiv(dim, block_d), batch)](
            x, weight, bias, positions, dy, d_pre, dweight_parts, dbias_parts, length, dim, x.stride(0),
            x.stride(1), WIDTH=width, HAS_BIAS=bias is not None, PACKED=positions is not None, SILU=ctx.silu,
            BT=block_t, BD=block_d, TAPS=triton.next_power_of_2(width), num_warps=warps)
        dx = torch.empty(batch, length, dim, device=x.device, dtype=x.dtype)
        block_t, block_d, warps = FORWARD_TILE
        short_conv_backward_input_kernel[(triton.cdiv(length, block_t), triton.cdiv(dim, block_d), batch)](
            d_pre, weight, positions, dx, length, dim, WIDTH=width, PACKED=positions is not None,
            BT=block_t, BD=block_d, num_warps=warps)
        dweight = dweight_parts.sum(0).to(weight.dtype)
        dbias = None if bias is None else dbias_parts.sum(0).to(bias.dtype)
        return dx, dweight, dbias, None, None


@jit
def _pre_activation(x_row, weight, bias, positions, rows, rows_in, cols, cols_in, stride_t,
                    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED: tl.constexpr):
    """``[BT, BD]`` float32: bias + Σ_j weight[:, j] · x[rows − (W − 1 − j)] for one sequence row of x (``x_row``
    points at its first token); taps reaching before the token's sequence start read 0."""
    if PACKED:
        reach = tl.load(positions + rows, mask=rows_in, other=0)
    else:
        reach = rows
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols_in, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(WIDTH):
        back = WIDTH - 1 - j
        w = tl.load(weight + cols * WIDTH + j, mask=cols_in, other=0.0).to(tl.float32)
        read = rows_in & (reach >= back)
        src = (rows - back).to(tl.int64) * stride_t
        xs = tl.load(x_row + src[:, None] + cols[None, :], mask=read[:, None] & cols_in[None, :], other=0.0)
        acc += xs.to(tl.float32) * w[None, :]
    return acc


@jit
def short_conv_forward_kernel(x, weight, bias, positions, y, length, dim, stride_b, stride_t,
                              WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED: tl.constexpr,
                              SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """One tile ``[BT tokens, BD channels]`` of one sequence row: y = act(pre-activation)."""
    row = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rows_in = rows < length
    cols_in = cols < dim
    pre = _pre_activation(x + row * stride_b, weight, bias, positions, rows, rows_in, cols, cols_in, stride_t,
                          WIDTH, HAS_BIAS, PACKED)
    if SILU:
        pre = pre * tl.sigmoid(pre)
    out = y + row * length * dim + rows.to(tl.int64)[:, None] * dim + cols[None, :]
    tl.store(out, pre.to(y.dtype.element_ty), mask=rows_in[:, None] & cols_in[None, :])


@jit
def short_conv_backward_pre_kernel(x, weight, bias, positions, dy, d_pre, dweight_parts, dbias_parts, length, dim,
                                   stride_b, stride_t, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                                   PACKED: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                                   TAPS: tl.constexpr):
    """One tile ``[BT tokens, BD channels]`` of one sequence row (``TAPS``: W rounded up to a power of two):
    ``d_pre = dy ⊙ silu'(pre)`` (the pre-activation recomputed from x; dy itself without SILU) stored in float32,
    and this program's partial sums over its tokens of dweight (tap j: Σ d_pre · x read W − 1 − j tokens back)
    and dbias."""
    row = tl.program_id(2).to(tl.int64)
    program = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rows_in = rows < length
    cols_in = cols < dim
    tile_in = rows_in[:, None] & cols_in[None, :]
    x_row = x + row * stride_b
    own = row * length * dim + rows.to(tl.int64)[:, None] * dim + cols[None, :]
    grad = tl.load(dy + own, mask=tile_in, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(x_row, weight, bias, positions, rows, rows_in, cols, cols_in, stride_t,
                              WIDTH, HAS_BIAS, PACKED)
        gate = tl.sigmoid(pre)
        grad = grad * gate * (1.0 + pre * (1.0 - gate))
    tl.store(d_pre + own, grad, mask=tile_in)
    if PACKED:
        reach = tl.load(positions + rows, mask=rows_in, other=0)
    else:
        reach = rows
    taps = tl.arange(0, TAPS)
    dweight = tl.zeros([BD, TAPS], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        back = WIDTH - 1 - j
        read = rows_in & (reach >= back)
        src = (rows - back).to(tl.int64) * stride_t
        xs = tl.load(x_row + src[:, None] + cols[None, :], mask=read[:, None] & cols_in[None, :], other=0.0)
        tap_sum = tl.sum(grad * xs.to(tl.float32), axis=0)
        dweight += tl.where(taps[None, :] == j, tap_sum[:, None], 0.0)
    parts = dweight_parts + program.to(tl.int64) * dim * WIDTH + cols[:, None] * WIDTH + taps[None, :]
    tl.store(parts, dweight, mask=cols_in[:, None] & (taps < WIDTH)[None, :])
    if HAS_BIAS:
        tl.store(dbias_parts + program.to(tl.int64) * dim + cols, tl.sum(grad, axis=0), mask=cols_in)


@jit
def short_conv_backward_input_kernel(d_pre, weight, positions, dx, length, dim, WIDTH: tl.constexpr,
                                     PACKED: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """One tile ``[BT tokens, BD channels]`` of one sequence row: token t feeds token t + k through tap W − 1 − k,
    so dx[t] = Σ_k weight[:, W − 1 − k] · d_pre[t + k] over the k for which t + k lies in t's sequence."""
    row = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cols_in = cols < dim
    d_pre_row = d_pre + row * length * dim
    dx_acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        shifted = rows + k
        shifted_in = shifted < length
        if PACKED:
            shifted_in = shifted_in & (tl.load(positions + shifted, mask=shifted_in, other=0) >= k)
        grad = tl.load(d_pre_row + shifted.to(tl.int64)[:, None] * dim + cols[None, :],
                       mask=shifted_in[:, None] & cols_in[None, :], other=0.0)
        w = tl.load(weight + cols * WIDTH + (WIDTH - 1 - k), mask=cols_in, other=0.0).to(tl.float32)
        dx_acc += grad * w[None, :]
    out = dx + row * length * dim + rows.to(tl.int64)[:, None] * dim + cols[None, :]
    tl.store(out, dx_acc.to(dx.dtype.element_ty), mask=(rows < length)[:, None] & cols_in[None, :])
