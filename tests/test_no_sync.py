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


def packed_inputs(length=21, heads=2, key_dim=4, value_dim=3, dtype=torch.float32):
    torch.manual_seed(1)
    return dict(q=torch.randn(1, length, heads, key_dim, dtype=dtype),
                k=torch.nn.functional.normalize(torch.randn(1, length, heads, key_dim, dtype=dtype), dim=-1),
                v=torch.randn(1, length, heads, value_dim, dtype=dtype),
                g=-0.2 * torch.rand(1, length, heads, dtype=dtype), beta=torch.rand(1, length, heads, dtype=dtype))


def test_cu_seqlens_is_read_once_per_tensor_and_again_when_it_changes():
    """The boundaries of one ``cu_seqlens`` tensor are read back once; an in-place write (also under no_grad, or
    through a view), a new tensor with other values, or an inference tensor are read again, and each call's output
    is that of a fresh tensor with its values."""
    x = packed_inputs()

    def run(cu_seqlens):
        with counting_host_reads() as (counts, _):
            o, _ = linear_memory(**x, rule="delta", backend="chunk", cu_seqlens=cu_seqlens, check_values=False)
        return o, counts["tolist"]

    def fresh(cu_seqlens):
        return linear_memory(**x, rule="delta", backend="chunk", cu_seqlens=cu_seqlens.clone())[0]

    cu_seqlens = torch.tensor([0, 5, 5, 17, 21], dtype=torch.int32)
    first, reads = run(cu_seqlens)
    assert reads == 1
    again, reads = run(cu_seqlens)
    assert reads == 0 and torch.equal(again, first)
    with torch.no_grad():
        cu_seqlens[1] = 4
    changed, reads = run(cu_seqlens)
    assert reads == 1 and torch.equal(changed, fresh(cu_seqlens)) and not torch.equal(changed, first)
    cu_seqlens[1:3].fill_(2)  # through a view
    changed, reads = run(cu_seqlens)
    assert reads == 1 and torch.equal(changed, fresh(cu_seqlens))
    assert run(cu_seqlens)[1] == 0
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):  # a bad write is caught too
        cu_seqlens[1] = 30
        run(cu_seqlens)
    with pytest.raises(ValueError, match="end at T = 20"):  # the length is checked at every call, read or not
        linear_memory(**{n: t[:, :20] for n, t in x.items()}, backend="chunk", cu_seqlens=torch.tensor([0, 21]))
    other = torch.tensor([0, 21])
    assert run(other)[1] == 1 and run(other)[1] == 0
    with torch.inference_mode():
        inference = torch.tensor([0, 4, 21])
    assert run(inference)[1] == 1 and run(inference)[1] == 1


def test_the_cache_keeps_no_tensor_alive():
    import gc
    import weakref

    from linmem.ops import backend

    x = packed_inputs()
    cu_seqlens = torch.tensor([0, 7, 21])
    linear_memory(**x, backend="chunk", cu_seqlens=cu_seqlens)
    ref = weakref.ref(cu_seqlens)
    assert id(cu_seqlens) in backend._PACKED
    key = id(cu_seqlens)
    del cu_seqlens
    gc.collect()
    assert ref() is None and key not in backend._PACKED


def test_unpad_and_document_starts_hand_the_op_their_boundaries():
    from linmem.ops.packing import document_starts, unpad

    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 1, 1]])
    with counting_host_reads() as (counts, where):
        indices, cu_seqlens = unpad(mask)
    assert sum(counts.values()) == 1, where  # the boundaries, read once
    assert indices.tolist() == [0, 1, 3, 9, 10, 11] and cu_seqlens.tolist() == [0, 3, 3, 6]
    x = {name: t[:, :6] for name, t in packed_inputs().items()}
    with counting_host_reads() as (counts, _):
        linear_memory(**x, backend="chunk", cu_seqlens=cu_seqlens, check_values=False)
    assert not counts
    cu_seqlens = document_starts(torch.tensor([[5, 2, 7, 2], [2, 3, 3, 3]]), separator_id=2)
    assert cu_seqlens.tolist() == [0, 2, 4, 5, 8]
    x = {name: t[:, :8] for name, t in packed_inputs().items()}
    with counting_host_reads() as (counts, _):
        o = linear_memory(**x, backend="chunk", cu_seqlens=cu_seqlens, check_values=False)[0]
    assert not counts
    assert torch.equal(o, linear_memory(**x, backend="chunk", cu_seqlens=cu_seqlens.clone())[0])


