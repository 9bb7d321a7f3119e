"""Hook points by name (``linmem.layers.hooks``): ``hook_names``, ``run_with_cache`` and ``run_with_hooks`` on every
model, the lab's state swap and write block redone with them alone, and the free path of a point without hooks
(no copies, no final states) giving the same logits and gradients."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import linmem.layers.recurrent as recurrent
import linmem.memory as mm
import linmem.memory.edits as edits
from linmem.layers.hooks import HookPoint
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.modeling import CACHE_FIELD
from tests.mixer_cases import MIXER_CASES

VOCAB = 48
TOL = 1e-10


def build(case: str, **overrides) -> LinMemForCausalLM:
    """A tiny float64 model of ``case`` with weights large enough that memories and their edits matter."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, expand_v=2.0,
                    hidden_ratio=2, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = LinMemForCausalLM(LinMemConfig(**{**settings, **MIXER_CASES[case], **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("a_proj.weight", "b_proj.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight")):
                p.normal_(0, 0.4)
    return model.double().eval()


def prompts(at: int, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Recipient and donor ``[2, length]`` that differ before ``at`` and agree from there on."""
    generator = torch.Generator().manual_seed(1)
    recipient = torch.randint(1, VOCAB, (2, length), generator=generator)
    donor = recipient.clone()
    donor[:, :at] = torch.randint(1, VOCAB, (2, at), generator=generator)
    return recipient, donor


def test_names_are_module_paths_of_every_mixer_and_attention():
    model = build("rdn_hybrid")
    names = model.hook_names()
    assert names == [n for n, m in model.named_modules() if isinstance(m, HookPoint)]
    assert {"model.layers.0.attn.hook_state", "model.layers.0.attn.hook_residual_state",
            "model.layers.1.attn.hook_q", "model.layers.2.attn.hook_readout"} <= set(names)
    assert model.model.hook_names()[0] == "layers.0.attn.hook_q"  # the backbone names from itself


def test_run_with_cache_selects_by_list_glob_prefix_and_predicate():
    model = build("rdn_hybrid")
    ids = prompts(4)[0]
    with torch.no_grad():
        plain = model(ids).logits
        out, every = model.run_with_cache(ids)
        assert torch.equal(out.logits, plain) and set(every) == set(model.hook_names())
        seen = {}
        handle = model.model.layers[2].attn.hook_v.register_forward_hook(lambda m, a, x: seen.setdefault("v", x))
        _, one = model.run_with_cache(ids, names=["model.layers.2.attn.hook_v"])
        handle.remove()
        assert list(one) == ["model.layers.2.attn.hook_v"] and torch.equal(one["model.layers.2.attn.hook_v"], seen["v"])
        _, states = model.run_with_cache(ids, names="*.hook_state")
        assert list(states) == ["model.layers.0.attn.hook_state", "model.layers.2.attn.hook_state"]
        _, layer = model.run_with_cache(ids, names="model.layers.1")
        assert list(layer) == ["model.layers.1.attn.hook_q", "model.layers.1.attn.hook_k"]
        _, picked = model.run_with_cache(ids, names=lambda name: name.endswith("hook_beta"))
        assert list(picked) == ["model.layers.0.attn.hook_beta", "model.layers.2.attn.hook_beta"]
    assert all(not m._forward_hooks for m in model.modules())


def test_unknown_names_say_what_is_close():
    model = build("gdn")
    ids = prompts(4)[0]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.attn\.hook_stat'.*model\.layers\.0\.attn\.hook_state"):
        model.run_with_cache(ids, names=["model.layers.0.attn.hook_stat"])
    with pytest.raises(ValueError, match="no hook point matches 'model.layers.0.attn.hook'"):  # prefixes are dotted
        model.run_with_hooks(ids, hooks=[("model.layers.0.attn.hook_k", no_op), ("model.layers.0.attn.hook", no_op)])
    with pytest.raises(TypeError, match="fn"):
        model.run_with_hooks(ids, hooks=[("model.layers.0.attn.hook_k", None)])
    with pytest.raises(ValueError, match="predicate accepts no hook point"):
        model.run_with_cache(ids, names=lambda name: False)
    assert all(not m._forward_hooks for m in model.modules())


def test_hooks_are_removed_when_the_run_raises():
    model = build("gdn")

    def fail(tensor, name):
        raise RuntimeError(f"stop at {name}")

    with pytest.raises(RuntimeError, match="stop at model.layers.0.attn.hook_readout"):
        model.run_with_hooks(prompts(4)[0], hooks=[("*.hook_q", lambda x, n: None), ("*.hook_readout", fail)])
    assert all(not m._forward_hooks for m in model.modules())


def swap_state_by_name(model, recipient, donor, layer: int, head: int, at: int) -> torch.Tensor:
    """The lab's ``StateSwap([(layer, head, "S")], at)`` from names alone: the donor's state after ``at`` tokens
    put into the recipient's through ``hook_state``, kept by the cache, and the suffix run from that cache."""
    name = f"model.layers.{layer}.attn.hook_state"
    _, donor_states = model.run_with_cache(donor[:, :at], names=name)

    def swap(state: torch.Tensor, point: str) -> torch.Tensor:
        state = state.clone()
        state[:, head] = donor_states[point][:, head]
        return state

    prefix = model.run_with_hooks(recipient[:, :at], hooks=[(name, swap)], use_cache=True)
    suffix = model(recipient[:, at:], cache=getattr(prefix, CACHE_FIELD), use_cache=True)
    return torch.cat([prefix.logits, suffix.logits], dim=1)


def block_write_by_name(model, ids, layer: int, head: int, span: tuple[int, int]) -> torch.Tensor:
    """The lab's ``WriteBlock([(layer, head, "S")], span)`` from names alone: β of the head zeroed in place."""

    def block(beta: torch.Tensor, name: str) -> None:
        beta[:, span[0]:span[1], head] = 0

    return model.run_with_hooks(ids, hooks=[(f"model.layers.{layer}.attn.hook_beta", block)]).logits


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gla", "gdn", "rla", "rdn_hybrid"])
@torch.no_grad()
def test_state_swap_and_write_block_by_name_give_the_labs_numbers(case):
    model = build(case)
    layer = mm.recurrent_layers(model)[-1]
    recipient, donor = prompts(at=6)
    lab_swap = mm.run(model, recipient, donor, [mm.StateSwap([(layer, 1, "S")], at=6)])
    by_name = swap_state_by_name(model, recipient, donor, layer, 1, at=6)
    assert (by_name - lab_swap).abs().max().item() < TOL
    assert (by_name - model(recipient).logits).abs().max().item() > 1e-4  # the swap changed the answer
    lab_block = mm.run(model, recipient, edits=[mm.WriteBlock([(layer, 0, "S")], span=(2, 7))])
    blocked = block_write_by_name(model, recipient, layer, 0, (2, 7))
    assert (blocked - lab_block).abs().max().item() < TOL
    assert (blocked - model(recipient).logits).abs().max().item() > 1e-4


def no_op(tensor: torch.Tensor, name: str) -> None:
    """A hook that reads nothing and changes nothing: its presence alone makes a point hooked."""


@pytest.mark.parametrize("case", ["gdn", "rdn_hybrid", "gla"])
def test_points_without_hooks_copy_nothing_and_skip_final_states(case, monkeypatch):
    """A training step with no hook makes no ``editable`` copy and asks the op for no final state; with a no-op
    hook on every point it makes the copies and takes the states; logits and gradients are equal either way."""
    model = build(case).train()
    ids = prompts(4)[0]
    copies, finals = [], []
    real_editable, real_op = recurrent.editable, recurrent.linear_memory

    def counting_editable(x, views_only=False):
        y = real_editable(x, views_only)
        copies.append(y is not x)
        return y

    def recording_op(*args, output_final_state=False, **kwargs):
        finals.append(output_final_state)
        return real_op(*args, output_final_state=output_final_state, **kwargs)

    monkeypatch.setattr(recurrent, "editable", counting_editable)
    monkeypatch.setattr(recurrent, "linear_memory", recording_op)

    def step(hooks) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        out = model.run_with_hooks(ids, labels=ids, use_cache=False, hooks=hooks)
        out.loss.backward()
        return out.logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    free_logits, free_grads = step([])
    assert not any(copies) and finals and not any(finals)
    copies.clear(), finals.clear()
    hooked_logits, hooked_grads = step([(None, no_op)])
    assert any(copies) and finals and all(finals)
    assert torch.equal(free_logits, hooked_logits) and torch.equal(free_grads, hooked_grads)


def test_edits_import_nothing_from_intervene():
    """Edits get an ``EditContext`` from the run instead of the run's ``LayerEditor``: ``edits.py`` does not import
    ``intervene.py``, not even for annotations, so the two modules do not depend on each other both ways."""
    tree = ast.parse(Path(edits.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "linmem.memory.intervene" not in imported
