"""``python -m linmem.bench.versus_fla`` as a CPU dry run: a scaled-down paper shape, FLA's kernels replaced by the
float64-capable stand-ins of tests/test_fla_import.py (plus a short convolution that keeps a decoding cache and a
plain cross entropy for FLA's fused one), every part run; the tables and the JSON carry the raw numbers, the loss
column comes from the losses both models really had, and an out-of-memory error becomes an "OOM" cell."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.test_fla_import import fla_on_cpu  # noqa: F401  (fixture)

fla = pytest.importorskip("fla", exc_type=ImportError)

import fla.models.modeling_utils as fla_modeling  # noqa: E402
from fla.modules import ShortConvolution  # noqa: E402

from linmem.bench import versus_fla, versus_fla_report  # noqa: E402
from linmem.bench.step_profile import table_name  # noqa: E402
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
    table = versus_fla_report.format_train(report["train"])
    assert "| OOM |" in table and table.splitlines()[-1].endswith("| – | whole |")
    assert "rounds" not in train and "per round" not in table  # one round: the table as it always was


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
    last = versus_fla_report.format_train(report["train"]).splitlines()[-1]
    assert last.startswith("| GDN-340M | 2 | 12 | eager | – |")


def test_budget_skips_and_lists_what_it_did_not_start(tmp_path, fla_decodes_on_cpu):
    report = versus_fla.main(DRY_RUN + ["--budget", "1e-9", "--out", str(tmp_path)])
    assert report["train"] == report["prefill"] == report["decode"] == []
    assert report["skipped"] == ["GDN-340M: write the FLA checkpoint"]
    assert "GDN-340M: write the FLA checkpoint" in (tmp_path / "versus_fla.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# --rounds: every cell measured several times in ABBA order
# ---------------------------------------------------------------------------------------------------------------

def who_is(model: torch.nn.Module) -> str:
    """Which cell of a row ``model`` is: FLA's own model, linmem's import (GDN) or its residual mixer (RDN)."""
    if not isinstance(model, versus_fla.LinMemForCausalLM):
        return "fla"
    return "residual" if model.config.mixer == "rdn" else "linmem"


def recording(monkeypatch, name: str, fail_at: int | None = None) -> list[tuple[str, dict]]:
    """Wrap ``versus_fla.<name>`` (a measurement taking the model first) so that every call appends (who, its
    result) to the returned list; the call numbered ``fail_at`` (from 0) runs out of memory instead."""
    calls, measured = [], getattr(versus_fla, name)

    def record(model, *args, **kwargs):
        if len(calls) == fail_at:
            calls.append((who_is(model), None))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        result = measured(model, *args, **kwargs)
        calls.append((who_is(model), result))
        return result

    monkeypatch.setattr(versus_fla, name, record)
    return calls


def rounds_of(calls: list[tuple[str, dict]], who: str) -> list[dict]:
    return [result for name, result in calls if name == who]


ROUNDS = DRY_RUN + ["--steps", "3", "--rounds", "2"]


@pytest.mark.slow
def test_rounds_measure_each_cell_in_abba_order_and_pool_their_steps(tmp_path, fla_decodes_on_cpu, monkeypatch):
    trained = recording(monkeypatch, "train_steps")
    forwarded = recording(monkeypatch, "prefill_forwards")
    report = versus_fla.main(ROUNDS + ["--parts", "train,prefill", "--residual", "--out", str(tmp_path)])
    assert [who for who, _ in trained] == ["fla", "linmem", "residual", "residual", "linmem", "fla"]
    assert [who for who, _ in forwarded] == ["fla", "linmem", "linmem", "fla"]
    (train,), (residual,), (prefill,) = report["train"], report["residual"], report["prefill"]
    cells = dict(fla=train["fla"], linmem=train["linmem"], residual=residual["residual"])
    for who, cell in cells.items():
        first, second = rounds_of(trained, who)
        assert cell["status"] == "ok"
        assert cell["steps_ms"] == first["steps_ms"] + second["steps_ms"] and len(cell["steps_ms"]) == 6
        assert cell["step_ms"] == statistics.median(first["steps_ms"] + second["steps_ms"])
        assert cell["rounds_ms"] == [first["step_ms"], second["step_ms"]]
        assert cell["losses"] == first["losses"]
        assert cell["max_round_loss_difference"] == max(abs(a - b) for a, b in zip(first["losses"],
                                                                                   second["losses"]))
        assert cell["max_round_loss_difference"] < 1e-5  # the same weights and batches, float32: deterministic
    assert residual["base"] == train["linmem"]
    assert train["rounds"] == {"fla": 2, "linmem": 2} and residual["rounds"] == {"base": 2, "residual": 2}
    fla_ms, linmem_ms, residual_ms = (cells[who]["rounds_ms"] for who in ("fla", "linmem", "residual"))
    assert train["rounds_ratio"] == [linmem_ms[0] / fla_ms[0], linmem_ms[1] / fla_ms[1]]
    assert residual["rounds_ratio"] == [residual_ms[0] / linmem_ms[0], residual_ms[1] / linmem_ms[1]]
    assert train["max_loss_difference"] == max(abs(a - b) for a, b in zip(cells["fla"]["losses"],
                                                                         cells["linmem"]["losses"]))
    for who in ("fla", "linmem"):
        first, second = rounds_of(forwarded, who)
        assert prefill[who]["forwards_ms"] == first["forwards_ms"] + second["forwards_ms"]
        assert prefill[who]["ms"] == statistics.median(prefill[who]["forwards_ms"])
        assert prefill[who]["rounds_ms"] == [first["ms"], second["ms"]]
    assert prefill["rounds"] == {"fla": 2, "linmem": 2}
    assert prefill["rounds_ratio"] == [prefill["linmem"]["rounds_ms"][r] / prefill["fla"]["rounds_ms"][r]
                                       for r in range(2)]
    markdown = (tmp_path / "versus_fla.md").read_text()
    assert "2 rounds, ABBA order" in markdown
    for rows, row, after in (
            (versus_fla_report.format_train, train, "| linmem / FLA | per round | FLA peak GiB |"),
            (versus_fla_report.format_residual, residual, "| residual / base | per round | base peak GiB |"),
            (versus_fla_report.format_prefill, prefill, "| linmem / FLA | per round | FLA peak GiB |")):
        table = rows([row])
        assert after in table and table in markdown
        assert f"x | {row['rounds_ratio'][0]:.2f}, {row['rounds_ratio'][1]:.2f} | " in table


@pytest.mark.parametrize("rounds, fail_at, order", [
    (2, 2, ["fla", "linmem", "linmem", "fla"]),  # linmem's second round fails, after an ok first one
    (3, 1, ["fla", "linmem", "fla", "fla"]),  # linmem's first round fails: it is not measured again
])
def test_a_round_out_of_memory_makes_the_cell_oom(fla_decodes_on_cpu, monkeypatch, rounds, fail_at, order):
    trained = recording(monkeypatch, "train_steps", fail_at=fail_at)
    report = versus_fla.main(ROUNDS + ["--parts", "train", "--rounds", str(rounds)])
    assert [who for who, _ in trained] == order
    (train,) = report["train"]
    assert train["linmem"] == {"status": "OOM"}
    assert train["fla"]["status"] == "ok" and len(train["fla"]["rounds_ms"]) == rounds
    assert train["rounds"] == {"fla": rounds, "linmem": order.count("linmem") - 1}  # the ok rounds before the OOM
    assert "rounds_ratio" not in train and "max_loss_difference" not in train
    row = versus_fla_report.format_train(report["train"]).splitlines()[-1]
    assert "| OOM | – | – |" in row  # linmem's time, the ratio, the per-round ratios


def test_a_budget_cut_keeps_the_rounds_measured_so_far(fla_decodes_on_cpu, monkeypatch):
    trained = recording(monkeypatch, "train_steps")
    may_start = versus_fla.Run.may_start

    def spent_after_four_trainings(self, what):
        if len(trained) == 4:
            self.deadline = self.started  # the budget is spent from here on
        return may_start(self, what)

    monkeypatch.setattr(versus_fla.Run, "may_start", spent_after_four_trainings)
    report = versus_fla.main(ROUNDS + ["--parts", "train", "--residual"])
    assert [who for who, _ in trained] == ["fla", "linmem", "residual", "residual"]
    assert report["skipped"] == ["GDN-340M train B=2 eager linmem round 2/2", "GDN-340M train B=2 eager fla round 2/2"]
    (train,), (residual,) = report["train"], report["residual"]
    assert train["rounds"] == {"fla": 1, "linmem": 1} and residual["rounds"] == {"base": 1, "residual": 2}
    assert train["fla"]["rounds_ms"] == [rounds_of(trained, "fla")[0]["step_ms"]]
    assert train["fla"]["max_round_loss_difference"] is None  # one round: nothing to compare
    assert len(residual["residual"]["rounds_ms"]) == 2
    assert train["rounds_ratio"] == [train["linmem"]["rounds_ms"][0] / train["fla"]["rounds_ms"][0]]
    assert residual["rounds_ratio"] == [residual["residual"]["rounds_ms"][0] / train["linmem"]["rounds_ms"][0]]


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit, match="--rounds"):
        versus_fla.main(DRY_RUN + ["--rounds", "0"])


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
    assert versus_fla_report._agreement_cells(equal)[:3] == ["100%", "none", "83% (83%)"]
    untested = versus_fla.decode_agreement(fla, {"tokens": linmem["tokens"]}, torch.bfloat16)  # FLA's cell failed
    assert "teacher_forced_agreement" not in untested and untested["first_difference"] == 1
    assert versus_fla_report._agreement_cells(untested) == ["50%", "token 1", "–", "–", "–", "–"]
    # a stored record made before the first difference was kept (docs/benchmarks/versus_fla-decode.json's rows)
    older = {"fla_token_agreement": untested["fla_token_agreement"]}
    assert versus_fla_report._agreement_cells(older) == ["50%", "not recorded", "–", "–", "–", "–"]


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
    assert versus_fla_report.DECODE_RULE in markdown


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
    assert "| token 1 | 75% (100%) |" in versus_fla_report.format_decode(report["decode"])


def test_without_flas_tokens_linmem_skips_the_teacher_forced_check(fla_decodes_on_cpu, monkeypatch):
    def fla_fails(*args):
        raise RuntimeError("FLA's decoding broke")

    monkeypatch.setattr(versus_fla, "fla_decode", fla_fails)
    report = versus_fla.main(DECODE_ONLY + ["--decode-batches", "1"])
    (row,) = report["decode"]
    assert row["fla"]["status"].startswith("RuntimeError") and row["linmem"]["status"] == "ok"
    assert "teacher_forced" not in row["linmem"] and "fla_token_agreement" not in row
    assert versus_fla_report.format_decode([row]).splitlines()[-1].endswith("| – | – | – | – | – | – |")


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


# ---------------------------------------------------------------------------------------------------------------
# --profile: where the residual mixer's extra time goes
# ---------------------------------------------------------------------------------------------------------------

PROFILED = DRY_RUN + ["--parts", "train", "--residual"]
PROFILE_KEYS = {"steps", "kinds", "top", "by_name", "total_ms"}


def table_after(text: str, header_start: str) -> list[list[str]]:
    """The body rows (cells stripped, backticks dropped) of the first Markdown table in ``text`` whose header line
    starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split(" | ")])
    return rows


