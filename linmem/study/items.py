"""Per-item evaluation records: the numbers behind each aggregate of ``linmem.eval``, one per test item.

``linmem.eval.runner.evaluate`` reports one number per task; an item bootstrap needs the items. Each record
builds the task's items exactly as the eval does (same windows, passages, sequences and trials, from the same
builders and seeds) and keeps, per item, a numerator and denominator (loss sum and tokens of a window, answers
right and answers of an MQAR sequence, 1/0 of a cloze passage or NIAH trial), the ``unit`` the bootstrap resamples
(a window, a cloze passage's document, a sequence or trial, a recall item's source passage; a window also names its
``document``, which the study's tables resample instead) and the ``group`` a metric averages over (MQAR: the number
of pairs; NIAH: the length x depth cell; recall: the load), as the eval's aggregates do. ``agreement`` compares the
records with the eval's own aggregates.
"""

from __future__ import annotations

from typing import Any

import torch

from linmem.data.randomness import sample_rng
from linmem.data.shards import SplitTokens
from linmem.data.synthetic import MQAR
from linmem.data.windows import sequential_window_documents, sequential_window_sources
from linmem.eval.cloze import build_cloze
from linmem.eval.loading import EvalModel
from linmem.eval.memory_recall import FormatUnavailable, recall_trials
from linmem.eval.mqar import mqar_batch, mqar_vocab_range
from linmem.eval.niah import NIAH_STREAM, haystack_tokens, niah_prompt
from linmem.eval.perplexity import leading_windows
from linmem.eval.runner import EvalOptions
from linmem.eval.scoring import logits_of, score_continuations, window_losses

ITEM_TASKS = ("ppl", "cloze", "mqar", "niah", "recall")
CLOZE_CONTEXT_TOKENS = 256  # linmem.eval.cloze's default context, which the runner uses


def _columns() -> dict[str, list]:
    return {"unit": [], "group": [], "num": [], "den": []}


def _add(columns: dict[str, list], unit: str, group: str, num: float, den: float, **extra: Any) -> None:
    for key, value in (("unit", unit), ("group", group), ("num", num), ("den", den), *extra.items()):
        columns.setdefault(key, []).append(value)


def ppl_items(em: EvalModel, split: SplitTokens, seq_len: int, o: EvalOptions) -> dict[str, list]:
    """One item per test window (as ``eval.perplexity``): its loss sum (nats) over its ``seq_len - 1`` targets,
    the ``source`` most of those targets come from (``sequential_window_sources``: per-source perplexity) and the
    ``document`` (``sequential_window_documents``: the bootstrap resamples documents, since the windows of one
    document are not independent)."""
    columns, windows = _columns(), leading_windows(split, seq_len, o.max_tokens)
    sources, documents = sequential_window_sources(split, seq_len), sequential_window_documents(split, seq_len)
    for start in range(0, len(windows), o.batch_size):
        losses = window_losses(em, torch.stack(windows[start:start + o.batch_size])).double()
        for i, row in enumerate(losses):
            _add(columns, f"w{start + i}", "all", float(row.sum()), row.numel(), source=sources[start + i],
                 document=documents[start + i])
    return columns


def cloze_items(em: EvalModel, split: SplitTokens, o: EvalOptions) -> dict[str, list]:
    """One item per cloze passage (as ``eval.cloze``): 1 when greedy decoding gives the target; the unit is the
    passage's document (passages of one document are not independent)."""
    examples = build_cloze(em, split, o.cloze_examples, context_chars=CLOZE_CONTEXT_TOKENS * 4)
    pairs = [(em.encode(e.context)[-CLOZE_CONTEXT_TOKENS:], em.encode(e.target)) for e in examples]
    columns = _columns()
    for example, (_, greedy) in zip(examples, score_continuations(em, pairs, o.batch_size)):
        _add(columns, example.source_id, "all", float(greedy), 1.0)
    return columns


