"""The op contract of docs/math.md: every pure-PyTorch backend against an independent float64 oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linmem.ops import chunk as chunk_module
from linmem.ops import linear_memory, linear_memory_step
from tests.oracle import oracle

F64 = torch.float64
TOL = 1e-9


def make_inputs(B, T, H, K, V, *, per_key=False, decay=(0.0, 1.0), seed=None, requires_grad=True):
    """Fresh random float64 inputs: unit keys, decays ``g ∈ -[decay]``, gates in (0, 1), random initial states."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def rand(*shape):
        return torch.rand(*shape, dtype=F64, generator=gen)

    def randn(*shape):
        return torch.randn(*shape, dtype=F64, generator=gen)

    lo, hi = decay
    inputs = dict(
        q=randn(B, T, H, K),
        k=torch.nn.functional.normalize(randn(B, T, H, K), dim=-1),
        v=randn(B, T, H, V),
        g=-(lo + (hi - lo) * rand(B, T, H, *([K] if per_key else []))),
        beta=rand(B, T, H),
        gamma=rand(B, T, H),
        S0=randn(B, H, V, K),
        R0=randn(B, H, V, K),
    )
    if requires_grad:
        for t in inputs.values():
            t.requires_grad_()
    return inputs


def run_op(x, backend, rule, residual, **switches):
    o, state = linear_memory(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"] if residual else None, rule=rule, residual=residual,
        initial_state=(x["S0"], x["R0"]) if residual else x["S0"], output_final_state=True, backend=backend,
        **switches,
    )
    return (o, *state) if residual else (o, state)


def run_oracle(x, rule, residual, residual_target="clip", **switches):
    o, S, R = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"], x["S0"], x["R0"], rule=rule,
                     residual=residual, target=residual_target, **switches)
    return (o, S, R) if residual else (o, S)


def loss_and_grads(outputs, x):
    """A loss that weighs every output element differently, and its gradient for every input."""
    gen = torch.Generator().manual_seed(1234)
    loss = sum((t * torch.randn(t.shape, dtype=F64, generator=gen)).sum() for t in outputs)
    leaves = list(x.values())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return {name: (torch.zeros_like(t) if gr is None else gr) for (name, t), gr in zip(x.items(), grads)}


def assert_close(a, b, what, tol=TOL):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:g}"


def check_against_oracle(x, backend, rule, residual, **switches):
    ours = run_op(x, backend, rule, residual, **switches)
    theirs = run_oracle(x, rule, residual, **switches)
    for name, a, b in zip(("o", "S_T", "R_T"), ours, theirs):
        assert_close(a, b, f"{backend} {name}")
    ours_grads = loss_and_grads(ours, x)
    theirs_grads = loss_and_grads(theirs, x)
    for name in x:
        if not residual and name in ("gamma", "R0"):
            continue
        assert_close(ours_grads[name], theirs_grads[name], f"{backend} d{name}")


