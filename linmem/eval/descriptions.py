"""Results in words for people: which text a perplexity was measured on. No torch here, so that commands which
only print records (``linmem zoo list``) stay fast."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def measured_on(metrics: Mapping[str, Any]) -> str:
    """Which text a perplexity of ``perplexity``'s ``metrics`` was measured on: ``"first 32,704 test tokens"``
    (the scored tokens of the first windows of the split; a window's first token is context only). Perplexities
    over other splits or token counts are different numbers, so every printed perplexity carries this. Where the
    windows were all of the split's: ``"the whole test split, 89,936 tokens"``."""
    split = metrics.get("split", "held-out")
    if metrics.get("whole_split"):
        return f"the whole {split} split, {metrics['tokens']:,} tokens"
    return f"first {metrics['tokens']:,} {split} tokens"


def describe_perplexity(metrics: Mapping[str, Any], digits: int = 2) -> str:
    """``"38.46 (first 32,704 test tokens, 512-token windows)"``: the perplexity with the text it was measured on."""
    return f"{metrics['ppl']:.{digits}f} ({measured_on(metrics)}, {metrics['seq_len']}-token windows)"
