"""What holds RDN's forward state passes back: one launch of each pass for Nsight Compute's hardware counters, beside
FLA's state pass at the same and at twice the value width.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
        --export DIR/passes python3 scripts/kernels/pass_counters.py [--width 256]

The timing benchmarks (docs/benchmarks/kernel-widths.md) say how long each pass takes; the counters say why: how
many programs share a multiprocessor (registers, shared memory, waves), how busy its tensor cores and its memory are,
what its warps wait on, and where (per SASS instruction, SourceCounters). Everything is compiled and FLA autotuned
before ``cudaProfilerStart``, so that only one launch of each variant below is profiled, in the order printed.
Without CUDA it runs the variants once in Triton's interpreter at a tiny shape (a dry run of the flow).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chain_probe import fla_pass, passes, probe_inputs, shape_parser  # noqa: E402

# (num_warps, num_stages, BV, KEYS_ONCE) of the forward's state passes; the first is the K = V = 256 row
LAUNCHES = [(4, 3, 32, True), (4, 2, 64, False), (8, 2, 64, False)]


def main(argv: list[str] | None = None) -> None:
    args = shape_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    from linmem.ops.triton import function

    device, x = probe_inputs(args)
    variants = []
    for warps, stages, bv, keys_once in LAUNCHES:
        options = dict(num_warps=warps, num_stages=stages, BV=bv, KEYS_ONCE=keys_once, PREFORMED=False)

        def both(options=options):
            function.override_options({"forward": options})
            return passes(x, True)

        formed = both()
        kept = {name: formed[name] for name in ("u", "w")}  # this launch's own writes

        def from_writes(options=options, kept=kept):
            function.override_options({"forward": options})
            return passes(x, True, kept)

        launch = f"{warps} warps, {stages} stages, BV {bv}, KEYS_ONCE {keys_once}"
        variants += [(f"RDN both passes forming ({launch}): base, then residual", both),
                     (f"RDN both passes from kept writes ({launch}): base, then residual", from_writes)]
    for factor in (1, 2):
        run = fla_pass(x, args.batch, factor) if device == "cuda" else None
        variants.append((f"FLA chunk_gated_delta_rule_fwd_h, V x{factor}", run))
    variants = [(name, run) for name, run in variants if run is not None]
    on_gpu = device == "cuda"
    if on_gpu:
        for _, run in variants:  # compile, autotune, warm
            run()
            run()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for i, (name, run) in enumerate(variants):
        print(f"[{i}] {name}", flush=True)
        run()
        if on_gpu:
            torch.cuda.synchronize()
    if on_gpu:
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
