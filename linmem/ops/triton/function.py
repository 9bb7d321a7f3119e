"""The autograd Function that chains the kernels, and ``TRITON``, the backend (``triton_forward`` and ``unsupported``).

Forward (grids in brackets; NT chunks of 64 tokens, N sequences, H heads):

1. scores.py ``chunk_scores_kernel`` [NT, H]: in-chunk log decays b and the ``[C, C]`` score rows A', P_base, P_res;
2. inverse.py ``chunk_inverse_kernel`` [NT, H, 1 or 2] (delta rule): ``T_β``, ``T_γ``;
3. forward.py ``state_pass_kernel`` [V/BV, N·H], sequential over chunks, once per memory: carries S, stores the
   states before every chunk, the writes u (delta), and the prediction error; with a residual memory a second
   launch carries R on ``ρ(err)`` and stores w;
4. forward.py ``output_kernel`` [V/BV, NT, H]: the read-outs from the stored states.

Backward (with ``recompute_states`` in the heads' row of ``KERNEL_OPTIONS``, step 3 runs again first):

5. backward_states.py ``reverse_pass_kernel`` [V/BV, N·H], reverse over chunks, once per memory (the residual one
   first, emitting dy and d_err): dS (dR) at every chunk end, dx per token, the initial states' gradients;
6. backward_scores.py ``backward_scores_kernel`` [NT, H]: dv, the score-matrix gradients E_Q, E_K, partial gate sums;
7. backward_keys.py ``backward_keys_kernel`` [NT, H, K/BK]: dq, dk, partial gate sums (launch option SPLIT: dk and
   dq in two launches);
8. decay_grad.py ``decay_grad_kernel`` [NT, H]: dg, dβ, dγ.
"""

from __future__ import annotations

import functools

import torch
import triton

from linmem.ops.backend import Backend, MemoryInputs, Packed
from linmem.ops.config import MemoryConfig
from linmem.ops.step import rho
from linmem.ops.triton import layout as _layout
from linmem.ops.triton.backward_keys import backward_keys_kernel
from linmem.ops.triton.backward_scores import backward_scores_kernel
from linmem.ops.triton.backward_states import both_reverse_passes_kernel, reverse_pass_kernel, reverse_writes_kernel
from linmem.ops.triton.decay_grad import decay_grad_kernel
from linmem.ops.triton.forward import (
    both_state_passes_kernel,
    output_kernel,
    pipelined_state_passes_kernel,
    preformed_error_kernel,
    preformed_writes_kernel,
    state_pass_kernel,
)
from linmem.ops.triton.inverse import chunk_inverse
from linmem.ops.triton.layout import (
    CHUNK,
    MAX_WIDTH,
    SequenceLayout,
    dot_dtype,
    interpreting,
    key_tiling,
    score_dtype,
)
from linmem.ops.triton.per_key_decay import PerKeyDecayFunction
from linmem.ops.triton.primitives import TARGET_CODES
from linmem.ops.triton.scores import chunk_scores

# Launch options per kernel on a GPU (``linmem.bench.kernels --sweep`` times alternatives; the interpreter ignores
# them). BV: value columns per program. The sequential passes (forward, backward_states) hold one state as [64, BV]
# float32 key blocks; BV=None there picks it per call (``_sequential_block``), num_warps=None 4 (8 for float32 inputs,
# whose tiles take twice the registers). BK=None: 64 key columns per program of backward_keys, 32 for float32 inputs.
# PRECISION of the inverse's block products: None picks tf32 for 16-bit inputs, full float32 ("ieee") for float32 ones
# (inverse.chunk_inverse). num_stages=None picks software pipelining (the next loop iteration's tiles load during this
# one's dots) where it fits in shared memory (``_pipeline_stages``). SPLIT computes backward_keys' dk and dq in two
# launches of one kernel (fewer live accumulators, no register spills). KEYS_ONCE (forward, backward_states) loads each
# [64, 64] key tile of a chunk once for both of the pass's products (the read ``K Sᵀ`` and the update ``Kᵀ(…)``): less
# shared memory at two or more stages, more registers and spills at one. FUSED (forward) runs an RLA/RDN's two memories
# in one program per value block (forward.py ``both_state_passes_kernel``: the key blocks loaded once for both, both
# states held at once) instead of two launches; FUSED (backward_states) runs their two reverse passes in one program,
# the base memory a chunk behind (backward_states.py ``both_reverse_passes_kernel``). Both are off in every row: at
# K = V = 256 on an H100 each was slower than the row's two launches. PIPELINED (forward) runs an RLA/RDN's two passes
# in one launch of one program per memory and value block, the residual memory's PIPELINED_GROUP chunks behind the
# base memory's (forward.py ``pipelined_state_passes_kernel``: one state per program, as in the two launches, the two
# chains overlapped instead of one after the other); off in every row: on an H100 at B=4, T=2048, H=8 RDN's fwd+bwd
# took 3.9-5.5% more GPU time with it at K = V = 256 and 1.6% more at K = 128, V = 256. PREFORMED (forward, the delta
# rule) forms the writes' state-free products in parallel kernels before each memory's pass (forward.py
# ``preformed_writes_kernel``, ``preformed_error_kernel``), each chain one read ``W S_0ᵀ`` and one update as in FLA's
# state pass, at the cost of four per-token tensors written and read (W, ũ per memory); off in every row: on an H100
# at B=4, T=2048, H=8 RDN's chains took 14% less at K = V = 256 (none less at K = 128, V = 256), but its forming
# kernels, the base memory's error read back from the stored states most, cost 4.5 times that (GDN + RDN fwd+bwd
# +13.8% at its best launch, BV 64 in 8 warps). PREFORMED (backward_states, the delta rule) is the same for the
# reverse passes: each memory's W formed before them, each chain the read ``K dSᵀ`` and the update ``Wᵀ du`` (as
# FLA's reverse state pass), and ``dx = T_σᵀ du`` (with the residual memory's error gradient) formed after each pass
# in parallel (backward_states.py ``reverse_writes_kernel``); off in every row: it fits the shared memory in one stage
# only, where its chains took 38-54% longer than the row's two (GDN + RDN +15.0% at K = V = 256).
# ONE_KEY_BLOCK (backward_states) holds dSᵀ as one [K, BV] tile (BK = K's power of two, NK = 1) instead of up to four
# [64, BV] ones: one dot per product and chunk.
# ``--sweep`` times them; the K = V = 256 row turns KEYS_ONCE on in both passes (three stages in the forward, two in the
# reverse pass, which one stage could not hold at that width), ONE_KEY_BLOCK stays off everywhere. Their offline sm_90
# resources and the sweep's times are in docs/benchmarks/kernel-widths.md.
# TUNED_AT_128 holds the fastest of ``--sweep`` on an H200 for RDN fwd+bwd at B=4, T=32K, H=16, K = V = 128
# (docs/benchmarks/kernels.md); each was checked against float64 on the GPU. recompute_states: the backward runs the
# forward's state passes again instead of keeping their results (each memory's per-chunk states [NT, H, K, V], the
# writes u, w and the error err, what ``recomputed_bytes`` counts: 3.2 GB of per-chunk states alone for GDN-1.3B's 24
# layers at B = 4, T = 2048), at the cost of one more sequential pass per memory. "base" recomputes the base memory's
# pass only and keeps a residual memory's per-chunk states and writes w (its error err comes again from the base pass):
# one sequential pass fewer in an RLA/RDN backward for those two tensors' bytes; for a memory without a residual one it
# is True. "writes" keeps each memory's writes (u, w: per token, a quarter of the per-chunk states' bytes at K = 256)
# and runs every pass again from them (``state_pass_kernel``'s FROM_WRITES): each state's chain is then its update
# alone, the delta write's read and triangular solve gone from it. Every row recomputes (True), as FLA's own chunked
# delta rule does: in ``versus_fla`` on an H100 (GDN-340M, B = 4, T = 2048, bf16 autocast) linmem's model with the
# states kept stepped in 0.81x FLA's time but peaked at 1.15x its memory (18.05 against 15.70 GiB), so memory, not time,
# was the binding cost (``--sweep`` prints the bytes and times both, never choosing by time alone). "base" saves RDN a
# few milliseconds of a GDN-1.3B training step for gigabytes of peak memory (docs/benchmarks/versus_fla.md,
# ``--recompute-states base``): no row takes it. "writes" left GDN-1.3B's steps (GDN's and RDN's) as they were and
# raised their peaks by 1.5-3 GiB (the same page): no row takes it either.
PIPELINED_GROUP = 4  # PIPELINED: the chunks a base program stores between two counts (the residual one's lag)
TUNED_AT_128 = {
    "scores": dict(num_warps=4, num_stages=1),
    "inverse": dict(num_warps=1, num_stages=1, PRECISION=None),
    "forward": dict(num_warps=None, num_stages=None, BV=None, KEYS_ONCE=False, FUSED=False, PIPELINED=False,
                    PREFORMED=False),
    "output": dict(num_warps=4, num_stages=2, BV=128),
    "backward_states": dict(num_warps=None, num_stages=None, BV=None, KEYS_ONCE=False, ONE_KEY_BLOCK=False,
                            FUSED=False, PREFORMED=False),
    "backward_scores": dict(num_warps=8, num_stages=None, BV=64),
    "backward_keys": dict(num_warps=4, num_stages=None, BV=64, BK=None, SPLIT=True),
    "decay_grad": dict(num_warps=2, num_stages=1),
    "recompute_states": True,
}
WIDTH_CLASSES = (64, 128, 256)  # a head width takes the row of the smallest class at least as wide


