"""The layers: each mixer against a naive re-derivation of its equations (explicit conv loop, the float64 oracle of
``tests/oracle.py`` for the memory, explicit norm and gate), the ablation switches, padding, hooks, attention, and
FLA 0.6.0's parameter names and shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.layers import (
    Attention,
    GatedDeltaNet,
    GatedLinearAttention,
    GatedRMSNorm,
    ResidualDeltaNet,
    ResidualLinearAttention,
    ShortConvolution,
    SimpleGatedLinearAttention,
)
from linmem.layers.gated_memory import stacked_weight
from linmem.layers.layer_cache import AttentionLayerCache, RecurrentLayerCache
from linmem.layers.mlp import swiglu_intermediate_size
from tests.oracle import oracle

F64 = torch.float64
TOL = 1e-10
D, H, K = 32, 2, 8
GATED = {"sgla": SimpleGatedLinearAttention, "gdn": GatedDeltaNet, "rla": ResidualLinearAttention,
         "rdn": ResidualDeltaNet}


def make_mixer(name: str, **kwargs) -> torch.nn.Module:
    """A float64 mixer with random weights (A_log / dt_bias as initialised, convs random)."""
    if name == "gla":
        layer = GatedLinearAttention(D, H, **kwargs)
    else:
        layer = GATED[name](D, H, K, **kwargs)
    layer = layer.double()
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, ShortConvolution):
                module.weight.normal_(0, 0.5)
    return layer


def hidden(batch: int, length: int, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(batch, length, D, dtype=F64)


# ---------------------------------------------------------------- naive re-derivations

def naive_causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y_t = silu(Σ_j w[:, j] x_{t−W+1+j})``, zeros before the start; x ``[B, T, D]``, weight ``[D, 1, W]``."""
    width = weight.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(width):
            if t - width + 1 + j >= 0:
                y[:, t] += weight[:, 0, j] * x[:, t - width + 1 + j]
    return F.silu(y)


def naive_inputs(layer, x, mask, silu_without_conv):
    outs = []
    for name in "qkv":
        y = getattr(layer, f"{name}_proj")(x)
        if mask is not None:
            y = y * mask[..., None]
        if layer.use_short_conv:
            y = naive_conv_for(layer, name, y)
        elif silu_without_conv:
            y = F.silu(y)
        outs.append(y)
    return outs


def naive_conv_for(layer, name, y):
    return naive_causal_conv(y, getattr(layer, f"{name}_conv1d").weight)


def naive_out(layer, norm, o, x):
    """Per-head RMSNorm (eps inside the root) times weight times silu(g_proj x), then o_proj."""
    batch, length = x.shape[:2]
    gate = layer.g_proj(x).view(batch, length, H, -1)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight * gate * torch.sigmoid(gate)
    return layer.o_proj(o.reshape(batch, length, -1))


def naive_gated_memory(layer, x, mask=None):
    """The sGLA / GDN / RLA / RDN layer from its docstring, memory by the oracle: output, S_T, R_T."""
    batch, length = x.shape[:2]
    q, k, v = naive_inputs(layer, x, mask, silu_without_conv=True)
    q, k = (t.view(batch, length, H, -1) for t in (q, k))
    q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    v = v.view(batch, length, H, -1)
    g = -torch.exp(layer.A_log) * F.softplus(layer.a_proj(x) + layer.dt_bias)
    beta = torch.sigmoid(layer.b_proj(x))
    gamma = beta if layer.gamma_mode == "tied" else (torch.sigmoid(layer.c_proj(x)) if layer.memory.residual else beta)
    if mask is not None:
        g, beta, gamma = g * mask[..., None], beta * mask[..., None], gamma * mask[..., None]
    zeros = torch.zeros(batch, H, v.shape[-1], K, dtype=F64)
    m = layer.memory
    o, S, R = oracle(q, k, v, g, beta, gamma, zeros, zeros, rule=m.rule, residual=m.residual,
                     target=m.residual_target, clip=m.clip, fit_history=m.fit_history, output_gates=m.output_gates)
    return naive_out(layer, layer.o_norm, o, x), S, R