@pytest.fixture
def counted_layouts(monkeypatch):
    """Counts of ``SequenceLayout.packed`` builds (the Triton kernels' chunk layout of packed sequences)."""
    pytest.importorskip("triton")
    from linmem.ops.triton.layout import SequenceLayout

    built = Counter()
    original = SequenceLayout.packed.__func__

    def packed(cls, bounds, device, chunk=64):
        built[tuple(bounds)] += 1
        return original(cls, bounds, device, chunk)

    monkeypatch.setattr(SequenceLayout, "packed", classmethod(packed))
    return built


def test_a_padded_batch_is_laid_out_once_per_forward(counted_layouts):
    """A 3-layer GDN on the Triton kernels (interpreted on the CPU) with left and inner padding: the mask is
    unpadded into one cu_seqlens, whose boundaries are read once and laid out once for all layers, forward and
    backward; another batch's mask is laid out again."""
    model = tiny_model("gdn", dtype=torch.float32)
    model.set_backend("triton")
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 4] = 0
    with counting_host_reads() as (counts, _):
        model(ids, attention_mask=mask).logits.square().mean().backward()
    assert dict(counted_layouts) == {(0, 6, 14): 1}
    assert counts["tolist"] == 1  # unpad's; the op reads nothing
    mask[1, 4] = 1
    model(ids, attention_mask=mask)
    assert dict(counted_layouts) == {(0, 6, 14): 1, (0, 6, 15): 1}


def test_the_triton_layout_is_built_once_per_cu_seqlens(counted_layouts):
    pytest.importorskip("triton")
    x = packed_inputs()
    cu_seqlens = torch.tensor([0, 3, 3, 17, 21], dtype=torch.int32)
    first = linear_memory(**x, rule="delta", backend="triton", cu_seqlens=cu_seqlens)[0]
    again = linear_memory(**x, rule="delta", backend="triton", cu_seqlens=cu_seqlens)[0]
    assert torch.equal(first, again) and dict(counted_layouts) == {(0, 3, 3, 17, 21): 1}
    reference = linear_memory(**{n: t.double() for n, t in x.items()}, rule="delta", backend="reference",
                              cu_seqlens=cu_seqlens)[0]
    assert (first.double() - reference).abs().max() < 1e-5
    cu_seqlens[1:3] = 8
    moved = linear_memory(**x, rule="delta", backend="triton", cu_seqlens=cu_seqlens)[0]
    reference = linear_memory(**{n: t.double() for n, t in x.items()}, rule="delta", backend="reference",
                              cu_seqlens=cu_seqlens.clone())[0]
    assert (moved.double() - reference).abs().max() < 1e-5
    assert dict(counted_layouts) == {(0, 3, 3, 17, 21): 1, (0, 8, 8, 17, 21): 1}


@pytest.mark.parametrize("zero", ["S0", "R0"])
def test_a_zero_initial_state_gets_its_gradient(zero):
    """The chunk backend's RLA no longer asks whether a state is zero (a host read) to decide its gradient: a zero
    S0 or R0 that requires grad gets the reference's gradient, the other state given or not."""
    x = gates(length=70, key_dim=4, value_dim=3)
    x["gamma"] = torch.rand_like(x["beta"])
    grads = {}
    for backend in ("chunk", "reference"):
        states = {"S0": torch.zeros(2, 2, 3, 4, dtype=F64, requires_grad=True),
                  "R0": 0.3 * torch.randn(2, 2, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(3))}
        if zero == "R0":
            states = {"S0": states["R0"], "R0": states["S0"]}
        o, _ = linear_memory(**x, residual=True, initial_state=(states["S0"], states["R0"]), backend=backend)
        o.square().sum().backward()
        grads[backend] = states[zero].grad
    assert grads["chunk"] is not None and grads["chunk"].abs().max() > 0
    assert (grads["chunk"] - grads["reference"]).abs().max() < 1e-10
