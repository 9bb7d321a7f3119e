"""Training-side contracts of the loss and the packed rows: the chunked loss is chosen automatically for large
vocabularies (its gradient, recall weighting included, is checked in tests/test_train.py);
``data.split_documents`` runs every document of a window as a sequence of its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from linmem.train import trainer
from linmem.train.config import LOSS_CHUNK_AUTO_BYTES, LOSS_CHUNK_TOKENS, loss_chunk_tokens, parse_config
from linmem.train.distributed import init_distributed
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)


def test_the_loss_is_chunked_when_the_logits_would_be_large(dataset):
    config = parse_config(tiny_config(dataset))
    seq_len = config.data.seq_len
    small_vocab = LOSS_CHUNK_AUTO_BYTES // (4 * seq_len * 4)  # 4 sequences of float32 logits fill the limit
    assert loss_chunk_tokens(config, 4, small_vocab) == 0
    assert loss_chunk_tokens(config, 4, small_vocab + 1) == LOSS_CHUNK_TOKENS
    config.train.loss_chunk_tokens = 0  # set: used as given
    assert loss_chunk_tokens(config, 4, 10 * small_vocab) == 0
    with pytest.raises(ValueError, match="train.loss_chunk_tokens must be >= 0"):
        parse_config(tiny_config(dataset, train={"loss_chunk_tokens": -1}))


@pytest.mark.parametrize("chunk", [0, 5])
def test_split_documents_gives_each_document_its_own_sequence(dataset, tmp_path, chunk):
    """With data.split_documents the trainer's per-token losses are those of every document of every row run
    alone (a document's last token, its separator, predicts the next document's first token from its own
    document only); a synthetic row's separator is a document of its own."""
    from linmem.ops.packing import document_starts

    config = parse_config(tiny_config(dataset, data={"seq_len": 96, "recall_fraction": 0.5, "split_documents": True},
                                      train={"micro_batch_size": 8, "loss_chunk_tokens": chunk}))
    run = trainer.setup(config, tmp_path, init_distributed("cpu"), "test")
    eos = run.data.shards.eos_id
    batch = run.data.batch(0, 0, 1, 8, 0, 1)
    ids, labels = batch["input_ids"], batch["labels"]
    inside = (ids[~batch["synthetic"], :-1] == eos).sum()
    assert inside > 0 and batch["synthetic"].any()  # text rows cross documents; synthetic rows open with EOS
    got = trainer.token_losses(run, ids, labels)
    with torch.no_grad():
        expected = []
        for row in ids:
            bounds = document_starts(row[None], eos).tolist()
            logits = torch.cat([run.model(input_ids=row[None, a:b]).logits[0] for a, b in zip(bounds, bounds[1:])])
            expected.append(logits)
        logits = torch.stack(expected)[:, :-1]
        targets = labels[:, 1:]
        want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
        whole_rows = dataclasses.replace(run, config=parse_config(tiny_config(
            dataset, data={"seq_len": 96, "recall_fraction": 0.5}, train={"micro_batch_size": 8})))
        mixed = trainer.token_losses(whole_rows, ids, labels)
    want = want.view(targets.shape)
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    # without the switch documents mix (an untrained model reads little context: far above rounding, still small)
    assert (mixed - want).abs().max() > 100 * (got.detach() - want).abs().max().clamp_min(1e-7)
