"""``linmem params CONFIG``: the parameter count of a training config's model, from a meta-device instantiation.

The model is built on PyTorch's ``meta`` device: every tensor has its shape but no storage, so counting a 1.5B
model needs no memory and no time. The count is split into the embeddings, the output head (0 when tied to the
embeddings), the final norm and, for each kind of block (linear mixer / softmax attention), the parts of one block
(``attn_norm``, the mixer with its projections, ``mlp_norm``, ``mlp``) times the number of such blocks.

``vocab_size: auto`` in a config means the dataset's vocabulary: the one of the dataset folder ``data.dir`` when it
has been built, else ``data.vocab_size`` (what a tokenizer trained by ``linmem data build`` would have), rounded up
to a multiple of 64 as the trainer does. A config without a ``data`` section counts with the default
``data.vocab_size``: the count needs no dataset.

Only argparse and the standard library load with this module; the functions that build a model or read a config
import torch and the models when called, so that ``linmem params --help`` and its argument errors answer at once.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from linmem.models import LinMemConfig
    from linmem.train.config import TrainConfig


@dataclass
class BlockKind:
    """The blocks of one kind: ``name`` (``"rdn"``, ``"attention"``, ...), their ``layers``, the parameters of
    one block per part (``parts``: ``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``) and of the mixer per
    projection (``mixer_parts``: ``q_proj``, ``k_proj``, ...; a module's direct parameters under their own name)."""

    name: str
    layers: list[int]
    parts: dict[str, int]
    mixer_parts: dict[str, int]

    @property
    def per_block(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        return self.per_block * len(self.layers)


@dataclass
class ParameterCount:
    """Where the parameters of a ``LinMemForCausalLM`` are; ``total`` counts a tied weight once."""

    total: int
    embeddings: int
    lm_head: int  # 0 when tied to the embeddings
    final_norm: int
    blocks: list[BlockKind] = field(default_factory=list)
    vocab_size: int = 0
    vocab_source: str = ""

    def to_dict(self) -> dict:
        out = asdict(self)
        for kind, block in zip(out["blocks"], self.blocks):
            kind.update(per_block=block.per_block, total=block.total)
        return out


def unique_numel(module: nn.Module) -> int:
    """Parameters of ``module``, a tensor shared by several submodules (tied weights) counted once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _children_numel(module: nn.Module) -> dict[str, int]:
    """``{child name: parameters}`` of ``module``, its own direct parameters (``A_log``, ...) by their names."""
    parts = {name: p.numel() for name, p in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        count = unique_numel(child)
        if count:
            parts[name] = count
    return parts


def count_model_parameters(config: LinMemConfig) -> ParameterCount:
    """Build ``LinMemForCausalLM(config)`` on the meta device (no memory) and count its parameters by part."""
    import torch

    from linmem.models import LinMemForCausalLM

    with torch.device("meta"):
        model = LinMemForCausalLM(config)
    backbone = model.model
    embeddings = unique_numel(backbone.embeddings)
    tied = model.lm_head.weight is backbone.embeddings.weight
    kinds: dict[str, BlockKind] = {}
    for i, block in enumerate(backbone.layers):
        name = "attention" if i in config.attention.layers else config.mixer
        parts = _children_numel(block)
        if name in kinds:
            if parts != kinds[name].parts:
                raise RuntimeError(f"layer {i}: its {name} block differs in size from layer {kinds[name].layers[0]}")
            kinds[name].layers.append(i)
        else:
            kinds[name] = BlockKind(name, [i], parts, _children_numel(block.attn))
    return ParameterCount(total=unique_numel(model), embeddings=embeddings, lm_head=0 if tied else
                          unique_numel(model.lm_head), final_norm=unique_numel(backbone.norm),
                          blocks=list(kinds.values()), vocab_size=config.vocab_size)


def resolve_vocab_size(config: TrainConfig) -> tuple[int, str]:
    """The dataset vocabulary ``vocab_size: auto`` stands for, and where it comes from (see the module doc)."""
    data = config.data
    index = Path(data.dir) / "index.json" if data.dir else None
    if index is not None and index.is_file():
        return int(json.loads(index.read_text(encoding="utf-8"))["vocab_size"]), f"the dataset {data.dir}"
    missing = "no dataset built yet" if data.dir else "no data.dir"
    return data.vocab_size, f"data.vocab_size ({missing})"


def model_config_of(config: TrainConfig) -> tuple[LinMemConfig, str]:
    """The ``LinMemConfig`` ``config`` trains, without opening its data (``vocab_size: auto`` resolved as the module
    doc says), and where its vocabulary size comes from."""
    from linmem.train.config import build_model_config

    if config.model.get("vocab_size", "auto") == "auto":
        data_vocab, source = resolve_vocab_size(config)
    else:
        data_vocab, source = 1, "model.vocab_size"
    return build_model_config(config, data_vocab), source


def count_config_parameters(config: TrainConfig) -> ParameterCount:
    """The parameter count of the model ``config`` trains (``vocab_size: auto`` resolved as the module doc says)."""
    model_config, source = model_config_of(config)
    count = count_model_parameters(model_config)
    count.vocab_source = source
    return count


def format_count(count: ParameterCount, title: str = "") -> str:
    """A text table: total, embeddings, head, final norm, then each block kind's parts (per block, x blocks)."""
    width = 42

    def row(label: str, per_block: str, blocks: str, total: int) -> str:
        return f"{label:<{width}}{per_block:>14}{blocks:>8}{total:>16,}"

    lines = [title] if title else []
    lines += [f"{'part':<{width}}{'per block':>14}{'blocks':>8}{'total':>16}",
              row(f"embeddings (vocab {count.vocab_size:,})", "", "", count.embeddings),
              row("lm_head" + (" (tied to the embeddings)" if not count.lm_head else ""), "", "", count.lm_head),
              row("final norm", "", "", count.final_norm)]
    for kind in count.blocks:
        n = len(kind.layers)
        lines.append(row(f"{kind.name} blocks (layers {_ranges(kind.layers)})", f"{kind.per_block:,}", f"x{n}",
                         kind.total))
        for part, value in kind.parts.items():
            lines.append(row(f"  {part}", f"{value:,}", f"x{n}", value * n))
            if part == "attn":
                lines += [row(f"    {sub}", f"{v:,}", f"x{n}", v * n) for sub, v in kind.mixer_parts.items()]
    lines.append(row("total", "", "", count.total))
    body = count.total - count.embeddings - count.lm_head
    lines.append(f"= {count.total / 1e6:,.2f}M parameters ({body / 1e6:,.2f}M without the embeddings and the head); "
                 f"vocabulary from {count.vocab_source}")
    return "\n".join(lines)


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    spans, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(spans)


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Print the parameter count of a training config's model (total, embeddings, each part of "
                          "a block), from a meta-device instantiation: no memory, no weights.")
    parser.add_argument("config", type=Path, help="a training YAML (configs/paper/rdn-1.5b.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value (repeatable): --set model.fit_history=false")
    parser.add_argument("--json", action="store_true", help="print the count as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from linmem.train.config import load_config

    config = load_config(args.config, args.overrides)
    count = count_config_parameters(config)
    if args.json:
        print(json.dumps(dict(config=str(args.config), overrides=args.overrides, **count.to_dict()), indent=2))
    else:
        title = f"{args.config}" + "".join(f" --set {o}" for o in args.overrides)
        print(format_count(count, title))
    return 0
