"""One tokenizer loader, one tokenizer type: every way linmem opens a tokenizer gives a transformers
``PreTrainedTokenizerFast`` whose token ids are those of the ``tokenizer.json`` engine it was read from (what the
loaders returned before), for the zoo's tokenizer and for an imported checkpoint's Llama-style one; a config that
names special tokens the vocabulary lacks never grows the vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

import linmem
from linmem.data.tokenizer import find_document_start, find_eos, load_tokenizer, special_token_ids, tokenizer_hash
from linmem.eval.loading import EvalModel, load_model
from linmem.memory.probe import load_model_dir
from linmem.models.loading import open_model

TEXTS = ["The secret number of Alice is 4821.", "  two  spaces , a comma ; and\ttabs\n\nnew lines",
         "ünïcode ✓ and emoji 🙂 mixed with ASCII", "<|endoftext|> spelled out in text", "", " x",
         "def f(x):\n    return x ** 2  # code"]


def zoo_folder() -> Path:
    if "gdn" not in linmem.zoo.names():
        pytest.skip("zoo model gdn is not shipped in this checkout")
    return linmem.zoo.path("gdn")


def llama_style(folder: Path, seed: int) -> Tokenizer:
    """A tokenizer folder shaped like an imported Llama checkpoint's: ``<unk>``, ``<s>``, ``</s>``, a metaspace
    pre-tokenizer, a post-processor that puts ``<s>`` first, and a slow-class config naming its special tokens."""
    rng = np.random.default_rng(seed)
    words = "river stone light water house bread field glass horse paper chair table sword crown".split()
    texts = [" ".join(rng.choice(words, 40)) + " 0123 ünïcode ✓." for _ in range(200)]
    engine = Tokenizer(models.BPE(unk_token="<unk>"))
    engine.pre_tokenizer = pre_tokenizers.Metaspace()
    engine.decoder = decoders.Metaspace()
    engine.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    engine.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True)
    engine.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None, "model_max_length": 2048,
              "clean_up_tokenization_spaces": False, "legacy": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return engine


def test_every_loader_gives_the_one_tokenizer_type(tmp_path):
    """The zoo's ``load``, ``open_model`` (every command), the eval's and the probe's loaders, ``load_tokenizer``
    on a folder or its file, and a model folder holding only ``tokenizer.json`` (as FLA imports and Hub snapshots
    copy it): one type, one vocabulary."""
    folder = zoo_folder()
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("tokenizer_config.json", "manifest.json"))
    found = {"zoo.load": linmem.zoo.load("gdn")[1], "open_model": open_model("zoo:gdn")[1],
             "eval": load_model("zoo:gdn", device="cpu").tokenizer, "probe": load_model_dir("zoo:gdn", "cpu")[1],
             "folder": load_tokenizer(folder), "file": load_tokenizer(folder / "tokenizer.json"),
             "tokenizer.json only": open_model(bare)[1]}
    assert {name: type(t) for name, t in found.items()} == {name: PreTrainedTokenizerFast for name in found}
    assert len({tokenizer_hash(t) for t in found.values()}) == 1
    assert {find_eos(t) for t in found.values()} == {("<|endoftext|>", 0)}
    assert found["folder"].pad_token == "<|pad|>" and found["tokenizer.json only"].pad_token is None


@pytest.mark.parametrize("kind", ["zoo", "imported"])
def test_token_ids_are_the_engines(kind, tmp_path):
    """Encoding and decoding through the loaded tokenizer give exactly what its ``tokenizer.json`` engine gives
    (the type the loaders returned before), with and without the post-processor's special tokens."""
    if kind == "zoo":
        folder = zoo_folder()
        engine = Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:
        folder = tmp_path / "imported"
        engine = llama_style(folder, seed=int(np.random.SeedSequence().entropy % 2**32))
    tokenizer = load_tokenizer(folder)
    assert tokenizer_hash(tokenizer) == tokenizer_hash(PreTrainedTokenizerFast(tokenizer_object=engine))
    assert len(tokenizer) == engine.get_vocab_size(with_added_tokens=True)
    em = EvalModel(None, tokenizer, folder, None, find_eos(tokenizer)[1])
    for text in TEXTS:
        ids = engine.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, add_special_tokens=False) == em.encode(text) == ids, text
        assert tokenizer.encode(text) == engine.encode(text).ids, text
        assert em.decode(ids) == engine.decode(ids, skip_special_tokens=False), text
    if kind == "imported":
        assert tokenizer.encode("river")[0] == 1 and em.encode("river")[0] != 1  # <s> only with special tokens
        assert (find_eos(tokenizer), find_document_start(tokenizer, 2)) == (("</s>", 2), 1)
        assert special_token_ids(folder) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_a_config_naming_tokens_the_vocabulary_lacks_never_grows_it(tmp_path):
    """transformers adds a configured special token missing from the vocabulary as a new id past the model's
    embeddings; the loader leaves such a BOS or pad unset, and refuses a missing end-of-text or extra token."""
    folder = tmp_path / "imported"
    engine = llama_style(folder, seed=0)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<bos>", "pad_token": "<pad>"}))
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.bos_token, tokenizer.pad_token, len(tokenizer)) == (None, None, engine.get_vocab_size())
    assert find_document_start(tokenizer, 2) == 2
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<eos>"}))
    with pytest.raises(ValueError, match="names eos_token '<eos>'"):
        load_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "additional_special_tokens": ["<x>"]}))
    with pytest.raises(ValueError, match=r"names tokens \['<x>'\] that"):
        load_tokenizer(folder)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizers file"):
        load_tokenizer(folder)
    with pytest.raises(FileNotFoundError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "absent")
