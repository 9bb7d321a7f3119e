"""The memory lab's edited step is the spec's step (``ops/step.py``) with per-memory writes.

``edited_step`` is checked against the equations written out here a second time, per head with plain matrices in
float64, on random inputs with every write override set at random, for both rules and every residual switch.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from linmem.memory.replay import HeadInputs, WriteOverrides, edited_step
from linmem.ops import MemoryConfig
from linmem.ops.step import memory_step, memory_step_parts

N, T, K, V = 3, 5, 4, 6
SCALE = 0.7

CONFIGS = [MemoryConfig(rule=rule) for rule in ("additive", "delta")] + [
    MemoryConfig(rule=rule, residual=True, residual_target=target, clip=0.6, fit_history=fit, output_gates=gates)
    for rule, target, fit, gates in itertools.product(("additive", "delta"), ("clip", "tanh", "identity"),
                                                      (True, False), (True, False))
]


def config_id(config: MemoryConfig) -> str:
    if not config.residual:
        return config.rule
    return f"{config.rule}-{config.residual_target}-fit{int(config.fit_history)}-gates{int(config.output_gates)}"


def random_inputs(config: MemoryConfig, per_key_decay: bool, gen: torch.Generator) -> HeadInputs:
    """Inputs of ``N`` heads over ``T`` tokens in float64; errors of order one so that ρ's clip and tanh bend."""
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(randn(N, T, K), dim=-1)
    g = -rand(N, T, K) if per_key_decay else -rand(N, T)
    return HeadInputs(randn(N, T, K), k, 2 * randn(N, T, V), g, rand(N, T), rand(N, T) if config.residual else None)


def random_overrides(x: HeadInputs, gen: torch.Generator) -> WriteOverrides:
    """Every field differs from the inputs; the residual target is given for about half of the (head, token)s."""
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return WriteOverrides(
        base_k=randn(N, T, K), base_v=randn(N, T, V), base_beta=rand(N, T), resid_k=randn(N, T, K),
        resid_gamma=None if x.gamma is None else rand(N, T), resid_r=randn(N, T, V),
        resid_r_set=rand(N, T) < 0.5, resid_r_shift=randn(N, T, V))


def written(state, key, value, strength, decay, rule):
    """One memory ``[V, K]`` written with ``(key, value, strength)`` under the decay matrix ``decay [K, K]``."""
    if rule == "delta":
        state = state - strength * torch.outer(state @ key, key)
    return state @ decay + strength * torch.outer(value, key)


def expected_step(x: HeadInputs, w: WriteOverrides, t: int, base: torch.Tensor, resid: torch.Tensor | None,
                  config: MemoryConfig):
    """The equations for head ``i`` at token ``t`` as matrices: ``S, R [V, K]``, ``A = diag(α)`` or ``α I``.

    S_t = (S − β_w (S k_w) k_wᵀ) A + β_w v_w k_wᵀ (delta; additive without the middle term);
    r = ρ(v − S_{t−1} k_r), or the given r where set, plus the shift;
    R_t = written like S with (k_r, r, γ_w) (fit_history), else r k_rᵀ;
    o = scale·(S_{t−1} A q + γ R_t q) (output gates), scale·(S_{t−1} q + R_t q) (plain sum), scale·S_t q (no R).
    """
    outs = []
    for i in range(N):
        q, v = x.q[i, t], x.v[i, t]
        alpha = x.g[i, t].exp()
        decay = torch.diag(alpha) if alpha.dim() else alpha * torch.eye(K, dtype=torch.float64)

        s_prev = base[i]
        s_new = written(s_prev, w.base_k[i, t], w.base_v[i, t], w.base_beta[i, t], decay, config.rule)
        if not config.residual:
            o = SCALE * (s_new @ q)
            outs.append((o, o, torch.zeros(V, dtype=torch.float64), s_new, None))
            continue
        k_r = w.resid_k[i, t]
        error = v - s_prev @ k_r
        if config.residual_target == "clip":
            r = error.clamp(-config.clip, config.clip)
        elif config.residual_target == "tanh":
            r = config.clip * torch.tanh(error / config.clip)
        else:
            r = error
        if w.resid_r_set[i, t]:
            r = w.resid_r[i, t]
        r = r + w.resid_r_shift[i, t]
        if config.fit_history:
            r_new = written(resid[i], k_r, r, w.resid_gamma[i, t], decay, config.rule)
        else:
            r_new = torch.outer(r, k_r)
        if config.output_gates:
            base_read, resid_read = s_prev @ decay @ q, x.gamma[i, t] * (r_new @ q)
        else:
            base_read, resid_read = s_prev @ q, r_new @ q
        outs.append((SCALE * (base_read + resid_read), SCALE * base_read, r, s_new, r_new))
    stacked = [None if parts[0] is None else torch.stack(parts) for parts in zip(*outs)]
    return tuple(stacked)


