"""flash-linear-attention checkpoint import: small random FLA 0.6.0 GLA and Gated DeltaNet models (both hybrids with
softmax-attention layers, non-default settings) are saved as safetensors, imported with linmem, and their logits
compared with FLA's own forward pass run on the CPU.

FLA's forward calls Triton kernels, which cannot run on a CPU. ``fla_on_cpu`` swaps each of them, at the name FLA's
code looks it up, for a pure-PyTorch stand-in, so FLA's layer wiring (projections, gates, normalisers, GQA repeats,
convolution placement, residual adds, RoPE tables) runs as FLA wrote it:

==========================================================  =========================================================
FLA kernel (where it is looked up)                          stand-in
==========================================================  =========================================================
``chunk_gla``, ``fused_recurrent_gla``, ``fused_chunk_gla``  FLA's reference ``fla.ops.gla.naive.naive_recurrent_gla``
(``fla.layers.gla``)                                        (states moved between FLA's V-first and K-first layouts)
``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_   FLA's ``naive_recurrent_gated_delta_rule``, after what the
rule`` (``fla.layers.gated_deltanet``)                      kernel does inside: L2 norm of q, k (eps 1e-6 in the
                                                            root), β = sigmoid (×2 with ``allow_neg_eigval``) and the
                                                            gate from FLA's ``naive_gdn_gate`` (−e^A_log·softplus)
``RMSNorm.forward`` (``fla.modules``; with residual/prenorm) FLA's ``rms_norm_ref`` (in the input dtype)
``FusedRMSNormGated.forward``                               ``x / rms(x) · w · act(g)`` (act: swish or sigmoid)
``ShortConvolution.forward``, ``causal_conv1d`` (the fused  ``F.conv1d`` over ``W − 1`` zeros of left padding, then
q/k/v conv of ``fla.layers.gated_deltanet``)                SiLU if the module has it
``SwiGLULinear.forward``, ``swiglu`` (``fla.modules.mlp``)  ``down(silu(gate) · up)``
``ACT2FN["swish"]`` (GLA's un-fused output gate)            ``F.silu``
``rotary_embedding`` (``fla.modules.rotary.ops``)           FLA's ``rotary_embedding_ref`` on the cached cos/sin rows
                                                            from the position offset on
``flash_attn_func`` (``fla.layers.attn``; flash-attn is     SDPA with flash-attn's contract: ``[B, T, H, d]``, GQA,
not installed)                                              causal aligned bottom-right, ``window_size=(left, right)``
==========================================================  =========================================================
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import linmem  # noqa: F401  (registers the Auto classes)
from linmem.models import LinMemForCausalLM, convert_fla_checkpoint, fla_config_to_linmem, load_fla_checkpoint
from linmem.models.modeling import CACHE_FIELD

fla = pytest.importorskip("fla", exc_type=ImportError)

import fla.layers.attn as fla_attn  # noqa: E402
import fla.layers.gated_deltanet as fla_gdn  # noqa: E402
import fla.layers.gla as fla_gla  # noqa: E402
import fla.modules.mlp as fla_mlp  # noqa: E402
import fla.modules.rotary.ops as fla_rotary  # noqa: E402
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM  # noqa: E402
from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution  # noqa: E402
from fla.modules.activations import ACT2FN  # noqa: E402
from fla.modules.norm.layernorm import rms_norm_ref  # noqa: E402
from fla.ops.gated_delta_rule.gate import naive_gdn_gate  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gla.naive import naive_recurrent_gla  # noqa: E402

VOCAB = 97


# ---------------------------------------------------------------------------------------------------------------
# Pure-PyTorch stand-ins for FLA's kernels (see the module docstring)
# ---------------------------------------------------------------------------------------------------------------

def _to_k_first(state: torch.Tensor | None, v_first: bool) -> torch.Tensor | None:
    """FLA's layers keep states ``[N, H, V, K]`` (``state_v_first=True``); its naive references ``[N, H, K, V]``."""
    return state.transpose(-1, -2) if state is not None and v_first else state


def gla_kernel(q, k, v, g=None, gk=None, initial_state=None, output_final_state=False, state_v_first=False,
               cu_seqlens=None, **unused):
    """Stands in for ``chunk_gla(q, k, v, g=...)``, ``fused_recurrent_gla(q, k, v, gk=...)`` and ``fused_chunk_gla``:
    ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, per-channel log decay ``[B, T, H, K]`` → FLA's naive recurrence."""
    assert cu_seqlens is None
    o, state = naive_recurrent_gla(q, k, v, gk if gk is not None else g, _to_k_first(initial_state, state_v_first),
                                   output_final_state)
    return o, _to_k_first(state, state_v_first)