def _row(**changes) -> dict:
    """A row of ``KERNEL_OPTIONS``: ``TUNED_AT_128`` with some kernels' options replaced (a new dict per row, so that
    changing one row leaves the others as they are)."""
    return {**TUNED_AT_128, **changes}


# The launch options by width class (K, V), each width rounded up to 64, 128 or 256: one row each, with the sweep
# (and GPU) that chose it. ``python -m linmem.bench.kernels --sweep --heads 8 --head-dim K [--value-dim V]`` times
# the candidates at one width and prints its row to paste here.
KERNEL_OPTIONS = {
    (64, 64): _row(),  # from K=128, not swept
    (64, 128): _row(),  # from K=128, not swept
    (64, 256): _row(),  # from K=128, not swept
    (128, 64): _row(),  # from K=128, not swept
    (128, 128): _row(),  # H200 sweep, RDN fwd+bwd, B=4, T=32K, H=16 (TUNED_AT_128)
    (128, 256): _row(),  # H100 busy sweep, forward and backward_states, GDN+RDN, B=4, T=2048, H=8: row stands
    (256, 64): _row(),  # from K=128, not swept
    (256, 128): _row(),  # from K=128, not swept
    (256, 256): _row(  # H100 sweep (triton 3.6), GDN+RDN fwd+bwd, B=1, T=8192, H=8 (docs/benchmarks/kernel-widths.md)
        scores=dict(num_warps=2, num_stages=1),
        inverse=dict(num_warps=1, num_stages=1, PRECISION="tf32x3"),
        forward=dict(num_warps=4, num_stages=3, BV=32, KEYS_ONCE=True, FUSED=False, PIPELINED=False, PREFORMED=False),
        output=dict(num_warps=4, num_stages=2, BV=64),
        backward_states=dict(num_warps=4, num_stages=2, BV=32, KEYS_ONCE=True, ONE_KEY_BLOCK=False, FUSED=False,
                             PREFORMED=False),
        backward_scores=dict(num_warps=8, num_stages=1, BV=64),
        backward_keys=dict(num_warps=4, num_stages=2, BV=64, BK=None, SPLIT=True),
        decay_grad=dict(num_warps=1, num_stages=1),
    ),
}
# float32 inputs (a test path, not a speed target) take narrower tiles and more warps at every width: the options
# above spill registers with float32 tiles (offline sm_90 compiles: the inverse at 2 warps, output at BV 128,
# backward_keys and backward_scores at BV 64). At K > 128 they run one stage in every kernel, whatever a row gives
# 16-bit inputs: a stage of float32 tiles takes twice the shared memory, and two stages of bf16 tiles at K = 256
# already come near the limit (``_pipeline_stages``).
FLOAT32_OPTIONS = {"inverse": dict(num_warps=4), "output": dict(BV=64),
                   "backward_scores": dict(BV=32), "backward_keys": dict(BV=32)}
INTERPRETER_BV = 16  # small value blocks under the interpreter: several blocks per head even at tiny widths


def width_class(dim: int) -> int:
    """The ``KERNEL_OPTIONS`` class of a head width: the smallest of ``WIDTH_CLASSES`` at least ``dim``."""
    for width in WIDTH_CLASSES:
        if dim <= width:
            return width
    raise ValueError(f"a head width of {dim} is over the widest launch class, {WIDTH_CLASSES[-1]}")


def kernel_options(key_dim: int, value_dim: int) -> dict:
    """The ``KERNEL_OPTIONS`` row (kernel name → launch options, and ``recompute_states``) of heads ``key_dim`` ×
    ``value_dim`` wide."""
    return KERNEL_OPTIONS[width_class(key_dim), width_class(value_dim)]