# a decay per key channel is only defined for the additive rule
DECAYS = [(config, False) for config in CONFIGS] + [(config, True) for config in CONFIGS if config.rule == "additive"]


@pytest.mark.parametrize(("config", "per_key_decay"), DECAYS,
                         ids=[f"{config_id(c)}-{'key' if per_key else 'head'}-decay" for c, per_key in DECAYS])
def test_edited_step_follows_the_equations_with_every_override(config, per_key_decay):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    x = random_inputs(config, per_key_decay, gen)
    w = random_overrides(x, gen)
    base = torch.randn(N, V, K, generator=gen, dtype=torch.float64)
    resid = torch.randn(N, V, K, generator=gen, dtype=torch.float64) if config.residual else None
    for t in range(T):  # the states carried from token to token, as replay does at adjacent special tokens
        got = edited_step(x, w, t, base, resid, config, SCALE)
        want = expected_step(x, w, t, base, resid, config)
        for name, a, b in zip(("o", "base_read", "r", "base", "resid"), got, want):
            if b is None:
                assert a is None, name
                continue
            assert (a - b).abs().max() <= 1e-12, f"{name} at t={t} (seed {seed}): {(a - b).abs().max():.3g}"
        base, resid = got[3], got[4]


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_unedited_step_is_the_spec(config):
    """Without overrides the lab's step and the parts step are ``memory_step`` bit for bit."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = random_inputs(config, False, gen)
    base = torch.randn(N, V, K, generator=gen, dtype=torch.float64)
    resid = torch.randn(N, V, K, generator=gen, dtype=torch.float64) if config.residual else None
    t = 2
    token = x.map(lambda y: y[:, t].unsqueeze(1))
    states = base.unsqueeze(1), None if resid is None else resid.unsqueeze(1)
    o, new_base, new_resid = memory_step(token, *states, config, SCALE)
    parts = memory_step_parts(token, *states, config, SCALE)
    lab = edited_step(x, WriteOverrides.none(x), t, base, resid, config, SCALE)
    assert torch.equal(parts.o, o) and torch.equal(parts.base_state, new_base)
    assert torch.equal(lab[0], o[:, 0]) and torch.equal(lab[3], new_base[:, 0])
    if config.residual:
        assert torch.equal(parts.residual_state, new_resid) and torch.equal(lab[4], new_resid[:, 0])
        assert torch.equal(lab[2], parts.residual_target[:, 0])
    else:
        assert new_resid is None and parts.residual_state is None and lab[4] is None
    assert torch.equal(lab[1], SCALE * parts.base_read[:, 0])


def test_edited_step_gradients():
    """Gradients reach the inputs, the states and the override tensors (a float64 gradcheck)."""
    config = MemoryConfig(rule="delta", residual=True, residual_target="tanh", clip=0.8)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = random_inputs(config, False, gen)
    w = random_overrides(x, gen)
    base = torch.randn(N, V, K, generator=gen, dtype=torch.float64)
    resid = torch.randn(N, V, K, generator=gen, dtype=torch.float64)
    leaves = (x.q, x.k, x.v, x.beta, x.gamma, w.base_k, w.base_v, w.resid_k, w.resid_gamma, w.resid_r_shift, base,
              resid)

    def outputs(q, k, v, beta, gamma, base_k, base_v, resid_k, resid_gamma, shift, s0, r0):
        inputs = HeadInputs(q, k, v, x.g, beta, gamma)
        over = WriteOverrides(base_k, base_v, w.base_beta, resid_k, resid_gamma, w.resid_r, w.resid_r_set, shift)
        o, base_read, r, s, rr = edited_step(inputs, over, 1, s0, r0, config, SCALE)
        return o, base_read, r, s, rr

    assert torch.autograd.gradcheck(outputs, tuple(t.clone().requires_grad_() for t in leaves))
