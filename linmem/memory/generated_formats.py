"""What a generated fact format is made of: the words, marks and text stretches the ``kv-filler`` training
generator draws a fresh format from for every sample (``linmem.memory.kv_filler``).

With ``template`` / ``keys`` / ``values`` ``GENERATED``, a sample's wording and words come from the training text's
frequent single-token words (``format_words``) or from every token id (``format_ids``), a generated template ending in
a mark of ``PUNCTUATION`` (``punctuation_tokens``); with template ``TEXT`` its wording is cut from a stretch of the
training text (``text_template_starts``, ``text_template_parts``). None of them is a token of ``HELD_OUT`` in any
case or spacing (``held_out_tokens``), so that a held-out format stays unseen in training.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from linmem.memory.fact_formats import HELD_OUT, TEMPLATES, vocabulary_words

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# A generated template's words (fewest, most): before the key, between key and value, after the value; one mark of
# PUNCTUATION closes the fact. A training query repeats the whole fact with its value under the loss mask.
GENERATED_WORDS = {"before": (1, 4), "middle": (1, 2), "after": (0, 2)}
GENERATED_TEMPLATE_MOST = sum(most for _, most in GENERATED_WORDS.values())  # the longest template's words
PUNCTUATION = (".", ",", ";", ":", "!", "?")
WORD_POOL = 1000  # how many of the training text's most frequent single-token words generated formats draw from
# ``word_pool: ids``: generated parts draw from every token id instead (``format_ids``), subword pieces, marks and
# digits included, so that a model copies whatever token a fact holds rather than the text's frequent words only.
EVERY_ID = "ids"
WHOLE_WORD_SHARE = 0.9  # a pool word ends a word in the training text at least this share of its occurrences


def text_template_starts(filler: np.ndarray, word_starts: np.ndarray, word_continues: np.ndarray,
                        held_out_pieces: Sequence[Sequence[int]]) -> dict[tuple[int, int, int], np.ndarray]:
    """Per template shape ``(a, b, c)`` (tokens before the key, between key and value, after the value less one;
    ``GENERATED_WORDS``), the positions of ``filler`` where a stretch of that shape can be cut: both slots hold a
    word (``word_starts``) that the next token does not continue (``word_continues``), and no token of the
    stretch lies in an occurrence of a held-out template's piece."""
    covered = np.zeros(len(filler) + 1, dtype=np.int64)
    for piece in held_out_pieces:
        if 0 < len(piece) <= len(filler):
            windows = np.lib.stride_tricks.sliding_window_view(filler, len(piece))
            for start in np.flatnonzero((windows == np.asarray(piece)).all(axis=1)):
                covered[start:start + len(piece)] = 1
    covered_before = np.concatenate([[0], np.cumsum(covered[:-1])])  # covered tokens before each position
    slot = np.zeros(len(filler), dtype=bool)
    slot[:-1] = word_starts[filler[:-1]] & ~word_continues[filler[1:]]
    starts = {}
    (a_low, a_high), (b_low, b_high), (c_low, c_high) = GENERATED_WORDS.values()
    for a in range(a_low, a_high + 1):
        for b in range(b_low, b_high + 1):
            for c in range(c_low, c_high + 1):
                size = a + b + c + 3
                p = np.arange(max(0, len(filler) - size + 1))
                ok = slot[p + a] & slot[p + a + 1 + b] & (covered_before[p + size] == covered_before[p])
                starts[(a, b, c)] = np.flatnonzero(ok)
    return starts


def held_out_template_pieces() -> list[str]:
    """The pieces (before, middle, after) of every ``HELD_OUT`` template."""
    return [piece for name in HELD_OUT["template"] for piece in TEMPLATES[name]]


def token_texts(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int]) -> list[str]:
    """The text of each token id of ``ids`` decoded alone (special tokens drop to ``""``), in one call of the
    tokenizer's engine: a vocabulary-wide scan decodes every id."""
    return tokenizer.backend_tokenizer.decode_batch([[int(i)] for i in ids], skip_special_tokens=True)


def word_continuations(tokenizer: PreTrainedTokenizerFast, size: int) -> np.ndarray:
    """``[size]`` bool per token id: its text begins with a letter or a digit, so it continues the word before it."""
    return np.asarray([text[:1].isalnum() for text in token_texts(tokenizer, range(size))], dtype=bool)


