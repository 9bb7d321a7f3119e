"""Needle in a haystack: a key-value sentence inserted into held-out text, asked for at the end.

For a context length L and a depth d in [0, 1], the haystack is L tokens of held-out text (from a random
position), the needle ``" The secret number of NAME is NUMBER."`` is inserted at token ``d·(haystack length)``,
and the prompt ends with ``" The secret number of NAME is"``; the answer is ``" NUMBER"`` (4 digits). A trial
counts when greedy decoding gives every answer token. Chance is about 1 in 9,000.

``niah_trial`` builds one trial from an ``encode`` callable; the eval (``niah_prompt``) and the training recall
generator ``NiahRecall`` (``data.recall: [{name: niah}]``, built by ``linmem.train.data``) both go through it, so
training sequences have exactly the eval's needle, query and answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from linmem.data.randomness import sample_rng
from linmem.data.shards import SplitTokens, TokenShards
from linmem.data.synthetic import FILLER_TOKENS, RecallSample, register_generator
from linmem.data.tokenizer import load_tokenizer
from linmem.eval.loading import EvalModel
from linmem.eval.scoring import score_continuations

NAMES = ("Alice", "Bernard", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
         "Luca", "Mira", "Nils", "Olga", "Pavel")
NIAH_STREAM = 0x41A4


def haystack_tokens(split: SplitTokens, limit: int = 4_000_000) -> np.ndarray:
    """The split's tokens (documents with EOS separators), concatenated, at most ``limit``."""
    parts, size = [], 0
    for shard in split.shards:
        parts.append(np.asarray(shard[: limit - size], dtype=np.int64))
        size += len(parts[-1])
        if size >= limit:
            break
    return np.concatenate(parts)


@dataclass(frozen=True)
class NiahTrial:
    """One trial without the leading end-of-text: ``context`` (haystack ``text`` with the ``needle`` inserted at
    ``cut``, then the ``query``) and the ``answer`` that follows it."""

    name: str
    number: int
    text: list[int]
    cut: int
    needle: list[int]
    query: list[int]
    answer: list[int]

    @property
    def context(self) -> list[int]:
        return self.text[:self.cut] + self.needle + self.text[self.cut:] + self.query


def niah_pieces(encode: Callable[[str], list[int]], name: str, number: int) -> tuple[list[int], list[int], list[int]]:
    """``(needle, query, answer)`` ids: ``" The secret number of NAME is NUMBER."``, ``"\\n The secret number of NAME
    is"``, ``" NUMBER"``."""
    return (encode(f" The secret number of {name} is {number}."), encode(f"\n The secret number of {name} is"),
            encode(f" {number}"))


def niah_trial(encode: Callable[[str], list[int]], hay: np.ndarray, length: int, depth: float,
               rng: np.random.Generator, names: Sequence[str] = NAMES,
               with_answer: bool = False) -> NiahTrial | None:
    """A trial whose context is ``length`` tokens (context and answer, if ``with_answer``), or None if it does not
    fit. Draws from ``rng``, in order: the name, the number, the haystack's start in ``hay``."""
    name, number = names[rng.integers(len(names))], int(rng.integers(1000, 10000))
    needle, query, answer = niah_pieces(encode, name, number)
    filler = length - len(needle) - len(query) - (len(answer) if with_answer else 0)
    if filler < 1 or filler >= len(hay):
        return None
    start = int(rng.integers(0, len(hay) - filler))
    text = hay[start:start + filler].tolist()
    return NiahTrial(name, number, text, int(round(depth * filler)), needle, query, answer)


def niah_prompt(em: EvalModel, hay: np.ndarray, length: int, depth: float,
                rng: np.random.Generator) -> tuple[list[int], list[int]] | None:
    """``(context ids, answer ids)`` of one trial of ``length`` tokens in all, or None if it does not fit."""
    trial = niah_trial(em.encode, hay, length - 1, depth, rng)  # the document start takes the first token
    return None if trial is None else ([em.document_start] + trial.context, trial.answer)


