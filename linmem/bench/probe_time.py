"""Time of ``linmem probe``'s default protocol, experiment by experiment, on this machine.

    python -m linmem.bench.probe_time                         # zoo:gdn, the default protocol, without the sweeps
    python -m linmem.bench.probe_time zoo:rdn --sweeps        # another model, the sweeps too
    python -m linmem.bench.probe_time --threads 1 --filler 128 --sources 4    # a quick run on one core

Prints, per experiment, the wall seconds and the CPU seconds (user + system of every thread of the process: on a
machine shared with other jobs the CPU seconds change less than the wall seconds), the total against the estimate
the probe printed before its experiments, and the machine: cores, torch threads and the 1-minute load average
before and after (a load above the core count means other jobs shared the cores). The probe's report goes to a
temporary folder and is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch


def machine() -> dict:
    """Cores, torch threads, the 1-minute load average (None where the system gives none) and the platform."""
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average_1min": load,
            "torch": torch.__version__, "platform": platform.platform()}


def time_probe(model: str, args: argparse.Namespace) -> dict:
    """Run the protocol on ``model`` (``zoo:NAME`` or a folder) into a temporary folder; its header's timings."""
    from linmem.memory.commands import documents_and_label
    from linmem.memory.probe import ProbeOptions, load_model_dir, run_protocol

    docs, filler = documents_and_label(args.text)
    load_start = time.perf_counter()
    net, tokenizer = load_model_dir(model, args.device)
    load_seconds = time.perf_counter() - load_start
    options = ProbeOptions(dev_sources=args.sources, confirm_sources=args.sources, filler_tokens=args.filler,
                           repeats=args.repeats, sweeps=args.sweeps)
    with tempfile.TemporaryDirectory() as out:
        start, cpu_start = time.perf_counter(), time.process_time()
        run_protocol(net, tokenizer, docs, options, out, header={"model": model})
        total, cpu_total = time.perf_counter() - start, time.process_time() - cpu_start
        header = json.loads((Path(out) / "results.json").read_text())["header"]
    return {"model": model, "filler_text": filler, "load_seconds": round(load_seconds, 1),
            "seconds": round(total, 1), "cpu_seconds": round(cpu_total, 1), "estimated_seconds":
            header["estimated_seconds"], "clean_recall_seconds": header["clean_recall_seconds"],
            "experiments": {name: {"seconds": header["seconds"][name], "cpu_seconds": header["cpu_seconds"][name]}
                            for name in header["seconds"]}}


def table(result: dict) -> str:
    """The result as lines of text: one per experiment, then the totals."""
    lines = [f"{'experiment':<22}{'wall s':>9}{'CPU s':>9}"]
    lines += [f"{name:<22}{t['seconds']:>9.1f}{t['cpu_seconds']:>9.1f}" for name, t in result["experiments"].items()]
    lines.append(f"{'protocol (with report)':<22}{result['seconds']:>9.1f}{result['cpu_seconds']:>9.1f}")
    lines.append(f"estimated before the experiments: {result['estimated_seconds']:.0f} s; clean-recall runs "
                 f"{result['clean_recall_seconds']:.1f} s; model load {result['load_seconds']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="zoo:gdn", help="zoo:NAME or a model folder (default zoo:gdn)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--sweeps", action="store_true", help="run the load and gap sweeps too")
    parser.add_argument("--sources", type=int, default=16, help="development and confirmation sources each")
    parser.add_argument("--filler", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", nargs="+", default=None, help="filler text sources (default: as linmem probe)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    before = machine()
    result = time_probe(args.model, args)
    result["machine"] = {**before, "load_average_1min_after": machine()["load_average_1min"]}
    print(table(result))
    m = result["machine"]
    print(f"machine: {m['cpus']} cores, {m['torch_threads']} torch threads, load average {m['load_average_1min']} "
          f"before and {m['load_average_1min_after']} after; {m['platform']}, torch {m['torch']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