def gated_delta_kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                       state_v_first=False, cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                       **unused):
    """Stands in for ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``: the kernel's own input
    transforms (L2 norm, sigmoid β, gate from raw ``a_proj`` output), then FLA's naive gated delta rule. Returns
    ``o`` in q's dtype, as the kernels do."""
    assert cu_seqlens is None
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    o, state = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale, _to_k_first(initial_state, state_v_first),
                                                output_final_state)
    return o.to(q.dtype), _to_k_first(state, state_v_first)


def rms_norm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    """``fla.modules.RMSNorm.forward``: FLA's ``rms_norm_ref`` in the input dtype (the residual add and
    ``prenorm=True``, which also returns ``x + residual``, as the fused kernel does)."""
    return rms_norm_ref(x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm, upcast=False)


def gated_rms_norm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """``fla.modules.FusedRMSNormGated.forward`` without residual: ``x / sqrt(mean(x²) + eps) · w · act(g)``."""
    assert residual is None and not prenorm
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    if self.weight is not None:
        y = y * self.weight
    return (y * (g.sigmoid() if self.activation == "sigmoid" else F.silu(g))).to(x.dtype)


def causal_conv(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                activation=None, cu_seqlens=None, **unused):
    """``causal_conv1d``: depthwise causal conv of ``x [B, T, D]`` with ``weight [D, W]`` (zeros before the start),
    then SiLU if asked. Returns ``(y [B, T, D], None)``."""
    assert residual is None and initial_state is None and not output_final_state and cu_seqlens is None
    width = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight.unsqueeze(1), bias, groups=x.shape[-1])
    y = y.transpose(1, 2)
    return (F.silu(y) if activation in ("silu", "swish") else y), None


def short_conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None,
                       **unused):
    """``fla.modules.ShortConvolution.forward`` (full sequences only: no cache, no mask)."""
    assert mask is None and cache is None
    return causal_conv(x, self.weight.squeeze(1), self.bias, residual, None, output_final_state, self.activation,
                       cu_seqlens)


def swiglu_linear_forward(self, x, y, weight, bias):
    """``fla.modules.mlp.SwiGLULinear.forward``: ``linear(silu(x) · y)``."""
    return F.linear(F.silu(x) * y, weight, bias)


def rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
    """``rotary_embedding``: FLA's ``rotary_embedding_ref`` on the cos/sin rows ``[offset, offset + T)``."""
    assert isinstance(seqlen_offsets, int) and cu_seqlens is None
    rows = slice(seqlen_offsets, seqlen_offsets + x.shape[1])
    return fla_rotary.rotary_embedding_ref(x, cos[rows], sin[rows], interleaved)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **unused):
    """flash-attn's ``flash_attn_func`` on SDPA: ``q [B, T, H, d]``, ``k, v [B, S, H_kv, d]`` → ``[B, T, H, d]``.

    Query i (of T, aligned to the last of S keys) sees key j iff ``j <= i + S − T`` when causal, and
    ``i + S − T − left <= j <= i + S − T + right`` for a window (−1: unbounded)."""
    assert dropout_p == 0.0
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    length, keys = q.shape[1], k.shape[1]
    offset = torch.arange(keys, device=q.device)[None, :] - torch.arange(length, device=q.device)[:, None] \
        - (keys - length)  # j − (i + S − T)
    allowed = torch.ones(length, keys, dtype=torch.bool, device=q.device)
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
                                       scale=softmax_scale)
    return o.transpose(1, 2)


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """Install the stand-ins for this test (build FLA models inside it: layers read some at construction)."""
    for name in ("chunk_gla", "fused_recurrent_gla", "fused_chunk_gla"):
        monkeypatch.setattr(fla_gla, name, gla_kernel)
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        monkeypatch.setattr(fla_gdn, name, gated_delta_kernel)
    monkeypatch.setattr(fla_gdn, "causal_conv1d", causal_conv)
    monkeypatch.setattr(RMSNorm, "forward", rms_norm_forward)
    monkeypatch.setattr(FusedRMSNormGated, "forward", gated_rms_norm_forward)
    monkeypatch.setattr(ShortConvolution, "forward", short_conv_forward)
    monkeypatch.setattr(fla_mlp.SwiGLULinear, "forward", swiglu_linear_forward)
    monkeypatch.setattr(fla_mlp, "swiglu", lambda x, y: F.silu(x) * y)
    monkeypatch.setitem(ACT2FN, "swish", F.silu)
    monkeypatch.setattr(fla_rotary, "rotary_embedding", rotary)
    monkeypatch.setattr(fla_attn, "flash_attn_func", flash_attn_func, raising=False)


