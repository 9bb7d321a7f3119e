"""The Triton backend against the float64 reference: outputs, final states and every gradient.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here before the
kernels are imported) at tiny shapes; with CUDA they run compiled, with tolerances for tf32/bf16 dots. Every kernel
output buffer is filled with NaN first (``layout.POISON_BUFFERS``), so an element no kernel writes cannot hide.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    # kernels decorated before the variable was set would be compiled ones: import them again
    for name in [m for m in sys.modules if m.startswith("linmem.ops.triton")]:
        del sys.modules[name]

triton = pytest.importorskip("triton")

from linmem.ops import linear_memory  # noqa: E402
from linmem.ops.triton import layout  # noqa: E402
from tests.test_bench_kernels import report_page, report_summary  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TOL = 3e-3 if ON_GPU else 1e-5  # tf32 dots on a GPU; float32 arithmetic in the interpreter
NAMES = ("q", "k", "v", "g", "beta", "gamma", "S0", "R0")


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    monkeypatch.setattr(layout, "POISON_BUFFERS", True)


def make_inputs(B, T, H, K, V, seed, g_scale=0.2):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * g_scale
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    gamma = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return dict(q=rand(B, T, H, K), k=k, v=rand(B, T, H, V), g=g, beta=beta, gamma=gamma,
                S0=0.3 * rand(B, H, V, K), R0=0.3 * rand(B, H, V, K))


def run(backend, inputs, dtype, residual, **options):
    """Forward and backward of a fixed random projection of the output and the final states."""
    leaves = {}
    for name, t in inputs.items():
        cast = t.to(dtype) if name in ("q", "k", "v") else (t if backend == "reference" else t.float())
        leaves[name] = cast.to(DEVICE).detach().requires_grad_(True)
    init = (leaves["S0"], leaves["R0"]) if residual else leaves["S0"]
    o, final = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                             leaves["gamma"] if residual else None, residual=residual, initial_state=init,
                             output_final_state=True, backend=backend, **options)
    finals = final if residual else (final,)
    gen = torch.Generator().manual_seed(1234)
    loss = 0.0
    for t in (o, *finals):
        loss = loss + (t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
    loss.backward()
    grads = {name: t.grad for name, t in leaves.items() if t.grad is not None}
    return o, finals, grads


def assert_bit_identical(got, want):
    """Two ``run`` results (output, final states, gradients) equal bit for bit."""
    assert torch.equal(got[0], want[0])
    for got_final, want_final in zip(got[1], want[1], strict=True):
        assert torch.equal(got_final, want_final)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name


def assert_close(name, got, want, tol):
    assert got is not None, f"{name}: no gradient"
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all(), f"{name}: NaN/Inf (an unwritten element or an overflow)"
    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


def compare(inputs, residual, dtype=torch.float32, tol=TOL, backend="triton", **options):
    reference_inputs = {n: t.to(dtype).double() if n in ("q", "k", "v") else t for n, t in inputs.items()}
    o_ref, finals_ref, grads_ref = run("reference", reference_inputs, torch.float64, residual, **options)
    o, finals, grads = run(backend, inputs, dtype, residual, **options)
    assert o.dtype == dtype
    assert_close("o", o, o_ref, tol)
    for i, (got, want) in enumerate(zip(finals, finals_ref)):
        assert_close(f"final state {i}", got, want, tol)
    for name in grads_ref:
        if name == "R0" and not residual:
            continue
        assert_close(f"d{name}", grads.get(name), grads_ref[name], tol)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("residual", [True, False])
def test_matches_reference(rule, residual):
    """Two chunks, the second partial (T = 100 with chunks of 64), two sequences, two heads."""
    compare(make_inputs(2, 100, 2, 32, 16, seed=0), residual, rule=rule)


@pytest.mark.parametrize("rule, options", [
    ("delta", dict(output_gates=False)),
    ("additive", dict(output_gates=False, residual_target="tanh", clip=0.5)),
    ("delta", dict(residual_target="identity", scale=0.7)),
    ("delta", dict(residual_target="tanh", clip=2.0)),
    ("additive", dict(residual_target="clip", clip=0.2)),
])
def test_switches(rule, options):
    compare(make_inputs(1, 70, 2, 32, 16, seed=1), True, rule=rule, **options)


@pytest.mark.parametrize("rule, options", [
    ("additive", {}),
    ("delta", {}),
    ("delta", dict(output_gates=False, residual_target="tanh", clip=0.5)),
    ("additive", dict(residual_target="identity", scale=0.7)),
])
def test_without_history_fitting(rule, options):
    """fit_history=False on the kernels (the residual memory holding only the step's correction) against the float64
    reference: the output, both final states (the residual one the last token's correction) and every gradient,
    the initial residual state's absent (it never reaches the output)."""
    compare(make_inputs(1, 100, 2, 32, 16, seed=11), True, rule=rule, fit_history=False, **options)


@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_without_history_fitting_packed_and_in_half_precision(rule):
    """fit_history=False over packed sequences (an empty one keeps its initial residual state) and with bf16 q, k,
    v, whose output and gradients come back rounded to bf16."""
    inputs = make_inputs(1, 180, 2, 32, 16, seed=12)
    for name in ("S0", "R0"):
        inputs[name] = 0.3 * torch.randn(5, 2, 16, 32, generator=torch.Generator().manual_seed(13),
                                         dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 20, 20, 150, 151, 180], dtype=torch.int32, device=DEVICE)
    compare(inputs, True, rule=rule, cu_seqlens=cu_seqlens, fit_history=False)
    compare(make_inputs(1, 70, 2, 32, 16, seed=14), True, dtype=torch.bfloat16, tol=2e-2, rule=rule,
            fit_history=False)


def test_without_history_fitting_runs_no_residual_pass(monkeypatch):
    """Without history fitting the residual memory has no sequential pass: one forward state pass (and its rerun in
    the backward) and one reverse pass, the base memory's, against two of each with fitting."""
    from linmem.ops.triton import function

    row = function.kernel_options(32, 16)
    monkeypatch.setitem(row, "forward", dict(row["forward"], FUSED=False))
    monkeypatch.setitem(row, "recompute_states", True)
    counts = {}
    for fit_history in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            passes = {name: _Counted(getattr(function, name)) for name in ("state_pass_kernel", "reverse_pass_kernel")}
            for name, counted in passes.items():
                patch.setattr(function, name, counted)
            run("triton", make_inputs(1, 70, 1, 32, 16, seed=16), torch.float32, True, rule="delta",
                fit_history=fit_history)
        counts[fit_history] = {name: len(counted.grids) for name, counted in passes.items()}
    assert counts == {True: {"state_pass_kernel": 4, "reverse_pass_kernel": 2},
                      False: {"state_pass_kernel": 2, "reverse_pass_kernel": 1}}


def test_without_history_fitting_runs_on_the_kernels():
    """The kernels take fit_history=False: ``auto`` sends it to them on CUDA, not to the chunk path."""
    from linmem.ops.backend import MemoryInputs
    from linmem.ops.config import MemoryConfig
    from linmem.ops.triton import TRITON

    x = {n: t.float().to(DEVICE) for n, t in make_inputs(1, 40, 1, 16, 16, seed=15).items()}
    inputs = MemoryInputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"])
    for rule in ("additive", "delta"):
        assert TRITON.unsupported(inputs, MemoryConfig(rule=rule, residual=True, fit_history=False)) is None


class _Counted:
    """Stands in for a kernel, launching it and recording the grid of every launch."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _resolved(name, dtype, width=128, sequences=256):
    """A kernel's (block sizes, launch options) at key and value width ``width`` over ``sequences`` N·H."""
    from linmem.ops.triton import function

    return function._options(name, value_dim=width, key_dim=width, dtype=dtype, sequences=sequences)


class _Recorded(_Counted):
    """Stands in for a kernel, launching it and recording the arguments of every launch."""

    def __init__(self, kernel):
        super().__init__(kernel)
        self.calls = []

    def __getitem__(self, grid):
        launch = super().__getitem__(grid)

        def recorded(*args, **kwargs):
            self.calls.append((args, kwargs))
            return launch(*args, **kwargs)

        return recorded


def _record_launches(monkeypatch, *names: str) -> tuple[_Recorded, ...]:
    """The op's kernels of these names (in linmem.ops.triton.function) replaced, for this test, by ``_Recorded``
    stand-ins, returned in the same order."""
    from linmem.ops.triton import function

    recorders = tuple(_Recorded(getattr(function, name)) for name in names)
    for name, recorder in zip(names, recorders):
        monkeypatch.setattr(function, name, recorder)
    return recorders


@pytest.mark.parametrize("memory", ["RDN", "GDN", "RLA", "GLA"])
def test_kernels_are_launched_by_keyword_with_none_for_absent_tensors(memory, monkeypatch):
    """Every kernel launch of a forward and backward passes its arguments by keyword, and a tensor the call does not
    have as None (the kernels' ``triton.heuristics`` flags follow from it), never another tensor standing in; with no
    gradient reaching the final states and initial states that need none, the reverse passes start from zero and
    store no initial-state gradient, against float64."""
    from linmem.ops.triton import function, inverse, per_key_decay, scores

    recorded = {}
    for module in (function, scores, inverse, per_key_decay):
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            recorded[module.__name__, name] = _Recorded(getattr(module, name))
            monkeypatch.setattr(module, name, recorded[module.__name__, name])
    rule, residual = {"RDN": ("delta", True), "GDN": ("delta", False), "RLA": ("additive", True),
                      "GLA": ("additive", False)}[memory]
    inputs = (per_key_inputs if memory == "GLA" else make_inputs)(1, 70, 2, 16, 8, seed=20)
    got, want = ({name: t.to(DEVICE) if backend == "triton" else t for name, t in inputs.items()}
                 for backend in ("triton", "reference"))
    for leaves in (got, want):
        for name in ("q", "k", "v", "g", "beta", "gamma"):
            leaves[name] = (leaves[name].float() if leaves is got else leaves[name]).requires_grad_(True)
        o, _ = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                             leaves["gamma"] if residual else None, rule=rule, residual=residual,
                             initial_state=(leaves["S0"], leaves["R0"]) if residual else leaves["S0"],
                             backend="triton" if leaves is got else "reference")
        (o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape).to(o.device)).sum(
            ).backward()
    for name in ("q", "k", "v", "g", "beta") + (("gamma",) if residual else ()):
        assert_close(f"d{name}", got[name].grad, want[name].grad, TOL)

    launches = [(key, args, kwargs) for key, r in recorded.items() for args, kwargs in r.calls]
    assert len({key for key, _, _ in launches}) == (4 if memory == "GLA" else 8 if rule == "delta" else 7)
    for key, args, kwargs in launches:
        assert args == (), f"{key}: {len(args)} positional arguments"
        by_tensor = {}
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                by_tensor.setdefault(id(value), []).append(name)
        shared = [sorted(names) for names in by_tensor.values() if len(names) > 1]
        # the residual memory's reverse pass reads γ as its write strength and as its read gate
        assert shared in ([], [["gamma", "strength"]]), f"{key}: one tensor passed for {shared}"
    if memory != "GLA":
        for _, _, kwargs in [c for c in launches if c[0][1] == "reverse_pass_kernel"]:
            assert kwargs["d_final"] is None and kwargs["d_initial"] is None
        absent = [name for c in launches for name, value in c[2].items() if value is None]
        assert ("gamma" in absent) == (not residual)


def _recompute_in_every_row(monkeypatch, choice) -> None:
    """``recompute_states`` = ``choice`` in every row of the op's launch options, for this test."""
    from linmem.ops.triton import function

    for row in function.KERNEL_OPTIONS.values():
        monkeypatch.setitem(row, "recompute_states", choice)


def _options_in_every_row(monkeypatch, kernel: str, **options) -> None:
    """``kernel``'s launch options updated with ``options`` in every row of the op's launch options, for this test."""
    from linmem.ops.triton import function

    for row in function.KERNEL_OPTIONS.values():
        monkeypatch.setitem(row, kernel, dict(row[kernel], **options))


