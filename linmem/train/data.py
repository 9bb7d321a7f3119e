"""The training stream of a config: the dataset folder (built first if asked), text windows, recall mixing.

Every batch is a pure function of ``(seed, step, rank, world_size)`` (``TokenWindows`` / ``RecallMix``), so the
data position of a run is just its step, and a run's global batch does not depend on how many processes share it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from linmem.data.build import BuildOptions, build_dataset
from linmem.data.mixing import RecallMix
from linmem.data.randomness import sample_indices
from linmem.data.shards import INDEX_NAME, TokenShards
from linmem.data.sources import open_source
from linmem.data.splits import SplitFractions
from linmem.data.synthetic import GENERATORS, RecallGenerator, make_generator
from linmem.data.tokenizer import load_tokenizer
from linmem.data.windows import TokenWindows, sequential_windows
from linmem.train.config import DataSection
from linmem.train.distributed import Distributed, barrier, broadcast_object

RECALL_EVAL_SEED_OFFSET = 1_000_003  # held-out recall samples: another seed than training's
KV_FILLER = "kv-filler"  # the memory lab's generator, built here from the dataset's tokenizer and text
KV_FILLER_DEFAULTS = {"template": "code", "values": "colors", "keys": "names", "num_bindings": 4, "repeats": 2}
KV_FILLER_TOKENS = 1_000_000  # filler text: the first tokens of the training split
NIAH = "niah"  # the NIAH eval's trials (linmem.eval.niah), haystack from the training split's first tokens
NIAH_OPTIONS = ("min_length", "max_length", "names")


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
    """The dataset folder of ``section``: opened as is, or built by rank 0 from ``data.sources`` first."""
    folder = Path(section.dir) if section.dir else None
    if folder is not None and (folder / INDEX_NAME).is_file():
        return folder
    if not section.sources:
        raise FileNotFoundError(f"{where}: data.dir {str(folder)!r} holds no dataset ({INDEX_NAME} missing) and "
                                f"data.sources is empty: build one with `linmem data build` or list data.sources")
    error = None
    if state.is_main:
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
    known). MQAR's ``vocab_range`` defaults to every id above the end-of-text id (or below it, if it is the last);
    ``kv-filler`` is the memory lab's generator, ``niah`` the NIAH eval's trials."""
    key = f"data.recall[{index}]"
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"{where}: {key} must be a mapping with a 'name' (e.g. {{name: mqar}})")
    options = dict(spec)
    name, weight, module = options.pop("name"), float(options.pop("weight", 1.0)), options.pop("module", None)
    if module:
        importlib.import_module(module)
    if name == "mqar":
        options["vocab_range"] = _mqar_range(options, shards, key, where)
    try:
        if name == KV_FILLER:
            generator = kv_filler_generator(options, shards)
        elif name == NIAH:
            generator = niah_generator(options, shards, key, seq_len)
        elif name not in GENERATORS:
            raise ValueError(f"{key}.name {name!r} is not a registered recall generator (known: "
                             f"{', '.join(sorted({*GENERATORS, KV_FILLER, NIAH}))}); set {key}.module to the module "
                             f"that registers it")
        else:
            generator = make_generator(name, **options)
    except (TypeError, ValueError, ImportError) as e:
        raise ValueError(f"{where}: {str(e) if str(e).startswith(key) else f'{key}: {e}'}") from None
    resolved = {"name": name, "weight": weight, **({"module": module} if module else {}),
                **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}
    return generator, weight, resolved


def _mqar_range(options: dict[str, Any], shards: TokenShards, key: str, where: str) -> tuple[int, int]:
    vocab_size, eos_id = shards.vocab_size, shards.eos_id
    default = [eos_id + 1, vocab_size] if eos_id + 1 < vocab_size else [0, eos_id]
    low, high = options.get("vocab_range", default)
    if not (0 <= low < high <= vocab_size) or low <= eos_id < high:
        raise ValueError(f"{where}: {key}.vocab_range {[low, high]} must lie in [0, {vocab_size}) and leave out the "
                         f"end-of-text id {eos_id}")
    return (low, high)