def mqar_items(em: EvalModel, seq_len: int, o: EvalOptions) -> dict[str, list]:
    """One item per MQAR sequence (as ``eval.mqar``): answers predicted right and answers, grouped by pairs."""
    low, high = mqar_vocab_range(em)
    columns = _columns()
    for n in o.mqar_pairs:
        if 4 * n > seq_len - 1 or n > (high - low) // 2:
            continue
        ids, mask = mqar_batch(MQAR((low, high), n, 0.01), seq_len, o.mqar_samples, o.seed, em.eos_id)
        for start in range(0, len(ids), o.batch_size):
            chunk, answers = ids[start:start + o.batch_size], mask[start:start + o.batch_size, 1:]
            hits = (logits_of(em, chunk)[:, :-1].argmax(-1) == chunk[:, 1:]) & answers
            for i in range(len(chunk)):
                _add(columns, f"{n}:{start + i}", str(n), float(hits[i].sum()), float(answers[i].sum()), pairs=n)
    return columns


def niah_items(em: EvalModel, split: SplitTokens, o: EvalOptions) -> dict[str, list]:
    """One item per NIAH trial (as ``eval.niah``): 1 when the answer is decoded greedily; grouped by cell."""
    hay, columns = haystack_tokens(split), _columns()
    for li, length in enumerate(o.niah_lengths):
        for di, depth in enumerate(o.niah_depths):
            trials = [(j, niah_prompt(em, hay, length, depth,
                                      sample_rng(o.seed, NIAH_STREAM, (li * 100 + di) * 10_000 + j)))
                      for j in range(o.niah_samples)]
            trials = [(j, t) for j, t in trials if t is not None]
            scores = score_continuations(em, [t for _, t in trials], o.batch_size) if trials else []
            for (j, _), (_, greedy) in zip(trials, scores):
                _add(columns, f"{length}@{depth}:{j}", f"{length}@{depth}", float(greedy), 1.0, length=length,
                     depth=depth)
    return columns


def recall_items(em: EvalModel, split: SplitTokens, o: EvalOptions) -> dict[str, list]:
    """One item per memory-lab recall item (as ``eval.memory_recall``): 1 when the answer wins among the four
    candidates; the unit is the item's source passage (the eval's bootstrap unit), grouped by load. No items when
    the tokenizer cannot build the format (the eval reports the task as not available)."""
    columns = _columns()
    try:
        trials = recall_trials(em, split, o.recall_format(), o.recall_bindings, o.recall_items, o.seed,
                               o.batch_size)
    except FormatUnavailable:
        return columns
    for t in trials:
        for source, correct in zip(t.sources, t.correct):
            _add(columns, source, str(t.num_bindings), correct, 1.0, bindings=t.num_bindings)
    return columns


def item_records(em: EvalModel, split: SplitTokens | None, tasks: list[str], o: EvalOptions,
                 progress=None) -> dict[str, dict[str, list]]:
    """The records of every task of ``tasks`` that has items (``ITEM_TASKS``); ``progress(name)`` is called
    before each."""
    seq_len = o.seq_len or em.seq_len
    builders = {"ppl": lambda: ppl_items(em, split, seq_len, o), "cloze": lambda: cloze_items(em, split, o),
                "mqar": lambda: mqar_items(em, seq_len, o), "niah": lambda: niah_items(em, split, o),
                "recall": lambda: recall_items(em, split, o)}
    records = {}
    for name in tasks:
        if name in builders:
            if progress is not None:
                progress(name)
            records[name] = builders[name]()
    return records


def ratio(columns: dict[str, list], groups: list[str] | None = None) -> float:
    """The aggregate the eval reports: the mean over groups of ``Σ num / Σ den`` within each group."""
    sums: dict[str, list[float]] = {}
    for group, num, den in zip(columns["group"], columns["num"], columns["den"]):
        if groups is None or group in groups:
            pair = sums.setdefault(group, [0.0, 0.0])
            pair[0] += num
            pair[1] += den
    values = [n / d for n, d in sums.values() if d > 0]
    return sum(values) / len(values) if values else float("nan")


def agreement(records: dict[str, dict[str, list]], report: dict[str, Any]) -> dict[str, float]:
    """``|records' aggregate - the eval's|`` per task (the eval's ``results.json`` report ``report``)."""
    reported = {"ppl": ("loss",), "cloze": ("accuracy",), "mqar": ("mean_accuracy",), "niah": ("mean_accuracy",),
                "recall": ("accuracy",)}
    out = {}
    for name, columns in records.items():
        metrics = report["tasks"].get(name, {}).get("metrics", {})
        value = metrics.get(reported[name][0])
        if value is not None:
            out[name] = abs(ratio(columns) - float(value))
    return out
