"""Evaluation of a model folder: perplexity, LAMBADA-style cloze, MQAR, needle in a haystack, the memory lab's
clean recall, per-layer stability norms; and an lm-evaluation-harness adapter (``linmem.eval.harness``)."""

from linmem.eval.loading import EvalModel, load_model, open_heldout
from linmem.eval.runner import TASKS, EvalOptions, evaluate

__all__ = ["TASKS", "EvalModel", "EvalOptions", "evaluate", "load_model", "open_heldout"]
