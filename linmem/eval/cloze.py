"""A LAMBADA-style last-word cloze built from held-out documents.

LAMBADA (Paperno et al. 2016) asks for the last word of a passage that needs the broad context. Without human
filtering we keep passages where the target word (at least ``min_word_chars`` letters, ending a sentence or
clause) already occurs in the context: predicting it means finding it there, as for most LAMBADA targets. The
score is the exact match of every target token under greedy decoding, and the target's perplexity per word.

A context is the last ``context_tokens`` tokens before the target, cut from the middle of a document, and goes to
the model as it is, with no end-of-text token before it: in training, EOS comes before a document's first token and
before every synthetic recall sample, and a text window starts anywhere in a document without one. An EOS before
mid-document text reads as "a recall sample follows" to some models: the zoo's GDN hybrid scored 0.109 (target
perplexity 1,744) with it and 0.266 (91) without, GDN 0.250 either way (64 passages; docs/evaluation.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from linmem.data.shards import SplitTokens
from linmem.eval.loading import EvalModel
from linmem.eval.scoring import score_continuations

WORD = re.compile(r"[A-Za-z]+")
CLAUSE_END = ".!?;:,\n"


@dataclass(frozen=True)
class ClozeExample:
    """``context`` text, ``target`` (the last word with its leading space), and the document it comes from."""

    context: str
    target: str
    source_id: str


def cloze_candidates(text: str, context_chars: int, min_word_chars: int = 4) -> list[tuple[int, str]]:
    """``(start, word)`` of every word in ``text`` that ends a clause, has ``context_chars`` of text before it,
    and whose lower-case form occurs as a word in that context."""
    found = []
    for match in WORD.finditer(text):
        word, start, end = match.group(), match.start(), match.end()
        if len(word) < min_word_chars or start < context_chars or (end < len(text) and text[end] not in CLAUSE_END):
            continue
        context = text[start - context_chars:start]
        if word.lower() in {w.lower() for w in WORD.findall(context)}:
            found.append((start, word))
    return found


def build_cloze(em: EvalModel, split: SplitTokens, count: int, context_chars: int = 1200,
                per_document: int = 3) -> list[ClozeExample]:
    """Up to ``count`` examples, at most ``per_document`` per document (spread evenly through it), documents
    in split order."""
    examples: list[ClozeExample] = []
    for _, source_id, tokens in split.documents():
        text = em.decode(tokens.tolist())
        candidates = cloze_candidates(text, context_chars)
        if not candidates:
            continue
        step = max(1, len(candidates) // per_document)
        for start, word in candidates[::step][:per_document]:
            context = text[start - context_chars:start]
            target = word
            if context.endswith(" "):
                context, target = context[:-1], " " + word
            examples.append(ClozeExample(context, target, source_id))
            if len(examples) == count:
                return examples
    return examples


def cloze(em: EvalModel, split: SplitTokens, count: int = 500, context_tokens: int = 256,
          batch_size: int = 16) -> dict[str, Any]:
    """Accuracy and target perplexity on ``build_cloze`` examples; context cut to ``context_tokens``."""
    examples = build_cloze(em, split, count, context_chars=context_tokens * 4)
    if not examples:
        raise ValueError(f"no cloze passages in split {split.name!r} (documents too short or no repeated words)")
    pairs = [(em.encode(e.context)[-context_tokens:], em.encode(e.target)) for e in examples]
    scores = score_continuations(em, pairs, batch_size)
    logprob = sum(s[0] for s in scores) / len(scores)
    accuracy = sum(s[1] for s in scores) / len(scores)
    samples = [{"target": e.target, "greedy": s[1], "logprob": round(s[0], 4), "context_tail": e.context[-80:]}
               for e, s in list(zip(examples, scores))[:10]]
    return {"metrics": {"accuracy": accuracy, "target_ppl": math.exp(-logprob), "examples": len(examples),
                        "documents": len({e.source_id for e in examples}), "context_tokens": context_tokens,
                        "eos_before_context": False},
            "samples": samples}
