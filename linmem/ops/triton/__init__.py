"""Fused Triton kernels of ``linear_memory`` (forward and backward) for both rules, with or without the residual
memory (RLA, RDN). Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``."""

from linmem.ops.triton.function import LinearMemoryFunction, triton_forward

__all__ = ["LinearMemoryFunction", "triton_forward"]
