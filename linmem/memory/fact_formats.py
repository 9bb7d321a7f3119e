"""The format of a key-value fact: its wording (``Template``) and the vocabularies of its keys and values.

A format is named (``TEMPLATES``, ``KEY_WORDS``, ``VALUE_WORDS``) or a user's own (``load_template``,
``load_vocabulary``: a file or a text); ``template_tokens`` and ``vocabulary_tokens`` give its token ids under a
tokenizer, where every key and value must be one token. ``HELD_OUT`` names the templates and vocabularies no
training configuration uses. ``GENERATED`` and ``TEXT`` are choices of the training generator only (a fresh format
for every sample, ``linmem.memory.kv_filler``); a task that measures recall refuses them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

KEY_WORDS = {
    "names": "Alice Bob Carol David Emma Frank Grace Henry Jack Kate Laura Mark Nancy Oliver Paul Peter Rachel "
             "Sarah Thomas Victor Anna John James Mary Robert Linda Michael Susan William Lucy George Edward Helen "
             "Charles Richard Martin Simon Arthur Harry Alice Philip Henry Hugh Walter Roger Ralph",
    "letters": "A B C D E F G H J K L M N P Q R S T U V W X Y Z",
    "objects": "door house table chair book letter ring sword crown horse ship tree river field stone bell cup "
               "gate wall bed coat hat key lamp rose glass bread wine tower garden window mountain paper box fire",
    "roles": "king queen lord lady duke knight soldier captain judge priest servant master father mother brother "
             "sister son daughter friend prince bishop merchant",
}
VALUE_WORDS = {
    "colors": "red blue green yellow black white brown pink purple orange gray gold silver",
    "cities": "Paris London Rome Berlin Madrid Vienna Athens Dublin Lisbon Prague Oslo Cairo Tokyo Boston York",
    "animals": "cat dog horse cow lion bear wolf fox deer bird fish sheep goat mouse eagle",
    "numbers": "one two three four five six seven eight nine ten eleven twelve twenty hundred",
    "shapes": "circle square line cross star ring box ball point cube",
    "directions": "north south east west up down left right inside outside",
    "materials": "iron wood bread wine water stone paper glass salt steel copper cotton wool",
}
# (fact before key, between key and value, after value); the query is the fact cut after the middle piece
TEMPLATES = {
    "code": (" The code of", " is", "."),
    "lives": (" Remember that", " lives in", "."),
    "colon": (" Note,", ":", ";"),
    "likes": (" We know that", " likes the", " one."),
    "went": (" Later that day the", " went", " again."),
    "keeps": (" It is said that the", " keeps the", " safe."),
}
# Templates and vocabularies no training configuration uses (the zoo trained on "code", "names", "colors"): a
# model's recall on them measures memory of facts in a format it never saw (tests/test_memory_analyses.py checks
# configs/ against this list).
HELD_OUT = {"template": ("went", "keeps"), "keys": ("roles",), "values": ("directions", "materials")}
# ``template`` / ``keys`` / ``values`` of the training generator ``kv-filler`` only: a fresh template or vocabulary
# for every sample, drawn from frequent words of the training text (``KeyValueFiller``). The lab and the eval
# measure recall in one fixed format, so they refuse it.
GENERATED = "generated"
TEXT = "text"  # template only: every training sample cuts its wording from a stretch of the training text
FORMAT_PARTS = ("template", "keys", "values")


@dataclass(frozen=True)
class Template:
    """A fact's wording: ``before`` key ``middle`` value ``after``; the query is the fact cut after ``middle``.
    ``name`` labels it in results (a file's path for a user's own)."""

    name: str
    before: str
    middle: str
    after: str

    def __post_init__(self) -> None:
        if not self.middle.strip():
            raise ValueError(f"rule 'query template': template {self.name!r} needs text between {{key}} and "
                             f"{{value}} (the query ends there); got {self.middle!r}")

    @property
    def pieces(self) -> tuple[str, str, str]:
        return self.before, self.middle, self.after

    @classmethod
    def parse(cls, text: str, name: str) -> Template:
        """A template from one line holding ``{key}`` then ``{value}`` once each, e.g. ``"The code of {key} is
        {value}."``. Keys and values are tokenized with a leading space, so the space before a placeholder is
        theirs; the fact starts with a space, as in ``TEMPLATES``."""
        line = " ".join(text.split())
        if line.count("{key}") != 1 or line.count("{value}") != 1 or line.index("{key}") > line.index("{value}"):
            raise ValueError(f"template {name!r} must hold {{key}} and then {{value}}, once each; got {text!r}")
        before, rest = line.split("{key}")
        middle, after = rest.split("{value}")
        return cls(name, " " + before.strip() if before.strip() else "", middle.rstrip(), after.rstrip())


@dataclass(frozen=True)
class Vocabulary:
    """Words for the keys or the values of a task (each must tokenize to one token, after a leading space)."""

    name: str
    words: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", tuple(self.words))
        if not self.words:
            raise ValueError(f"vocabulary {self.name!r} holds no words")


def _read_lines(path: Path) -> list[str]:
    """The lines of a user's file, stripped, without blank lines and ``#`` comments."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def refuse_generated(part: str, value: object) -> None:
    """``ValueError`` when ``value`` is ``GENERATED``: a per-sample format exists only in training data, so a task
    that measures recall (the lab, the eval) cannot take it for ``part`` (``template``, ``keys`` or ``values``)."""
    if isinstance(value, str) and (value == GENERATED or (part == "template" and value == TEXT)):
        raise ValueError(f"{part} {value!r} is a training-only choice (the kv-filler recall generator draws a "
                         f"fresh {part} for every sample); measuring recall needs one fixed {part}: a name of "
                         f"{sorted(_choices(part))} or a file")


