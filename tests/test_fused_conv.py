"""``linmem.ops.fused.short_conv``: the torch path and the Triton kernels (under the interpreter on CPU) against a
float64 token-by-token reference, and against ``ShortConvolution``."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from linmem.layers.conv import ShortConvolution
from linmem.ops.fused.conv import short_conv
from linmem.ops.packing import sequence_positions

triton = pytest.importorskip("triton")


def reference(x, weight, bias, silu, lengths=None):
    """float64 token loop: each token sums its W taps, skipping those before its own sequence's start."""
    x, weight = x.double(), weight.double()
    batch, length, dim = x.shape
    width = weight.shape[1]
    starts = [0] * length
    if lengths is not None:
        offset = 0
        for n in lengths:
            starts[offset:offset + n] = [offset] * n
            offset += n
    rows = []
    for t in range(length):
        acc = torch.zeros(batch, dim, dtype=torch.float64) if bias is None else bias.double().expand(batch, dim)
        for j in range(width):
            source = t - (width - 1) + j
            if source >= starts[t]:
                acc = acc + weight[:, j] * x[:, source]
        rows.append(acc)
    y = torch.stack(rows, 1)
    return F.silu(y) if silu else y


def bounds(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def inputs(batch, length, dim, width, with_bias, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, dim, generator=gen, dtype=dtype)
    weight = torch.randn(dim, width, generator=gen, dtype=dtype) / width ** 0.5
    bias = torch.randn(dim, generator=gen, dtype=dtype) if with_bias else None
    return x, weight, bias


def grads_of(fn, x, weight, bias, seed=1, grad_dtype=torch.float64):
    """(y, dx, dweight, dbias) of ``fn`` with a fixed random output gradient (rounded to ``grad_dtype``)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(grad_dtype).double()
    (y.double() * dy).sum().backward()
    return [y.detach()] + [None if t is None else t.grad for t in leaves]


def assert_close_all(got, want, atol, rtol):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol)


def test_sequence_positions_restart_at_every_start_including_empty_sequences():
    cu = bounds([1, 3, 0, 2])
    assert sequence_positions(cu, 6).tolist() == [0, 0, 1, 2, 0, 1]
    assert sequence_positions(cu, 6).dtype == torch.int64


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("width", [1, 3, 4])
def test_torch_path_matches_reference_and_short_convolution(width, activation):
    x, weight, bias = inputs(2, 9, 6, width, True, dtype=torch.float64)
    y = short_conv(x, weight, bias, activation=activation, prefer_triton=False)
    torch.testing.assert_close(y, reference(x, weight, bias, activation is not None), atol=1e-12, rtol=1e-12)
    conv = ShortConvolution(6, width, bias=True, activation=activation).double()
    with torch.no_grad():
        conv.weight.copy_(weight[:, None])
        conv.bias.copy_(bias)
    torch.testing.assert_close(y, conv(x)[0], atol=1e-12, rtol=1e-12)


def test_torch_path_packed_matches_reference_and_short_convolution():
    lengths = [1, 3, 0, 5, 2]
    x, weight, bias = inputs(1, 11, 5, 4, True, dtype=torch.float64)
    y = short_conv(x, weight, bias, cu_seqlens=bounds(lengths), prefer_triton=False)
    torch.testing.assert_close(y, reference(x, weight, bias, True, lengths), atol=1e-12, rtol=1e-12)
    conv = ShortConvolution(5, 4, bias=True).double()
    with torch.no_grad():
        conv.weight.copy_(weight[:, None])
        conv.bias.copy_(bias)
    torch.testing.assert_close(y, conv(x, cu_seqlens=bounds(lengths))[0], atol=1e-12, rtol=1e-12)


def test_torch_path_computes_16_bit_inputs_in_float32_and_keeps_their_dtype():
    x, weight, bias = inputs(2, 7, 4, 4, True)
    y = short_conv(x.bfloat16(), weight, bias, prefer_triton=False)
    assert y.dtype == torch.bfloat16
    want = reference(x.bfloat16().float(), weight, bias, True)
    torch.testing.assert_close(y.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("packed", [False, True])
def test_torch_path_gradcheck(packed):
    x, weight, bias = inputs(1 if packed else 2, 6, 3, 3, True, dtype=torch.float64)
    cu = bounds([2, 0, 1, 3]) if packed else None
    leaves = [t.requires_grad_(True) for t in (x, weight, bias)]
    assert torch.autograd.gradcheck(lambda *a: short_conv(*a, cu_seqlens=cu, prefer_triton=False), leaves)


TRITON_CASES = [
    (batch, length, dim, width, with_bias, activation)
    for batch, length, dim, width, with_bias, activation in itertools.product(
        [1, 2], [1, 5, 70], [8, 40], [2, 4], [True, False], ["silu", None])
    # every combination of width, bias and activation at T = 70; the short rows thinned to keep the file quick
    if length == 70 or (with_bias == (activation is None) and (batch + dim + width) % 2 == 0)
]


@pytest.mark.parametrize("batch,length,dim,width,with_bias,activation", TRITON_CASES)
def test_triton_matches_reference_with_gradients(batch, length, dim, width, with_bias, activation):
    x, weight, bias = inputs(batch, length, dim, width, with_bias, seed=length + dim)
    silu = activation is not None
    got = grads_of(lambda *a: short_conv(*a, activation=activation, prefer_triton=True), x, weight, bias)
    want = grads_of(lambda *a: reference(*a, silu), x.double(), weight.double(),
                    None if bias is None else bias.double())
    assert got[0].dtype == torch.float32
    assert_close_all(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths,width,activation", [
    ([1, 3, 0, 66], 4, "silu"),
    ([0, 70], 2, None),
    ([3, 1, 1, 65], 4, None),
    ([40, 0, 0, 30], 2, "silu"),
])
def test_triton_packed_matches_reference_with_gradients(lengths, width, activation):
    x, weight, bias = inputs(1, sum(lengths), 40, width, True, seed=width)
    silu = activation is not None
    cu = bounds(lengths)
    got = grads_of(lambda *a: short_conv(*a, activation=activation, cu_seqlens=cu, prefer_triton=True),
                   x, weight, bias)
    want = grads_of(lambda *a: reference(*a, silu, lengths), x.double(), weight.double(), bias.double())
    assert_close_all(got, want, atol=1e-5, rtol=1e-5)


def test_triton_reads_strided_x_in_place():
    """x a slice of a wider projection output (the q/k/v channels of a fused projection), B and T strides odd."""
    wide, weight, bias = inputs(2, 70, 56, 4, True)
    x = wide[:, :, 8:48]
    assert not x.is_contiguous()
    got = grads_of(lambda *a: short_conv(*a, prefer_triton=True), x, weight[8:48], bias[8:48])
    want = grads_of(lambda *a: reference(*a, True), x.double(), weight[8:48].double(), bias[8:48].double())
    assert_close_all(got, want, atol=1e-5, rtol=1e-5)


def test_triton_keeps_bfloat16():
    x, weight, bias = inputs(2, 70, 40, 4, True)
    x16 = x.bfloat16()
    got = grads_of(lambda *a: short_conv(*a, prefer_triton=True), x16, weight, bias)
    # y's gradient reaches the kernel in bf16; the reference gets the same rounded values
    want = grads_of(lambda *a: reference(*a, True), x16.double(), weight.double(), bias.double(),
                    grad_dtype=torch.bfloat16)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    assert got[2].dtype == got[3].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].double(), want[1], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[2].double(), want[2], atol=1e-4, rtol=1e-4)  # float32 sums of exact products
    torch.testing.assert_close(got[3].double(), want[3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("call,message", [
    (lambda x, w: short_conv(x, w, activation="relu"), "activation"),
    (lambda x, w: short_conv(x[0], w), r"\[B, T, D\]"),
    (lambda x, w: short_conv(x, w[:3]), r"\[D, W\]"),
    (lambda x, w: short_conv(x, w, torch.zeros(3)), r"bias must be \[D\]"),
    (lambda x, w: short_conv(x, w, cu_seqlens=bounds([2, 3])), "B == 1"),
    (lambda x, w: short_conv(x[:1], w, cu_seqlens=bounds([2, 3]).float()), "integer"),
    (lambda x, w: short_conv(x, torch.zeros(4, 9), prefer_triton=True), "kernel widths up to 8"),
])
def test_bad_inputs_are_named(call, message):
    x, weight, _ = inputs(2, 5, 4, 4, False)
    with pytest.raises(ValueError, match=message):
        call(x, weight)


@pytest.mark.parametrize("prefer_triton", [False, True])
def test_empty_row(prefer_triton):
    x, weight, bias = inputs(2, 0, 8, 4, True)
    assert short_conv(x, weight, bias, prefer_triton=prefer_triton).shape == (2, 0, 8)
