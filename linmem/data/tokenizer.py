"""Tokenizers: byte-level BPE trained locally with ``tokenizers``, saved so ``AutoTokenizer`` loads them, and the
one loader of every saved tokenizer.

A saved tokenizer folder holds ``tokenizer.json`` (the whole tokenizer) and ``tokenizer_config.json`` (its class
and special tokens), as ``transformers``' ``save_pretrained`` writes them, so
``AutoTokenizer.from_pretrained(folder)`` works on a model folder that contains them. Byte-level BPE encodes any
text without unknown tokens and decodes it back exactly.

Training gives a ``tokenizers.Tokenizer`` (the engine); everything linmem loads or hands on is a transformers
``PreTrainedTokenizerFast`` (``load_tokenizer``, ``wrap_tokenizer``), whose ``.backend_tokenizer`` is that engine
for bulk work (``encode_batch``, hashing).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from linmem.io.atomic import write_bytes_atomic
from linmem.io.folders import output_file, read_marker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# End-of-text spellings of common tokenizers, tried in order when a given tokenizer.json does not say.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BYTE_ALPHABET = 256
CONFIG_NAME = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = (EOS_TOKEN, PAD_TOKEN),
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    ``vocab_size`` counts the 256 byte tokens and the special tokens (which get the first ids: ``<|endoftext|>``
    is 0). A small corpus may end with fewer merges than asked for, hence a smaller vocabulary.
    """
    floor = BYTE_ALPHABET + len(special_tokens) + 1
    if not floor <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in [{floor}, 2**32] (256 bytes + {len(special_tokens)} special "
                         f"tokens + at least one merge); got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved at ``path`` (a folder holding ``tokenizer.json``, or that file itself) as a transformers
    fast tokenizer, with the special tokens of a ``tokenizer_config.json`` beside it: the one loader of every
    tokenizer linmem reads (the zoo's, a dataset's, a model folder's, an imported checkpoint's).

    A transformers tokenizer is what ``AutoTokenizer.from_pretrained(folder)`` gives a user and carries the folder's
    special tokens with it; its Rust engine (``.backend_tokenizer``) is the ``tokenizers.Tokenizer`` the file
    describes, unchanged. A special token the config names but the vocabulary lacks is left unset (transformers
    would add it as a new id past the model's embeddings), except the end-of-text, which every user of a tokenizer
    needs: a config naming one the vocabulary lacks is a ``ValueError``."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {str(path)!r}: expected a tokenizer.json file or a folder "
                                f"holding one (or --tokenizer train to train one)")
    try:
        engine = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise ValueError(f"{file}: not a valid tokenizers file ({e})") from None
    vocabulary, config, overrides = engine.get_vocab(), _config(file.parent), {}
    for key in SPECIAL_TOKEN_KEYS:
        token = _token_text(config.get(key))
        if token is None:
            continue
        if token not in vocabulary:
            if key == "eos_token":
                raise ValueError(f"{file.parent / CONFIG_NAME} names eos_token {token!r}, which {file} does not "
                                 f"have: name one of its tokens there")
            overrides[key] = None
        elif isinstance(config[key], dict):
            overrides[key] = token  # transformers reads only its own AddedToken records ("__type"), not any dict
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(file.parent), tokenizer_object=engine, **overrides)
    added = sorted(set(tokenizer.get_vocab()) - set(vocabulary))  # tokens of the config's other special lists
    if added:
        raise ValueError(f"the tokenizer config in {file.parent} names tokens {added} that {file} does not have")
    return tokenizer


def _config(folder: Path) -> dict:
    """The ``tokenizer_config.json`` in ``folder`` ({} if there is none)."""
    config = folder / CONFIG_NAME
    return json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}


def _token_text(value) -> str | None:
    """A special token of a tokenizer config as text (configs write it as text or as ``{"content": ...}``)."""
    return value.get("content") if isinstance(value, dict) else value


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int | None:
    """The id of ``token`` in the vocabulary, None if it has none (never the unknown token's id)."""
    return tokenizer.backend_tokenizer.token_to_id(token)


