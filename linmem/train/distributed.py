"""torch.distributed plumbing: one process per device under ``torchrun``, DDP or FSDP2 wrapping, reductions.

Launched plainly, the trainer is a single process and none of this starts a process group. Under
``torchrun --nproc_per_node N`` (or across nodes), ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` are set and a group
starts: NCCL on GPUs, gloo on CPU. Checkpoints of a multi-node run need a file system all nodes share.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Distributed:
    """Where this process stands: ``rank`` of ``world_size`` processes, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this process's CUDA device if there is one, else CPU; ``cuda`` takes ``LOCAL_RANK``'s GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device is 'cuda' but torch sees no GPU; use 'cpu' or 'auto'")
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_distributed(device_name: str = "auto") -> Distributed:
    """Start the process group if ``torchrun`` launched us (``WORLD_SIZE`` > 1); pick this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Distributed(rank, world_size, local_rank, device)


def shutdown(state: Distributed) -> None:
    """End the process group (if this process started one)."""
    if state.active and dist.is_initialized():
        dist.destroy_process_group()


def barrier(state: Distributed) -> None:
    if state.active:
        dist.barrier()


def all_reduce_sum(values: torch.Tensor, state: Distributed) -> torch.Tensor:
    """Sum of ``values`` over all processes (a float64 copy; the input is left alone)."""
    out = values.detach().to(torch.float64).clone()
    if state.active:
        device = state.device if state.device.type == "cuda" else torch.device("cpu")
        out = out.to(device)
        dist.all_reduce(out)
    return out.cpu()


def rank_batches(items: torch.Tensor, state: Distributed, batch_size: int) -> Iterator[tuple[torch.Tensor, bool]]:
    """This process's batches of ``items [N, ...]`` as ``(batch, counted)``: rows ``rank, rank + world, ...``, so
    that every row is on exactly one process (shares differ by at most one row), cut into ``batch_size`` rows.

    Every process yields as many batches as the largest share needs, so that the collectives inside a sharded
    model's forward (FSDP2's all-gathers) line up: once its share is used up, a process yields ``(items[:1],
    False)``, a batch to run and not count. Nothing is yielded for empty ``items``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    share = items[state.rank::state.world_size]
    largest = -(-len(items) // state.world_size)
    for start in range(0, largest, batch_size):
        batch = share[start:start + batch_size]
        yield (batch, True) if len(batch) else (items[:1], False)


def broadcast_object(obj, state: Distributed):
    """Rank 0's ``obj`` on every process (small picklable values only: paths, flags, errors)."""
    if not state.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_error(error: str | None, state: Distributed) -> str | None:
    """The message of the lowest-ranked process that has one (``error``: this process's message or None), on
    every process, so that all of them stop together with the same, specific message."""
    if not state.active:
        return error
    messages: list[str | None] = [None] * state.world_size
    dist.all_gather_object(messages, error)
    return next((m for m in messages if m is not None), None)


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped by FSDP2 (``fully_shard``): its state is sharded across processes."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def wrap_model(model: nn.Module, parallel: str, state: Distributed) -> nn.Module:
    """``model`` as the run trains it: unchanged for one process, else DDP or FSDP2 (``fully_shard`` on each
    block, then on the whole model). ``parallel``: ``auto`` (DDP when distributed), ``none``, ``ddp``, ``fsdp``."""
    if parallel == "auto":
        parallel = "ddp" if state.active else "none"
    if parallel == "none":
        if state.active:
            raise ValueError("train.parallel is 'none' but several processes were launched; use ddp or fsdp")
        return model
    if not state.active:
        return model  # one process: DDP / FSDP would only add overhead
    if parallel == "ddp":
        device_ids = [state.device.index] if state.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return fully_shard_model(model)


def fully_shard_model(model: nn.Module, **options) -> nn.Module:
    """FSDP2 over the process group: ``fully_shard`` on each block (its parameters gathered just for its forward
    and backward), then on the whole model (embeddings, final norm, head); ``options`` go to every ``fully_shard``
    (``mp_policy=MixedPrecisionPolicy(...)``). Needs a started process group."""
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def start_local_group(device: torch.device) -> bool:
    """A one-process group (rank 0 of world size 1) on a free local port, NCCL on CUDA and gloo on the CPU, so that
    FSDP2 can run in a single process; returns False (and starts nothing) when a group is already running."""
    if dist.is_initialized():
        return False
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    return True


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Checkpoint every block of a ``LinMemForCausalLM`` (non-reentrant ``torch.utils.checkpoint``): the forward
    pass keeps each block's input only and the backward pass recomputes the block. Call it before ``wrap_model``,
    so FSDP2's hooks stay outside the recomputed part. Uses transformers' ``activation_checkpointing_enable`` where
    it exists, else its older name ``gradient_checkpointing_enable``."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient all-reduce on accumulation micro-steps (DDP: ``require_backward_grad_sync``; FSDP2:
    ``set_requires_gradient_sync``); no-op for a plain module."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = enabled
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
