"""The linear-memory op and its backends (see ``docs/math.md`` for the exact contract)."""

from linmem.ops.backend import BACKENDS
from linmem.ops.config import MemoryConfig
from linmem.ops.linear_memory import linear_memory, linear_memory_step

__all__ = ["BACKENDS", "MemoryConfig", "linear_memory", "linear_memory_step"]
