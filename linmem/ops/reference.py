"""The reference backend: a token loop over ``memory_step`` that reads like the equations (the spec in code).

Slow by design; supports float64 and every switch. Inputs arrive checked and in the state dtype
(see ``linmem.ops.linear_memory``).
"""

from __future__ import annotations

import torch

from linmem.ops.backend import Backend, MemoryInputs
from linmem.ops.config import MemoryConfig
from linmem.ops.step import memory_step


def reference_forward(x: MemoryInputs, base_state: torch.Tensor, residual_state: torch.Tensor | None,
                      config: MemoryConfig, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the recurrence over one batch of equal-length sequences (the ``Backend`` contract, ``backend.py``)."""
    outputs = []
    for t in range(x.q.shape[1]):
        o_t, base_state, residual_state = memory_step(x.map(lambda y, t=t: y[:, t]), base_state, residual_state,
                                                      config, scale)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1) if outputs else x.v.new_zeros(x.v.shape)
    return o, base_state, residual_state


REFERENCE = Backend("reference", reference_forward)
