"""What every linear-memory mixer shares: q/k/v projections with short convolutions, the hook points, and the
hand-off to the op (``linear_memory`` over a sequence, ``linear_memory_step`` for one decoding token).

A subclass builds its parameters, turns ``hidden_states`` into the per-head write inputs (q, k, v, g, β, γ) and calls
``self.run_memory(...)``, which fires the hooks, runs the op from the cached state and stores the new state.

Hook points (identity modules, see ``linmem.layers.hooks``), per head, after all preprocessing; every write input is
0 at padded positions:

- ``hook_q``, ``hook_k`` ``[B, T, H, K]``: query and key after projection, short conv / activation and L2 norm (GLA:
  no norm, no activation without conv);
- ``hook_v`` ``[B, T, H, V]``: value;
- ``hook_g`` ``[B, T, H]`` (GLA: ``[B, T, H, K]``, per key channel): log decay ``log α ≤ 0``;
- ``hook_beta`` ``[B, T, H]``: base write strength β (GLA: 1);
- ``hook_gamma`` ``[B, T, H]``: residual write/read strength γ (RLA / RDN only; with ``gamma="tied"`` a copy of β
  taken before ``hook_beta``);
- ``hook_readout`` ``[B, T, H, V]``: the op's read-out ``o``, before the output norm and gate;
- ``hook_state`` ``[B, H, V, K]``: the base state S after the last token of this forward (float32 / float64);
- ``hook_residual_state`` ``[B, H, V, K]``: the residual state R (RLA / RDN only).

In a decoding step T = 1. What a hook returns replaces the tensor: a replaced ``hook_state`` is what the cache keeps
for the next tokens. A hook may also edit the tensor in place (``out.mul_(0)``, ``out[:, 3] = 0``), also under
autograd: the points whose tensor autograd could not follow through an in-place edit get a tensor of their own when
gradients are recorded (``editable``): q, k and v (q and k are what the L2 norm keeps for its backward; q, k and v
are views of one fused projection), g, β and γ (kept by the functions that made them), the read-out and the states
(views of buffers made inside the op's autograd Functions).

A point costs nothing while no hook is on it (``HookPoint.is_hooked``): no copy is made for it, and without a cache
and a hook on ``hook_state`` / ``hook_residual_state`` the op is not asked for its final states at all.

The op's value check of the gates (``check_values``, one device→host synchronisation per call) runs only while a
hook sits on ``hook_g``, ``hook_beta`` or ``hook_gamma``: a hook may write any value there, and a log decay > 0 or a
strength outside [0, 2] is then the hook's bug, reported as a ``ValueError``. Without one the gates are in range by
construction (``g = −exp(A)·softplus(·)`` or ``logsigmoid(·)/c`` ≤ 0, ``β, γ = sigmoid(·)`` or ``2·sigmoid(·)``,
zero at padding), so a training step pays no host sync per layer for it. A NaN or infinity that the model itself
produces is a diverged run, not an input error: the trainer's loss check reports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from linmem.layers.conv import ShortConvolution
from linmem.layers.hooks import HookPoint
from linmem.ops import MemoryConfig, linear_memory, linear_memory_step

if TYPE_CHECKING:
    from linmem.layers.layer_cache import RecurrentLayerCache


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last axis (FLA's ``l2norm``, eps inside the root), in at least float32."""
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    return (y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def padding_mask(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The last ``length`` columns of a ``[B, past + T]`` 0/1 mask as a bool ``[B, T]`` (True = real), or None."""
    if attention_mask is None:
        return None
    return attention_mask[:, -length:].bool()


def zero_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x [B, T, ...]`` with every padded position set to 0 (``where``, not a product: garbage, even NaN, in
    padded hidden states cannot leak)."""
    if mask is None:
        return x
    return torch.where(mask.view(*mask.shape, *([1] * (x.dim() - 2))), x, torch.zeros((), dtype=x.dtype))


def editable(x: torch.Tensor, views_only: bool = False) -> torch.Tensor:
    """``x``, or a contiguous copy of it where a hook's in-place edit of ``x`` would break the backward pass.

    Only while autograd records ``x`` (grad enabled and ``x.requires_grad``): then a copy is made if ``x`` is a
    view (of an op's internal buffer, which autograd cannot rebase an in-place edit onto), or always unless
    ``views_only`` (for tensors that the op that made them may keep for its backward, as a sigmoid keeps its
    output). A non-contiguous view is copied into the layout a later ``reshape`` would copy it into anyway."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    if views_only and x._base is None:
        return x
    return x.clone(memory_format=torch.contiguous_format)


class RecurrentMixer(nn.Module):
    """Base class of the linear-memory mixers (not used on its own).

    Args:
        memory: which memory the op computes (rule, residual and the ablation switches).
        backend: the op's backend, ``"auto"`` | ``"reference"`` | ``"chunk"`` | ``"triton"``, passed to the op as
            it is (the op checks it); a model sets it on every mixer with ``set_backend``.
    """

    def __init__(self, memory: MemoryConfig, backend: str = "auto", layer_idx: int | None = None):
        super().__init__()
        self.memory = memory
        self.backend = backend
        self.layer_idx = layer_idx
        for name in ("q", "k", "v", "g", "beta", "readout", "state"):
            setattr(self, f"hook_{name}", HookPoint())
        if memory.residual:
            self.hook_gamma = HookPoint()
            self.hook_residual_state = HookPoint()

    def _make_convs(self, dims: dict[str, int], conv_size: int, conv_bias: bool) -> None:
        """``q_conv1d``, ``k_conv1d``, ``v_conv1d`` with SiLU (FLA's names and shapes)."""
        for name, dim in dims.items():
            setattr(self, f"{name}_conv1d", ShortConvolution(dim, conv_size, bias=conv_bias, activation="silu"))

    def project(
        self,
        name: str,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        cache: RecurrentLayerCache | None,
        silu_without_conv: bool,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``{name}_proj(x)`` then the short conv + SiLU (or only SiLU / nothing without convs), zero at padding:
        ``[B, T, D]``; with ``cu_seqlens`` the conv stays inside each packed sequence."""
        x = getattr(self, f"{name}_proj")(x)
        if not self.use_short_conv:
            return zero_padding(F.silu(x) if silu_without_conv else x, mask)
        state = None if cache is None else cache.conv_states.get(name)
        y, new_state = getattr(self, f"{name}_conv1d")(x, state=state, mask=mask, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.conv_states[name] = new_state
        return zero_padding(y, mask)

    def run_memory(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        gamma: torch.Tensor | None,
        cache: RecurrentLayerCache | None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fire the write hooks, run the memory from the cached state, store the new state.

        Args:
            q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` or ``[B, T, H, K]``; beta, gamma:
                ``[B, T, H]`` (gamma None without a residual memory).
            cache: this layer's cache, updated in place; None runs from zero states and keeps nothing.
            cu_seqlens: ``[N + 1]``: B == 1 row of N packed sequences, each run from zero states (no cache; the
                state hooks see the N final states ``[N, H, V, K]``).
        Returns:
            the read-out ``[B, T, H, V]`` (after ``hook_readout``).
        """
        if cu_seqlens is not None and cache is not None:
            raise ValueError("cu_seqlens: packed sequences run from zero states and keep none; pass cache=None")
        q, k, v = self._through(self.hook_q, q), self._through(self.hook_k, k), self._through(self.hook_v, v)
        g = self._through(self.hook_g, g)
        beta = self._through(self.hook_beta, beta)
        if self.memory.residual:
            gamma = self._through(self.hook_gamma, gamma)
        state = None if cache is None else cache.memory_state(self.memory.residual)
        check_values = self._gates_hooked()
        if cache is not None and q.shape[1] == 1:  # decoding: one step of the recurrence
            o, final = linear_memory_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], None if gamma is None else gamma[:, 0], state,
                memory=self.memory, check_values=check_values,
            )
            o = o.unsqueeze(1)
        else:
            o, final = linear_memory(q, k, v, g, beta, gamma, memory=self.memory, initial_state=state,
                                     output_final_state=self._wants_final_state(cache), backend=self.backend,
                                     cu_seqlens=cu_seqlens, check_values=check_values)
        if final is not None:
            self._keep_state(final, cache, q.shape[1])
        return self._through(self.hook_readout, o, views_only=True)

    @staticmethod
    def _through(point: HookPoint, x: torch.Tensor, views_only: bool = False) -> torch.Tensor:
        """``point(x)``, with ``x`` first made ``editable`` only where a hook on the point could edit it in place."""
        return point(editable(x, views_only) if point.is_hooked else x)

    def _gates_hooked(self) -> bool:
        """Whether a hook could have written the gates (then the op checks their values; see the module notes)."""
        points = [self.hook_g, self.hook_beta] + ([self.hook_gamma] if self.memory.residual else [])
        return any(point.is_hooked for point in points)

    def _wants_final_state(self, cache: RecurrentLayerCache | None) -> bool:
        """Whether anything reads the final states: a cache to continue from them, or a hook on a state point."""
        hooked = self.hook_state.is_hooked or (self.memory.residual and self.hook_residual_state.is_hooked)
        return cache is not None or hooked

    def _keep_state(self, final, cache: RecurrentLayerCache | None, length: int) -> None:
        base, resid = final if self.memory.residual else (final, None)
        base = self._through(self.hook_state, base)
        if self.memory.residual:
            resid = self._through(self.hook_residual_state, resid)
        if cache is not None:
            cache.base_state, cache.residual_state = base, resid
            cache.seen_tokens += length
