"""The kernel benchmark's inputs and its correctness checks: random inputs, one run of the op, and linmem's Triton
backend judged against float64 (``run_check``) or against itself on one sequence of a long batch (``offsets_check``),
with the tolerances the checks allow."""

from __future__ import annotations

import math
import os

import torch

TOLERANCE = {torch.float32: 3e-3, torch.bfloat16: 1e-2}  # relative, on whole tensors (tf32 / bf16 dots)
# With the clip target, a prediction error err = v − S_{t−1}k within rounding distance of ±clip lands on the other
# side of it in the kernels and flips ρ' between 0 and 1 for that element, so dv there (= β∘dx + d_err, d_err = ρ'·…)
# differs from float64 by the whole term, with no fault: rounding only q, k, v to tf32 in an exact float64 run moves
# the whole dv by ~6e-3 (`python -m linmem.bench.clip_sensitivity`; 3e-4 with tanh, whose ρ' is continuous), and
# on an H100 float32 cases measured dv 1.4e-2 to 1.7e-2 against 3e-3 or less for their other outputs. So the check
# compares dv without the elements whose float64 err lies within FLIP_BAND of ±clip: the same rounding moves float64's
# err by at most 1.9e-3 at the main check shape (B 2, T 300, H 3, K = V = 128, 4 draws), the band is five times
# that, about 1% of the elements; bf16 inputs are 8x coarser.
FLIP_BAND = {torch.float32: 1e-2, torch.bfloat16: 8e-2}
# The flips reach the other elements of dv, and dk, dg and dβ, through the base memory's backward, at up to a
# quarter of the flipped elements' change (16 trials of the tf32 rounding: dk 1.5e-3, dg 1.2e-3, dβ 1.9e-3 against dv
# 8.1e-3; tanh 3-4e-4 for all; float32 dβ and dg 3.0e-3 to 4.4e-3 seen on a GPU). The base memory's initial state's
# dS0 moves by the same path, but only where a flip falls while that state still counts, early in a sequence: 2e-4 to
# 4.9e-3 over ten single trials (tanh 2e-4), float32 dS0 3.4e-3 and 4.2e-3 on a GPU. So clip cases allow those five
# the plain tolerance plus CLIP_SPREAD; dq, dγ, the residual memory's dR0 (its chain takes ρ's value, never its slope)
# and the final states keep the plain one. The tanh cases check the same paths at the plain tolerance.
CLIP_SPREAD = {torch.float32: 5e-3, torch.bfloat16: 1e-2}
CLIP_COUPLED = ("dv", "dk", "dg", "dbeta", "dS0")
CLIP_COUPLED_TOLERANCE = {dtype: TOLERANCE[dtype] + CLIP_SPREAD[dtype] for dtype in TOLERANCE}


def _clipped(case: dict) -> bool:
    return case["residual"] and case.get("options", {}).get("residual_target", "clip") == "clip"


def _tolerance(case: dict, dtype: torch.dtype, name: str) -> float:
    if _clipped(case) and name in CLIP_COUPLED:
        return CLIP_COUPLED_TOLERANCE[dtype]
    return TOLERANCE[dtype]


