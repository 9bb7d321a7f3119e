"""The chunk backend at every legal decay: resets (``g = −∞``, α = 0), huge (``−1e30``, ``−1e4``) and tiny
(``−1e-6``, 0) log decays mixed with ordinary ones, against ``reference`` (the token loop) in float64 and float32.

Convention checked here: at ``g = −∞`` the gradient of g is finite (it is ``e^{g}·(…) = 0``, as the reference's
autograd gives); elsewhere every gradient is compared with the reference's where that one is finite.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linmem.ops import linear_memory

F64 = torch.float64
EXTREME_DECAYS = (0.0, -1e-6, -30.0, -1e4, -1e30, -math.inf)
# (rule, residual, per-key decay): sGLA, GLA, GDN, RLA (per head and per key), RDN
MEMORIES = [("additive", False, False), ("additive", False, True), ("delta", False, False),
            ("additive", True, False), ("additive", True, True), ("delta", True, False)]


def draw_decays(shape, extreme_share: float, gen: torch.Generator, dtype=F64) -> torch.Tensor:
    """Log decays: ordinary ones in ``(−1, 0]``, each replaced with probability ``extreme_share`` by one of
    ``EXTREME_DECAYS``."""
    g = -torch.rand(shape, dtype=dtype, generator=gen)
    extremes = torch.tensor(EXTREME_DECAYS, dtype=dtype)
    pick = extremes[torch.randint(len(EXTREME_DECAYS), shape, generator=gen)]
    return torch.where(torch.rand(shape, generator=gen, dtype=dtype) < extreme_share, pick, g)


def make_inputs(B, T, H, K, V, per_key, extreme_share, seed, dtype=F64, with_states=True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(B, T, H, K, dtype=dtype, generator=gen),
        k=torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=dtype, generator=gen), dim=-1),
        v=torch.randn(B, T, H, V, dtype=dtype, generator=gen),
        g=draw_decays((B, T, H, *([K] if per_key else [])), extreme_share, gen, dtype),
        beta=torch.rand(B, T, H, dtype=dtype, generator=gen),
        gamma=torch.rand(B, T, H, dtype=dtype, generator=gen),
    )
    if with_states:
        x["S0"] = torch.randn(B, H, V, K, dtype=dtype, generator=gen)
        x["R0"] = torch.randn(B, H, V, K, dtype=dtype, generator=gen)
    return x


def run(x, backend, rule, residual, cu_seqlens=None, **switches):
    """Outputs and final states of one backend, as a tuple of tensors."""
    states = (x.get("S0"), x.get("R0")) if residual else x.get("S0")
    o, final = linear_memory(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"] if residual else None,
                             rule=rule, residual=residual, initial_state=states, output_final_state=True,
                             cu_seqlens=cu_seqlens, backend=backend, **switches)
    return (o, *final) if residual else (o, final)


def grads(outputs, x, seed) -> dict:
    """Gradients of every input of a loss that weighs each output element with its own random weight."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, dtype=F64, generator=gen).to(t.dtype)).sum() for t in outputs)
    found = torch.autograd.grad(loss, list(x.values()), allow_unused=True)
    return {name: torch.zeros_like(t) if d is None else d for (name, t), d in zip(x.items(), found)}


def worst_error(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    """Largest absolute difference where the reference is finite; ours must be finite everywhere."""
    assert torch.isfinite(ours).all(), f"{what}: chunk gives non-finite values"
    finite = torch.isfinite(theirs)
    return (ours.double() - theirs.double())[finite].abs().max().item() if finite.any() else 0.0


def compare(x, rule, residual, tol, cu_seqlens=None, **switches):
    leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
    seed = int(torch.randint(1 << 30, ()))
    results = {}
    for backend in ("chunk", "reference"):
        inputs = {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}
        outputs = run(inputs, backend, rule, residual, cu_seqlens, **switches)
        results[backend] = outputs, grads(outputs, inputs, seed)
    (ours, our_grads), (theirs, their_grads) = results["chunk"], results["reference"]
    for name, a, b in zip(("o", "S_T", "R_T"), ours, theirs):
        err = worst_error(a, b, name)
        assert err <= tol * max(1.0, b.abs().max().item()), f"{name}: max abs error {err:.3g}"
    for name in x:
        err = worst_error(our_grads[name], their_grads[name], f"d{name}")
        scale = their_grads[name][torch.isfinite(their_grads[name])].abs().max().item() if x[name].numel() else 0
        assert err <= tol * max(1.0, scale), f"d{name}: max abs error {err:.3g} (largest gradient {scale:.3g})"


@st.composite
def cases(draw):
    rule, residual, per_key = draw(st.sampled_from(MEMORIES))
    packed = draw(st.booleans())
    switches = {}
    if residual:
        switches = dict(fit_history=draw(st.booleans()), output_gates=draw(st.booleans()),
                        residual_target=draw(st.sampled_from(["clip", "tanh", "identity"])))
    shape = dict(B=1 if packed else draw(st.integers(1, 2)), T=draw(st.integers(1, 70)), H=draw(st.integers(1, 2)),
                 K=draw(st.integers(1, 8)), V=draw(st.integers(1, 8)))
    cu_seqlens = None
    if packed:
        cuts = sorted(draw(st.lists(st.integers(0, shape["T"]), max_size=3)))
        cu_seqlens = torch.tensor([0, *cuts, shape["T"]])
    share = draw(st.sampled_from([0.05, 0.2, 0.6, 1.0]))
    return rule, residual, per_key, switches, shape, cu_seqlens, share, draw(st.booleans())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 2**31 - 1))
