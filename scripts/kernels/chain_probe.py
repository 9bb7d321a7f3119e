"""How long RDN's sequential state passes take by how their chain is built, beside FLA's state pass.

    python scripts/kernels/chain_probe.py [--batch 4] [--length 2048] [--heads 8] [--width 256] [--out DIR]

linmem's forward pass forms each memory's writes inside its chunk loop (the read ``K Sᵀ``, the chunk's inverse, for
the base memory the error too); the pass from kept writes (``recompute_states`` "writes", ``FROM_WRITES``) only
updates the state, as FLA's ``chunk_gated_delta_rule_fwd_h`` nearly does (its writes come from a kernel before it, its
loop keeps one read ``w Sᵀ``). Offline (docs/benchmarks/kernel-widths.md, last section) the passes from kept writes
hold a [256, 64] state without a spill, two programs per SM, where the forming passes spill. This times, per value
block and launch: the base memory's pass alone and both memories' passes, forming and from kept writes, and FLA's pass
at the same and at twice the value width; it checks that both ways give the same per-chunk states and errors. It
times the forward's PREFORMED passes too (the writes' state-free products formed in parallel kernels before each
chain, which is then one read and one update, as in FLA), with their relative difference from the forming passes.
Without CUDA it runs in Triton's interpreter at a tiny shape (a dry run of the flow, no timings worth reading).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the interpreter's dry run: set before Triton's kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

# (num_warps, num_stages, BV, KEYS_ONCE) of the forward's state passes; the first is the K = V = 256 row
LAUNCHES = [(4, 3, 32, True), (4, 2, 32, False), (4, 2, 64, False), (8, 2, 64, False), (8, 1, 64, False),
            (4, 2, 16, True)]


def inputs(batch: int, length: int, heads: int, width: int, device: str) -> dict:
    """Packed bf16 inputs ``[N_tok, H, ·]`` of an RDN layer and the per-chunk scores and inverses its forward
    computes before the state passes."""
    from linmem.ops.config import MemoryConfig
    from linmem.ops.triton import function
    from linmem.ops.triton.layout import SequenceLayout

    n_tok = batch * length
    bf16 = torch.bfloat16
    q, k = (F.normalize(torch.randn(n_tok, heads, width, device=device), dim=-1).to(bf16) for _ in range(2))
    v = torch.randn(n_tok, heads, width, device=device).to(bf16)
    g = F.logsigmoid(torch.randn(n_tok, heads, device=device) + 4)
    beta, gamma = (torch.rand(n_tok, heads, device=device).sigmoid() for _ in range(2))
    layout = SequenceLayout.fixed(batch, length, torch.device(device))
    flags = function._Flags(MemoryConfig(rule="delta", residual=True), bf16)
    state = torch.zeros(batch, heads, width, width, device=device)
    _, _, _, saved = function._forward(q, k, v, g, beta, gamma, state, state, flags, 0.1, layout)
    return dict(k=k, v=v, g=g, beta=beta, gamma=gamma, state=state, flags=flags, layout=layout, saved=saved)


def passes(x: dict, residual: bool, writes: dict | None = None) -> dict:
    """The state passes (the base memory's, and the residual memory's with ``residual``), forming their writes, or
    from ``writes`` (u and w as a forming pass at the same launch stored them)."""
    from linmem.ops.triton import function

    s = x["saved"]
    return function._state_passes(x["k"], x["v"], s["b"], x["g"], x["beta"], x["gamma"], s["key_scores"],
                                  s["inv_beta"], s["inv_gamma"], x["state"], x["state"], x["flags"], x["layout"],
                                  residual_pass=residual, writes=writes)


def fla_pass(x: dict, batch: int, value_factor: int):
    """FLA's state pass over the same keys, with writes of ``value_factor`` times the value width (FLA's GDN 2V at 2);
    None where FLA is not installed."""
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    except ImportError:
        return None
    n_tok, heads, width = x["k"].shape
    k = x["k"].view(batch, n_tok // batch, heads, width)
    w = k.clone()
    u = torch.cat([x["v"]] * value_factor, dim=-1).view(batch, n_tok // batch, heads, width * value_factor)
    # FLA's pass takes the log decays summed within each chunk of 64 (its chunk_local_cumsum)
    g = x["g"].view(batch, -1, 64, heads).cumsum(2).view(batch, n_tok // batch, heads)
    return lambda: chunk_gated_delta_rule_fwd_h(k, w, u, g=g, output_final_state=True)


def shape_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of the layer's shape (B, T, H and the head width), at the training micro-batch by default."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    return parser


def probe_inputs(args: argparse.Namespace) -> tuple[str, dict]:
    """The device and ``inputs`` at the shape of ``args``; without CUDA a tiny shape for the interpreter's dry run
    (written back into ``args``)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        args.batch, args.length, args.heads, args.width = 1, 128, 1, 32
    torch.manual_seed(0)
    return device, inputs(args.batch, args.length, args.heads, args.width, device)