def _autograd_node(t, name):
    """The node of the graph behind ``t`` whose class is ``name`` (a custom Function's node is its ctx)."""
    stack, seen = [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            return node
        stack.extend(next_node for next_node, _ in node.next_functions)
    raise AssertionError(f"no {name} behind the tensor")


@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("residual", [True, False])
def test_recomputed_states_are_bit_identical(rule, residual, monkeypatch):
    """recompute_states: the forward keeps none of its state passes' results (per-chunk states, writes, error),
    the backward runs those passes again (one more launch per memory), and the output, final states and every
    gradient are bit for bit those of the run that keeps them."""
    from linmem.ops.triton import function

    inputs = make_inputs(2, 70, 2, 32, 16, seed=19)
    launches = _Counted(function.state_pass_kernel)
    monkeypatch.setattr(function, "state_pass_kernel", launches)
    _recompute_in_every_row(monkeypatch, False)
    kept = run("triton", inputs, torch.float32, residual, rule=rule)
    passes = len(launches.grids)
    assert passes == (2 if residual else 1)
    _recompute_in_every_row(monkeypatch, True)
    recomputed = run("triton", inputs, torch.float32, residual, rule=rule)
    assert len(launches.grids) == 3 * passes  # the forward's passes, then again in the backward
    assert_bit_identical(recomputed, kept)

    leaves = {n: t.float().requires_grad_(True) for n, t in inputs.items()}
    o, _ = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         leaves["gamma"] if residual else None, residual=residual, rule=rule, backend="triton")
    saved = function.saved_for_backward(_autograd_node(o, "LinearMemoryFunctionBackward"))
    assert all(saved[name] is None for name in function.RECOMPUTED)
    _recompute_in_every_row(monkeypatch, False)
    o, _ = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         leaves["gamma"] if residual else None, residual=residual, rule=rule, backend="triton")
    saved = function.saved_for_backward(_autograd_node(o, "LinearMemoryFunctionBackward"))
    flags = function._Flags(function.MemoryConfig(rule=rule, residual=residual), torch.float32)
    shapes = function.state_pass_outputs(140, 4, 2, 2, 32, 16, flags, "meta")
    assert function.recomputed_bytes(saved) == function.recomputed_bytes(shapes) > 0
    assert function.recomputed_bytes(shapes) == 4 * (4 * 2 * 32 * 16 * (1 + residual)
                                                     + 140 * 2 * 16 * ((rule == "delta") + 2 * residual))


@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("residual", [True, False])
def test_recomputing_the_base_pass_only_keeps_the_residual_memorys_results(rule, residual, monkeypatch):
    """recompute_states "base": the forward keeps a residual memory's per-chunk states and writes w, the backward
    runs the base memory's pass alone again (its error err too), and every output and gradient is bit for bit that
    of the run that keeps everything; without a residual memory it is recompute_states True."""
    from linmem.ops.triton import function

    inputs = make_inputs(2, 70, 2, 32, 16, seed=23)
    launches = _Counted(function.state_pass_kernel)
    monkeypatch.setattr(function, "state_pass_kernel", launches)
    results = {}
    for recompute in (False, "base"):
        _recompute_in_every_row(monkeypatch, recompute)
        before = len(launches.grids)
        results[recompute] = run("triton", inputs, torch.float32, residual, rule=rule)
        passes = len(launches.grids) - before
        assert passes == (1 + residual if recompute is False else 1 + residual + 1)  # the base pass again
    assert_bit_identical(results["base"], results[False])

    leaves = {n: t.float().requires_grad_(True) for n, t in inputs.items()}
    o, _ = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         leaves["gamma"] if residual else None, residual=residual, rule=rule, backend="triton")
    saved = function.saved_for_backward(_autograd_node(o, "LinearMemoryFunctionBackward"))
    assert all(saved[name] is None for name in ("base_chunks", "u", "err"))
    assert all((saved[name] is not None) == residual for name in ("res_chunks", "w"))
    flags = function._Flags(function.MemoryConfig(rule=rule, residual=residual), torch.float32)
    shapes = function.state_pass_outputs(140, 4, 2, 2, 32, 16, flags, "meta")
    kept_bytes = 4 * (4 * 2 * 32 * 16 + 140 * 2 * 16) if residual else 0  # res_chunks and w, float32 inputs
    assert function.recomputed_bytes(shapes, "base") == function.recomputed_bytes(shapes, True) - kept_bytes
    with pytest.raises(ValueError, match="recompute_states must be one of"):
        function.recomputed_names("residual")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("residual", [True, False])
def test_recomputing_from_the_kept_writes_gives_the_same_bits(rule, residual, dtype, monkeypatch):
    """recompute_states "writes": the forward keeps each memory's writes (u with the delta rule, w with a residual
    memory) and drops the per-chunk states and the error; the backward runs every pass again from those writes
    (FROM_WRITES: the writes read, not formed or stored), and the output, final states and every gradient are bit for
    bit those of the run that keeps everything, in bfloat16 too, where the writes are rounded to their storage type
    before the forward's passes update their states with them."""
    from linmem.ops.triton import function

    inputs = make_inputs(2, 70, 2, 32, 16, seed=int(torch.randint(0, 2**16, ())))
    passes = _Recorded(function.state_pass_kernel)
    monkeypatch.setattr(function, "state_pass_kernel", passes)
    results = {}
    for recompute in (False, "writes"):
        _recompute_in_every_row(monkeypatch, recompute)
        passes.calls.clear()
        results[recompute] = run("triton", inputs, dtype, residual, rule=rule)
        launched = [kwargs for _, kwargs in passes.calls]
        from_writes = [kwargs["writes_in"] is not None for kwargs in launched]
        if recompute is False:
            assert from_writes == [False] * (1 + residual)
        else:  # the forward's passes, then the backward's: from the writes wherever a memory stores them
            assert from_writes == [False] * (1 + residual) + [rule == "delta"] + [True] * residual
            assert all(kwargs["writes_out"] is None for kwargs in launched[1 + residual:])
    assert_bit_identical(results["writes"], results[False])

    leaves = {n: t.to(dtype if n in "qkv" else torch.float32).requires_grad_(True) for n, t in inputs.items()}
    _recompute_in_every_row(monkeypatch, "writes")
    o, _ = linear_memory(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         leaves["gamma"] if residual else None, residual=residual, rule=rule, backend="triton")
    saved = function.saved_for_backward(_autograd_node(o, "LinearMemoryFunctionBackward"))
    assert all(saved[name] is None for name in ("base_chunks", "res_chunks", "err"))
    assert (saved["u"] is not None) == (rule == "delta") and (saved["w"] is not None) == residual
    flags = function._Flags(function.MemoryConfig(rule=rule, residual=residual), dtype)
    shapes = function.state_pass_outputs(140, 4, 2, 2, 32, 16, flags, "meta")
    size = shapes["base_chunks"].element_size()
    writes_bytes = size * 140 * 2 * 16 * ((rule == "delta") + residual)
    assert function.recomputed_bytes(shapes, "writes") == function.recomputed_bytes(shapes, True) - writes_bytes


@pytest.mark.parametrize("recompute", [False, "base", "writes", True])
def test_the_backward_frees_what_the_forward_kept_while_the_output_lives(recompute, monkeypatch):
    """The tensors the forward keeps are freed once the backward has run, though the output (and so its graph) is
    still referenced, as a training loop holds its last loss through the next step's forward; and reading them
    after that backward is refused."""
    import gc
    import weakref

    from linmem.ops.triton import function

    _recompute_in_every_row(monkeypatch, recompute)
    leaves = {n: t.float().requires_grad_(True) for n, t in make_inputs(1, 70, 2, 32, 16, seed=29).items()}
    o, _ = linear_memory(*(leaves[n] for n in ("q", "k", "v", "g", "beta", "gamma")), residual=True, rule="delta",
                         backend="triton")
    node = _autograd_node(o, "LinearMemoryFunctionBackward")
    kept = {name: weakref.ref(t) for name, t in function.saved_for_backward(node).items() if t is not None}
    assert {"key_scores", "inv_gamma"} <= set(kept)
    assert ("res_chunks" in kept) == (recompute in (False, "base")) and ("base_chunks" in kept) == (recompute is False)
    assert ("w" in kept) == (recompute is not True)
    o.sum().backward()
    gc.collect()
    assert o.grad_fn is not None
    assert [name for name, ref in kept.items() if ref() is not None] == []
    with pytest.raises(RuntimeError):
        function.saved_for_backward(node)