def override_options(overrides: dict | None) -> None:
    """Change every row of ``KERNEL_OPTIONS`` for the rest of the process: a kernel's entry of ``overrides`` updates
    that kernel's launch options (``{"forward": {"FUSED": True}}``), ``recompute_states`` replaces the row's. An
    unknown kernel or launch option is refused before any row changes."""
    overrides = {} if overrides is None else overrides
    if not isinstance(overrides, dict):
        raise ValueError(f"launch options are a dict of kernel names; got {overrides!r}")
    for name, opts in overrides.items():
        if name not in TUNED_AT_128:
            raise ValueError(f"no kernel {name!r} in the launch options; known: {', '.join(TUNED_AT_128)}")
        if name == "recompute_states":
            recomputed_names(opts)  # refuses an unknown choice
        elif not isinstance(opts, dict) or not set(opts) <= set(TUNED_AT_128[name]):
            raise ValueError(f"{name}: a dict of its launch options ({', '.join(TUNED_AT_128[name])}); got {opts!r}")
    for name, opts in overrides.items():
        for row in KERNEL_OPTIONS.values():
            row[name] = dict(row[name], **opts) if isinstance(opts, dict) else opts


@functools.cache
def _multiprocessors() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132  # an H100/H200, for offline compiles


# the widest value block BV=None picks per sequential pass (``_sequential_block``)
SEQUENTIAL_WIDEST = {"forward": 32, "backward_states": 64}


def _sequential_block(key_dim: int, dtype: torch.dtype, sequences: int, value_dim: int, widest: int = 32) -> int:
    """BV of a sequential pass over ``sequences`` (N·H) state columns of ``value_dim`` values: the widest of 64 (up
    to ``widest``), 32 and 16 where it fits in registers (16-bit inputs, K ≤ 128) and keeps the multiprocessors
    busy, else 16 (twice the programs: at long sequences only ``N·H·V/BV`` programs run, each latency-bound).
    On an H200 (RDN bf16, B=4, T=32K, H=16) BV = 32 beat 16 in both passes; in the reverse pass BV = 64 (4 warps,
    two stages) beat 32 where at least half a program per multiprocessor runs, while the forward pass at 64 was
    slower, hence ``widest``."""
    if key_dim > 128 or dtype == torch.float32:
        return 16
    if widest >= 64 and 2 * sequences * triton.cdiv(value_dim, 64) >= _multiprocessors():
        return 64
    return 32 if sequences * triton.cdiv(value_dim, 32) >= _multiprocessors() else 16


def _pipeline_stages(key_dim: int, dtype: torch.dtype | None) -> int:
    """num_stages of the kernels that loop over chunks or value blocks: 2 (the next iteration's tiles load during
    this one's dots) for 16-bit inputs with K ≤ 128, else 1. On an H200 (triton 3.6) two stages asked for 237–277 KiB
    of shared memory (the limit is 227 KiB) in the reverse pass with float32 inputs at K = 128 and bf16 at K = 256."""
    return 2 if dtype in (torch.bfloat16, torch.float16) and key_dim <= 128 else 1


def _options(name: str, *, key_dim: int, value_dim: int, dtype: torch.dtype | None = None,
             sequences: int = 0) -> tuple[dict, dict]:
    """(block sizes, launch options) of one kernel for heads of these widths, from their row of ``KERNEL_OPTIONS``
    (``sequences``: N·H of a sequential pass)."""
    opts = dict(kernel_options(key_dim, value_dim)[name])
    if dtype == torch.float32:
        opts.update(FLOAT32_OPTIONS.get(name, {}))
    launch = {key: opts.pop(key) for key in ("num_warps", "num_stages") if key in opts}
    if "num_warps" in launch and launch["num_warps"] is None:
        launch["num_warps"] = 8 if dtype == torch.float32 else 4
    if "num_stages" in launch and (launch["num_stages"] is None or (dtype == torch.float32 and key_dim > 128)):
        launch["num_stages"] = _pipeline_stages(key_dim, dtype)
    if opts.get("BV", 0) is None:
        opts["BV"] = _sequential_block(key_dim, dtype, sequences, value_dim, SEQUENTIAL_WIDEST.get(name, 32))
    if "BK" in opts:  # key columns per program of backward_keys (five [64, BK] float32 accumulators), up to all
        opts["BK"] = min(opts["BK"] or (32 if dtype == torch.float32 else 64), _layout.key_block(key_dim))
    if interpreting():
        launch = {}
        if "BV" in opts:
            opts["BV"] = INTERPRETER_BV
    if "BV" in opts:
        opts["BV"] = min(opts["BV"], max(16, triton.next_power_of_2(value_dim)))
    return opts, launch


class _Flags:
    """Compile-time switches shared by every kernel of one call."""

    def __init__(self, config: MemoryConfig, dtype: torch.dtype):
        self.delta = config.rule == "delta"
        self.residual = config.residual
        # without history fitting the residual memory holds one token's correction: no pass of its own
        # (_without_fitting adds that correction around the kernels)
        self.without_fitting = config.residual and not config.fit_history
        # a residual memory with sequential passes of its own (history fitting on)
        self.residual_passes = config.residual and config.fit_history
        self.gates = config.output_gates
        self.target = TARGET_CODES[config.residual_target]
        self.clip = float(config.clip)
        self.dt = dot_dtype(dtype)
        self.store_dtype = score_dtype(dtype)

    def kernel_args(self) -> dict:
        return dict(DT=self.dt, DELTA=self.delta, RESIDUAL=self.residual)


def _buf(shape, device, dtype=torch.float32):
    return _layout.new_buffer(shape, device, dtype)


def _forward(q, k, v, g, beta, gamma, base0, res0, flags: _Flags, scale: float, layout: SequenceLayout):
    n_tok, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    bk, nk = key_tiling(key_dim)
    widths = dict(key_dim=key_dim, value_dim=value_dim)
    b, key_scores, base_scores, res_scores = chunk_scores(q, k, g, layout, delta=flags.delta,
                                                          residual=flags.residual, output_gates=flags.gates,
                                                          launch=_options("scores", **widths)[1])
    inv_beta = inv_gamma = None
    if flags.delta:
        inverse_opts, inverse_launch = _options("inverse", **widths, dtype=k.dtype)
        inv_beta, inv_gamma = chunk_inverse(key_scores, g, beta, gamma if flags.residual else None, layout,
                                            inverse_launch, inverse_opts["PRECISION"])

    states = _state_passes(k, v, b, g, beta, gamma, key_scores, inv_beta, inv_gamma, base0, res0, flags, layout)
    o = _buf((n_tok, heads, value_dim), k.device, v.dtype)
    blocks, launch = _options("output", **widths, dtype=k.dtype)
    output_kernel[(triton.cdiv(value_dim, blocks["BV"]), layout.num_chunks, heads)](
        q=q, v=v, b=b, g=g, beta=beta, gamma=gamma, base_scores=base_scores, res_scores=res_scores,
        base_chunks=states["base_chunks"], res_chunks=states["res_chunks"], u_in=states["u"], w_in=states["w"], o=o,
        cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, scale=scale,
        H=heads, K=key_dim, V=value_dim, C=CHUNK, BK=bk, NK=nk, OUTPUT_GATES=flags.gates,
        **blocks, **flags.kernel_args(), **launch,
    )
    base_final, res_final = states.pop("base_final"), states.pop("res_final")
    saved = dict(b=b, key_scores=key_scores, base_scores=base_scores, res_scores=res_scores, inv_beta=inv_beta,
                 inv_gamma=inv_gamma, **states)
    return o, base_final, res_final, saved


