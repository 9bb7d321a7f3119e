"""The training config: a YAML file with four sections, checked key by key before any work starts.

```yaml
model: {hidden_size: 256, num_hidden_layers: 6, mixer: rdn, ...}   # LinMemConfig fields; vocab_size: auto
data:  {dir: data/zoo, sources: [stdlib], seq_len: 512, recall_fraction: 0.25, recall: [{name: mqar}]}
optim: {lr: 3.0e-4, min_lr: 3.0e-5, warmup_steps: 100, weight_decay: 0.1, grad_clip: 1.0}
train: {steps: 2000, batch_size: 32, micro_batch_size: 16, eval_interval: 200, checkpoint_interval: 500}
```

Defaults follow the RLA paper's Table 7 recipe, scaled down (AdamW, cosine schedule from 3e-4 to 3e-5 after a
linear warmup, weight decay 0.1, gradient clipping 1.0, init std 0.006). Every error names the key
(``optim.lrr``, ``train.batch_size``) so a user can fix the file without reading code. ``include: base.yaml``
at the top level merges a shared base under the file (``read_config_dict``), so that a family of configs states
its common sections once.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from linmem.io.backend_names import BACKENDS
from linmem.models.configuration import FLAT_FIELDS, SUB_CONFIGS, LinMemConfig
from linmem.train.compile import compile_mode
from linmem.train.lab_recall import parse_entries

# LinMemConfig / PretrainedConfig arguments a training config may not set (the trainer owns them).
MODEL_KEYS_OWNED = {"self", "kwargs", "use_cache"}
DEFAULT_INIT_STD = 0.006  # RLA Table 7
DTYPES = ("auto", "float32", "bfloat16")
PARALLEL = ("auto", "none", "ddp", "fsdp")
LOSS_CHUNK_TOKENS = 8192  # tokens per piece of the chunked loss (a 100K vocabulary: 3 GiB of float32 logits)
LOSS_CHUNK_AUTO_BYTES = 2**30  # float32 logits of one micro-batch above this size are computed in pieces


@dataclass
class DataSection:
    """Where the tokens come from and how windows are cut.

    ``dir``: a dataset folder (``linmem data build``); when it holds no dataset yet and ``sources`` is given, the
    trainer builds it there first (``vocab_size``, ``splits``; ``tokenizer``: ``train``, a ``tokenizer.json`` or
    ``zoo:NAME`` for a zoo model's tokenizer). ``seq_len``: tokens per training window.
    ``recall_fraction``: share of training sequences replaced by synthetic recall sequences, made by ``recall``,
    a list of generator specs ``{name: mqar, weight: 1, ...generator options}`` (``module`` imports a module that
    registers further generators). ``recall_loss_weight``: each answer token of a synthetic sequence counts this
    many text tokens in the loss (a 512-token window holds 8-32 answers, so at weight 1 recall is about 1% of
    the gradient and tiny models never learn it). ``eval_split``: the held-out split for validation loss.
    ``split_documents``: a window's documents (each ends with the EOS separator) run as separate sequences of
    one packed row (``cu_seqlens``), so no token reads the document before it; off, a window runs as one sequence
    and a document sees the end of the previous one, separator between.
    """

    dir: str | None = None
    sources: list[str] = field(default_factory=list)
    tokenizer: str = "train"
    vocab_size: int = 4096
    splits: str = "0.96,0.02,0.02"
    seq_len: int = 512
    recall_fraction: float = 0.0
    recall: list[dict] = field(default_factory=list)
    recall_loss_weight: float = 1.0
    eval_split: str = "validation"
    split_documents: bool = False


@dataclass
class OptimSection:
    """AdamW with a cosine schedule: linear warmup to ``lr`` over ``warmup_steps``, cosine down to ``min_lr`` at
    ``train.steps``. Weight decay applies to matrices only (not norms, biases or decay parameters). ``fused``:
    PyTorch's fused AdamW (one kernel per parameter group and step instead of the default's several per tensor list;
    the same update up to rounding)."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    fused: bool = False


