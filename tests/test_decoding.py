"""``captured_generate`` / ``StaticDecoder``: the static one-token step gives ``model.generate``'s tokens (greedy,
left padding, end of sequence), samples the model's filtered distribution reproducibly, refuses what it cannot
decode; on CUDA the captured graph gives the uncaptured step's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401  (registers the Auto classes)
from linmem.models import LinMemConfig, StaticDecoder, captured_generate
from linmem.models.decoding import EOS_CHECK_EVERY, Sampling
from tests.test_no_sync import counting_host_reads

VOCAB = 48
RECURRENT_MIXERS = ["gdn", "rdn", "rla", "sgla", "gla"]


def tiny_model(mixer: str = "gdn", dtype=torch.float64, device="cpu", **overrides):
    torch.manual_seed(sum(map(ord, mixer)))
    settings = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, expand_v=2.0,
                    hidden_ratio=2, mixer=mixer, pad_token_id=None, eos_token_id=None, bos_token_id=None)
    config = LinMemConfig(**{**settings, **overrides})
    return AutoModelForCausalLM.from_config(config).to(dtype=dtype, device=device).eval()


def prompt(batch: int, length: int = 7, padded: bool = False, device="cpu"):
    """Random ids ``[B, T]`` and a left-padded mask (row r padded by ``(r + 2) % 3`` tokens) or None."""
    ids = torch.randint(0, VOCAB, (batch, length), device=device)
    if not padded:
        return ids, None
    pads = torch.tensor([(r + 2) % 3 for r in range(batch)], device=device)[:, None]
    mask = (torch.arange(length, device=device) >= pads).long()
    return ids, mask


@pytest.mark.parametrize("mixer", RECURRENT_MIXERS)
@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_greedy_equals_generate(mixer, batch, padded):
    model = tiny_model(mixer)
    ids, mask = prompt(batch, padded=padded)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                              max_new_tokens=10, do_sample=False)
    got = captured_generate(model, ids, 10, attention_mask=mask)
    assert got.shape == (batch, ids.shape[1] + 10)
    assert torch.equal(got, expected)


@torch.no_grad()
def test_decoder_reused_across_prompts():
    """A second prompt through the same decoder starts from its own prefill, not from the first call's states."""
    model = tiny_model("rdn")
    decoder = StaticDecoder(model, batch_size=2)
    first, second = prompt(2, 5)[0], prompt(2, 9, padded=True)
    decoder.generate(first, 6)
    got = decoder.generate(second[0], 6, attention_mask=second[1])
    assert torch.equal(got, model.generate(second[0], attention_mask=second[1], max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("mixer", ["gdn", "rdn", "gla"])
@pytest.mark.parametrize("do_sample", [False, True])
@torch.no_grad()
def test_step_reads_nothing_back_to_the_host(mixer, do_sample):
    """What a CUDA graph captures must not synchronise: the static step (forward, state write-back, choice of the
    token, end-of-sequence marks) reads no tensor value back to the host (counted on the CPU)."""
    model = tiny_model(mixer)
    sampling = Sampling(do_sample, 0.7, 5, 0.9)
    generator = torch.Generator().manual_seed(0)
    decoder = StaticDecoder(model, 2, sampling, generator=generator, eos_token_id=[3, 4], pad_token_id=0)
    decoder.generate(prompt(2)[0], 2)
    with counting_host_reads() as (counts, where):
        decoder._step(generator)
    assert not counts, "".join(where)


@pytest.mark.parametrize("mixer", ["gdn", "rla"])
@torch.no_grad()
def test_eos_ends_rows_like_generate(mixer):
    """Rows that ended continue with the pad id and the output stops where the last row ended; the loop looks at
    the end only every EOS_CHECK_EVERY tokens, so a long budget runs at most that many steps past the end."""
    model = tiny_model(mixer)
    ids, mask = prompt(3, padded=True)
    free = captured_generate(model, ids, 12, attention_mask=mask, eos_token_id=[])
    eos = [int(free[0, ids.shape[1] + 2]), int(free[1, ids.shape[1] + 5]), int(free[2, ids.shape[1] + 1])]
    pad = next(t for t in range(VOCAB) if t not in eos)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=200, do_sample=False, eos_token_id=eos,
                              pad_token_id=pad)
    decoder = StaticDecoder(model, 3, eos_token_id=eos, pad_token_id=pad)
    got = decoder.generate(ids, 200, attention_mask=mask)
    assert got.shape[1] <= ids.shape[1] + 6 and torch.equal(got, expected)
    assert decoder.steps_run == EOS_CHECK_EVERY - 1
    ended_at = [int(torch.isin(row[ids.shape[1]:], torch.tensor(eos)).long().argmax()) for row in got]
    for row, end in zip(got[:, ids.shape[1]:], ended_at):
        assert (row[end + 1:] == pad).all()


@torch.no_grad()
def test_eos_defaults_to_generation_config():
    model = tiny_model("gdn")
    ids, _ = prompt(1)
    free = captured_generate(model, ids, 8)[0, ids.shape[1]:]
    end = next(i for i in range(1, 8) if free[i] not in free[:i])  # the first new token unseen before it
    model.generation_config.eos_token_id = int(free[end])
    got = captured_generate(model, ids, 8)
    assert torch.equal(got[0, ids.shape[1]:], free[:end + 1])
    assert torch.equal(got, model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                           do_sample=False))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool ``[..., vocab]``: the smallest set of most likely tokens whose probability reaches ``top_p``."""
    ordered, order = probs.sort(-1, descending=True)
    keep_sorted = torch.cat([torch.ones_like(ordered[..., :1], dtype=torch.bool),
                             ordered.cumsum(-1)[..., :-1] < top_p], -1)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.6), (8, 0.7)])
@torch.no_grad()
def test_sampling_is_reproducible_and_possible(top_k, top_p):
    """The same generator seed gives the same tokens, another seed others; every sampled token lies inside the
    top-k and the top-p nucleus of the model's distribution at its position (so has nonzero probability)."""
    model = tiny_model("rdn")
    ids, mask = prompt(3, padded=True)
    new = 16

    def sample(seed: int):
        return captured_generate(model, ids, new, attention_mask=mask, do_sample=True, temperature=0.8,
                                 top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(seed))

    tokens = sample(1)
    assert torch.equal(tokens, sample(1)) and not torch.equal(tokens, sample(2))
    full_mask = torch.cat([mask, torch.ones(3, new, dtype=torch.long)], 1)
    logits = model(tokens, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1] / 0.8
    chosen = tokens[:, ids.shape[1]:]
    probs = logits.softmax(-1)
    assert (probs.gather(-1, chosen[..., None]) > 0).all()
    if top_k:
        assert (logits.gather(-1, chosen[..., None]) >= logits.topk(top_k, -1).values[..., -1:]).all()
    if top_p < 1:
        allowed = logits.masked_fill(logits < logits.topk(top_k or VOCAB, -1).values[..., -1:], float("-inf"))
        assert nucleus(allowed.softmax(-1), top_p).gather(-1, chosen[..., None]).all()


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 6])
@torch.no_grad()
def test_sampling_follows_the_distribution(top_k):
    """Many rows of one prompt: the first sampled token's frequencies match the model's probabilities at
    temperature 0.5 (top-k renormalised): total variation below twice what sampling noise of that many draws
    gives on average. Sampling at temperature 1, or without the top-k cut, lies 4 to 18 times that far off."""
    model = tiny_model("gdn")
    model.lm_head.weight.mul_(20)  # logits spread like a trained model's, so that temperature and top-k matter
    rows = 4000
    ids = torch.randint(0, VOCAB, (1, 6)).expand(rows, 6).contiguous()
    tokens = captured_generate(model, ids, 1, do_sample=True, temperature=0.5, top_k=top_k,
                               generator=torch.Generator().manual_seed(3))
    logits = model(ids[:1]).logits[0, -1] / 0.5
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    expected = logits.softmax(-1)
    seen = torch.bincount(tokens[:, -1], minlength=VOCAB).double() / rows
    noise = 0.5 * (2 * expected * (1 - expected) / (torch.pi * rows)).sqrt().sum()  # mean TV of `rows` draws
    assert (seen[expected == 0] == 0).all()
    assert 0.5 * (seen - expected).abs().sum() < 2 * noise