def _state_passes(k, v, b, g, beta, gamma, key_scores, inv_beta, inv_gamma, base0, res0, flags: _Flags,
                  layout: SequenceLayout, residual_pass: bool = True, writes: dict | None = None) -> dict:
    """The sequential forward passes (forward.py ``state_pass_kernel``): each memory's state before every chunk
    (``base_chunks``, ``res_chunks`` ``[NT, H, K, V]``), its writes (u with the delta rule, w with a residual memory,
    ``[N_tok, H, V]``), the prediction error ``err`` (residual) and the final states (``[N, H, V, K]``); None where
    the memory has none. Run again in the backward with ``recompute_states``: the same launches give the same
    bits. ``residual_pass`` False runs the base memory's pass only (the residual memory's buffers stay unwritten).
    ``writes`` (``recompute_states`` "writes": the forward's u and w by name) runs each pass from them
    (``state_pass_kernel``'s FROM_WRITES: the update alone on the chain, the base memory's read only for its error):
    the same states and error, bit for bit; the writes are not stored again. Without history fitting the residual
    memory has no pass: its states, writes and final state are zeros."""
    n_tok, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    bk, nk = key_tiling(key_dim)
    residual_pass = residual_pass and flags.residual_passes
    out = state_pass_outputs(n_tok, layout.num_chunks, layout.num_seqs, heads, key_dim, value_dim, flags, k.device,
                             residual_pass, with_writes=writes is None)
    if flags.without_fitting:
        for name, like in (("res_chunks", "base_chunks"), ("w", "err"), ("res_final", "base_final")):
            out[name] = torch.zeros_like(out[like], dtype=out["base_chunks"].dtype if name == "w" else None)
    blocks, launch = _options("forward", value_dim=value_dim, key_dim=key_dim, dtype=k.dtype,
                              sequences=layout.num_seqs * heads)
    fused = blocks.pop("FUSED", False) and residual_pass
    pipelined = blocks.pop("PIPELINED", False) and residual_pass and not fused
    preformed = blocks.pop("PREFORMED", False) and flags.delta and writes is None and not (fused or pipelined)
    u_in, w_in = (None, None) if writes is None else (writes["u"], writes["w"])  # no u, w buffers then: not stored
    grid = (triton.cdiv(value_dim, blocks["BV"]), layout.num_seqs * heads)
    common = dict(k=k, b=b, g=g, cu_seqlens=layout.cu_seqlens, chunk_offsets=layout.chunk_offsets, clip=flags.clip,
                  H=heads, K=key_dim, V=value_dim, C=CHUNK, BK=bk, NK=nk, DT=flags.dt, DELTA=flags.delta,
                  TARGET=flags.target, **blocks, **launch)
    if fused:  # both memories in one program per value block (FUSED): the same products, the same buffers
        both_state_passes_kernel[grid](
            v=v, beta=beta, gamma=gamma, key_scores=key_scores, inv_beta=inv_beta, inv_gamma=inv_gamma, base0=base0,
            res0=res0, base_final=out["base_final"], res_final=out["res_final"], base_chunks=out["base_chunks"],
            res_chunks=out["res_chunks"], u_out=out["u"], w_out=out["w"], err_out=out["err"], u_in=u_in, w_in=w_in,
            **common,
        )
        return out
    if pipelined:  # both memories in one launch, the residual memory's programs PIPELINED_GROUP chunks behind
        sync = torch.zeros(1 + grid[0] * grid[1], device=k.device, dtype=torch.int32)  # tickets, chunks counted
        pipelined_state_passes_kernel[grid + (2,)](
            v=v, beta=beta, gamma=gamma, key_scores=key_scores, inv_beta=inv_beta, inv_gamma=inv_gamma, base0=base0,
            res0=res0, base_final=out["base_final"], res_final=out["res_final"], base_chunks=out["base_chunks"],
            res_chunks=out["res_chunks"], u_out=out["u"], w_out=out["w"], err_out=out["err"], u_in=u_in, w_in=w_in,
            sync=sync, GROUP=PIPELINED_GROUP, **common,
        )
        return out
    if preformed:  # each chain one read and one update, the rest in parallel kernels before and between (PREFORMED)
        _preformed_passes(out, k, v, b, g, beta, gamma, key_scores, inv_beta, inv_gamma, base0, res0, flags, layout,
                          residual_pass, grid, common)
        return out
    # the base memory (values v, strength β), emitting the prediction error for the residual memory
    state_pass_kernel[grid](
        x=v, err=None, strength=beta, inverse=inv_beta, key_scores=key_scores if flags.residual else None,
        state0=base0, state_final=out["base_final"], state_chunks=out["base_chunks"], writes_out=out["u"],
        err_out=out["err"], writes_in=u_in, write_keys=None, **common,
    )
    if residual_pass:  # the residual memory (values ρ(err), strength γ)
        state_pass_kernel[grid](
            x=None, err=out["err"], strength=gamma, inverse=inv_gamma, key_scores=None, state0=res0,
            state_final=out["res_final"], state_chunks=out["res_chunks"], writes_out=out["w"], err_out=None,
            writes_in=w_in, write_keys=None, **common,
        )
    return out


