"""linmem: the memory of linear-attention language models."""

from linmem.ops import linear_memory, linear_memory_step

__version__ = "0.1.0"

__all__ = ["linear_memory", "linear_memory_step", "__version__"]