# ---------------------------------------------------------------------------------------------------------------
# Small random FLA checkpoints
# ---------------------------------------------------------------------------------------------------------------

GLA_HYBRID = dict(  # GQA in the memory and the attention, convs, a clamped gate, un-fused norms, windowed attention
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_heads=4, num_kv_heads=2, expand_k=0.75,
    expand_v=1.5, use_short_conv=True, conv_size=3, clamp_min=-0.1, norm_eps=1e-5, intermediate_size=96,
    fuse_norm=False, fuse_swiglu=False, attn=dict(layers=[1], num_heads=4, num_kv_heads=2, qkv_bias=True,
                                                  window_size=5, rope_theta=500.0),
)
GLA_PLAIN = dict(  # FLA's defaults, except a norm without weights and tied embeddings
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, elementwise_affine=False,
    tie_word_embeddings=True,
)
GDN_HYBRID = dict(  # value width 1.5 K, conv width 3, tied embeddings, full causal attention in the last layer
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=16, expand_v=1.5, conv_size=3,
    norm_eps=1e-5, hidden_ratio=3, tie_word_embeddings=True, attn=dict(layers=[2], num_heads=2),
)


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights of order-one activations (unlike the 0.02 init) so every path shows in the logits: projections
    N(0, 1/fan_in), norm weights 1 ± 0.3, biases N(0, 0.5), gate-projection biases N(0, 2), decays α spread over
    (0, 1) through ``A_log`` and ``dt_bias``."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(math.log(0.5), math.log(8.0), generator=gen))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) - 1.0)
        elif "norm" in name:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("gk_proj.1.bias"):
            p.copy_(2.0 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)


def save_fla(kind: str, settings: dict, path, seed: int, **save_kwargs):
    """Build, randomise and save an FLA model (float32 safetensors); returns it in eval mode."""
    config, model_class = (GLAConfig, GLAForCausalLM) if kind == "gla" else (GatedDeltaNetConfig,
                                                                            GatedDeltaNetForCausalLM)
    torch.manual_seed(seed)
    model = model_class(config(**settings))
    randomise(model, seed)
    model.save_pretrained(path, **save_kwargs)
    return model.eval()


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------------------------
# Parity with FLA
# ---------------------------------------------------------------------------------------------------------------

CHECKPOINTS = {
    "gla_hybrid": ("gla", GLA_HYBRID, {}),
    "gla_plain": ("gla", GLA_PLAIN, {}),
    "gdn_hybrid": ("gated_deltanet", GDN_HYBRID, dict(max_shard_size="40KB")),  # sharded: the index path
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@torch.no_grad()
def test_imported_logits_equal_fla(name, tmp_path, fla_on_cpu):
    kind, settings, save_kwargs = CHECKPOINTS[name]
    fla_model = save_fla(kind, settings, tmp_path, seed=len(name), **save_kwargs)
    ids = tokens(2, 70)  # past FLA's 64-token switch between its recurrent and chunked GLA paths
    for dtype, tol in ((torch.float64, 1e-5), (torch.float32, 1e-4)):
        # FLA's naive references run their recurrences in float32 even for a float64 model: hence 1e-5 there
        expected = fla_model.to(dtype)(ids, use_cache=False).logits
        for backend in ("chunk", "reference"):
            model = load_fla_checkpoint(tmp_path, dtype=dtype, backend=backend)
            actual = model(ids, use_cache=False).logits
            assert actual.dtype == dtype
            assert relative_error(actual, expected) < tol, (name, dtype, backend, relative_error(actual, expected))


@torch.no_grad()
def test_prefill_then_decode_equals_forward(tmp_path, fla_on_cpu):
    save_fla("gla", GLA_HYBRID, tmp_path / "gla", seed=1)
    save_fla("gated_deltanet", GDN_HYBRID, tmp_path / "gdn", seed=2)
    ids = tokens(2, 24, seed=3)
    for path in (tmp_path / "gla", tmp_path / "gdn"):
        model = load_fla_checkpoint(path, dtype=torch.float64)
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :15], use_cache=True)
        cache, steps = getattr(out, CACHE_FIELD), []
        for t in range(15, ids.shape[1]):
            step = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(step.logits)
        decoded = torch.cat([out.logits, *steps], dim=1)
        assert (decoded - full).abs().max().item() < 1e-10


@torch.no_grad()
def test_converted_directory_loads_through_auto_classes(tmp_path, fla_on_cpu):
    from transformers import AutoModelForCausalLM

    fla_model = save_fla("gated_deltanet", GDN_HYBRID, tmp_path / "fla", seed=4)
    (tmp_path / "fla" / "tokenizer_config.json").write_text("{}")
    out = convert_fla_checkpoint(tmp_path / "fla", tmp_path / "linmem")
    assert json.loads((out / "config.json").read_text())["model_type"] == "linmem"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, LinMemForCausalLM)
    ids = tokens(1, 20)
    assert relative_error(model(ids).logits, fla_model(ids, use_cache=False).logits) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# The config mapping and what is refused
