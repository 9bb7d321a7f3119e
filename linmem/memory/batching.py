"""How many units (edit sets: one per head in a head scan) one batched run of the memory lab takes, and what it
does when a batch does not fit.

``run_in_batches`` is the one place that chooses. Three ways, said in the ``BatchChoice`` it returns:

- ``given``: the caller's size (``run_many(chunk=...)``, ``--chunk``, or ``batch_size`` around the calls);
- ``measured`` (CUDA): the first batch is one unit; the peak memory it allocated per unit and the memory free after
  it (the driver's free memory plus what PyTorch's allocator holds unused) give the next batch, as many units as
  fit in ``MEMORY_SHARE`` of it, planned again before every batch, since the kept outputs take memory too;
- ``default`` (CPU and other devices): ``DEFAULT_SIZE`` units. A CPU gains no speed from larger batches, and its
  free RAM says little about what an allocation may take (the operating system overcommits), so none is measured.

In every way an out-of-memory error halves the batch and runs it again, and no later batch is larger; a batch of
one unit that does not fit raises ``torch.OutOfMemoryError`` naming the device and its free memory. The units are
independent, so a batch's outputs are those of its units whatever the batch size.

Measuring resets torch's peak-memory counter of the device; ``peak_allocated`` and ``reset_peak`` give and reset a
peak that spans those resets, for callers that time a stage.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

import torch

DEFAULT_SIZE = 16  # units per batch where no memory is measured (the lab's chunk before sizes were chosen)
MEMORY_SHARE = 0.8  # of the free memory a planned batch may take: the rest covers fragmentation and estimates
GIB = 2**30

T = TypeVar("T")

_given: ContextVar[int | None] = ContextVar("linmem_batch_size", default=None)
_logs: ContextVar[tuple[list, ...]] = ContextVar("linmem_batch_logs", default=())
_folded_peaks: dict[int, int] = {}  # per CUDA device: the highest peak seen before a measurement reset torch's


@dataclass
class BatchChoice:
    """What one batched run chose: ``how`` (``"given"``, ``"measured"``, ``"default"``), the largest batch that
    ran, the free memory and per-unit memory the measured plan came from, and the sizes that ran out of memory."""

    unit: str
    total: int
    how: str
    device: str
    largest: int = 0
    free_bytes: int | None = None
    unit_bytes: int | None = None
    backed_off_from: list[int] = field(default_factory=list)

    def describe(self) -> str:
        """One line, e.g. ``8 of 769 edit sets per batch (chosen from 61.2 GiB free, 4.10 GiB each; backed off
        once from 16)``."""
        if self.how == "measured" and self.free_bytes is not None:
            why = f"chosen from {self.free_bytes / GIB:.1f} GiB free, {self.unit_bytes / GIB:.2f} GiB each"
        elif self.how == "measured":
            why = "all in one measured batch"
        elif self.how == "given":
            why = "as given"
        else:
            why = f"the default on {self.device}"
        backed = self.backed_off_from
        if backed:
            times = {1: "once", 2: "twice"}.get(len(backed), f"{len(backed)} times")
            why += f"; backed off {times} from {backed[0]}"
        return f"{self.largest} of {self.total} {self.unit} per batch ({why})"

    def as_dict(self) -> dict:
        return {"size": self.largest, "total": self.total, "how": self.how, "free_gib": _gib(self.free_bytes),
                "unit_gib": _gib(self.unit_bytes), "backed_off_from": list(self.backed_off_from),
                "text": self.describe()}


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / GIB, 3)


def summary(choices: Sequence[BatchChoice]) -> str | None:
    """One line for the batched runs of a piece of work (None without any): the run of the most units, and how
    many others there were and how often they backed off."""
    if not choices:
        return None
    main = max(choices, key=lambda c: (c.total, c.largest))
    text = main.describe()
    others = len(choices) - 1
    if others:
        backoffs = sum(len(c.backed_off_from) for c in choices) - len(main.backed_off_from)
        text += f"; {others} other batched run{'s' if others > 1 else ''}" + (
            f", backed off {backoffs} time{'s' if backoffs > 1 else ''}" if backoffs else "")
    return text


@contextmanager
def batch_size(size: int | None) -> Iterator[None]:
    """While inside, runs whose caller gives no size take ``size`` units per batch (None: chosen as usual)."""
    if size is not None and size < 1:
        raise ValueError(f"batch size must be >= 1; got {size}")
    token = _given.set(size)
    try:
        yield
    finally:
        _given.reset(token)


@contextmanager
def recorded() -> Iterator[list[BatchChoice]]:
    """While inside, every ``run_in_batches`` appends its ``BatchChoice`` to the yielded list (nested recorders
    each get it)."""
    log: list[BatchChoice] = []
    token = _logs.set((*_logs.get(), log))
    try:
        yield log
    finally:
        _logs.reset(token)


def is_out_of_memory(error: BaseException) -> bool:
    """A failed allocation: ``torch.OutOfMemoryError`` (CUDA) or the CPU allocator's ``RuntimeError``."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


