"""Refuse a run that cannot fit in memory before its first update, instead of being killed during it.

One update needs the tensors autograd keeps for the backward pass, the gradients and AdamW's two moments. The first
grow linearly with the sequence length for every memory (tests/test_chunk_memory.py), so they are counted in one
forward pass at a short length (``saved_tensors_hooks``: each storage once, weights excluded) and scaled to the run's
length; the other two are 12 bytes per float32 parameter. The sum must fit in the memory the device has free.
"""

from __future__ import annotations

from pathlib import Path

import torch

from linmem.io.labels import IGNORE_INDEX

PROBE_LENGTH = 128  # tokens per row of the counting pass
HEADROOM = 0.9  # share of the free memory a run may plan to use


def free_bytes(device: torch.device) -> int | None:
    """Memory the device has free: CUDA's free bytes, or the host's ``MemAvailable`` (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def address(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for one without a plain local storage (an FSDP2 shard, a freed
    unsharded weight)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def saved_bytes(losses_of, model: torch.nn.Module, batch: int, length: int, device: torch.device) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward pass of ``losses_of(ids, labels)`` on
    ``batch`` rows of ``length`` tokens (each storage counted once, the model's weights left out)."""
    weights = {address(p) for p in model.parameters()}
    kept: dict[int, torch.UntypedStorage] = {}  # held until the pass ends, so no address is reused

    def count(t: torch.Tensor) -> torch.Tensor:
        where = address(t)
        if where is not None and where not in weights:
            kept[where] = t.untyped_storage()
        return t

    ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 1:] = 0
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        losses_of(ids, labels)
    return sum(storage.nbytes() for storage in kept.values())


def check_fits(losses_of, model: torch.nn.Module, batch: int, length: int, device: torch.device,
               where: str = "config") -> int:
    """Raise ``ValueError`` when one update of ``batch`` rows of ``length`` tokens would not fit in the device's
    free memory; returns the estimate in bytes."""
    probe = min(length, PROBE_LENGTH)
    activations = saved_bytes(losses_of, model, batch, probe, device) * length / probe
    states = 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # gradients + AdamW's m and v
    need = int(activations + states)
    free = free_bytes(device)
    if free is not None and need > HEADROOM * free:
        raise ValueError(f"{where}: one update needs about {need / 2**30:.1f} GiB ({activations / 2**30:.1f} GiB of "
                         f"activations for {batch} x {length} tokens, {states / 2**30:.1f} GiB of gradients and "
                         f"optimizer state) but {device.type} has {free / 2**30:.1f} GiB free; lower data.seq_len or "
                         f"train.micro_batch_size, or turn on train.gradient_checkpointing")
    return need
