"""Evaluation of a model folder: perplexity, LAMBADA-style cloze, MQAR, needle in a haystack, the memory lab's
clean recall, per-layer stability norms; and an lm-evaluation-harness adapter (``linmem.eval.harness``).

The names below load with their module on first use (``linmem.io.lazy``), so that ``linmem eval --help`` does not
import torch and transformers."""

from linmem.io.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "linmem.eval.loading": ("EvalModel", "load_model", "open_heldout"),
    "linmem.eval.runner": ("EvalOptions", "evaluate"),
    "linmem.eval.task_names": ("TASKS",),
})
