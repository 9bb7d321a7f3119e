"""``python -m linmem.bench.versus_fla`` as a CPU dry run: a scaled-down paper shape, FLA's kernels replaced by the
float64-capable stand-ins of tests/test_fla_import.py (plus a short convolution that keeps a decoding cache and a
plain cross entropy for FLA's fused one), every part run; the tables and the JSON carry the raw numbers, the loss
column comes from the losses both models really had, and an out-of-memory error becomes an "OOM" cell."""

from __future__ import annotations

import json
from types import SimpleNamespace

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
        assert row["first_difference"] is None and row["teacher_forced_agreement"] == 1.0
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


def test_without_fla_only_linmems_models_run_and_the_tables_say_so(tmp_path, fla_decodes_on_cpu, monkeypatch, capsys):
    measured = []

    def recording(original):
        def record(model, *args, **kwargs):
            measured.append(type(model).__name__)
            return original(model, *args, **kwargs)
        return record

    for name in ("train_steps", "prefill_forwards", "fla_decode", "linmem_decode"):
        monkeypatch.setattr(versus_fla, name, recording(getattr(versus_fla, name)))
    report = versus_fla.main(DRY_RUN + ["--no-fla", "--residual", "--decode-batches", "1", "--out", str(tmp_path)])
    assert measured and all(name == "LinMemForCausalLM" for name in measured)
    (train,) = report["train"]
    assert "fla" not in train and train["linmem"]["status"] == "ok" and "max_loss_difference" not in train
    assert report["residual"][0]["residual"]["status"] == "ok"
    assert "fla" not in report["prefill"][0] and report["prefill"][0]["linmem"]["status"] == "ok"
    assert "fla" not in report["decode"][0] and report["decode"][0]["linmem"]["status"] == "ok"
    assert report["settings"]["no_fla"] is True
    out = capsys.readouterr().out
    assert "] measuring GDN-340M train B=2 eager linmem" in out and "eager fla" not in out
    assert versus_fla.format_train(report["train"]).splitlines()[-1].startswith("| GDN-340M | 2 | 12 | eager | – |")


def test_budget_skips_and_lists_what_it_did_not_start(tmp_path, fla_decodes_on_cpu):
    report = versus_fla.main(DRY_RUN + ["--budget", "1e-9", "--out", str(tmp_path)])
    assert report["train"] == report["prefill"] == report["decode"] == []
    assert report["skipped"] == ["GDN-340M: write the FLA checkpoint"]
    assert "GDN-340M: write the FLA checkpoint" in (tmp_path / "versus_fla.md").read_text()


def test_the_trainers_loss_chunk_rule():
    assert versus_fla.trainer_loss_chunk_tokens(4, 2048, 32000) == 0  # 1.0e9 bytes of float32 logits: one piece
    assert versus_fla.trainer_loss_chunk_tokens(8, 2048, 32000) == LOSS_CHUNK_TOKENS



# ---------------------------------------------------------------------------------------------------------------
# Decode agreement: teacher-forced scoring, the row's summary, a deliberately perturbed linmem
# ---------------------------------------------------------------------------------------------------------------

