"""The memory lab's core: the identities of issue 4 on tiny random float64 models of every mixer, S-vs-R
attribution, the decomposition, and that runs leave weights and inputs alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401
import linmem.memory as mm
from linmem.models import LinMemConfig
from tests.mixer_cases import MIXER_CASES

TOL = 1e-9
VOCAB = 48
CASES = MIXER_CASES


def build(case: str) -> torch.nn.Module:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, expand_v=2.0,
                hidden_ratio=2, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    config = LinMemConfig(**{**base, **CASES[case]})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the 0.02 init, so memories and their edits matter
        for name, p in model.named_parameters():
            if name.endswith(("a_proj.weight", "b_proj.weight", "c_proj.weight")):
                p.normal_(0, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                p.normal_(0, 0.3)
    return model.to(torch.float64).eval()


def pair(batch: int = 2, length: int = 14, at: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Recipient and donor that differ (somewhere) before ``at`` and agree from ``at`` on."""
    recipient = torch.randint(1, VOCAB, (batch, length))
    donor = recipient.clone()
    donor[:, :at] = torch.randint(1, VOCAB, (batch, at))
    return recipient, donor


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def close(a, b, tol=TOL) -> bool:
    return (a - b).abs().max().item() < tol


@pytest.fixture(params=list(CASES))
def case(request) -> str:
    return request.param


def test_components_and_layers(case):
    model = build(case)
    comps = mm.heads(model)
    residual = case.startswith("r")
    recurrent = [i for i in mm.layers(model) if i not in model.config.attention.layers]
    assert len(comps) == len(recurrent) * 2 * (2 if residual else 1)
    assert {c.layer for c in comps} == set(recurrent)
    assert mm.Component.parse("L1H0R") == mm.Component(1, 0, "R") == mm.Component.parse((1, 0, "R"))
    edit = mm.StateSwap([(0, 1)], at=3)
    assert edit == mm.StateSwap([mm.Component(0, 1, "S")], at=3) != mm.StateSwap([(0, 1)], at=3, control="random")
    assert repr(edit) == ("StateSwap(components=(Component(layer=0, head=1, memory='S'),), at=3, control='donor', "
                          "seed=0)")
    with pytest.raises(ValueError, match="at must be"):
        mm.StateSwap([(0, 1)], at=0)


def test_no_edit_equals_model(case):
    model = build(case)
    recipient, _ = pair()
    assert close(mm.run(model, recipient), logits(model, recipient))


def test_swap_every_state_and_conv_gives_donor(case):
    model = build(case)
    recipient, donor = pair(at=8)
    edits = [mm.StateSwap(mm.heads(model), at=8), mm.CacheSwap(mm.layers(model), at=8, kinds=("conv", "kv"))]
    out = mm.run(model, recipient, donor, edits)
    assert close(out[:, 8:], logits(model, donor)[:, 8:])
    assert close(out[:, :8], logits(model, recipient)[:, :8])
    partial = mm.run(model, recipient, donor, edits[:1])  # without the conv / KV caches the donor is not reached
    assert not close(partial[:, 8:], logits(model, donor)[:, 8:], 1e-6)


def test_patch_every_readout_gives_donor(case):
    model = build(case)
    recipient, donor = pair(at=8)
    edits = [mm.OutputPatch(mm.heads(model), positions=range(8, 14))]
    if model.config.attention.layers:  # the attention layers read the prefix from their KV cache
        edits.append(mm.CacheSwap(model.config.attention.layers, at=8, kinds="kv"))
    out = mm.run(model, recipient, donor, edits)
    assert close(out[:, 8:], logits(model, donor)[:, 8:])


@pytest.mark.slow
def test_swap_all_then_restore_all_gives_recipient(case):
    model = build(case)
    recipient, donor = pair(at=8)
    edits = [mm.StateSwap(mm.heads(model), at=8), mm.CacheSwap(mm.layers(model), at=8, kinds="conv"),
             mm.OutputRestore(mm.heads(model), positions=range(8, 14))]
    out = mm.run(model, recipient, donor, edits)
    assert close(out, logits(model, recipient))
    swapped = mm.run(model, recipient, donor, edits[:2])
    assert not close(swapped[:, 8:], logits(model, recipient)[:, 8:], 1e-6)


