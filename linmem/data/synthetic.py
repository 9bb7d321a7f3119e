"""Synthetic recall sequences: MQAR, and the protocol + registry that other recall generators plug into.

A recall generator turns a NumPy generator and a length into a ``RecallSample``: token ids and a loss mask that is
True only where a token is an answer the model must recall from earlier in the sequence. ``mixing.RecallMix``
interleaves such samples into the natural-text training stream. A new generator (e.g. the memory lab's key-value
bindings in natural filler) is any object with a ``name`` and a ``sample(rng, seq_len)`` method, registered with
``register_generator("name", factory)`` when its module is imported; ``make_generator("name", **options)`` builds it.
A generator that needs the training dataset (its tokenizer, its text) also registers ``for_dataset``, a builder
``(options, dataset, seq_len, key) -> generator``; ``generator_for_dataset`` is what training calls. Generators
defined above ``data`` (the memory lab's ``kv-filler``, the NIAH eval's ``niah``) register when their modules are
imported, which ``linmem.train.data`` does; this module names no package above its own.

**MQAR** (multi-query associative recall, Arora et al. 2023, "Zoology"): the sequence opens with ``N`` key-value
pairs ``k_1 v_1 ... k_N v_N``, then every key is asked once, at a position chosen by a power law over the distance
from the end of the bindings, and followed by its value::

    k_1 v_1 k_2 v_2 | f f k_2 v_2 f f f f k_1 v_1 f f
                            ^^^ answer          ^^^ answer       (f: filler, never a key of this sequence)

Keys come from the lower half of ``vocab_range``, values from the upper half (each distinct within a sequence);
filler tokens from the whole range except this sequence's keys, so each query has exactly one binding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from linmem.data.shards import TokenShards


@dataclass(frozen=True)
class RecallSample:
    """``tokens [T]`` int64 ids and ``loss_mask [T]`` bool: True where ``tokens[t]`` is an answer (predicted from
    ``tokens[:t]``)."""

    tokens: np.ndarray
    loss_mask: np.ndarray


@runtime_checkable
class RecallGenerator(Protocol):
    """Makes recall sequences of a requested length; all randomness from ``rng``."""

    name: str

    def sample(self, rng: np.random.Generator, seq_len: int) -> RecallSample: ...


GENERATORS: dict[str, Callable[..., RecallGenerator]] = {}
# (options, dataset, seq_len, key) -> generator; completes ``options`` in place with the values used
DatasetBuilder = Callable[[dict[str, Any], TokenShards, "int | None", str], RecallGenerator]
DATASET_BUILDERS: dict[str, DatasetBuilder] = {}
FILLER_TOKENS = 1_000_000  # dataset-built generators take filler text from the training split's first tokens


def register_generator(name: str, factory: Callable[..., RecallGenerator],
                       for_dataset: DatasetBuilder | None = None) -> Callable[..., RecallGenerator]:
    """Make ``make_generator(name, **options)`` call ``factory(**options)`` (and ``generator_for_dataset`` call
    ``for_dataset`` when given); returns ``factory``."""
    if name in GENERATORS and GENERATORS[name] is not factory:
        raise ValueError(f"a recall generator named {name!r} is already registered ({GENERATORS[name]!r})")
    GENERATORS[name] = factory
    if for_dataset is not None:
        DATASET_BUILDERS[name] = for_dataset
    return factory


def known_generators() -> list[str]:
    return sorted(GENERATORS)


def _registered(name: str) -> bool:
    return name in GENERATORS


def make_generator(name: str, **options) -> RecallGenerator:
    """The registered generator ``name`` built with ``options``."""
    if not _registered(name):
        raise ValueError(f"unknown recall generator {name!r}; registered: {', '.join(known_generators())} (a "
                         f"generator registers itself when its module is imported)")
    return GENERATORS[name](**options)


def generator_for_dataset(name: str, options: dict[str, Any], dataset: TokenShards, seq_len: int | None = None,
                          key: str = "recall") -> RecallGenerator:
    """Generator ``name`` for training on ``dataset`` (sequences of ``seq_len`` tokens, if known): its registered
    ``for_dataset`` builder, else ``make_generator(name, **options)``. ``options`` is completed in place with the
    defaults used (recorded with the model); errors name ``key``."""
    if not _registered(name):
        raise ValueError(f"{key}.name {name!r} is not a registered recall generator (known: "
                         f"{', '.join(known_generators())}); set {key}.module to the module that registers it")
    builder = DATASET_BUILDERS.get(name)
    return builder(options, dataset, seq_len, key) if builder else make_generator(name, **options)


def check_sample(sample: RecallSample, seq_len: int, vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` unless ``sample`` has ``[seq_len]`` int tokens (below ``vocab_size``) and a bool mask."""
    tokens, mask = np.asarray(sample.tokens), np.asarray(sample.loss_mask)
    if tokens.shape != (seq_len,) or mask.shape != (seq_len,):
        raise ValueError(f"a recall sample must have tokens and loss_mask of shape [{seq_len}]; got "
                         f"{list(tokens.shape)} and {list(mask.shape)}")
    if not np.issubdtype(tokens.dtype, np.integer) or mask.dtype != np.bool_:
        raise ValueError(f"tokens must be integers and loss_mask bool; got {tokens.dtype} and {mask.dtype}")
    if tokens.size and (tokens.min() < 0 or (vocab_size is not None and tokens.max() >= vocab_size)):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got [{tokens.min()}, {tokens.max()}]")