SWITCHES = st.fixed_dictionaries({
    "residual_target": st.sampled_from(["clip", "tanh", "identity"]),
    "clip": st.sampled_from([1.0, 0.3]),
    "fit_history": st.booleans(),
    "output_gates": st.booleans(),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    backend=st.sampled_from(["reference", "chunk"]),
    rule=st.sampled_from(["additive", "delta"]),
    residual=st.booleans(),
    per_key=st.booleans(),
    shape=st.tuples(st.integers(1, 2), st.integers(1, 70), st.integers(1, 2), st.integers(1, 6), st.integers(1, 5)),
    switches=SWITCHES,
    seed=st.integers(0, 2**31),
)
def test_backends_match_oracle(backend, rule, residual, per_key, shape, switches, seed):
    """Outputs, final states and every gradient within 1e-9 of the oracle, for random shapes and switches."""
    per_key = per_key and rule == "additive"
    x = make_inputs(*shape, per_key=per_key, seed=seed)
    check_against_oracle(x, backend, rule, residual, **(switches if residual else {}))


@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("residual", [False, True])
def test_chunk_many_chunks(rule, residual):
    """Several chunks with a ragged tail (T = 3·64 + 13) and mixed decay strengths."""
    x = make_inputs(1, 205, 2, 5, 3, decay=(0.0, 0.2))
    check_against_oracle(x, "chunk", rule, residual)


def test_chunk_many_chunks_per_key_decay():
    x = make_inputs(1, 53, 2, 4, 3, per_key=True, decay=(0.0, 0.5))  # chunk 16: 3 full chunks and a tail
    check_against_oracle(x, "chunk", "additive", True)


@pytest.mark.parametrize("rule,residual,per_key", [("additive", False, False), ("additive", False, True),
                                                   ("additive", True, False), ("additive", True, True),
                                                   ("delta", False, False), ("delta", True, False)])
@pytest.mark.parametrize("fit_history", [True, False])
def test_chunk_in_segments(monkeypatch, rule, residual, per_key, fit_history):
    """A sequence longer than ``SEGMENT_LENGTH`` runs segment by segment (here segments of 40 tokens, not a
    multiple of either chunk size, so the segments end inside chunks): outputs, states and gradients as one pass."""
    monkeypatch.setattr(chunk_module, "SEGMENT_LENGTH", 40)
    x = make_inputs(1, 133, 2, 4, 3, per_key=per_key, decay=(0.0, 0.3))
    check_against_oracle(x, "chunk", rule, residual, **({"fit_history": fit_history} if residual else {}))


@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("decay", [(0.0, 0.0), (30.0, 60.0)], ids=["alpha_is_1", "alpha_near_0"])
def test_extreme_decays(rule, decay):
    """α exactly 1 (no forgetting) and α ≈ e^-45 (forget everything): no overflow, still exact."""
    x = make_inputs(1, 90, 2, 4, 3, decay=decay)
    check_against_oracle(x, "chunk", rule, True)


@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_chunk_gradcheck(rule):
    """Finite differences, independent of autograd, for every input of a residual memory."""
    x = make_inputs(1, 7, 1, 3, 2, decay=(0.05, 0.5))

    def fn(q, k, v, g, beta, gamma, S0, R0):
        o, (S, R) = linear_memory(q, k, v, g, beta, gamma, rule=rule, residual=True, initial_state=(S0, R0),
                                  output_final_state=True, backend="chunk", residual_target="tanh")
        return o, S, R

    assert torch.autograd.gradcheck(fn, tuple(x.values()), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "chunk"])
@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("residual", [False, True])
def test_state_hand_over(backend, rule, residual):
    """Splitting a sequence anywhere and passing the final state on gives the same outputs and states."""
    x = make_inputs(2, 97, 2, 4, 3, requires_grad=False)
    full = run_op(x, backend, rule, residual)
    split = int(torch.randint(1, 96, ()).item())
    first = {n: (t[:, :split] if t.dim() >= 3 and n not in ("S0", "R0") else t) for n, t in x.items()}
    second = {n: (t[:, split:] if t.dim() >= 3 and n not in ("S0", "R0") else t) for n, t in x.items()}
    head = run_op(first, backend, rule, residual)
    second["S0"] = head[1]
    if residual:
        second["R0"] = head[2]
    tail = run_op(second, backend, rule, residual)
    assert_close(torch.cat([head[0], tail[0]], dim=1), full[0], f"outputs split at {split}")
    for a, b in zip(tail[1:], full[1:]):
        assert_close(a, b, f"final state split at {split}")


@pytest.mark.parametrize("backend", ["reference", "chunk"])
@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_varlen_equals_separate_runs(backend, rule):
    lengths = [5, 0, 70, 1, 33]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    N, T = len(lengths), sum(lengths)
    x = make_inputs(1, T, 2, 4, 3)
    S0, R0 = torch.randn(N, 2, 3, 4, dtype=F64), torch.randn(N, 2, 3, 4, dtype=F64)
    o, (S, R) = linear_memory(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"], rule=rule, residual=True,
                              initial_state=(S0, R0), output_final_state=True, cu_seqlens=bounds, backend=backend)
    for n in range(N):
        part = slice(int(bounds[n]), int(bounds[n + 1]))
        o_n, (S_n, R_n) = linear_memory(
            x["q"][:, part], x["k"][:, part], x["v"][:, part], x["g"][:, part], x["beta"][:, part],
            x["gamma"][:, part], rule=rule, residual=True, initial_state=(S0[n : n + 1], R0[n : n + 1]),
            output_final_state=True, backend="reference",
        )
        assert_close(o[:, part], o_n, f"sequence {n} outputs")
        assert_close(S[n : n + 1], S_n, f"sequence {n} S")
        assert_close(R[n : n + 1], R_n, f"sequence {n} R")


