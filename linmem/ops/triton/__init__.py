"""Fused Triton kernels of ``linear_memory`` (forward and backward) for both rules, with or without the residual
memory (RLA, RDN). Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``."""

from linmem.ops.triton.function import TRITON, LinearMemoryFunction, triton_forward

__all__ = ["TRITON", "LinearMemoryFunction", "triton_forward"]