def main(argv: list[str] | None = None) -> dict:
    parser = shape_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="writes chain_probe.json there")
    args = parser.parse_args(argv)
    from linmem.ops.triton import function

    device, x = probe_inputs(args)
    rows = []
    for warps, stages, bv, keys_once in LAUNCHES:
        options = dict(num_warps=warps, num_stages=stages, BV=bv, KEYS_ONCE=keys_once, PREFORMED=False)
        function.override_options({"forward": options})
        row = dict(options)
        try:
            formed = passes(x, True)
            kept = {name: formed[name] for name in ("u", "w")}  # this launch's own writes: the same bits again
            from_kept = passes(x, True, kept)
            row["same_states"] = all(torch.equal(formed[n], from_kept[n]) for n in ("base_chunks", "res_chunks",
                                                                                  "err"))
            for name, residual, writes in (("base formed", False, None), ("both formed", True, None),
                                           ("base from writes", False, kept), ("both from writes", True, kept)):
                if device == "cuda":
                    row[name] = triton.testing.do_bench(functools.partial(passes, x, residual, writes))
            # PREFORMED: the writes' state-free products in parallel kernels, each chain one read and one update
            function.override_options({"forward": options | dict(PREFORMED=True)})
            preformed = passes(x, True)
            row["preformed max rel diff"] = max(
                ((preformed[n].float() - formed[n].float()).norm() / formed[n].float().norm()).item()
                for n in ("base_chunks", "res_chunks", "err"))
            for name, residual in (("base preformed", False), ("both preformed", True)):
                if device == "cuda":
                    row[name] = triton.testing.do_bench(functools.partial(passes, x, residual))
        except Exception as exc:  # noqa: BLE001 (a launch that does not compile or fit is reported, not fatal)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    fla = {}
    for factor in (1, 2):
        run = fla_pass(x, args.batch, factor) if device == "cuda" else None
        fla[f"FLA fwd_h V x{factor}"] = triton.testing.do_bench(run) if run else None
    print(json.dumps(fla), flush=True)
    columns = ("base formed", "both formed", "base from writes", "both from writes", "base preformed",
               "both preformed")
    print("| warps, stages, BV, KEYS_ONCE | " + " | ".join(f"{c} ms" for c in columns)
          + " | same states | preformed rel. diff |")
    print("|---" * (len(columns) + 3) + "|")
    for row in rows:
        cells = [f"{row[c]:.3f}" if row.get(c) is not None else "–" for c in columns]
        launch = f"{row['num_warps']}, {row['num_stages']}, {row['BV']}, {row['KEYS_ONCE']}"
        print(f"| {launch} | " + " | ".join(cells) + f" | {row.get('same_states', row.get('error'))} | "
              f"{row.get('preformed max rel diff', float('nan')):.1e} |")
    print(" ".join(f"{name}: {ms:.3f} ms" if ms is not None else f"{name}: –" for name, ms in fla.items()))
    report = dict(shape=vars(args) | {"out": None}, gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, triton=triton.__version__, rows=rows, fla=fla)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chain_probe.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
