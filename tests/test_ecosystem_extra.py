"""linmem with the habits of interpretability and Hugging Face users: hook points edited in place under autograd,
``output_attentions``, pyvene's module mapping, distributed validation over every window, a CLI that answers before
importing torch, and perplexities that say which text they were measured on."""

from __future__ import annotations

import pytest
import torch

from linmem.layers.hooks import HookPoint
from linmem.models import LinMemConfig, LinMemForCausalLM
from tests.mixer_cases import MIXER_CASES

VOCAB = 48


def tiny_model(case: dict, **overrides) -> LinMemForCausalLM:
    """A two-layer float64 model of ``case`` (``MIXER_CASES``) with fresh random weights."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16)
    settings.update(case)
    settings.update(overrides)
    return LinMemForCausalLM(LinMemConfig(**settings)).double()


def loss_and_grads(model: LinMemForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def hook_point_names(model: LinMemForCausalLM) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, HookPoint)]


def edit_in_place(module, args, out):
    """Copy the first row along axis 1 into the second (a token into the next, or a state's head into the next),
    then scale everything by 0.75."""
    out[:, 1] = out[:, 0]
    out.mul_(0.75)


def edit_out_of_place(module, args, out):
    """``edit_in_place`` on a new tensor, returned to replace the hook point's tensor."""
    edited = out.clone()
    edited[:, 1] = edited[:, 0]
    return edited * 0.75


HOOK_EDIT_CASES = [(case, "chunk") for case in sorted(MIXER_CASES)] + [("rdn", "reference")]


@pytest.mark.parametrize(("case", "backend"), HOOK_EDIT_CASES)
def test_every_hook_point_can_be_edited_in_place_under_autograd(case, backend):
    """An in-place edit of a hook point's tensor (index assignment and ``mul_``) gives the loss and gradients of the
    same edit returned as a new tensor, and differs from the unedited run (the edit took effect)."""
    torch.manual_seed(0)
    model = tiny_model(MIXER_CASES[case], backend=backend,
                       num_hidden_layers=MIXER_CASES[case].get("num_hidden_layers", 1))
    ids = torch.randint(0, VOCAB, (2, 7))
    clean_loss, _ = loss_and_grads(model, ids)
    names = hook_point_names(model)
    assert any(name.endswith("hook_readout") for name in names)
    modules = dict(model.named_modules())
    for name in names:
        handle = modules[name].register_forward_hook(edit_in_place)
        try:
            edited_loss, edited_grads = loss_and_grads(model, ids)
        finally:
            handle.remove()
        handle = modules[name].register_forward_hook(edit_out_of_place)
        try:
            expected_loss, expected_grads = loss_and_grads(model, ids)
        finally:
            handle.remove()
        assert torch.isfinite(edited_loss) and all(torch.isfinite(g).all() for g in edited_grads), name
        torch.testing.assert_close(edited_loss, expected_loss, msg=name)
        for got, want in zip(edited_grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, msg=name)
        if not name.endswith("state"):  # the final states feed no output of this forward
            assert edited_loss != clean_loss, f"{name}: the in-place edit had no effect"