def base_errors(inputs: dict, rule: str, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """The base memory's prediction errors ``err_t = v_t − S_{t−1}k_t`` ``[B, T, H, V]`` in float64, by the token
    loop of ``linmem.ops.step`` from the initial states ``S0`` (``[B, H, V, K]``, or one per packed sequence of
    ``cu_seqlens`` with B = 1, each sequence starting from its own)."""
    from linmem.ops.step import read, write

    x = {name: t.double() for name, t in inputs.items()}
    starts = {0: 0}
    if cu_seqlens:
        starts = {cu_seqlens[i]: i for i in range(len(cu_seqlens) - 1) if cu_seqlens[i + 1] > cu_seqlens[i]}
    out = torch.empty_like(x["v"])
    state = None
    for t in range(x["v"].shape[1]):
        if t in starts:
            state = x["S0"] if not cu_seqlens else x["S0"][starts[t]].unsqueeze(0)
        k_t, v_t = x["k"][:, t], x["v"][:, t]
        out[:, t] = v_t - read(state, k_t)
        state = write(state, k_t, v_t, x["beta"][:, t], x["g"][:, t], rule)
    return out


def clip_dv_error(got: torch.Tensor, want: torch.Tensor, err: torch.Tensor, clip: float, band: float) -> dict:
    """dv's relative error without the elements whose float64 prediction error ``err`` (the shape of dv) lies within
    ``band`` of ±``clip`` (``dv``), over all of them (``dv_all``), and the share left out (``flip_band``)."""
    near = ((err.abs() - clip).abs() < band).to(got.device)
    return dict(dv=_rel(got[~near], want[~near]), dv_all=_rel(got, want), flip_band=near.double().mean().item())

# ------------------------------------------------------------------------------------------------ inputs and runs


def random_inputs(B, T, H, K, V, dtype, device, seed, decay="random"):
    """q, k (L2-normalised), v in ``dtype``; g ≤ 0 (``[B, T, H]``, or ``[B, T, H, K]`` with ``decay="per_key"``),
    β, γ ∈ [0, 1] and initial states in float32."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    g = -torch.rand(B, T, H, generator=gen) * 0.3
    if decay == "extreme":  # α = 1 exactly and α ≈ 0 (e^-30), mixed
        g = torch.where(torch.rand(B, T, H, generator=gen) < 0.3, torch.full_like(g, -30.0), torch.zeros_like(g))
    if decay == "per_key":  # GLA: a log decay per key channel, a few channels reset (g = -inf)
        g = -torch.rand(B, T, H, K, generator=gen) * 0.3
        g = torch.where(torch.rand(B, T, H, K, generator=gen) < 0.01, torch.full_like(g, -torch.inf), g)
    tensors = dict(q=rand(B, T, H, K), k=torch.nn.functional.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
                   g=g, beta=torch.rand(B, T, H, generator=gen), gamma=torch.rand(B, T, H, generator=gen),
                   S0=0.3 * rand(B, H, V, K), R0=0.3 * rand(B, H, V, K))
    for name in ("q", "k", "v"):
        tensors[name] = tensors[name].to(dtype)
    return {name: t.to(device) for name, t in tensors.items()}


def grad_leaves(x):
    """``x``'s tensors as fresh autograd leaves, the floating-point ones requiring gradients."""
    return {n: t.detach().requires_grad_(t.is_floating_point()) for n, t in x.items()}


def linmem_run(inputs, rule, residual, backend, dtype=None, cu_seqlens=None, grads=True, seed=0, **options):
    """One forward (+ backward of a fixed random projection of o and the final states); returns o, states, grads."""
    from linmem.ops import linear_memory

    leaves = {}
    for name, t in inputs.items():
        t = t.to(dtype) if dtype is not None else t
        leaves[name] = t.detach().requires_grad_(grads)
    init = (leaves["S0"], leaves["R0"]) if residual else leaves["S0"]
    o, final = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                             leaves["gamma"] if residual else None, rule=rule, residual=residual, initial_state=init,
                             output_final_state=True, cu_seqlens=cu_seqlens, backend=backend, **options)
    finals = final if residual else (final,)
    if not grads:
        return o, finals, {}
    gen = torch.Generator(device="cpu").manual_seed(seed + 99)
    loss = 0.0
    for t in (o, *finals):
        weights = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)
        loss = loss + (t.double() * weights).sum()
    loss.backward()
    used = [n for n in leaves if residual or n not in ("gamma", "R0")]
    return o, finals, {n: leaves[n].grad for n in used}


# ------------------------------------------------------------------------------------------------ correctness