def _preformed_passes(out: dict, k, v, b, g, beta, gamma, key_scores, inv_beta, inv_gamma, base0, res0,
                      flags: _Flags, layout: SequenceLayout, residual_pass: bool, grid: tuple, common: dict) -> None:
    """``_state_passes`` with the delta writes' state-free products taken before each chain (the forward's
    PREFORMED, as FLA's chunked delta rule forms its writes): ``preformed_writes_kernel`` forms
    ``W = T_β diag(β e^b) K`` (and the residual memory's ``T_γ diag(γ e^b) K``) and ``ũ = T_β diag(β) V``, the base
    memory's pass forms ``u = ũ − W S_0ᵀ`` on its chain, ``preformed_error_kernel`` then takes the error from the
    stored states and writes and forms the residual memory's ``ũ = T_γ diag(γ) ρ(err)``, and its pass forms ``w``
    likewise. The same results as the forming passes up to rounding, into ``out``; the two W ``[N_tok, H, K]`` (in
    the storage type: the chain's dot takes them in the input type anyway) and the two ũ ``[N_tok, H, V]`` (float32:
    u = ũ − W S_0ᵀ is small beside its terms where a memory predicts its values well, and ũ rounded to bf16 before
    the difference moved RDN's bf16 dv error under the clip target from 2.5e-3 to 7.6e-2, docs/benchmarks/
    kernel-widths.md) live only during the passes."""
    n_tok, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    formed = _preformed_writes(k, v, value_dim, b, g, beta, gamma, inv_beta, inv_gamma, flags, layout,
                               residual_keys=residual_pass)
    state_pass_kernel[grid](
        x=None, err=None, strength=beta, inverse=None, key_scores=None, state0=base0, state_final=out["base_final"],
        state_chunks=out["base_chunks"], writes_out=out["u"], err_out=None, writes_in=formed["base_values"],
        write_keys=formed["base_keys"], **common,
    )
    if not flags.residual:
        return
    bk, nk = key_tiling(key_dim)
    bv, launch = _preformed_launch(key_dim, value_dim, k.dtype)
    res_values = _buf((n_tok, heads, value_dim), k.device) if residual_pass else None  # float32 (docstring)
    preformed_error_kernel[(triton.cdiv(value_dim, bv), layout.num_chunks, heads)](
        k=k, v=v, b=b, g=g, gamma=gamma, key_scores=key_scores, inv_gamma=inv_gamma, base_chunks=out["base_chunks"],
        u_in=out["u"], err_out=out["err"], res_values_out=res_values, cu_seqlens=layout.cu_seqlens,
        chunk_indices=layout.chunk_indices, clip=flags.clip, H=heads, K=key_dim, V=value_dim, C=CHUNK, BK=bk, NK=nk,
        BV=bv, DT=flags.dt, TARGET=flags.target, **launch,
    )
    if residual_pass:
        state_pass_kernel[grid](
            x=None, err=None, strength=gamma, inverse=None, key_scores=None, state0=res0,
            state_final=out["res_final"], state_chunks=out["res_chunks"], writes_out=out["w"], err_out=None,
            writes_in=res_values, write_keys=formed["res_keys"], **common,
        )


def _preformed_launch(key_dim: int, value_dim: int, dtype: torch.dtype) -> tuple[int, dict]:
    """The value block and launch options of the chunk-parallel PREFORMED kernels (``preformed_writes_kernel``,
    ``preformed_error_kernel``, ``reverse_writes_kernel``): the output kernel's, a chunk-parallel kernel alike."""
    blocks, launch = _options("output", key_dim=key_dim, value_dim=value_dim, dtype=dtype)
    return blocks["BV"], launch


def _preformed_writes(k, v, value_dim: int, b, g, beta, gamma, inv_beta, inv_gamma, flags: _Flags,
                      layout: SequenceLayout, residual_keys: bool) -> dict:
    """The delta writes' state-free products, chunk-parallel (``preformed_writes_kernel``): ``base_keys``
    ``W = T_β diag(β e^b) K`` and, with ``residual_keys``, ``res_keys`` ``T_γ diag(γ e^b) K`` (``[N_tok, H, K]`` in
    the storage type, else None); with ``v`` also ``base_values`` ``ũ = T_β diag(β) V`` (``[N_tok, H, V]`` float32,
    ``_preformed_passes`` says why; else None)."""
    n_tok, heads, key_dim = k.shape
    bk, nk = key_tiling(key_dim)
    bv, launch = _preformed_launch(key_dim, value_dim, k.dtype)
    per_key = (n_tok, heads, key_dim)
    formed = dict(base_keys=_buf(per_key, k.device, flags.store_dtype),
                  res_keys=_buf(per_key, k.device, flags.store_dtype) if residual_keys else None,
                  base_values=None if v is None else _buf((n_tok, heads, value_dim), k.device))
    value_blocks = 0 if v is None else triton.cdiv(value_dim, bv)
    preformed_writes_kernel[(nk + value_blocks, layout.num_chunks, heads)](
        k=k, v=v, b=b, g=g, beta=beta, gamma=gamma, inv_beta=inv_beta, inv_gamma=inv_gamma,
        base_keys_out=formed["base_keys"], res_keys_out=formed["res_keys"], base_values_out=formed["base_values"],
        cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, H=heads, K=key_dim, V=value_dim, C=CHUNK,
        BK=bk, NKB=nk, BV=bv, DT=flags.dt, **launch,
    )
    return formed


def state_pass_outputs(num_tokens: int, num_chunks: int, num_seqs: int, heads: int, key_dim: int, value_dim: int,
                       flags: _Flags, device, residual_pass: bool = True, with_writes: bool = True) -> dict:
    """The buffers ``_state_passes`` fills (None where the memory has none, for the residual memory's own results
    when ``residual_pass`` is False, and for the writes when ``with_writes`` is False): per-chunk states
    ``[NT, H, K, V]`` and the writes u, w in the storage type, the error err in float32, the final states
    ``[N, H, V, K]`` float32."""
    per_chunk = (num_chunks, heads, key_dim, value_dim)  # states before each chunk, [K, V]
    per_token = (num_tokens, heads, value_dim)
    final = (num_seqs, heads, value_dim, key_dim)
    residual = flags.residual and residual_pass
    return dict(base_chunks=_buf(per_chunk, device, flags.store_dtype),
                res_chunks=_buf(per_chunk, device, flags.store_dtype) if residual else None,
                u=_buf(per_token, device, flags.store_dtype) if flags.delta and with_writes else None,
                w=_buf(per_token, device, flags.store_dtype) if residual and with_writes else None,
                err=_buf(per_token, device) if flags.residual else None,
                base_final=_buf(final, device), res_final=_buf(final, device) if residual else None)


# what ``recompute_states`` leaves out of the forward's saved tensors: the state passes' results but the final states
RECOMPUTED = ("base_chunks", "res_chunks", "u", "w", "err")
# every memory's pass run again, the base memory's only, every memory's from its kept writes, none
RECOMPUTE_CHOICES = (True, "base", "writes", False)


def recomputed_names(recompute: bool | str) -> tuple[str, ...]:
    """The state passes' results the backward runs again under ``recompute_states`` = ``recompute`` (the rest are
    kept from the forward)."""
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute_states must be one of {RECOMPUTE_CHOICES}; got {recompute!r}")
    if recompute == "base":
        return ("base_chunks", "u", "err")
    if recompute == "writes":
        return ("base_chunks", "res_chunks", "err")
    return RECOMPUTED if recompute else ()


def recomputed_bytes(saved: dict, recompute: bool | str = True) -> int:
    """Bytes of a forward's saved tensors (or of ``state_pass_outputs``) that ``recompute_states`` = ``recompute``
    does not keep for the backward."""
    return sum(saved[name].numel() * saved[name].element_size() for name in recomputed_names(recompute)
               if saved[name] is not None)


