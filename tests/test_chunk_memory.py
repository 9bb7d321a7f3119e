"""The chunk backend's memory grows linearly in T for every memory, GLA's per-key decay included: the largest
tensor that a forward+backward creates at length 2T is at most about twice the one at length T (a quadratic
``[B, H, N, N, K]`` hand-over would make it four times). Counted by tensor size, not timed."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linmem.ops import linear_memory


class LargestTensor(TorchDispatchMode):
    """Records the number of bytes of the largest tensor any operation returns."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def largest_tensor(T: int, rule: str, residual: bool, per_key: bool) -> int:
    B, H, K, V = 1, 2, 16, 16
    q = torch.randn(B, T, H, K, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).requires_grad_()
    v = torch.randn(B, T, H, V, requires_grad=True)
    g = (-torch.rand(B, T, H, K) if per_key else -torch.rand(B, T, H)).requires_grad_()
    beta, gamma = torch.rand(B, T, H), torch.rand(B, T, H)
    with LargestTensor() as mode:
        o, _ = linear_memory(q, k, v, g, beta, gamma if residual else None, rule=rule, residual=residual,
                             backend="chunk")
        o.square().sum().backward()
    return mode.bytes


@pytest.mark.slow
@pytest.mark.parametrize("rule,residual,per_key", [("additive", False, False), ("additive", False, True),
                                                   ("delta", False, False), ("additive", True, False),
                                                   ("additive", True, True), ("delta", True, False)])
def test_largest_tensor_grows_linearly_with_length(rule, residual, per_key):
    short, long = largest_tensor(2048, rule, residual, per_key), largest_tensor(4096, rule, residual, per_key)
    assert long <= 2.2 * short, (short, long)
