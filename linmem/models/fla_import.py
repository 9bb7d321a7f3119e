"""Import flash-linear-attention (FLA 0.6.0) checkpoints: ``model_type`` ``"gla"`` and ``"gated_deltanet"``, hybrids
with an ``attn`` block included, as ``LinMemForCausalLM`` models that compute the same logits.

A checkpoint is a directory with FLA's ``config.json`` and safetensors weights (``model.safetensors`` or shards listed
in ``model.safetensors.index.json``). The config maps field by field (``fla_config_to_linmem``); every FLA setting
that linmem cannot reproduce exactly raises a ``ValueError`` naming the field and its value, so a model that would
compute something else is never built. Parameter names are FLA's, so weights load as they are; the two exceptions
are GLA's un-fused norm (``g_norm`` → ``g_norm_swish_gate``, same math) and a norm without weights
(``elementwise_affine=False`` → a weight of ones). Weights are read with ``safetensors`` only (nothing is
unpickled), one tensor at a time, into a model allocated on the target device (``empty_model``, ``WeightWriter``),
after the names and shapes of the files' headers were checked against the model the config describes, built on the
meta device (``check_checkpoint_shapes``): a config of absurd size is one line, and nothing is allocated for it.

``AutoModelForCausalLM.from_pretrained`` cannot take such a directory directly: ``"gla"`` and ``"gated_deltanet"``
are FLA's own model types (FLA registers them with the Auto classes when imported), so linmem does not claim them.
Use ``load_fla_checkpoint`` (alias ``from_fla``), or ``convert_fla_checkpoint`` once, which writes a linmem
directory that ``AutoModelForCausalLM`` / ``LinMemForCausalLM.from_pretrained`` load. docs/fla_import.md has the
full table of fields.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from linmem.models.configuration import LinMemConfig
from linmem.models.modeling import LinMemForCausalLM
from linmem.models.sub_configs import AttentionConfig

FLA_MODEL_TYPES = ("gla", "gated_deltanet")

# FLA 0.6.0's defaults (GLAConfig / GatedDeltaNetConfig), used for fields a config.json leaves out; with the fields
# below they are also every field each model type knows.
_COMMON_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_ratio=4, intermediate_size=None, hidden_act="swish", norm_eps=1e-6, attn=None,
    tie_word_embeddings=False, max_position_embeddings=2048, conv_size=4, attnres_block_size=None,
    initializer_range=0.02, use_cache=True, pad_token_id=None, bos_token_id=1, eos_token_id=2,
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gla": dict(_COMMON_DEFAULTS, hidden_size=2048, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1.0,
                num_kv_heads=None, feature_map=None, use_short_conv=False, use_output_gate=True, clamp_min=None,
                elementwise_affine=True, use_gk=True, use_gv=False, fuse_norm=True),
    "gated_deltanet": dict(_COMMON_DEFAULTS, hidden_size=2048, num_hidden_layers=21, num_heads=6, head_dim=256,
                           expand_v=2.0, num_v_heads=None, use_gate=True, use_short_conv=True, allow_neg_eigval=False,
                           output_gate_activation="swish"),
}

# Fields that leave the forward pass unchanged: kernel choice, fusions, the loss, initialisation, caching.
_NO_MATH_FIELDS = {
    "attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp",
    "initializer_range", "use_cache", "max_position_embeddings",
}
# Fields every transformers config may carry (transformers 4.x and 5.x); none changes an FLA model's math.
_GENERIC_FIELDS = {
    "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "architectures", "auto_map", "model_type",
    "transformers_version", "dtype", "torch_dtype", "use_bfloat16", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder",
    "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
}
# Fields linmem reproduces at the listed values only: {field: (allowed values, why others are refused)}.
_COMMON_FIXED: dict[str, tuple[tuple, str]] = {
    "hidden_act": (("swish",), "linmem's MLP is SwiGLU (FLA's 'powlu' MLP is not implemented)"),
    "attnres_block_size": ((None,), "attention residuals (FLA's fused_attnres blocks) are not implemented in linmem"),
    "conv_bias": ((False,), "FLA 0.6.0's models build their short convolutions without bias whatever this field "
                            "says, so such a checkpoint's meaning depends on the FLA version that wrote it"),
}
_FIXED: dict[str, dict[str, tuple[tuple, str]]] = {
    "gla": {
        **_COMMON_FIXED,
        "feature_map": ((None,), "linmem's GLA applies no feature map to q and k"),
        "use_output_gate": ((True,), "linmem's GLA always has the swish output gate (g_proj)"),
        "use_gk": ((True,), "FLA 0.6.0 ignores it and always uses the per-channel decay gk_proj; a checkpoint "
                            "written with another value computes something else"),
        "use_gv": ((False,), "FLA 0.6.0 ignores it and has no value gate; a checkpoint written with another value "
                             "computes something else"),
        "gate_logit_normalizer": ((16,), "FLA 0.6.0's GLAForCausalLM does not pass it to its layer, which always "
                                         "divides the gate logits by 16"),
        "gate_low_rank_dim": ((16,), "FLA 0.6.0's GLAForCausalLM does not pass it to its layer, which always uses "
                                     "a rank-16 gate projection"),
    },
    "gated_deltanet": {
        **_COMMON_FIXED,
        "use_gate": ((True,), "linmem's GatedDeltaNet always has the output gate (g_proj and a gated RMSNorm)"),
        "allow_neg_eigval": ((False,), "it doubles β to [0, 2]; linmem's delta rule takes β in [0, 1]"),
        "output_gate_activation": (("swish", "silu"), "linmem's GatedDeltaNet output gate is swish"),
    },
}
_ATTN_FIELDS = {"layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta", "qk_norm"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "added_tokens.json")


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"FLA config field {field!r} = {value!r} cannot be imported: {why}")


def fla_config_to_linmem(
    fla_config: Mapping[str, Any],
    *,
    backend: str = "auto",
    allow_unknown_fields: bool = False,
) -> LinMemConfig:
    """The ``LinMemConfig`` of an FLA 0.6.0 ``GLAConfig`` / ``GatedDeltaNetConfig`` (its ``config.json`` as a dict).

    GLA: ``expand_k``, ``expand_v`` → ``head_dim = D·expand_k / H`` and ``expand_v = (D·expand_v / H) / head_dim``;
    ``num_kv_heads``, ``clamp_min``, short convs as given; gate normaliser and low-rank dim FLA's fixed 16.
    Gated DeltaNet: ``head_dim``, ``num_heads``, ``expand_v`` as given. Both: sizes, ``hidden_ratio`` /
    ``intermediate_size``, ``norm_eps``, ``tie_word_embeddings``, special token ids, and the ``attn`` block (layers,
    num_heads, num_kv_heads, qkv_bias, window_size, rope_theta) → ``attention`` (``AttentionConfig``).

    Args:
        fla_config: the FLA config dict; fields it leaves out take FLA 0.6.0's defaults.
        backend: the linmem op backend to record in the config.
        allow_unknown_fields: accept fields neither FLA 0.6.0 nor transformers defines (default: refuse them, since
            linmem cannot tell whether they change the math).
    Raises:
        ValueError: naming the field and value of any setting linmem cannot reproduce exactly.
    """
    model_type = fla_config.get("model_type")
    if model_type not in FLA_MODEL_TYPES:
        raise ValueError(f"FLA config field 'model_type' = {model_type!r} cannot be imported: linmem imports "
                         f"{FLA_MODEL_TYPES}")
    cfg = {**_DEFAULTS[model_type], **fla_config}
    _check_fields(model_type, fla_config, cfg, allow_unknown_fields)
    attention = _attention_config(cfg["attn"], cfg["num_hidden_layers"])
    hidden, heads = cfg["hidden_size"], cfg["num_heads"]
    if model_type == "gla":
        mixer = dict(mixer="gla", num_kv_heads=cfg["num_kv_heads"], clamp_min=cfg["clamp_min"],
                     gate_logit_normalizer=16, gate_low_rank_dim=16, **_gla_widths(hidden, heads, cfg))
    else:
        mixer = dict(mixer="gdn", head_dim=cfg["head_dim"], expand_v=cfg["expand_v"])
    return LinMemConfig(
        vocab_size=cfg["vocab_size"], hidden_size=hidden, num_hidden_layers=cfg["num_hidden_layers"],
        num_heads=heads, **mixer, attention=attention,
        use_short_conv=cfg["use_short_conv"], conv_size=cfg["conv_size"], conv_bias=False,
        hidden_ratio=cfg["hidden_ratio"], intermediate_size=cfg["intermediate_size"], norm_eps=cfg["norm_eps"],
        tie_word_embeddings=cfg["tie_word_embeddings"], max_position_embeddings=cfg["max_position_embeddings"],
        initializer_range=cfg["initializer_range"], use_cache=cfg["use_cache"], backend=backend,
        pad_token_id=cfg["pad_token_id"], bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
    )


def _check_fields(model_type: str, given: Mapping[str, Any], cfg: Mapping[str, Any], allow_unknown: bool) -> None:
    """Refuse values linmem cannot reproduce and (unless allowed) fields nobody defines."""
    fixed = _FIXED[model_type]
    for field, (allowed, why) in fixed.items():
        if field in cfg and cfg[field] not in allowed:
            raise _refuse(field, cfg[field], why)
    if model_type == "gated_deltanet" and cfg["num_v_heads"] not in (None, cfg["num_heads"]):
        raise _refuse("num_v_heads", cfg["num_v_heads"], f"grouped value heads (num_v_heads != num_heads = "
                      f"{cfg['num_heads']}) are not implemented in linmem's GatedDeltaNet")
    known = _NO_MATH_FIELDS | _GENERIC_FIELDS | set(fixed) | set(_DEFAULTS[model_type])
    unknown = sorted(set(given) - known)
    if unknown and not allow_unknown:
        raise ValueError(f"FLA config fields {unknown} are unknown to FLA 0.6.0 and transformers; linmem cannot tell "
                         f"whether they change the math (pass allow_unknown_fields=True to import anyway)")


def _gla_widths(hidden: int, heads: int, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """linmem's ``head_dim`` (K) and ``expand_v`` (V / K) for FLA's ``expand_k`` / ``expand_v`` (widths of all heads
    as fractions of ``hidden_size``)."""
    widths = {}
    for name in ("expand_k", "expand_v"):
        width = hidden * cfg[name]
        if not math.isclose(width, round(width)) or round(width) < 1 or round(width) % heads:
            raise _refuse(name, cfg[name], f"hidden_size ({hidden}) * {name} must be a positive integer divisible by "
                                           f"num_heads ({heads})")
        widths[name] = round(width) // heads
    return dict(head_dim=widths["expand_k"], expand_v=widths["expand_v"] / widths["expand_k"])


def _attention_config(attn: Any, num_layers: int) -> AttentionConfig | None:
    """The ``AttentionConfig`` of FLA's ``attn`` block (None: no attention layers): one dict, or a list of dicts
    that may differ only in ``layers`` (linmem's hybrids give every softmax layer the same shape)."""
    if attn is None:
        return None
    specs = [attn] if isinstance(attn, Mapping) else list(attn) if isinstance(attn, (list, tuple)) else None
    if not specs or any(not isinstance(spec, Mapping) for spec in specs):
        raise _refuse("attn", attn, "expected a dict or a non-empty list of dicts")
    shapes = []
    layers: list[int] = []
    for spec in specs:
        extra = sorted(set(spec) - _ATTN_FIELDS)
        if extra:
            raise _refuse(f"attn.{extra[0]}", spec[extra[0]], "not an FLA 0.6.0 attention setting; linmem cannot "
                                                              "tell whether it changes the math")
        if spec.get("qk_norm"):
            raise _refuse("attn.qk_norm", spec["qk_norm"], "FLA 0.6.0 builds its attention layers without q/k norms "
                                                           "whatever this field says, so such a checkpoint's meaning "
                                                           "depends on the FLA version that wrote it")
        if "layers" not in spec or "num_heads" not in spec:
            raise _refuse("attn", spec, "an attention spec needs 'layers' and 'num_heads'")
        layers += list(spec["layers"])
        heads = spec["num_heads"]
        kv_heads = heads if spec.get("num_kv_heads") is None else spec["num_kv_heads"]
        shapes.append(dict(num_heads=heads, num_kv_heads=kv_heads, qkv_bias=bool(spec.get("qkv_bias", False)),
                           window_size=spec.get("window_size"), rope_theta=float(spec.get("rope_theta", 1e4))))
    if any(shape != shapes[0] for shape in shapes[1:]):
        raise _refuse("attn", attn, "attention specs of different shapes (heads, bias, window, rope_theta); linmem's "
                                    "hybrids give all attention layers one shape")
    if any(not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
        raise _refuse("attn.layers", layers, f"layer indices must be distinct and in [0, {num_layers})")
    return AttentionConfig(layers=sorted(layers), **shapes[0])


# Streaming: a checkpoint's tensors go, one at a time, into a model whose parameters were allocated on the target
# device without being initialised, so host memory holds one tensor beyond the model (and nothing beyond one tensor
# when the model is on a GPU) and device memory holds the weights only. Before that, the same writes run on the
# meta device with the shapes of the files' headers, so weights that do not fit the config are refused before
# anything is allocated. The HF hybrids' loader uses the same steps.

_STORED_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` names.

    Raises:
        ValueError: if the directory has no safetensors weights (a ``pytorch_model.bin`` is refused, not read).
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    found = f" (found {pickled}: pickled weights, which linmem never loads since unpickling can run code; " \
            f"convert them to safetensors with a tool you trust)" if pickled else ""
    raise ValueError(f"{path} has no model.safetensors or model.safetensors.index.json{found}")


def stream_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``files``, read on the CPU one at a time (``safetensors.safe_open``,
    never unpickled); one file is open at a time."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def header_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``files`` as ``stream_safetensors`` gives them, but on the meta device:
    the shapes come from the file headers and nothing is read or allocated."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, torch.empty(handle.get_slice(name).get_shape(), device="meta")


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (``safetensors_files``) on the CPU, read with ``safetensors``."""
    return dict(stream_safetensors(safetensors_files(path)))


def stored_dtype(files: list[Path], names: tuple[str, ...]) -> torch.dtype:
    """The float dtype the first of ``names`` found in ``files`` is stored in (read from the file headers only)."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            stored = set(handle.keys())
            for name in (n for n in names if n in stored):
                code = handle.get_slice(name).get_dtype()
                if code not in _STORED_FLOATS:
                    raise ValueError(f"{file}: {name} is stored as {code}; pass dtype= (a float dtype) to load it")
                return _STORED_FLOATS[code]
    raise ValueError(f"{files[0].parent} has none of the tensors {list(names)}")


def empty_model(config: LinMemConfig, dtype: torch.dtype, device: torch.device | str) -> LinMemForCausalLM:
    """``LinMemForCausalLM(config)`` in eval mode with uninitialised ``dtype`` parameters on ``device`` (built on the
    meta device, so no memory is taken twice and no random init runs); ``lm_head`` tied to the embedding where the
    config ties them. Buffers stay on the meta device: ``WeightWriter.finish`` refuses a model that has any."""
    model = _meta_model(config)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            kind = dtype if param.is_floating_point() else param.dtype
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                               requires_grad=param.requires_grad))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _meta_model(config: LinMemConfig) -> LinMemForCausalLM:
    """``LinMemForCausalLM(config)`` on the meta device, without random init, ``lm_head`` tied where the config
    ties it."""
    with _no_init_weights(), torch.device("meta"):
        model = LinMemForCausalLM(config)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def check_checkpoint_shapes(config: LinMemConfig, files: list[Path],
                            write: Callable[[WeightWriter, Iterable[tuple[str, torch.Tensor]]], object],
                            what: str) -> None:
    """Refuse (one ``ValueError`` line starting with ``what``) a checkpoint whose tensors do not fill the model
    ``config`` describes exactly, before anything is allocated: ``write`` (the loader's own writes, given a
    ``WeightWriter`` and ``(name, tensor)`` pairs) runs on a model built on the meta device with the shapes of the
    files' headers (``header_tensors``). The message names the tensors and both parameter counts, so a config of
    absurd size (a vocabulary of 10^12) is plain."""
    writer = WeightWriter(_meta_model(config))
    with torch.no_grad():
        write(writer, header_tensors(files))
    mismatch = writer.mismatch()
    if mismatch:
        described = sum(param.numel() for param in writer.params.values())
        held = sum(tensor.numel() for _, tensor in header_tensors(files))
        raise ValueError(f"{what}: {mismatch} (the config describes {described:,} parameters, the weights hold "
                         f"{held:,}); nothing was allocated")


class WeightWriter:
    """Copies checkpoint tensors (or slices of them) into the parameters of an ``empty_model`` and checks, at the
    end, that every parameter was written in full, that no tensor went nowhere and that every shape fitted."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())  # a tied lm_head is the embedding: listed once
        self.written = dict.fromkeys(self.params, 0)  # elements written per parameter
        self.unexpected: list[str] = []
        self.wrong: list[str] = []

    def write(self, source: str, target: str, value: torch.Tensor, index: Any = None) -> None:
        """Copy ``value`` (checkpoint tensor ``source``) into parameter ``target``, or into ``target[index]``."""
        param = self.params.get(target)
        if param is None:
            self.unexpected.append(source)
            return
        dest = param.data if index is None else param.data[index]
        if dest.shape != value.shape:
            self.wrong.append(f"{source}: checkpoint {list(value.shape)}, linmem {target} {list(dest.shape)}")
            return
        dest.copy_(value)
        self.written[target] += value.numel()

    def reject(self, source: str) -> None:
        """Record a checkpoint tensor that has no place in the model."""
        self.unexpected.append(source)

    def is_written(self, target: str) -> bool:
        return self.written.get(target, 0) > 0

    def mismatch(self) -> str | None:
        """What keeps the model from being filled exactly, for an error message (None: nothing)."""
        missing = [name for name, param in self.params.items() if self.written[name] < param.numel()]
        twice = [name for name, param in self.params.items() if self.written[name] > param.numel()]
        if not (missing or twice or self.unexpected or self.wrong):
            return None
        repeated = f", written more than once {_few(twice)}" if twice else ""
        return (f"the weights do not match the model its config describes: missing {_few(missing)}, unexpected "
                f"{_few(self.unexpected)}, wrong shapes {_few(self.wrong)}{repeated}")

    def finish(self, what: str) -> None:
        """Raise ``ValueError`` naming ``what`` (the checkpoint) unless the model was filled exactly."""
        mismatch = self.mismatch()
        if mismatch:
            raise ValueError(f"{what}: {mismatch}")
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        meta = [name for name, tensor in tensors if tensor.is_meta]
        if meta:
            raise ValueError(f"{what}: linmem's model has tensors no checkpoint holds and the loader does not compute "
                             f"({_few(meta)}); give them a value in linmem.models.fla_import.empty_model")


def _few(names: list[str], shown: int = 12) -> str:
    """A list for an error message, cut after ``shown`` entries."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def fla_tensor_name(name: str, model_type: str) -> str:
    """linmem's name of an FLA parameter: the same, except GLA's un-fused output norm (``attn.g_norm.weight`` →
    ``attn.g_norm_swish_gate.weight``; both are RMSNorm times swish(g_proj x))."""
    if model_type == "gla":
        return re.sub(r"(\.attn)\.g_norm\.weight$", r"\1.g_norm_swish_gate.weight", name)
    return name


def _write_fla(writer: WeightWriter, tensors: Iterable[tuple[str, torch.Tensor]],
               fla_config: Mapping[str, Any]) -> torch.Tensor | None:
    """Write an FLA checkpoint's ``tensors`` through ``writer``; GLA with ``elementwise_affine=False`` gets
    output-norm weights of ones (a norm without weight). Returns the checkpoint's ``lm_head.weight`` where the
    config ties it to the embedding (not written: the caller compares it), else None."""
    config, model_type = writer.model.config, fla_config["model_type"]
    head = None
    for name, tensor in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            head = tensor
            continue
        writer.write(name, fla_tensor_name(name, model_type), tensor)
    if model_type == "gla" and not {**_DEFAULTS["gla"], **fla_config}["elementwise_affine"]:
        for i in (i for i in range(config.num_hidden_layers) if i not in config.attention.layers):
            target = f"model.layers.{i}.attn.g_norm_swish_gate.weight"
            if not writer.is_written(target):
                writer.write("(no weight: ones)", target, torch.ones_like(writer.params[target]))
    return head


def _fill_fla(model: LinMemForCausalLM, files: list[Path], fla_config: Mapping[str, Any]) -> None:
    """Stream ``files`` into ``empty_model`` ``model`` (``_write_fla``). A tied ``lm_head.weight`` in the checkpoint
    must equal the embedding."""
    writer = WeightWriter(model)
    with torch.no_grad():
        head = _write_fla(writer, stream_safetensors(files), fla_config)
    writer.finish(str(files[0].parent))
    embedding = model.model.embeddings.weight
    if head is not None and not torch.equal(head.to(embedding), embedding):
        raise ValueError("the config ties lm_head to the embeddings (tie_word_embeddings=True) but the checkpoint "
                         "holds a different lm_head.weight; which one FLA uses depends on load order")


def _resolve_dtype(dtype: torch.dtype | str | None, files: list[Path]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":  # the checkpoint's own (the embedding's) dtype
        return stored_dtype(files, ("model.embeddings.weight",))
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype must be a torch.dtype, its name, 'auto' or None; got {dtype!r}")


def load_fla_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str | None = None,
    backend: str = "auto",
    allow_unknown_fields: bool = False,
) -> LinMemForCausalLM:
    """Load an FLA GLA / Gated DeltaNet checkpoint directory as a ``LinMemForCausalLM`` (in eval mode).

    Args:
        path: directory with FLA's ``config.json`` and safetensors weights, or the Hugging Face Hub id
            ``ORG/NAME[@REVISION]`` of such a checkpoint, fetched into the Hugging Face cache (``linmem.io.hub``; an
            existing folder of that name wins).
        dtype: parameter dtype; ``"auto"`` / None keep the checkpoint's (its embedding's dtype).
        device: where the model lives (None: CPU).
        backend: the linmem op backend (``"auto"``: Triton on CUDA, chunk elsewhere).
        allow_unknown_fields: see ``fla_config_to_linmem``.
    Raises:
        ValueError: a setting linmem cannot reproduce, a ``.bin``-only directory, or weights that do not match the
            config (names or shapes).
    """
    from linmem.io.models import local_or_hub_folder
    from linmem.models.loading import check_hub_config

    path = local_or_hub_folder(path, check_hub_config)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json (expected an FLA checkpoint directory)")
    fla_config = json.loads((path / "config.json").read_text())
    config = fla_config_to_linmem(fla_config, backend=backend, allow_unknown_fields=allow_unknown_fields)
    files = safetensors_files(path)
    check_checkpoint_shapes(config, files, lambda writer, tensors: _write_fla(writer, tensors, fla_config),
                            str(path / "config.json"))
    model = empty_model(config, _resolve_dtype(dtype, files), device or "cpu")
    _fill_fla(model, files, fla_config)
    return model


def _no_init_weights():
    """transformers' ``no_init_weights`` (skip random init: every weight is loaded afterwards), where it exists."""
    from contextlib import nullcontext

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return nullcontext()
    return no_init_weights()


from_fla = load_fla_checkpoint


def convert_fla_checkpoint(
    path: str | Path,
    output_dir: str | Path,
    *,
    dtype: torch.dtype | str | None = "auto",
    allow_unknown_fields: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write an FLA checkpoint as a linmem checkpoint (``save_pretrained``: ``config.json`` with
    ``model_type = "linmem"`` and safetensors weights) that ``AutoModelForCausalLM.from_pretrained`` loads after
    ``import linmem``. Tokenizer files next to the FLA weights are copied along. ``path`` is a folder or a Hub id
    (as in ``load_fla_checkpoint``). Returns ``output_dir``, which must be new, empty or an earlier conversion's
    unless ``overwrite`` (``linmem.io.folders.prepare_output_folder``)."""
    from linmem.io.folders import prepare_output_folder
    from linmem.io.models import local_or_hub_folder
    from linmem.models.loading import check_hub_config, record_architecture

    path = local_or_hub_folder(path, check_hub_config)
    output_dir = prepare_output_folder(output_dir, overwrite=overwrite, kind="convert")
    model = load_fla_checkpoint(path, dtype=dtype, allow_unknown_fields=allow_unknown_fields)
    model.save_pretrained(output_dir)
    record_architecture(output_dir, model.config)  # the loader checks config.json against it
    for name in _TOKENIZER_FILES:
        source = Path(path) / name
        if source.is_file() and not (output_dir / name).exists():
            shutil.copy2(source, output_dir / name)
    return output_dir
