"""The autograd Function that chains the kernels, and ``triton_forward``, the backend entry point.

Forward: scores.py (in-chunk decays and score rows) → inverse.py (delta rule) → forward.py (sequential over chunks,
both memories). When a gradient is needed the forward pass also stores the states before every chunk and the
per-token writes; the backward pass is backward_states.py (reverse over chunks) → backward_scores.py →
backward_keys.py → decay_grad.py, all on the same flattened layout (layout.py).
"""

from __future__ import annotations

import torch
import triton

from linmem.ops.config import MemoryConfig
from linmem.ops.triton import layout as _layout
from linmem.ops.triton.backward_keys import backward_keys_kernel
from linmem.ops.triton.backward_scores import backward_scores_kernel
from linmem.ops.triton.backward_states import backward_states_kernel
from linmem.ops.triton.decay_grad import decay_grad_kernel
from linmem.ops.triton.forward import forward_kernel
from linmem.ops.triton.inverse import chunk_inverse
from linmem.ops.triton.layout import CHUNK, SequenceLayout, dot_dtype, interpreting, key_block
from linmem.ops.triton.primitives import TARGET_CODES
from linmem.ops.triton.scores import chunk_scores

# Launch options per kernel on a GPU (linmem.bench.kernels times alternatives; the interpreter ignores them).
# BV: value rows per program (the sequential passes hold two [BV, K] float32 states), BK: key columns per program.
# num_stages=1: Triton's default software pipelining (3 stages) multi-buffers every tile of these long loop bodies;
# on Triton 3.6 that asked for 248 KB (bf16) to 502 KB (fp32) of shared memory on an H200 (limit 227 KB).
KERNEL_OPTIONS = {
    "scores": dict(num_warps=4),
    "inverse": dict(num_warps=4),
    "forward": dict(num_warps=8, num_stages=1, BV=32),
    "backward_states": dict(num_warps=8, num_stages=1, BV=32),
    "backward_scores": dict(num_warps=8, num_stages=1, BV=64),
    "backward_keys": dict(num_warps=8, num_stages=1, BK=64, BV=32),
    "decay_grad": dict(num_warps=4),
}


def _options(name: str, key_dim: int = 0, value_dim: int = 0) -> tuple[dict, dict]:
    """(block sizes, launch options) of one kernel for these widths."""
    opts = dict(KERNEL_OPTIONS[name])
    launch = {key: opts.pop(key) for key in ("num_warps", "num_stages") if key in opts}
    if interpreting():
        launch = {}
    if "BV" in opts:
        cap = 16 if key_dim > 128 and name in ("forward", "backward_states") else opts["BV"]
        opts["BV"] = min(cap, max(16, triton.next_power_of_2(value_dim)))
    if "BK" in opts:
        opts["BK"] = min(opts["BK"], key_block(key_dim))
    return opts, launch


class _Flags:
    """Compile-time switches shared by every kernel of one call."""

    def __init__(self, config: MemoryConfig, dtype: torch.dtype):
        self.delta = config.rule == "delta"
        self.residual = config.residual
        self.gates = config.output_gates
        self.target = TARGET_CODES[config.residual_target]
        self.clip = float(config.clip)
        self.dt = dot_dtype(dtype)

    def kernel_args(self) -> dict:
        return dict(DT=self.dt, DELTA=self.delta, RESIDUAL=self.residual, OUTPUT_GATES=self.gates)


