"""lm-evaluation-harness adapter: ``LinMemLM``, an ``lm_eval`` ``LM`` registered as ``linmem``.

From a shell, once linmem is installed with its ``eval`` extra::

    lm_eval --model linmem --model_args pretrained=DIR --tasks T [--include_path TASKS_DIR]
    python -m linmem.eval.harness --model linmem --model_args pretrained=DIR --tasks T

lm_eval 0.4 has no plugin mechanism: linmem's wheel installs ``linmem-lm-eval.pth`` (``packaging/``), which, only
in a process started as ``lm_eval``/``lm-eval``, adds ``linmem`` to lm_eval's model registry as a lazy
``"linmem.eval.harness:LinMemLM"`` entry after lm_eval's own models (an editable install has no ``.pth``: use
``python -m linmem.eval.harness``, which runs the same CLI).

From Python, importing this module registers ``linmem`` beside lm_eval's own models (``hf`` and the rest stay
available)::

    import lm_eval, linmem.eval.harness
    lm_eval.simple_evaluate(model="linmem", model_args="pretrained=runs/rdn/model", tasks=[...])

``model_args``: ``pretrained`` (a model folder), ``device`` (auto), ``batch_size``, ``max_length`` of a scored
window in tokens (default: the training ``seq_len``), ``max_gen_toks``, ``dtype`` of the weights (``float32``,
``bfloat16``, ``float16``, ``auto``: as saved), ``document_start`` (``true``). Any other name is refused.

Document-start framing: with ``document_start=true`` every request is scored after the token a document starts
after (``EvalModel.document_start``: the tokenizer's BOS for an imported checkpoint that names one, else the
end-of-text, which separates documents in linmem's training), as the model saw every document in training.
lm_eval's ``hf`` model instead scores a non-empty context as it is (it adds a BOS only where the tokenizer adds
one, and linmem's tokenizers add none), so the two differ on the same weights; ``document_start=false`` scores
exactly like ``hf`` (docs/evaluation.md). A trailing space of a context moves to the continuation (byte-level BPE
attaches spaces to the next word). Contexts are cut on the left to ``max_length`` tokens. Generation is greedy.
"""

from __future__ import annotations

import sys
from typing import Any

import lm_eval.models  # noqa: F401  (lm_eval's own models enter the registry before linmem, so they stay listed)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from linmem.eval.loading import EvalModel, load_model
from linmem.eval.scoring import greedy_generate, score_continuations

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_bool(name: str, value: bool | str) -> bool:
    """A boolean ``model_args`` value (``true``/``false``, ``1``/``0``, ``yes``/``no``)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in TRUE + FALSE:
        raise ValueError(f"model_args {name} must be true or false; got {value!r}")
    return text in TRUE


def parse_dtype(value: str | torch.dtype) -> torch.dtype | str:
    """The weights' dtype named by ``model_args`` ``dtype``."""
    if isinstance(value, torch.dtype):
        return value
    if str(value) not in DTYPES:
        raise ValueError(f"model_args dtype must be one of {', '.join(DTYPES)}; got {value!r}")
    return DTYPES[str(value)]


def split_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    """Move trailing whitespace of ``context`` onto ``continuation``."""
    stripped = context.rstrip()
    return stripped, context[len(stripped):] + continuation


@register_model("linmem")
class LinMemLM(LM):
    """A linmem model folder (or a loaded ``EvalModel``) for lm-evaluation-harness (``model_args``: see the module
    docstring). ``max_batch_size`` is lm_eval's own argument, accepted and unused (no automatic batch size)."""

    def __init__(self, pretrained: str | EvalModel, device: str | None = "auto", batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 64, dtype: str | torch.dtype = "float32",
                 document_start: bool | str = True, max_batch_size: int | None = None, **unknown: Any):
        super().__init__()
        if unknown:
            raise ValueError(f"unknown model_args for --model linmem: {', '.join(sorted(unknown))}; known: "
                             "pretrained, device, batch_size, max_length, max_gen_toks, dtype, document_start")
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "auto"  # the harness passes its own default device; use what this machine has
        weights = parse_dtype(dtype)
        self.em = pretrained if isinstance(pretrained, EvalModel) else load_model(pretrained, device, weights)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length) if max_length else self.em.seq_len
        self.max_gen_toks = int(max_gen_toks)
        self.document_start = parse_bool("document_start", document_start)

    def _encode_context(self, context: str) -> list[int]:
        """Context ids after the document start (``document_start=true``), else as the tokenizer gives them
        (an empty context still starts after it: a first token needs something to be predicted from)."""
        ids = self.em.encode(context)
        return [self.em.document_start] + ids if self.document_start or not ids else ids

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` for each ``Instance`` with ``args = (context, cont)``."""
        pairs = []
        for request in requests:
            context, continuation = split_trailing_space(*request.args)
            pairs.append((self._encode_context(context), self.em.encode(continuation)))
        return score_continuations(self.em, pairs, self.batch_size, self.max_length)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Log-likelihood of each whole string: chunks of ``max_length`` targets, each scored with as much
        preceding context as fits (every token predicted once, the first from the document start)."""
        results = []
        for request in tqdm(requests, disable=len(requests) < 50, desc="rolling"):
            sequence = [self.em.document_start] + self.em.encode(request.args[0])  # as hf: the first token too
            pairs = [(sequence[:start], sequence[start:start + self.max_length])
                     for start in range(1, len(sequence), self.max_length)]
            results.append(sum(s[0] for s in score_continuations(self.em, pairs, self.batch_size, self.max_length)))
        return results

    def generate_until(self, requests) -> list[str]:
        """Greedy continuation of each context until one of ``gen_kwargs["until"]`` appears (cut there),
        EOS, or ``max_gen_toks`` tokens."""
        return [self._generate(*request.args)
                for request in tqdm(requests, disable=len(requests) < 50, desc="generate")]

    def _generate(self, context: str, kwargs: dict[str, Any]) -> str:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        budget = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        ids = self._encode_context(context)[-max(1, self.max_length - budget):]

        def stop(generated: list[int]) -> bool:
            text = self.em.decode(generated)
            return any(u in text for u in until)

        text = self.em.decode(greedy_generate(self.em, ids, budget, stop))
        for marker in until:
            text = text.split(marker)[0]
        return text


def main(argv: list[str] | None = None) -> None:
    """``python -m linmem.eval.harness ...``: the lm-evaluation-harness CLI with ``--model linmem`` registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