@dataclass(frozen=True)
class NiahRecall:
    """Training recall generator (``linmem.data.synthetic`` protocol) of NIAH trials in the eval's format.

    A sample of ``seq_len`` tokens ends with one trial of ``L`` tokens (haystack from ``hay`` with the needle at a
    uniform depth, the query, the answer), ``L`` uniform in ``[min_length, max_length]`` (None: ``seq_len``; a
    missing ``min_length`` is ``max_length``). A shorter trial is preceded by haystack text and an end-of-text, so
    it always starts after one, as in the eval (the mixer's separator opens a full-length one). The loss mask marks
    the answer tokens only.
    """

    encode: Callable[[str], list[int]]
    hay: np.ndarray
    eos_id: int
    names: tuple[str, ...] = NAMES
    min_length: int | None = None
    max_length: int | None = None
    name: ClassVar[str] = "niah"

    def lengths(self, seq_len: int) -> tuple[int, int]:
        """``(low, high)``: the range of trial lengths in a sample of ``seq_len`` tokens."""
        high = seq_len if self.max_length is None else self.max_length
        low = high if self.min_length is None else self.min_length
        if not 1 <= low <= high <= seq_len:
            raise ValueError(f"niah: min_length {low} and max_length {high} must satisfy 1 <= min_length <= "
                             f"max_length <= {seq_len} (the sequence after the separator)")
        return low, high

    def sample(self, rng: np.random.Generator, seq_len: int) -> RecallSample:
        low, high = self.lengths(seq_len)
        length, depth = int(rng.integers(low, high + 1)), float(rng.random())
        trial = niah_trial(self.encode, self.hay, length, depth, rng, self.names, with_answer=True)
        if trial is None:
            raise ValueError(f"niah: a trial of {length} tokens has no room for the needle, query and answer (raise "
                             f"min_length or data.seq_len), or is not shorter than the haystack ({len(self.hay)} "
                             f"tokens)")
        lead = seq_len - length  # haystack text, then the end-of-text
        start = int(rng.integers(0, max(1, len(self.hay) - lead)))
        prefix = self.hay[start:start + lead - 1].tolist() + [self.eos_id] if lead else []
        if len(prefix) != lead:
            raise ValueError(f"niah: the haystack ({len(self.hay)} tokens) is shorter than the {lead} tokens before "
                             f"a trial of {length}")
        context = prefix + trial.context
        tokens = np.asarray(context + trial.answer, dtype=np.int64)
        mask = np.zeros(len(tokens), dtype=bool)
        mask[len(context):] = True
        return RecallSample(tokens, mask)


NIAH_OPTIONS = ("min_length", "max_length", "names")


def niah_for_dataset(options: dict[str, Any], shards: TokenShards, seq_len: int | None, key: str) -> NiahRecall:
    """``niah`` for training on ``shards``: the eval's trials with this dataset's tokenizer, the haystack the
    training split's first ``FILLER_TOKENS`` tokens.

    Options: ``min_length``, ``max_length`` (trial tokens; default: the whole sequence after the separator,
    ``seq_len - 1``), ``names`` (default the eval's). ``options`` is completed in place with the values used.
    Errors name ``key`` and the option.
    """
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
        return tokenizer.encode(text, add_special_tokens=False)

    if low is not None:  # needs at least: the longest pieces over a sample of numbers, and one haystack token
        needed, longest = max((sum(map(len, niah_pieces(encode, n, number))) + 1, n)
                              for n in names for number in range(1000, 10000, 997))
        if low < needed:
            what = f"{key}.{given[0]} {low}" if given else f"data.seq_len {seq_len}"
            raise ValueError(f"{what} leaves no room for a trial: the needle, query and answer of {longest!r} and one "
                             f"haystack token need {needed} tokens with this tokenizer")
    hay = haystack_tokens(shards.split("train"), FILLER_TOKENS)
    return NiahRecall(encode, hay, shards.eos_id, tuple(names), low, high)


register_generator(NiahRecall.name, NiahRecall, niah_for_dataset)


def niah(em: EvalModel, split: SplitTokens, lengths: Sequence[int] = (256, 512, 1024, 2048),
         depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), samples: int = 20, seed: int = 0,
         batch_size: int = 8) -> dict[str, Any]:
    """Accuracy on the ``lengths`` x ``depths`` grid, ``samples`` trials per cell."""
    hay = haystack_tokens(split)
    grid = []
    for li, length in enumerate(lengths):
        row = []
        for di, depth in enumerate(depths):
            trials = [niah_prompt(em, hay, length, depth, sample_rng(seed, NIAH_STREAM, (li * 100 + di) * 10_000 + j))
                      for j in range(samples)]
            trials = [t for t in trials if t is not None]
            scores = score_continuations(em, trials, batch_size) if trials else []
            row.append(sum(s[1] for s in scores) / len(scores) if scores else None)
        grid.append(row)
    cells = [a for row in grid for a in row if a is not None]
    if not cells:
        raise ValueError(f"no NIAH length in {list(lengths)} fits the held-out split ({len(hay)} tokens)")
    return {"metrics": {"mean_accuracy": sum(cells) / len(cells), "samples_per_cell": samples},
            "grid": {"lengths": list(lengths), "depths": list(depths), "accuracy": grid}}