def test_profile_keeps_every_kernels_time_and_shows_where_the_residual_time_goes(tmp_path, fla_decodes_on_cpu):
    report = versus_fla.main(PROFILED + ["--profile", "1", "--out", str(tmp_path)])
    (train,), (residual,) = report["train"], report["residual"]
    assert residual["base"] == train["linmem"]
    for cell in (train["fla"], train["linmem"], residual["residual"]):
        assert cell["status"] == "ok" and len(cell["steps_ms"]) == 2 and len(cell["losses"]) == 3  # not timed
        profile = cell["profile"]
        assert set(profile) == PROFILE_KEYS and profile["steps"] == 1
        by_name, total = profile["by_name"], profile["total_ms"]
        assert len(by_name) > versus_fla_report.PROFILE_TOP  # every operator, not only the ranked ones
        assert sum(entry["ms_per_step"] for entry in by_name.values()) == pytest.approx(total, rel=1e-12)
        # the shares were taken over the whole step by the profiler: by_name's total is that whole step
        for row in profile["top"]:
            assert row["ms_per_step"] == by_name[row["name"]]["ms_per_step"]
            assert row["share"] == pytest.approx(row["ms_per_step"] / total, rel=1e-9)
        assert len(profile["top"]) == versus_fla_report.PROFILE_TOP
        ms = versus_fla_report.kinds_ms(by_name)
        assert all(ms[kind] == pytest.approx(share * total, rel=1e-9, abs=1e-12)
                   for kind, share in profile["kinds"].items())
    assert report["settings"]["profile"] == 1 and any("host's gap" in note for note in report["notes"])
    markdown = (tmp_path / "versus_fla.md").read_text()
    section = markdown.split("## Where the residual mixer's extra time goes")[1].split("\n## ")[0]
    assert versus_fla_report.PROFILE_RULE in section
    assert "### GDN-340M B=2 T=12 eager: rdn against linmem's import (profiled steps: 1)" in section
    base, other = residual["base"], residual["residual"]
    one, two = base["profile"], other["profile"]
    assert (f"busy per step: base {one['total_ms']:.3f} ms, residual {two['total_ms']:.3f} ms, residual − base "
            f"{two['total_ms'] - one['total_ms']:+.3f} ms") in section
    assert (f"wall − busy per step (the host's gap): base {base['step_ms']:.3f} − {one['total_ms']:.3f} = "
            f"{base['step_ms'] - one['total_ms']:.3f} ms, residual {other['step_ms']:.3f} − {two['total_ms']:.3f} = "
            f"{other['step_ms'] - two['total_ms']:.3f} ms") in section
    assert f"| busy (all) | {one['total_ms']:.3f} | {two['total_ms']:.3f} |" in section
    rows = table_after(section, "| kernel or operator |")
    assert len(rows) == versus_fla_report.PROFILE_TOP
    absent = dict(ms_per_step=0.0, calls_per_step=0)
    differences = []
    for name, _, base_ms, residual_ms, difference, calls in rows:
        a, b = one["by_name"].get(name, absent), two["by_name"].get(name, absent)
        assert (base_ms, residual_ms) == (f"{a['ms_per_step']:.3f}", f"{b['ms_per_step']:.3f}")
        assert difference == f"{b['ms_per_step'] - a['ms_per_step']:+.3f}"
        assert calls == f"{a['calls_per_step']:g} / {b['calls_per_step']:g}"
        differences.append(abs(b["ms_per_step"] - a["ms_per_step"]))
    assert differences == sorted(differences, reverse=True)
    every = {name: abs(two["by_name"].get(name, absent)["ms_per_step"]
                       - one["by_name"].get(name, absent)["ms_per_step"])
             for name in one["by_name"].keys() | two["by_name"].keys()}
    shown = versus_fla_report.PROFILE_TOP
    assert differences[-1] >= sorted(every.values(), reverse=True)[shown - 1]  # the largest shown
    kinds = markdown.split("## Training step by kind: FLA against linmem")[1].split("\n## ")[0]
    assert "| kind | FLA ms/step | linmem ms/step | linmem − FLA ms |" in kinds
    assert f"| busy (all) | {train['fla']['profile']['total_ms']:.3f} | {train['linmem']['profile']['total_ms']:.3f}" \
        in kinds