@pytest.mark.parametrize("case_name", ["sgla", "gla", "gdn", "rla", "rdn"])
def test_write_block_before_at_forgets_prefix(case_name):
    """With every write before ``at + W − 1`` blocked (W the conv width: the tokens whose conv window still reaches
    the prefix), the logits from there on do not depend on the tokens before ``at``."""
    model = build(case_name)
    width = mm.conv_width(model)
    recipient, donor = pair(at=5, length=16)
    block = [mm.WriteBlock(mm.heads(model), span=(0, 5 + width - 1))]
    a, b = mm.run(model, recipient, edits=block), mm.run(model, donor, edits=block)
    assert close(a[:, 5 + width - 1:], b[:, 5 + width - 1:])
    assert not close(logits(model, recipient)[:, 5 + width - 1:], logits(model, donor)[:, 5 + width - 1:], 1e-6)


@pytest.mark.parametrize("case_name", ["rla", "rdn", "rdn_hybrid"])
def test_swap_r_and_s_separately(case_name):
    """Swapping only R or only S of a layer changes the logits; both together equal the swap of that layer's
    whole recurrent cache."""
    model = build(case_name)
    recipient, donor = pair(at=8)
    layer = mm.recurrent_layers(model)[0]
    comps = {m: [c for c in mm.heads(model) if c.layer == layer and c.memory == m] for m in "SR"}
    clean = logits(model, recipient)
    only_s = mm.run(model, recipient, donor, [mm.StateSwap(comps["S"], at=8)])
    only_r = mm.run(model, recipient, donor, [mm.StateSwap(comps["R"], at=8)])
    both = mm.run(model, recipient, donor, [mm.StateSwap(comps["S"] + comps["R"], at=8)])
    whole = mm.run(model, recipient, donor, [mm.CacheSwap([layer], at=8, kinds="recurrent")])
    assert not close(only_s, clean, 1e-6) and not close(only_r, clean, 1e-6)
    assert not close(only_s, only_r, 1e-6)
    assert close(both, whole)


@pytest.mark.slow
def test_contributions_sum_to_state(case):
    model = build(case)
    ids = torch.randint(1, VOCAB, (12,))
    for c in mm.heads(model):
        parts = mm.contributions(model, ids, c.layer, c.head, t=9, memory=c.memory)
        assert parts.shape == (10, 16, 8)
        s = mm.state(model, ids, c.layer, c.head, t=9, memory=c.memory)
        assert (parts.sum(0) - s).abs().max().item() < TOL
        assert parts[-1].abs().max() > 0 and parts[0].abs().max() > 0


@pytest.mark.slow
def test_run_changes_no_weights_or_inputs(case):
    model = build(case)
    recipient, donor = pair(at=8)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    r0, d0 = recipient.clone(), donor.clone()
    comps = mm.heads(model)[:2]
    edits = [mm.StateSwap(comps, at=8, control="random"), mm.DonorWrite(comps, span=(2, 4)),
             mm.OutputPatch(comps[:1], positions=[9, 10]), mm.OutputRestore(comps[1:], positions=[11])]
    mm.run(model, recipient, donor, edits)
    assert torch.equal(recipient, r0) and torch.equal(donor, d0)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_logits_at_keeps_the_callers_order_and_counts_negatives_from_the_end():
    model = build("gdn")
    recipient, donor = pair(length=14, at=8)
    edits = [mm.StateSwap(mm.heads(model)[:1], at=8)]
    full = mm.run(model, recipient, donor, edits)
    picked = mm.run_many(model, recipient, donor, [edits], logits_at=[-1, 2, 12, 7])[0]
    assert close(picked, full[:, [13, 2, 12, 7]])
    with pytest.raises(ValueError, match="logits_at"):
        mm.run_many(model, recipient, donor, [edits], logits_at=[14])


