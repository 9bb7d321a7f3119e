"""Deterministic train / validation / test splits by document.

A document's split depends only on its ``source_id`` (and a salt): SHA-256 maps the id to a number in [0, 1)
that falls into one of the cumulative fraction intervals. The same document lands in the same split on every
machine, in every build, whatever else is in the corpus, and no document is in two splits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class SplitFractions:
    """Fractions of documents per split; each in [0, 1], summing to 1."""

    train: float = 0.98
    validation: float = 0.01
    test: float = 0.01

    def __post_init__(self) -> None:
        values = self.as_dict()
        bad = {k: v for k, v in values.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"split fractions must lie in [0, 1]; got {bad}")
        if abs(sum(values.values()) - 1.0) > 1e-9:
            raise ValueError(f"split fractions must sum to 1; got {values} (sum {sum(values.values()):.6g})")

    def as_dict(self) -> dict[str, float]:
        return {"train": self.train, "validation": self.validation, "test": self.test}

    @classmethod
    def parse(cls, text: str) -> SplitFractions:
        """``"0.98,0.01,0.01"`` (train, validation, test)."""
        parts = text.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3:
            raise ValueError(f"splits must be three numbers 'train,validation,test' like 0.98,0.01,0.01; got {text!r}")
        return cls(*values)


def unit_hash(source_id: str, salt: str = "linmem") -> float:
    """A number in [0, 1) from the first 8 bytes of ``sha256(salt NUL source_id)``."""
    digest = hashlib.sha256(f"{salt}\0{source_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(source_id: str, fractions: SplitFractions | None = None, salt: str = "linmem") -> str:
    """The split (``"train"``, ``"validation"`` or ``"test"``) of the document with id ``source_id``
    (default fractions: ``SplitFractions()``)."""
    fractions = fractions or SplitFractions()
    u = unit_hash(source_id, salt)
    edge = 0.0
    for name, fraction in fractions.as_dict().items():
        edge += fraction
        if u < edge:
            return name
    # u < 1 always, but the running sum may round below 1: the last non-empty split takes the remainder.
    return [name for name, f in fractions.as_dict().items() if f > 0][-1]
