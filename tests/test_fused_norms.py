"""``linmem.ops.fused.norms``: the eager paths against float64 formulas, gradcheck and the model's own norm layers
(bit for bit), and the Triton kernels (under the interpreter on CPU) against the float64 formulas, outputs and every
gradient."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from linmem.layers.norm import GatedRMSNorm, RMSNorm
from linmem.layers.recurrent import l2_normalize
from linmem.ops.fused import gated_rms_norm, l2_norm, rms_norm
from linmem.ops.fused.norms import _triton_fits

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

EPS = 1e-6


def reference_rms(x, weight, residual=None, zero_centered=False, eps=EPS):
    """float64: (y, summed or None)."""
    h = x.double() if residual is None else x.double() + residual.double()
    scale = 1 + weight.double() if zero_centered else weight.double()
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale, (None if residual is None else h)


def reference_gated(x, gate, weight, activation, eps=EPS):
    x, gate = x.double(), gate.double()
    act = torch.sigmoid(gate) if activation == "sigmoid" else gate * torch.sigmoid(gate)
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double() * act


def reference_l2(x, eps=EPS):
    x = x.double()
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def outputs_and_grads(fn, inputs, seed=99):
    """Outputs of ``fn(*inputs)`` (a tensor or tuple) and the float64 gradients of every input for fixed random
    output gradients (one per output)."""
    inputs = leaves(*inputs)
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * randn(*o.shape, seed=seed + i, dtype=torch.float64)).sum() for i, o in enumerate(outs))
    loss.backward()
    return [o.detach().double() for o in outs], [None if t is None else t.grad.double() for t in inputs]


def assert_close_all(actual, expected, atol, rtol):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


# --- eager paths ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_equals_the_layers_bit_for_bit(dtype):
    x, r, g = randn(3, 5, 32, seed=0, dtype=dtype), randn(3, 5, 32, seed=1, dtype=dtype), randn(3, 5, 32, seed=2)
    for zero_centered in (False, True):
        norm = RMSNorm(32, eps=1e-5, zero_centered=zero_centered)
        norm.weight.data = randn(32, seed=3) * 0.1 + (0 if zero_centered else 1)
        assert torch.equal(rms_norm(x, norm.weight, 1e-5, zero_centered=zero_centered, prefer_triton=False), norm(x))
        y, summed = rms_norm(x, norm.weight, 1e-5, residual=r, zero_centered=zero_centered, prefer_triton=False)
        assert torch.equal(summed, x + r) and torch.equal(y, norm(x + r))
    for activation in ("swish", "silu", "sigmoid"):
        gated = GatedRMSNorm(32, eps=1e-5, activation=activation)
        gated.weight.data = randn(32, seed=4)
        assert torch.equal(gated_rms_norm(x, g, gated.weight, 1e-5, activation, prefer_triton=False), gated(x, g))
    assert torch.equal(l2_norm(x, prefer_triton=False), l2_normalize(x))


@pytest.mark.parametrize("zero_centered,with_residual", list(itertools.product([False, True], repeat=2)))
def test_eager_rms_norm_float64(zero_centered, with_residual):
    x, w, r = randn(4, 3, 24, seed=0, dtype=torch.float64), randn(24, seed=1, dtype=torch.float64), None
    if with_residual:
        r = randn(4, 3, 24, seed=2, dtype=torch.float64)
    out = rms_norm(x, w, EPS, residual=r, zero_centered=zero_centered, prefer_triton=False)
    y, summed = reference_rms(x, w, r, zero_centered)
    if with_residual:
        torch.testing.assert_close(out[1], summed, atol=1e-12, rtol=1e-12)
        out = out[0]
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, y, atol=1e-12, rtol=1e-12)
    small = [randn(2, 3, 5, seed=3, dtype=torch.float64), randn(5, seed=4, dtype=torch.float64)]
    small.append(randn(2, 3, 5, seed=5, dtype=torch.float64) if with_residual else None)
    assert torch.autograd.gradcheck(
        lambda a, b, c: rms_norm(a, b, EPS, residual=c, zero_centered=zero_centered, prefer_triton=False),
        leaves(*small))


@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_eager_gated_rms_norm_float64(activation):
    x, g, w = (randn(*s, seed=i, dtype=torch.float64) for i, s in enumerate([(4, 3, 24), (4, 3, 24), (24,)]))
    out = gated_rms_norm(x, g, w, EPS, activation, prefer_triton=False)
    torch.testing.assert_close(out, reference_gated(x, g, w, activation), atol=1e-12, rtol=1e-12)
    small = leaves(*(randn(*s, seed=i, dtype=torch.float64) for i, s in enumerate([(2, 3, 5), (2, 3, 5), (5,)])))
    assert torch.autograd.gradcheck(lambda a, b, c: gated_rms_norm(a, b, c, EPS, activation, prefer_triton=False),
                                    small)


def test_eager_l2_norm_float64():
    x = randn(4, 3, 24, seed=0, dtype=torch.float64)
    torch.testing.assert_close(l2_norm(x, prefer_triton=False), reference_l2(x), atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(lambda a: l2_norm(a, prefer_triton=False), leaves(randn(2, 3, 5, seed=1,
                                                                                          dtype=torch.float64)))


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_eager_bf16_dtypes(residual_dtype):
    x, w = randn(2, 4, 32, seed=0, dtype=torch.bfloat16), randn(32, seed=1)
    r = randn(2, 4, 32, seed=2, dtype=residual_dtype)
    y, summed = rms_norm(x, w, EPS, residual=r, prefer_triton=False)
    assert (y.dtype, summed.dtype) == (torch.bfloat16, residual_dtype)
    assert rms_norm(x, w, EPS, residual=r, out_dtype=torch.float32, prefer_triton=False)[0].dtype == torch.float32
    assert rms_norm(x, w, EPS, prefer_triton=False).dtype == torch.bfloat16
    assert gated_rms_norm(x, randn(2, 4, 32, seed=3), w, EPS, prefer_triton=False).dtype == torch.bfloat16
    assert l2_norm(x, prefer_triton=False).dtype == torch.bfloat16
    expected, _ = reference_rms(x, w, r)
    torch.testing.assert_close(y.double(), expected, atol=0.05, rtol=0.02)


def test_arguments_are_checked():
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(ValueError, match="activation"):
        gated_rms_norm(x, x, w, EPS, "relu")
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(7), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, EPS, residual=torch.randn(3, 7))
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(2, 8), w, EPS)


def test_default_dispatch_is_eager_on_the_cpu():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    assert not _triton_fits([x, w])
    assert "RMSNormFunction" not in type(rms_norm(x, w, EPS).grad_fn).__name__
    assert "L2NormFunction" not in type(l2_norm(x).grad_fn).__name__


# --- Triton kernels under the interpreter ---------------------------------------------------------------------------

SHAPES = list(itertools.product([1, 7, 33], [16, 48, 64]))
F32 = {"atol": 2e-5, "rtol": 2e-4}


@needs_triton
@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("zero_centered,with_residual", list(itertools.product([False, True], repeat=2)))
def test_triton_rms_norm(rows, width, zero_centered, with_residual):
    x, w = randn(rows, width, seed=0), randn(width, seed=1) * 0.5 + (0 if zero_centered else 1)
    r = randn(rows, width, seed=2) if with_residual else None
    outs, grads = outputs_and_grads(
        lambda a, b, c: rms_norm(a, b, EPS, residual=c, zero_centered=zero_centered, prefer_triton=True), [x, w, r])
    ref_in = leaves(x.double(), w.double(), None if r is None else r.double())
    ref_outs, ref_grads = outputs_and_grads(
        lambda a, b, c: tuple(o for o in reference_rms(a, b, c, zero_centered) if o is not None), ref_in)
    assert_close_all(outs, ref_outs, **F32)
    assert_close_all(grads, ref_grads, **F32)


@needs_triton
@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_triton_gated_rms_norm(rows, width, activation):
    inputs = [randn(rows, width, seed=0), randn(rows, width, seed=1) * 2, randn(width, seed=2)]
    outs, grads = outputs_and_grads(lambda a, b, c: gated_rms_norm(a, b, c, EPS, activation, prefer_triton=True),
                                    inputs)
    ref_outs, ref_grads = outputs_and_grads(lambda a, b, c: reference_gated(a, b, c, activation),
                                            [t.double() for t in inputs])
    assert_close_all(outs, ref_outs, **F32)
    assert_close_all(grads, ref_grads, **F32)


@needs_triton
@pytest.mark.parametrize("rows,width", SHAPES)
def test_triton_l2_norm(rows, width):
    x = randn(rows, width, seed=0)
    outs, grads = outputs_and_grads(lambda a: l2_norm(a, prefer_triton=True), [x])
    ref_outs, ref_grads = outputs_and_grads(reference_l2, [x.double()])
    assert_close_all(outs, ref_outs, **F32)
    assert_close_all(grads, ref_grads, **F32)


@needs_triton
def test_triton_rms_norm_with_unused_sum():
    """Only ``y`` feeds the loss: the sum's gradient is None (not a tensor of zeros) and d_residual = d_x."""
    x, w, r = randn(7, 16, seed=0), randn(16, seed=1), randn(7, 16, seed=2)
    outs, grads = outputs_and_grads(lambda a, b, c: rms_norm(a, b, EPS, residual=c, prefer_triton=True)[0], [x, w, r])
    ref_outs, ref_grads = outputs_and_grads(lambda a, b, c: reference_rms(a, b, c)[0],
                                            [x.double(), w.double(), r.double()])
    assert_close_all(outs, ref_outs, **F32)
    assert_close_all(grads, ref_grads, **F32)