def test_bad_edits_raise_clear_errors():
    model = build("gdn")
    recipient, _ = pair()
    with pytest.raises(ValueError, match="integer token index"):
        mm.CacheSwap([0], ("kv",), 5)  # kinds where `at` goes
    with pytest.raises(ValueError, match="toward must be"):
        mm.KeyAlign([(0, 0)], span=(2, 5), toward=-1)
    with pytest.raises(ValueError, match="no residual memory R"):
        mm.run(model, recipient, edits=[mm.WriteBlock([(0, 0, "R")], span=(1, 3))])
    with pytest.raises(ValueError, match="outside the prompt"):
        mm.run(model, recipient, edits=[mm.OutputPatch([(0, 0)], positions=[14])])
    with pytest.raises(ValueError, match="pass donor_ids"):
        mm.run(model, recipient, edits=[mm.StateSwap([(0, 0)], at=4)])


def test_random_donor_write_matches_the_donor_write_change_in_norm():
    """The random donor write moves each token's write matrix ``s v kᵀ`` by the Frobenius norm of the donor's
    change ``s_d v_d k_dᵀ − s v kᵀ``."""
    from linmem.memory.edits import write_noise

    g = torch.Generator().manual_seed(0)
    s, s_d = torch.rand(5, generator=g, dtype=torch.float64), torch.rand(5, generator=g, dtype=torch.float64)
    v, v_d = (torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(2))
    k, k_d = (torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    delta = write_noise(s_d, v_d, k_d, s, v, k, seed=(1,))
    outer = lambda a, b, c: a[:, None, None] * b[:, :, None] * c[:, None, :]  # noqa: E731
    moved = (outer(s, v + delta, k) - outer(s, v, k)).flatten(1).norm(dim=1)
    wanted = (outer(s_d, v_d, k_d) - outer(s, v, k)).flatten(1).norm(dim=1)
    assert torch.allclose(moved, wanted, rtol=1e-12)


@pytest.mark.parametrize("case_name", ["gdn", "rdn"])
def test_key_align_acts_from_its_span_on(case_name):
    model = build(case_name)
    recipient, _ = pair()
    comps = mm.heads(model)
    clean = logits(model, recipient)
    for mode in ("align", "orthogonal"):
        out = mm.run(model, recipient, edits=[mm.KeyAlign(comps, span=(6, 10), toward=3, mode=mode)])
        assert close(out[:, :6], clean[:, :6])
        assert not close(out[:, 6:], clean[:, 6:], 1e-6)
    with pytest.raises(ValueError, match="outside span"):
        mm.KeyAlign(comps, span=(2, 5), toward=3)


def test_random_controls_match_the_donor_change_in_norm():
    """The equal-norm random state swap moves the state by exactly ‖donor − recipient‖ (per prompt)."""
    model = build("rdn")
    recipient, donor = pair(at=8)
    c = mm.Component(1, 0, "R")
    from linmem.memory.experiments import states_at
    from linmem.memory.intervene import apply_cache_edit
    from linmem.memory.recording import backbone
    from linmem.models import LinMemCache

    caches = []
    for ids in (recipient, donor):
        cache = LinMemCache.from_config(model.config)
        with torch.no_grad():
            backbone(model)(input_ids=ids[:, :8], cache=cache, use_cache=True)
        caches.append(cache)
    before = caches[0].layers[1].residual_state[:, 0].clone()
    apply_cache_edit(model, caches[0], caches[1], mm.StateSwap([c], 8, control="random", seed=3), slice(None))
    moved = (caches[0].layers[1].residual_state[:, 0] - before).flatten(1).norm(dim=1)
    wanted = (states_at(model, donor, 8, c) - states_at(model, recipient, 8, c)).flatten(1).norm(dim=1)
    assert torch.allclose(moved, wanted, rtol=1e-9) and wanted.min() > 0
    swapped = mm.run(model, recipient, donor, [mm.StateSwap([c], 8, control="random", seed=3)])
    assert not close(swapped, mm.run(model, recipient, donor, [mm.StateSwap([c], 8)]), 1e-6)