@pytest.mark.parametrize("recompute", [False, "base", True])
def test_the_op_under_non_reentrant_checkpointing_gives_the_same_gradients(recompute, monkeypatch):
    """Under non-reentrant ``torch.utils.checkpoint`` (what ``enable_gradient_checkpointing`` uses), whose hooks
    unpack each saved tensor once, the op's backward runs and gives every gradient bit for bit as without it."""
    from torch.utils.checkpoint import checkpoint

    _recompute_in_every_row(monkeypatch, recompute)
    inputs = make_inputs(1, 70, 2, 32, 16, seed=31)
    weights = torch.randn(1, 70, 2, 16, dtype=torch.float64)
    names = ("q", "k", "v", "g", "beta", "gamma")

    def gradients(checkpointed: bool) -> list[torch.Tensor]:
        leaves = [inputs[n].float().requires_grad_(True) for n in names]
        op = lambda *args: linear_memory(*args, residual=True, rule="delta", backend="triton")[0]  # noqa: E731
        o = checkpoint(op, *leaves, use_reentrant=False) if checkpointed else op(*leaves)
        (o * weights.float()).sum().backward()
        return [leaf.grad for leaf in leaves]

    plain, checkpointed = gradients(False), gradients(True)
    for name, a, b in zip(names, plain, checkpointed):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("rule, target", [("delta", "clip"), ("additive", "clip"), ("delta", "tanh")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_memories_in_one_pass_give_the_two_passes_bits(rule, target, dtype, monkeypatch):
    """The forward's FUSED: an RLA/RDN's two memories in one program per value block (one launch in the forward and
    one in the backward's recomputation, none of the single-memory pass) give the output, final states and every
    gradient of the two launches bit for bit, partial last chunks and initial states included; with recompute_states
    "base" the backward's recomputation is the base memory's pass alone, with "writes" one fused pass from the
    forward's writes."""
    from linmem.ops.triton import function

    inputs = make_inputs(2, 70, 2, 32, 16, seed=29)
    single = _Counted(function.state_pass_kernel)
    both = _Counted(function.both_state_passes_kernel)
    monkeypatch.setattr(function, "state_pass_kernel", single)
    monkeypatch.setattr(function, "both_state_passes_kernel", both)
    two = run("triton", inputs, dtype, True, rule=rule, residual_target=target)
    assert (len(single.grids), len(both.grids)) == (4, 0)  # two passes, and both again in the backward
    _options_in_every_row(monkeypatch, "forward", FUSED=True)
    one = run("triton", inputs, dtype, True, rule=rule, residual_target=target)
    assert (len(single.grids), len(both.grids)) == (4, 2)
    assert_bit_identical(one, two)
    _recompute_in_every_row(monkeypatch, "base")
    base = run("triton", inputs, dtype, True, rule=rule, residual_target=target)
    assert (len(single.grids), len(both.grids)) == (5, 3)
    assert_bit_identical(base, two)
    _recompute_in_every_row(monkeypatch, "writes")  # the backward rebuilds both states from the writes in one pass
    from_writes = run("triton", inputs, dtype, True, rule=rule, residual_target=target)
    assert (len(single.grids), len(both.grids)) == (5, 5)
    assert_bit_identical(from_writes, two)
    # without a residual memory the option changes nothing: one pass of the single-memory kernel
    run("triton", inputs, dtype, False, rule=rule)
    assert (len(single.grids), len(both.grids)) == (7, 5)


@pytest.mark.parametrize("rule, target", [("delta", "clip"), ("additive", "tanh")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipelined_passes_give_the_two_passes_bits(rule, target, dtype, monkeypatch):
    """The forward's PIPELINED: an RLA/RDN's two passes in one launch of two programs per value block, the residual
    memory's waiting for each chunk's error, give the output, final states and every gradient of the two launches bit
    for bit (three sequences, partial last chunks, initial states), in the forward and in the
    backward's recomputation, with recompute_states True and "writes"; without a residual memory the single pass
    runs. The interpreter runs the programs one after another in ticket order, so a residual program finds its
    base program's chunks all counted: what runs on a GPU with the two chains overlapped is timed by
    ``linmem.bench.kernels --sweep``."""
    from linmem.ops.triton import function

    inputs = make_inputs(3, 70, 2, 32, 16, seed=31)
    single = _Counted(function.state_pass_kernel)
    pipelined = _Counted(function.pipelined_state_passes_kernel)
    monkeypatch.setattr(function, "state_pass_kernel", single)
    monkeypatch.setattr(function, "pipelined_state_passes_kernel", pipelined)
    two = run("triton", inputs, dtype, True, rule=rule, residual_target=target)
    assert (len(single.grids), len(pipelined.grids)) == (4, 0)
    _options_in_every_row(monkeypatch, "forward", PIPELINED=True)
    one = run("triton", inputs, dtype, True, rule=rule, residual_target=target)
    assert (len(single.grids), len(pipelined.grids)) == (4, 2)
    assert all(grid[2] == 2 for grid in pipelined.grids)  # a base and a residual program per value block
    assert_bit_identical(one, two)
    _recompute_in_every_row(monkeypatch, "writes")  # both states rebuilt from the writes, in one launch again
    from_writes = run("triton", inputs, dtype, True, rule=rule, residual_target=target)
    assert (len(single.grids), len(pipelined.grids)) == (4, 4)
    assert_bit_identical(from_writes, two)
    run("triton", inputs, dtype, False, rule=rule)
    assert (len(single.grids), len(pipelined.grids)) == (6, 4)


@pytest.mark.parametrize("rule, target, gates", [("delta", "clip", False), ("additive", "clip", True),
                                                 ("delta", "tanh", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_reverse_passes_in_one_program_give_the_two_passes_bits(rule, target, gates, dtype, monkeypatch):
    """backward_states' FUSED: an RLA/RDN's two reverse passes in one program per value block, the base memory one
    chunk behind the residual one (one launch, none of the single-memory pass), give the output, final states and
    every gradient of the two launches bit for bit, partial last chunks and initial states included, with and
    without output gates; without a residual memory the option changes nothing."""
    from linmem.ops.triton import function

    inputs = make_inputs(2, 150, 2, 32, 16, seed=41)
    options = dict(rule=rule, residual_target=target, output_gates=gates)
    single = _Counted(function.reverse_pass_kernel)
    both = _Counted(function.both_reverse_passes_kernel)
    monkeypatch.setattr(function, "reverse_pass_kernel", single)
    monkeypatch.setattr(function, "both_reverse_passes_kernel", both)
    two = run("triton", inputs, dtype, True, **options)
    assert (len(single.grids), len(both.grids)) == (2, 0)
    _options_in_every_row(monkeypatch, "backward_states", FUSED=True)
    one = run("triton", inputs, dtype, True, **options)
    assert (len(single.grids), len(both.grids)) == (2, 1)
    assert_bit_identical(one, two)
    run("triton", inputs, dtype, False, rule=rule)
    assert (len(single.grids), len(both.grids)) == (3, 1)


@pytest.mark.parametrize("memory, K, packed, keys_once", [
    ("RDN", 80, True, False), ("RLA", 80, True, True), ("RDN", 200, False, True)])
def test_reverse_passes_fused_against_float64(memory, K, packed, keys_once, monkeypatch):
    """backward_states' FUSED against float64: packed sequences with initial states (an empty one, one shorter than a
    chunk, one over three chunks; two key blocks, the second partial) or two sequences of two chunks (four key
    blocks, the fourth partial), with and without KEYS_ONCE; every gradient, the initial states' included."""
    from linmem.ops.triton import function

    _options_in_every_row(monkeypatch, "backward_states", FUSED=True, KEYS_ONCE=keys_once)
    both = _Recorded(function.both_reverse_passes_kernel)
    monkeypatch.setattr(function, "both_reverse_passes_kernel", both)
    rule, residual = MEMORIES[memory]
    inputs, extra = _option_case(K, packed)
    compare(inputs, residual, rule=rule, **extra)
    assert len(both.calls) == 1 and both.calls[0][1]["KEYS_ONCE"] is keys_once


def test_sequential_pass_launch_options(monkeypatch):
    """The sequential passes' options where they say None: 4 warps (8 for float32 inputs), two stages, and the
    widest value block that keeps the multiprocessors busy."""
    from linmem.ops.triton import function

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(function, "_multiprocessors", lambda: 132)
    for name in ("forward", "backward_states"):
        # 256 sequences of 128 values keep every width busy
        # the passes' own options are off unless a row turns them on
        off = dict(KEYS_ONCE=False, FUSED=False, PREFORMED=False) | (
            dict(ONE_KEY_BLOCK=False) if name == "backward_states" else dict(PIPELINED=False))
        assert _resolved(name, torch.bfloat16) == (
            {"BV": function.SEQUENTIAL_WIDEST[name], **off}, {"num_warps": 4, "num_stages": 2})
        assert _resolved(name, torch.float32)[1]["num_warps"] == 8


def test_sequential_value_blocks(monkeypatch):
    """BV=None of a sequential pass: 64 only in the reverse pass, where N·H·V/64 programs fill half the
    multiprocessors; 32 where N·H·V/32 fill them all; else 16; always 16 for float32 or K > 128."""
    from linmem.ops.triton import function

    monkeypatch.setattr(function, "_multiprocessors", lambda: 132)
    pick = function._sequential_block
    assert pick(128, torch.bfloat16, 256, 128, widest=64) == 64  # B=16, H=16: 512 programs at 64
    assert pick(128, torch.bfloat16, 64, 128, widest=64) == 64  # B=4: 128 programs at 64
    assert pick(128, torch.bfloat16, 32, 128, widest=64) == 16  # B=2: 64 at 64, 128 at 32
    assert pick(128, torch.bfloat16, 64, 128, widest=32) == 32  # the forward pass stops at 32
    assert pick(128, torch.bfloat16, 16, 128, widest=64) == 16  # B=1
    assert pick(256, torch.bfloat16, 256, 256, widest=64) == 16
    assert pick(128, torch.float32, 256, 128, widest=64) == 16


@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_packed_sequences(rule):
    """cu_seqlens with an empty sequence, one shorter than a chunk and one spanning three chunks."""
    inputs = make_inputs(1, 180, 2, 32, 16, seed=2)
    for name in ("S0", "R0"):
        inputs[name] = 0.3 * torch.randn(5, 2, 16, 32, generator=torch.Generator().manual_seed(3),
                                         dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 20, 20, 150, 151, 180], dtype=torch.int32, device=DEVICE)
    compare(inputs, True, rule=rule, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("g_fill", [0.0, -30.0, "mixed"])
def test_extreme_decays(g_fill):
    """No decay at all (α = 1), a decay that wipes the state (α = e^-30), and both mixed in one chunk."""
    inputs = make_inputs(1, 80, 1, 32, 16, seed=4)
    if g_fill == "mixed":
        inputs["g"] = torch.where(torch.rand(inputs["g"].shape, generator=torch.Generator().manual_seed(5)) < 0.2,
                                  -30.0, 0.0).double()
    else:
        inputs["g"] = torch.full_like(inputs["g"], g_fill)
    compare(inputs, True, rule="delta")


@pytest.mark.parametrize("K, V, rule", [(48, 40, "delta"), (80, 24, "additive"), (200, 16, "delta")])
def test_key_and_value_widths(K, V, rule):
    """Key widths that are not powers of two: one padded key block (48), two blocks of 64 with a partial second
    (80), four blocks with a partial fourth (200); value widths split into several value blocks, the last partial."""
    compare(make_inputs(1, 66, 1, K, V, seed=6), True, rule=rule)


MEMORIES = {"GDN": ("delta", False), "RDN": ("delta", True), "RLA": ("additive", True), "sGLA": ("additive", False)}


def _option_case(K, packed):
    """(inputs, options) of a launch-option test at key width K (16 values, two heads): packed sequences (an empty
    one, one shorter than a chunk, one over three chunks; ``cu_seqlens``) with initial states, or two sequences of
    two chunks."""
    if not packed:
        return make_inputs(2, 100, 2, K, 16, seed=32), {}
    inputs = make_inputs(1, 180, 2, K, 16, seed=30)
    gen = torch.Generator().manual_seed(31)
    for name in ("S0", "R0"):
        inputs[name] = 0.3 * torch.randn(5, 2, 16, K, generator=gen, dtype=torch.float64)
    return inputs, dict(cu_seqlens=torch.tensor([0, 20, 20, 150, 151, 180], dtype=torch.int32, device=DEVICE))


KEYS_ONCE, ONE_KEY_BLOCK = dict(KEYS_ONCE=True), dict(ONE_KEY_BLOCK=True)
BOTH = dict(KEYS_ONCE=True, ONE_KEY_BLOCK=True)


@pytest.mark.parametrize("options, memory, K, packed", [
    (KEYS_ONCE, "GDN", 80, True), (KEYS_ONCE, "RDN", 80, True), (KEYS_ONCE, "RLA", 80, True),
    (KEYS_ONCE, "sGLA", 80, True), (KEYS_ONCE, "RDN", 200, False), (KEYS_ONCE, "GDN", 200, False),
    (ONE_KEY_BLOCK, "RDN", 80, True), (ONE_KEY_BLOCK, "GDN", 200, False),
    (BOTH, "GDN", 80, True), (BOTH, "RLA", 80, True), (BOTH, "sGLA", 80, True), (BOTH, "RDN", 200, False),
], ids=lambda value: "+".join(value) if isinstance(value, dict) else None)
def test_reverse_pass_options(options, memory, K, packed, monkeypatch):
    """The reverse pass's launch options against float64 for every memory (the delta rule and the additive one,
    the residual memory's error out and the base memory's error in): KEYS_ONCE (each key block loaded once for the
    read and the update), ONE_KEY_BLOCK (dSᵀ as one [K, BV] tile) and both; two key blocks of 64 (the second
    partial) over packed sequences (an empty one, one shorter than a chunk, one over three chunks), or four (the
    fourth partial) over two sequences of two chunks; initial and final states and every gradient. The reverse
    passes are launched with the options (one block of K's power of two with ONE_KEY_BLOCK)."""
    from linmem.ops.triton import function

    _options_in_every_row(monkeypatch, "backward_states", **options)
    launches = _Recorded(function.reverse_pass_kernel)
    monkeypatch.setattr(function, "reverse_pass_kernel", launches)
    rule, residual = MEMORIES[memory]
    inputs, extra = _option_case(K, packed)
    compare(inputs, residual, rule=rule, **extra)
    assert len(launches.calls) == 1 + residual
    one_block = options.get("ONE_KEY_BLOCK", False)
    for _, kwargs in launches.calls:
        assert kwargs["KEYS_ONCE"] is options.get("KEYS_ONCE", False)
        assert (kwargs["BK"], kwargs["NK"]) == ((triton.next_power_of_2(K), 1) if one_block else (64, -(-K // 64)))


@pytest.mark.parametrize("memory, K, packed", [("GDN", 80, True), ("RDN", 80, True), ("RLA", 80, True),
                                               ("sGLA", 80, True), ("RDN", 200, False), ("GDN", 200, False)])
def test_forward_pass_keys_once(memory, K, packed, monkeypatch):
    """KEYS_ONCE of the forward's state passes (each key block loaded once for the read ``K S_0ᵀ`` and the update)
    against float64 for every memory: the delta rule (read and update) and the additive one (the update only, and
    the read for the base memory's error out); two key blocks of 64 (the second partial) over packed sequences with
    initial states, or four (the fourth partial) over two sequences of two chunks; final states and every gradient
    (the backward runs the state passes again with ``recompute_states``). Every state pass is launched with it."""
    from linmem.ops.triton import function

    _options_in_every_row(monkeypatch, "forward", KEYS_ONCE=True)
    launches = _Recorded(function.state_pass_kernel)
    monkeypatch.setattr(function, "state_pass_kernel", launches)
    rule, residual = MEMORIES[memory]
    inputs, extra = _option_case(K, packed)
    compare(inputs, residual, rule=rule, **extra)
    passes = 1 + function.kernel_options(K, 16)["recompute_states"]
    assert len(launches.calls) == (1 + residual) * passes
    assert all(kwargs["KEYS_ONCE"] is True for _, kwargs in launches.calls)


@pytest.mark.parametrize("memory, K, packed, keys_once, recompute", [
    ("RDN", 80, True, False, True), ("RLA", 80, True, True, "writes"), ("RDN", 200, False, True, "writes"),
    ("RLA", 200, False, False, True)])
def test_forward_pass_fused_against_float64(memory, K, packed, keys_once, recompute, monkeypatch):
    """FUSED (both memories of RLA/RDN in one state pass) against float64: packed sequences with initial states
    (an empty one, one shorter than a chunk, one over three chunks; two key blocks, the second partial) or two
    sequences of two chunks (four key blocks, the fourth partial), with and without KEYS_ONCE, the backward's
    recomputation from the start or from the kept writes; final states and every gradient. Both the forward and the
    backward's recomputation launch the fused kernel, never the single one."""

    _recompute_in_every_row(monkeypatch, recompute)
    _options_in_every_row(monkeypatch, "forward", FUSED=True, KEYS_ONCE=keys_once)
    single, both = _record_launches(monkeypatch, "state_pass_kernel", "both_state_passes_kernel")
    rule, residual = MEMORIES[memory]
    inputs, extra = _option_case(K, packed)
    compare(inputs, residual, rule=rule, **extra)
    assert not single.calls and len(both.calls) == 2
    assert all(kwargs["KEYS_ONCE"] is keys_once for _, kwargs in both.calls)
    assert [kwargs["w_in"] is not None for _, kwargs in both.calls] == [False, recompute == "writes"]


@pytest.mark.parametrize("memory, K, packed, keys_once, recompute", [
    ("RDN", 80, True, False, True), ("GDN", 80, True, True, True), ("RDN", 200, False, True, "writes"),
    ("RLA", 80, True, False, True), ("GDN", 200, False, False, "base")])
def test_forward_pass_preformed_against_float64(memory, K, packed, keys_once, recompute, monkeypatch):
    """PREFORMED (the delta writes' state-free products ``W = T diag(σ e^b) K`` and ``ũ = T diag(σ) X`` formed in
    parallel kernels, each chain ``u = ũ − W S_0ᵀ`` and the update, the base memory's error after its pass) against
    float64: packed sequences with initial states (an empty one, one shorter than a chunk, one over three chunks;
    two key blocks, the second partial) or two sequences of two chunks (four key blocks, the fourth partial), with
    and without KEYS_ONCE, the backward recomputing the passes the same way, from the kept writes, or the base pass
    only; final states and every gradient. The delta rule's passes take the preformed writes in the forward and in a
    recomputation from the start; the additive rule (RLA) has no writes to form and runs the passes as before."""

    _recompute_in_every_row(monkeypatch, recompute)
    _options_in_every_row(monkeypatch, "forward", PREFORMED=True, KEYS_ONCE=keys_once)
    passes, writes, errors = _record_launches(monkeypatch, "state_pass_kernel", "preformed_writes_kernel",
                                              "preformed_error_kernel")
    rule, residual = MEMORIES[memory]
    inputs, extra = _option_case(K, packed)
    compare(inputs, residual, rule=rule, **extra)
    preformed_runs = 0 if rule == "additive" else 1 + (recompute in (True, "base"))
    assert len(writes.calls) == preformed_runs
    assert len(errors.calls) == preformed_runs * residual
    preformed = [kwargs for _, kwargs in passes.calls if kwargs["write_keys"] is not None]
    assert len(preformed) == (rule == "delta") * ((1 + residual) * (1 + (recompute is True)) + (recompute == "base"))
    assert all(kwargs["err_out"] is None and kwargs["KEYS_ONCE"] is keys_once for kwargs in preformed)
    # the residual memory's W only where its pass runs: in the forward, and in a recomputation of every pass
    want_res_keys = ([residual] + [residual and recompute is True] * (preformed_runs - 1))[:preformed_runs]
    assert [kwargs["res_keys_out"] is not None for _, kwargs in writes.calls] == want_res_keys


@pytest.mark.parametrize("memory, K, packed, keys_once, extra", [
    ("RDN", 80, True, False, {}), ("GDN", 80, True, True, {}), ("RDN", 200, False, True, {}),
    ("RLA", 80, True, False, {}), ("RDN", 80, True, True, dict(output_gates=False, residual_target="tanh", clip=0.5)),
    ("RDN", 200, False, False, dict(fit_history=False))])
def test_reverse_pass_preformed_against_float64(memory, K, packed, keys_once, extra, monkeypatch):
    """PREFORMED of the reverse passes (each memory's ``W = T diag(σ e^b) K`` formed before them, each chain the
    read and the update ``Wᵀ du``, ``dx = T_σᵀ du`` and the residual memory's error gradient formed after each pass)
    against float64: packed sequences with initial states (an empty one, one shorter than a chunk, one over three
    chunks; two key blocks, the second partial) or two sequences of two chunks (four key blocks, the fourth partial),
    with and without KEYS_ONCE; RDN with the output gates off and a tanh target (the error gradient through ρ'), and
    without history fitting (the error's gradient given, no residual pass); every gradient. The delta rule's passes
    take W and are followed by ``reverse_writes_kernel``, the residual memory's with its error gradient out; the
    additive rule (RLA) has no W and runs as before."""

    _options_in_every_row(monkeypatch, "backward_states", PREFORMED=True, KEYS_ONCE=keys_once)
    passes, writes, keys = _record_launches(monkeypatch, "reverse_pass_kernel", "reverse_writes_kernel",
                                            "preformed_writes_kernel")
    rule, residual = MEMORIES[memory]
    inputs, options = _option_case(K, packed)
    compare(inputs, residual, rule=rule, **options, **extra)
    residual_pass = residual and extra.get("fit_history", True)
    delta = rule == "delta"
    assert len(passes.calls) == 1 + residual_pass
    assert [kwargs["write_keys"] is not None for _, kwargs in passes.calls] == [delta] * (1 + residual_pass)
    assert all(kwargs["d_err_out"] is None or not delta for _, kwargs in passes.calls)
    assert len(keys.calls) == delta
    assert [kwargs["res_keys_out"] is not None for _, kwargs in keys.calls] == [residual_pass] * delta
    # the residual memory's dx with its error gradient, then the base memory's
    assert [kwargs["d_err_out"] is not None for _, kwargs in writes.calls] == ([True] * residual_pass + [False]) * delta


def test_reverse_pass_preformed_in_half_precision(monkeypatch):
    """The reverse passes' PREFORMED with bf16 inputs, where W and du are stored rounded to bf16 (du before
    ``T_σᵀ``): RDN against float64 within the half-precision allowance, two sequences of two chunks, four key
    blocks (the fourth partial), the clip target."""

    _options_in_every_row(monkeypatch, "backward_states", PREFORMED=True)
    compare(make_inputs(2, 100, 2, 200, 16, seed=41), True, dtype=torch.bfloat16, tol=2e-2, rule="delta")


@pytest.mark.parametrize("memory", ["RDN", "GDN"])
def test_recomputing_from_the_kept_writes_against_float64(memory, monkeypatch):
    """recompute_states "writes" with a pass per memory against float64: packed sequences with initial states (an
    empty one, one shorter than a chunk, one over three chunks; two key blocks, the second partial); final states and
    every gradient."""
    _recompute_in_every_row(monkeypatch, "writes")
    rule, residual = MEMORIES[memory]
    inputs, extra = _option_case(80, True)
    compare(inputs, residual, rule=rule, **extra)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    """q, k, v in half precision reach the kernels as they are (the reference sees the same rounded values; o and
    dq, dk, dv come back rounded to half precision)."""
    compare(make_inputs(1, 70, 2, 32, 16, seed=7), True, dtype=dtype, tol=2e-2, rule="delta")


@pytest.mark.parametrize("seed", [37, 41])
def test_preformed_writes_in_half_precision(seed, monkeypatch):
    """PREFORMED with bf16 inputs, where W is stored rounded to bf16 before the chain (ũ in float32): RDN with the
    clip target against float64 within the half-precision allowance, two sequences of two chunks, four key blocks
    (the fourth partial). With ũ rounded to bf16 too, seed 41 misses it (dv 7.6e-2: u = ũ − W S_0ᵀ is small beside
    its terms, and its error moves entries of the error across the clip)."""

    _options_in_every_row(monkeypatch, "forward", PREFORMED=True)
    compare(make_inputs(2, 100, 2, 200, 16, seed=seed), True, dtype=torch.bfloat16, tol=2e-2, rule="delta")


def per_key_inputs(B, T, H, K, V, seed, reset_rate=0.0):
    """``make_inputs`` with GLA's decay, one log decay per key channel ``g [B, T, H, K]``; ``reset_rate`` of the
    entries are ``-inf`` (that channel's memory wiped)."""
    inputs = make_inputs(B, T, H, K, V, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    g = -0.3 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    inputs["g"] = torch.where(torch.rand(g.shape, generator=gen) < reset_rate, -torch.inf, g.double())
    return inputs


def _gla_launches(monkeypatch):
    """Records the grid of every launch of the per-key-decay kernels."""
    from linmem.ops.triton import per_key_decay

    counted = {}
    for name in ("per_key_forward_kernel", "per_key_query_grad_kernel", "per_key_state_grad_kernel",
                 "per_key_decay_grad_kernel"):
        counted[name] = _Counted(getattr(per_key_decay, name))
        monkeypatch.setattr(per_key_decay, name, counted[name])
    return counted


@pytest.mark.parametrize("B, T, H, K, V, reset_rate", [(2, 37, 2, 16, 8, 0.0), (1, 50, 1, 24, 12, 0.05)])
def test_per_key_decay_matches_reference(monkeypatch, B, T, H, K, V, reset_rate):
    """GLA's memory (additive, a decay per key channel) runs on its own kernels, not on the chunk backend: outputs,
    final state and the gradients of q, k, v, g, beta and S0 against float64, with a key width that is not a power
    of two and some channels reset (g = -inf) mid-sequence."""
    counted = _gla_launches(monkeypatch)
    compare(per_key_inputs(B, T, H, K, V, seed=11, reset_rate=reset_rate), False, rule="additive")
    assert all(c.grids for c in counted.values()), {n: len(c.grids) for n, c in counted.items()}


def test_per_key_decay_value_blocks(monkeypatch):
    """Value rows split over several programs (the last block partial): dq and dk are summed over the blocks."""
    from linmem.ops.triton import per_key_decay

    monkeypatch.setattr(per_key_decay, "NARROW_LAUNCH", (64, 4))  # BK = 16, BV = 4: V = 10 in three blocks
    assert per_key_decay.tiling(16, 10) == (16, 4, 3, 4)
    counted = _gla_launches(monkeypatch)
    compare(per_key_inputs(1, 30, 2, 16, 10, seed=12), False, rule="additive", scale=0.6)
    assert counted["per_key_forward_kernel"].grids[0][0] == 3


def test_per_key_decay_wide_launch(monkeypatch):
    """From WIDE_KEYS on, a program holds a larger tile on fewer warps (FLA's K = 128 heads): all value rows of a
    small head in one program, against float64."""
    from linmem.ops.triton import per_key_decay

    assert per_key_decay.tiling(128, 256) == (128, 32, 8, 1) and per_key_decay.tiling(64, 64)[3] == 4
    monkeypatch.setattr(per_key_decay, "WIDE_KEYS", 16)
    assert per_key_decay.tiling(16, 40) == (16, 64, 1, 1)
    counted = _gla_launches(monkeypatch)
    compare(per_key_inputs(2, 20, 2, 16, 40, seed=18), False, rule="additive")
    assert counted["per_key_forward_kernel"].grids[0][0] == 1


def test_per_key_decay_values_wider_than_the_chunk_kernels_take(monkeypatch):
    """GLA's memory with V = 300 (over MAX_WIDTH; FLA's GLA-1.3B has V = 512) runs on its own kernels, in value
    blocks, against float64; a key width over MAX_WIDTH is refused, naming the width."""
    from linmem.ops.triton.layout import MAX_WIDTH

    counted = _gla_launches(monkeypatch)
    assert 300 > MAX_WIDTH
    compare(per_key_inputs(1, 12, 1, 16, 300, seed=16), False, rule="additive")
    assert counted["per_key_forward_kernel"].grids[0][0] == 300 // 64 + 1  # BV = 1024 // 16 = 64: five blocks
    with pytest.raises(ValueError, match=f"K = {MAX_WIDTH + 16}, V = 8 wide"):
        compare(per_key_inputs(1, 6, 1, MAX_WIDTH + 16, 8, seed=17), False, rule="additive")


def test_per_key_decay_packed_sequences():
    """cu_seqlens with an empty sequence and sequences of 1 and 40 tokens: each starts from its own state."""
    inputs = per_key_inputs(1, 60, 2, 16, 8, seed=13, reset_rate=0.02)
    inputs["S0"] = 0.3 * torch.randn(4, 2, 8, 16, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 19, 19, 20, 60], dtype=torch.int32, device=DEVICE)
    compare(inputs, False, rule="additive", cu_seqlens=cu_seqlens)


def test_per_key_decay_half_precision():
    """bf16 q, k, v reach the kernels as they are."""
    compare(per_key_inputs(1, 40, 2, 16, 8, seed=15), False, dtype=torch.bfloat16, tol=2e-2, rule="additive")


def _bench(monkeypatch):
    """``linmem.bench.kernels``, with the shape a run sets (``--heads``, ``--head-dim``, ``--value-dim``) put back
    after the test."""
    from linmem.bench import kernels

    monkeypatch.setattr(kernels, "HEADS", kernels.HEADS)
    monkeypatch.setattr(kernels, "HEAD_DIM", kernels.HEAD_DIM)
    monkeypatch.setattr(kernels, "VALUE_DIM", kernels.VALUE_DIM)
    monkeypatch.setenv("LINMEM_BENCH_SHAPE", "")
    return kernels


BENCH_DRY_RUN = ["--skip-check", "--lengths", "64", "--tokens", "64", "--heads", "1", "--head-dim", "16", "--workers",
                 "1"]


def test_kernel_benchmark_dry_run(tmp_path, monkeypatch, capsys):
    """``python -m linmem.bench.kernels`` end to end on the CPU (interpreter, tiny shapes): options, timing, the
    report files and the summary table the GPU run ends with; values wider than the keys (``--value-dim``)."""
    kernels = _bench(monkeypatch)
    kernels.main([*BENCH_DRY_RUN, "--value-dim", "24", "--methods", "linmem sGLA,FLA sGLA 2V", "--out",
                  str(tmp_path)])
    out = capsys.readouterr().out.rstrip().splitlines()
    # no linmem / FLA pair was asked for: the summary holds the times (FLA absent on the CPU: a dash)
    assert out[-3] == "| T | linmem sGLA | FLA sGLA 2V |" and out[-1].startswith("| 64 | ")
    assert float(out[-1].split("|")[2]) > 0 and out[-1].split("|")[3].strip() == "–"
    assert (tmp_path / "kernels.json").exists() and (tmp_path / "kernels.md").exists()
    page = (tmp_path / "kernels.md").read_text()
    table = page.split("## fwd+bwd")[1].strip().splitlines()
    assert table[0] == "| T | linmem sGLA | FLA sGLA 2V |"
    assert "H = 1, head dim 16, value dim 24," in page
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert (report["head_dim"], report["value_dim"]) == (16, 24)
    from linmem.ops.triton import function

    assert report["kernel_options"] == json.loads(json.dumps(function.kernel_options(16, 24)))


def test_kernel_benchmark_times_the_op_as_a_training_step_calls_it(monkeypatch):
    """The bench's linmem methods skip the gates' value check, as a model's mixer does unless a hook could write the
    gates: that check reads flags back to the host, a synchronisation per call that FLA's functions do not make and
    that a timed step would otherwise include. The float64 checks keep it (they call the op with its defaults)."""
    from linmem.bench import kernel_checks
    from linmem.ops import checks

    kernels = _bench(monkeypatch)
    checked = []
    real = checks.check_gate_values
    monkeypatch.setattr(checks, "check_gate_values", lambda *a: checked.append(1) or real(*a))
    x = kernel_checks.random_inputs(1, 32, 1, 16, 16, torch.float32, "cpu", seed=int(torch.randint(1000, ())))
    x["g_key"] = -0.05 * torch.rand(1, 32, 1, 16)
    for name in kernels.CHUNKED_METHODS + ["linmem GLA"]:
        kernels.METHODS[name](kernel_checks.grad_leaves(x)).sum().backward()
    assert checked == []
    kernel_checks.linmem_run({k: v for k, v in x.items() if k != "g_key"}, "delta", True, "triton")
    assert checked  # the default call checks


def _bench_with_gdn_raising(monkeypatch, error: BaseException):
    """``linmem.bench.kernels`` for a CPU dry run in which timing linmem GDN raises ``error``."""
    kernels = _bench(monkeypatch)
    timed = kernels.time_method

    def raising(fn, x, backward):
        if fn is kernels.METHODS["linmem GDN"]:
            raise error
        return timed(fn, x, backward)

    monkeypatch.setattr(kernels, "time_method", raising)
    return kernels


def test_kernel_benchmark_killed_inside_a_method_keeps_the_methods_before(tmp_path, monkeypatch):
    """A run stopped while it times a method (on the GPU: an FLA autotune outlasting the command's time limit)
    leaves kernels.json and kernels.md with every method timed before it."""
    kernels = _bench_with_gdn_raising(monkeypatch, KeyboardInterrupt())  # what a kill does, without the kill
    with pytest.raises(KeyboardInterrupt):
        kernels.main([*BENCH_DRY_RUN, "--methods", "linmem sGLA,linmem GDN", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert [(r["method"], r["mode"]) for r in report["results"]] == [("linmem sGLA", "fwd"), ("linmem sGLA", "fwd+bwd")]
    assert all(r["ms"] > 0 for r in report["results"])
    assert "linmem sGLA" in (tmp_path / "kernels.md").read_text()


def test_time_limit_stops_a_long_call_through_broad_excepts():
    """``time_limit`` stops code that runs past it, even inside an ``except Exception`` (as an autotuner has), and
    leaves no timer behind."""
    import time

    from linmem.bench import kernels

    def autotune_forever():
        while True:
            try:
                time.sleep(0.01)  # one "compile"
            except Exception:  # noqa: BLE001 (what the limit must get through)
                pass

    start = time.perf_counter()
    with pytest.raises(kernels.OverBudget), kernels.time_limit(0.2):
        autotune_forever()
    assert 0.15 < time.perf_counter() - start < 2.0
    with kernels.time_limit(5.0):
        time.sleep(0.01)
    time.sleep(0.05)  # a timer left running would raise here


def test_kernel_benchmark_method_over_budget_is_skipped_and_the_rest_timed(tmp_path, monkeypatch):
    """A method stopped by the budget is recorded as skipped (its table cell a dash), and the methods after it
    are still timed."""
    from linmem.bench.kernels import OverBudget

    stopped = OverBudget("stopped after 20 s: the time budget is spent")  # what the alarm raises
    kernels = _bench_with_gdn_raising(monkeypatch, stopped)
    kernels.main([*BENCH_DRY_RUN, "--methods", "linmem GDN,linmem sGLA", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert [(r["method"], r["mode"]) for r in report["results"]] == [("linmem sGLA", "fwd"), ("linmem sGLA", "fwd+bwd")]
    assert any(s.startswith("linmem GDN T=64 from fwd (stopped after 20 s") for s in report["skipped"])
    table = (tmp_path / "kernels.md").read_text().split("## fwd+bwd")[1].strip().splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    row = [c.strip() for c in table[2].strip("|").split("|")]
    assert "linmem sGLA" in header and float(row[header.index("linmem sGLA")]) > 0
    assert "linmem GDN" not in header or row[header.index("linmem GDN")] in ("–", "-", "")


def test_kernel_report_compares_with_fla_at_twice_the_value_width():
    """The report's tables hold the methods a run timed, and, when FLA was timed at twice the value width, the
    ratios against it; an unknown method is refused before anything runs."""
    from linmem.bench import kernels

    report = _report({"linmem RDN": 22.0, "FLA GDN": 13.0, "FLA GDN 2V": 20.0, "linmem RLA": 19.0, "FLA sGLA": 8.0})
    table = report_page(report).split("## fwd+bwd")[1].strip().splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["T", "linmem RLA", "linmem RDN", "FLA sGLA", "FLA GDN", "FLA GDN 2V", "RDN / FLA GDN",
                      "RLA / FLA sGLA", "RDN / FLA GDN 2V"]
    assert table[2] == "| 2048 | 19.00 | 22.00 | 8.00 | 13.00 | 20.00 | 1.69x | 2.38x | 1.10x |"
    # with linmem's single-memory ops timed too, RDN and RLA are also divided by them (each label names its divisor)
    report = _report({"linmem RDN": 22.0, "linmem GDN": 11.0, "FLA GDN": 13.0})
    table = report_page(report).split("## fwd+bwd")[1].strip().splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[-3:] == ["GDN / FLA GDN", "RDN / FLA GDN", "RDN / GDN"]
    assert table[2].endswith("| 0.85x | 1.69x | 2.00x |")
    with pytest.raises(SystemExit):
        kernels.main(["--methods", "linmem RDN,FLA GDN 3V"])


def _report(ms: dict[str, float], lengths=(2048,)) -> dict:
    """A kernel benchmark report with ``ms`` as every length's forward and forward+backward times."""
    results = [dict(method=m, mode=mode, T=T, B=131072 // T, ms=t) for T in lengths for m, t in ms.items()
               for mode in ("fwd", "fwd+bwd")]
    return dict(env=dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c"), tokens=131072, results=results)


def test_kernel_report_ratios_are_the_pairs_timed():
    """Each linmem / FLA pair timed in one run gets its ratio column (GLA's among them), no column is left for a
    pair not timed, and the closing summary gives each pair's two times and their ratio."""
    report = _report({"linmem GLA": 51.6, "FLA GLA": 23.0, "linmem RDN": 22.0}, lengths=(2048, 8192))
    table = report_page(report).split("## fwd+bwd")[1].strip().splitlines()
    assert table[0] == "| T | linmem RDN | linmem GLA | FLA GLA | GLA / FLA GLA |"
    assert table[2] == "| 2048 | 22.00 | 51.60 | 23.00 | 2.24x |" and table[3].startswith("| 8192 |")
    summary = report_summary(report).splitlines()
    assert summary[-4:] == ["| T | GLA / FLA GLA |", "|---|---|", "| 2048 | 51.60 / 23.00 ms = 2.24x |",
                            "| 8192 | 51.60 / 23.00 ms = 2.24x |"]
    # the chunked kernels' launch options are listed where a method ran on them; GLA's kernels have their own
    assert "Launch options of linmem's chunked kernels" in report_page(dict(report, kernel_options={"a": {}}))
    gla_only = _report({"linmem GLA": 51.6, "FLA GLA": 23.0})
    assert "Launch options" not in report_page(dict(gla_only, kernel_options={"a": {}}))


def test_kernel_report_tells_a_check_that_did_not_run_from_one_that_failed():
    """The 64-bit offsets check needs tens of GiB beside the compile workers: one that raised (out of memory, say)
    is reported as not run, with its error, never as a wrong result; one whose numbers differ is FAILED."""
    case = "RDN bfloat16 B=5 T=122880: last sequence equals it run alone"
    raised = dict(case=case, errors={}, worst=float("inf"), passed=False, error="OutOfMemoryError: CUDA out of memory")
    wrong = dict(case=case, errors={"o": 0.5}, worst=0.5, passed=False)
    right = dict(case=case, errors={"o": 0.0}, worst=0.0, passed=True)
    text = {name: report_page(dict(_report({"linmem RDN": 1.0}), offsets=found))
            for name, found in (("raised", raised), ("wrong", wrong), ("right", right))}
    assert f"NOT RUN (OutOfMemoryError: CUDA out of memory): {case}" in text["raised"]
    assert "FAILED" not in text["raised"]
    assert f"FAILED: {case}" in text["wrong"] and "NOT RUN" not in text["wrong"]
    assert f"passed: {case}" in text["right"]
    assert "offsets not run" in report_summary(dict(_report({"linmem RDN": 1.0}), checks=[], offsets=raised))


def test_kernel_report_renders_again_from_its_json(tmp_path, capsys):
    """``--render`` rewrites kernels.md and kernels.png from a run's kernels.json, with the shape it recorded,
    and refuses a folder without one."""
    from linmem.bench import kernels

    report = dict(_report({"linmem RLA": 19.0, "FLA sGLA": 8.0}, lengths=(2048, 8192)), heads=4, head_dim=64)
    (tmp_path / "kernels.json").write_text(json.dumps(report))
    kernels.main(["--render", "--out", str(tmp_path)])
    page = (tmp_path / "kernels.md").read_text()
    assert "H = 4, head dim 64" in page and "| 2048 | 19.00 | 8.00 | 2.38x |" in page
    assert (tmp_path / "kernels.png").stat().st_size > 0
    assert capsys.readouterr().out.rstrip().endswith("| 8192 | 19.00 / 8.00 ms = 2.38x |")
    with pytest.raises(SystemExit, match="no kernels.json"):
        kernels.main(["--render", "--out", str(tmp_path / "empty")])


def test_kernel_benchmark_warms_only_what_it_times():
    """The compile tasks before the timings warm the methods asked for: linmem's, and each FLA kernel an FLA method
    runs (the three-call compositions run FLA's sGLA and GDN), once; a sweep adds RDN, RLA and GDN under its
    variants."""
    from linmem.bench import kernels

    def warmed(methods, variants=()):
        return [(task["method"], task.get("kernel_options"), task.get("T"))
                for _, task in kernels.warm_tasks(methods, list(variants))]

    assert warmed(["linmem GLA", "FLA GLA"]) == [("linmem GLA", None, None), ("FLA GLA", None, 8192)]
    assert warmed(["FLA 3-call RDN", "FLA GDN", "SDPA flash"]) == [("FLA GDN", None, 8192)]
    variant = {"scores": {"num_warps": 8}}
    assert warmed(["linmem sGLA"], [variant]) == [("linmem RLA", None, None), ("linmem RLA", variant, None),
                                                   ("linmem RDN", None, None), ("linmem RDN", variant, None),
                                                   ("linmem sGLA", None, None),
                                                   ("linmem GDN", None, None), ("linmem GDN", variant, None)]


@pytest.mark.slow
def test_kernel_benchmark_checks_given_launch_options(monkeypatch):
    """The benchmark's float64 checks run with other launch options when given them (a sweep's winners, before
    they are timed): every worker applies them and reports what it ran with."""
    from linmem.bench import kernel_checks

    kernels = _bench(monkeypatch)
    kernels._set_shape(1, 16)
    # This test is about the options reaching every worker, not about bf16 rounding: the cases' inputs get fixed
    # seeds, so the verdict does not depend on the draw (fresh bf16 draws at these tiny shapes land near the 1e-2
    # allowance now and then; the benchmark itself keeps fresh inputs on the GPU).
    drawn = kernel_checks.check_cases

    def seeded_cases(*args):
        return [dict(case, seed=i) for i, case in enumerate(drawn(*args))]

    monkeypatch.setattr(kernel_checks, "check_cases", seeded_cases)
    options = {"backward_keys": dict(num_warps=4, num_stages=1, BV=32, BK=None, SPLIT=False)}
    results, failures = kernels.warm_and_check([], workers=2, skip_check=False, quick=True, lengths=[64], tokens=64,
                                               kernel_options=options)
    assert not failures and not results["unfinished"]
    done = results["checks"] + [results["offsets"], results["finite"]]
    assert len(results["checks"]) >= 3 and all(r["passed"] for r in done)
    assert all(r["kernel_options"] == options for r in done)


@pytest.mark.parametrize("K, V", [(128, 128), (256, 256), (128, 256), (64, 64)])
def test_sweep_variants_each_change_one_default(K, V):
    """Every variant of the benchmark's sweep changes one kernel's launch options, to something other than the
    row of KERNEL_OPTIONS at the swept widths (a variant equal to it would time the default twice), with no unknown
    option and no variant twice; with K or V over 128 the wide candidates join (value blocks of 32 and 64, 4 or 8
    warps, one or two stages), the reverse pass in two stages at K = 256 only with KEYS_ONCE; the forward's state
    passes with KEYS_ONCE at the row's own options (where the row has it off), and at K = 256 in three or four
    stages (BV = 32, never the spilling 64) and at BV = 16 in two or three; recompute_states is timed at its other
    choices too."""
    from linmem.bench import kernels
    from linmem.ops.triton import function

    variants = kernels.sweep_variants(K, V)
    row = function.kernel_options(K, V)
    assert variants
    assert len({repr(v) for v in variants}) == len(variants)
    # nor one launch under two spellings: num_warps None is 4 for bf16, num_stages None the width's pipeline depth
    stages = 2 if K <= 128 else 1

    def launch(name, options):
        if not isinstance(options, dict):
            return name, options
        options = dict(options)
        options["num_warps"] = 4 if options.get("num_warps", 4) is None else options.get("num_warps")
        options["num_stages"] = stages if options.get("num_stages", stages) is None else options.get("num_stages")
        return name, tuple(sorted(options.items()))

    launches = [launch(*next(iter(v.items()))) for v in variants]
    assert len(set(launches)) == len(launches)
    assert not {launch(name, row[name]) for name in row} & set(launches)
    others = [{"recompute_states": c} for c in function.RECOMPUTE_CHOICES if c != row["recompute_states"]]
    assert [v for v in variants if "recompute_states" in v] == others  # every other choice, timed
    for variant in variants:
        ((name, options),) = variant.items()
        assert options != row[name], name
        if name != "recompute_states":
            assert set(options) == set(row[name]), name
    forward = {(o["BV"], o["num_warps"], o["num_stages"]) for v in variants for n, o in v.items() if n == "forward"}
    own = (row["forward"]["BV"], row["forward"]["num_warps"], row["forward"]["num_stages"])
    wide = {(bv, w, st) for bv in (32, 64) for w in (4, 8) for st in (1, 2)} - {own}  # the row's own is not timed
    assert (wide <= forward) == (max(K, V) > 128)
    reverse = {(o["num_stages"], o["KEYS_ONCE"]) for v in variants for n, o in v.items() if n == "backward_states"}
    assert ((2, False) in reverse) == (K <= 128 and V > 128)
    assert ((2, True) in reverse) == (K > 128)  # two stages fit at K = 256 with each key tile loaded once
    assert any(keys_once for _, keys_once in reverse)
    forward_keys_once = [o for v in variants for n, o in v.items() if n == "forward" and o["KEYS_ONCE"]
                         and not o["PREFORMED"]]
    if not row["forward"]["KEYS_ONCE"]:  # a row with it on (K = 256) is not timed again as a variant
        assert dict(row["forward"], KEYS_ONCE=True) in forward_keys_once
    assert row["forward"] not in forward_keys_once
    # a kernel the row moved away from TUNED_AT_128 can move back: its TUNED_AT_128 launch is a candidate
    for name, options in function.TUNED_AT_128.items():
        if name != "recompute_states" and launch(name, options) != launch(name, row[name]):
            assert launch(name, options) in launches, name
    assert ({o["num_stages"] for o in forward_keys_once} >= {3, 4}) == (K > 128)
    assert all(o["BV"] != 64 for o in forward_keys_once) and len(forward_keys_once) <= 8
    # at K = 256 also BV 16 in two stages (two programs per SM) and three
    assert ({(o["BV"], o["num_stages"]) for o in forward_keys_once} >= {(16, 2), (16, 3)}) == (K > 128)
    # both memories in one pass: at half the row's value block, and at K <= 128 at the row's own (it spills at 256)
    fused = [o for v in variants for n, o in v.items() if n == "forward" and o["FUSED"]]
    assert dict(row["forward"], FUSED=True, BV=16) in fused
    # both passes in one launch: at the row's own launch, and at K = 256 at BV 16 in two stages (two programs per SM)
    pipelined = [o for v in variants for n, o in v.items() if n == "forward" and o["PIPELINED"]]
    assert pipelined == [dict(row["forward"], PIPELINED=True)] + (
        [dict(row["forward"], PIPELINED=True, BV=16, num_stages=2)] if K > 128 else [])
    assert (dict(row["forward"], FUSED=True) in fused) == (K <= 128)
    # the writes' state-free products before each chain: at BV 64, 8 warps, two stages
    preformed = [o for v in variants for n, o in v.items() if n == "forward" and o["PREFORMED"]]
    assert preformed == [dict(row["forward"], PREFORMED=True, BV=64, KEYS_ONCE=False, num_warps=8, num_stages=2)]
    # both reverse passes in one program: one stage, BV 16, and at K = 256 the key tiles loaded per product
    fused = [o for v in variants for n, o in v.items() if n == "backward_states" and o.get("FUSED")]
    assert [(o["num_stages"], o["BV"], o["KEYS_ONCE"]) for o in fused] == [(1, 16, False)]
    # each memory's W before the reverse passes: one stage, at the row's value block
    preformed = [o for v in variants for n, o in v.items() if n == "backward_states" and o["PREFORMED"]]
    assert preformed == [dict(row["backward_states"], PREFORMED=True, KEYS_ONCE=False, num_stages=1)]


def test_sweep_keeps_the_variant_best_for_every_rule(monkeypatch):
    """The sweep keeps, per kernel, the variant with the smallest RDN + RLA + GDN time, in the row of the swept
    widths only: a variant that speeds RDN up and slows the others down more loses to the default, and one within
    the sweep's margin of the default does not move the row; the row it leaves holds the winners, the other rows are
    as they were; recompute_states is timed but not chosen; past the deadline no variant is timed."""
    from linmem.bench import kernels
    from linmem.ops.triton import function

    monkeypatch.setattr(kernels, "HEADS", 1)
    monkeypatch.setattr(kernels, "HEAD_DIM", 16)
    monkeypatch.setattr(kernels, "VALUE_DIM", 80)  # the row (64, 128)
    monkeypatch.setattr(function, "KERNEL_OPTIONS", {k: dict(v) for k, v in function.KERNEL_OPTIONS.items()})
    row = function.KERNEL_OPTIONS[64, 128]
    others = {k: dict(v) for k, v in function.KERNEL_OPTIONS.items() if k != (64, 128)}
    row["output"] = dict(row["output"], BV=128)
    row["decay_grad"] = dict(row["decay_grad"], num_warps=2)
    rdn_only = {"output": dict(row["output"], BV=64)}
    every = {"decay_grad": dict(row["decay_grad"], num_warps=4)}
    within_noise = {"backward_scores": dict(row["backward_scores"], BV=16)}
    timings = {  # (output BV, decay_grad warps, backward_scores BV) -> (RDN, RLA, GDN) ms
        (128, 2, 64): (10.0, 8.0, 5.0), (64, 2, 64): (9.0, 8.5, 5.6), (128, 4, 64): (9.5, 7.5, 4.5),
        (128, 2, 16): (9.9, 7.9, 4.9)}  # 1.3% below the default: inside the margin

    calls = []

    def fake_time(fn, x, backward):
        calls.append(fn)
        times = timings[(row["output"]["BV"], row["decay_grad"]["num_warps"], row["backward_scores"]["BV"])]
        faster = 0.5 if row["recompute_states"] != default else 1.0
        return faster * times[[kernels.METHODS[name] for name in kernels.SWEPT].index(fn)]

    monkeypatch.setattr(kernels, "time_method", fake_time)
    default = row["recompute_states"]
    row["backward_scores"] = dict(row["backward_scores"], BV=64)
    chosen = kernels.tune([rdn_only, every, within_noise, {"recompute_states": not default}], 1, 64)
    assert chosen["output"]["BV"] == 128 and chosen["decay_grad"]["num_warps"] == 4
    assert chosen["backward_scores"]["BV"] == 64
    assert chosen["recompute_states"] is default  # timed (here the fastest), never chosen by time
    assert row["decay_grad"]["num_warps"] == 4 and row["output"]["BV"] == 128
    assert {k: v for k, v in function.KERNEL_OPTIONS.items() if k != (64, 128)} == others
    before, timed = dict(row), len(calls)
    assert kernels.tune([rdn_only], 1, 64, deadline=0.0) == before  # past the deadline: nothing but the default
    assert len(calls) == timed + len(kernels.SWEPT)


def _swept_row(monkeypatch):
    """``linmem.bench.kernels`` timing heads 16 x 80 (the row (64, 128) of a copy of ``KERNEL_OPTIONS``), and that
    row with the output at BV 128 and decay_grad at 2 warps: the default two sweep tests move away from."""
    from linmem.bench import kernels
    from linmem.ops.triton import function

    monkeypatch.setattr(kernels, "HEADS", 1)
    monkeypatch.setattr(kernels, "HEAD_DIM", 16)
    monkeypatch.setattr(kernels, "VALUE_DIM", 80)
    monkeypatch.setattr(function, "KERNEL_OPTIONS", {k: dict(v) for k, v in function.KERNEL_OPTIONS.items()})
    row = function.KERNEL_OPTIONS[64, 128]
    row["output"] = dict(row["output"], BV=128)
    row["decay_grad"] = dict(row["decay_grad"], num_warps=2)
    return kernels, row


def test_sweep_by_busy_time_judges_by_the_kernels_gpu_time(monkeypatch):
    """With ``metric="busy"`` the kernels' own time decides, not the call's wall time: a variant whose wall time is
    lower only through the host (its kernels take longer) is not chosen, one whose kernels take less is, whatever
    its wall time; an unknown metric is refused."""
    from linmem.bench import kernel_profile

    kernels, row = _swept_row(monkeypatch)
    host_only = {"output": dict(row["output"], BV=64)}
    kernels_faster = {"decay_grad": dict(row["decay_grad"], num_warps=4)}
    wall = {(128, 2): 1.0, (64, 2): 0.8, (128, 4): 1.1}  # relative to the default
    busy = {(128, 2): 1.0, (64, 2): 1.05, (128, 4): 0.9}

    def key():
        return row["output"]["BV"], row["decay_grad"]["num_warps"]

    monkeypatch.setattr(kernels, "time_method", lambda fn, x, backward: wall[key()])
    monkeypatch.setattr(kernel_profile, "busy_ms", lambda fn, x, repeats, device: busy[key()])
    chosen = kernels.tune([host_only, kernels_faster], 1, 64, metric="busy")
    assert chosen["output"]["BV"] == 128 and chosen["decay_grad"]["num_warps"] == 4
    row.update(output=dict(row["output"], BV=128), decay_grad=dict(row["decay_grad"], num_warps=2))
    chosen = kernels.tune([host_only, kernels_faster], 1, 64)  # by wall time: the other way round
    assert chosen["output"]["BV"] == 64 and chosen["decay_grad"]["num_warps"] == 2
    with pytest.raises(ValueError, match="metric"):
        kernels.tune([host_only], 1, 64, metric="cycles")


def test_sweep_judges_each_variant_against_the_default_timed_beside_it(monkeypatch):
    """On a GPU whose speed drifts during the sweep, each variant is compared with the default timed next to it,
    not with the default's first timing: a variant 5% slower than the default, timed after the machine got 30%
    faster, is not chosen, and one 5% faster, timed after it got 30% slower, is."""
    kernels, row = _swept_row(monkeypatch)
    slower = {"output": dict(row["output"], BV=64)}
    faster = {"decay_grad": dict(row["decay_grad"], num_warps=4)}
    cost = {(128, 2): 1.0, (64, 2): 1.05, (128, 4): 0.95}  # relative to the default
    speed = {"now": 1.0}  # the machine's drift: a time factor that changes between the variants

    def fake_time(fn, x, backward):
        return speed["now"] * cost[(row["output"]["BV"], row["decay_grad"]["num_warps"])]

    timed = []
    per_total = len(kernels.SWEPT)  # timings per total over the swept methods

    def drifting(*args, **kwargs):
        # the first total (the default) at speed 1; then each pair of totals (variant and default) at its own speed
        calls = len(timed)
        timed.append(calls)
        speed["now"] = 1.0 if calls < per_total else (0.7, 1.3)[(calls - per_total) // (2 * per_total)]
        return fake_time(*args, **kwargs)

    monkeypatch.setattr(kernels, "time_method", drifting)
    chosen = kernels.tune([slower, faster], 1, 64)
    assert chosen["output"]["BV"] == 128  # 5% slower beside its default, though faster than the first timing
    assert chosen["decay_grad"]["num_warps"] == 4  # 5% faster beside its default, though slower than the first


def test_launch_table_by_width_class(monkeypatch):
    """Each head width takes the row of the smallest class at least as wide, K and V apart; K = V = 128 keeps the
    options tuned there; a row changed alone changes only the launches of its widths; the row a sweep prints is
    Python that rebuilds the row."""
    from linmem.bench import kernel_report
    from linmem.ops.triton import function

    assert [function.width_class(d) for d in (1, 32, 64, 65, 128, 129, 200, 256)] == [64, 64, 64, 128, 128, 256,
                                                                                         256, 256]
    with pytest.raises(ValueError, match="300"):
        function.width_class(300)
    classes = function.WIDTH_CLASSES
    assert set(function.KERNEL_OPTIONS) == {(k, v) for k in classes for v in classes}
    assert len({id(row) for row in function.KERNEL_OPTIONS.values()}) == len(classes) ** 2
    assert function.kernel_options(128, 128) == function.TUNED_AT_128
    assert function.kernel_options(100, 256) is function.KERNEL_OPTIONS[128, 256]

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(function.KERNEL_OPTIONS, (128, 256), function._row(output=dict(num_warps=8, num_stages=1,
                                                                                        BV=32)))
    assert function._options("output", key_dim=128, value_dim=256)[0]["BV"] == 32
    assert function._options("output", key_dim=128, value_dim=200)[1] == {"num_warps": 8, "num_stages": 1}
    assert function._options("output", key_dim=128, value_dim=128)[0]["BV"] == 128
    assert function._options("output", key_dim=256, value_dim=128)[0]["BV"] == 128

    text = kernel_report.table_row(128, 200, function.KERNEL_OPTIONS[128, 256], "a reason")
    assert text.splitlines()[0] == "    (128, 256): _row(  # a reason"
    assert eval("{" + text + "}", vars(function)) == {(128, 256): function.KERNEL_OPTIONS[128, 256]}
    assert kernel_report.table_row(64, 64, function.kernel_options(64, 64), "why") == "    (64, 64): _row(),  # why"


def test_chunk_fallback_under_autocast():
    """bf16 q, k, v under a bf16 autocast (mixed-precision training) on the chunk backend (where ``auto`` sends
    inputs the kernels do not take; here fit_history=False) run in the state dtype, autocast off, instead of
    letting the autocast mix bf16 products into its float32 accumulators."""
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        compare(make_inputs(1, 20, 1, 16, 16, seed=8), True, dtype=torch.bfloat16, tol=3e-2, backend="chunk",
                rule="additive", fit_history=False)


@pytest.mark.slow
@pytest.mark.parametrize("BK, split, shape, residual", [
    (128, False, (1, 66, 1, 200, 16), True), (256, False, (1, 66, 1, 200, 16), False),
    (128, False, (2, 100, 2, 32, 16), True), (64, True, (1, 66, 1, 200, 16), True),
    (64, True, (2, 100, 2, 32, 16), False), (128, True, (2, 100, 2, 32, 16), True),
])
@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_key_gradient_launch_options(BK, split, shape, residual, rule, monkeypatch):
    """backward_keys with more than 64 key columns per program (half its programs, each reading the token tiles once
    for twice the keys): K = 200 in two blocks of 128 (the second mostly masked) or one of 256, BK capped at the
    padded key width; and SPLIT, dk and dq in two launches that each write their own gate partial sums."""
    from linmem.ops.triton import function

    row = function.kernel_options(shape[3], shape[4])
    monkeypatch.setitem(row, "backward_keys", dict(row["backward_keys"], BK=BK, SPLIT=split))
    launches = _Counted(function.backward_keys_kernel)
    monkeypatch.setattr(function, "backward_keys_kernel", launches)
    blocks, _ = function._options("backward_keys", value_dim=shape[4], key_dim=shape[3], dtype=torch.float32)
    assert blocks["BK"] == min(BK, triton.next_power_of_2(shape[3]))
    compare(make_inputs(*shape, seed=5), residual, rule=rule, **(dict(clip=0.3) if residual else {}))
    assert len(launches.grids) == (2 if split else 1)


@pytest.mark.parametrize("kernel", ["forward", "backward_states", "backward_scores", "backward_keys"])
def test_pipelined_stages_only_where_they_fit(kernel, monkeypatch):
    """Where a row leaves the stages to the code (None): two pipeline stages for 16-bit inputs with K ≤ 128, one for
    float32 inputs or K > 128, where two asked for more shared memory than an H200 has. Where a row names them (the
    swept K = 256 row), 16-bit inputs take the row's; float32 inputs at K > 128 one stage whatever the row says
    (the GPU launch options; the interpreter ignores them)."""
    from linmem.ops.triton import function

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    stages = {(key_dim, dtype): _resolved(kernel, dtype, key_dim)[1]["num_stages"]
              for key_dim in (64, 128, 256) for dtype in (torch.bfloat16, torch.float16, torch.float32)}

    def expected(key_dim, dtype):
        named = function.kernel_options(key_dim, key_dim)[kernel]["num_stages"]
        if named is None:
            return 2 if dtype != torch.float32 and key_dim <= 128 else 1
        return 1 if dtype == torch.float32 and key_dim > 128 else named

    assert stages == {(k, d): expected(k, d) for k, d in stages}
    assert {stages[k, torch.float32] for k in (64, 128, 256)} == {1}


def test_float32_inputs_keep_the_narrower_options(monkeypatch):
    """float32 inputs take the launch options that do not spill registers with float32 tiles; 16-bit inputs the
    faster, wider ones."""
    from linmem.ops.triton import function

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, overrides in function.FLOAT32_OPTIONS.items():
        wide, narrow = ({**blocks, **launch} for blocks, launch in (_resolved(name, torch.bfloat16),
                                                                    _resolved(name, torch.float32)))
        assert {key: narrow[key] for key in overrides} == overrides
        assert all(wide[key] != value for key, value in overrides.items())

    # at K = 256 the row pipelines 16-bit inputs in two stages; float32 tiles keep one stage in every kernel
    row = function.kernel_options(256, 256)
    piped = [name for name, opts in row.items() if isinstance(opts, dict) and opts.get("num_stages") == 2]
    assert piped
    for name in piped:
        assert _resolved(name, torch.bfloat16, width=256)[1]["num_stages"] == 2
        assert _resolved(name, torch.float32, width=256)[1]["num_stages"] == 1
    assert _resolved("output", torch.float32)[1]["num_stages"] == function.TUNED_AT_128["output"]["num_stages"]


def assert_same_model_outputs(kernels, chunk, ids):
    """The logits of ``ids`` and every parameter's gradient of a fixed loss on them agree between two models with the
    same weights, one on backend='triton' and one on 'chunk'."""
    outs = {}
    for name, model in (("chunk", chunk), ("triton", kernels)):
        logits = model(ids).logits
        (logits.double() ** 2).mean().backward()
        outs[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_close("logits", outs["triton"][0], outs["chunk"][0], max(TOL, 1e-5))
    assert outs["triton"][1].keys() == outs["chunk"][1].keys()
    for n, grad in outs["chunk"][1].items():
        assert_close(f"d {n}", outs["triton"][1][n], grad, max(TOL, 1e-4))


def test_gla_model_and_memory_lab_on_the_kernels(monkeypatch):
    """A GLA model on backend='triton' (its per-key-decay walk) against the same weights on 'chunk': logits, every
    parameter's gradient, and the memory lab's edits (state swap, donor write, write block), which split the
    sequence at the edit and hand states across."""

    import linmem.memory as mm
    from tests.test_memory_experiments import tiny_model

    def build(backend):
        return tiny_model(40, seed=21, pad_token_id=0, eos_token_id=None, bos_token_id=None, mixer="gla",
                          backend=backend).to(DEVICE)

    chunk, kernels = build("chunk"), build("triton")
    kernels.load_state_dict(chunk.state_dict())
    counted = _gla_launches(monkeypatch)
    ids = torch.randint(1, 40, (2, 19), generator=torch.Generator().manual_seed(22)).to(DEVICE)
    assert_same_model_outputs(kernels, chunk, ids)
    donor = ids.clone()
    donor[:, :9] = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(23)).to(DEVICE)
    heads = mm.heads(chunk)
    for edits in ([mm.StateSwap(heads[:2], at=9)], [mm.DonorWrite(heads[1:3], span=(2, 5))],
                  [mm.WriteBlock(heads, span=(0, 6))]):
        with torch.no_grad():
            want, got = mm.run(chunk, ids, donor, edits), mm.run(kernels, ids, donor, edits)
        assert_close(f"{edits[0]!r}", got, want, max(TOL, 1e-5))
        assert not torch.allclose(want, chunk(ids).logits.detach(), atol=1e-4), "the edit changed nothing"
    assert all(c.grids for c in counted.values())  # the triton model ran on the walk, not on the chunk fallback


@pytest.mark.parametrize("mixer", ["rla", pytest.param("rdn", marks=pytest.mark.slow)])
def test_model_without_history_fitting_and_memory_lab_on_the_kernels(mixer, monkeypatch):
    """An RLA/RDN model with fit_history=False on backend='triton' against the same weights on 'chunk': logits,
    every parameter's gradient, and the memory lab's edits, which hand both memories' states across a split (the
    residual one, the last token's correction, is then ignored after it, as the equations say)."""
    import linmem.memory as mm
    from linmem.ops.triton import function
    from tests.test_memory_experiments import tiny_model

    def build(backend):
        return tiny_model(40, seed=31, pad_token_id=0, eos_token_id=None, bos_token_id=None, mixer=mixer,
                          fit_history=False, backend=backend).to(DEVICE)

    chunk, kernels = build("chunk"), build("triton")
    kernels.load_state_dict(chunk.state_dict())
    launches = _Counted(function.output_kernel)
    monkeypatch.setattr(function, "output_kernel", launches)
    ids = torch.randint(1, 40, (2, 19), generator=torch.Generator().manual_seed(32)).to(DEVICE)
    assert_same_model_outputs(kernels, chunk, ids)
    assert launches.grids  # the triton model ran on the kernels
    donor = ids.clone()
    donor[:, :9] = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(33)).to(DEVICE)
    heads = mm.heads(chunk)
    for edits in ([mm.StateSwap(heads[:2], at=9)], [mm.DonorWrite(heads[1:3], span=(2, 5))]):
        with torch.no_grad():
            want, got = mm.run(chunk, ids, donor, edits), mm.run(kernels, ids, donor, edits)
        assert_close(f"{edits[0]!r}", got, want, max(TOL, 1e-5))


def test_swept_option_limits_what_the_sweep_compiles(monkeypatch):
    import linmem.bench.kernels as bench

    monkeypatch.setattr(bench, "SWEPT", bench.SWEPT)  # restored after the test
    with pytest.raises(SystemExit):
        bench.main(["--swept", "linmem GDN,FLA GDN", "--sweep"])
    variant = {"forward": dict(num_warps=4, num_stages=1, BV=32)}
    everything = {task["method"] for _, task in bench.warm_tasks(["linmem GDN"], [variant])}
    assert everything == {"linmem GDN", "linmem RDN", "linmem RLA"}
    bench._set_swept(["linmem GDN"])
    tasks = bench.warm_tasks(["linmem GDN"], [variant])
    assert tasks == [("compile", dict(method="linmem GDN")),
                     ("compile", dict(method="linmem GDN", kernel_options=variant))]


def test_profile_methods_are_checked_before_any_work():
    import linmem.bench.kernels as bench

    for bad in (["--profile-methods", "linmem XYZ"], ["--profile-methods", "FLA GDN,nope"], ["--profile-repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.main(["--profile", *bad])


@pytest.fixture
def stopped_bench(monkeypatch):
    """linmem.bench.kernels with what its ``main`` sets (the timed shape, the swept methods, the environment, FLA's
    version flag, the rows ``--options`` changes) restored after the test, and its compiles replaced by a stop that
    records the variants to time and the row at the timed widths: a run's choices, seen before any work.
    Returns (the module, what the stop saw)."""
    import linmem.bench.kernels as bench
    from linmem.ops.triton import function

    for name in ("SWEPT", "HEAD_DIM", "VALUE_DIM", "HEADS"):
        monkeypatch.setattr(bench, name, getattr(bench, name))
    for name in ("LINMEM_BENCH_SHAPE", "FLA_CACHE_RESULTS"):
        monkeypatch.delenv(name, raising=False)
    for key, row in function.KERNEL_OPTIONS.items():
        monkeypatch.setitem(function.KERNEL_OPTIONS, key, dict(row))
    try:
        import fla.ops.common.chunk_o as fla_chunk_o

        monkeypatch.setattr(fla_chunk_o, "TRITON_ABOVE_3_7_1", fla_chunk_o.TRITON_ABOVE_3_7_1)
    except ImportError:
        pass
    seen = {}

    def stop_at_the_compiles(variants, *args, **kwargs):
        seen["variants"] = variants
        seen["row"] = dict(function.kernel_options(bench.HEAD_DIM, bench.VALUE_DIM))
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench, "warm_and_check", stop_at_the_compiles)
    return bench, seen


def test_sweep_kernels_option_sweeps_only_those_kernels(stopped_bench):
    """``--sweep-kernels backward_states`` times the reverse pass's variants only (fewer compiles: a sweep that fits a
    short GPU budget), ``recompute_states`` there its other choices; an unknown kernel name stops the run before any
    work."""
    bench, seen = stopped_bench
    with pytest.raises(SystemExit):
        bench.main(["--sweep", "--sweep-kernels", "backward_states,reverse"])
    with pytest.raises(RuntimeError, match="stop here"):
        bench.main(["--sweep", "--sweep-kernels", "backward_states", "--head-dim", "256", "--heads", "2"])
    assert seen["variants"] and {next(iter(v)) for v in seen["variants"]} == {"backward_states"}
    assert seen["variants"] == [v for v in bench.sweep_variants(256, 256) if "backward_states" in v]
    with pytest.raises(RuntimeError, match="stop here"):  # the recompute choices alone: timed with their memory
        bench.main(["--sweep", "--sweep-kernels", "forward,recompute_states", "--head-dim", "256", "--heads", "2"])
    assert {next(iter(v)) for v in seen["variants"]} == {"forward", "recompute_states"}
    assert [v for v in seen["variants"] if "recompute_states" in v] == [{"recompute_states": "base"},
                                                                        {"recompute_states": "writes"},
                                                                        {"recompute_states": False}]


def test_sweep_only_option_keeps_the_variants_that_set_those_options(stopped_bench):
    """``--sweep-only FUSED=True,recompute_states=base`` times, of the kernels ``--sweep-kernels`` names, only the
    variants that set one of those options to that value; a malformed list, or one that leaves nothing to time, stops
    the run before any work."""
    bench, seen = stopped_bench
    wide = ["--head-dim", "256", "--heads", "2"]
    with pytest.raises(RuntimeError, match="stop here"):
        bench.main(["--sweep", "--sweep-kernels", "forward,recompute_states", "--sweep-only",
                    "FUSED=True,recompute_states=base,recompute_states=writes", *wide])
    everything = [v for v in bench.sweep_variants(256, 256) if next(iter(v)) in ("forward", "recompute_states")]
    expected = [v for v in everything if v.get("forward", {}).get("FUSED") is True
                or v.get("recompute_states") in ("base", "writes")]
    assert seen["variants"] == expected
    assert {"recompute_states": "base"} in expected and {"recompute_states": "writes"} in expected
    assert any("forward" in v for v in expected)
    assert len(expected) < len(everything)
    with pytest.raises(RuntimeError, match="stop here"):  # a value compared as text: BV=16 of any kernel
        bench.main(["--sweep", "--sweep-only", "BV=16", *wide])
    assert seen["variants"] and all(next(iter(v.values()))["BV"] == 16 for v in seen["variants"])
    for bad in ("FUSED", "=True", "FUSED=", "BV=999"):
        with pytest.raises(SystemExit):
            bench.main(["--sweep", "--sweep-only", bad, *wide])


def test_override_options_changes_every_row_and_refuses_unknown_names(monkeypatch):
    """``override_options`` (the kernels bench's ``--options``, the resource check's ``--options``) updates one
    kernel's launch options or replaces ``recompute_states`` in every row; an unknown kernel, launch option or
    recompute choice is refused before any row changes."""
    from linmem.ops.triton import function

    for key, row in function.KERNEL_OPTIONS.items():
        monkeypatch.setitem(function.KERNEL_OPTIONS, key, {name: (dict(opts) if isinstance(opts, dict) else opts)
                                                           for name, opts in row.items()})
    before = {key: dict(row) for key, row in function.KERNEL_OPTIONS.items()}
    for bad in ({"nope": {}}, {"forward": {"NOPE": 1}}, {"forward": 3}, {"recompute_states": "sometimes"},
                {"forward": {"FUSED": True}, "recompute_states": "sometimes"}):
        with pytest.raises(ValueError):
            function.override_options(bad)
        assert function.KERNEL_OPTIONS == before
    function.override_options({"forward": {"FUSED": True}, "recompute_states": "writes"})
    for key, row in function.KERNEL_OPTIONS.items():
        assert row["recompute_states"] == "writes"
        assert row["forward"] == dict(before[key]["forward"], FUSED=True)
        assert {name: opts for name, opts in row.items() if name not in ("forward", "recompute_states")} == {
            name: opts for name, opts in before[key].items() if name not in ("forward", "recompute_states")}


def test_bench_options_set_the_row_before_the_sweep_reads_it(stopped_bench):
    """``--options`` changes the launch options before the sweep builds its candidates from the row: with
    ``recompute_states`` "writes" set, the FUSED candidate is timed against a row that rebuilds from the writes; bad
    JSON or an unknown option stops the run before any work."""
    bench, seen = stopped_bench
    wide = ["--head-dim", "256", "--heads", "2"]
    with pytest.raises(RuntimeError, match="stop here"):
        bench.main(["--sweep", "--sweep-kernels", "forward", "--sweep-only", "FUSED=True", "--options",
                    '{"recompute_states": "writes"}', *wide])
    assert seen["row"]["recompute_states"] == "writes"
    assert seen["variants"] and all(v["forward"]["FUSED"] for v in seen["variants"])
    for bad in ("{not json", '{"recompute_states": "sometimes"}', '{"forward": {"NOPE": 1}}', "[1, 2]"):
        with pytest.raises(SystemExit):
            bench.main(["--options", bad, *wide])