def strided_view(case: str) -> torch.Tensor:
    """Views whose rows need two strides, three (then copied), or whose last axis is strided."""
    if case == "head-view":  # the first third of a [B, T, 3·H·K] projection as [B, T, H=3, K=16]
        return randn(2, 5, 3 * 48, seed=10)[..., :48].view(2, 5, 3, 16)
    if case == "three-strides":
        return randn(4, 6, 5, 16, seed=11)[::2, ::2, ::2]
    if case == "permuted":
        return randn(4, 6, 5, 16, seed=11).permute(2, 0, 1, 3)
    return randn(3, 7, 32, seed=12)[..., ::2]


@needs_triton
@pytest.mark.parametrize("case", ["head-view", "three-strides", "permuted", "strided-last-axis"])
def test_triton_reads_strided_views(case):
    x = strided_view(case)
    width = x.shape[-1]
    gate, w, r = randn(*x.shape, seed=20), randn(width, seed=21), randn(*x.shape, seed=22)
    gate_view = torch.empty(x.shape[:-1] + (2 * width,))[..., ::2].copy_(gate)  # a strided last axis too

    def ops(a, b, c, d):
        y, summed = rms_norm(a, c, EPS, residual=d, prefer_triton=True)
        return y, summed, gated_rms_norm(a, b, c, EPS, prefer_triton=True), l2_norm(a, prefer_triton=True)

    def reference(a, b, c, d):
        return (*reference_rms(a, c, d), reference_gated(a, b, c, "swish"), reference_l2(a))

    x_view = x.detach().requires_grad_(True)
    outs = ops(x_view, gate_view, w, r)
    dys = [randn(*o.shape, seed=30 + i).transpose(0, 1).contiguous().transpose(0, 1) for i, o in enumerate(outs)]
    torch.autograd.backward(outs, dys)
    ref_in = leaves(x.double(), gate.double(), w.double(), r.double())
    ref_outs = reference(*ref_in)
    torch.autograd.backward(ref_outs, [d.double() for d in dys])
    assert_close_all([o.detach().double() for o in outs], [o.detach() for o in ref_outs], **F32)
    torch.testing.assert_close(x_view.grad.double(), ref_in[0].grad, **F32)