def check_cases(quick: bool, device: str, key_dim: int, value_dim: int) -> list[dict]:
    """Every rule × residual × dtype at head dim 128, plus head dims 64 and 256, packed sequences, the ablation
    switches and extreme decays, and RDN and GDN at the timed widths ``key_dim`` × ``value_dim``; T is never a
    multiple of the chunk size (64). On ``device`` "cpu" (a dry run in the interpreter), a few of them, tiny."""
    cases = []
    for dtype in ("float32", "bfloat16"):
        for rule in ("additive", "delta"):
            for residual in (True, False):
                cases.append(dict(rule=rule, residual=residual, dtype=dtype, B=2, T=300, H=3, K=128, V=128))
    cases += [
        dict(rule="delta", residual=True, dtype="bfloat16", B=1, T=200, H=2, K=64, V=64),
        dict(rule="delta", residual=True, dtype="bfloat16", B=1, T=200, H=2, K=256, V=256),
        dict(rule="additive", residual=True, dtype="float32", B=1, T=200, H=2, K=256, V=256),
        dict(rule="delta", residual=True, dtype="float32", B=1, T=1500, H=2, K=128, V=128, oracle="chunk"),
        dict(rule="delta", residual=True, dtype="bfloat16", B=1, T=400, H=2, K=128, V=128,
             cu_seqlens=[0, 37, 37, 230, 231, 400]),
        dict(rule="additive", residual=True, dtype="float32", B=1, T=400, H=2, K=128, V=128,
             cu_seqlens=[0, 100, 164, 400]),
        dict(rule="delta", residual=True, dtype="float32", B=1, T=150, H=2, K=128, V=128,
             options=dict(output_gates=False, residual_target="tanh")),
        dict(rule="additive", residual=True, dtype="float32", B=1, T=150, H=2, K=128, V=128,
             options=dict(residual_target="identity", clip=0.5)),
        dict(rule="delta", residual=True, dtype="float32", B=1, T=150, H=2, K=128, V=128, decay="extreme"),
        dict(rule="delta", residual=True, dtype="bfloat16", B=2, T=300, H=3, K=128, V=128,
             options=dict(residual_target="tanh")),  # bf16 without clip's discontinuity
        # GLA's memory (per_key_decay.py): the zoo's head (K = 32, V = 64), FLA's (128) and packed sequences
        dict(rule="additive", residual=False, dtype="bfloat16", B=2, T=300, H=4, K=32, V=64, decay="per_key"),
        dict(rule="additive", residual=False, dtype="float32", B=2, T=300, H=3, K=128, V=128, decay="per_key"),
        dict(rule="additive", residual=False, dtype="float32", B=1, T=400, H=2, K=32, V=64, decay="per_key",
             cu_seqlens=[0, 37, 37, 230, 231, 400]),
    ]
    if quick:  # every rule × residual × dtype, packed sequences, head dims 64/256, the switches, extreme decays, GLA
        # at both of its launches (per_key_decay.tiling)
        cases = cases[:8] + [cases[8], cases[9], cases[12], cases[14], cases[16], cases[18], cases[19], cases[20]]
    if device == "cpu":  # dry run in the interpreter: the same code paths at a few tiny shapes
        return [dict(c, T=min(c["T"], 100), K=32, V=32, cu_seqlens=c.get("cu_seqlens") and [0, 30, 30, 100])
                for c in cases[::4]]
    if (key_dim, value_dim) != (128, 128):  # the widths timed (and swept)
        cases += [dict(rule=rule, residual=residual, dtype="bfloat16", B=2, T=300, H=3, K=key_dim, V=value_dim)
                  for rule, residual in (("delta", True), ("delta", False))]
    return cases


