"""Per-layer L2 norms of the mixer output: the RLA paper's Fig. 4a stability diagnostic.

For every layer, the L2 norm over the hidden size of the mixer's output (``layers.i.attn``, ``[B, T, D]``, what
is added to the residual stream), per token, averaged and maximised over held-out windows. For linear mixers the
norm of the memory read-out before the output norm (``hook_readout``, ``[B, T, H, V]`` flattened per token) is
reported as well: that is where an unclipped residual memory grows (``max_layer_readout_norm``, the largest
per-layer mean; the output norm after the per-head RMSNorm is held down by that norm).
"""

from __future__ import annotations

from typing import Any

import torch

from linmem.data.shards import SplitTokens
from linmem.data.windows import sequential_windows
from linmem.eval.loading import EvalModel
from linmem.eval.scoring import logits_of


class NormMeter:
    """Sum, count and max of per-token L2 norms seen by a forward hook."""

    def __init__(self):
        self.total, self.count, self.max = 0.0, 0, 0.0

    def __call__(self, module, args, output: torch.Tensor) -> None:
        norms = output.detach().float().flatten(2).norm(dim=-1)  # [B, T]
        self.total += float(norms.double().sum())
        self.count += norms.numel()
        self.max = max(self.max, float(norms.max()))

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)


def stability(em: EvalModel, split: SplitTokens, seq_len: int, windows: int = 16,
              batch_size: int = 8) -> dict[str, Any]:
    """Mean / max per-token norms of every layer's mixer output (and read-out) on ``windows`` held-out windows."""
    data = [w for _, w in zip(range(windows), sequential_windows(split, seq_len))]
    if not data:
        raise ValueError(f"split {split.name!r} has no window of {seq_len} tokens; use a smaller --seq-len")
    meters, handles = [], []
    for block in em.model.model.layers:
        output, readout = NormMeter(), NormMeter()
        handles.append(block.attn.register_forward_hook(output))
        if hasattr(block.attn, "hook_readout"):
            handles.append(block.attn.hook_readout.register_forward_hook(readout))
        meters.append((output, readout if hasattr(block.attn, "hook_readout") else None))
    try:
        for chunk in torch.stack(data).split(batch_size):
            logits_of(em, chunk)
    finally:
        for handle in handles:
            handle.remove()
    rows = [{"layer": i, "kind": "attention" if readout is None else em.model.config.mixer,
             "output_norm_mean": output.mean, "output_norm_max": output.max,
             "readout_norm_mean": None if readout is None else readout.mean,
             "readout_norm_max": None if readout is None else readout.max}
            for i, (output, readout) in enumerate(meters)]
    worst = max(r["output_norm_mean"] for r in rows)
    return {"metrics": {"max_layer_output_norm": worst, "max_layer_readout_norm": largest_readout_norm(rows),
                        "windows": len(data), "seq_len": seq_len}, "table": rows}


def largest_readout_norm(rows: list[dict[str, Any]]) -> float | None:
    """The largest per-layer mean read-out norm of ``stability``'s table rows (None without a memory layer)."""
    readouts = [float(r["readout_norm_mean"]) for r in rows if r.get("readout_norm_mean") is not None]
    return max(readouts, default=None)