@needs_triton
def test_row_layout_reads_views_in_place():
    from linmem.ops.fused.norm_kernels import row_layout

    head_view = strided_view("head-view")  # [2, 5, 3, 16], strides (720, 144, 16, 1)
    (same,), inner, strides = row_layout(head_view)
    assert same.data_ptr() == head_view.data_ptr() and inner == 3 and strides == [(144, 16)]
    contiguous = torch.randn(2, 5, 16)
    assert row_layout(contiguous)[1:] == (1, [(16, 0)])
    (copied,), inner, strides = row_layout(strided_view("three-strides"))
    assert copied.is_contiguous() and (inner, strides) == (1, [(16, 0)])


@needs_triton
def test_triton_empty_rows():
    x, w = torch.zeros(0, 3, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    y, summed = rms_norm(x, w, EPS, residual=torch.zeros(0, 3, 16), prefer_triton=True)
    g = gated_rms_norm(x, torch.zeros(0, 3, 16), w, EPS, prefer_triton=True)
    q = l2_norm(x, prefer_triton=True)
    assert y.shape == summed.shape == g.shape == q.shape == (0, 3, 16)
    (y.sum() + summed.sum() + g.sum() + q.sum()).backward()
    assert x.grad.shape == (0, 3, 16) and torch.equal(w.grad, torch.zeros(16))


@needs_triton
def test_triton_mixed_dtypes_follow_the_eager_path():
    """bf16 branch output into a float32 residual stream (the model under autocast): y bf16, summed float32, and
    each input's gradient in its own dtype, with the eager path's values."""
    x, w, r = randn(7, 48, seed=0, dtype=torch.bfloat16), randn(48, seed=1), randn(7, 48, seed=2)
    outs, grads = outputs_and_grads(lambda a, b, c: rms_norm(a, b, EPS, residual=c, prefer_triton=True), [x, w, r])
    ref_outs, ref_grads = outputs_and_grads(lambda a, b, c: rms_norm(a, b, EPS, residual=c, prefer_triton=False),
                                            [x, w, r])
    torch.testing.assert_close(outs[1], ref_outs[1], atol=0, rtol=0)  # summed: the same float32 sum
    assert_close_all(outs[:1] + grads, ref_outs[:1] + ref_grads, atol=0.02, rtol=0.02)
    leaf_x, leaf_r = leaves(x, r)
    y, summed = rms_norm(leaf_x, w, EPS, residual=leaf_r, prefer_triton=True)
    (y.float().sum() + summed.sum()).backward()
    assert (y.dtype, summed.dtype, leaf_x.grad.dtype, leaf_r.grad.dtype) == (torch.bfloat16, torch.float32,
                                                                            torch.bfloat16, torch.float32)
    g = gated_rms_norm(x, randn(7, 48, seed=3, dtype=torch.bfloat16), w, EPS, prefer_triton=True)
    assert g.dtype == l2_norm(x, prefer_triton=True).dtype == torch.bfloat16


@needs_triton
def test_triton_saves_no_float32_copy_of_the_input():
    """What autograd keeps: the bf16 input (or output, for l2_norm), the weight and a float32 rstd per row."""
    x, w = randn(8, 64, seed=0, dtype=torch.bfloat16).requires_grad_(True), randn(64, seed=1).requires_grad_(True)
    gate = randn(8, 64, seed=2, dtype=torch.bfloat16).requires_grad_(True)
    for fn in (lambda: rms_norm(x, w, EPS, prefer_triton=True),
               lambda: gated_rms_norm(x, gate, w, EPS, prefer_triton=True),
               lambda: l2_norm(x, prefer_triton=True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):
            fn()
        assert saved
        for t in saved:
            assert t.dtype == torch.bfloat16 or t.numel() <= 64, (t.dtype, tuple(t.shape))
