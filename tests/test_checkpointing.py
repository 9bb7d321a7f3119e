"""Gradient checkpointing per block: ``gradient_checkpointing_enable()`` recomputes every block in the backward pass
and gives the same loss and the same gradient for every parameter (float64, every mixer and a hybrid, left
padding), keeps fewer activations, turns caches off in training, and the trainer's ``train.gradient_checkpointing``
switch trains the same run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.autograd.graph import saved_tensors_hooks

from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.train.config import parse_config
from linmem.train.distributed import enable_gradient_checkpointing
from linmem.train.trainer import train
from tests.mixer_cases import MIXER_CASES
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)

VOCAB = 61


def tiny_model(case: dict, seed: int) -> LinMemForCausalLM:
    shape = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=1.0,
                 intermediate_size=40, initializer_range=0.2, backend="reference")
    torch.manual_seed(seed)
    return LinMemForCausalLM(LinMemConfig(**{**shape, **case})).double().train()


def loss_and_grads(model: LinMemForCausalLM, ids: torch.Tensor, mask: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def count_mixer_calls(model: LinMemForCausalLM) -> list[int]:
    calls = [0] * len(model.model.layers)
    for i, block in enumerate(model.model.layers):
        block.attn.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("name", list(MIXER_CASES))
def test_same_loss_and_gradients_with_checkpointing(name):
    seed = int(torch.randint(0, 2**31, ()).item())
    model = tiny_model(MIXER_CASES[name], seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in one row: the mask reaches every checkpointed block
    loss, grads = loss_and_grads(model, ids, mask)
    calls = count_mixer_calls(model)
    with pytest.warns(FutureWarning):  # transformers' deprecated alias, the name users know
        model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and all(b.gradient_checkpointing for b in model.model.layers)
    loss_ckpt, grads_ckpt = loss_and_grads(model, ids, mask)
    assert calls == [2] * len(calls), "each block runs again in the backward pass"
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-12, atol=0)
    assert grads_ckpt.keys() == grads.keys()
    for key, grad in grads.items():
        assert grad.abs().sum() > 0 or key.endswith(".bias"), f"{name}: {key} gets no gradient"
        torch.testing.assert_close(grads_ckpt[key], grad, rtol=1e-10, atol=1e-13, msg=f"{name}: {key}")
    model.gradient_checkpointing_disable()
    calls[:] = [0] * len(calls)
    loss_again, _ = loss_and_grads(model, ids, mask)
    assert calls == [1] * len(calls) and loss_again == loss


def saved_bytes(model: LinMemForCausalLM, ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one forward (each storage counted once)."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(storages.values())


def test_checkpointing_keeps_fewer_activations():
    model = tiny_model(dict(mixer="rdn", num_hidden_layers=4), seed=0)
    ids = torch.randint(0, VOCAB, (2, 64))
    plain = saved_bytes(model, ids)
    enable_gradient_checkpointing(model)
    checkpointed = saved_bytes(model, ids)
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


def test_caches_are_off_in_checkpointed_training():
    model = tiny_model(MIXER_CASES["rdn_hybrid"], seed=1)
    enable_gradient_checkpointing(model)
    ids = torch.randint(0, VOCAB, (1, 9))
    out = model(input_ids=ids, use_cache=True)
    assert out.cache is None
    with torch.no_grad():  # nothing is recomputed without gradients: the cache is filled as usual
        cache = model(input_ids=ids, use_cache=True).cache
        assert cache is not None and cache.get_seq_length() == 9
    with pytest.raises(ValueError, match="cache"):
        model(input_ids=ids, cache=cache)
    model.eval()
    generated = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 12)


def test_trainer_switch_trains_the_same_run(dataset, tmp_path):
    runs = {}
    for switch in (False, True):
        config = parse_config(tiny_config(dataset, model={**tiny_config(dataset)["model"], "mixer": "rdn"},
                                          train={"steps": 3, "eval_interval": 0, "checkpoint_interval": 0,
                                                 "gradient_checkpointing": switch}))
        out = tmp_path / f"ckpt-{switch}"
        train(config, out)
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in lines if "grad_norm" in r]
        runs[switch] = ([v for r in steps for v in (r["loss"], r["grad_norm"])],
                        load_file(out / "model" / "model.safetensors"))
    (metrics_plain, weights_plain), (metrics_ckpt, weights_ckpt) = runs[False], runs[True]
    assert len(metrics_plain) == 6
    assert metrics_ckpt == pytest.approx(metrics_plain, rel=1e-5)
    for key, weight in weights_plain.items():
        torch.testing.assert_close(weights_ckpt[key], weight, rtol=1e-5, atol=1e-6, msg=key)


def test_config_switch_is_checked(dataset):
    with pytest.raises(ValueError, match=r"train\.gradient_checkpointing must be bool"):
        parse_config(tiny_config(dataset, train={"gradient_checkpointing": "yes"}))