def _choices(part: str) -> dict[str, Any]:
    return TEMPLATES if part == "template" else _vocabularies(part)


def load_template(value: str | Template) -> str | Template:
    """``--template NAME|FILE|TEXT``: a name of ``TEMPLATES`` (kept as the name), a text file whose first line is
    the template (see ``Template.parse``), or the template text itself (holding ``{key}`` and ``{value}``)."""
    refuse_generated("template", value)
    if isinstance(value, Template) or value in TEMPLATES:
        return value
    path = Path(value)
    if path.is_file():
        lines = _read_lines(path)
        if not lines:
            raise ValueError(f"template file {value!r} holds no template line")
        return Template.parse(lines[0], str(path))
    if "{key}" in value:
        return Template.parse(value, value)
    raise ValueError(f"template must be one of {sorted(TEMPLATES)}, a file or a text with {{key}} and {{value}}; "
                     f"got {value!r}")


def load_vocabulary(value: str | Vocabulary, kind: str) -> str | Vocabulary:
    """``--keys`` / ``--values NAME|FILE``: a name of ``KEY_WORDS`` / ``VALUE_WORDS`` (kept as the name) or a text
    file of words, one or more a line (blank lines and ``#`` comments skipped). ``kind``: ``"keys"`` or
    ``"values"``."""
    table = _vocabularies(kind)
    refuse_generated(kind, value)
    if isinstance(value, Vocabulary) or value in table:
        return value
    path = Path(value)
    if path.is_file():
        return Vocabulary(str(path), tuple(w for line in _read_lines(path) for w in line.split()))
    raise ValueError(f"{kind} must be one of {sorted(table)} or a word-list file; got {value!r}")


def _vocabularies(kind: str) -> dict[str, str]:
    if kind not in ("keys", "values"):
        raise ValueError(f"kind must be 'keys' or 'values'; got {kind!r}")
    return KEY_WORDS if kind == "keys" else VALUE_WORDS


def template_pieces(template: str | Template) -> tuple[str, str, str]:
    """``(before, middle, after)`` of a template name or ``Template``."""
    return template.pieces if isinstance(template, Template) else TEMPLATES[template]


def vocabulary_words(vocabulary: str | Vocabulary, kind: str) -> list[str]:
    """The words of a vocabulary name (of ``kind`` ``"keys"`` or ``"values"``) or ``Vocabulary``."""
    return list(vocabulary.words) if isinstance(vocabulary, Vocabulary) else _vocabularies(kind)[vocabulary].split()


def label(choice: str | Template | Vocabulary) -> str:
    """A template's or vocabulary's name for results."""
    return choice if isinstance(choice, str) else choice.name


def single_tokens(tokenizer: PreTrainedTokenizerFast, words: Iterable[str], rule: str, need: int,
                  name: str = "") -> list[int]:
    """The ids of the distinct words (with a leading space) that are one token; ``ValueError`` naming ``rule``
    (and the vocabulary ``name``) when fewer than ``need``."""
    ids, seen = [], set()
    for word in words:
        pieces = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(pieces) == 1 and pieces[0] not in seen:
            ids.append(pieces[0])
            seen.add(pieces[0])
    if len(ids) < need:
        of = f" of vocabulary {name!r}" if name else ""
        raise ValueError(f"rule '{rule}': only {len(ids)} distinct words{of} are a single token with this tokenizer "
                         f"(need {need}); choose another vocabulary or a tokenizer with whole-word tokens")
    return ids


def check_choice(part: str, value: object) -> None:
    """``ValueError`` naming ``part`` unless ``value`` is a name of its table (``TEMPLATES``, ``KEY_WORDS`` or
    ``VALUE_WORDS``) or a ``Template`` / ``Vocabulary``; ``GENERATED`` is refused (``refuse_generated``)."""
    refuse_generated(part, value)
    kind = Template if part == "template" else Vocabulary
    if not isinstance(value, kind) and value not in _choices(part):
        raise ValueError(f"{part} must be one of {sorted(_choices(part))} or a {kind.__name__}; got {value!r}")


def template_tokens(tokenizer: PreTrainedTokenizerFast,
                    template: str | Template) -> tuple[list[int], list[int], list[int]]:
    """The token ids of ``template``'s ``(before, middle, after)``; ``ValueError`` if ``middle`` is empty."""
    before, middle, after = (tokenizer.encode(p, add_special_tokens=False) for p in template_pieces(template))
    if not middle:
        raise ValueError(f"rule 'query template': template {label(template)!r} tokenizes to nothing")
    return before, middle, after


def vocabulary_tokens(tokenizer: PreTrainedTokenizerFast, vocabulary: str | Vocabulary, kind: str,
                      need: int) -> list[int]:
    """The single-token ids of ``vocabulary``'s words (``kind``: ``"keys"`` or ``"values"``), at least ``need``."""
    return single_tokens(tokenizer, vocabulary_words(vocabulary, kind), f"single-token {kind}", need,
                         label(vocabulary))