# ---------------------------------------------------------------------------------------------------------------

def test_config_mapping():
    config = fla_config_to_linmem({**GLAConfig(**GLA_HYBRID).to_dict()})
    assert (config.mixer, config.num_heads, config.head_dim, config.expand_v) == ("gla", 4, 12, 2.0)
    assert (config.num_kv_heads, config.clamp_min, config.conv_size, config.conv_bias) == (2, -0.1, 3, False)
    assert (config.intermediate_size, config.norm_eps, config.tie_word_embeddings) == (96, 1e-5, False)
    assert config.attention.layers == [1]
    assert (config.attention.num_heads, config.attention.num_kv_heads, config.attention.qkv_bias) == (4, 2, True)
    assert (config.attention.window_size, config.attention.rope_theta, config.attention.qk_norm) == (5, 500.0, False)
    config = fla_config_to_linmem(GatedDeltaNetConfig(**GDN_HYBRID).to_dict())
    assert (config.mixer, config.head_dim, config.expand_v, config.use_short_conv) == ("gdn", 16, 1.5, True)
    assert (config.hidden_ratio, config.tie_word_embeddings, config.attention.layers) == (3, True, [2])
    # fields missing from config.json take FLA 0.6.0's defaults
    config = fla_config_to_linmem({"model_type": "gated_deltanet"})
    assert (config.hidden_size, config.num_heads, config.head_dim, config.num_hidden_layers) == (2048, 6, 256, 21)


@pytest.mark.parametrize("kind, field, value", [
    ("gated_deltanet", "use_gate", False),
    ("gated_deltanet", "allow_neg_eigval", True),
    ("gated_deltanet", "num_v_heads", 4),
    ("gated_deltanet", "output_gate_activation", "sigmoid"),
    ("gla", "feature_map", "relu"),
    ("gla", "use_output_gate", False),
    ("gla", "use_gv", True),
    ("gla", "gate_logit_normalizer", 8),
    ("gla", "conv_bias", True),
    ("gla", "hidden_act", "powlu"),
    ("gla", "attnres_block_size", 2),
    ("gla", "expand_k", 0.3),
    ("gla", "some_new_switch", 1),
])
def test_settings_linmem_cannot_reproduce_are_refused(kind, field, value):
    base = {"model_type": kind, "hidden_size": 64, "num_heads": 2}
    with pytest.raises(ValueError, match=field):
        fla_config_to_linmem({**base, field: value})


@pytest.mark.parametrize("attn, field", [
    (dict(layers=[0], num_heads=2, qk_norm=True), "qk_norm"),
    ([dict(layers=[0], num_heads=2), dict(layers=[1], num_heads=4)], "attn"),
    (dict(layers=[0], num_heads=2, sink_tokens=4), "sink_tokens"),
])
def test_attention_settings_linmem_cannot_reproduce_are_refused(attn, field):
    with pytest.raises(ValueError, match=field):
        fla_config_to_linmem({"model_type": "gla", "hidden_size": 64, "num_heads": 2, "num_hidden_layers": 2,
                              "attn": attn})


def test_attention_spec_list_of_one_shape_is_merged():
    attn = [dict(layers=[2], num_heads=2, window_size=8), dict(layers=[0], num_heads=2, window_size=8)]
    config = fla_config_to_linmem({"model_type": "gla", "hidden_size": 64, "num_heads": 2, "num_hidden_layers": 3,
                                   "attn": attn})
    assert config.attention.layers == [0, 2] and config.attention.window_size == 8


def test_unknown_fields_are_refused_unless_allowed():
    fields = {"model_type": "gated_deltanet", "hidden_size": 64, "num_heads": 2, "head_dim": 16, "new_knob": 3}
    with pytest.raises(ValueError, match="new_knob"):
        fla_config_to_linmem(fields)
    assert fla_config_to_linmem(fields, allow_unknown_fields=True).mixer == "gdn"


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gla", "hidden_size": 32, "num_heads": 2,
                                                      "num_hidden_layers": 1, "vocab_size": VOCAB}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_fla_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        fla_config_to_linmem({"model_type": "mamba2"})


def test_weights_that_do_not_match_the_config_are_refused(tmp_path, fla_on_cpu):
    save_fla("gla", GLA_PLAIN, tmp_path, seed=5)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "expand_v": 2.0}))
    with pytest.raises(ValueError, match="wrong shapes"):
        load_fla_checkpoint(tmp_path)