def run_check(case: dict, device: str) -> dict:
    """linmem's Triton backend against float64 on one case, its inputs on ``device``: relative errors (Frobenius) of
    every output."""
    from linmem.ops.triton import layout

    layout.POISON_BUFFERS = True
    dtype = getattr(torch, case["dtype"])
    seed = case.get("seed", int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run unless a case fixes one
    inputs = random_inputs(case["B"], case["T"], case["H"], case["K"], case["V"], dtype, device, seed,
                           case.get("decay", "random"))
    bounds = case.get("cu_seqlens")
    cu = torch.tensor(bounds, dtype=torch.int32, device=device) if bounds else None
    if bounds:
        for name in ("S0", "R0"):
            inputs[name] = 0.3 * torch.randn(len(bounds) - 1, *inputs[name].shape[1:], device=device)
    options = case.get("options", {})
    exact = {n: t.double() for n, t in inputs.items()}
    oracle = case.get("oracle", "reference")
    ref = linmem_run(exact, case["rule"], case["residual"], oracle, cu_seqlens=cu, seed=seed, **options)
    got = linmem_run(inputs, case["rule"], case["residual"], "triton", cu_seqlens=cu, seed=seed, **options)
    errors = {"o": _rel(got[0], ref[0])}
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        errors[("S_T", "R_T")[i]] = _rel(a, b)
    for name, want in ref[2].items():
        errors["d" + name] = _rel(got[2].get(name), want)
    band = {}
    if _clipped(case) and got[2].get("v") is not None:  # dv away from ρ's kinks, dv_all over every element
        found = clip_dv_error(got[2]["v"], ref[2]["v"], base_errors(exact, case["rule"], bounds),
                              options.get("clip", 1.0), FLIP_BAND[dtype])
        errors["dv"] = found.pop("dv")
        band = found
    worst = max(errors.values())
    passed = all(err < _tolerance(case, dtype, name) for name, err in errors.items())
    return dict(case=case_name(case), errors=errors, worst=worst, passed=bool(passed), **band)


def offsets_check(device: str, batch: int = 5, length: int = 122880, heads: int = 16, dim: int = 128) -> dict:
    """RDN (bf16) forward+backward on ``device``, on ``batch`` sequences of ``length`` tokens, enough that the
    per-chunk state tensors hold more than 2^31 elements (the default 614K tokens: 2.5e9): the last sequence's output,
    final states and input gradients must equal those of the same sequence run alone. A 32-bit offset overflow
    anywhere shows here."""
    from linmem.ops import linear_memory
    from linmem.ops.triton import function

    row = function.kernel_options(dim, dim)
    for name in ("forward", "backward_states"):  # the same kernels for the batch and the sequence alone
        row[name] = dict(row[name], BV=16)
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(4), "little"))

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    x = dict(q=rand(batch, length, heads, dim, dtype=torch.bfloat16),
             k=torch.nn.functional.normalize(rand(batch, length, heads, dim), dim=-1).bfloat16(),
             v=rand(batch, length, heads, dim, dtype=torch.bfloat16),
             g=-0.1 * rand(batch, length, heads).abs(), beta=rand(batch, length, heads).sigmoid(),
             gamma=rand(batch, length, heads).sigmoid(), S0=0.3 * rand(batch, heads, dim, dim),
             R0=0.3 * rand(batch, heads, dim, dim))
    d_o = rand(batch, length, heads, dim, dtype=torch.bfloat16)

    def run(part):
        leaves = {n: t[part].detach().requires_grad_(True) for n, t in x.items()}
        o, (s, r) = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                  leaves["gamma"], rule="delta", residual=True, output_final_state=True,
                                  initial_state=(leaves["S0"], leaves["R0"]), backend="triton")
        o.backward(d_o[part])
        last = slice(-1, None)
        return dict(o=o[last].detach(), S_T=s[last].detach(), R_T=r[last].detach(),
                    **{"d" + n: t.grad[last] for n, t in leaves.items()})

    every = run(slice(None))
    alone = run(slice(batch - 1, batch))
    errors = {name: _rel(every[name], alone[name]) for name in every}
    worst = max(errors.values())
    name = (f"RDN bfloat16 B={batch} T={length} H={heads} K=V={dim}: last sequence equals it run alone "
            f"(per-chunk states of {batch * -(-length // 64) * heads * dim * dim / 1e9:.1f}e9 elements)")
    return dict(case=name, errors=errors, worst=worst, passed=bool(worst < 1e-6))


def _rel(got, want) -> float:
    if got is None:
        return math.inf
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def case_name(case: dict) -> str:
    """A check case as one line: the memory, dtype and shape, and what else it sets."""
    memory = {("additive", True): "RLA", ("delta", True): "RDN", ("additive", False): "sGLA",
              ("delta", False): "GDN"}[(case["rule"], case["residual"])]
    if case.get("decay") == "per_key":
        memory = "GLA"
    extra = [f"{k}={v}" for k, v in case.get("options", {}).items()]
    if case.get("cu_seqlens"):
        extra.append("varlen")
    if case.get("decay") not in (None, "per_key"):
        extra.append(f"decay={case['decay']}")
    if case.get("oracle"):
        extra.append(f"oracle={case['oracle']}")
    return (f"{memory} {case['dtype']} B={case['B']} T={case['T']} H={case['H']} K={case['K']} V={case['V']} "
            + " ".join(extra)).strip()
