"""The memory lab's clean recall in chosen formats at every evaluation of a training run (``train.eval_lab_recall``).

A run that trains on recall data can be followed on formats it never trains on: the same 4-choice items that
``linmem eval --tasks recall`` scores (``linmem.eval.memory_recall``), built from the documents of the run's
validation split (``data.eval_split``), never from the test split. Each entry of ``train.eval_lab_recall`` is a
mapping::

    {template: keeps, keys: roles, values: materials, loads: [1, 4], items: 64, filler: 128}

(``loads``, ``items`` and ``filler`` optional, with these defaults). Every evaluation logs, per entry and load,
``val_lab_recall:TEMPLATE/KEYS/VALUES@K`` (the share of items answered, chance 0.25) to ``metrics.jsonl``.

Because recall on a held-out format can peak during training and then fall (docs/results.md), this is what a
legitimate early stop reads: a *validation* format, disjoint from the format the test reports, chosen before the
run. Scoring changes no update: the items come from their own seeded generator and the model runs without
gradients, so a run with it logs the same losses as one without it (tests/test_train_lab_recall.py).

Every process scores every item (the same forward passes on each), so that sharded models (FSDP2) run their
collectives in step; the numbers are those of one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from linmem.data.shards import TokenShards
from linmem.data.tokenizer import find_document_start, find_eos, load_tokenizer
from linmem.eval.loading import EvalModel
from linmem.eval.memory_recall import (
    RecallFormat,
    builders,
    check_format,
    check_loads,
    filler_passages,
    recall_trials,
)

ENTRY_KEYS = ("template", "keys", "values", "loads", "items", "filler")
DEFAULTS = {"loads": [1, 4], "items": 64, "filler": 128}
PREFIX = "val_lab_recall"


@dataclass(frozen=True)
class LabRecallEntry:
    """One format followed during training: ``fmt`` (two presentations per fact) at ``loads``, ``items`` per load."""

    fmt: RecallFormat
    loads: tuple[int, ...]
    items: int

    @property
    def label(self) -> str:
        """``TEMPLATE/KEYS/VALUES`` (names, or file stems for a user's own files)."""
        names = (self.fmt.template, self.fmt.keys, self.fmt.values)
        return "/".join(Path(n).stem if Path(n).is_file() else n for n in names)

    def metric(self, load: int) -> str:
        return f"{PREFIX}:{self.label}@{load}"


def parse_entries(entries: Any, where: str = "config") -> list[LabRecallEntry]:
    """``train.eval_lab_recall`` checked: a list of mappings with ``template``, ``keys`` and ``values`` (names of the
    lab's formats or files) and optional ``loads`` / ``items`` / ``filler``; ``ValueError`` naming the entry."""
    if not isinstance(entries, list):
        raise ValueError(f"{where}: train.eval_lab_recall must be a list of formats; got {entries!r}")
    out = []
    for i, entry in enumerate(entries):
        key = f"train.eval_lab_recall[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: {key} must be a mapping with template, keys and values; got {entry!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        missing = [k for k in ("template", "keys", "values") if k not in entry]
        if unknown or missing:
            problem = f"unknown key {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"
            raise ValueError(f"{where}: {key}: {problem}; keys: {', '.join(ENTRY_KEYS)}")
        values = {**DEFAULTS, **entry}
        for name in ("items", "filler"):
            if not isinstance(values[name], int) or isinstance(values[name], bool) or values[name] < 1:
                raise ValueError(f"{where}: {key}.{name} must be an integer >= 1; got {values[name]!r}")
        fmt = RecallFormat(values["template"], values["keys"], values["values"], filler_tokens=values["filler"])
        try:
            loads = check_loads(values["loads"], f"{key}.loads")
            check_format(fmt, key)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        out.append(LabRecallEntry(fmt, loads, values["items"]))
    labels = [e.label for e in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{where}: train.eval_lab_recall names a format twice: {labels}")
    return out


class LabRecall:
    """Scores ``entries`` on ``model`` with the documents of split ``split`` of ``data_folder``. Built at the start
    of a run, so that a format this tokenizer cannot build, or a load its key vocabulary cannot supply, stops the
    run before its first update rather than at its first evaluation."""

    def __init__(self, entries: list[LabRecallEntry], model: nn.Module, data_folder: str | Path, split: str,
                 device: torch.device):
        folder = Path(data_folder)
        tokenizer = load_tokenizer(folder)
        _, eos_id = find_eos(tokenizer)
        self.entries = entries
        self.split = TokenShards(folder).split(split)
        self.eval_model = EvalModel(model, tokenizer, folder, device, eos_id, {},
                                    find_document_start(tokenizer, eos_id))
        for entry in entries:
            try:
                builders(tokenizer, entry.fmt, entry.loads)
            except ValueError as e:  # FormatUnavailable included: nothing could be logged for this entry
                raise ValueError(f"train.eval_lab_recall {entry.label}: {e}") from None
        self.passages = {}  # per filler length, made once: the documents do not change during a run
        for filler in sorted({entry.fmt.filler_tokens for entry in entries}):
            try:
                self.passages[filler] = filler_passages(self.eval_model, self.split, filler)
            except ValueError as e:
                raise ValueError(f"train.eval_lab_recall: {e} in {folder}; lower the entries' filler") from None

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        """``{val_lab_recall:LABEL@K: accuracy}`` for every entry and load (the model's mode is left to the
        caller)."""
        out = {}
        for entry in self.entries:
            for trials in recall_trials(self.eval_model, self.split, entry.fmt, entry.loads, entry.items,
                                        sources=self.passages[entry.fmt.filler_tokens]):
                out[entry.metric(trials.num_bindings)] = sum(trials.correct) / len(trials.correct)
        return out