class DeviceMemory:
    """The memory of one CUDA device as the planner reads it: free bytes, and the peak a batch allocated."""

    def __init__(self, device: torch.device):
        self.device = device
        self.before = 0

    def free(self) -> int:
        """Bytes a new batch can take: the driver's free memory plus the allocator's cached, unused blocks."""
        driver_free, _ = torch.cuda.mem_get_info(self.device)
        return driver_free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def start(self) -> None:
        """Start measuring a batch (folds the peak so far into ``peak_allocated``, then resets torch's)."""
        index = _index(self.device)
        _folded_peaks[index] = peak_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.before = torch.cuda.memory_allocated(self.device)

    def used(self) -> int:
        """Peak bytes allocated since ``start`` beyond what was allocated then (outputs kept included)."""
        return max(torch.cuda.max_memory_allocated(self.device) - self.before, 0)

    def release(self) -> None:
        """Give the memory of a failed batch back to the device."""
        gc.collect()
        torch.cuda.empty_cache()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def memory_of(device: torch.device | str) -> DeviceMemory | None:
    """The planner's view of ``device``'s memory; None where none is measured (every device but CUDA)."""
    device = torch.device(device)
    return DeviceMemory(device) if device.type == "cuda" else None


def peak_allocated(device: torch.device | str | None = None) -> int:
    """Peak bytes allocated on a CUDA device since ``reset_peak``, across the resets measuring makes."""
    device = torch.device("cuda" if device is None else device)
    return max(torch.cuda.max_memory_allocated(device), _folded_peaks.get(_index(device), 0))


def reset_peak(device: torch.device | str | None = None) -> None:
    """Reset ``peak_allocated`` (and torch's peak counter) of a CUDA device."""
    device = torch.device("cuda" if device is None else device)
    torch.cuda.reset_peak_memory_stats(device)
    _folded_peaks[_index(device)] = 0


def run_in_batches(run: Callable[[int, int], T], total: int, device: torch.device | str, size: int | None = None,
                   unit: str = "edit sets") -> tuple[list[T], BatchChoice]:
    """``run(start, stop)`` over units ``[0, total)`` in consecutive batches; returns the outputs in order and the
    ``BatchChoice`` (also given to every ``recorded`` list). ``size``: units per batch (None: ``batch_size``'s, or
    chosen as the module says); out-of-memory errors halve it in every case."""
    if size is not None and size < 1:
        raise ValueError(f"batch size must be >= 1; got {size}")
    size = size or _given.get()
    memory = None if size else memory_of(device)
    choice = BatchChoice(unit, total, "given" if size else "measured" if memory else "default", str(device))
    planned, ceiling = size or (1 if memory else DEFAULT_SIZE), total
    outputs: list[T] = []
    done = 0
    while done < total:
        n = max(1, min(planned, ceiling, total - done))
        if memory is not None:
            memory.start()
        try:
            outputs.append(run(done, done + n))
            failed = False
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            if n == 1:
                free = "" if memory is None else f" ({memory.free() / GIB:.1f} GiB free)"
                backed = f" (backed off from {choice.backed_off_from[0]})" if choice.backed_off_from else ""
                raise torch.OutOfMemoryError(
                    f"a batch of one of the {total} {unit} does not fit in the memory of {device}{free}{backed}: "
                    f"free memory on the device, or run fewer items (prompts) or shorter ones at once") from error
            failed = True
        if failed:  # outside the except block, so that the failed batch's tensors can be freed
            choice.backed_off_from.append(n)
            ceiling = planned = n // 2
            if memory is not None:
                memory.release()
            continue
        done += n
        if memory is not None:
            used = math.ceil(memory.used() / n)
            if n > choice.largest or choice.unit_bytes is None:
                choice.unit_bytes = used
            elif n == choice.largest:
                choice.unit_bytes = max(choice.unit_bytes, used)
            free = memory.free()
            if choice.free_bytes is None and done < total:
                choice.free_bytes = free  # what the first plan came from
            planned = total if choice.unit_bytes == 0 else max(1, int(free * MEMORY_SHARE) // choice.unit_bytes)
        choice.largest = max(choice.largest, n)
    for log in _logs.get():
        log.append(choice)
    return outputs, choice
