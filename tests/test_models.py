"""The Hugging Face models: built through the Auto classes for every mixer and an RDN hybrid, decoding equals the
full forward (float64), generate equals an argmax loop, save/load round-trips through safetensors only, left
padding is invisible, every parameter gets a gradient, bad configs raise, FLA 0.6.0's parameter names."""

from __future__ import annotations

import pickle

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import linmem  # noqa: F401  (registers the Auto classes)
from linmem.layers import recurrent
from linmem.models import AttentionLayerCache, LinMemCache, LinMemConfig, LinMemModel, RecurrentLayerCache
from tests.mixer_cases import MIXER_CASES

TOL = 1e-10
VOCAB = 64
CASES = MIXER_CASES


def tiny_config(**overrides) -> LinMemConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, expand_v=2.0,
                hidden_ratio=2, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return LinMemConfig(**{**base, **overrides})


def build(case: str, dtype=torch.float64, **overrides):
    model = AutoModelForCausalLM.from_config(tiny_config(**CASES[case], **overrides))
    assert type(model).__name__ == "LinMemForCausalLM"
    with torch.no_grad():  # larger decay-path weights than the 0.02 init, so the memories matter
        for name, p in model.named_parameters():
            if name.endswith(("a_proj.weight", "b_proj.weight", "c_proj.weight")):
                p.normal_(0, 0.5)
    return model.to(dtype).eval()


def ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=TOL, rtol=0)


@pytest.fixture(params=list(CASES))
def case(request) -> str:
    return request.param