def _shift_left(x):
    """x_{t+1} at position t (zero at the end): the base op then reads ``S_t x_{t+1}``."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def _previous_state_reads(x, rule, read):
    """``S_{t−1} read_t`` for every t from the base op alone (reading at t−1 with a shifted query)."""
    o, _ = linear_memory(_shift_left(read), x["k"], x["v"], x["g"], x["beta"], rule=rule,
                         initial_state=x["S0"], scale=1.0, backend="reference")
    first, _ = linear_memory(read[:, :1], torch.zeros_like(x["k"][:, :1]), torch.zeros_like(x["v"][:, :1]),
                             initial_state=x["S0"], scale=1.0, backend="reference")
    return torch.cat([first, o[:, :-1]], dim=1)


@pytest.mark.parametrize("backend", ["reference", "chunk"])
@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_identity_without_history_fitting(backend, rule):
    """fit_history=False gives o_t = scale·(α_t S_{t−1} q_t + γ_t r_t (k_tᵀ q_t)), with S_{t−1}k_t and
    S_{t−1}q_t read from the base op alone (the composition trick of issue 3)."""
    x = make_inputs(1, 80, 2, 4, 3, requires_grad=False)
    x["g"] = -torch.rand(1, 80, 2, dtype=F64)
    scale = 0.7
    o, _ = linear_memory(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"], rule=rule, residual=True,
                         fit_history=False, initial_state=(x["S0"], x["R0"]), scale=scale, backend=backend)
    prev_k = _previous_state_reads(x, rule, x["k"])
    prev_q = _previous_state_reads(x, rule, x["q"])
    r = (x["v"] - prev_k).clamp(-1, 1)
    kq = (x["k"] * x["q"]).sum(-1, keepdim=True)
    alpha = x["g"].exp().unsqueeze(-1)
    gamma = x["gamma"].unsqueeze(-1)
    assert_close(o, scale * (alpha * prev_q + gamma * r * kq), "w/o fitting identity")


@pytest.mark.parametrize("backend", ["reference", "chunk"])
@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_gamma_zero_is_decayed_base_read(backend, rule):
    """γ = 0: the residual memory contributes nothing and o_t = scale·α_t S_{t−1} q_t."""
    x = make_inputs(1, 70, 2, 4, 3, requires_grad=False)
    o, _ = linear_memory(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.zeros_like(x["gamma"]), rule=rule,
                         residual=True, initial_state=(x["S0"], x["R0"]), backend=backend)
    expected = x["g"].exp().unsqueeze(-1) * _previous_state_reads(x, rule, x["q"]) * 4**-0.5
    assert_close(o, expected, "gamma = 0")


def test_additive_error_is_causal_key_attention():
    """Additive rule: S_{t−1}k_t is the strictly causal (decayed) linear attention of keys against keys."""
    x = make_inputs(1, 40, 1, 4, 3, requires_grad=False)
    x["S0"] = torch.zeros_like(x["S0"])
    prev_k = _previous_state_reads(x, "additive", x["k"])[0, :, 0]
    k, v, beta, g = x["k"][0, :, 0], x["v"][0, :, 0], x["beta"][0, :, 0], x["g"][0, :, 0]
    cum = g.cumsum(0)
    decay = torch.exp((cum[:, None] - g[:, None]) - cum[None, :]).tril(-1)  # Π_{s<u<t} α_u, s < t
    expected = (decay * (k @ k.T)) @ (beta[:, None] * v)
    assert_close(prev_k, expected, "causal key attention")


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_step_matches_sequence(rule, residual):
    """Decoding token by token with ``linear_memory_step`` equals the sequence op."""
    x = make_inputs(2, 20, 2, 4, 3, requires_grad=False)
    full = run_op(x, "chunk", rule, residual)
    state = (x["S0"], x["R0"]) if residual else x["S0"]
    for t in range(20):
        o_t, state = linear_memory_step(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t],
                                        x["gamma"][:, t] if residual else None, state, rule=rule, residual=residual)
        assert_close(o_t, full[0][:, t], f"step {t}")
    for a, b in zip(state if residual else (state,), full[1:]):
        assert_close(a, b, "final state")


@pytest.mark.parametrize("backend", ["reference", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes(backend, dtype):
    """Output in q's dtype, states in float32, close to the float64 result."""
    x = make_inputs(1, 70, 2, 8, 4, requires_grad=False)
    low = {n: t.to(dtype) for n, t in x.items()}
    o, (S, R) = linear_memory(low["q"], low["k"], low["v"], low["g"], low["beta"], low["gamma"], rule="delta",
                              residual=True, output_final_state=True, backend=backend)
    o64, (S64, _) = linear_memory(*(low[n].to(F64) for n in ("q", "k", "v", "g", "beta", "gamma")), rule="delta",
                                  residual=True, output_final_state=True, backend="reference")
    assert o.dtype == dtype and S.dtype == torch.float32 and R.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(o.to(F64), o64, f"{dtype} outputs", tol=tol * max(1.0, o64.abs().max().item()))
    assert_close(S.to(F64), S64, f"{dtype} state", tol=tol * max(1.0, S64.abs().max().item()))


