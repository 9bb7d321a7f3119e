"""Hugging Face GDN hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid) imported into linmem: the same logits
as the transformers model's own forward (prefill and token-by-token decoding with its cache), the memory lab's
identities of tests/test_memory.py on the converted models, clear refusals, and ``linmem probe`` on a saved folder.

Tiny random configs are built from the transformers config classes (no downloads). On the CPU transformers would
route the GDN recurrence to FLA's Triton kernels (FLA is installed) and the experts to ``grouped_mm``; the tests
run transformers' own PyTorch paths instead (``_torch_gdn_paths``, ``experts_implementation="eager"``).

transformers computes its RMSNorms, RoPE tables, router softmax and GDN recurrence in float32 even in a float64
model, so a float64 comparison agrees to float32 rounding (measured ~3e-6), not to float64's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.olmo_hybrid import modeling_olmo_hybrid
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

import linmem.memory as mm
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.hf_import import hf_config_to_linmem, load_hf_hybrid
from tests import test_memory

ZOO_TOKENIZER = Path(__file__).resolve().parents[1] / "linmem" / "zoo" / "models" / "gdn" / "tokenizer.json"
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")
# what every family shares: 2 value heads per recurrent layer over 1 key head (grouped keys), K = 8, V = 16 (the
# shapes tests/test_memory.py's identity tests expect), attention in the middle layer
GDN = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)
COMMON = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
              pad_token_id=0, bos_token_id=None, eos_token_id=None, **GDN)
LAYERS = ["linear_attention", "full_attention", "linear_attention"]


def torch_body(decorated):
    """The PyTorch function under transformers' kernel decorator: the decorator's wrapper keeps it as
    ``__wrapped__`` (functools.wraps); with the ``kernels`` package installed that wrapper is itself held by an
    ``nn.Module`` whose ``forward`` calls it."""
    if isinstance(decorated, torch.nn.Module):
        held = [cell.cell_contents for cell in type(decorated).forward.__closure__ or ()
                if hasattr(cell.cell_contents, "__wrapped__")]
        if len(held) != 1:
            raise RuntimeError(f"cannot find the function that {type(decorated)} calls")
        decorated = held[0]
    return decorated.__wrapped__


@pytest.fixture(autouse=True)
def _torch_gdn_paths(monkeypatch):
    """Run transformers' PyTorch GDN functions (not FLA's Triton kernels, which need a GPU here)."""
    for module in (modeling_qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe, modeling_olmo_hybrid):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(module, name, torch_body(getattr(module, name)))


def hf_config(family: str, vocab_size: int = 64, layer_types=None):
    layer_types = LAYERS if layer_types is None else layer_types
    common = dict(COMMON, vocab_size=vocab_size, layer_types=layer_types, num_hidden_layers=len(layer_types))
    qwen = dict(head_dim=16, partial_rotary_factor=0.5, intermediate_size=48)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
               experts_implementation="eager")
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **qwen, **moe, mlp_only_layers=[1])
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, **qwen)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**common, head_dim=16, partial_rotary_factor=0.5, **moe)
    return transformers.OlmoHybridConfig(**common, intermediate_size=48)


def hf_model(family: str, dtype=torch.float64, seed: int = 0, **kwargs):
    """A random transformers model with weights large enough that every memory and edit matters."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.dim() >= 2:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
            else:
                p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def _scale(x: torch.Tensor) -> float:
    return x.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 2e-5), (torch.float32, 1e-4)])
def test_prefill_and_decoding_match_transformers(family, dtype, tol):
    hf = hf_model(family, dtype)
    ours = load_hf_hybrid(hf)
    assert ours.dtype == dtype and len(mm.heads(ours)) == 4 and mm.attention_layers(ours) == [1]
    ids = torch.randint(1, 64, (2, 13))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids).logits
        assert (expected - got).abs().max().item() < tol * max(1.0, _scale(expected))
        prefix = 7  # prefill 7 tokens, then decode one token at a time, each model with its own cache
        hf_out, our_out = hf(ids[:, :prefix], use_cache=True), ours(ids[:, :prefix], use_cache=True)
        hf_cache, our_cache = hf_out.cache, our_out.cache
        for t in range(prefix, ids.shape[1]):
            hf_out = hf(ids[:, t:t + 1], cache=hf_cache, use_cache=True)
            our_out = ours(ids[:, t:t + 1], cache=our_cache, use_cache=True)
            assert (hf_out.logits[:, -1] - expected[:, t]).abs().max().item() < tol * max(1.0, _scale(expected))
            assert (our_out.logits[:, -1] - expected[:, t]).abs().max().item() < tol * max(1.0, _scale(expected))
    # the recurrent state is HF's transposed ([B, H, K, V] there, [B, H, V, K] here)
    hf_state, ours_state = hf_cache.get_recurrent_state(0, state_idx=0), our_cache.layers[0].base_state
    assert (hf_state.transpose(-1, -2).to(ours_state) - ours_state).abs().max().item() < tol * _scale(ours_state)