def _forward(q, k, v, g, beta, gamma, base0, res0, flags: _Flags, scale: float, layout: SequenceLayout, store: bool):
    n_tok, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    b, key_scores, base_scores, res_scores = chunk_scores(q, k, g, layout, delta=flags.delta,
                                                          residual=flags.residual, output_gates=flags.gates,
                                                          launch=_options("scores")[1])
    inv_beta = inv_gamma = None
    if flags.delta:
        inv_beta, inv_gamma = chunk_inverse(key_scores, g, beta, gamma if flags.residual else None, layout,
                                            _options("inverse")[1])

    dev = k.device
    o = _buf((n_tok, heads, value_dim), dev, v.dtype)
    base_final = _buf((layout.num_seqs, heads, value_dim, key_dim), dev)
    res_final = _buf(base_final.shape, dev, base_final.dtype) if flags.residual else None
    saved = {}
    if store:
        per_chunk = (layout.num_chunks, heads, value_dim, key_dim)
        per_token = (n_tok, heads, value_dim)
        saved["base_chunks"] = _buf(per_chunk, dev)
        saved["u"] = _buf(per_token, dev)
        if flags.delta or flags.residual:
            saved["err"] = _buf(per_token, dev)
        if flags.residual:
            saved["res_chunks"] = _buf(per_chunk, dev)
            saved["w"] = _buf(per_token, dev)
            saved["eps"] = _buf(per_token, dev)
            if flags.gates:
                saved["res_read"] = _buf(per_token, dev)
    dummy = b
    blocks, launch = _options("forward", key_dim, value_dim)
    grid = (triton.cdiv(value_dim, blocks["BV"]), layout.num_seqs * heads)
    forward_kernel[grid](
        q, k, v, b, g, beta, gamma if gamma is not None else dummy,
        _or(key_scores, dummy), base_scores, _or(res_scores, dummy), _or(inv_beta, dummy), _or(inv_gamma, dummy),
        base0, _or(res0, dummy), o, base_final, _or(res_final, dummy),
        *(saved.get(name, dummy) for name in ("base_chunks", "res_chunks", "u", "w", "err", "eps", "res_read")),
        layout.cu_seqlens, layout.chunk_offsets, scale, flags.clip,
        H=heads, K=key_dim, V=value_dim, C=CHUNK, BK=key_block(key_dim), TARGET=flags.target,
        STORE=store, **blocks, **flags.kernel_args(), **launch,
    )
    prepared = dict(b=b, key_scores=key_scores, base_scores=base_scores, res_scores=res_scores, inv_beta=inv_beta,
                    inv_gamma=inv_gamma)
    return o, base_final, res_final, prepared, saved


def _buf(shape, device, dtype=torch.float32):
    return _layout.new_buffer(shape, device, dtype)


def _or(t, dummy):
    return dummy if t is None else t