def find_eos(tokenizer: PreTrainedTokenizerFast, eos_token: str | None = None) -> tuple[str, int]:
    """``(token, id)`` of the end-of-text token: ``eos_token`` if given, else the tokenizer's configured one, else
    the first of ``EOS_CANDIDATES`` in the vocabulary."""
    candidates = [eos_token] if eos_token else [tokenizer.eos_token] if tokenizer.eos_token else list(EOS_CANDIDATES)
    for token in candidates:
        found = token_id(tokenizer, token)
        if found is not None:
            return token, found
    raise ValueError(f"the tokenizer has none of the end-of-text tokens {candidates}; name its token with "
                     f"--eos-token")


def find_document_start(tokenizer: PreTrainedTokenizerFast, eos_id: int) -> int:
    """The id a document starts after: the tokenizer's configured BOS (an imported checkpoint's, e.g. ``<s>``;
    ``load_tokenizer`` keeps only one the vocabulary has), else ``eos_id`` (linmem's tokenizers name their
    end-of-text as both, since training separates documents with it)."""
    return eos_id if tokenizer.bos_token is None else token_id(tokenizer, tokenizer.bos_token)


def special_token_ids(path: str | Path) -> dict[str, int]:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` of the tokenizer saved at ``path`` (a folder with
    ``tokenizer.json`` and ``tokenizer_config.json``, or the ``tokenizer.json`` file).

    The end-of-text as ``find_eos`` finds it; the beginning as ``find_document_start`` (the configured BOS, else the
    end-of-text, which starts every document in linmem's training); the configured pad token, else the end-of-text
    (so batched generation pads with a token the model knows)."""
    tokenizer = load_tokenizer(path)
    _, eos_id = find_eos(tokenizer)
    pad_id = None if tokenizer.pad_token is None else token_id(tokenizer, tokenizer.pad_token)
    return {"bos_token_id": find_document_start(tokenizer, eos_id), "eos_token_id": eos_id,
            "pad_token_id": eos_id if pad_id is None else pad_id}


def wrap_tokenizer(engine: Tokenizer, eos_token: str = EOS_TOKEN, pad_token: str | None = PAD_TOKEN,
                   bos_token: str | None = None) -> PreTrainedTokenizerFast:
    """``engine`` (a trained or given ``tokenizers.Tokenizer``) as linmem's tokenizer type, with these special
    tokens: ``pad_token`` and ``bos_token`` only if they are in the vocabulary, the BOS defaulting to the
    end-of-text (documents start after it in linmem's training). An ``eos_token`` the vocabulary lacks is a
    ``ValueError``."""
    from transformers import PreTrainedTokenizerFast

    if engine.token_to_id(eos_token) is None:
        raise ValueError(f"the tokenizer has no end-of-text token {eos_token!r}; name its token with --eos-token")
    pad = pad_token if pad_token and engine.token_to_id(pad_token) is not None else None
    bos = bos_token if bos_token and engine.token_to_id(bos_token) is not None else eos_token
    return PreTrainedTokenizerFast(tokenizer_object=engine, eos_token=eos_token, bos_token=bos, pad_token=pad)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Write ``tokenizer``'s ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` (``AutoTokenizer``-
    and ``load_tokenizer``-loadable; a trained engine is saved as ``wrap_tokenizer`` makes it). Each file is written
    atomically, never through a symbolic link (``ValueError``). Returns the path of ``tokenizer.json``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="linmem-tokenizer-") as staging:  # save_pretrained follows links
        tokenizer.save_pretrained(staging)
        for saved in sorted(Path(staging).iterdir()):
            write_bytes_atomic(tokenizer_file_path(out_dir, saved.name), saved.read_bytes())
    return out_dir / "tokenizer.json"


def tokenizer_file_path(out_dir: Path, name: str) -> Path:
    """Where the tokenizer's file ``name`` goes: through ``output_file`` in an output folder linmem marked (no
    write through a link, no replacing a user's file), else ``out_dir / name``."""
    return output_file(out_dir, name) if read_marker(out_dir) is not None else out_dir / name


def tokenizer_hash(tokenizer: PreTrainedTokenizerFast) -> str:
    """SHA-256 of the tokenizer engine's canonical JSON (keys sorted): equal hashes mean the same token ids."""
    canonical = json.dumps(json.loads(tokenizer.backend_tokenizer.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