@pytest.mark.slow
@torch.no_grad()
def test_low_temperature_is_greedy():
    model = tiny_model("sgla")
    ids, mask = prompt(3, padded=True)
    greedy = captured_generate(model, ids, 10, attention_mask=mask)
    cold = captured_generate(model, ids, 10, attention_mask=mask, do_sample=True, temperature=1e-6,
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(cold, greedy)


def test_sampling_scores_filter():
    """``Sampling.scores``: top-k keeps the k largest, top-p the smallest prefix reaching p, temperature divides."""
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    assert torch.isinf(Sampling(True, 1.0, 2).scores(logits)).tolist() == [[False, True, False, True]]
    probs = logits.softmax(-1)[0]  # 0.64, 0.09, 0.24, 0.03
    kept = ~torch.isinf(Sampling(True, 1.0, 0, float(probs[0]) + 0.01).scores(logits))
    assert kept.tolist() == [[True, False, True, False]]
    assert torch.equal(Sampling(True, 0.5).scores(logits), logits * 2)


@pytest.mark.parametrize("config, match", [
    (dict(mixer="gdn", num_hidden_layers=3, attn_layers=[1], attn_num_heads=2, attn_num_kv_heads=1),
     "softmax attention.*model.generate"),
    (dict(mixer="gdn", num_experts=2, moe_intermediate_size=16), "mixture-of-experts.*model.generate"),
])
def test_refuses_what_the_static_step_cannot_decode(config, match):
    model = tiny_model(**config)
    with pytest.raises(ValueError, match=match):
        captured_generate(model, prompt(1)[0], 4)


@pytest.mark.parametrize("call, match", [
    (lambda m, ids: captured_generate(m, ids.float(), 4), "int64 tensor"),
    (lambda m, ids: captured_generate(m, ids[0], 4), r"int64 tensor \[B, T\]"),
    (lambda m, ids: captured_generate(m, ids[:, :0], 4), "T >= 1"),
    (lambda m, ids: captured_generate(m, ids, 0), "max_new_tokens"),
    (lambda m, ids: captured_generate(m, ids, 4, attention_mask=torch.ones(2, 3)), "attention_mask must be"),
    (lambda m, ids: captured_generate(m, ids, 4, attention_mask=(torch.arange(7) < 5).long().expand(2, 7)),
     "pad on the left"),
    (lambda m, ids: captured_generate(m, ids, 4, attention_mask=2 * torch.ones_like(ids)), "0 .padding. and 1"),
    (lambda m, ids: captured_generate(m, ids, 4, do_sample=True, temperature=0.0), "temperature must be > 0"),
    (lambda m, ids: captured_generate(m, ids, 4, do_sample=True, top_p=0.0), "top_p"),
    (lambda m, ids: captured_generate(m, ids, 4, do_sample=True, top_k=-1), "top_k"),
    (lambda m, ids: captured_generate(m, ids, 4, eos_token_id="2"), "eos_token_id"),
    (lambda m, ids: captured_generate(m, ids, 4, capture=True), "capture=True needs a model on CUDA"),
    (lambda m, ids: StaticDecoder(m, 3).generate(ids, 4), "B = 3"),
    (lambda m, ids: StaticDecoder(m, 0), "batch_size"),
    (lambda m, ids: captured_generate(torch.nn.Linear(2, 2), ids, 4), "LinMemForCausalLM"),
])
def test_bad_input_is_a_clear_error(call, match):
    model = tiny_model("gdn")
    with pytest.raises(ValueError, match=match):
        call(model, prompt(2)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("mixer", ["gdn", "rdn", "gla"])
@torch.no_grad()
def test_captured_equals_uncaptured_on_cuda(mixer):
    model = tiny_model(mixer, dtype=torch.float32, device="cuda")
    ids, mask = prompt(3, padded=True, device="cuda")
    uncaptured = captured_generate(model, ids, 40, attention_mask=mask, capture=False)
    decoder = StaticDecoder(model, 3, capture=True)
    assert decoder.captured
    assert torch.equal(decoder.generate(ids, 40, attention_mask=mask), uncaptured)
    assert torch.equal(decoder.generate(ids, 40, attention_mask=mask), uncaptured)  # replays from a fresh prefill

    def sample(seed: int, capture: bool):
        return captured_generate(model, ids, 40, attention_mask=mask, do_sample=True, top_k=10, top_p=0.9,
                                 generator=torch.Generator("cuda").manual_seed(seed), capture=capture)

    assert torch.equal(sample(5, True), sample(5, True)) and not torch.equal(sample(5, True), sample(6, True))
    handle = model.model.layers[0].attn.hook_k.register_forward_hook(lambda *args: None)
    try:
        with pytest.raises(ValueError, match="hooks"):
            StaticDecoder(model, 3, capture=True)
    finally:
        handle.remove()