def _backward(do, d_base_final, d_res_final, q, k, v, g, beta, gamma, flags: _Flags, scale, layout, prepared, saved):
    n_tok, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    dev = k.device
    dummy = prepared["b"]
    b = prepared["b"]
    p = {name: _or(t, dummy) for name, t in prepared.items()}
    s = {name: saved.get(name, dummy) for name in ("base_chunks", "res_chunks", "u", "w", "err", "eps", "res_read")}

    per_chunk = (layout.num_chunks, heads, value_dim, key_dim)
    per_token = (n_tok, heads, value_dim)
    d_base_chunks = _buf(per_chunk, dev)
    d_res_chunks = _buf(per_chunk, dev) if flags.residual else dummy
    du = _buf(per_token, dev)
    dw = _buf(per_token, dev) if flags.residual else dummy
    d_err = _buf(per_token, dev) if flags.residual else dummy
    d_base0 = _buf((layout.num_seqs, heads, value_dim, key_dim), dev)
    d_res0 = _buf(d_base0.shape, dev, d_base0.dtype) if flags.residual else None
    blocks, launch = _options("backward_states", key_dim, value_dim)
    backward_states_kernel[(triton.cdiv(value_dim, blocks["BV"]), layout.num_seqs * heads)](
        q, k, do, b, g, beta, _or(gamma, dummy), p["key_scores"], p["base_scores"], p["res_scores"], p["inv_beta"],
        p["inv_gamma"], s["err"], d_base_final, _or(d_res_final, dummy), d_base0, _or(d_res0, dummy),
        d_base_chunks, d_res_chunks, du, dw, d_err, layout.cu_seqlens, layout.chunk_offsets, scale, flags.clip,
        H=heads, K=key_dim, V=value_dim, C=CHUNK, BK=key_block(key_dim), TARGET=flags.target,
        **blocks, **flags.kernel_args(), **launch,
    )

    key_blocks, key_launch = _options("backward_keys", key_dim, value_dim)
    n_kblocks = triton.cdiv(key_dim, key_blocks["BK"])
    dv = _buf((n_tok, heads, value_dim), dev, v.dtype)
    dbeta = _buf((n_tok, heads), dev)
    dgamma = _buf((n_tok, heads), dev) if flags.residual else dummy
    e_q = _buf((n_tok, heads, CHUNK), dev)
    e_k = _buf((n_tok, heads, CHUNK), dev)
    db_part = _buf((n_kblocks + 1, n_tok, heads), dev)
    dbm_part = _buf((n_kblocks + 1, n_tok, heads), dev)
    blocks, launch = _options("backward_scores", key_dim, value_dim)
    backward_scores_kernel[(layout.num_chunks, heads)](
        v, do, b, g, beta, _or(gamma, dummy), p["key_scores"], p["base_scores"], p["res_scores"], s["u"], s["w"],
        s["err"], s["eps"], s["res_read"], du, dw, d_err, dv, dbeta, dgamma, e_q, e_k, db_part[n_kblocks],
        dbm_part[n_kblocks], layout.cu_seqlens, layout.chunk_indices, scale,
        H=heads, V=value_dim, C=CHUNK, **blocks, **flags.kernel_args(), **launch,
    )

    dq = _buf(q.shape, dev, q.dtype)
    dk = _buf(k.shape, dev, k.dtype)
    db_end_part = _buf((n_kblocks, layout.num_chunks, heads), dev)
    backward_keys_kernel[(layout.num_chunks, heads, n_kblocks)](
        q, k, do, b, g, beta, _or(gamma, dummy), e_q, e_k, s["u"], s["w"], du, dw, d_err,
        s["base_chunks"], s["res_chunks"], d_base_chunks, d_res_chunks, dq, dk, db_part, dbm_part, db_end_part,
        layout.cu_seqlens, layout.chunk_indices, scale, n_tok, layout.num_chunks,
        H=heads, K=key_dim, V=value_dim, C=CHUNK, **key_blocks, **flags.kernel_args(), **key_launch,
    )

    dg = _buf((n_tok, heads), dev)
    decay_grad_kernel[(layout.num_chunks, heads)](
        db_part, dbm_part, db_end_part, dg, layout.cu_seqlens, layout.chunk_indices, n_tok, layout.num_chunks,
        H=heads, C=CHUNK, PARTS=n_kblocks + 1, END_PARTS=n_kblocks, **_options("decay_grad")[1],
    )
    return dq, dk, dv, dg, dbeta, (dgamma if flags.residual else None), d_base0, d_res0


