"""A run that cannot fit in memory is refused before its first update (issue: ``--set data.seq_len=100000`` grew
to 20 GB and was killed with an empty metrics log)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.train import memory_check


def tiny_model(mixer: str = "rdn") -> LinMemForCausalLM:
    return LinMemForCausalLM(LinMemConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                                          mixer=mixer, backend="chunk"))


def losses_of(model):
    def run(ids, labels):
        logits = model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none")
    return run


@pytest.mark.parametrize("mixer", ["gdn", "rdn"])
def test_saved_activations_grow_linearly(mixer):
    model = tiny_model(mixer)
    short = memory_check.saved_bytes(losses_of(model), model, 2, 64, torch.device("cpu"))
    long = memory_check.saved_bytes(losses_of(model), model, 2, 128, torch.device("cpu"))
    assert 0 < short and 1.8 * short <= long <= 2.2 * short


def test_a_run_that_does_not_fit_is_refused_with_what_to_lower(monkeypatch):
    model = tiny_model()
    need = memory_check.check_fits(losses_of(model), model, 2, 1000, torch.device("cpu"))
    monkeypatch.setattr(memory_check, "free_bytes", lambda device: need)  # fits only without headroom
    with pytest.raises(ValueError, match=r"one update needs about .* lower data.seq_len"):
        memory_check.check_fits(losses_of(model), model, 2, 1000, torch.device("cpu"), where="cfg.yaml")
    monkeypatch.setattr(memory_check, "free_bytes", lambda device: 2 * need)
    assert memory_check.check_fits(losses_of(model), model, 2, 1000, torch.device("cpu")) == pytest.approx(need)