@dataclass
class TrainSection:
    """The run: ``steps`` optimizer updates of ``batch_size`` sequences each (global, over all processes),
    ``micro_batch_size`` sequences per process and forward pass (gradient accumulation makes up the rest).

    ``eval_interval`` / ``checkpoint_interval`` in steps (0: never; a last checkpoint is always written),
    ``eval_tokens`` held-out tokens per evaluation, ``keep_checkpoints`` (the newest N stay), ``seed``,
    ``device`` (``auto``: CUDA if present), ``dtype`` (``auto``: bfloat16 autocast on GPU, float32 on CPU),
    ``parallel`` (``auto``: DDP when launched with more than one process), ``save_dtype`` of the final model,
    ``init_from``: start from a saved model's weights (a model folder or ``zoo:NAME``; ``linmem.train.init_from``)
    instead of a random initialisation. ``gradient_checkpointing``: keep only each block's input in the forward pass
    and recompute the block in the backward pass (activation memory of one block instead of all; about a third more
    compute; same loss and gradients). ``loss_chunk_tokens``: the LM head and the loss run over this many tokens
    at a time, each piece recomputed in the backward pass, so that a micro-batch's float32 logits
    ``[micro_batch_size x seq_len, vocab]`` never exist whole (same loss and gradients); 0: in one piece; left out:
    chunks of ``LOSS_CHUNK_TOKENS`` when the whole logits would take more than ``LOSS_CHUNK_AUTO_BYTES``.
    ``compile``: ``torch.compile`` each block's norms, mixer and MLP (``linmem.train.compile``), fusing their
    elementwise work; ``false`` (default), ``true`` or a mode name (``linmem.train.compile.COMPILE_MODES``).
    ``eval_lab_recall``: formats whose memory-lab recall every evaluation logs, on the validation split's documents
    (``linmem.train.lab_recall``; none by default). ``backend``: the linear-memory op's backend for this run
    (``linmem.io.backend_names.BACKENDS``; ``linmem train --backend`` sets it; ``model.backend`` is read as this
    key), a run-time choice that the saved model does not keep.
    """

    steps: int = 1000
    batch_size: int = 32
    micro_batch_size: int | None = None
    eval_interval: int = 200
    eval_tokens: int = 65536
    eval_recall_samples: int = 64
    checkpoint_interval: int = 500
    keep_checkpoints: int = 2
    log_interval: int = 1
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    parallel: str = "auto"
    save_dtype: str = "float32"
    progress: bool = True
    init_from: str | None = None
    gradient_checkpointing: bool = False
    loss_chunk_tokens: int | None = None
    compile: bool | str = False
    eval_lab_recall: list[dict] = field(default_factory=list)
    backend: str = "auto"


@dataclass
class TrainConfig:
    """The whole config; ``model`` is kept as a dict of ``LinMemConfig`` arguments (``vocab_size`` may be
    ``"auto"``: the dataset's vocabulary rounded up to a multiple of 64)."""

    model: dict[str, Any] = field(default_factory=dict)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    name: str = ""
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (YAML / JSON ready)."""
        return dataclasses.asdict(self)


SECTIONS = {"data": DataSection, "optim": OptimSection, "train": TrainSection}


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read and check a YAML config (``FileNotFoundError`` / ``ValueError`` naming the key), its ``include:`` files
    merged under it (``read_config_dict``); ``overrides`` are ``"section.key=value"`` strings applied last (values
    parsed as YAML: ``train.steps=50``)."""
    raw = read_config_dict(path)
    return parse_config(apply_overrides(raw, overrides or []), where=str(path))


def read_config_dict(path: str | Path, text: str | None = None) -> dict[str, Any]:
    """The mapping a YAML config file stands for, before any checks: ``include: base.yaml`` (or a list of files,
    each a path relative to the including file's folder) names configs merged under this one, the later include
    over the earlier and this file over all of them; mappings merge key by key at every depth, any other value
    (lists included) is replaced whole. ``text`` reads that YAML as if it were the file at ``path``. A file that
    includes itself, directly or through others, is refused (``ValueError`` naming the chain)."""
    return _read_with_includes(Path(path), text, ())


def _read_with_includes(path: Path, text: str | None, chain: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(resolved):], resolved))
        raise ValueError(f"{chain[-1]}: include cycle: {cycle}")
    if text is None:
        if not path.is_file():
            where = f"{chain[-1]}: include names" if chain else "no config file at"
            raise FileNotFoundError(f"{where} {str(path)!r}")
        text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    raw = raw or {}
    if not isinstance(raw, dict):
        return raw  # parse_config names the problem
    includes = raw.pop("include", None)
    if includes is None:
        return raw
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i.strip() for i in includes):
        raise ValueError(f"{path}: include must be a file name or a list of file names; got {includes!r}")
    merged: dict[str, Any] = {}
    for name in includes:
        merged = _deep_merge(merged, _read_with_includes(path.parent / name, None, (*chain, resolved)))
    return _deep_merge(merged, raw)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A new mapping: ``base`` with ``top``'s keys over it, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``raw`` with each ``"a.b=value"`` set (``value`` read as YAML); unknown keys are caught later by name."""
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path.strip():
            raise ValueError(f"--set expects section.key=value; got {item!r}")
        *parents, leaf = path.strip().split(".")
        node = raw
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {name} is not a section")
        node[leaf] = yaml.safe_load(text)
    return raw


