"""eval.scoring.greedy_generate: the static-decoder path (one captured step per token on CUDA, run uncaptured here)
gives the step-by-step loop's tokens, with the EOS cut and a stop callback, and hybrids fall back to the loop."""

import random

import pytest
import torch

from linmem.eval.loading import EvalModel
from linmem.eval.scoring import greedy_generate
from linmem.models import LinMemConfig, LinMemForCausalLM

VOCAB = 61


def eval_model(eos_id: int, **overrides) -> EvalModel:
    config = LinMemConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
                          expand_v=2.0, hidden_ratio=2, mixer="rdn", pad_token_id=0, **overrides)
    model = LinMemForCausalLM(config).double().eval()
    with torch.no_grad():  # a larger output projection: tokens that vary from step to step
        model.lm_head.weight.normal_(0, 1.0)
    return EvalModel(model, None, None, torch.device("cpu"), eos_id)


def test_static_path_equals_the_loop_with_eos_and_stop():
    em = eval_model(eos_id=VOCAB)  # an EOS id the model never emits: the whole greedy run
    context = [random.randrange(1, VOCAB) for _ in range(random.randrange(3, 9))]
    free = greedy_generate(em, context, 12, static=False)
    assert len(free) == 12
    assert greedy_generate(em, context, 12, static=True) == free
    assert greedy_generate(em, context, 0, static=True) == []
    # an EOS the run meets: both stop before its first occurrence
    eos = free[5]
    with_eos = EvalModel(em.model, None, None, em.device, eos)
    loop = greedy_generate(with_eos, context, 12, static=False)
    assert loop == free[:free.index(eos)]
    assert greedy_generate(with_eos, context, 12, static=True) == loop
    # a stop callback: the token that made it true is kept, as in the loop
    target = free[7]
    stop = lambda generated: len(generated) >= 2 and generated[-1] == target  # noqa: E731
    loop = greedy_generate(em, context, 12, stop, static=False)
    assert loop == free[:free.index(target, 1) + 1]
    assert greedy_generate(em, context, 12, stop, static=True) == loop


def test_hybrid_falls_back_to_the_loop_and_the_decoder_is_kept():
    em = eval_model(eos_id=VOCAB, attn_layers=[1])
    context = [3, 5, 7]
    # static=None on a CPU: the loop; forcing the static path on a hybrid is refused by the decoder
    assert greedy_generate(em, context, 4) == greedy_generate(em, context, 4, static=False)
    with pytest.raises(ValueError, match="softmax attention"):
        greedy_generate(em, context, 4, static=True)
    plain = eval_model(eos_id=VOCAB)
    greedy_generate(plain, context, 3, static=True)
    decoder = plain.decoders[VOCAB]
    greedy_generate(plain, [9, 2], 3, static=True)
    assert plain.decoders[VOCAB] is decoder
