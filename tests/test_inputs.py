"""Bad and borderline inputs to the op and the memory lab's edits, and the op called the way FLA's ops are called.

The FLA tests run FLA 0.6.0's naive references (``fla.ops.gated_delta_rule.naive``, ``fla.ops.simple_gla.naive``)
on the same inputs; they are skipped where flash-linear-attention is not installed.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import linmem.memory as mm
from linmem.ops import linear_memory, linear_memory_step
from linmem.ops.checks import STRENGTH_RANGE

F64 = torch.float64
BACKENDS = ("reference", "chunk")


def inputs(B=2, T=9, H=2, K=4, V=5, requires_grad=False):
    """Fresh float64 inputs: unit keys, decays in (-1, 0], gates in (0, 1), initial states."""
    x = dict(q=torch.randn(B, T, H, K, dtype=F64), k=torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=F64),
                                                                                     dim=-1),
             v=torch.randn(B, T, H, V, dtype=F64), g=-torch.rand(B, T, H, dtype=F64),
             beta=torch.rand(B, T, H, dtype=F64), gamma=torch.rand(B, T, H, dtype=F64))
    for t in x.values():
        t.requires_grad_(requires_grad)
    return x


# ------------------------------------------------------------------------------------------------ op inputs


@pytest.mark.parametrize("dims", [(0, 5), (4, 0), (0, 0)])
def test_zero_key_or_value_dim_is_a_value_error(dims):
    K, V = dims
    x = inputs(K=K, V=V)
    with pytest.raises(ValueError, match="K and V must be >= 1"):
        linear_memory(**x, rule="delta", residual=True)
    with pytest.raises(ValueError, match="K and V must be >= 1"):
        linear_memory_step(x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], x["g"][:, 0], x["beta"][:, 0])


@pytest.mark.parametrize("name", ["beta", "gamma"])
@pytest.mark.parametrize("value", [-0.25, 2.5, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_strength_outside_its_range_is_refused(name, value, backend):
    x = inputs()
    with torch.no_grad():
        x[name][1, 4, 0] = value
    with pytest.raises(ValueError, match=rf"{name} must be finite and in \[0, 2\].*at \[1, 4, 0\]"):
        linear_memory(**x, rule="delta", residual=True, backend=backend)
    with pytest.raises(ValueError, match=rf"{name} must be finite"):
        linear_memory_step(*(x[n][:, 4] for n in ("q", "k", "v", "g", "beta", "gamma")), rule="additive",
                           residual=True)


@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_write_strength_up_to_two_is_accepted_and_exact(rule):
    """β, γ ∈ (1, 2] are legal (the delta rule's negative eigenvalues): the chunk backend agrees with the reference
    in float64, outputs and gradients; with unit keys the delta-rule state stays bounded."""
    x = inputs(T=40, requires_grad=True)
    with torch.no_grad():
        x["beta"].mul_(STRENGTH_RANGE[1])
        x["gamma"].mul_(STRENGTH_RANGE[1])
        x["beta"][0, 0, 0] = STRENGTH_RANGE[1]
    runs = {b: linear_memory(**x, rule=rule, residual=True, backend=b, output_final_state=True) for b in BACKENDS}
    weights = torch.randn_like(runs["reference"][0])
    grads = {b: torch.autograd.grad((o * weights).sum() + s.sum() + r.sum(), list(x.values()))
             for b, (o, (s, r)) in runs.items()}
    (o_ref, (s_ref, _)), (o_chunk, (s_chunk, _)) = runs["reference"], runs["chunk"]
    assert torch.allclose(o_chunk, o_ref, atol=1e-9, rtol=0) and torch.allclose(s_chunk, s_ref, atol=1e-9, rtol=0)
    for a, b in zip(grads["chunk"], grads["reference"]):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-8)
    if rule == "delta":
        g_free = dict(x, g=torch.zeros_like(x["g"]))  # no decay: only the transition's eigenvalues bound S
        _, s = linear_memory(**{n: t.detach() for n, t in g_free.items() if n != "gamma"}, rule="delta",
                             output_final_state=True)
        bound = sum(x["v"].detach()[:, t].norm(dim=-1) * STRENGTH_RANGE[1] for t in range(x["v"].shape[1]))
        assert bool((torch.linalg.matrix_norm(s, ord=2) <= bound + 1e-9).all())


@pytest.mark.parametrize("flag", ["residual", "fit_history", "output_gates"])
@pytest.mark.parametrize("value", [1, 0, "yes", torch.tensor(True), np.True_, None])
def test_switches_must_be_real_bools(flag, value):
    x = inputs()
    with pytest.raises(ValueError, match=rf"{flag} must be True or False"):
        linear_memory(**x, **{flag: value})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_empty_sequence_returns_a_copy_of_the_initial_state(backend, residual, state_v_first):
    x = inputs(T=0, K=3, V=3)
    shape = (2, 2, 3, 3)
    s0, r0 = torch.randn(shape, dtype=F64), torch.randn(shape, dtype=F64)
    keep = s0.clone(), r0.clone()
    o, state = linear_memory(**x, rule="delta", residual=residual, initial_state=(s0, r0) if residual else s0,
                             output_final_state=True, backend=backend, state_v_first=state_v_first)
    assert o.shape == (2, 0, 2, 3)
    finals = state if residual else (state,)
    for final, given, before in zip(finals, (s0, r0), keep):
        assert torch.equal(final, given)
        assert final.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()
        final.add_(1.0)  # editing the returned state leaves the caller's untouched
        assert torch.equal(given, before)


# ------------------------------------------------------------------------------------------------ StateAdd


def tiny_model():
    from transformers import AutoModelForCausalLM

    from linmem.models import LinMemConfig

    config = LinMemConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_heads=2, head_dim=4, expand_v=2.0,
                          hidden_ratio=2, mixer="rdn", pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return AutoModelForCausalLM.from_config(config).to(F64).eval()


def test_state_add_with_a_wrong_shape_names_the_expected_one():
    model = tiny_model()
    ids = torch.randint(1, 40, (2, 10))
    right = torch.randn(2, 8, 4, dtype=F64)  # V = 2 * head_dim, K = head_dim
    edited = mm.run(model, ids, edits=[mm.StateAdd([(1, 0, "R")], at=5, delta=right)])
    assert edited.shape[:2] == (2, 10)
    for wrong in (right.transpose(1, 2), right[:1], torch.randn(2, 8, 5, dtype=F64)):
        with pytest.raises(ValueError, match=r"StateAdd.delta must have shape \[B, V, K\] = \[2, 8, 4\].*got"):
            mm.run(model, ids, edits=[mm.StateAdd([(1, 0, "R")], at=5, delta=wrong)])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_state_add_with_nan_or_inf_is_refused_when_built(bad):
    delta = torch.randn(2, 8, 4)
    delta[1, 3, 2] = bad
    with pytest.raises(ValueError, match="StateAdd.delta must be finite"):
        mm.StateAdd([(1, 0, "S")], at=5, delta=delta)
    with pytest.raises(ValueError, match=r"StateAdd.delta must be a tensor \[B, V, K\]"):
        mm.StateAdd([(1, 0, "S")], at=5, delta=torch.randn(8, 4))


# ------------------------------------------------------------------------------------------ FLA's calling convention


class Float64Torch:
    """``torch`` as FLA's naive references see it, with ``float32`` standing for float64: they cast their inputs with
    ``.to(torch.float32)``, so with this module in their namespace they compute in float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def fla_naive(module: str, monkeypatch):
    pytest.importorskip("fla")
    naive = importlib.import_module(f"fla.ops.{module}.naive")
    monkeypatch.setattr(naive, "torch", Float64Torch())
    return naive


def l2(x):
    return x / (x * x).sum(-1, keepdim=True).add(1e-6).sqrt()  # FLA's l2norm, epsilon included


def grads_of(o, state, leaves, weights):
    return torch.autograd.grad((o * weights[0]).sum() + (state * weights[1]).sum(), leaves)


@pytest.mark.parametrize("dims", [(8, 8), (6, 10)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_delta_rule_with_fla_keywords_matches_fla_naive(dims, backend, monkeypatch):
    """``chunk_gated_delta_rule``'s keywords (``[N, H, K, V]`` states via ``state_v_first=False``, q/k L2 norm in
    the op) give FLA's naive recurrent gated delta rule: outputs, final states and every gradient, in float64."""
    naive = fla_naive("gated_delta_rule", monkeypatch)
    K, V = dims
    B, T, H = 2, 21, 3
    q, k, v = torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, V,
                                                                                                 dtype=F64)
    g, beta = -torch.rand(B, T, H, dtype=F64), torch.rand(B, T, H, dtype=F64)
    h0 = torch.randn(B, H, K, V, dtype=F64)  # FLA's layout
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, h0)]
    scale = 0.7
    o, ht = linear_memory(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, state_v_first=False, rule="delta", backend=backend)
    o_fla, ht_fla = naive.naive_recurrent_gated_delta_rule(q=l2(q), k=l2(k), v=v, beta=beta, g=g, scale=scale,
                                                           initial_state=h0, output_final_state=True)
    assert ht.shape == ht_fla.shape == (B, H, K, V)
    assert torch.allclose(o, o_fla, atol=1e-10, rtol=0) and torch.allclose(ht, ht_fla, atol=1e-10, rtol=0)
    weights = torch.randn_like(o), torch.randn_like(ht)
    for ours, theirs in zip(grads_of(o, ht, leaves, weights), grads_of(o_fla, ht_fla, leaves, weights)):
        assert torch.allclose(ours, theirs, atol=1e-9, rtol=0)
    if K == V:  # the same state, read in linmem's default layout, is another state: the keyword is needed
        o_default, _ = linear_memory(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0,
                                     use_qk_l2norm_in_kernel=True, rule="delta", backend=backend)
        assert not torch.allclose(o_default, o_fla, atol=1e-3)
        o_v_first, _ = linear_memory(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                     initial_state=h0.transpose(-1, -2), use_qk_l2norm_in_kernel=True, rule="delta",
                                     backend=backend)
        assert torch.allclose(o_v_first, o_fla, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dims", [(8, 8), (6, 10)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_simple_gla_with_fla_keywords_matches_fla_naive(dims, backend, monkeypatch):
    """``chunk_simple_gla``'s keywords, with the fixed per-head decay ``g_gamma [H]`` and FLA-layout states, give
    FLA's naive chunked simple GLA with that decay at every token. Its intra-chunk decay mask is cast to float32
    (``.float()``), which bounds the agreement to ~1e-7 relative."""
    naive = fla_naive("simple_gla", monkeypatch)
    K, V = dims
    B, T, H = 2, 70, 3  # over one FLA chunk of 64
    q, k, v = torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, V,
                                                                                                 dtype=F64)
    g_gamma = -torch.rand(H, dtype=F64) * 0.2
    h0 = torch.randn(B, H, K, V, dtype=F64)
    leaves = [t.requires_grad_() for t in (q, k, v, g_gamma, h0)]
    o, ht = linear_memory(q=q, k=k, v=v, g_gamma=g_gamma, scale=None, initial_state=h0, output_final_state=True,
                          state_v_first=False, backend=backend)
    o_fla, ht_fla = naive.naive_chunk_simple_gla(q=q, k=k, v=v, g=g_gamma.expand(B, T, H), initial_state=h0,
                                                 output_final_state=True, scale=None)
    assert ht.shape == ht_fla.shape == (B, H, K, V)
    size = o_fla.abs().max().item(), ht_fla.abs().max().item()
    assert (o - o_fla).abs().max().item() < 1e-6 * size[0]
    assert (ht - ht_fla).abs().max().item() < 1e-6 * size[1]
    weights = torch.randn_like(o), torch.randn_like(ht)
    for ours, theirs in zip(grads_of(o, ht, leaves, weights), grads_of(o_fla, ht_fla, leaves, weights)):
        assert (ours - theirs).abs().max().item() < 1e-6 * max(1.0, theirs.abs().max().item())


def test_fla_keywords_are_checked():
    x = inputs()
    with pytest.raises(ValueError, match="either g .* or g_gamma"):
        linear_memory(**x, g_gamma=torch.zeros(2, dtype=F64))
    del x["g"]
    with pytest.raises(ValueError, match=r"g_gamma must have shape \[H\] = \[2\]"):
        linear_memory(**x, g_gamma=torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="g_gamma must be <= 0"):
        linear_memory(**x, g_gamma=torch.tensor([0.0, 0.1], dtype=F64))
    with pytest.raises(ValueError, match=r"initial_state \(S0\) must have shape \[N, H, K, V\]"):
        linear_memory(**x, initial_state=torch.zeros(2, 2, 5, 4, dtype=F64), state_v_first=False)
    with pytest.raises(ValueError, match="state_v_first and use_qk_l2norm_in_kernel must be bools"):
        linear_memory(**x, state_v_first="kv")