def test_chunk_matches_reference_at_extreme_decays(case, seed):
    rule, residual, per_key, switches, shape, cu_seqlens, share, with_states = case
    x = make_inputs(**shape, per_key=per_key, extreme_share=share, seed=seed, with_states=with_states)
    if cu_seqlens is not None and with_states:  # one initial state per packed sequence
        count = len(cu_seqlens) - 1
        x["S0"], x["R0"] = (torch.randn(count, *s.shape[1:], dtype=F64) for s in (x["S0"], x["R0"]))
    compare(x, rule, residual, 1e-9, cu_seqlens, **switches)


@pytest.mark.slow
@pytest.mark.parametrize("rule,residual,per_key", MEMORIES)
@pytest.mark.parametrize("decay", [-math.inf, -1e30, -1e8, -1e4, -30.0])
def test_one_huge_decay_in_a_long_chunk(rule, residual, per_key, decay):
    """One strong decay in the middle of ordinary ones, T crossing chunk boundaries: exact in float64, and the
    tokens before the decay unaffected."""
    x = make_inputs(1, 150, 2, 8, 8, per_key, 0.0, seed=int(torch.randint(1 << 30, ())))
    x["g"][:, 70] = decay
    compare(x, rule, residual, 1e-9)


@pytest.mark.parametrize("rule,residual,per_key", MEMORIES)
def test_float32_at_extreme_decays(rule, residual, per_key):
    """In float32 the chunk backend stays within float32 rounding of the float64 reference at every extreme
    decay (a cumulative-sum form was off by 23.8 at ``g = −1e8`` on outputs of size 10)."""
    x64 = make_inputs(2, 150, 2, 16, 16, per_key, 0.2, seed=int(torch.randint(1 << 30, ())))
    x64["g"][:, 40] = -1e8
    x32 = {name: t.float().requires_grad_() for name, t in x64.items()}
    ours = run(x32, "chunk", rule, residual)
    theirs = run({n: t.requires_grad_() for n, t in x64.items()}, "reference", rule, residual)
    for name, a, b in zip(("o", "S_T", "R_T"), ours, theirs):
        err = worst_error(a, b, name)
        assert err <= 1e-4 * max(1.0, b.abs().max().item()), f"float32 {name}: max abs error {err:.3g}"
    seed = int(torch.randint(1 << 30, ()))
    our_grads, their_grads = grads(ours, x32, seed), grads(theirs, x64, seed)
    for name in x64:
        err = worst_error(our_grads[name], their_grads[name], f"d{name}")
        scale = their_grads[name][torch.isfinite(their_grads[name])].abs().max().item()
        assert err <= 1e-4 * max(1.0, scale), f"float32 d{name}: max abs error {err:.3g} (largest {scale:.3g})"


def test_reset_forgets_everything_before_it():
    """``g = −∞`` at token t: the outputs from t on equal those of a run that starts at t from a zero state."""
    x = make_inputs(1, 100, 2, 4, 4, False, 0.0, seed=int(torch.randint(1 << 30, ())), with_states=False)
    x["g"][:, 67] = -math.inf
    for rule in ("additive", "delta"):
        full = run(x, "chunk", rule, False)[0]
        tail = run({name: t[:, 67:] for name, t in x.items()}, "chunk", rule, False)[0]
        assert torch.isfinite(full).all()
        assert (full[:, 67:] - tail).abs().max().item() <= 1e-12
