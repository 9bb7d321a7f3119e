"""One text-to-ids call for both tokenizer types linmem's loaders return (``tokenizers.Tokenizer`` and a
transformers tokenizer): ``Tokenize``, which the lab's tasks and the training generator tokenize with."""

from __future__ import annotations

from collections.abc import Sequence


class Tokenize:
    """``text -> list[int]`` for a ``tokenizers.Tokenizer`` or a transformers tokenizer (no special tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ``ids`` (special tokens dropped)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
