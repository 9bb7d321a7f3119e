"""The label of a token position that no loss counts, shared by the batches ``data/`` makes and the loss ``ops/``
computes (standard library only: the lowest layer both import).

``IGNORE_INDEX`` is Hugging Face's value (``-100``), so that labels linmem writes mean the same to a transformers
model and to ``torch.nn.functional.cross_entropy``'s default ``ignore_index``.
"""

from __future__ import annotations

IGNORE_INDEX = -100
