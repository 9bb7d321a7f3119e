"""linmem: the memory of linear-attention language models."""

from linmem.models import LinMemConfig, LinMemForCausalLM, LinMemModel, register_auto_classes
from linmem.ops import linear_memory, linear_memory_step

register_auto_classes()

__version__ = "0.1.0"


def __getattr__(name: str):
    """``linmem.zoo`` after a plain ``import linmem``, imported on first use."""
    if name == "zoo":
        import importlib

        return importlib.import_module("linmem.zoo")
    raise AttributeError(f"module 'linmem' has no attribute {name!r}")

__all__ = ["LinMemConfig", "LinMemForCausalLM", "LinMemModel", "linear_memory", "linear_memory_step", "__version__"]