class LinearMemoryFunction(torch.autograd.Function):
    """Both memories over packed sequences. Inputs on the flattened layout: ``q, k [N_tok, H, K]``,
    ``v [N_tok, H, V]``, ``g, beta, gamma [N_tok, H]`` float32, states ``[N, H, V, K]`` float32."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, gamma, base0, res0, config, scale, layout):
        flags = _Flags(config, q.dtype)
        store = any(ctx.needs_input_grad)
        o, base_final, res_final, prepared, saved = _forward(q, k, v, g, beta, gamma, base0, res0, flags, scale,
                                                             layout, store)
        if store:
            ctx.flags, ctx.scale, ctx.layout = flags, scale, layout
            ctx.prepared, ctx.saved = prepared, saved
            ctx.save_for_backward(q, k, v, g, beta, gamma)
        return o, base_final, res_final

    @staticmethod
    def backward(ctx, do, d_base_final, d_res_final):
        q, k, v, g, beta, gamma = ctx.saved_tensors
        flags = ctx.flags
        state_shape = (ctx.layout.num_seqs, k.shape[1], v.shape[2], k.shape[2])
        if d_base_final is None:
            d_base_final = torch.zeros(state_shape, device=k.device, dtype=torch.float32)
        if flags.residual:
            d_res_final = torch.zeros_like(d_base_final) if d_res_final is None else d_res_final.float().contiguous()
        d_base_final = d_base_final.float().contiguous()
        grads = _backward(do.contiguous(), d_base_final, d_res_final, q, k, v, g, beta, gamma, flags, ctx.scale,
                          ctx.layout, ctx.prepared, ctx.saved)
        dq, dk, dv, dg, dbeta, dgamma, d_base0, d_res0 = grads
        return dq, dk, dv, dg, dbeta, dgamma, d_base0, d_res0, None, None, None


def triton_forward(q, k, v, g, beta, gamma, base_state, residual_state, config: MemoryConfig, scale: float,
                   cu_seqlens: torch.Tensor | None = None):
    """The ``chunk_forward`` contract (``q, k [B, T, H, K]``, ``v [B, T, H, V]``, gates ``[B, T, H]``, states
    ``[N, H, V, K]``; returns ``o [B, T, H, V]`` and the final states), on the fused Triton kernels.

    q, k, v may be bfloat16, float16 or float32 (dots in that type, states in float32). ``cu_seqlens`` (host-checked
    boundaries, B == 1) runs packed sequences natively. Falls back to the chunk backend (plain PyTorch autograd) for
    float64 inputs, per-key-channel decay ``g [B, T, H, K]`` and ``fit_history=False``.
    """
    if q.dtype == torch.float64 or g.dim() == 4 or (config.residual and not config.fit_history):
        return _fallback(q, k, v, g, beta, gamma, base_state, residual_state, config, scale, cu_seqlens)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if length == 0:
        return v.new_zeros(v.shape), base_state, residual_state
    if cu_seqlens is None:
        layout = SequenceLayout.fixed(batch, length, q.device)
    else:
        layout = SequenceLayout.packed([int(x) for x in cu_seqlens.tolist()], q.device)
    flat = lambda t: t.reshape(batch * length, *t.shape[2:]).contiguous()  # noqa: E731
    gates = [flat(t.float()) for t in (g, beta)] + [flat(gamma.float()) if config.residual else None]
    o, base_final, res_final = LinearMemoryFunction.apply(
        flat(q), flat(k), flat(v), *gates, base_state.float().contiguous(),
        residual_state.float().contiguous() if config.residual else None, config, float(scale), layout,
    )
    return o.reshape(batch, length, heads, value_dim), base_final, res_final


def _fallback(q, k, v, g, beta, gamma, base_state, residual_state, config, scale, cu_seqlens):
    """The chunk backend in the state dtype, one sequence at a time for packed input."""
    from linmem.ops.chunk import chunk_forward

    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    args = [cast(t) for t in (q, k, v, g, beta, gamma)]
    if cu_seqlens is None:
        return chunk_forward(*args, cast(base_state), cast(residual_state), config, scale)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    outs, base_finals, res_finals = [], [], []
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        part = [None if t is None else t[:, start:end] for t in args]
        o, s, r = chunk_forward(*part, cast(base_state[n:n + 1]),
                                None if residual_state is None else cast(residual_state[n:n + 1]), config, scale)
        outs.append(o)
        base_finals.append(s)
        res_finals.append(r)
    res_final = torch.cat(res_finals) if residual_state is not None else None
    return torch.cat(outs, dim=1), torch.cat(base_finals), res_final


triton_forward.native_inputs = True  # linear_memory passes bf16/fp16 q, k, v and cu_seqlens through unchanged
