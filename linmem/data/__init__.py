"""Data: document sources, deterministic splits, tokenizers, token shards, training windows and synthetic recall.

The path of a corpus: ``Source.documents()`` -> ``split_of(source_id)`` -> tokenizer -> ``ShardWriter`` ->
``index.json`` (all in ``build_dataset``), then ``TokenShards(folder).split("train")`` -> ``TokenWindows`` (random
windows, resumable at any step) -> ``RecallMix`` (MQAR and other recall generators mixed in).
"""

from linmem.data.build import BuildOptions, build_dataset
from linmem.data.builtin import BUILTIN_SOURCES, BibleKJV, Shakespeare, StdlibDocs, open_source
from linmem.data.mixing import RecallMix
from linmem.data.shards import ShardWriter, SplitTokens, TokenShards
from linmem.data.sources import (
    DiskDataset,
    Document,
    Folder,
    JsonlFile,
    ParquetFile,
    Source,
    SourceUnavailable,
    TextFile,
    open_path,
)
from linmem.data.splits import SPLITS, SplitFractions, split_of
from linmem.data.synthetic import (
    GENERATORS,
    MQAR,
    RecallGenerator,
    RecallSample,
    check_sample,
    make_generator,
    register_generator,
)
from linmem.data.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    find_eos,
    load_tokenizer,
    save_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)
from linmem.data.windows import IGNORE_INDEX, TokenWindows, sequential_windows

__all__ = [
    "BUILTIN_SOURCES", "BibleKJV", "BuildOptions", "DiskDataset", "Document", "EOS_TOKEN", "Folder", "GENERATORS",
    "IGNORE_INDEX", "JsonlFile", "MQAR", "PAD_TOKEN", "ParquetFile", "RecallGenerator", "RecallMix", "RecallSample",
    "SPLITS", "Shakespeare", "ShardWriter", "Source", "SourceUnavailable", "SplitFractions", "SplitTokens",
    "StdlibDocs", "TextFile", "TokenShards", "TokenWindows", "build_dataset", "check_sample", "find_eos",
    "load_tokenizer", "make_generator", "open_path", "open_source", "register_generator", "save_tokenizer",
    "sequential_windows", "split_of", "tokenizer_hash", "train_tokenizer",
]
