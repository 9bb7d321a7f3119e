"""Where PREFORMED's time goes: per-kernel GPU times of linmem's RDN and GDN forward+backward at the row of
``KERNEL_OPTIONS`` and at each PREFORMED candidate of the sweep (``linmem.bench.kernels.sweep_variants``).

    python scripts/kernels/preformed_profile.py [--width 256] [--value-width 256] [--out DIR]

bf16, B = 4, T = 2048, H = 8 (the training micro-batch of docs/benchmarks/kernel-widths.md); each cell is
``kernel_profile.profile_method``'s medians over three profiled steps: the longest kernels and the busy time (the sum
over every kernel). A sweep (``--sweep-metric busy``) says whether a candidate wins; this says which kernels make the
difference: the chains (``state_pass_kernel``, ``reverse_pass_kernel``) against the kernels PREFORMED adds
(``preformed_writes_kernel``, ``preformed_error_kernel``, ``reverse_writes_kernel``). GPU only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from linmem.bench import environment, kernel_profile, kernels
from linmem.ops.triton import function

STEPS = 3
METHODS = ("linmem RDN", "linmem GDN")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256, help="key width K")
    parser.add_argument("--value-width", type=int, default=None, help="value width V (default K)")
    parser.add_argument("--out", type=Path, default=None, help="folder for preformed_profile.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("preformed_profile.py times GPU kernels: no CUDA device here")
    K, V = args.width, args.value_width or args.width
    kernel_profile.PROFILE_TOP = 30  # every kernel of a step
    kernels.HEADS, kernels.HEAD_DIM, kernels.VALUE_DIM = 8, K, V
    row = function.kernel_options(K, V)
    default = dict(row)
    candidates = [v for v in kernels.sweep_variants(K, V)
                  if isinstance(next(iter(v.values())), dict) and next(iter(v.values())).get("PREFORMED")]
    x = kernels.bench_inputs(4, 2048)
    cells = []
    for change in [{}] + candidates:
        row.clear()
        row.update(default | change)
        try:
            for method in METHODS:
                summary = kernel_profile.profile_method(kernels.METHODS[method], x, STEPS, "cuda")
                cells.append(dict(change=change, method=method, **summary))
                print(f"== {change or 'the row'} | {method}: busy {summary['busy_ms']:.3f} ms", flush=True)
                for name, ms in summary["rows"]:
                    print(f"   {ms:.3f}  {name[:100]}", flush=True)
        finally:
            row.clear()
            row.update(default)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = dict(shape=dict(B=4, T=2048, H=8, K=K, V=V), row=default, environment=environment("cuda"),
                      cells=cells)
        (args.out / "preformed_profile.json").write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