def test_without_profile_no_cell_is_profiled_and_the_report_has_no_profile_section(tmp_path, fla_decodes_on_cpu):
    report = versus_fla.main(PROFILED + ["--no-fla", "--out", str(tmp_path)])
    (train,), (residual,) = report["train"], report["residual"]
    assert "profile" not in train["linmem"] and "profile" not in residual["residual"]
    assert "profile" not in report["settings"] and not any("profile" in note for note in report["notes"])
    markdown = (tmp_path / "versus_fla.md").read_text()
    assert "## Where the residual mixer's extra time goes" not in markdown and "by kind" not in markdown
    assert versus_fla_report.PROFILE_RULE not in markdown


def test_with_rounds_only_the_first_round_of_each_cell_is_profiled(fla_decodes_on_cpu, monkeypatch):
    trained = recording(monkeypatch, "train_steps")
    report = versus_fla.main(ROUNDS + ["--parts", "train", "--residual", "--profile", "1"])
    assert [who for who, _ in trained] == ["fla", "linmem", "residual", "residual", "linmem", "fla"]
    for who in ("fla", "linmem", "residual"):
        first, second = rounds_of(trained, who)
        assert set(first["profile"]) == PROFILE_KEYS and "profile" not in second
    (train,), (residual,) = report["train"], report["residual"]
    assert train["fla"]["profile"] == rounds_of(trained, "fla")[0]["profile"]
    assert residual["residual"]["profile"] == rounds_of(trained, "residual")[0]["profile"]
    assert "### GDN-340M B=2 T=12 eager: rdn" in versus_fla_report.format_residual_profiles(report["residual"])