def naive_gla(layer, x, mask=None):
    """FLA's GLA: no feature map, per-key gate logsigmoid(gk)/16, β = 1, scale K^-½, gated norm."""
    batch, length = x.shape[:2]
    q, k, v = naive_inputs(layer, x, mask, silu_without_conv=False)
    q, k, v = (t.view(batch, length, H, -1) for t in (q, k, v))
    g = F.logsigmoid(layer.gk_proj(x)).view(batch, length, H, -1) / 16
    beta = torch.ones(batch, length, H, dtype=F64)
    if mask is not None:
        g, beta = g * mask[..., None, None], beta * mask[..., None]
    zeros = torch.zeros(batch, H, v.shape[-1], q.shape[-1], dtype=F64)
    o, S, _ = oracle(q, k, v, g, beta, beta, zeros, zeros, rule="additive", residual=False)
    return naive_out(layer, layer.g_norm_swish_gate, o, x), S, None


# ---------------------------------------------------------------- building blocks

def test_short_convolution_continues_from_its_state():
    conv = ShortConvolution(6, 4, bias=False).double()
    x = torch.randn(2, 9, 6, dtype=F64)
    y, state = conv(x)
    assert torch.allclose(y, naive_causal_conv(x, conv.weight), atol=TOL, rtol=0)
    y1, s1 = conv(x[:, :5])
    y2, s2 = conv(x[:, 5:6], state=s1)
    y3, s3 = conv(x[:, 6:], state=s2)
    assert torch.allclose(torch.cat([y1, y2, y3], 1), y, atol=TOL, rtol=0)
    assert torch.equal(s3, x[:, -3:].transpose(1, 2)) and torch.equal(state, s3)


@pytest.mark.parametrize("width,bias", [(4, False), (3, True), (1, False)])
def test_short_convolution_compiled_as_a_sum_of_taps(width, bias):
    """Under torch.compile the convolution is a sum of shifted products (``_taps``, which fuses with the SiLU):
    the same values and gradients as ``F.conv1d`` in eager mode, from zeros and from a state."""
    conv = ShortConvolution(5, width, bias=bias).double()
    if bias:
        conv.bias.data.normal_()
    params = list(conv.parameters())
    x = torch.randn(2, 7, 5, dtype=F64, requires_grad=True)
    full = torch.randn(2, 5, width - 1 + 7, dtype=F64)
    eager = F.conv1d(full, conv.weight, conv.bias, groups=5)
    assert torch.allclose(conv._taps(full, 7), eager, atol=TOL, rtol=0)
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    for state in (None, torch.randn(2, 5, width - 1, dtype=F64)):
        outputs, weights = [], torch.randn(2, 7, 5, dtype=F64)
        for module in (conv, compiled):
            y, new_state = module(x, state=state)
            outputs.append((y, new_state, *torch.autograd.grad((y * weights).sum(), [x, *params])))
        for a, b in zip(*outputs):
            assert torch.allclose(a, b, atol=TOL, rtol=0)
    if not bias:
        assert torch.allclose(compiled(x)[0], naive_causal_conv(x, conv.weight), atol=TOL, rtol=0)


def test_gated_rmsnorm_and_swiglu_size():
    norm = GatedRMSNorm(5, eps=1e-5).double()
    norm.weight.data.uniform_(0.5, 1.5)
    x, gate = torch.randn(3, 5, dtype=F64), torch.randn(3, 5, dtype=F64)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight * F.silu(gate)
    assert torch.allclose(norm(x, gate), expected, atol=TOL, rtol=0)
    assert swiglu_intermediate_size(2048, 4) == 5632 and swiglu_intermediate_size(32, 4) == 256


# ---------------------------------------------------------------- mixers against the naive layers

@pytest.mark.parametrize("name", ["sgla", "gdn", "rla", "rdn", "gla"])
@pytest.mark.parametrize("use_short_conv", [True, False])
def test_mixer_matches_naive_layer(name, use_short_conv):
    layer = make_mixer(name, use_short_conv=use_short_conv)
    x = hidden(2, 11)
    cache = RecurrentLayerCache()
    y = layer(x, cache=cache)
    naive = naive_gla if name == "gla" else naive_gated_memory
    y_ref, S, R = naive(layer, x)
    assert torch.allclose(y, y_ref, atol=TOL, rtol=0)
    assert torch.allclose(cache.base_state, S, atol=TOL, rtol=0)
    assert (cache.residual_state is None) == (R is None)
    if R is not None:
        assert torch.allclose(cache.residual_state, R, atol=TOL, rtol=0)