def kv_filler_generator(options: dict[str, Any], shards: TokenShards) -> RecallGenerator:
    """The memory lab's ``kv-filler`` generator (``linmem.memory.tasks.KeyValueFiller``): its key-value facts
    and queries with this dataset's tokenizer, between stretches of the training split's text.

    Options: ``template``, ``values``, ``keys`` (the lab's ``TaskSpec`` vocabularies), ``num_bindings``,
    ``repeats``. ``options`` is completed in place with the defaults used, so the model records them.
    """
    from linmem.memory.tasks import KeyValueFiller, TaskBuilder, TaskSpec

    for name, default in KV_FILLER_DEFAULTS.items():
        options.setdefault(name, default)
    spec = {k: options[k] for k in ("template", "values", "keys")}
    builder = TaskBuilder(load_tokenizer(shards.folder), TaskSpec(num_bindings=options["num_bindings"], **spec))
    filler = np.concatenate([np.asarray(s[:KV_FILLER_TOKENS], dtype=np.int64) for s in shards.split("train").shards])
    generator_options = {k: v for k, v in options.items() if k not in spec}
    return KeyValueFiller.from_builder(builder, filler[:KV_FILLER_TOKENS], **generator_options)


def niah_generator(options: dict[str, Any], shards: TokenShards, key: str,
                   seq_len: int | None = None) -> RecallGenerator:
    """The ``niah`` generator (``linmem.eval.niah.NiahRecall``): the NIAH eval's trials with this dataset's
    tokenizer, the haystack the training split's first ``KV_FILLER_TOKENS`` tokens.

    Options: ``min_length``, ``max_length`` (trial tokens; default: the whole sequence after the separator,
    ``seq_len - 1``), ``names`` (default the eval's). ``options`` is completed in place with the values used.
    Errors name ``key`` and the option.
    """
    from linmem.eval.niah import NAMES, NiahRecall, haystack_tokens, niah_pieces

    given = [k for k in ("min_length", "max_length") if options.get(k) is not None]
    unknown = sorted(set(options) - set(NIAH_OPTIONS))
    if unknown:
        raise ValueError(f"{key}: unknown option(s) {', '.join(unknown)} for niah (known: {', '.join(NIAH_OPTIONS)})")
    room = None if seq_len is None else seq_len - 1  # the mixer's separator takes the first token
    for option in ("min_length", "max_length"):
        value = options.get(option)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}.{option} must be a positive integer (trial tokens); got {value!r}")
        if value is not None and room is not None and value > room:
            raise ValueError(f"{key}.{option} {value} is longer than a sequence after its separator (data.seq_len "
                             f"{seq_len} - 1 = {room})")
    if options.get("max_length") is None:
        options["max_length"] = room
    if options.get("min_length") is None:
        options["min_length"] = options["max_length"]
    low, high = options["min_length"], options["max_length"]
    if low is not None and high is not None and low > high:
        raise ValueError(f"{key}.min_length {low} is above {key}.max_length {high}")
    names = options.setdefault("names", list(NAMES))
    if (not isinstance(names, (list, tuple)) or not names
            or not all(isinstance(n, str) and n.strip() and n == n.strip() for n in names)):
        raise ValueError(f"{key}.names must be a non-empty list of names (strings without surrounding spaces); "
                         f"got {names!r}")
    options["names"] = list(names)
    tokenizer = load_tokenizer(shards.folder)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    if low is not None:  # needs at least: the longest pieces over a sample of numbers, and one haystack token
        needed, longest = max((sum(map(len, niah_pieces(encode, n, number))) + 1, n)
                              for n in names for number in range(1000, 10000, 997))
        if low < needed:
            what = f"{key}.{given[0]} {low}" if given else f"data.seq_len {seq_len}"
            raise ValueError(f"{what} leaves no room for a trial: the needle, query and answer of {longest!r} and one "
                             f"haystack token need {needed} tokens with this tokenizer")
    hay = haystack_tokens(shards.split("train"), KV_FILLER_TOKENS)
    return NiahRecall(encode, hay, shards.eos_id, tuple(names), low, high)


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