def _backward(do, d_base_final, d_res_final, q, k, v, g, beta, gamma, flags: _Flags, scale, layout, saved,
              initial_grads=(True, True), d_err_out=None):
    """The gradients of q, k, v, g, β, γ and the initial states (None for γ without a residual memory, and for an
    initial state whose entry of ``initial_grads`` is False); ``d_base_final``, ``d_res_final`` may be None (no
    gradient reaches the final states). ``d_err_out`` (without history fitting, ``[N_tok, H, V]``; None for zero):
    the prediction error's gradient from outside the op, where the forward returned the error."""
    n_tok, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    dev = k.device
    bk, nk = key_tiling(key_dim)
    widths = dict(key_dim=key_dim, value_dim=value_dim)
    b = saved["b"]

    per_chunk = (layout.num_chunks, heads, key_dim, value_dim)
    per_token = (n_tok, heads, value_dim)
    initial = (layout.num_seqs, heads, value_dim, key_dim)
    # the gradients of the writes and the error feed dots in the input type; for half-precision inputs they are
    # stored in it (the elementwise uses, dv and the gate sums, are rounded to that precision anyway)
    dx = _buf(per_token, dev, flags.store_dtype)
    d_base_chunks = _buf(per_chunk, dev, flags.store_dtype)
    d_base0 = _buf(initial, dev) if initial_grads[0] else None
    blocks, launch = _options("backward_states", **widths, dtype=k.dtype, sequences=layout.num_seqs * heads)
    if blocks.pop("ONE_KEY_BLOCK"):  # dSᵀ as one [K, BV] tile: one dot per product and chunk, not one per 64 keys
        bk, nk = _layout.key_block(key_dim), 1
    # both memories' reverse passes in one launch (FUSED: both_reverse_passes_kernel)
    fused = blocks.pop("FUSED", False) and flags.residual_passes
    # each delta chain the read and the update Wᵀ du, dx = T_σᵀ du after it (PREFORMED: _preformed_reverse_writes)
    preformed = blocks.pop("PREFORMED", False) and flags.delta and not fused
    grid = (triton.cdiv(value_dim, blocks["BV"]), layout.num_seqs * heads)
    common = dict(q=q, k=k, do=do, b=b, g=g, gamma=gamma, cu_seqlens=layout.cu_seqlens,
                  chunk_offsets=layout.chunk_offsets, scale=scale, clip=flags.clip,
                  H=heads, K=key_dim, V=value_dim, C=CHUNK, BK=bk, NK=nk, DT=flags.dt, DELTA=flags.delta,
                  TARGET=flags.target, **blocks, **launch)
    dy = d_err = d_res_chunks = d_res0 = None
    if flags.without_fitting:  # no residual memory to run back: the error's gradient is given
        dy = torch.zeros(per_token, device=dev, dtype=flags.store_dtype)
        d_err = dy.clone() if d_err_out is None else d_err_out.to(flags.store_dtype)
        d_res_chunks = torch.zeros(per_chunk, device=dev, dtype=flags.store_dtype)
        d_res0 = torch.zeros(initial, device=dev) if initial_grads[1] else None
    elif flags.residual:  # the residual memory's reverse pass emits the gradient of the prediction error
        dy = _buf(per_token, dev, flags.store_dtype)
        d_err = _buf(per_token, dev, flags.store_dtype)
        d_res_chunks = _buf(per_chunk, dev, flags.store_dtype)
        d_res0 = _buf(initial, dev) if initial_grads[1] else None
    if fused:  # both memories in one program per value block, the base memory one chunk behind (FUSED)
        both_reverse_passes_kernel[grid](
            beta=beta, key_scores=saved["key_scores"], base_scores=saved["base_scores"],
            res_scores=saved["res_scores"], inv_beta=saved["inv_beta"], inv_gamma=saved["inv_gamma"],
            err=saved["err"], d_base_final=d_base_final, d_res_final=d_res_final, d_base0=d_base0, d_res0=d_res0,
            d_base_chunks=d_base_chunks, d_res_chunks=d_res_chunks, dx_out=dx, dy_out=dy, d_err_out=d_err,
            READ_BM=not flags.gates, GATED=flags.gates, **common,
        )
    else:
        if preformed:  # W of each memory, and dx (dy, d_err) formed after each pass
            write_keys, writes = _preformed_reverse_writes(k, g, beta, gamma, value_dim, saved, flags, layout)
        else:
            write_keys, writes = {"base": None, "res": None}, None
        if flags.residual_passes:  # the residual memory first: it emits d_err
            reverse_pass_kernel[grid](
                strength=gamma, key_scores=None, scores=saved["res_scores"], inverse=saved["inv_gamma"],
                err=saved["err"], write_keys=write_keys["res"], d_err_in=None, d_final=d_res_final,
                d_initial=d_res0, d_chunks=d_res_chunks, dx_out=dy, d_err_out=None if preformed else d_err,
                READ_BM=False, GATED=flags.gates, **common,
            )
            if preformed:
                writes(dx=dy, strength=gamma, inverse=saved["inv_gamma"], err=saved["err"], d_err_out=d_err)
        # the base memory, taking the error's gradient (RLA/RDN)
        reverse_pass_kernel[grid](
            strength=beta, key_scores=saved["key_scores"] if flags.residual else None, scores=saved["base_scores"],
            inverse=saved["inv_beta"], err=None, write_keys=write_keys["base"], d_err_in=d_err,
            d_final=d_base_final, d_initial=d_base0, d_chunks=d_base_chunks, dx_out=dx, d_err_out=None,
            READ_BM=flags.residual and not flags.gates, GATED=False, **common,
        )
        if preformed:
            writes(dx=dx, strength=beta, inverse=saved["inv_beta"], err=None, d_err_out=None)

    # partial sums of the per-token gate gradients: one slot per key block of backward_keys, then one from
    # backward_scores, then (SPLIT) one per key block of its query launch
    key_blocks, key_launch = _options("backward_keys", **widths, dtype=k.dtype)
    keys_bk = key_blocks.pop("BK")
    split = key_blocks.pop("SPLIT")
    keys_nk = triton.cdiv(key_dim, keys_bk)
    n_parts = 2 * keys_nk + 1 if split else keys_nk + 1
    part_names = ("db_part", "dbm_part", "dbeta_part", "dgamma_part")[:4 if flags.residual else 3]
    parts = dict(zip(part_names, _buf((len(part_names), n_parts, n_tok, heads), dev).unbind(0)))
    parts.setdefault("dgamma_part", None)
    score_parts = {name: None if part is None else part[keys_nk] for name, part in parts.items()}
    part_stride = n_tok * heads
    dv = _buf(per_token, dev, v.dtype)
    e_q = _buf((n_tok, heads, CHUNK), dev, flags.store_dtype)
    e_k = _buf((n_tok, heads, CHUNK), dev, flags.store_dtype)
    # what the chunk-parallel kernels read of the forward and of the reverse passes (None where a memory or rule has
    # no such tensor)
    inputs = dict(v=v, do=do, b=b, g=g, beta=beta, gamma=gamma, u_in=saved["u"], w_in=saved["w"],
                  err_in=saved["err"], dx_in=dx, dy_in=dy, derr_in=d_err, cu_seqlens=layout.cu_seqlens,
                  chunk_indices=layout.chunk_indices, scale=scale, clip=flags.clip, H=heads, V=value_dim, C=CHUNK,
                  OUTPUT_GATES=flags.gates, TARGET=flags.target, **flags.kernel_args())
    blocks, launch = _options("backward_scores", **widths, dtype=k.dtype)
    backward_scores_kernel[(layout.num_chunks, heads)](
        key_scores=saved["key_scores"], base_scores=saved["base_scores"], res_scores=saved["res_scores"], dv=dv,
        e_q=e_q, e_k=e_k, **score_parts, **inputs, **blocks, **launch,
    )

    dq = _buf(q.shape, dev, q.dtype)
    dk = _buf(k.shape, dev, k.dtype)
    db_end_part = _buf((keys_nk, layout.num_chunks, heads), dev)
    # dq and dk in one launch, or (SPLIT) dk then dq, each with fewer accumulators
    for queries, keys, first_slot in ([(None, dk, 0), (dq, None, keys_nk + 1)] if split else [(dq, dk, 0)]):
        backward_keys_kernel[(layout.num_chunks, heads, keys_nk)](
            q=q, k=k, e_q=e_q, e_k=e_k, base_chunks=saved["base_chunks"], res_chunks=saved["res_chunks"],
            d_base_chunks=d_base_chunks, d_res_chunks=d_res_chunks, dq=queries, dk=keys, db_end_part=db_end_part,
            part_stride=part_stride, first_slot=first_slot, n_chunks_total=layout.num_chunks, K=key_dim,
            BK=keys_bk, **parts, **inputs, **key_blocks, **key_launch,
        )

    dg = _buf((n_tok, heads), dev)
    dbeta = _buf((n_tok, heads), dev)
    dgamma = _buf((n_tok, heads), dev) if flags.residual else None
    decay_grad_kernel[(layout.num_chunks, heads)](
        **parts, db_end_part=db_end_part, dg=dg, dbeta=dbeta, dgamma=dgamma, part_stride=part_stride,
        cu_seqlens=layout.cu_seqlens,
        chunk_indices=layout.chunk_indices, n_chunks_total=layout.num_chunks, H=heads, C=CHUNK, PARTS=n_parts,
        END_PARTS=keys_nk, **_options("decay_grad", **widths)[1],
    )
    return dq, dk, dv, dg, dbeta, dgamma, d_base0, d_res0


