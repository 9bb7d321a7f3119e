"""``linmem.ops.fused.swiglu_linear``: the torch path and the Triton kernels (under the interpreter on CPU) against
``F.linear(F.silu(gate) * up, weight)`` in float64, what it saves for the backward, and its dtypes under autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.ops.fused.swiglu import swiglu_linear

triton = pytest.importorskip("triton")


def formula(gate, up, weight):
    return F.linear(F.silu(gate) * up, weight)


def inputs(shape, out_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(*shape, generator=gen, dtype=dtype) * 2
    up = torch.randn(*shape, generator=gen, dtype=dtype)
    weight = torch.randn(out_dim, shape[-1], generator=gen, dtype=dtype) / shape[-1] ** 0.5
    return gate, up, weight


def grads_of(fn, *tensors, seed=1):
    """(y, d_gate, d_up, d_weight) of ``fn`` with a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (y.double() * dy).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


def float64_reference(gate, up, weight):
    return grads_of(formula, gate.double(), up.double(), weight.double())


def assert_close_all(got, want, atol, rtol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(5, 12), (2, 3, 7)])
def test_torch_path_matches_formula_in_float64(shape):
    gate, up, weight = inputs(shape, 6, dtype=torch.float64)
    got = grads_of(lambda *a: swiglu_linear(*a, prefer_triton=False), gate, up, weight)
    assert_close_all(got, float64_reference(gate, up, weight), atol=1e-12, rtol=1e-12)


def test_default_dispatch_on_cpu_is_torch_path_and_passes_gradcheck():
    gate, up, weight = (t.requires_grad_(True) for t in inputs((2, 3, 5), 4, dtype=torch.float64))
    assert torch.autograd.gradcheck(swiglu_linear, (gate, up, weight))


def test_saves_gate_up_and_weight_only():
    """The product is recomputed in the backward: of the [N, I] tensors only gate and up are kept (the formula
    keeps four)."""
    gate, up, weight = (t.requires_grad_(True) for t in inputs((4, 9), 3))

    def saved_by(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(gate, up, weight)
        return saved

    kept = saved_by(lambda *a: swiglu_linear(*a, prefer_triton=False))
    assert len(kept) == 3
    assert {t.data_ptr() for t in kept} == {gate.data_ptr(), up.data_ptr(), weight.data_ptr()}
    assert sum(t.shape == gate.shape for t in saved_by(formula)) == 4


@pytest.mark.parametrize("shape,out_dim", [((1, 8), 4), ((2, 17, 40), 8), ((3, 300), 5), ((0, 40), 3)])
def test_triton_matches_formula_in_float64(shape, out_dim):
    gate, up, weight = inputs(shape, out_dim, seed=shape[-1])
    got = grads_of(lambda *a: swiglu_linear(*a, prefer_triton=True), gate, up, weight)
    assert got[0].dtype == torch.float32 and got[0].shape == (*shape[:-1], out_dim)
    assert_close_all(got, float64_reference(gate, up, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefer_triton", [False, True])
def test_gate_and_up_as_halves_of_one_projection(prefer_triton):
    """gate and up as column slices of one [N, 2I] projection: rows strided, read in place."""
    fused, _, weight = inputs((2, 19, 80), 6)
    got = grads_of(lambda f, w: swiglu_linear(f[..., :40], f[..., 40:], w, prefer_triton=prefer_triton),
                   fused, weight[:, :40])
    want = grads_of(lambda f, w: formula(f[..., :40], f[..., 40:], w), fused.double(), weight[:, :40].double())
    assert_close_all(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefer_triton", [False, True])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_autocast_gives_the_formulas_dtypes_and_values(prefer_triton, input_dtype):
    """Under autocast the matmuls run in bf16 as the formula's would: same output and gradient dtypes, values to
    bf16 rounding (the fused product is rounded once, the formula's twice)."""
    gate, up, weight = inputs((3, 11, 40), 8)
    gate, up = gate.to(input_dtype), up.to(input_dtype)
    results = []
    for fn in (lambda *a: swiglu_linear(*a, prefer_triton=prefer_triton), formula):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(grads_of(fn, gate, up, weight))
    got, want = results
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert got[0].dtype == torch.bfloat16 and got[3].dtype == torch.float32
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=0.05, rtol=0.05)


def test_mismatched_dtypes_without_autocast_fail_like_the_formula():
    gate, up, weight = inputs((4, 8), 3)
    with pytest.raises(RuntimeError):
        formula(gate.double(), up.double(), weight)
    with pytest.raises(RuntimeError):
        swiglu_linear(gate.double(), up.double(), weight)


@pytest.mark.parametrize("call,message", [
    (lambda g, u, w: swiglu_linear(g, u[:, :4], w), "same shape"),
    (lambda g, u, w: swiglu_linear(g, u, w[:, :4]), r"\[D, I\]"),
])
def test_bad_shapes_are_named(call, message):
    gate, up, weight = inputs((4, 8), 3)
    with pytest.raises(ValueError, match=message):
        call(gate, up, weight)
