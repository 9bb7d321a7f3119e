"""Data: document sources, deterministic splits, tokenizers, token shards, training windows and synthetic recall.

The path of a corpus: ``Source.documents()`` -> ``split_of(source_id)`` -> tokenizer -> ``ShardWriter`` ->
``index.json`` (all in ``build_dataset``), then ``TokenShards(folder).split("train")`` -> ``TokenWindows`` (random
windows, resumable at any step) -> ``RecallMix`` (MQAR and other recall generators mixed in).

The names below load with their module on first use (``linmem.io.lazy``), so that importing one light module of the
package (``linmem.data.commands``) does not import torch.
"""

from linmem.io.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "linmem.data.build": ("BuildOptions", "build_dataset"),
    "linmem.data.builtin": ("BUILTIN_SOURCES", "BibleKJV", "Shakespeare", "StdlibDocs", "open_source"),
    "linmem.data.mixing": ("RecallMix",),
    "linmem.data.shards": ("ShardWriter", "SplitTokens", "TokenShards"),
    "linmem.data.sources": ("DiskDataset", "Document", "Folder", "JsonlFile", "ParquetFile", "Source",
                            "SourceUnavailable", "TextFile", "open_path"),
    "linmem.data.splits": ("SPLITS", "SplitFractions", "split_of"),
    "linmem.data.synthetic": ("GENERATORS", "MQAR", "RecallGenerator", "RecallSample", "check_sample",
                              "make_generator", "register_generator"),
    "linmem.data.tokenizer": ("EOS_TOKEN", "PAD_TOKEN", "find_eos", "load_tokenizer", "save_tokenizer",
                              "tokenizer_hash", "train_tokenizer"),
    "linmem.data.windows": ("TokenWindows", "sequential_window_sources", "sequential_windows"),
})