def test_empty_sequence():
    x = make_inputs(1, 0, 2, 4, 3, requires_grad=False)
    o, S = linear_memory(x["q"], x["k"], x["v"], initial_state=x["S0"], output_final_state=True)
    assert o.shape == (1, 0, 2, 3)
    assert torch.equal(S, x["S0"])


BAD_INPUTS = [
    (dict(k=torch.randn(1, 5, 2, 3)), "k must have the shape of q"),
    (dict(v=torch.randn(1, 5, 3, 3)), "v must have shape"),
    (dict(g=torch.full((1, 5, 2), 0.1)), "g must be <= 0"),
    (dict(g=-torch.rand(1, 5, 3)), "g must have shape"),
    (dict(beta=torch.rand(1, 5)), "beta must have shape"),
    (dict(residual=True), "residual=True needs gamma"),
    (dict(residual=True, gamma=torch.rand(1, 5, 2), clip=0.0), "clip must be > 0"),
    (dict(q=torch.randint(0, 3, (1, 5, 2, 4))), "q must be a floating-point tensor"),
    (dict(rule="mamba"), "rule must be one of"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(residual_target="huber", residual=True, gamma=torch.rand(1, 5, 2)), "residual_target must be one of"),
    (dict(rule="delta", g=-torch.rand(1, 5, 2, 4)), "only defined for rule='additive'"),
    (dict(initial_state=torch.zeros(1, 2, 4, 4)), r"initial_state \(S0\) must have shape"),
    (dict(initial_state=(torch.zeros(1, 2, 3, 4), None)), "must be one tensor S0"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5]), batch=2), r"cu_seqlens needs packed sequences in one row"),
    (dict(cu_seqlens=torch.tensor([0, 2, 4])), "cu_seqlens must start at 0 and end at T"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 5])), "non-decreasing"),
]


@pytest.mark.parametrize("override,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_raises_value_error(override, message):
    override = dict(override)
    batch = override.pop("batch", 1)
    args = dict(q=torch.randn(batch, 5, 2, 4), k=torch.randn(batch, 5, 2, 4), v=torch.randn(batch, 5, 2, 3))
    for name in ("q", "k", "v"):
        if name in override:
            args[name] = override.pop(name)
    with pytest.raises(ValueError, match=message):
        linear_memory(args["q"], args["k"], args["v"], **override)