def test_gradients_match_transformers(family):
    """The converted model is the same function of its weights: input-embedding gradients agree."""
    hf = hf_model(family, torch.float64)
    ours = load_hf_hybrid(hf)
    ids = torch.randint(1, 64, (1, 9))
    grads = []
    for model, embed in ((hf, hf.get_input_embeddings()), (ours, ours.model.embeddings)):
        x = embed(ids).detach().requires_grad_(True)
        model(inputs_embeds=x).logits.pow(2).sum().backward()
        grads.append(x.grad)
    assert (grads[0] - grads[1]).abs().max().item() < 1e-4 * max(1.0, _scale(grads[0]))


@pytest.fixture
def converted(monkeypatch, family):
    """tests/test_memory.py's ``build`` returning this family's converted float64 model."""
    model = load_hf_hybrid(hf_model(family, torch.float64))
    monkeypatch.setattr(test_memory, "build", lambda case: model)
    return model


def test_lab_components_are_the_value_heads(converted):
    heads = mm.heads(converted)
    assert heads == [mm.Component(layer, head) for layer in (0, 2) for head in (0, 1)]
    mixer = converted.model.layers[0].attn
    assert mixer.num_key_heads == 1 and mixer.num_heads == 2  # two value heads read one key head


@pytest.mark.slow
@pytest.mark.parametrize("identity", [
    "test_no_edit_equals_model",
    "test_swap_every_state_and_conv_gives_donor",
    "test_patch_every_readout_gives_donor",
    "test_swap_all_then_restore_all_gives_recipient",
    "test_contributions_sum_to_state",
    "test_run_changes_no_weights_or_inputs",
])
def test_memory_lab_identities(converted, family, identity):
    getattr(test_memory, identity)(family)


def test_write_block_forgets_prefix_without_attention(monkeypatch, family):
    """Blocking every write before ``at + W − 1`` makes the logits prefix-independent (a purely recurrent variant:
    attention layers would read the prefix from their KV cache)."""
    if family == "olmo_hybrid":  # OlmoHybridConfig needs an attention layer: keep the converted recurrent layers only
        model = without_attention(load_hf_hybrid(hf_model(family, torch.float64)))
    else:
        model = load_hf_hybrid(hf_model(family, torch.float64, layer_types=["linear_attention"] * 2))
    monkeypatch.setattr(test_memory, "build", lambda case: model)
    test_memory.test_write_block_before_at_forgets_prefix(family)


def without_attention(model):
    """The converted model with its attention layers removed (the recurrent layers keep their weights)."""
    keep = mm.recurrent_layers(model)
    fields = model.config.to_dict()
    config = LinMemConfig(**{**fields, "num_hidden_layers": len(keep),
                             "attention": {**fields["attention"], "layers": []}})
    weights = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            if int(layer) not in keep:
                continue
            name = f"model.layers.{keep.index(int(layer))}.{rest}"
        weights[name] = tensor
    smaller = LinMemForCausalLM(config).to(model.dtype)
    smaller.load_state_dict(weights)
    return smaller.eval()


def test_refusals_name_the_model_type():
    config = hf_config("qwen3_5")
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="'qwen3_5_text'.*hidden_act 'gelu'"):
        hf_config_to_linmem(config)
    config = hf_config("qwen3_next")
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="'qwen3_next'.*RoPE type 'yarn'"):
        hf_config_to_linmem(config)
    kimi = transformers.KimiLinearConfig()
    with pytest.raises(ValueError, match="'kimi_linear'.*per-key-channel decay"):
        hf_config_to_linmem(kimi)


def test_vision_language_qwen3_5_folder_loads_its_text_model(tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` folder (model_type ``qwen3_5``, text weights under
    ``model.language_model``) converts to its text model with the same logits for text input."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1)
    config = transformers.Qwen3_5Config(text_config=hf_config("qwen3_5").to_dict(), vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    ours = load_hf_hybrid(tmp_path, dtype=torch.float32)
    ids = torch.randint(1, 64, (1, 9))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        assert (ours(ids).logits - expected).abs().max().item() < 1e-4 * max(1.0, _scale(expected))


def test_saved_folder_loads_and_probes(tmp_path):
    """A ``save_pretrained`` Qwen3.5 folder (with the zoo's tokenizer) loads with its logits and ``linmem probe``
    writes its report."""
    from linmem.memory import commands

    hf = hf_model("qwen3_5", torch.float32, vocab_size=4096)
    folder = tmp_path / "qwen3_5"
    hf.save_pretrained(folder)
    shutil.copy(ZOO_TOKENIZER, folder / "tokenizer.json")
    ours = load_hf_hybrid(folder)
    ids = torch.randint(1, 4096, (1, 11))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4 * max(1.0, _scale(hf(ids).logits))
    out = tmp_path / "probe"
    parser = argparse.ArgumentParser()
    commands.register(parser)  # the arguments exactly as `linmem probe` parses them
    args = parser.parse_args([str(folder), "--out", str(out), "--device", "cpu", "--filler", "48", "--bindings", "2",
                              "--repeats", "1", "--dev-sources", "2", "--confirm-sources", "2", "--no-sweeps",
                              "--no-extras", "--only", "head_scan"])
    assert commands.main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "report.html").is_file()
    assert "head_scan" in json.dumps(results)
