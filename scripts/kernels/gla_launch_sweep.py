"""Time GLA's token-walk kernels (linmem/ops/triton/per_key_decay.py) under several launches: the state tile's size
in float32 elements and the warps of each program. The table behind ``NARROW_LAUNCH`` / ``WIDE_LAUNCH``
(docs/benchmarks/gla/launch.md). Needs a CUDA GPU.

    python scripts/kernels/gla_launch_sweep.py [--settings 1024:4,4096:1,...] [--budget 300]

Per shape (FLA's head, K = V = 128, H = 16, 131,072 tokens of T = 2,048; the zoo's head, K = 32, V = 64, H = 8,
32 x 512 tokens) and launch: forward and forward+backward medians on ``linmem.bench.kernel_checks``' inputs (bf16
q, k, v, per-key decays with a few channels reset) and ``linmem.bench.kernels``' timing, and the float64 check of
``kernel_checks`` of the output, final state and every input gradient (B = 2, T = 300, H = 3, K = V = 128, fresh
inputs per launch).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from linmem.bench import kernel_checks, kernels
from linmem.ops.triton import layout, per_key_decay

SHAPES = {"K=V=128": (64, 2048, 16, 128, 128), "zoo K=32 V=64": (32, 512, 8, 32, 64)}
SETTINGS = "512:2,512:4,1024:1,1024:2,1024:4,2048:1,2048:2,2048:4,2048:8,4096:1,4096:2,4096:4,4096:8,8192:1,8192:2," \
           "8192:4,8192:8,16384:4,16384:8"
CHECK_CASE = dict(rule="additive", residual=False, dtype="float32", B=2, T=300, H=3, K=128, V=128, decay="per_key")


def inputs(B, T, H, K, V) -> dict:
    x = kernel_checks.random_inputs(B, T, H, K, V, torch.bfloat16, kernels.DEVICE, seed=0, decay="per_key")
    x["g_key"] = x.pop("g")  # the name the "linmem GLA" method reads
    return x


def check(seed: int) -> float:
    """The worst relative error against float64 (``kernel_checks.run_check``, which NaN-fills new kernel buffers)."""
    worst = kernel_checks.run_check(dict(CHECK_CASE, seed=seed), kernels.DEVICE)["worst"]
    layout.POISON_BUFFERS = False  # the timed runs take buffers as the library does
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=SETTINGS, help="ELEMENTS:WARPS, comma-separated")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; settings past it are skipped")
    args = parser.parse_args()
    settings = [tuple(int(n) for n in s.split(":")) for s in args.settings.split(",")]
    gla = kernels.METHODS["linmem GLA"]
    start = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| shape | elements | warps | BV | fwd ms | fwd+bwd ms | check |\n|---|---|---|---|---|---|---|")
    for label, shape in SHAPES.items():
        x = inputs(*shape)
        for seed, (elements, warps) in enumerate(settings, start=1):
            if time.time() - start > args.budget:
                print(f"| {label} | {elements} | {warps} | skipped: budget spent | | | |")
                continue
            per_key_decay.NARROW_LAUNCH = per_key_decay.WIDE_LAUNCH = (elements, warps)
            bv = per_key_decay.tiling(shape[3], shape[4])[1]
            print(f"| {label} | {elements} | {warps} | {bv} | {kernels.time_method(gla, x, False):.2f} | "
                  f"{kernels.time_method(gla, x, True):.2f} | {check(seed):.1e} |", flush=True)


if __name__ == "__main__":
    main()
