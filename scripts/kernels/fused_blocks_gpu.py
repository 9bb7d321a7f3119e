"""The fused block kernels of ``linmem.ops.fused`` on a GPU: float64 checks and time against their eager versions.

    python scripts/kernels/fused_blocks_gpu.py [--tokens 8192] [--hidden 2048] [--out FILE.json]

For each op at a 1.3B-model shape (``--tokens`` rows of ``--hidden`` channels, bf16 inputs as under autocast):
the Triton path's output and every gradient against the eager path run in float64 on the same inputs (the largest
relative error, ``max |Δ| / max |reference|``), then forward+backward time (``triton.testing.do_bench`` median) of
the Triton path and of the eager path in the input dtype, and the memory autograd keeps between forward and
backward (allocated after the forward minus before it, the inputs excluded), both ways.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from linmem.ops.fused.conv import short_conv
from linmem.ops.fused.cross_entropy import token_cross_entropy
from linmem.ops.fused.norms import gated_rms_norm, l2_norm, rms_norm
from linmem.ops.fused.swiglu import swiglu_linear


def cases(tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    """name -> (function of (inputs..., prefer_triton), input tensors)."""
    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device="cuda") * scale).to(dt)

    inner = 256 * ((int(hidden * 8 / 3) + 255) // 256)
    heads, width = hidden // 256, 256
    return {
        "rms_norm": (lambda x, w, p: rms_norm(x, w, 1e-6, prefer_triton=p),
                     [rand(tokens, hidden, dt=torch.float32), rand(hidden, dt=torch.float32) + 1]),
        "add + rms_norm": (lambda x, r, w, p: torch.cat([t.float().flatten() for t in
                                                          rms_norm(x, w, 1e-6, residual=r, prefer_triton=p)]),
                           [rand(tokens, hidden), rand(tokens, hidden, dt=torch.float32),
                            rand(hidden, dt=torch.float32) + 1]),
        "gated_rms_norm": (lambda x, g, w, p: gated_rms_norm(x, g, w, 1e-5, prefer_triton=p),
                           [rand(tokens, heads, width), rand(tokens, heads, width),
                            rand(width, dt=torch.float32) + 1]),
        "l2_norm": (lambda x, p: l2_norm(x, prefer_triton=p), [rand(tokens, heads, width)]),
        "short_conv + silu (q, k, v)": (
            lambda x, w, p: short_conv(x, w, activation="silu", prefer_triton=p),
            [rand(tokens // 2048 or 1, min(tokens, 2048), 3 * hidden), rand(3 * hidden, 4, scale=0.5,
                                                                              dt=torch.float32)]),
        "swiglu_linear": (lambda g, u, w, p: swiglu_linear(g, u, w, prefer_triton=p),
                          [rand(tokens, inner), rand(tokens, inner), rand(hidden, inner, scale=inner ** -0.5)]),
        "cross entropy (vocab 32000)": (
            lambda x, p: token_cross_entropy(x, TARGETS[x.shape[0]], prefer_triton=p),
            [rand(tokens, 32000, scale=3)]),
    }


TARGETS: dict[int, torch.Tensor] = {}


def run_case(fn, inputs, prefer_triton: bool, grad_out: torch.Tensor | None = None):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, prefer_triton)
    grad_out = torch.randn_like(out, dtype=torch.float32).to(out.dtype) if grad_out is None else grad_out
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves], grad_out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def kept_bytes(fn, inputs, prefer_triton: bool) -> int:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(*leaves, prefer_triton)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    TARGETS[args.tokens] = torch.randint(0, 32000, (args.tokens,), device="cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.tokens} tokens, hidden {args.hidden}, bf16 inputs (float32 weights and residual stream)")
    print(f"{'op':30} {'max rel err (out, grads)':>26} {'fused ms':>9} {'eager ms':>9} {'speed-up':>8} "
          f"{'kept MiB fused':>14} {'kept MiB eager':>14}")
    for name, (fn, inputs) in cases(args.tokens, args.hidden, torch.bfloat16).items():
        out, grads, grad_out = run_case(fn, inputs, True)
        exact = [t.double() for t in inputs]
        ref, ref_grads, _ = run_case(fn, exact, False, grad_out.double())
        errors = [relative(out, ref)] + [relative(g, r) for g, r in zip(grads, ref_grads) if r is not None]

        def step(prefer, fn=fn, inputs=inputs, grad_out=grad_out):
            leaves = [t.detach().requires_grad_() for t in inputs]
            fn(*leaves, prefer).backward(grad_out)

        fused_ms = triton.testing.do_bench(lambda: step(True))
        eager_ms = triton.testing.do_bench(lambda: step(False))
        kept = [kept_bytes(fn, inputs, p) / 2**20 for p in (True, False)]
        rows.append(dict(op=name, errors=errors, fused_ms=fused_ms, eager_ms=eager_ms, kept_mib_fused=kept[0],
                         kept_mib_eager=kept[1]))
        print(f"{name:30} {max(errors):>26.2e} {fused_ms:>9.3f} {eager_ms:>9.3f} {eager_ms / fused_ms:>7.2f}x "
              f"{kept[0]:>14.1f} {kept[1]:>14.1f}")
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                            triton=triton.__version__, tokens=args.tokens, hidden=args.hidden,
                                            rows=rows), indent=1))


if __name__ == "__main__":
    main()
