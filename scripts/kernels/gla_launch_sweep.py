"""Time GLA's token-walk kernels (linmem/ops/triton/per_key_decay.py) under several launches: the state tile's size
in float32 elements and the warps of each program. The table behind ``NARROW_LAUNCH`` / ``WIDE_LAUNCH``
(docs/benchmarks/gla/launch.md). Needs a CUDA GPU.

    python scripts/kernels/gla_launch_sweep.py [--settings 1024:4,4096:1,...] [--budget 300]

Per shape (FLA's head, K = V = 128, H = 16, 131,072 tokens of T = 2,048; the zoo's head, K = 32, V = 64, H = 8,
32 x 512 tokens; bf16 q, k, v) and launch: forward and forward+backward medians (``triton.testing.do_bench``), and
a float32 check of the output and every input gradient against the ``chunk`` backend on fresh inputs.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from linmem.ops import linear_memory
from linmem.ops.triton import per_key_decay

SHAPES = {"K=V=128": (64, 2048, 16, 128, 128), "zoo K=32 V=64": (32, 512, 8, 32, 64)}
SETTINGS = "512:2,512:4,1024:1,1024:2,1024:4,2048:1,2048:2,2048:4,2048:8,4096:1,4096:2,4096:4,4096:8,8192:1,8192:2," \
           "8192:4,8192:8,16384:4,16384:8"


def inputs(B, T, H, K, V, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    return dict(q=draw(B, T, H, K).to(dtype), k=torch.nn.functional.normalize(draw(B, T, H, K), dim=-1).to(dtype),
                v=draw(B, T, H, V).to(dtype), g=-0.1 * torch.rand(B, T, H, K, device="cuda", generator=gen),
                beta=torch.rand(B, T, H, device="cuda", generator=gen))


def gla(x, backend):
    return linear_memory(x["q"], x["k"], x["v"], x["g"], x["beta"], None, rule="additive", residual=False,
                         backend=backend)[0]


def check(seed) -> float:
    """Worst relative error of the output and the input gradients, triton against chunk, float32."""
    x = inputs(2, 200, 3, 128, 128, torch.float32, seed)
    results = []
    for backend in ("triton", "chunk"):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o = gla(leaves, backend)
        o.backward(torch.ones_like(o))
        results.append([o.detach()] + [leaves[n].grad for n in leaves])
    return max(float((a - b).norm() / b.norm()) for a, b in zip(*results))


def time_ms(x, backward: bool) -> float:
    leaves = {n: t.detach().requires_grad_(backward) for n, t in x.items()}
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(lambda: gla(leaves, "triton"), warmup=3, rep=15)
    d_o = torch.randn_like(gla(leaves, "triton"))
    return triton.testing.do_bench(lambda: gla(leaves, "triton").backward(d_o), warmup=3, rep=15,
                                   grad_to_none=list(leaves.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=SETTINGS, help="ELEMENTS:WARPS, comma-separated")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; settings past it are skipped")
    args = parser.parse_args()
    settings = [tuple(int(n) for n in s.split(":")) for s in args.settings.split(",")]
    start = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| shape | elements | warps | BV | fwd ms | fwd+bwd ms | check |\n|---|---|---|---|---|---|---|")
    for label, shape in SHAPES.items():
        x = inputs(*shape, torch.bfloat16, seed=0)
        for seed, (elements, warps) in enumerate(settings, start=1):
            if time.time() - start > args.budget:
                print(f"| {label} | {elements} | {warps} | skipped: budget spent | | | |")
                continue
            per_key_decay.NARROW_LAUNCH = per_key_decay.WIDE_LAUNCH = (elements, warps)
            bv = per_key_decay.tiling(shape[3], shape[4])[1]
            print(f"| {label} | {elements} | {warps} | {bv} | {time_ms(x, False):.2f} | {time_ms(x, True):.2f} | "
                  f"{check(seed):.1e} |", flush=True)


if __name__ == "__main__":
    main()
