"""``train.init_from``: start a run from a saved model's weights instead of a random initialisation.

The source is a model folder (``config.json`` + ``model.safetensors``: a run's ``OUT/model``, a
``save_pretrained`` folder) or ``zoo:NAME`` (a model shipped in ``linmem.zoo``). A staged recipe trains one data
mix, then continues from that model with another: the optimizer, the schedule and the data stream start afresh
(``--resume`` is for continuing the same run; a checkpoint of this run, when resumed, wins over ``init_from``).

Refused with an error that names the difference: another architecture (every ``config.json`` key that defines
the model, shapes and switches alike, must match the run's ``model`` section), another tokenizer (the source's
``train_info.json`` tokenizer hash, or its ``tokenizer.json`` vocabulary, against the dataset's), missing or
extra tensors.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from torch import nn

from linmem.io.models import resolve_model_folder
from linmem.io.run_info import read_train_info
from linmem.io.zoo_dir import ZOO_PREFIX
from linmem.models import LinMemConfig
from linmem.train.checkpoint import with_tied_head

# config.json keys that do not define the trained model: how the op runs, how the weights were first drawn, ids
NOT_ARCHITECTURE = frozenset({"backend", "initializer_range", "use_cache", "transformers_version", "architectures",
                              "_name_or_path", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                              "pad_token_id", "max_position_embeddings"})


def resolve_source(source: str, where: str = "config") -> Path:
    """The model folder ``source`` names (``zoo:NAME`` or a path); ``FileNotFoundError`` naming the key if it
    holds no model."""
    if source.startswith(ZOO_PREFIX):
        try:
            folder = resolve_model_folder(source)  # the one resolution of zoo:NAME, shared by every command
        except ValueError as e:
            raise FileNotFoundError(f"{where}: train.init_from {source!r}: {e}") from None
    else:
        folder = Path(source)
    missing = [name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{where}: train.init_from {source!r} is not a model folder ({' and '.join(missing)} "
                                f"missing); give a run's OUT/model folder, a save_pretrained folder or zoo:NAME")
    return folder


def architecture_differences(saved_config: LinMemConfig, config: LinMemConfig) -> list[str]:
    """``key: saved X, run Y`` for every key that defines the model where the source's and the run's differ."""
    saved, run = saved_config.to_dict(), config.to_dict()
    keys = sorted((set(saved) | set(run)) - NOT_ARCHITECTURE)
    return [f"{key}: saved {saved.get(key)!r}, run {run.get(key)!r}" for key in keys if saved.get(key) != run.get(key)]


def tokenizer_difference(folder: Path, dataset: Path, dataset_hash: str) -> str | None:
    """Why the source's tokenizer is not the dataset's, or None if they agree (or the source records neither)."""
    saved_hash = read_train_info(folder).get("tokenizer_hash")
    if saved_hash is not None:
        return None if saved_hash == dataset_hash else (
            f"its tokenizer (hash {saved_hash[:12]}) is not the dataset's ({dataset_hash[:12]})")
    if (folder / "tokenizer.json").is_file() and (dataset / "tokenizer.json").is_file():
        from linmem.data.tokenizer import load_tokenizer

        saved, ours = load_tokenizer(folder).get_vocab(), load_tokenizer(dataset).get_vocab()
        return None if saved == ours else "its tokenizer.json vocabulary is not the dataset's"
    return None


def source_summary(source: str, folder: Path) -> dict:
    """What a run started from: ``source`` as configured, and the source's own name, updates and tokens (and, if it
    was itself a later stage, its ``init_from``), from its ``train_info.json``; only ``source`` if it has none."""
    info = read_train_info(folder)
    summary = {"source": source}
    summary.update({key: info[key] for key in ("name", "steps", "tokens", "init_from") if key in info})
    return summary


def earlier_stages(init_from: dict | None) -> list[dict]:
    """The chain of ``source_summary`` records, first stage first."""
    chain = []
    while init_from:
        chain.insert(0, {k: v for k, v in init_from.items() if k != "init_from"})
        init_from = init_from.get("init_from")
    return chain


def load_initial_weights(model: nn.Module, source: str, config: LinMemConfig, dataset: Path, dataset_hash: str,
                         where: str = "config") -> Path:
    """Copy the weights of ``source`` into ``model`` (built from ``config``, not yet wrapped); returns the folder."""
    folder = resolve_source(source, where)
    try:
        saved = LinMemConfig.from_pretrained(folder)
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"{where}: train.init_from {source!r}: its config.json is not a linmem model's: {e}") from None
    differences = architecture_differences(saved, config)
    if differences:
        raise ValueError(f"{where}: train.init_from {source!r} has another architecture than the run's model "
                         f"section: {'; '.join(differences)}")
    why = tokenizer_difference(folder, dataset, dataset_hash)
    if why:
        raise ValueError(f"{where}: train.init_from {source!r}: {why}; the token ids would mean other tokens")
    tensors = with_tied_head(load_file(str(folder / "model.safetensors")), config)
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    wrong = sorted(k for k in set(own) & set(tensors) if tensors[k].shape != own[k].shape)
    if missing or extra or wrong:
        raise ValueError(f"{where}: train.init_from {source!r}: the weights do not fit the model (missing "
                         f"{missing[:5]}, unexpected {extra[:5]}, other shapes {wrong[:5]})")
    model.load_state_dict(tensors)  # copies into the parameters, in their dtype
    return folder
