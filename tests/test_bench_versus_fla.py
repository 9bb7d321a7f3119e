"""``python -m linmem.bench.versus_fla`` as a CPU dry run: a scaled-down paper shape, FLA's kernels replaced by the
float64-capable stand-ins of tests/test_fla_import.py (plus a short convolution that keeps a decoding cache and a
plain cross entropy for FLA's fused one), every part run; the tables and the JSON carry the raw numbers, the loss
column comes from the losses both models really had, and an out-of-memory error becomes an "OOM" cell."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.test_fla_import import fla_on_cpu  # noqa: F401  (fixture)

fla = pytest.importorskip("fla", exc_type=ImportError)

import fla.models.modeling_utils as fla_modeling  # noqa: E402
from fla.modules import ShortConvolution  # noqa: E402

from linmem.bench import versus_fla  # noqa: E402
from linmem.train.config import LOSS_CHUNK_TOKENS  # noqa: E402


def short_conv_with_cache(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None,
                          **unused):
    """``ShortConvolution.forward`` with FLA's decoding cache ``[B, D, W]`` (the last W inputs, newest last): the
    cache's last W − 1 inputs (zeros without one) stand before ``x [B, T, D]``; returns ``(y, new cache or None)``;
    a given cache is updated in place when no gradient is taken, as FLA's decoding step does."""
    assert mask is None and residual is None and cu_seqlens is None
    (batch, _, channels), width = x.shape, self.kernel_size[0]
    past = cache[..., 1:].to(x.dtype) if cache is not None else x.new_zeros(batch, channels, width - 1)
    inputs = torch.cat([past, x.transpose(1, 2)], dim=-1)  # [B, D, W − 1 + T]
    y = F.conv1d(inputs, self.weight, self.bias, groups=channels).transpose(1, 2)
    y = F.silu(y) if self.activation in ("silu", "swish") else y
    new_cache = inputs[..., -width:]
    if cache is not None and not torch.is_grad_enabled():
        cache.copy_(new_cache)
    return y, (new_cache if output_final_state else None)


@pytest.fixture
def fla_decodes_on_cpu(fla_on_cpu, monkeypatch):  # noqa: F811
    monkeypatch.setattr(ShortConvolution, "forward", short_conv_with_cache)
    monkeypatch.setattr(fla_modeling, "FusedCrossEntropyLoss",
                        lambda inplace_backward=True, reduction="mean": torch.nn.CrossEntropyLoss(reduction=reduction))


DRY_RUN = ["--device", "cpu", "--shapes", "GDN-340M", "--scaled", "32,2,64", "--batches", "2", "--seq-len", "12",
           "--steps", "2", "--warmup", "1", "--prefill-len", "16", "--decode-tokens", "3", "--decode-batches", "1,2"]


@pytest.mark.slow
def test_dry_run_reports_every_part_from_real_measurements(tmp_path, fla_decodes_on_cpu):
    report = versus_fla.main(DRY_RUN + ["--residual", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "versus_fla.json").read_text()) == json.loads(json.dumps(report))
    (train,) = report["train"]
    fla_cell, linmem_cell = train["fla"], train["linmem"]
    assert fla_cell["status"] == linmem_cell["status"] == "ok"
    assert len(fla_cell["losses"]) == len(linmem_cell["losses"]) == 3 and len(fla_cell["steps_ms"]) == 2
    # the same weights and batches, float32 on the CPU: the losses agree closely, step after step (training moves
    # them, so they are not all equal), and the column is their largest difference
    assert len(set(fla_cell["losses"])) == 3
    assert train["max_loss_difference"] == max(abs(a - b) for a, b in zip(fla_cell["losses"], linmem_cell["losses"]))
    assert train["max_loss_difference"] < 1e-4
    assert abs(fla_cell["losses"][0] - torch.log(torch.tensor(64.0)).item()) < 0.5  # FLA's init: near uniform
    (residual,) = report["residual"]
    assert residual["mixer"] == "rdn" and residual["residual"]["status"] == "ok"
    assert residual["base"] == linmem_cell
    (prefill,) = report["prefill"]
    assert prefill["fla"]["status"] == prefill["linmem"]["status"] == "ok" and len(prefill["fla"]["forwards_ms"]) == 2
    assert [row["batch"] for row in report["decode"]] == [1, 2]
    for row in report["decode"]:
        assert row["fla"]["status"] == row["linmem"]["status"] == "ok"
        assert torch.tensor(row["linmem"]["tokens"]).shape == (row["batch"], 3)
        for name in ("captured", "reused"):  # captured decoding, where linmem has it: the uncaptured greedy tokens
            assert row["linmem"][name] is None or row["linmem"][name]["agrees"]
        assert row["fla_token_agreement"] == 1.0  # float32, the same weights: FLA's greedy tokens
    markdown = (tmp_path / "versus_fla.md").read_text()
    for title in ("## Training step", "## Residual mixer", "## Prefill", "## Greedy decoding"):
        assert title in markdown
    assert f"{train['max_loss_difference']:.2e}" in markdown and f"{fla_cell['losses'][0]:.4f}" in markdown
    assert "python -m linmem.bench.versus_fla --device cpu" in markdown
    assert "Hopper" in markdown  # the bypass note


def test_out_of_memory_is_an_oom_cell_and_the_run_goes_on(tmp_path, fla_decodes_on_cpu, monkeypatch):
    measured = versus_fla.train_steps

    def linmem_runs_out_of_memory(model, *args):
        if isinstance(model, versus_fla.LinMemForCausalLM):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return measured(model, *args)

    monkeypatch.setattr(versus_fla, "train_steps", linmem_runs_out_of_memory)
    report = versus_fla.main(DRY_RUN + ["--parts", "train,prefill", "--out", str(tmp_path)])
    (train,) = report["train"]
    assert train["linmem"] == {"status": "OOM"} and train["fla"]["status"] == "ok"
    assert "max_loss_difference" not in train
    assert report["prefill"][0]["linmem"]["status"] == "ok"
    table = versus_fla.format_train(report["train"])
    assert "| OOM |" in table and table.splitlines()[-1].endswith("| – | whole |")


def test_budget_skips_and_lists_what_it_did_not_start(tmp_path, fla_decodes_on_cpu):
    report = versus_fla.main(DRY_RUN + ["--budget", "1e-9", "--out", str(tmp_path)])
    assert report["train"] == report["prefill"] == report["decode"] == []
    assert report["skipped"] == ["GDN-340M: write the FLA checkpoint"]
    assert "GDN-340M: write the FLA checkpoint" in (tmp_path / "versus_fla.md").read_text()


def test_the_trainers_loss_chunk_rule():
    assert versus_fla.trainer_loss_chunk_tokens(4, 2048, 32000) == 0  # 1.0e9 bytes of float32 logits: one piece
    assert versus_fla.trainer_loss_chunk_tokens(8, 2048, 32000) == LOSS_CHUNK_TOKENS