def text_template_parts(tokenizer: PreTrainedTokenizerFast, size: int) -> dict[str, Any]:
    """``KeyValueFiller``'s text-template options for token ids below ``size``: the held-out templates' pieces as
    token runs, and per id whether it begins a word (a space and a letter) and whether it continues one."""
    return dict(text_template=True,
                held_out_pieces=[tokenizer.encode(piece, add_special_tokens=False)
                                 for piece in held_out_template_pieces()],
                word_starts=np.asarray([text[:1] == " " and text[1:2].isalpha()
                                        for text in token_texts(tokenizer, range(size))], dtype=bool),
                word_continues=word_continuations(tokenizer, size))


def held_out_tokens(tokenizer: PreTrainedTokenizerFast) -> tuple[set[int], set[str]]:
    """The token ids of every ``HELD_OUT`` template piece and vocabulary word (after a space), and the lower-case
    words they spell (with each such token's own text), so that training can leave out every case of them."""
    texts = held_out_template_pieces()
    texts += [" " + word for kind in ("keys", "values") for name in HELD_OUT[kind]
              for word in vocabulary_words(name, kind)]
    ids = {i for text in texts for i in tokenizer.encode(text, add_special_tokens=False)}
    words = {word.lower() for text in texts for word in re.findall(r"[A-Za-z]+", text)}
    words |= {text.strip().lower() for text in token_texts(tokenizer, sorted(ids))}
    return ids, words


def word_endings(tokenizer: PreTrainedTokenizerFast, stream: np.ndarray) -> np.ndarray:
    """Per token id, the share of its occurrences in ``stream`` (all but the last) that end a word: the next token
    does not continue it with a letter or a digit. ``[max id + 1]``, NaN for ids that do not occur."""
    continues = word_continuations(tokenizer, int(stream.max()) + 1)
    current, following = stream[:-1], stream[1:]
    seen = np.bincount(current, minlength=len(continues)).astype(np.float64)
    ended = np.bincount(current, weights=~continues[following], minlength=len(continues))
    with np.errstate(invalid="ignore", divide="ignore"):
        return ended / seen


def format_words(tokenizer: PreTrainedTokenizerFast, filler: Sequence[int], size: int = WORD_POOL) -> list[int]:
    """The ``size`` most frequent tokens of ``filler`` (ties: the lower id first) that are one whole alphabetic
    ASCII word after a space (`` the``, `` King``), encode back to that one token and end a word in ``filler`` at
    least ``WHOLE_WORD_SHARE`` of the times they occur (so that a word's first piece, `` mon`` of `` money``, is
    not taken for a word), leaving out every token and word of ``HELD_OUT`` in any case (``held_out_tokens``): the
    words generated formats draw from."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"word_pool must be an integer >= 1 (words generated formats draw from) or {EVERY_ID!r} "
                         f"(every token id); got {size!r}")
    banned_ids, banned_words = held_out_tokens(tokenizer)
    stream = np.asarray(filler, dtype=np.int64)
    counts = np.bincount(stream)
    ends = word_endings(tokenizer, stream)
    texts = token_texts(tokenizer, range(len(counts)))
    words: list[int] = []
    for token in (int(t) for t in np.argsort(-counts, kind="stable")):
        if counts[token] == 0 or len(words) == size:
            break
        text = texts[token]
        word = text[1:]
        if (token in banned_ids or not text.startswith(" ") or not (word.isascii() and word.isalpha())
                or word.lower() in banned_words or not ends[token] >= WHOLE_WORD_SHARE
                or tokenizer.encode(text, add_special_tokens=False) != [token]):
            continue
        words.append(token)
    return words


def format_ids(tokenizer: PreTrainedTokenizerFast, vocab_size: int, exclude: Sequence[int] = ()) -> list[int]:
    """Every token id below ``vocab_size`` but ``exclude`` (the end-of-text token, say) and ``HELD_OUT``'s: the ids
    of its pieces and words, and any token that spells a held-out word in another case or spacing (`` North``,
    ``north``): the pool of ``word_pool: ids``."""
    banned_ids, banned_words = held_out_tokens(tokenizer)
    banned_ids |= {int(t) for t in exclude}
    return [i for i, text in enumerate(token_texts(tokenizer, range(vocab_size)))
            if i not in banned_ids and text.strip().lower() not in banned_words]


def punctuation_tokens(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids of the marks of ``PUNCTUATION`` that are one token and no token of ``HELD_OUT`` (its templates end
    in ``"."``, so generated facts do not)."""
    banned, _ = held_out_tokens(tokenizer)
    marks = [tokenizer.encode(mark, add_special_tokens=False) for mark in PUNCTUATION]
    return list(dict.fromkeys(ids[0] for ids in marks if len(ids) == 1 and ids[0] not in banned))

