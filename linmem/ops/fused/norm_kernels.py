"""Triton kernels of the row norms in ``norms.py`` (RMSNorm with a fused residual add, gated RMSNorm, L2 norm), with
their autograd Functions. Imported only when a Triton path runs (Triton is an optional dependency).

Every op works on rows: a tensor ``[..., D]`` is ``N`` rows of ``D`` elements, one row in one tile of ``BLOCK_D``
(D padded to a power of two). A program handles ``BLOCK_ROWS`` rows at a time; the backward programs loop over
consecutive row blocks and write their share of the weight gradient as one float32 row of a ``[programs, D]``
partial sum that torch reduces (no atomics, so the result does not depend on scheduling). All arithmetic is float32;
loads convert from the tensors' own dtypes, stores round to the outputs' dtypes.

Inputs need not be contiguous: their leading axes are read through at most two strides (``row_layout``), so a
head view ``[B, T, H, K]`` of a wider projection is read in place. Outputs are new contiguous tensors.

Saved for the backward (never a float32 copy of a whole input):

- rms_norm: the normalised input in its own dtype (``x``, or the stored sum ``x + residual``), the weight and
  ``rstd [N]`` float32;
- gated_rms_norm: ``x``, ``gate``, the weight and ``rstd``;
- l2_norm: the output ``y`` in its dtype and ``rstd``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

# Float32 elements per program tile (rows × padded width). Under the CPU interpreter the tile is small, so that even
# the tests' tiny inputs take several row blocks and the backward's loop over them runs.
TILE_ELEMENTS = 4096
INTERPRETER_TILE_ELEMENTS = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tiling(rows: int, width: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_D, warps) for ``rows`` rows of ``width`` elements."""
    block_d = triton.next_power_of_2(width)
    tile = INTERPRETER_TILE_ELEMENTS if _interpreting() else TILE_ELEMENTS
    block_rows = max(1, min(tile // block_d, triton.next_power_of_2(rows)))
    warps = min(16, max(2, block_rows * block_d // 512))
    return block_rows, block_d, warps


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _program_count(device: torch.device, blocks: int) -> int:
    """Programs of a backward launch that loops over ``blocks`` row blocks: a few per multiprocessor (each writes one
    row of weight-gradient partials), two under the interpreter (so the loop runs more than once)."""
    if device.type == "cuda":
        return max(1, min(blocks, 4 * _multiprocessors(device.index if device.index is not None else 0)))
    return max(1, min(blocks, 2))


def row_layout(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], int, list[tuple[int, int]]]:
    """Same-shaped tensors ``[..., D]`` as rows ``r`` at ``(r // inner) * outer_stride + (r % inner) * inner_stride``.

    Returns the tensors (a contiguous copy only where the last axis is not unit-stride or the leading axes need more
    than two strides), ``inner`` and each tensor's ``(outer_stride, inner_stride)``."""
    if any(t.stride(-1) != 1 for t in tensors if t.shape[-1] > 1):
        tensors = tuple(t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in tensors)
    groups: list[tuple[int, list[int]]] = []  # (rows, each tensor's stride), innermost axis group first
    for axis in reversed(range(tensors[0].dim() - 1)):
        size = tensors[0].shape[axis]
        if size == 1:
            continue
        strides = [t.stride(axis) for t in tensors]
        if groups and all(s == inner_s * groups[-1][0] for s, inner_s in zip(strides, groups[-1][1])):
            groups[-1] = (groups[-1][0] * size, groups[-1][1])
        else:
            groups.append((size, strides))
    if len(groups) > 2:
        tensors = tuple(t.contiguous() for t in tensors)
        return row_layout(*tensors)
    if len(groups) == 2:
        return list(tensors), groups[0][0], [(o, i) for o, i in zip(groups[1][1], groups[0][1])]
    strides = groups[0][1] if groups else [0] * len(tensors)
    return list(tensors), 1, [(s, 0) for s in strides]


@triton.jit
def _offsets(rows, inner, outer_stride, inner_stride):
    """int64 offsets of the first element of ``rows`` (see ``row_layout``)."""
    rows = rows.to(tl.int64)
    return (rows // inner) * outer_stride + (rows % inner) * inner_stride


@triton.jit
def _load(ptr, row_offsets, cols, mask):
    """A ``[BLOCK_ROWS, BLOCK_D]`` tile in float32, 0 outside ``mask``."""
    return tl.load(ptr + row_offsets[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, rows, width, cols, values, mask):
    """A tile into a contiguous ``[N, width]`` tensor, rounded to its dtype."""
    offsets = rows.to(tl.int64)[:, None] * width + cols[None, :]
    tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_block(block, n_rows, width, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row block ``block``: its rows, the columns, the row mask and the ``[BLOCK_ROWS, BLOCK_D]`` tile mask."""
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    return rows, cols, row_mask, row_mask[:, None] & (cols < width)[None, :]


@triton.jit
def _load_scale(weight, cols, width, ZERO_CENTERED: tl.constexpr):
    """The per-column scale in float32: ``weight``, or ``1 + weight``."""
    scale = tl.load(weight + cols, mask=cols < width, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        scale += 1.0
    return scale


@triton.jit
def _load_normalised(x, x_offsets, rstd, rows, row_mask, cols, mask):
    """The saved ``rstd`` of ``rows`` and the recomputed ``x̂ = x · rstd`` tile (0 outside ``mask``)."""
    r = tl.load(rstd + rows, mask=row_mask, other=0.0)
    return r, _load(x, x_offsets, cols, mask) * r[:, None]


@triton.jit
def _rms_input_grad(x_hat, scaled_dy, r, width):
    """The gradient of x through ``x̂ = x · rstd`` (mean over ``width``) given ``scaled_dy``, the gradient of x̂."""
    return r[:, None] * (scaled_dy - x_hat * (tl.sum(scaled_dy * x_hat, axis=1) / width)[:, None])


@triton.jit
def _activation(gate, SIGMOID: tl.constexpr):
    """``act(gate)`` and ``act'(gate)`` for act = sigmoid or silu (swish)."""
    s = tl.sigmoid(gate)
    if SIGMOID:
        return s, s * (1.0 - s)
    return gate * s, s * (1.0 + gate * (1.0 - s))


@triton.jit
def rms_norm_forward_kernel(
    x, x_outer, x_inner, residual, res_outer, res_inner, weight, y, summed, rstd,
    n_rows, inner, width, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """y = h · rstd · scale with h = x (+ residual, stored rounded to ``summed``'s dtype and normalised as stored),
    rstd = 1 / sqrt(mean(h²) + eps), scale = weight or 1 + weight. Grid: one program per row block."""
    rows, cols, row_mask, mask = _row_block(tl.program_id(0), n_rows, width, BLOCK_ROWS, BLOCK_D)
    h = _load(x, _offsets(rows, inner, x_outer, x_inner), cols, mask)
    if HAS_RESIDUAL:
        h += _load(residual, _offsets(rows, inner, res_outer, res_inner), cols, mask)
        h = h.to(summed.dtype.element_ty)
        _store(summed, rows, width, cols, h, mask)
        h = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(h * h, axis=1) / width + eps)
    scale = _load_scale(weight, cols, width, ZERO_CENTERED)
    _store(y, rows, width, cols, h * r[:, None] * scale[None, :], mask)
    tl.store(rstd + rows, r, mask=row_mask)


@triton.jit
def rms_norm_backward_kernel(
    x, x_outer, x_inner, dy, dy_outer, dy_inner, d_summed, ds_outer, ds_inner, weight, rstd,
    dx, d_residual, dw_partial,
    n_rows, inner, width, blocks_per_program,
    HAS_DSUMMED: tl.constexpr, STORE_DRESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dx = rstd · (scale·dy − x̂ · mean(scale·dy · x̂)) (+ d_summed), x̂ = x · rstd; this program's Σ dy · x̂ over its
    rows into ``dw_partial[program]``. Grid: programs that each loop over ``blocks_per_program`` row blocks."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < width
    scale = _load_scale(weight, cols, width, ZERO_CENTERED)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(blocks_per_program):
        rows, _, row_mask, mask = _row_block(program * blocks_per_program + block, n_rows, width, BLOCK_ROWS,
                                              BLOCK_D)
        r, x_hat = _load_normalised(x, _offsets(rows, inner, x_outer, x_inner), rstd, rows, row_mask, cols, mask)
        grad_y = _load(dy, _offsets(rows, inner, dy_outer, dy_inner), cols, mask)
        scaled = grad_y * scale[None, :]
        grad_x = _rms_input_grad(x_hat, scaled, r, width)
        if HAS_DSUMMED:
            grad_x += _load(d_summed, _offsets(rows, inner, ds_outer, ds_inner), cols, mask)
        _store(dx, rows, width, cols, grad_x, mask)
        if STORE_DRESIDUAL:
            _store(d_residual, rows, width, cols, grad_x, mask)
        dw += tl.sum(grad_y * x_hat, axis=0)
    tl.store(dw_partial + program * width + cols, dw, mask=col_mask)


@triton.jit
def gated_rms_norm_forward_kernel(
    x, x_outer, x_inner, gate, g_outer, g_inner, weight, y, rstd,
    n_rows, inner, width, eps,
    SIGMOID: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """y = x · rstd · weight · act(gate). Grid: one program per row block."""
    rows, cols, row_mask, mask = _row_block(tl.program_id(0), n_rows, width, BLOCK_ROWS, BLOCK_D)
    h = _load(x, _offsets(rows, inner, x_outer, x_inner), cols, mask)
    act, _ = _activation(_load(gate, _offsets(rows, inner, g_outer, g_inner), cols, mask), SIGMOID)
    r = tl.rsqrt(tl.sum(h * h, axis=1) / width + eps)
    w = _load_scale(weight, cols, width, False)
    _store(y, rows, width, cols, h * r[:, None] * w[None, :] * act, mask)
    tl.store(rstd + rows, r, mask=row_mask)


@triton.jit
def gated_rms_norm_backward_kernel(
    x, x_outer, x_inner, gate, g_outer, g_inner, dy, dy_outer, dy_inner, weight, rstd,
    dx, d_gate, dw_partial,
    n_rows, inner, width, blocks_per_program,
    SIGMOID: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """With the per-element scale w·act(gate): dx by the RMSNorm formula, d_gate = dy · x̂ · w · act'(gate), this
    program's Σ dy · x̂ · act(gate) into ``dw_partial[program]``. Grid: as ``rms_norm_backward_kernel``."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < width
    w = _load_scale(weight, cols, width, False)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(blocks_per_program):
        rows, _, row_mask, mask = _row_block(program * blocks_per_program + block, n_rows, width, BLOCK_ROWS,
                                              BLOCK_D)
        r, x_hat = _load_normalised(x, _offsets(rows, inner, x_outer, x_inner), rstd, rows, row_mask, cols, mask)
        act, act_grad = _activation(_load(gate, _offsets(rows, inner, g_outer, g_inner), cols, mask), SIGMOID)
        grad_y = _load(dy, _offsets(rows, inner, dy_outer, dy_inner), cols, mask)
        weighted = grad_y * w[None, :]
        scaled = weighted * act
        grad_x = _rms_input_grad(x_hat, scaled, r, width)
        _store(dx, rows, width, cols, grad_x, mask)
        _store(d_gate, rows, width, cols, weighted * x_hat * act_grad, mask)
        dw += tl.sum(grad_y * x_hat * act, axis=0)
    tl.store(dw_partial + program * width + cols, dw, mask=col_mask)


@triton.jit
def l2_norm_forward_kernel(
    x, x_outer, x_inner, y, rstd, n_rows, inner, width, eps, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """y = x · rstd, rstd = 1 / sqrt(Σx² + eps). Grid: one program per row block."""
    rows, cols, row_mask, mask = _row_block(tl.program_id(0), n_rows, width, BLOCK_ROWS, BLOCK_D)
    h = _load(x, _offsets(rows, inner, x_outer, x_inner), cols, mask)
    r = tl.rsqrt(tl.sum(h * h, axis=1) + eps)
    _store(y, rows, width, cols, h * r[:, None], mask)
    tl.store(rstd + rows, r, mask=row_mask)


@triton.jit
def l2_norm_backward_kernel(
    y, dy, dy_outer, dy_inner, rstd, dx, n_rows, inner, width, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dx = rstd · (dy − y · Σ dy·y) from the stored output ``y`` (contiguous). Grid: one program per row block."""
    rows, cols, row_mask, mask = _row_block(tl.program_id(0), n_rows, width, BLOCK_ROWS, BLOCK_D)
    out = _load(y, rows.to(tl.int64) * width, cols, mask)
    grad_y = _load(dy, _offsets(rows, inner, dy_outer, dy_inner), cols, mask)
    r = tl.load(rstd + rows, mask=row_mask, other=0.0)
    _store(dx, rows, width, cols, r[:, None] * (grad_y - out * tl.sum(grad_y * out, axis=1)[:, None]), mask)


def _launch_shape(x: torch.Tensor) -> tuple[int, int, tuple[int, int, int]]:
    """(rows, width, ``_tiling``) of ``x [..., D]``."""
    width = x.shape[-1]
    n_rows = x.numel() // width if width else 0
    return n_rows, width, _tiling(n_rows, width)


def _empty_rows(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device=like.device)


def _weight_partials(programs: int, width: int, device: torch.device, n_rows: int) -> torch.Tensor:
    """``[programs, width]`` float32 rows for a backward launch's weight-gradient partials: left unset when the launch
    runs (every program stores its row, a program past the last row block its zeros), zeros when there are no rows
    and nothing is launched. An unset tensor saves one fill kernel per norm and backward."""
    make = torch.empty if n_rows else torch.zeros
    return make(programs, width, dtype=torch.float32, device=device)


def _weight_grad(partials: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return partials.sum(0).to(weight.dtype)


def _backward_grid(x: torch.Tensor, block_rows: int) -> tuple[int, int]:
    """(programs, row blocks per program) of a backward launch over ``x``'s rows."""
    blocks = triton.cdiv(x.numel() // x.shape[-1], block_rows)
    programs = _program_count(x.device, blocks)
    return programs, triton.cdiv(blocks, programs)


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` on Triton: returns ``y`` or, with a residual, ``(y, summed)``."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, residual, weight, eps: float, zero_centered: bool, out_dtype: torch.dtype):
        ctx.set_materialize_grads(False)
        n_rows, width, (block_rows, block_d, warps) = _launch_shape(x)
        y = _empty_rows(x, out_dtype)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        summed = _empty_rows(x, residual.dtype) if residual is not None else None
        (xr, rr), inner, ((xo, xi), (ro, ri)) = row_layout(x, residual if residual is not None else x)
        if n_rows:
            rms_norm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
                xr, xo, xi, rr, ro, ri, weight, y, summed if summed is not None else y, rstd,
                n_rows, inner, width, eps,
                HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered,
                BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps,
            )
        ctx.save_for_backward(x if summed is None else summed, weight, rstd)
        ctx.zero_centered = zero_centered
        ctx.has_residual = residual is not None
        ctx.dtypes = (x.dtype, residual.dtype if residual is not None else None)
        return y if summed is None else (y, summed)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @once_differentiable
    def backward(ctx, dy, d_summed=None):
        x, weight, rstd = ctx.saved_tensors
        x_dtype, residual_dtype = ctx.dtypes
        if dy is None and d_summed is None:
            return None, None, None, None, None, None
        if dy is None:
            dy = torch.zeros(x.shape, dtype=x_dtype, device=x.device)
        n_rows, width, (block_rows, block_d, warps) = _launch_shape(x)
        dx = _empty_rows(x, x_dtype)
        store_residual = ctx.has_residual and residual_dtype != x_dtype
        d_residual = _empty_rows(x, residual_dtype) if store_residual else None
        programs, per_program = _backward_grid(x, block_rows) if n_rows else (1, 0)
        partials = _weight_partials(programs, width, x.device, n_rows)
        has_ds = d_summed is not None
        (xr, dyr, dsr), inner, ((xo, xi), (yo, yi), (so, si)) = row_layout(x, dy, d_summed if has_ds else dy)
        if n_rows:
            rms_norm_backward_kernel[(programs,)](
                xr, xo, xi, dyr, yo, yi, dsr, so, si, weight, rstd,
                dx, d_residual if store_residual else dx, partials,
                n_rows, inner, width, per_program,
                HAS_DSUMMED=has_ds, STORE_DRESIDUAL=store_residual, ZERO_CENTERED=ctx.zero_centered,
                BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps,
            )
        if not ctx.has_residual:
            d_residual = None
        elif not store_residual:
            d_residual = dx
        return dx, d_residual, _weight_grad(partials, weight), None, None, None


class GatedRMSNormFunction(torch.autograd.Function):
    """``gated_rms_norm`` on Triton."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, gate, weight, eps: float, sigmoid: bool):
        n_rows, width, (block_rows, block_d, warps) = _launch_shape(x)
        y = _empty_rows(x, x.dtype)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        (xr, gr), inner, ((xo, xi), (go, gi)) = row_layout(x, gate)
        if n_rows:
            gated_rms_norm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
                xr, xo, xi, gr, go, gi, weight, y, rstd, n_rows, inner, width, eps,
                SIGMOID=sigmoid, BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps,
            )
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.sigmoid = sigmoid
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @once_differentiable
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        n_rows, width, (block_rows, block_d, warps) = _launch_shape(x)
        dx = _empty_rows(x, x.dtype)
        d_gate = _empty_rows(gate, gate.dtype)
        programs, per_program = _backward_grid(x, block_rows) if n_rows else (1, 0)
        partials = _weight_partials(programs, width, x.device, n_rows)
        (xr, gr, dyr), inner, ((xo, xi), (go, gi), (yo, yi)) = row_layout(x, gate, dy)
        if n_rows:
            gated_rms_norm_backward_kernel[(programs,)](
                xr, xo, xi, gr, go, gi, dyr, yo, yi, weight, rstd, dx, d_gate, partials,
                n_rows, inner, width, per_program,
                SIGMOID=ctx.sigmoid, BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps,
            )
        return dx, d_gate, _weight_grad(partials, weight), None, None


class L2NormFunction(torch.autograd.Function):
    """``l2_norm`` on Triton."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, eps: float):
        n_rows, width, (block_rows, block_d, warps) = _launch_shape(x)
        y = _empty_rows(x, x.dtype)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        (xr,), inner, ((xo, xi),) = row_layout(x)
        if n_rows:
            l2_norm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
                xr, xo, xi, y, rstd, n_rows, inner, width, eps,
                BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps,
            )
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @once_differentiable
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        n_rows, width, (block_rows, block_d, warps) = _launch_shape(y)
        dx = _empty_rows(y, y.dtype)
        (dyr,), inner, ((yo, yi),) = row_layout(dy)
        if n_rows:
            l2_norm_backward_kernel[(triton.cdiv(n_rows, block_rows),)](
                y, dyr, yo, yi, rstd, dx, n_rows, inner, width,
                BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps,
            )
        return dx, None
