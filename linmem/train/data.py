"""The training stream of a config: the dataset folder (built first if asked), text windows, recall mixing.

Every batch is a pure function of ``(seed, step, rank, world_size)`` (``TokenWindows`` / ``RecallMix``), so the
data position of a run is just its step, and a run's global batch does not depend on how many processes share it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from linmem.data.build import BuildOptions, build_dataset
from linmem.data.builtin import open_source
from linmem.data.mixing import RecallMix
from linmem.data.randomness import sample_indices
from linmem.data.shards import INDEX_NAME, TokenShards
from linmem.data.splits import SplitFractions
from linmem.data.synthetic import RecallGenerator, generator_for_dataset
from linmem.data.windows import TokenWindows, sequential_windows
from linmem.eval import niah as _niah_generator  # noqa: F401 (registers the "niah" recall generator)
from linmem.memory import kv_filler as _kv_filler_generator  # noqa: F401 (registers "kv-filler")
from linmem.train.config import DataSection
from linmem.train.distributed import Distributed, barrier, broadcast_object

RECALL_EVAL_SEED_OFFSET = 1_000_003  # held-out recall samples: another seed than training's


@dataclass
class TrainData:
    """The opened dataset and the streams the trainer draws from."""

    folder: Path
    shards: TokenShards
    stream: TokenWindows | RecallMix
    recall: RecallMix | None  # synthetic-only stream for held-out recall accuracy (None without generators)
    generator_specs: list[dict[str, Any]]  # resolved options of every generator (recorded with the model)

    @property
    def vocab_size(self) -> int:
        return self.shards.vocab_size

    def batch(self, step: int, micro: int, accumulation: int, micro_batch_size: int, rank: int,
              world_size: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``micro`` of update ``step``: ``input_ids, labels [micro_batch_size, T]``, ``synthetic [B]``.

        Update ``s`` covers global samples ``[s·G, (s+1)·G)`` with ``G = micro_batch_size · accumulation ·
        world_size``, whatever the split into processes and micro-batches.
        """
        return self.stream.batch(step * accumulation + micro, micro_batch_size, rank, world_size)


def ensure_dataset(section: DataSection, state: Distributed, where: str = "config") -> Path:
    """The dataset folder of ``section``: opened as is, or built by rank 0 from ``data.sources`` first (saying
    where, since a relative ``data.dir`` lands in the working directory)."""
    if not section.dir:
        raise ValueError(f"{where}: data.dir is required: the dataset folder to read, or to build from "
                         "data.sources")
    folder = Path(section.dir)
    if (folder / INDEX_NAME).is_file():
        return folder
    if not section.sources:
        raise FileNotFoundError(f"{where}: data.dir {str(folder)!r} holds no dataset ({INDEX_NAME} missing) and "
                                f"data.sources is empty: build one with `linmem data build` or list data.sources")
    error = None
    if state.is_main:
        print(f"data.dir {str(folder)!r} holds no dataset: building it from data.sources "
              f"({', '.join(section.sources)}) in {folder.resolve()}", flush=True)
        try:
            sources = [open_source(spec) for spec in section.sources]
            options = BuildOptions(tokenizer=section.tokenizer, vocab_size=section.vocab_size,
                                   fractions=SplitFractions.parse(section.splits), progress=False)
            build_dataset(sources, folder, options, source_specs=section.sources)
        except (ValueError, FileNotFoundError) as e:
            error = f"{where}: building data.dir {str(folder)!r} from data.sources failed: {e}"
    error = broadcast_object(error, state)
    barrier(state)
    if error:
        raise ValueError(error)
    return folder


def resolve_generator(spec: dict[str, Any], index: int, shards: TokenShards, where: str,
                      seq_len: int | None = None) -> tuple[RecallGenerator, float, dict[str, Any]]:
    """``(generator, weight, resolved spec)`` of ``data.recall[index]`` for sequences of ``seq_len`` tokens (if
    known), built by the generator's registered ``for_dataset`` builder (``linmem.data.synthetic``)."""
    key = f"data.recall[{index}]"
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"{where}: {key} must be a mapping with a 'name' (e.g. {{name: mqar}})")
    options = dict(spec)
    name, weight, module = options.pop("name"), float(options.pop("weight", 1.0)), options.pop("module", None)
    try:
        if module:  # a module the user names that registers further generators
            importlib.import_module(module)
        generator = generator_for_dataset(name, options, shards, seq_len, key)
    except (TypeError, ValueError, ImportError) as e:
        raise ValueError(f"{where}: {str(e) if str(e).startswith(key) else f'{key}: {e}'}") from None
    resolved = {"name": name, "weight": weight, **({"module": module} if module else {}),
                **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}
    return generator, weight, resolved


def open_train_data(section: DataSection, seed: int, state: Distributed, where: str = "config") -> TrainData:
    """Open (or build) the dataset and make the training stream; shape errors name the config key."""
    folder = ensure_dataset(section, state, where)
    shards = TokenShards(folder)
    if "train" not in shards.splits:
        raise ValueError(f"{where}: data.dir {str(folder)!r} has no train split")
    try:
        windows = TokenWindows(shards.split("train"), section.seq_len, seed)
    except ValueError as e:
        raise ValueError(f"{where}: data.seq_len: {e}") from None
    resolved = [resolve_generator(spec, i, shards, where, section.seq_len)
                for i, spec in enumerate(section.recall)]
    generators, weights, specs = [r[0] for r in resolved], [r[1] for r in resolved], [r[2] for r in resolved]
    stream: TokenWindows | RecallMix = windows
    recall = None
    if generators:
        stream = RecallMix(windows, generators, section.recall_fraction, seed, weights)
        recall = RecallMix(windows, generators, 1.0, seed + RECALL_EVAL_SEED_OFFSET, weights)
        try:  # a generator that cannot fill seq_len fails now, not at step 1,000
            recall.batch(0, 2)
        except ValueError as e:
            raise ValueError(f"{where}: data.recall with data.seq_len {section.seq_len}: {e}") from None
    return TrainData(folder, shards, stream, recall, specs)


def eval_windows(shards: TokenShards, split: str, seq_len: int, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens // seq_len`` non-overlapping windows ``[N, seq_len]`` of ``split`` (fixed for a
    run); empty ``[0, seq_len]`` if the split is missing or shorter than a window."""
    count = max_tokens // seq_len
    if split not in shards.splits or count == 0:
        return torch.zeros(0, seq_len, dtype=torch.long)
    rows = []
    for window in sequential_windows(shards.split(split), seq_len):
        if len(rows) == count:
            break
        rows.append(window)
    return torch.stack(rows) if rows else torch.zeros(0, seq_len, dtype=torch.long)


def recall_eval_batch(recall: RecallMix, samples: int) -> dict[str, torch.Tensor]:
    """Held-out synthetic recall samples ``0 .. samples-1`` (another seed than training)."""
    return recall.samples(sample_indices(0, samples))

