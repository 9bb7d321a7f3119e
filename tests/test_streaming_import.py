"""Streaming import of checkpoint folders (``linmem.models.hf_import.load_hf_folder``, ``load_fla_checkpoint``):
sharded safetensors go one tensor at a time into a linmem model built on the meta device and allocated on the target
device, without building the transformers model.

- Peak host memory: in a fresh process, loading a ~40 MB float32 checkpoint in 12 MB shards grows the peak RSS
  (``VmHWM``, reset through ``/proc/self/clear_refs``) by the model's weights plus at most the largest shard + 25%.
- Parity: sharded folders of every HF family, with tied and untied embeddings, give transformers' logits while
  ``from_pretrained`` of any transformers model is blocked. Their checkpoints hold the names transformers converts on
  loading (per-expert MoE weights, OLMo-Hybrid's separate convs and renamed norms).
- A linmem tensor that no checkpoint holds (a buffer) is refused by name rather than left on the meta device.

The measuring process is ``tests/streaming_probe.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from linmem.models import LinMemForCausalLM, fla_config_to_linmem, fla_import, hf_import
from linmem.models import modeling as linmem_modeling
from linmem.models.hf_import import load_hf_hybrid
from linmem.models.loading import load_weights
from tests.test_hf_hybrids import FAMILIES, _torch_gdn_paths, hf_model  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parents[1]
SHARD = "12MB"  # transformers' unit: 12 * 10**6 bytes
BIG_QWEN = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, intermediate_size=1024,
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
BIG_GDN = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_heads=4, head_dim=32, expand_v=2.0,
               hidden_ratio=4, tie_word_embeddings=False)


def save_big(kind: str, folder: Path) -> None:
    """A random float32 checkpoint of ~40 MB in 12 MB shards (its transformers or FLA model)."""
    torch.manual_seed(0)
    if kind == "hf":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**BIG_QWEN))
    else:
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**BIG_GDN))
    model.save_pretrained(folder, max_shard_size=SHARD)


def save_small(kind: str, folder: Path) -> None:
    if kind == "hf":
        hf_model("qwen3_5", torch.float32).save_pretrained(folder)
    else:
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**{**BIG_GDN, "hidden_size": 32, "num_hidden_layers": 2,
                                                        "vocab_size": 64, "attn": None})).save_pretrained(folder)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("kind", ["hf", "fla"])
def test_sharded_checkpoint_streams_within_the_largest_shard(kind, tmp_path):
    if kind == "fla":
        pytest.importorskip("fla", exc_type=ImportError)
    folder, warmup = tmp_path / "big", tmp_path / "small"
    save_big(kind, folder)
    save_small(kind, warmup)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 3 and (folder / "model.safetensors.index.json").is_file()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.streaming_probe", kind, str(folder), str(warmup)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = max(shard.stat().st_size for shard in shards)
    assert measured["weights"] > 3 * largest  # the margin below is small next to the model
    beyond_weights = measured["growth"] - measured["weights"]
    assert beyond_weights <= 1.25 * largest, f"{beyond_weights / 1e6:.1f} MB beyond the weights, shard " \
                                             f"{largest / 1e6:.1f} MB"


def block_transformers_models(monkeypatch) -> None:
    """Fail any ``from_pretrained`` of a transformers model: the streaming import builds none."""
    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained was called")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_folder_gives_transformers_logits(family, tied, tmp_path, monkeypatch):
    hf = hf_model(family, torch.float32, vocab_size=96)
    if tied:
        hf.config.tie_word_embeddings = True
        hf.tie_weights()
        assert hf.lm_head.weight is hf.get_input_embeddings().weight
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 3
    block_transformers_models(monkeypatch)
    ours = load_hf_hybrid(tmp_path)
    assert ours.config.tie_word_embeddings == tied and ours.dtype == torch.float32
    assert (ours.lm_head.weight is ours.model.embeddings.weight) == tied
    ids = torch.randint(1, 96, (2, 11))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (ours(ids).logits - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())


def test_olmo_hybrid_convs_of_their_own_widths(tmp_path, monkeypatch):
    """OLMo-Hybrid's own checkpoints hold ``q_conv1d`` and ``k_conv1d`` of the key width and ``v_conv1d`` of the
    value width (transformers' ``save_pretrained`` writes three equal thirds of its joined conv instead)."""
    hf = hf_model("olmo_hybrid", torch.float32)
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    key_width = hf.config.linear_num_key_heads * hf.config.linear_key_head_dim
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.linear_attn."
        joined = torch.cat([tensors.pop(f"{prefix}{part}_conv1d.weight") for part in "qkv"])
        assert joined.shape[0] % 3 == 0 and joined.shape[0] // 3 != key_width
        for part, conv in zip("qkv", joined.split([key_width, key_width, joined.shape[0] - 2 * key_width])):
            tensors[f"{prefix}{part}_conv1d.weight"] = conv.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    block_transformers_models(monkeypatch)
    ids = torch.randint(1, 64, (1, 9))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (load_hf_hybrid(tmp_path)(ids).logits - expected).abs().max().item() < 1e-4 * expected.abs().max()


def test_a_tensor_no_checkpoint_holds_is_refused_by_name(tmp_path, monkeypatch):
    """A linmem buffer (as a RoPE table would be) is not in any checkpoint: the loader names it instead of leaving it
    on the meta device or uninitialised."""
    hf_model("qwen3_5", torch.float32).save_pretrained(tmp_path)
    init = linmem_modeling.LinMemModel.__init__

    def with_table(self, config):
        init(self, config)
        self.register_buffer("rope_table", torch.ones(4), persistent=False)
    monkeypatch.setattr(linmem_modeling.LinMemModel, "__init__", with_table)
    with pytest.raises(ValueError, match=r"does not compute.*model\.rope_table"):
        load_hf_hybrid(tmp_path)


GDN_FIELDS = dict(model_type="gated_deltanet", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2,
                  head_dim=8)


def fla_folder(folder: Path, **changes) -> LinMemForCausalLM:
    """A tiny FLA Gated DeltaNet folder written without FLA (its parameter names are linmem's): ``config.json`` with
    ``changes`` over the fields the weights were made with. Returns the model the weights come from."""
    torch.manual_seed(0)
    model = LinMemForCausalLM(fla_config_to_linmem(GDN_FIELDS)).eval()
    folder.mkdir()
    save_file(dict(model.state_dict()), folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**GDN_FIELDS, **changes}))
    return model


