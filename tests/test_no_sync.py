"""No host synchronisation in a training step: a GDN / RDN model's forward and backward read no tensor value back
to the host (counted on the CPU by patching every ``torch.Tensor`` method that does so on CUDA), the op's value
check of the gates runs only where a hook could have written them, and packed sequences' boundaries are read back
and laid out once per ``cu_seqlens`` tensor, not once per layer."""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401  (registers the Auto classes)
from linmem.models import LinMemConfig
from linmem.ops import linear_memory, linear_memory_step

F64 = torch.float64
VOCAB = 64

# every Tensor method, and torch function, that copies a value to the host or sizes its output by the values (a
# device→host synchronisation on CUDA)
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
              "masked_select", "unique")
HOST_READ_FUNCTIONS = ("nonzero", "masked_select", "unique")


@contextlib.contextmanager
def counting_host_reads():
    """Count (by method name, with where each came from) the host reads of tensors while the block runs."""
    counts: Counter[str] = Counter()
    where: list[str] = []
    patched = [(torch.Tensor, name) for name in HOST_READS] + [(torch, name) for name in HOST_READ_FUNCTIONS]
    originals = {(owner, name): getattr(owner, name) for owner, name in patched}

    def counted(name, original):
        def read(*args, **kwargs):
            counts[name] += 1
            where.append(f"{name}: " + "".join(traceback.format_stack(limit=4)[:-1]))
            return original(*args, **kwargs)

        return read

    for (owner, name), original in originals.items():
        setattr(owner, name, counted(name, original))
    try:
        yield counts, where
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


def tiny_model(mixer: str, layers: int = 3, dtype=F64):
    config = LinMemConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_heads=2, head_dim=8,
                          expand_v=2.0, hidden_ratio=2, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                          mixer=mixer)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def gates(batch=2, length=5, heads=2, key_dim=4, value_dim=3, **bad):
    torch.manual_seed(0)
    x = dict(q=torch.randn(batch, length, heads, key_dim, dtype=F64),
             k=torch.randn(batch, length, heads, key_dim, dtype=F64),
             v=torch.randn(batch, length, heads, value_dim, dtype=F64),
             g=-torch.rand(batch, length, heads, dtype=F64),
             beta=torch.rand(batch, length, heads, dtype=F64))
    for name, value in bad.items():
        x[name][1, 2, 0] = value
    return x


@pytest.mark.parametrize("name, value, message", [("g", 0.5, "g must be <= 0"),
                                                  ("beta", 3.0, "beta must be finite and in"),
                                                  ("beta", float("nan"), "beta must be finite and in")])
def test_check_values_false_skips_only_the_value_check(name, value, message):
    x = gates(**{name: value})
    with pytest.raises(ValueError, match=message):
        linear_memory(**x, rule="delta", backend="chunk")
    with counting_host_reads() as (counts, where):
        linear_memory(**x, rule="delta", backend="chunk", check_values=False)
    assert not counts, where
    step = {key: t[:, 2] for key, t in x.items()}
    with pytest.raises(ValueError, match=message):
        linear_memory_step(**step, rule="delta")
    linear_memory_step(**step, rule="delta", check_values=False)
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\]"):  # shapes are still checked
        linear_memory(**{**x, "beta": x["beta"][:, :-1]}, rule="delta", check_values=False)
    with pytest.raises(ValueError, match="check_values must be a bool"):
        linear_memory(**x, check_values=None)
    with pytest.raises(ValueError, match="g_gamma must be <= 0"):
        linear_memory(**{**x, "g": None}, g_gamma=torch.tensor([0.0, 0.1], dtype=F64))
    linear_memory(**{**x, "g": None, "beta": None}, g_gamma=torch.tensor([0.0, 0.1], dtype=F64), check_values=False)


@pytest.mark.parametrize("mixer", ["gdn", "rdn", "gla"])
def test_a_training_step_reads_nothing_back(mixer):
    """Forward, loss and backward of a 3-layer model (chunk backend) read no tensor value back to the host."""
    model = tiny_model(mixer)
    ids = torch.randint(1, VOCAB, (2, 11))
    with counting_host_reads() as (counts, where):
        loss = model(ids, labels=ids).loss
        loss.backward()
    assert not counts, "".join(where)


@pytest.mark.parametrize("point, value, message", [("hook_beta", 3.0, "beta must be finite and in"),
                                                   ("hook_g", 0.5, "g must be <= 0"),
                                                   ("hook_gamma", -1.0, "gamma must be finite and in")])
def test_a_hook_on_a_gate_brings_the_check_back(point, value, message):
    model = tiny_model("rdn")
    mixer = model.model.layers[1].attn
    ids = torch.randint(1, VOCAB, (2, 7))
    handle = getattr(mixer, point).register_forward_hook(lambda module, args, out: torch.full_like(out, value))
    with pytest.raises(ValueError, match=message):
        model(ids)
    handle.remove()
    handle = getattr(mixer, point).register_forward_hook(lambda module, args, out: out)  # a hook that writes nothing
    with counting_host_reads() as (counts, _):
        model(ids)
    assert counts["tolist"] == 1  # the one check of that layer's gates, read back together
    handle.remove()