@pytest.mark.parametrize("name,kwargs", [("sgla", {}), ("gdn", {}), ("rdn", {}), ("rla", {}),
                                         ("rdn", {"gamma": "tied"})])
def test_gate_gradients_match_naive_layer(name, kwargs):
    """The gates come from one product with the stacked a/b/c weights (``gate_inputs``): every gate weight, the decay
    parameters and x get the naive layer's gradients (one product per gate), in float64."""
    layer = make_mixer(name, **kwargs)
    x = hidden(2, 9).requires_grad_()
    weights = torch.randn(2, 9, D, dtype=F64)
    params = [p for n, p in layer.named_parameters() if n.split(".")[0] in ("a_proj", "b_proj", "c_proj", "A_log",
                                                                             "dt_bias")]
    assert len(params) == (5 if hasattr(layer, "c_proj") else 4)
    grads = torch.autograd.grad((layer(x) * weights).sum(), [x, *params])
    expected = torch.autograd.grad((naive_gated_memory(layer, x)[0] * weights).sum(), [x, *params])
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-9, rtol=1e-9)


def test_stacked_weight_casts_before_stacking_under_autocast():
    """Under autocast the stack holds autocast's type and the product and every weight's gradient equal those of the
    float32 weights stacked first and cast by autocast; without autocast it is the float32 stack."""
    projections = [torch.nn.Linear(D, width, bias=False) for width in (8, 8, 16)]
    x = torch.randn(3, 5, D)
    assert torch.equal(stacked_weight(projections), torch.cat([p.weight for p in projections]))
    results = []
    for stack in (stacked_weight, lambda ps: torch.cat([p.weight for p in ps])):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            weight = stack(projections)
            y = F.linear(x, weight)
        grads = torch.autograd.grad((y.float() * torch.linspace(-1, 1, 32)).sum(), [p.weight for p in projections])
        results.append((weight.dtype, y, grads))
    (dtype, y, grads), (_, y_ref, grads_ref) = results
    assert dtype == torch.bfloat16 and y.dtype == y_ref.dtype == torch.bfloat16
    assert torch.equal(y, y_ref)
    assert all(g.dtype == torch.float32 and torch.equal(g, r) for g, r in zip(grads, grads_ref))


ABLATIONS = [
    dict(gamma="tied"),
    dict(residual_target="tanh", clip=0.5),
    dict(residual_target="identity"),
    dict(clip=0.2),
    dict(fit_history=False),
    dict(output_gates=False),
]


@pytest.mark.parametrize("name", ["rla", "rdn"])
@pytest.mark.parametrize("switch", ABLATIONS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_ablation_switch_reaches_the_op(name, switch):
    """Each switch gives exactly the naive layer with that switch, and differs from the default layer."""
    default = make_mixer(name)
    ablated = make_mixer(name, **switch)
    ablated.load_state_dict(default.state_dict(), strict=False)
    x = hidden(2, 9, scale=3.0)
    y = ablated(x)
    assert torch.allclose(y, naive_gated_memory(ablated, x)[0], atol=TOL, rtol=0)
    assert (y - default(x)).abs().max() > 1e-6


def test_tied_gamma_is_beta():
    """``gamma="tied"`` has no c_proj, feeds γ = β to the op, and equals an independent layer whose c_proj is b_proj."""
    tied, free = make_mixer("rdn", gamma="tied"), make_mixer("rdn")
    assert not hasattr(tied, "c_proj") and hasattr(free, "c_proj")
    free.load_state_dict(tied.state_dict(), strict=False)
    free.c_proj.weight.data.copy_(tied.b_proj.weight.data)
    seen = {}
    tied.hook_beta.register_forward_hook(lambda m, a, out: seen.__setitem__("beta", out))
    tied.hook_gamma.register_forward_hook(lambda m, a, out: seen.__setitem__("gamma", out))
    x = hidden(1, 6)
    # the free layer projects β and γ in one product (``gate_inputs``), whose wider output may sum in another order
    # than the tied layer's β alone: equal to float64 rounding, not bit for bit
    torch.testing.assert_close(tied(x), free(x), rtol=0, atol=1e-12)
    assert torch.equal(seen["beta"], seen["gamma"])


@pytest.mark.parametrize("name", ["sgla", "gla", "rdn"])
def test_backends_agree_in_layer(name):
    layer = make_mixer(name)
    x = hidden(2, 21)
    y_chunk = layer(x)
    layer.backend = "reference"
    assert torch.allclose(layer(x), y_chunk, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["sgla", "gdn", "rla", "rdn", "gla"])
@pytest.mark.parametrize("use_short_conv", [True, False])
def test_padding_never_writes(name, use_short_conv):
    """Left padding, even holding NaN: outputs at real tokens, the states and the conv states equal the unpadded
    run."""
    layer = make_mixer(name, use_short_conv=use_short_conv)
    x = hidden(1, 7)
    padded = torch.cat([torch.full((1, 3, D), float("nan"), dtype=F64), x], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 7])
    alone, padded_cache = RecurrentLayerCache(), RecurrentLayerCache()
    y = layer(x, cache=alone)
    y_pad = layer(padded, attention_mask=mask, cache=padded_cache)
    assert torch.allclose(y_pad[:, 3:], y, atol=TOL, rtol=0)
    assert torch.allclose(padded_cache.base_state, alone.base_state, atol=TOL, rtol=0)
    for key, state in alone.conv_states.items():
        assert torch.allclose(padded_cache.conv_states[key], state, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["sgla", "gdn", "rla", "rdn", "gla"])
