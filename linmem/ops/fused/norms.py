"""Row norms over the last axis, fused on Triton where that pays: RMSNorm (optionally adding the residual stream
first), the gated RMSNorm of a mixer's output and the L2 norm of q and k.

Each function has two paths with the same values:

- **Triton** (``norm_kernels.py``): one kernel per direction; the backward recomputes the normalised rows from the
  input (or, for the L2 norm, from the output) and the saved ``rstd``, so no float32 copy of a whole tensor is kept;
- **eager**: plain torch, for the CPU, float64 (tests compare tightly), rows too wide for one tile, and
  ``torch.compile``, which fuses these few element-wise ops itself.

``prefer_triton=None`` chooses Triton for CUDA tensors of float16 / bfloat16 / float32 whose rows fit one tile, and not
while ``torch.compile`` traces; ``True`` forces Triton (the tests run it on the CPU under ``TRITON_INTERPRET=1``),
``False`` the eager path. Arithmetic is float32 at least (float64 stays float64), the result is cast to the output
dtype, as in ``linmem.layers.norm`` and ``linmem.layers.recurrent.l2_normalize``.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW_BYTES = 65536  # a row longer than this (in its widest input dtype) does not fit one tile: eager path
ACTIVATIONS = ("swish", "silu", "sigmoid")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_fits(tensors: list[torch.Tensor], out_dtype: torch.dtype | None = None) -> bool:
    """Whether the default dispatch takes the Triton path for these inputs."""
    if torch.compiler.is_compiling() or not _triton_installed():
        return False
    if out_dtype is not None and out_dtype not in TRITON_DTYPES:
        return False
    if not all(t.is_cuda and t.dtype in TRITON_DTYPES for t in tensors):
        return False
    return tensors[0].shape[-1] * max(t.element_size() for t in tensors) <= MAX_ROW_BYTES


def _check_shapes(x: torch.Tensor, weight: torch.Tensor | None, *others: torch.Tensor | None) -> None:
    for name, other in zip(("residual", "gate"), others):
        if other is not None and other.shape != x.shape:
            raise ValueError(f"{name} must have x's shape {tuple(x.shape)}; got {tuple(other.shape)}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},); got {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             zero_centered: bool = False, out_dtype: torch.dtype | None = None,
             prefer_triton: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``y = h / sqrt(mean(h²) + eps) · scale`` over the last axis, ``h = x`` or ``x + residual``; ``scale`` is
    ``weight``, or ``1 + weight`` when ``zero_centered``.

    ``x [..., D]``; ``residual`` None or ``[..., D]`` (any float dtype); ``weight [D]``. Without a residual returns
    ``y``; with one returns ``(y, summed)``, ``summed = x + residual`` in residual's dtype (the residual stream, float32
    under autocast), which is also what is normalised. ``y`` is in ``out_dtype`` (None: x's dtype)."""
    _check_shapes(x, weight, residual)
    out_dtype = out_dtype or x.dtype
    inputs = [x, weight] if residual is None else [x, weight, residual]
    if prefer_triton or (prefer_triton is None and _triton_fits(inputs, out_dtype)):
        from linmem.ops.fused.norm_kernels import RMSNormFunction

        return RMSNormFunction.apply(x, residual, weight, eps, zero_centered, out_dtype)
    return _rms_norm_eager(x, weight, eps, residual, zero_centered, out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "swish",
                   *, prefer_triton: bool | None = None) -> torch.Tensor:
    """``y = x / sqrt(mean(x²) + eps) · weight · act(gate)`` over the last axis, ``act`` = SiLU (``"swish"`` /
    ``"silu"``) or ``"sigmoid"``; ``x, gate [..., D]``, ``weight [D]``; ``y`` in x's dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    _check_shapes(x, weight, None, gate)
    if prefer_triton or (prefer_triton is None and _triton_fits([x, gate, weight])):
        from linmem.ops.fused.norm_kernels import GatedRMSNormFunction

        return GatedRMSNormFunction.apply(x, gate, weight, eps, activation == "sigmoid")
    return _gated_rms_norm_eager(x, gate, weight, eps, activation)


def l2_norm(x: torch.Tensor, eps: float = 1e-6, *, prefer_triton: bool | None = None) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last axis (eps inside the root); ``x [..., D]``, same dtype out."""
    if prefer_triton or (prefer_triton is None and _triton_fits([x])):
        from linmem.ops.fused.norm_kernels import L2NormFunction

        return L2NormFunction.apply(x, eps)
    return _l2_norm_eager(x, eps)


def _rstd(h: torch.Tensor, eps: float, mean: bool = True) -> torch.Tensor:
    """``1 / sqrt(mean(h²) + eps)`` (or ``Σh²``) over the last axis, kept as ``[..., 1]``."""
    squares = h.pow(2)
    return torch.rsqrt((squares.mean(-1, keepdim=True) if mean else squares.sum(-1, keepdim=True)) + eps)


def _rms_norm_eager(x, weight, eps, residual, zero_centered, out_dtype):
    summed = None if residual is None else (x + residual).to(residual.dtype)
    h = x if summed is None else summed
    h = h.to(_compute_dtype(h.dtype))  # a no-op for float32 / float64 inputs
    normed = h * _rstd(h, eps)
    scale = 1 + weight.to(normed.dtype) if zero_centered else weight
    y = (normed * scale).to(out_dtype)
    return y if summed is None else (y, summed)


def _gated_rms_norm_eager(x, gate, weight, eps, activation):
    gate = gate.to(_compute_dtype(gate.dtype))
    act = torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate)
    h = x.to(_compute_dtype(x.dtype))
    return (h * _rstd(h, eps) * weight * act).to(x.dtype)


def _l2_norm_eager(x, eps):
    h = x.to(_compute_dtype(x.dtype))
    return (h * _rstd(h, eps, mean=False)).to(x.dtype)