def refuse_allocation(monkeypatch) -> None:
    """Fail the allocation of any model's weights: what is refused must be refused before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were allocated")
    monkeypatch.setattr(fla_import, "empty_model", refuse)
    monkeypatch.setattr(hf_import, "empty_model", refuse)


def one_line_refusal(folder: Path) -> str:
    started = time.perf_counter()
    with pytest.raises(ValueError) as error:
        load_weights(folder)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and time.perf_counter() - started < 10, message
    return message


def test_an_fla_folder_loads_after_its_shapes_are_checked(tmp_path):
    source = fla_folder(tmp_path / "fla")
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(load_weights(tmp_path / "fla")[0](ids).logits, source(ids).logits)


def test_an_fla_config_of_absurd_vocabulary_is_one_line_before_allocating(tmp_path, monkeypatch):
    fla_folder(tmp_path / "fla", vocab_size=10**12)
    refuse_allocation(monkeypatch)
    message = one_line_refusal(tmp_path / "fla")
    assert message.startswith(f"{tmp_path / 'fla' / 'config.json'}: the weights do not match")
    assert "model.embeddings.weight: checkpoint [64, 32], linmem model.embeddings.weight [1000000000000, 32]" in \
        message and "nothing was allocated" in message


def test_an_fla_config_of_other_shapes_is_refused_before_allocating(tmp_path, monkeypatch):
    fla_folder(tmp_path / "fla", head_dim=16)
    refuse_allocation(monkeypatch)
    assert "model.layers.0.attn.q_proj.weight: checkpoint [16, 32]" in one_line_refusal(tmp_path / "fla")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size"])
def test_an_hf_config_of_absurd_size_is_one_line_before_allocating(field, tmp_path, monkeypatch):
    hf_model("qwen3_5", torch.float32).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, field: 10**12}))
    refuse_allocation(monkeypatch)
    block_transformers_models(monkeypatch)
    message = one_line_refusal(tmp_path)
    assert message.startswith(f"{tmp_path / 'config.json'}: the weights do not match")
    assert "model.embed_tokens.weight: checkpoint [64, 32]" in message and "nothing was allocated" in message
