"""Byte-level BPE tokenizers trained locally with ``tokenizers``, saved so ``AutoTokenizer`` loads them.

A saved tokenizer folder holds ``tokenizer.json`` (the whole tokenizer) and ``tokenizer_config.json`` (its class
and special tokens), as ``transformers``' ``save_pretrained`` writes them, so
``AutoTokenizer.from_pretrained(folder)`` works on a model folder that contains them. Byte-level BPE encodes any
text without unknown tokens and decodes it back exactly.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from linmem.io.atomic import write_bytes_atomic
from linmem.io.folders import output_file, read_marker

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# End-of-text spellings of common tokenizers, tried in order when a given tokenizer.json does not say.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BYTE_ALPHABET = 256


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


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a folder that contains one."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {str(path)!r}: expected a tokenizer.json file or a folder "
                                f"holding one (or --tokenizer train to train one)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise ValueError(f"{file}: not a valid tokenizers file ({e})") from None


def _configured_token(path: Path, key: str) -> str | None:
    """The special token ``key`` (``eos_token``, ``bos_token``) of a ``tokenizer_config.json`` beside ``path``."""
    config = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    if not config.is_file():
        return None
    token = json.loads(config.read_text(encoding="utf-8")).get(key)
    return token.get("content") if isinstance(token, dict) else token


def find_eos(tokenizer: Tokenizer, eos_token: str | None = None, path: str | Path | None = None) -> tuple[str, int]:
    """``(token, id)`` of the end-of-text token: ``eos_token`` if given, else the one in a
    ``tokenizer_config.json`` beside ``path``, else the first of ``EOS_CANDIDATES`` in the vocabulary."""
    candidates = [eos_token] if eos_token else []
    if not candidates and path is not None and (configured := _configured_token(Path(path), "eos_token")):
        candidates = [configured]
    candidates = candidates or list(EOS_CANDIDATES)
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    raise ValueError(f"the tokenizer has none of the end-of-text tokens {candidates}; name its token with "
                     f"--eos-token")


def find_document_start(tokenizer: Tokenizer, path: str | Path, eos_id: int) -> int:
    """The id a document starts after: the ``bos_token`` of a ``tokenizer_config.json`` beside ``path`` when the
    vocabulary has it (an imported checkpoint's, e.g. ``<s>``), else ``eos_id`` (linmem's tokenizers name their
    end-of-text as both, since training separates documents with it)."""
    configured = _configured_token(Path(path), "bos_token")
    token_id = tokenizer.token_to_id(configured) if configured else None
    return eos_id if token_id is None else token_id


def special_token_ids(path: str | Path) -> dict[str, int]:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` of the tokenizer saved at ``path`` (a folder with
    ``tokenizer.json`` and ``tokenizer_config.json``, or the ``tokenizer.json`` file).

    The end-of-text as ``find_eos`` finds it; the beginning as ``find_document_start`` (the configured BOS, else the
    end-of-text, which starts every document in linmem's training); the configured pad token when the vocabulary has
    it, else the end-of-text (so batched generation pads with a token the model knows)."""
    tokenizer = load_tokenizer(path)
    _, eos_id = find_eos(tokenizer, None, path)
    pad = _configured_token(Path(path), "pad_token")
    pad_id = tokenizer.token_to_id(pad) if pad else None
    return {"bos_token_id": find_document_start(tokenizer, path, eos_id), "eos_token_id": eos_id,
            "pad_token_id": eos_id if pad_id is None else pad_id}


def configured_tokens(path: str | Path) -> dict[str, str]:
    """The ``bos_token`` and ``pad_token`` a ``tokenizer_config.json`` beside ``path`` names (those it names)."""
    found = {key: _configured_token(Path(path), key) for key in ("bos_token", "pad_token")}
    return {key: token for key, token in found.items() if token}


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, eos_token: str = EOS_TOKEN,
                   pad_token: str | None = PAD_TOKEN, bos_token: str | None = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` (``AutoTokenizer``-loadable).

    ``pad_token`` and ``bos_token`` are used only if they are in the vocabulary; the BOS defaults to the
    end-of-text (documents start after it in linmem's training). Each file is written atomically, never through a
    symbolic link (``ValueError``). Returns the path of ``tokenizer.json``.
    """
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pad = pad_token if pad_token and tokenizer.token_to_id(pad_token) is not None else None
    bos = bos_token if bos_token and tokenizer.token_to_id(bos_token) is not None else eos_token
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token, bos_token=bos,
                                      pad_token=pad)
    with tempfile.TemporaryDirectory(prefix="linmem-tokenizer-") as staging:  # save_pretrained follows links
        wrapped.save_pretrained(staging)
        for saved in sorted(Path(staging).iterdir()):
            write_bytes_atomic(tokenizer_file_path(out_dir, saved.name), saved.read_bytes())
    return out_dir / "tokenizer.json"


def tokenizer_file_path(out_dir: Path, name: str) -> Path:
    """Where the tokenizer's file ``name`` goes: through ``output_file`` in an output folder linmem marked (no
    write through a link, no replacing a user's file), else ``out_dir / name``."""
    return output_file(out_dir, name) if read_marker(out_dir) is not None else out_dir / name


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON (keys sorted): equal hashes mean the same token ids."""
    canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
