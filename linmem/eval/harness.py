"""lm-evaluation-harness adapter: ``LinMemLM``, an ``lm_eval`` ``LM`` registered as ``linmem``.

```python
import lm_eval, linmem.eval.harness                       # importing registers --model linmem
lm_eval.simple_evaluate(model="linmem", model_args="pretrained=runs/rdn/model", tasks=[...])
```
or from a shell: ``python -m linmem.eval.harness run --model linmem --model_args pretrained=DIR --tasks T
--include_path TASKS_DIR`` (the harness CLI, with the model registered first).

Every request is prefixed with the token a document starts after (``EvalModel.document_start``): the
tokenizer's BOS for an imported checkpoint that names one (lm-evaluation-harness's Hugging Face models put it
before an empty context), else the end-of-text, which separates documents in linmem's training. A trailing space of
a context moves to the continuation (byte-level BPE attaches spaces to the next word). Contexts are cut on the left
to ``max_length`` tokens (default: the training window). Generation is greedy.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from linmem.eval.loading import EvalModel, load_model
from linmem.eval.scoring import greedy_generate, score_continuations


def split_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    """Move trailing whitespace of ``context`` onto ``continuation``."""
    stripped = context.rstrip()
    return stripped, context[len(stripped):] + continuation


@register_model("linmem")
class LinMemLM(LM):
    """A linmem model folder (or a loaded ``EvalModel``) for lm-evaluation-harness.

    Args: ``pretrained`` model folder or ``EvalModel``; ``device`` (auto); ``batch_size``; ``max_length`` of a
    scored window in tokens (default: training ``seq_len``); ``max_gen_toks`` default generation budget.
    """

    def __init__(self, pretrained: str | EvalModel, device: str | None = "auto", batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 64, **kwargs: Any):
        super().__init__()
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "auto"  # the harness passes its own default device; use what this machine has
        self.em = pretrained if isinstance(pretrained, EvalModel) else load_model(pretrained, device)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length) if max_length else self.em.seq_len
        self.max_gen_toks = int(max_gen_toks)

    def _encode_context(self, context: str) -> list[int]:
        return [self.em.document_start] + self.em.encode(context)

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
            sequence = self._encode_context(request.args[0])
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
