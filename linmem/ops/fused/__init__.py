"""Fused, memory-lean blocks of the model around the op (Triton kernels with eager torch paths of the same values)."""

from linmem.ops.fused.conv import short_conv
from linmem.ops.fused.cross_entropy import token_cross_entropy
from linmem.ops.fused.norms import gated_rms_norm, l2_norm, rms_norm
from linmem.ops.fused.swiglu import swiglu_linear

__all__ = ["gated_rms_norm", "l2_norm", "rms_norm", "short_conv", "swiglu_linear", "token_cross_entropy"]