def parse_config(raw: dict[str, Any], where: str = "config") -> TrainConfig:
    """A ``TrainConfig`` from a dict as YAML gives it; unknown keys and wrong types raise ``ValueError``."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: the top level must be a mapping with keys model, data, optim, train")
    known = {"model", "name", "description", *SECTIONS}
    _reject_unknown(raw, known, "", where)
    sections = {}
    for name, cls in SECTIONS.items():
        value = raw.get(name) or {}
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {name} must be a mapping; got {type(value).__name__}")
        sections[name] = _build_section(cls, value, name, where)
    model = _check_model_section(raw.get("model") or {}, where)
    _take_model_backend(model, sections["train"], raw.get("train") or {}, where)
    config = TrainConfig(model=model, name=str(raw.get("name", "")), description=str(raw.get("description", "")),
                         **sections)
    check_config(config, where)
    return config


def _reject_unknown(values: dict, known: set[str], prefix: str, where: str) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        names = ", ".join(f"{prefix}{k}" for k in unknown)
        raise ValueError(f"{where}: unknown key {names}; known keys{' of ' + prefix[:-1] if prefix else ''}: "
                         f"{', '.join(sorted(known))}")


def _build_section(cls: type, values: dict[str, Any], name: str, where: str):
    """``cls(**values)`` after checking names and types (YAML reads ``3e-4`` as a string: floats are parsed)."""
    hints = typing.get_type_hints(cls)
    _reject_unknown(values, set(hints), f"{name}.", where)
    return cls(**{key: _coerce(value, hints[key], f"{name}.{key}", where) for key, value in values.items()})


def _coerce(value: Any, hint: Any, key: str, where: str) -> Any:
    """``value`` checked against the annotation ``hint`` (int, float, str, bool, list, dict, optional)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    bases = [o for o in options if o is not type(None)]
    if len(bases) > 1:  # e.g. ``bool | str``: the value must be one of them as it is
        if any(isinstance(value, b) for b in bases):
            return value
        raise ValueError(f"{where}: {key} must be {' or '.join(b.__name__ for b in bases)}; got {value!r}")
    base = bases[0]
    origin = typing.get_origin(base) or base
    if origin is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is str and isinstance(value, (list, tuple)) and key == "data.splits":
        return ",".join(map(str, value))
    ok = isinstance(value, origin) and not (origin in (int, float) and isinstance(value, bool))
    if not ok:
        raise ValueError(f"{where}: {key} must be {getattr(origin, '__name__', origin)}; got {value!r}")
    return value


def _check_model_section(model: dict[str, Any], where: str) -> dict[str, Any]:
    """Model keys must be ``LinMemConfig`` arguments (the sub-configs ``attention`` and ``moe`` as mappings of
    their fields, or their older flat names, ``FLAT_FIELDS``); defaults the init std to the recipe's 0.006."""
    if not isinstance(model, dict):
        raise ValueError(f"{where}: model must be a mapping of LinMemConfig fields")
    known = set(inspect.signature(LinMemConfig.__init__).parameters) - MODEL_KEYS_OWNED
    _reject_unknown(model, known | set(FLAT_FIELDS), "model.", where)
    for name, kind in SUB_CONFIGS.items():
        if isinstance(model.get(name), dict):
            _reject_unknown(model[name], {f.name for f in dataclasses.fields(kind)}, f"model.{name}.", where)
    return {"initializer_range": DEFAULT_INIT_STD, "vocab_size": "auto", **model}


def _take_model_backend(model: dict[str, Any], train: TrainSection, train_raw: dict[str, Any], where: str) -> None:
    """A ``model.backend`` becomes ``train.backend``: the op's backend is a choice of the run, not part of the model
    (both given and different is refused)."""
    if "backend" not in model:
        return
    backend = model.pop("backend")
    if "backend" in train_raw and train_raw["backend"] != backend:
        raise ValueError(f"{where}: model.backend {backend!r} and train.backend {train_raw['backend']!r} differ; "
                         f"keep train.backend only")
    train.backend = backend