def test_a_failing_profile_keeps_the_cells_timings(fla_decodes_on_cpu, monkeypatch):
    def profiling_fails(*args, **kwargs):
        raise torch.OutOfMemoryError("no room for the trace")

    monkeypatch.setattr(versus_fla, "profile_steps", profiling_fails)
    report = versus_fla.main(PROFILED + ["--no-fla", "--profile", "2"])
    (residual,) = report["residual"]
    for cell in (residual["base"], residual["residual"]):
        assert cell["status"] == "ok" and len(cell["steps_ms"]) == 2
        assert cell["profile"] == {"steps": 2, "error": "OutOfMemoryError: no room for the trace"}
    section = versus_fla_report.format_residual_profiles(report["residual"])
    assert "- GDN-340M B=2 T=12 eager residual: profiling failed: OutOfMemoryError" in section
    assert "###" not in section and versus_fla_report.PROFILE_RULE not in section


def by_name(**entries: tuple[float, float, str]) -> dict[str, dict]:
    return {name: dict(ms_per_step=ms, calls_per_step=calls, kind=kind) for name, (ms, calls, kind) in entries.items()}


def test_profile_difference_counts_a_missing_name_as_zero_and_ranks_by_the_size_of_the_difference():
    base = by_name(mm=(10.0, 4, "matmul"), mul=(3.0, 20, "other"), gone=(0.5, 1, "other"),
                   adam=(1.0, 1, "optimizer"))
    residual = by_name(mm=(12.5, 6, "matmul"), mul=(1.0, 10, "other"), output_kernel=(2.0, 8, "linmem kernels"),
                       adam=(1.0, 1, "optimizer"))
    rows = versus_fla_report.profile_difference(base, residual)
    assert [(r["name"], r["difference_ms"]) for r in rows] == [
        ("mm", 2.5), ("mul", -2.0), ("output_kernel", 2.0), ("gone", -0.5), ("adam", 0.0)]  # ties: by name
    new, gone = rows[2], rows[3]
    assert (new["base_ms"], new["other_ms"], new["base_calls"], new["other_calls"], new["kind"]) == \
        (0.0, 2.0, 0, 8, "linmem kernels")
    assert (gone["base_ms"], gone["other_ms"], gone["base_calls"], gone["other_calls"], gone["kind"]) == \
        (0.5, 0.0, 1, 0, "other")
    table = versus_fla_report.format_difference(dict(by_name=base), dict(by_name=residual), top=3)
    assert table.splitlines()[2:] == ["| `mm` | matmul | 10.000 | 12.500 | +2.500 | 4 / 6 |",
                                      "| `mul` | other | 3.000 | 1.000 | -2.000 | 20 / 10 |",
                                      "| `output_kernel` | linmem kernels | 0.000 | 2.000 | +2.000 | 0 / 8 |"]
    assert versus_fla_report.kinds_ms(residual) == {"matmul": 12.5, "linmem kernels": 2.0, "linmem blocks": 0.0,
                                                    "attention": 0.0, "optimizer": 1.0, "communication": 0.0,
                                                    "other": 1.0}
    kinds = versus_fla_report.format_kinds_against(dict(by_name=base, total_ms=14.5),
                                                   dict(by_name=residual, total_ms=16.5), "base", "residual")
    assert "| matmul | 10.000 | 12.500 | +2.500 |" in kinds and "| other | 3.500 | 1.000 | -2.500 |" in kinds
    assert kinds.splitlines()[-1] == "| busy (all) | 14.500 | 16.500 | +2.000 |"
    long = "k" * 100 + "|x"
    assert table_name(long, versus_fla_report.NAME_WIDTH) == "`" + "k" * 89 + "…`"
    assert table_name("a|b") == "`a\\|b`"


