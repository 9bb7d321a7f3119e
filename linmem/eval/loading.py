"""Open what an evaluation needs: a model folder (weights, config, tokenizer, training record) and held-out text.

A model is a folder or ``zoo:NAME``, opened by ``linmem.models.loading`` (the one loader of every command): what
``linmem train`` writes to ``OUT/model`` (or any checkpoint folder, a run folder, or a folder saved with
``save_pretrained`` plus a ``tokenizer.json``), or an FLA checkpoint. Held-out text comes from a dataset folder
built with the same tokenizer: the one the model was trained on (recorded in ``train_info.json``) or ``--data DIR``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from linmem.data.shards import INDEX_NAME, SplitTokens, TokenShards
from linmem.data.tokenizer import find_document_start, find_eos, tokenizer_hash
from linmem.io.models import pick_device
from linmem.io.run_info import read_train_info
from linmem.models import LinMemForCausalLM
from linmem.models.loading import open_model


@dataclass
class EvalModel:
    """A model ready for evaluation (eval mode, on ``device``) with its tokenizer and training record."""

    model: LinMemForCausalLM
    tokenizer: PreTrainedTokenizerFast
    folder: Path
    device: torch.device
    eos_id: int
    info: dict[str, Any] = field(default_factory=dict)
    start_id: int | None = None  # the token a document starts after (None: eos_id); see ``find_document_start``
    decoders: dict = field(default_factory=dict, repr=False)  # eos id -> StaticDecoder (eval.scoring)

    @property
    def document_start(self) -> int:
        """The id put before a scored or prompted text: where a training document starts."""
        return self.eos_id if self.start_id is None else self.start_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` as the tokenizer's engine decodes it (special tokens kept, spaces never cleaned)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def seq_len(self) -> int:
        """The training window length (512 if unknown)."""
        return int(self.info.get("seq_len", 512))


def load_model(path: str | Path, device: str = "auto", dtype: torch.dtype = torch.float32,
               backend: str = "auto") -> EvalModel:
    """Load a model (a folder, a run folder or ``zoo:NAME``: ``linmem.io.models.resolve_model_folder``) with its
    tokenizer and training record; weights as ``dtype`` on ``device``, mixers on the op ``backend``."""
    model, tokenizer, folder = open_model(path, device=device, dtype=dtype, backend=backend)
    _, eos_id = find_eos(tokenizer)
    return EvalModel(model, tokenizer, folder, pick_device(device), eos_id, read_train_info(folder),
                     find_document_start(tokenizer, eos_id))


def open_heldout(em: EvalModel, data_dir: str | Path | None, split: str) -> SplitTokens:
    """Split ``split`` of ``data_dir`` (default: the dataset recorded in ``train_info.json``, a relative path taken
    from the model folder, as the zoo's shipped models record it), checked to use the model's tokenizer."""
    recorded = em.folder / em.info["dataset"] if em.info.get("dataset") else None  # relative: to the model folder
    folder = Path(data_dir) if data_dir else recorded
    if folder is None or not (folder / INDEX_NAME).is_file():
        where = f"{folder} has no dataset" if folder else "the model folder records no dataset"
        raise FileNotFoundError(f"held-out text needed and {where}: pass --data DIR, a dataset built with the "
                                f"model's tokenizer (linmem data build --sources stdlib --tokenizer {em.folder} "
                                f"--out DIR)")
    shards = TokenShards(folder)
    if shards.tokenizer_hash != tokenizer_hash(em.tokenizer):
        raise ValueError(f"{folder} was tokenized with another tokenizer than {em.folder}'s; rebuild it with "
                         f"--tokenizer {em.folder}")
    if split not in shards.splits or shards.split(split).num_tokens == 0:
        raise ValueError(f"{folder} has no tokens in split {split!r}; choose --split among {shards.splits}")
    return shards.split(split)