@torch.no_grad()
def test_decoding_token_by_token_equals_forward(case):
    model = build(case)
    x = ids(2, 9)
    full = model(x, use_cache=False).logits
    cache, steps = None, []
    for t in range(x.shape[1]):
        out = model(x[:, t: t + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    assert close(torch.cat(steps, 1), full)


@torch.no_grad()
def test_prefill_then_steps_equal_forward(case, monkeypatch):
    """Prefill runs ``linear_memory`` from the cache, each further token one ``linear_memory_step``."""
    model = build(case)
    x = ids(2, 11)
    full = model(x).logits
    steps = []
    step = recurrent.linear_memory_step
    monkeypatch.setattr(recurrent, "linear_memory_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    out = model(x[:, :6], use_cache=True)
    cache, logits = out.cache, [out.logits]
    for t in range(6, 11):
        out = model(x[:, t: t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
    assert close(torch.cat(logits, 1), full)
    assert len(steps) == 5 * (model.config.num_hidden_layers - len(model.config.attention.layers))
    check_cache_contents(model.config, cache, batch=2, seen=11)


def check_cache_contents(config: LinMemConfig, cache: LinMemCache, batch: int, seen: int) -> None:
    """The documented attributes and shapes of every layer's cache."""
    assert isinstance(cache, LinMemCache) and cache.get_seq_length() == seen
    head_v = int(config.head_dim * config.expand_v)
    for i, layer in enumerate(cache.layers):
        if i in config.attention.layers:
            assert isinstance(layer, AttentionLayerCache)
            head_dim = config.hidden_size // config.attention.num_heads
            assert layer.keys.shape == layer.values.shape == (batch, seen, config.attention.num_kv_heads, head_dim)
            continue
        assert isinstance(layer, RecurrentLayerCache) and layer.seen_tokens == seen
        assert layer.base_state.shape == (batch, config.num_heads, head_v, config.head_dim)
        assert layer.base_state.dtype == torch.float64
        assert (layer.residual_state is not None) == (config.mixer in ("rla", "rdn"))
        assert sorted(layer.conv_states) == ["k", "q", "v"]
        assert layer.conv_states["q"].shape == (batch, config.num_heads * config.head_dim, config.conv_size - 1)


@torch.no_grad()
def test_greedy_generate_equals_argmax_loop(case):
    model = build(case)
    prompt = ids(2, 5)
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    sequence = prompt
    for _ in range(6):
        next_token = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)


@torch.no_grad()
def test_save_load_round_trip(case, tmp_path, monkeypatch):
    model = build(case, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert "model.safetensors" in files and "config.json" in files
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in files)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("loading must not unpickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    without_path = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert type(loaded) is type(model) and without_path(loaded.config) == without_path(model.config)
    for (name, p), (name2, p2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == name2 and torch.equal(p, p2), name
    x = ids(2, 7)
    assert torch.equal(loaded(x).logits, model(x).logits)


@torch.no_grad()
def test_left_padding_is_invisible(case):
    """A left-padded batch gives each row's logits, and its decoding steps, as that row alone."""
    model = build(case)
    short, long = ids(1, 4), ids(1, 7)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    out = model(batch, attention_mask=mask, use_cache=True)
    assert close(out.logits[0, 3:], model(short).logits[0])
    assert close(out.logits[1], model(long).logits[0])
    step = ids(2, 1)
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    next_logits = model(step, attention_mask=mask, cache=out.cache, use_cache=True).logits
    assert close(next_logits[0], model(torch.cat([short, step[:1]], 1)).logits[0, -1:])
    assert close(next_logits[1], model(torch.cat([long, step[1:]], 1)).logits[0, -1:])


@torch.no_grad()
def test_left_padded_generate_equals_each_row_alone():
    model = build("rdn_hybrid")
    short, long = ids(1, 3), ids(1, 6)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    together = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False)
    alone = [model.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=4, do_sample=False)
             for row in (short, long)]
    assert torch.equal(together[0, 3:], alone[0][0]) and torch.equal(together[1], alone[1][0])


def record_attention_positions(model) -> list:
    """A list that each forward pass of the hybrid's attention layer (layer 1) appends its ``position_ids`` to."""
    seen = []
    model.model.layers[1].attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["position_ids"].tolist()), with_kwargs=True)
    return seen


@torch.no_grad()
def test_rope_positions_count_real_tokens():
    """RoPE is shift invariant, so parity alone cannot see positions: read them at the attention layer."""
    model = build("rdn_hybrid")
    seen = record_attention_positions(model)
    batch = ids(2, 5)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model(batch, attention_mask=mask, use_cache=True)
    model(ids(2, 1), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), cache=out.cache)
    assert seen == [[[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]], [[3], [5]]]


def test_gradients_reach_every_parameter(case):
    model = build(case, dtype=torch.float32).train()
    x = ids(2, 8)
    loss = model(x, labels=x).loss
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_tied_embeddings_and_auto_model():
    model = AutoModelForCausalLM.from_config(tiny_config(mixer="rla", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embeddings.weight
    assert isinstance(AutoModel.from_config(tiny_config(mixer="gdn")), LinMemModel)
    assert isinstance(AutoConfig.for_model("linmem", hidden_size=32, num_heads=2, head_dim=8), LinMemConfig)


def test_initialisation():
    """Normal(0, initializer_range) weights, unit norms, Mamba2 decay parameters: A ∈ (0, 16], softplus(dt_bias) in
    [1e-4, 0.1]."""
    model = AutoModelForCausalLM.from_config(tiny_config(mixer="rdn", hidden_size=64, initializer_range=0.1))
    mixer = model.model.layers[0].attn
    for weight in (mixer.q_proj.weight, mixer.q_conv1d.weight, model.model.embeddings.weight, model.lm_head.weight):
        # five standard errors of the sample mean and std of n draws (a small conv weight has few elements)
        n = weight.numel()
        assert abs(weight.std().item() - 0.1) < 5 * 0.1 / (2 * n) ** 0.5
        assert abs(weight.mean().item()) < 5 * 0.1 / n**0.5
    assert torch.equal(mixer.o_norm.weight, torch.ones_like(mixer.o_norm.weight))
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    A, dt = mixer.A_log.exp(), torch.nn.functional.softplus(mixer.dt_bias)
    assert (A > 0).all() and (A <= 16).all() and (dt >= 1e-4 - 1e-7).all() and (dt <= 0.1 + 1e-7).all()
    assert mixer.A_log.std() > 0 and mixer.dt_bias.std() > 0  # spread over heads, not one value


BAD_CONFIGS = [
    dict(mixer="mamba"),
    dict(attn_layers=[2]),
    dict(attn_layers=[-1]),
    dict(attn_layers=[0, 0]),
    dict(attn_layers=[0], attn_num_heads=3),
    dict(attn_layers=[0], attn_num_heads=4, attn_num_kv_heads=3),
    dict(head_dim=0),
    dict(hidden_size=-8),
    dict(head_dim=8, expand_v=0.3),
    dict(gamma="shared"),
    dict(residual_target="huber"),
    dict(clip=0.0),
    dict(backend="cuda"),
]


@pytest.mark.parametrize("overrides", BAD_CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_bad_config_raises(overrides):
    with pytest.raises(ValueError):
        tiny_config(**overrides)


@torch.no_grad()
def test_inspectable_cache_and_hooks_in_model():
    """The model's hooks are addressable by name, and the cache of a hook-edited run holds the edited state."""
    model = build("rdn_hybrid")
    states = {}
    layer = model.model.layers[2].attn
    layer.hook_state.register_forward_hook(lambda m, a, out: states.setdefault("S", out))
    out = model(ids(1, 5), use_cache=True)
    assert out.cache.layers[2].base_state is states["S"]
    assert "LinMemCache" in repr(out.cache)


def test_parameter_names_match_fla():
    fla_models = pytest.importorskip("fla.models")
    shapes = lambda m: {n: tuple(t.shape) for n, t in m.state_dict().items()}  # noqa: E731
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2)
    theirs = fla_models.GatedDeltaNetForCausalLM(fla_models.GatedDeltaNetConfig(head_dim=8, **kw))
    ours = AutoModelForCausalLM.from_config(tiny_config(mixer="gdn", hidden_ratio=4))
    assert shapes(ours) == shapes(theirs)
    theirs = fla_models.GLAForCausalLM(fla_models.GLAConfig(use_short_conv=True, **kw))  # expand_k 0.5, expand_v 1
    ours = AutoModelForCausalLM.from_config(tiny_config(mixer="gla", hidden_ratio=4))
    assert shapes(ours) == shapes(theirs)


# --- the chunked loss ------------------------------------------------------------------------------------------


def _loss_and_gradients(model, x, labels, weights=None, **kwargs):
    """The mean loss (or, with ``weights [B, T-1]``, the trainer's weighted sum over the total weight) and every
    parameter's gradient."""
    model.zero_grad(set_to_none=True)
    out = model(x, labels=labels, use_cache=False, **kwargs)
    if weights is None:
        loss = out.loss
    else:
        losses = out.token_losses if out.logits is None else torch.nn.functional.cross_entropy(
            out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
            reduction="none").view(weights.shape)
        loss = (losses * weights).sum() / weights.sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_loss_equals_the_whole_logits_loss(chunk, tied):
    """float64: loss and every parameter's gradient equal the unchunked ones, with ignored labels, for chunks that
    do not divide the tokens, and under the trainer's recall weighting (answers of synthetic rows count more)."""
    from linmem.train.trainer import target_weights

    model = build("rdn_hybrid", tie_word_embeddings=tied).train()
    x = ids(3, 9)
    labels = x.clone()
    labels[0, :4] = -100  # a prompt that is not predicted
    labels[2, 6] = -100
    whole = _loss_and_gradients(model, x, labels)
    chunked = _loss_and_gradients(model, x, labels, loss_chunk_tokens=chunk)
    weights = target_weights({"labels": labels, "synthetic": torch.tensor([0, 1, 0])}, 32.0).double()
    weighted_whole = _loss_and_gradients(model, x, labels, weights)
    weighted_chunked = _loss_and_gradients(model, x, labels, weights, loss_chunk_tokens=chunk)
    for (loss_a, grads_a), (loss_b, grads_b) in ((whole, chunked), (weighted_whole, weighted_chunked)):
        assert torch.isfinite(loss_a) and abs(float(loss_a - loss_b)) < TOL
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert close(grads_a[name], grads_b[name]), name
    assert not close(whole[0], weighted_whole[0])  # the weighting matters


def test_chunked_loss_keeps_no_logits_and_checks_its_argument():
    model = build("gdn")
    x = ids(2, 6)
    out = model(x, labels=x, loss_chunk_tokens=4)
    assert out.logits is None and out.token_losses.shape == (2, 5)
    logits = model(x).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none")
    assert close(out.token_losses.flatten(), expected)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        model(x, labels=x, loss_chunk_tokens=-1)


# --- packed rows (cu_seqlens) and unpadding -------------------------------------------------------------------


def _documents(lengths, generator=None):
    return [torch.randint(1, VOCAB, (1, n), generator=generator) for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("conv", [True, False])
def test_a_packed_row_equals_each_document_alone(case, conv):
    """float64: the logits and every parameter's gradient of one row of several documents (lengths straddling the
    conv width, one of a single token) equal those of the documents run one by one."""
    model = build(case, use_short_conv=conv).train()
    docs = _documents([5, 1, 3, 7])
    cu_seqlens = torch.tensor([0, 5, 6, 9, 16], dtype=torch.int32)
    weights = [torch.randn(1, d.shape[1], VOCAB, dtype=torch.float64) for d in docs]  # a random loss direction

    packed = model(torch.cat(docs, 1), cu_seqlens=cu_seqlens, use_cache=False).logits
    (packed * torch.cat(weights, 1)).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    alone = [model(d, use_cache=False).logits for d in docs]
    sum((a * w).sum() for a, w in zip(alone, weights)).backward()

    assert close(packed, torch.cat(alone, 1))
    for name, p in model.named_parameters():
        assert close(packed_grads[name], p.grad), name
    fused = model(torch.cat(docs, 1), use_cache=False).logits  # without boundaries the documents do mix
    assert not close(fused[:, 5:], torch.cat(alone[1:], 1))


@torch.no_grad()
def test_padding_is_unpadded_into_packed_rows(case):
    """A batch with padding anywhere (left, right, inside) and no cache: real positions give each row's logits
    alone, padded positions give zeros, and a row given its own positions keeps them."""
    model = build(case)
    rows = _documents([6, 3, 4])
    width = 8
    batch = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    places = [torch.arange(0, 6), torch.arange(5, 8), torch.tensor([0, 2, 3, 6])]  # right, left, holes
    for i, (row, at) in enumerate(zip(rows, places)):
        batch[i, at], mask[i, at] = row[0], 1
    out = model(batch, attention_mask=mask, use_cache=False).logits
    for i, (row, at) in enumerate(zip(rows, places)):
        assert close(out[i, at], model(row, use_cache=False).logits[0]), i
    assert (out[mask == 0] == 0).all()


def test_packed_rows_refuse_a_cache_and_a_batch():
    model = build("gdn")
    x = ids(1, 6)
    cu_seqlens = torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(x, cu_seqlens=cu_seqlens, use_cache=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids(2, 3), cu_seqlens=cu_seqlens, use_cache=False)


@torch.no_grad()
def test_rope_positions_restart_in_each_packed_sequence():
    """RoPE is shift invariant, so parity cannot see positions: read them at the attention layer."""
    model = build("rdn_hybrid")
    seen = record_attention_positions(model)
    model(ids(1, 6), cu_seqlens=torch.tensor([0, 2, 3, 6]), use_cache=False)
    model(ids(2, 4), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]]), use_cache=False)
    assert seen == [[[0, 1, 0, 0, 1, 2]], [[0, 1, 2, 0, 1, 2]]]
