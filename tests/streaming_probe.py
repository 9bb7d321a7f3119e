"""The measuring process of tests/test_streaming_import.py: ``python -m tests.streaming_probe KIND FOLDER WARMUP``
loads WARMUP (``KIND`` ``hf``: ``load_hf_hybrid``, ``fla``: ``load_fla_checkpoint``; the lazy imports and first-call
allocations happen there), resets the peak RSS, loads FOLDER and prints JSON: ``growth``, the peak RSS's growth in
bytes, and ``weights``, the loaded parameters' bytes. It imports only what loading needs, so it starts fast."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(kind: str, folder: str, warmup: str) -> dict[str, int]:
    if kind == "hf":
        from linmem.models.hf_import import load_hf_hybrid as load
    else:
        from linmem.models.fla_import import load_fla_checkpoint as load
    load(warmup)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    before = status_kib("VmRSS")
    model = load(folder)
    growth = (status_kib("VmHWM") - before) * 1024
    return {"growth": growth, "weights": sum(p.numel() * p.element_size() for p in model.parameters())}


if __name__ == "__main__":
    print(json.dumps(measure(*sys.argv[1:4])))
