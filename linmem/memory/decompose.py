"""The state of one head as a sum of per-token contributions (``docs/math.md``, "Decomposition").

Along the recorded trajectory, ``C_i^(i) = W_i`` (token i's write) and ``C_i^(t) = 𝒯_t(C_i^(t−1))`` with ``𝒯_t`` the
linear map step t applies to the old state. Base memory S: ``W_i = β_i v_i k_iᵀ``, ``𝒯_t(X) = α_t X`` (additive; GLA:
``X·diag(α_t)``) or ``α_t X (I − β_t k_t k_tᵀ)`` (delta). Residual memory R (RLA / RDN): ``W_i = γ_i r_i k_iᵀ`` with the
recorded ``r_i = ρ(v_i − S_{i−1}k_i)`` and ``γ`` in place of ``β``; without ``fit_history`` R keeps only this token's
``r_t k_tᵀ``. Exact for this trajectory only: a causal effect needs a re-run (``linmem.memory.run``).
"""

from __future__ import annotations

import torch
from torch import nn

from linmem.memory.components import Component, check_component, mixer
from linmem.memory.recording import Recording, backbone, on_model
from linmem.models.cache import LinMemCache
from linmem.ops.linear_memory import state_dtype_for
from linmem.ops.step import read, rho


def _prompt(ids: torch.Tensor, t: int) -> torch.Tensor:
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.shape[0] != 1:
        raise ValueError(f"ids must be one prompt, [T] or [1, T]; got {list(ids.shape)}")
    if not 0 <= t < ids.shape[1]:
        raise ValueError(f"t must be in [0, {ids.shape[1]}); got {t}")
    return ids[:, : t + 1]


@torch.no_grad()
def state(model: nn.Module, ids: torch.Tensor, layer: int, head: int, t: int, memory: str = "S") -> torch.Tensor:
    """The memory ``[V, K]`` of ``(layer, head, memory)`` after tokens ``[0, t]`` of ``ids [T]`` (or ``[1, T]``)."""
    check_component(model, Component(layer, head, memory))
    cache = LinMemCache.from_config(model.config)
    backbone(model)(input_ids=on_model(model, _prompt(ids, t)), cache=cache, use_cache=True)
    layer_cache = cache.layers[layer]
    return (layer_cache.base_state if memory == "S" else layer_cache.residual_state)[0, head]


def _transition(x: torch.Tensor, g: torch.Tensor, k: torch.Tensor, strength: torch.Tensor, rule: str):
    """``𝒯(X)`` for a stack ``x [n, V, K]``: ``α X (I − s k kᵀ)`` (delta) or ``α X`` (additive)."""
    if rule == "delta":
        x = x - strength * torch.einsum("nv,k->nvk", x @ k, k)
    return x * g.exp()[None, None, :] if g.dim() else x * g.exp()  # per key channel (GLA) or per head


@torch.no_grad()
def contributions(model: nn.Module, ids: torch.Tensor, layer: int, head: int, t: int,
                  memory: str = "S") -> torch.Tensor:
    """``C_i^(t)`` for ``i = 0 .. t``: ``[t + 1, V, K]``; their sum is ``state(model, ids, layer, head, t, memory)``.

    ``ids``: one prompt ``[T]`` or ``[1, T]``; ``memory``: ``"S"`` or ``"R"``.
    """
    check_component(model, Component(layer, head, memory))
    mix = mixer(model, layer)
    inputs = Recording.of(model, _prompt(ids, t), [layer]).inputs[layer]
    x = {name: value[0, :, head].to(state_dtype_for(inputs["q"].dtype)) for name, value in inputs.items()}
    config = mix.memory
    size = (t + 1, x["v"].shape[-1], x["k"].shape[-1])
    base_parts, resid_parts = x["v"].new_zeros(size), x["v"].new_zeros(size)
    base = x["v"].new_zeros(size[1:])
    for j in range(t + 1):
        k, v, g, beta = x["k"][j], x["v"][j], x["g"][j], x["beta"][j]
        if config.residual:
            r = rho(v - read(base[None, None], k[None, None])[0, 0], config.residual_target, config.clip)
            gamma = x["gamma"][j]
            if config.fit_history:
                resid_parts[:j] = _transition(resid_parts[:j], g, k, gamma, config.rule)
                resid_parts[j] = gamma * torch.outer(r, k)
            else:
                resid_parts[:j] = 0
                resid_parts[j] = torch.outer(r, k)
        base_parts[:j] = _transition(base_parts[:j], g, k, beta, config.rule)
        base_parts[j] = beta * torch.outer(v, k)
        base = base_parts[: j + 1].sum(0)
    return base_parts if memory == "S" else resid_parts