def power_law(size: int, power_a: float) -> np.ndarray:
    """``p [size]`` with ``p_j`` proportional to ``(j + 1) ** (power_a - 1)``: 1 is uniform, small values favour
    small ``j``."""
    weights = np.arange(1, size + 1, dtype=np.float64) ** (power_a - 1.0)
    return weights / weights.sum()


def _draw_excluding(rng: np.random.Generator, low: int, high: int, excluded: np.ndarray, size: int) -> np.ndarray:
    """``size`` uniform ids from ``[low, high)`` minus the distinct ids ``excluded``."""
    gaps = np.sort(excluded - low) - np.arange(len(excluded))  # how many allowed ids precede each excluded one
    draws = rng.integers(0, high - low - len(excluded), size=size)
    return draws + np.searchsorted(gaps, draws, side="right") + low


@dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall over token ids ``vocab_range = (low, high)``.

    ``num_kv_pairs`` bindings, each queried once; ``power_a`` shapes the query positions (see ``power_law``;
    Zoology's default 0.01 puts most queries soon after the bindings). Needs ``seq_len >= 4 * num_kv_pairs``.
    """

    vocab_range: tuple[int, int]
    num_kv_pairs: int = 8
    power_a: float = 0.01
    name: ClassVar[str] = "mqar"

    def __post_init__(self) -> None:
        low, high = self.vocab_range
        if not 0 <= low < high:
            raise ValueError(f"vocab_range must be (low, high) with 0 <= low < high; got {self.vocab_range}")
        if self.num_kv_pairs < 1 or (high - low) // 2 < self.num_kv_pairs:
            raise ValueError(f"num_kv_pairs must be in [1, {(high - low) // 2}] (half of vocab_range {self.vocab_range}"
                             f" holds the keys, half the values); got {self.num_kv_pairs}")
        if self.power_a <= 0:
            raise ValueError(f"power_a must be > 0; got {self.power_a}")

    def sample(self, rng: np.random.Generator, seq_len: int) -> RecallSample:
        """One sequence ``[seq_len]``; the loss mask marks the ``num_kv_pairs`` answers."""
        n, (low, high) = self.num_kv_pairs, self.vocab_range
        slots = (seq_len - 2 * n) // 2
        if slots < n:
            raise ValueError(f"MQAR with {n} pairs needs seq_len >= {4 * n}; got {seq_len}")
        middle = low + (high - low) // 2
        keys = rng.choice(np.arange(low, middle), size=n, replace=False)
        values = rng.choice(np.arange(middle, high), size=n, replace=False)
        tokens = _draw_excluding(rng, low, high, keys, seq_len)
        tokens[0:2 * n:2], tokens[1:2 * n:2] = keys, values
        asked = 2 * n + 2 * rng.choice(slots, size=n, replace=False, p=power_law(slots, self.power_a))
        order = rng.permutation(n)
        tokens[asked], tokens[asked + 1] = keys[order], values[order]
        loss_mask = np.zeros(seq_len, dtype=bool)
        loss_mask[asked + 1] = True
        return RecallSample(tokens.astype(np.int64), loss_mask)


def mqar_for_dataset(options: dict[str, Any], dataset: TokenShards, seq_len: int | None, key: str) -> MQAR:
    """MQAR over ``dataset``'s ids: ``vocab_range`` defaults to every id above the end-of-text id (or below it, if it
    is the last) and must leave it out."""
    vocab_size, eos_id = dataset.vocab_size, dataset.eos_id
    default = [eos_id + 1, vocab_size] if eos_id + 1 < vocab_size else [0, eos_id]
    low, high = options.get("vocab_range", default)
    if not (0 <= low < high <= vocab_size) or low <= eos_id < high:
        raise ValueError(f"{key}.vocab_range {[low, high]} must lie in [0, {vocab_size}) and leave out the "
                         f"end-of-text id {eos_id}")
    options["vocab_range"] = (low, high)
    return MQAR(**options)


register_generator(MQAR.name, MQAR, mqar_for_dataset)