def test_decoding_steps_equal_the_sequence(name):
    layer = make_mixer(name)
    x = hidden(2, 8)
    y = layer(x)
    cache = RecurrentLayerCache()
    steps = [layer(x[:, : 3], cache=cache)] + [layer(x[:, t: t + 1], cache=cache) for t in range(3, 8)]
    assert torch.allclose(torch.cat(steps, 1), y, atol=TOL, rtol=0)
    assert cache.seen_tokens == 8


# ---------------------------------------------------------------- hooks

@pytest.mark.parametrize("name", ["sgla", "gdn", "rla", "rdn", "gla"])
def test_hooks_fire_with_documented_shapes(name):
    layer = make_mixer(name)
    residual = name in ("rla", "rdn")
    V = layer.head_v_dim
    K_ = layer.head_k_dim
    B, T = 2, 5
    expected = {"q": (B, T, H, K_), "k": (B, T, H, K_), "v": (B, T, H, V), "beta": (B, T, H),
                "g": (B, T, H, K_) if name == "gla" else (B, T, H), "readout": (B, T, H, V), "state": (B, H, V, K_)}
    if residual:
        expected.update(gamma=(B, T, H), residual_state=(B, H, V, K_))
    seen = {}
    for point in expected:
        getattr(layer, f"hook_{point}").register_forward_hook(
            lambda m, a, out, point=point: seen.__setitem__(point, tuple(out.shape)))
    assert hasattr(layer, "hook_gamma") == residual
    layer(hidden(B, T))
    assert seen == expected


@pytest.mark.parametrize("name", ["gla", "rdn"])
def test_editing_hooks_changes_the_run(name):
    layer = make_mixer(name)
    x = hidden(1, 6)
    y = layer(x)
    handle = layer.hook_readout.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    assert torch.equal(layer(x), torch.zeros_like(y))  # a zero read-out gives a zero output (norm, gate, o_proj)
    handle.remove()
    handle = layer.hook_readout.register_forward_hook(lambda m, a, out: out + torch.randn_like(out))
    assert (layer(x) - y).abs().max() > 1e-3
    handle.remove()
    # replacing the state: the cache keeps what the hook returned, and the next token sees it
    clean, edited = RecurrentLayerCache(), RecurrentLayerCache()
    layer(x[:, :5], cache=clean)
    handle = layer.hook_state.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    layer(x[:, :5], cache=edited)
    handle.remove()
    assert torch.equal(edited.base_state, torch.zeros_like(clean.base_state))
    assert (layer(x[:, 5:], cache=edited) - layer(x[:, 5:], cache=clean)).abs().max() > 1e-6


# ---------------------------------------------------------------- attention