def test_profile_must_not_be_negative():
    with pytest.raises(SystemExit, match="--profile"):
        versus_fla.main(DRY_RUN + ["--profile", "-1"])


def test_options_set_every_row_for_the_run_and_say_so(tmp_path, monkeypatch, fla_decodes_on_cpu):
    """``--options`` changes the op's launch options in every row before any work, and the report's notes and
    settings say so; an unknown kernel or option stops the run before any work."""
    from linmem.ops.triton import function

    for key, row in function.KERNEL_OPTIONS.items():  # put back after the test
        monkeypatch.setitem(function.KERNEL_OPTIONS, key, dict(row))
    for bad in ('{"nope": {}}', '{"forward": {"NOPE": 1}}', '{"recompute_states": "sometimes"}', "[1]"):
        with pytest.raises(SystemExit, match="--options"):
            versus_fla.main(DRY_RUN + ["--options", bad, "--budget", "1e-9"])
    options = '{"forward": {"FUSED": true, "BV": 16}, "recompute_states": "writes"}'
    report = versus_fla.main(DRY_RUN + ["--options", options, "--budget", "1e-9", "--out", str(tmp_path)])
    assert all(row["forward"]["FUSED"] is True and row["forward"]["BV"] == 16 and row["recompute_states"] == "writes"
               for row in function.KERNEL_OPTIONS.values())
    assert report["settings"]["kernel_options"] == json.loads(options)
    assert any("--options" in note and '"FUSED": true' in note for note in report["notes"])


def test_recompute_states_option_sets_every_row_for_the_run_and_says_so(monkeypatch):
    from linmem.ops.triton import function

    for row in function.KERNEL_OPTIONS.values():  # put back after the test
        monkeypatch.setitem(row, "recompute_states", row["recompute_states"])
    note = versus_fla.set_recompute_states("base")
    assert all(row["recompute_states"] == "base" for row in function.KERNEL_OPTIONS.values())
    assert "recompute_states 'base'" in note and "--recompute-states base" in note
    versus_fla.set_recompute_states("off")
    assert all(row["recompute_states"] is False for row in function.KERNEL_OPTIONS.values())
    parser = versus_fla.build_parser()
    assert versus_fla.settings_of(parser.parse_args(["--recompute-states", "on"]), "triton")["recompute_states"] == "on"
    assert "recompute_states" not in versus_fla.settings_of(parser.parse_args([]), "triton")
    with pytest.raises(SystemExit):
        parser.parse_args(["--recompute-states", "maybe"])