def _preformed_reverse_writes(k, g, beta, gamma, value_dim: int, saved: dict, flags: _Flags,
                              layout: SequenceLayout):
    """What the reverse passes' PREFORMED takes: each delta memory's ``W = T_σ diag(σ e^b) K`` (``{"base": W_β,
    "res": W_γ or None}``, ``[N_tok, H, K]`` in the storage type, formed by ``preformed_writes_kernel``), and a
    launcher of ``reverse_writes_kernel`` that turns the du a pass stored in ``dx`` into ``T_σᵀ du`` in place (with
    the residual memory's ``d_err_out``, its error's gradient too)."""
    heads = k.shape[1]
    formed = _preformed_writes(k, None, value_dim, saved["b"], g, beta, gamma, saved["inv_beta"], saved["inv_gamma"],
                               flags, layout, residual_keys=flags.residual_passes)
    bv, launch = _preformed_launch(k.shape[-1], value_dim, k.dtype)

    def writes(dx, strength, inverse, err, d_err_out):
        reverse_writes_kernel[(triton.cdiv(value_dim, bv), layout.num_chunks, heads)](
            dx=dx, strength=strength, inverse=inverse, err=err, d_err_out=d_err_out, cu_seqlens=layout.cu_seqlens,
            chunk_indices=layout.chunk_indices, clip=flags.clip, H=heads, V=value_dim, C=CHUNK, BV=bv,
            DT=flags.dt, TARGET=flags.target, **launch,
        )

    return {"base": formed["base_keys"], "res": formed["res_keys"]}, writes


SAVED_INPUTS = 8  # what LinearMemoryFunction saves before its forward's results: q, k, v, g, β, γ, the initial states