class TokenTableModel(torch.nn.Module):
    """A stand-in causal model whose logits at a position are row ``table[token]`` of its own input token, so what
    each position predicts is known without running a network; ``logits_to_keep`` as transformers' models read it."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table  # [vocab, vocab]

    def forward(self, ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 0):
        logits = self.table[ids]  # [B, T, vocab]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_teacher_forced_scores_each_given_token_from_the_logits_before_it():
    torch.manual_seed(1)
    vocab, batch, prompt_len, count = 11, 3, 5, 6
    table = torch.randn(vocab, vocab, dtype=torch.float64)
    prompt = torch.randint(vocab, (batch, prompt_len))
    tokens = torch.randint(vocab, (batch, count))
    scored = versus_fla.teacher_forced(TokenTableModel(table), prompt, tokens)
    # the logits that predict new token k are those at the input token just before it
    before = torch.cat([prompt[:, -1:], tokens[:, :-1]], dim=1)  # [B, N]
    logits = table[before]  # [B, N, vocab]
    top2 = logits.topk(2, dim=-1).values
    assert scored["argmax"] == logits.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(scored["top"], dtype=torch.float64), top2[..., 0], atol=1e-6)
    assert torch.allclose(torch.tensor(scored["top2_margin"], dtype=torch.float64), top2[..., 0] - top2[..., 1],
                          atol=1e-6)
    below = top2[..., 0] - logits.gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(torch.tensor(scored["below_fla"], dtype=torch.float64), below, atol=1e-6)
    assert all(len(scored[key]) == batch and len(scored[key][0]) == count for key in scored)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dtype_spacing_is_the_gap_to_the_next_representable_number(dtype):
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for value in (0.3, 1.0, 1.9, 5.0, 17.25, -40.0, 1000.0):
        number = torch.tensor([abs(value)], dtype=dtype)
        following = (number.view(bits) + 1).view(dtype)  # the next representable number up
        assert versus_fla.dtype_spacing(value, dtype) == (following.double() - number.double()).item()


def test_decode_agreement_summarises_free_running_and_teacher_forced_differences():
    def forced(argmax, below, margin, top):
        return dict(argmax=argmax, below_fla=below, top2_margin=margin, top=top)

    fla = dict(tokens=[[1, 2, 3], [4, 5, 6]],
               teacher_forced=forced([[1, 2, 3], [4, 5, 7]], [[0, 0, 0], [0, 0, 0.5]],
                                     [[0.1, 0.2, 0.125], [0.0625, 0.3, 0.4]], [[1, 1, 5.0], [2.5, 1, 1]]))
    linmem = dict(tokens=[[1, 2, 9], [4, 7, 8]],
                  teacher_forced=forced([[1, 2, 9], [0, 5, 6]], [[0, 0, 0.25], [0.75, 0, 0]],
                                        [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], [[1, 1, 3.0], [-6.0, 1, 1]]))
    row = versus_fla.decode_agreement(fla, linmem, torch.bfloat16)
    assert row["fla_token_agreement"] == pytest.approx(3 / 6)
    assert row["first_differences"] == [2, 1] and row["first_difference"] == 1  # the earliest row's
    assert row["teacher_forced_agreement"] == pytest.approx(4 / 6)  # misses at (0, 2) and (1, 0)
    assert row["fla_teacher_forced_agreement"] == pytest.approx(5 / 6)  # FLA's own argmax left its token at (1, 2)
    assert row["disagreements"] == 2
    assert row["linmem_margin"] == dict(median=0.5, max=0.75)  # of 0.25 and 0.75
    assert row["fla_margin"] == dict(median=0.09375, max=0.125)  # of 0.125 and 0.0625
    assert row["rounding_spacing"] == 2.0**-5  # bfloat16 at |−6.0|, the largest top-1 logit at the misses
    equal = versus_fla.decode_agreement(fla, dict(linmem, tokens=fla["tokens"], teacher_forced=fla["teacher_forced"]),
                                        torch.bfloat16)
    assert equal["first_difference"] is None and equal["first_differences"] == [None, None]
    assert equal["fla_token_agreement"] == 1.0 and equal["disagreements"] == 1  # FLA's own miss at (1, 2)
    assert versus_fla._agreement_cells(equal)[:3] == ["100%", "none", "83% (83%)"]
    untested = versus_fla.decode_agreement(fla, {"tokens": linmem["tokens"]}, torch.bfloat16)  # FLA's cell failed
    assert "teacher_forced_agreement" not in untested and untested["first_difference"] == 1
    assert versus_fla._agreement_cells(untested) == ["50%", "token 1", "–", "–", "–", "–"]


DECODE_ONLY = DRY_RUN + ["--parts", "decode", "--decode-tokens", "4"]


def test_dry_run_decode_agrees_token_for_token_and_says_how_to_read_it(tmp_path, fla_decodes_on_cpu):
    report = versus_fla.main(DECODE_ONLY + ["--out", str(tmp_path)])
    for row in report["decode"]:
        for cell in (row["fla"], row["linmem"]):
            assert set(cell["teacher_forced"]) == {"argmax", "below_fla", "top2_margin", "top"}
            assert torch.tensor(cell["teacher_forced"]["argmax"]).shape == (row["batch"], 4)
        assert row["fla"]["teacher_forced"]["argmax"] == row["fla"]["tokens"]  # float32: FLA's own tokens
        assert row["fla_token_agreement"] == row["teacher_forced_agreement"] == 1.0
        assert row["first_difference"] is None and row["first_differences"] == [None] * row["batch"]
        assert row["disagreements"] == 0 and row["linmem_margin"] is row["fla_margin"] is None
    markdown = (tmp_path / "versus_fla.md").read_text()
    assert "| teacher-forced agree (FLA's own) |" in markdown
    assert "| 100% | none | 100% (100%) | – | – | – |" in markdown
    assert versus_fla.DECODE_RULE in markdown


def boost_linmem_at(new_token: int, boost: float):
    """A ``linmem_decode`` whose model adds ``boost`` to the logit of (its argmax + 1) at the position that predicts
    new token ``new_token``, in every forward: its generation and its teacher-forced scoring. Forward hooks track the
    absolute position: a forward of more than one token starts a sequence, a one-token forward extends it."""
    measured = versus_fla.linmem_decode

    def perturbed(model, prompt, *args, **kwargs):
        seen = dict(length=0)
        target = prompt.shape[1] + new_token - 1  # the absolute position whose logits predict that new token

        def count(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            seen["length"] = ids.shape[1] if ids.shape[1] > 1 else seen["length"] + 1

        def raise_a_wrong_token(module, inputs, logits):  # logits [B, L, vocab]: the last L positions
            index = target - (seen["length"] - logits.shape[1])
            if not 0 <= index < logits.shape[1]:
                return logits
            logits = logits.clone()
            wrong = (logits[:, index].argmax(-1) + 1) % logits.shape[-1]
            logits[torch.arange(logits.shape[0]), index, wrong] += boost
            return logits

        model.register_forward_pre_hook(count, with_kwargs=True)
        model.lm_head.register_forward_hook(raise_a_wrong_token)
        return measured(model, prompt, *args, **kwargs)

    return perturbed


def test_a_perturbed_linmem_disagrees_where_it_was_perturbed(tmp_path, fla_decodes_on_cpu, monkeypatch):
    monkeypatch.setattr(versus_fla, "linmem_decode", boost_linmem_at(1, 1e3))
    report = versus_fla.main(DECODE_ONLY)
    for row in report["decode"]:
        batch = row["batch"]
        assert row["first_difference"] == 1 and row["first_differences"] == [1] * batch
        assert row["fla_token_agreement"] <= 0.75
        # on FLA's prefix only new token 1 was pushed off FLA's token; tokens 2 and 3 agree again
        assert row["teacher_forced_agreement"] == 0.75 and row["fla_teacher_forced_agreement"] == 1.0
        assert row["disagreements"] == batch
        linmem_forced, fla_forced = row["linmem"]["teacher_forced"], row["fla"]["teacher_forced"]
        assert [argmax[1] != token[1] for argmax, token in zip(linmem_forced["argmax"], row["fla"]["tokens"])] == \
            [True] * batch
        assert 999 < row["linmem_margin"]["median"] <= row["linmem_margin"]["max"] < 1001  # the boost, not a tie
        fla_margins = [margins[1] for margins in fla_forced["top2_margin"]]
        assert row["fla_margin"]["max"] == pytest.approx(max(fla_margins)) and 0 < max(fla_margins) < 1
        tops = [abs(top[1]) for forced in (linmem_forced, fla_forced) for top in forced["top"]]
        assert row["rounding_spacing"] == versus_fla.dtype_spacing(max(tops), torch.float32)
    assert "| token 1 | 75% (100%) |" in versus_fla.format_decode(report["decode"])


def test_without_flas_tokens_linmem_skips_the_teacher_forced_check(fla_decodes_on_cpu, monkeypatch):
    def fla_fails(*args):
        raise RuntimeError("FLA's decoding broke")

    monkeypatch.setattr(versus_fla, "fla_decode", fla_fails)
    report = versus_fla.main(DECODE_ONLY + ["--decode-batches", "1"])
    (row,) = report["decode"]
    assert row["fla"]["status"].startswith("RuntimeError") and row["linmem"]["status"] == "ok"
    assert "teacher_forced" not in row["linmem"] and "fla_token_agreement" not in row
    assert versus_fla.format_decode([row]).splitlines()[-1].endswith("| – | – | – | – | – | – |")


def test_a_failing_teacher_forced_check_keeps_the_cells_speeds(fla_decodes_on_cpu, monkeypatch):
    def scoring_fails(model, prompt, tokens):
        raise torch.OutOfMemoryError("no room for the logits")

    monkeypatch.setattr(versus_fla, "teacher_forced", scoring_fails)
    report = versus_fla.main(DECODE_ONLY + ["--decode-batches", "1"])
    (row,) = report["decode"]
    for cell in (row["fla"], row["linmem"]):
        assert cell["status"] == "ok" and cell["tokens_per_s"] > 0
        assert cell["teacher_forced"] == {"error": "OutOfMemoryError: no room for the logits"}
    assert row["fla_token_agreement"] == 1.0 and "teacher_forced_agreement" not in row