def check_config(config: TrainConfig, where: str = "config", world_size: int = 1) -> None:
    """Values the trainer cannot run with, as ``ValueError`` naming the key (shapes that depend on the dataset
    are checked when it is opened)."""
    t, o, d = config.train, config.optim, config.data
    for key, value in (("train.steps", t.steps), ("train.batch_size", t.batch_size), ("data.seq_len", d.seq_len),
                       ("train.log_interval", t.log_interval), ("train.keep_checkpoints", t.keep_checkpoints)):
        if value < 1:
            raise ValueError(f"{where}: {key} must be >= 1; got {value}")
    for key, value in (("train.eval_interval", t.eval_interval), ("train.checkpoint_interval",
                       t.checkpoint_interval), ("optim.warmup_steps", o.warmup_steps), ("train.eval_tokens",
                       t.eval_tokens), ("train.eval_recall_samples", t.eval_recall_samples),
                       ("train.loss_chunk_tokens", t.loss_chunk_tokens or 0)):
        if value < 0:
            raise ValueError(f"{where}: {key} must be >= 0; got {value}")
    if d.seq_len < 2:
        raise ValueError(f"{where}: data.seq_len must be >= 2; got {d.seq_len}")
    if not (0 < o.min_lr <= o.lr) or not math.isfinite(o.lr):
        raise ValueError(f"{where}: need 0 < optim.min_lr <= optim.lr; got min_lr {o.min_lr}, lr {o.lr}")
    for key, value in (("optim.weight_decay", o.weight_decay), ("optim.grad_clip", o.grad_clip)):
        if value < 0:
            raise ValueError(f"{where}: {key} must be >= 0; got {value}")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1 and o.eps > 0):
        raise ValueError(f"{where}: need 0 <= optim.beta1, optim.beta2 < 1 and optim.eps > 0")
    if not 0.0 <= d.recall_fraction <= 1.0:
        raise ValueError(f"{where}: data.recall_fraction must be in [0, 1]; got {d.recall_fraction}")
    if not (d.recall_loss_weight > 0 and math.isfinite(d.recall_loss_weight)):
        raise ValueError(f"{where}: data.recall_loss_weight must be a positive number; got {d.recall_loss_weight}")
    if d.recall_fraction > 0 and not d.recall:
        raise ValueError(f"{where}: data.recall_fraction > 0 needs at least one generator in data.recall")
    for key, value, choices in (("train.dtype", t.dtype, DTYPES), ("train.parallel", t.parallel, PARALLEL),
                                ("train.save_dtype", t.save_dtype, ("float32", "bfloat16")),
                                ("train.backend", t.backend, BACKENDS)):
        if value not in choices:
            raise ValueError(f"{where}: {key} must be one of {choices}; got {value!r}")
    try:
        compile_mode(t.compile)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    parse_entries(t.eval_lab_recall, where)
    if t.eval_lab_recall and not t.eval_interval:
        raise ValueError(f"{where}: train.eval_lab_recall is logged at every evaluation, and train.eval_interval 0 "
                         f"means none; set an interval or drop the formats")
    micro_batch_size(config, world_size, where)


def micro_batch_size(config: TrainConfig, world_size: int, where: str = "config") -> tuple[int, int]:
    """``(micro_batch_size, accumulation_steps)`` per process: ``batch_size = micro · accumulation · world``."""
    t = config.train
    if t.micro_batch_size is not None and t.micro_batch_size < 1:
        raise ValueError(f"{where}: train.micro_batch_size must be >= 1 (or left out); got {t.micro_batch_size}")
    micro = t.micro_batch_size or max(1, t.batch_size // world_size)
    if micro < 1 or t.batch_size % (micro * world_size):
        raise ValueError(f"{where}: train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size "
                         f"({micro}) x processes ({world_size})")
    return micro, t.batch_size // (micro * world_size)


def loss_chunk_tokens(config: TrainConfig, micro_batch: int, vocab_size: int) -> int:
    """Tokens per piece of the training loss (0: logits in one piece): ``train.loss_chunk_tokens`` when set, else
    ``LOSS_CHUNK_TOKENS`` if one micro-batch's float32 logits would exceed ``LOSS_CHUNK_AUTO_BYTES``."""
    if config.train.loss_chunk_tokens is not None:
        return config.train.loss_chunk_tokens
    whole = micro_batch * config.data.seq_len * vocab_size * 4
    return LOSS_CHUNK_TOKENS if whole > LOSS_CHUNK_AUTO_BYTES else 0


def build_model_config(config: TrainConfig, data_vocab_size: int, where: str = "config") -> LinMemConfig:
    """The ``LinMemConfig`` of the run, on ``train.backend``; ``vocab_size: auto`` becomes the dataset's vocabulary
    rounded up to 64."""
    model = dict(config.model)
    if model.get("vocab_size") == "auto":
        model["vocab_size"] = -(-data_vocab_size // 64) * 64
    elif not isinstance(model.get("vocab_size"), int) or model["vocab_size"] < data_vocab_size:
        raise ValueError(f"{where}: model.vocab_size ({model.get('vocab_size')}) must be 'auto' or an integer >= the "
                         f"dataset's vocabulary ({data_vocab_size})")
    try:
        return LinMemConfig(**model, backend=config.train.backend)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: model: {e}") from None
