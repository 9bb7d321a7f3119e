"""Answer-level metrics over the 4 candidate values of each query (all logits at the last prompt position).

Per item: ``choice [B, 4]`` the candidates' logits; the model's answer is the argmax (4-choice conditional
likelihood: the softmax over the four). Margins are logit differences, so they do not depend on the rest of the
vocabulary.
"""

from __future__ import annotations

import torch


def choice_logits(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``logits [B, vocab]`` (the last position) and ``candidates [B, 4]`` ids → ``[B, 4]`` float64."""
    return logits.double().gather(-1, candidates.to(logits.device))


def pick(choice: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return choice.gather(-1, index.to(choice.device)[:, None])[:, 0]


def target_margin(choice: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """``z_answer − max_{other candidates} z`` ``[B]``: > 0 iff the answer is chosen."""
    others = choice.scatter(-1, answer.to(choice.device)[:, None], float("-inf"))
    return pick(choice, answer) - others.max(-1).values


def donor_margin(choice: torch.Tensor, answer: torch.Tensor, donor: torch.Tensor) -> torch.Tensor:
    """``z_donor − z_recipient`` ``[B]``."""
    return pick(choice, donor) - pick(choice, answer)


def compare(clean: torch.Tensor, edited: torch.Tensor, answer: torch.Tensor,
            donor: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-item metrics of one edit from the clean and edited ``[B, 4]`` candidate logits.

    Returns ``clean_correct``, ``edited_correct``, ``target_margin_change`` and, with ``donor`` answers,
    ``donor_answer`` (edited run picks the donor's value), ``donor_margin_shift`` (change of ``z_donor −
    z_recipient``, > 0 toward the donor); all ``[B]`` float64.
    """
    out = {
        "clean_correct": (clean.argmax(-1) == answer.to(clean.device)).double(),
        "edited_correct": (edited.argmax(-1) == answer.to(clean.device)).double(),
        "target_margin_change": target_margin(edited, answer) - target_margin(clean, answer),
    }
    if donor is not None:
        out["donor_answer"] = (edited.argmax(-1) == donor.to(clean.device)).double()
        out["donor_margin_shift"] = donor_margin(edited, answer, donor) - donor_margin(clean, answer, donor)
    return out


def break_rate(clean_correct: torch.Tensor, edited_correct: torch.Tensor) -> tuple[float, int]:
    """Non-target break rate: among queries right before the edit (the denominator, returned too), the share
    wrong after it."""
    right = clean_correct.bool()
    n = int(right.sum())
    return (float((~edited_correct.bool() & right).sum()) / n if n else float("nan")), n