class LinearMemoryFunction(torch.autograd.Function):
    """Both memories over packed sequences. Inputs on the flattened layout: ``q, k [N_tok, H, K]``,
    ``v [N_tok, H, V]``, ``g, beta, gamma [N_tok, H]`` float32, states ``[N, H, V, K]`` float32. Returns the output,
    the final states and, with ``fit_history=False`` (``_without_fitting``), the base memory's prediction error
    ``v_t − S_{t−1} k_t`` (``[N_tok, H, V]`` float32; else None), whose gradient reaches the base memory."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, gamma, base0, res0, config, scale, layout):
        flags = _Flags(config, q.dtype)
        store = any(ctx.needs_input_grad)
        o, base_final, res_final, saved = _forward(q, k, v, g, beta, gamma, base0, res0, flags, scale, layout)
        err = saved["err"] if flags.without_fitting else None
        if store:
            # with recompute_states the backward runs the state passes (all, or the base memory's) again, from the
            # initial states
            choice = kernel_options(k.shape[-1], v.shape[-1])["recompute_states"]
            ctx.recompute, ctx.from_writes = recomputed_names(choice), choice == "writes"
            saved.update(dict.fromkeys(ctx.recompute))
            ctx.flags, ctx.scale, ctx.layout, ctx.saved_names = flags, scale, layout, tuple(saved)
            # every kept tensor goes through save_for_backward, never a ctx attribute: autograd frees those once the
            # backward has run, while a ctx attribute lives as long as the graph, into the next step's forward
            # wherever a training loop still holds the last loss
            ctx.save_for_backward(q, k, v, g, beta, gamma, *((base0, res0) if ctx.recompute else (None, None)),
                                  *saved.values())  # the first SAVED_INPUTS, then the forward's results
            ctx.set_materialize_grads(False)  # no gradient of the final states: the reverse passes start from zero
        return o, base_final, res_final, err

    @staticmethod
    def backward(ctx, do, d_base_final, d_res_final, d_err=None):
        tensors = ctx.saved_tensors  # read once: non-reentrant checkpointing unpacks each saved tensor only once
        q, k, v, g, beta, gamma, base0, res0 = tensors[:SAVED_INPUTS]
        flags = ctx.flags
        saved = saved_for_backward(ctx, tensors)
        if ctx.recompute:
            states = _state_passes(k, v, saved["b"], g, beta, gamma, saved["key_scores"], saved["inv_beta"],
                                   saved["inv_gamma"], base0, res0, flags, ctx.layout,
                                   residual_pass="res_chunks" in ctx.recompute,
                                   writes=saved if ctx.from_writes else None)
            saved = dict(saved, **{name: states[name] for name in ctx.recompute})
        do = torch.zeros_like(v) if do is None else do.contiguous()
        finals = [None if d is None else d.float().contiguous() for d in (d_base_final, d_res_final)]
        grads = _backward(do, *finals, q, k, v, g, beta, gamma, flags, ctx.scale, ctx.layout, saved,
                          initial_grads=ctx.needs_input_grad[6:8],
                          d_err_out=None if d_err is None else d_err.contiguous())
        dq, dk, dv, dg, dbeta, dgamma, d_base0, d_res0 = grads
        return dq, dk, dv, dg, dbeta, dgamma, d_base0, d_res0, None, None, None


def saved_for_backward(node, tensors: tuple | None = None) -> dict:
    """What the forward of a ``LinearMemoryFunction`` node (its ``ctx``, the ``grad_fn`` of its output) keeps for the
    backward, by name (``_forward``'s ``saved``; None for what ``recompute_states`` leaves out), from ``tensors``
    (the node's ``saved_tensors``, read here when None). Readable until the backward has run."""
    tensors = node.saved_tensors if tensors is None else tensors
    return dict(zip(node.saved_names, tensors[SAVED_INPUTS:]))


def triton_forward(x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                   config: MemoryConfig, scale: float,
                   packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``Backend`` contract (``linmem.ops.backend``) on the fused Triton kernels, for inputs ``unsupported``
    finds nothing against.

    q, k, v may be bfloat16, float16 or float32 (dots in that type, states carried in float32). ``packed``
    (B == 1) runs packed sequences natively.
    """
    q, k, v, g, beta, gamma = x
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if length == 0:
        return v.new_zeros(v.shape), base_state, residual_state
    if packed is None:
        layout = SequenceLayout.fixed(batch, length, q.device)
    else:
        layout = packed.derived(("triton layout", q.device), lambda: SequenceLayout.packed(packed.bounds, q.device))
    flat = lambda t: t.reshape(batch * length, *t.shape[2:]).contiguous()  # noqa: E731
    if g is not None and g.dim() == 4:  # GLA: a decay per key channel, walked token after token (per_key_decay.py)
        o, base_final = PerKeyDecayFunction.apply(flat(q), flat(k), flat(v), flat(g.float()), flat(beta.float()),
                                                  base_state.float().contiguous(), float(scale), layout.cu_seqlens)
        return o.reshape(batch, length, heads, value_dim), base_final, None
    gates = [flat(t.float()) for t in (g, beta)] + [flat(gamma.float()) if config.residual else None]
    if config.residual and not config.fit_history:
        o, base_final, res_final = _without_fitting(flat(q), flat(k), flat(v), *gates, base_state, residual_state,
                                                    config, float(scale), layout)
    else:
        o, base_final, res_final, _ = LinearMemoryFunction.apply(
            flat(q), flat(k), flat(v), *gates, base_state.float().contiguous(),
            residual_state.float().contiguous() if config.residual else None, config, float(scale), layout,
        )
    return o.reshape(batch, length, heads, value_dim), base_final, res_final


def _without_fitting(q, k, v, g, beta, gamma, base_state, residual_state, config: MemoryConfig, scale: float,
                     layout: SequenceLayout):
    """RLA/RDN without history fitting on the flattened layout (``LinearMemoryFunction``'s inputs): the residual
    memory holds only this step's correction, ``R_t = r_t k_tᵀ`` with ``r_t = ρ(v_t − S_{t−1} k_t)``, so that
    ``o_t = scale·(α_t S_{t−1} q_t + γ_t (k_tᵀ q_t) r_t)`` (without output gates ``S_{t−1} q_t`` and no γ). The
    kernels run the base memory alone (no residual pass, its states zero, γ given as 0), so that their output is
    the base read, and return the prediction error; the per-token correction is added here, and the error's
    gradient enters the base memory's reverse pass. The final residual state is each sequence's
    last correction (``residual_state`` for an empty sequence). Returns ``o [N_tok, H, V]`` and the final states."""
    base_read, base_final, _, err = LinearMemoryFunction.apply(
        q, k, v, g, beta, torch.zeros_like(gamma), base_state.float().contiguous(), None, config, scale, layout,
    )
    r = rho(err, config.residual_target, config.clip)
    # elementwise products and sums, not matmuls, so that an enclosing autocast keeps them in float32
    key_query = (k.float() * q.float()).sum(-1, keepdim=True)
    strength = gamma[..., None] if config.output_gates else 1.0
    o = (base_read.float() + scale * strength * key_query * r).to(base_read.dtype)
    starts, ends = layout.cu_seqlens[:-1].long(), layout.cu_seqlens[1:].long()
    last = (ends - 1).clamp_min(0)
    correction = r[last][..., :, None] * k[last].float()[..., None, :]  # [N, H, V, K]
    res_final = torch.where((ends > starts)[:, None, None, None], correction, residual_state.float())
    return o, base_final, res_final


def unsupported(x: MemoryInputs, config: MemoryConfig) -> str | None:
    """None when the kernels run these inputs, else why not: float64, a per-key-channel decay ``g [B, T, H, K]``
    with any memory but the additive one without a residual (GLA's), head widths over
    ``MAX_WIDTH`` (for GLA's memory only the key width: its token walk splits the value rows over programs, so FLA's
    GLA-1.3B heads, K = 256 and V = 512, stay on the kernels)."""
    per_key = x.g is not None and x.g.dim() == 4
    gla = config.rule == "additive" and not config.residual
    key_dim, value_dim = x.q.shape[-1], x.v.shape[-1]
    if x.q.dtype == torch.float64:
        return "q, k and v are float64 (the kernels take float32, bfloat16 and float16)"
    if per_key and not gla:
        return "g is a per-key-channel decay [B, T, H, K] with a residual memory (kernels exist for GLA's memory only)"
    if key_dim > MAX_WIDTH or (value_dim > MAX_WIDTH and not (per_key and gla)):
        return f"the heads are K = {key_dim}, V = {value_dim} wide (the kernels take up to {MAX_WIDTH})"
    return None


TRITON = Backend("triton", triton_forward, native_inputs=True, unsupported=unsupported)
