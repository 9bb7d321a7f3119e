"""``linmem.ops.fused.token_cross_entropy``: the Triton kernels (CPU interpreter) and the eager path against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.io.labels import IGNORE_INDEX
from linmem.ops.fused.cross_entropy import token_cross_entropy


def reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.double(), targets, ignore_index=IGNORE_INDEX, reduction="none")


@pytest.mark.parametrize("rows, vocab", [(1, 5), (6, 37), (9, 300)])
def test_triton_values_and_gradients_match_float64(rows, vocab, monkeypatch):
    monkeypatch.setattr("linmem.ops.fused.cross_entropy.VOCAB_BLOCK", 64)  # several blocks per row at vocab 300
    logits = (torch.randn(rows, vocab) * 4).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    targets[0] = IGNORE_INDEX
    weights = torch.rand(rows)
    losses = token_cross_entropy(logits, targets, prefer_triton=True)
    (losses * weights).sum().backward()
    exact = logits.detach().double().requires_grad_()
    expected = reference(exact, targets)
    (expected * weights.double()).sum().backward()
    assert losses.dtype == torch.float32 and losses[0] == 0
    torch.testing.assert_close(losses.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), exact.grad, rtol=1e-5, atol=1e-6)
    assert torch.all(logits.grad[0] == 0)


def test_bf16_logits_give_bf16_gradients_and_float32_losses():
    logits = (torch.randn(4, 50) * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (4,))
    losses = token_cross_entropy(logits, targets, prefer_triton=True)
    losses.sum().backward()
    exact = logits.detach().double().requires_grad_()
    reference(exact, targets).sum().backward()
    assert losses.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(losses.double(), reference(logits.detach(), targets), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), exact.grad, rtol=1e-2, atol=4e-3)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e30, -1e30, 5.0]])
    targets = torch.tensor([1, 2])
    torch.testing.assert_close(token_cross_entropy(logits, targets, prefer_triton=True),
                               reference(logits, targets).float())


def test_target_outside_the_vocabulary_gives_nan():
    losses = token_cross_entropy(torch.randn(2, 7), torch.tensor([3, 7]), prefer_triton=True)
    assert torch.isfinite(losses[0]) and torch.isnan(losses[1])


def test_eager_path_keeps_float64_and_matches_gradcheck():
    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, IGNORE_INDEX, 10, 5])
    assert token_cross_entropy(logits, targets).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda x: token_cross_entropy(x, targets), (logits,))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        token_cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        token_cross_entropy(torch.randn(2, 3), torch.zeros(2))