def naive_attention(layer, x, window=None):
    """Per head, explicit RoPE on both halves, causal (windowed) softmax; GQA by kv head h // groups."""
    batch, length, _ = x.shape
    d, heads, kv_heads = layer.head_dim, layer.num_heads, layer.num_kv_heads
    q = layer.q_proj(x).view(batch, length, heads, d)
    k = layer.k_proj(x).view(batch, length, kv_heads, d)
    v = layer.v_proj(x).view(batch, length, kv_heads, d)
    freqs = 10000.0 ** (-torch.arange(d // 2, dtype=F64) * 2 / d)
    angle = torch.arange(length, dtype=F64)[:, None] * freqs  # [T, d/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rope(t):
        a, b = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    q, k = rope(q), rope(k)
    out = torch.zeros_like(q)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        scores = torch.einsum("btd,bsd->bts", q[:, :, h], k[:, :, kh]) / d**0.5
        t_idx, s_idx = torch.arange(length)[:, None], torch.arange(length)[None]
        allowed = (s_idx <= t_idx) & ((s_idx > t_idx - window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, :, h] = torch.einsum("bts,bsd->btd", scores.softmax(-1), v[:, :, kh])
    return layer.o_proj(out.reshape(batch, length, -1))


@pytest.mark.parametrize("kv_heads,window", [(4, None), (1, None), (2, 3)])
def test_attention_matches_naive_and_decodes(kv_heads, window):
    layer = Attention(D, 4, num_kv_heads=kv_heads, window_size=window).double()
    x = hidden(2, 9)
    y = layer(x)
    assert torch.allclose(y, naive_attention(layer, x, window), atol=TOL, rtol=0)
    cache = AttentionLayerCache()
    steps = [layer(x[:, :4], cache=cache)] + [layer(x[:, t: t + 1], cache=cache) for t in range(4, 9)]
    assert torch.allclose(torch.cat(steps, 1), y, atol=TOL, rtol=0)
    assert cache.keys.shape == (2, 9, kv_heads, D // 4)


def test_attention_masks_padding():
    layer = Attention(D, 4, qk_norm=True).double()
    x = hidden(1, 6)
    padded = torch.cat([torch.full((1, 2, D), float("nan"), dtype=F64), x], 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    y_pad = layer(padded, attention_mask=mask, position_ids=positions)
    assert torch.allclose(y_pad[:, 2:], layer(x), atol=TOL, rtol=0)



def test_attention_hooks_see_the_rotated_queries_and_keys():
    """``hook_q`` / ``hook_k`` carry ``[B, T, H, d]`` / ``[B, T, H_kv, d]`` after RoPE: the weights recomputed from
    them, applied to the values, give the layer's output."""
    layer = Attention(D, 4, num_kv_heads=2).double()
    x = hidden(2, 7)
    seen = {}
    layer.hook_q.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out))
    layer.hook_k.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out))
    y = layer(x)
    d = D // 4
    assert seen["q"].shape == (2, 7, 4, d) and seen["k"].shape == (2, 7, 2, d)
    k = seen["k"].repeat_interleave(2, dim=2)
    v = layer.v_proj(x).view(2, 7, 2, d).repeat_interleave(2, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", seen["q"], k) / d**0.5
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)
    assert torch.allclose(layer.o_proj(out.reshape(2, 7, -1)), y, atol=TOL, rtol=0)

# ---------------------------------------------------------------- FLA 0.6.0 names and shapes

def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


@pytest.mark.parametrize("use_short_conv", [True, False])
def test_parameter_names_match_fla(use_short_conv):
    fla_layers = pytest.importorskip("fla.layers")
    ours = GatedDeltaNet(64, 2, 16, use_short_conv=use_short_conv)
    theirs = fla_layers.GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, use_short_conv=use_short_conv)
    assert _shapes(ours) == _shapes(theirs)
    for kv_heads in (None, 1):
        ours = GatedLinearAttention(64, 2, num_kv_heads=kv_heads, use_short_conv=use_short_conv)
        theirs = fla_layers.GatedLinearAttention(hidden_size=64, num_heads=2, num_kv_heads=kv_heads,
                                                 use_short_conv=use_short_conv)
        assert _shapes(ours) == _shapes(theirs)


def test_residual_mixers_add_only_c_proj():
    base = set(_shapes(GatedDeltaNet(D, H, K)))
    assert set(_shapes(ResidualDeltaNet(D, H, K))) - base == {"c_proj.weight"}
    assert set(_shapes(ResidualLinearAttention(D, H, K, gamma="tied"))) == base
    assert _shapes(Attention(D, 4, num_kv_heads=2, qk_norm=True)) == {
        "q_proj.weight": (D, D), "k_proj.weight": (16, D), "v_proj.weight": (16, D), "o_proj.weight": (D, D),
        "q_norm.weight": (8,), "k_norm.weight": (8,)}
