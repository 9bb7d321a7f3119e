"""``python -m linmem.bench.training`` as a CPU dry run: every requested mixer measured, ratios from the times,
the budget and failing pairs skipped with a reason."""

import json
import math
from pathlib import Path

import pytest
import torch

from linmem.bench import step_profile, training

TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--head-dim", "16", "--vocab", "64", "--batch", "1",
        "--seq-len", "32", "--steps", "2", "--warmup", "1", "--backends", "chunk", "--threads", "1"]


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_dry_run_writes_every_mixer_and_ratios(tmp_path):
    rows = training.main([*TINY, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["torch"] == torch.__version__ and report["settings"]["batch"] == 1 and not report["skipped"]
    by_mixer = {r["mixer"]: r for r in report["rows"]}
    assert set(by_mixer) == {"rdn", "rla", "gdn", "sgla"} and len(rows) == 4
    for r in report["rows"]:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and r["finite"]
        assert r["tokens_per_s"] == pytest.approx(32 / (r["step_ms"] / 1e3))
        assert r["params"] > 0 and r["timed_steps"] == 2 and r["backend"] == "chunk"
    assert by_mixer["rdn"]["vs_base"] == pytest.approx(by_mixer["rdn"]["step_ms"] / by_mixer["gdn"]["step_ms"])
    assert by_mixer["rla"]["vs_base"] == pytest.approx(by_mixer["rla"]["step_ms"] / by_mixer["sgla"]["step_ms"])
    assert by_mixer["gdn"]["vs_base"] is None and by_mixer["sgla"]["vs_base"] is None
    md = (tmp_path / "training.md").read_text()
    assert "| RDN | chunk |" in md and f"{by_mixer['rdn']['vs_base']:.2f}x GDN" in md
    assert "python -m linmem.bench.training" in md


def test_budget_and_failures_are_skipped_with_a_reason(tmp_path, monkeypatch):
    build = training.model_config

    def failing_sgla(args, mixer, backend):
        if mixer == "sgla":
            raise RuntimeError("no sGLA here")
        return build(args, mixer, backend)

    monkeypatch.setattr(training, "model_config", failing_sgla)
    rows = training.main([*TINY, "--mixers", "sgla,rla", "--out", str(tmp_path)])
    assert [r["mixer"] for r in rows] == ["rla"] and rows[0]["vs_base"] is None
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["skipped"] == [dict(mixer="sgla", backend="chunk", checkpointing=False,
                                      reason="RuntimeError: no sGLA here")]

    rows = training.main([*TINY, "--mixers", "gdn,rdn", "--budget", "0"])
    assert [r["mixer"] for r in rows] == ["gdn"] and rows[0]["timed_steps"] == 1  # the deadline ends its timing


def test_environment_names_the_software():
    from linmem.bench import environment

    env = environment("cpu")
    assert env["device"] == "cpu" and env["gpu"] is None and env["torch"] == torch.__version__
    triton = pytest.importorskip("triton")
    assert env["triton"] == triton.__version__


def test_checkpointing_both_ways_trains_alike_and_reports_the_saving(tmp_path):
    rows = training.main([*TINY, "--mixers", "rdn", "--checkpointing", "both", "--out", str(tmp_path)])
    assert [(r["mixer"], r["checkpointing"]) for r in rows] == [("rdn", False), ("rdn", True)]
    plain, checkpointed = rows
    assert checkpointed["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)  # same steps, same data
    report = json.loads((tmp_path / "training.json").read_text())
    (saving,) = report["savings"]
    assert saving["throughput_kept"] == pytest.approx(checkpointed["tokens_per_s"] / plain["tokens_per_s"])
    assert saving["memory_saving"] is None  # peak GPU memory only on CUDA
    md = (tmp_path / "training.md").read_text()
    assert "| RDN | chunk | yes |" in md and "| RDN | chunk | no |" in md and "throughput kept" in md


PAPER_TINY = ["--paper", "rdn,gdn", "--seq-lens", "16,32", "--tokens-per-step", "64", "--backends", "chunk",
              "--steps", "2", "--warmup", "1", "--threads", "1", "--set", "model.hidden_size=32",
              "--set", "model.num_hidden_layers=2", "--set", "model.num_heads=2", "--set", "model.head_dim=16",
              "--set", "model.intermediate_size=48", "--set", "model.vocab_size=96"]


def test_paper_mode_runs_fsdp2_on_one_process(tmp_path):
    import torch.distributed as dist

    from linmem.bench.flops import H200_BF16_DENSE_TFLOPS, flops_per_token
    from linmem.train.config import load_config
    from linmem.train.params import count_config_parameters, model_config_of

    rows = training.main([*PAPER_TINY, "--out", str(tmp_path)])
    assert not dist.is_initialized()  # the one-process group it started is gone
    assert [(r["model"], r["seq_len"], r["batch"]) for r in rows] == [
        ("rdn", 16, 4), ("rdn", 32, 2), ("gdn", 16, 4), ("gdn", 32, 2)]
    overrides = [a for a in PAPER_TINY[PAPER_TINY.index("--set"):] if a != "--set"]
    for r in rows:
        config = load_config(training.PAPER_CONFIGS / f"{r['model']}-1.5b.yaml", overrides)
        count = count_config_parameters(config)
        assert r["params"] == count.total and r["finite"] and r["checkpointing"] and r["timed_steps"] == 2
        # 6 N over the weights that multiply (not the input table) + 6 L H m K V (RDN m = 6, GDN m = 3)
        expected = 6 * (count.total - count.embeddings) + 6 * 2 * 2 * {"rdn": 6, "gdn": 3}[r["model"]] * 16 * 16
        assert r["flops_per_token"]["total"] == pytest.approx(expected)
        assert r["flops_per_token"] == flops_per_token(model_config_of(config)[0], r["seq_len"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * expected / (H200_BF16_DENSE_TFLOPS * 1e12))
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq_len"] / (r["step_ms"] / 1e3))
    report = json.loads((tmp_path / "paper-training.json").read_text())
    assert report["mode"] == "paper" and len(report["rows"]) == 4 and not report["skipped"]
    md = (tmp_path / "paper-training.md").read_text()
    assert "| RDN | chunk | 16 | 4 |" in md and "FSDP2 world size 1" in md and "989" in md


def test_paper_mode_profile_says_where_a_step_goes(tmp_path):
    """``--profile 1``: per row, the kinds' shares of the step's own time sum to 1, matmul among them (the model's
    projections), and the ranked operators are the step's largest, in the JSON and the Markdown report."""
    tiny = list(PAPER_TINY)
    tiny[tiny.index("rdn,gdn")], tiny[tiny.index("16,32")] = "rdn", "16"
    rows = training.main([*tiny, "--profile", "1", "--out", str(tmp_path)])
    profile = rows[0]["profile"]
    assert profile["steps"] == 1 and sum(profile["kinds"].values()) == pytest.approx(1.0)
    assert profile["kinds"]["matmul"] > 0 and set(profile["kinds"]) == set(step_profile.KINDS)
    shares = [r["share"] for r in profile["top"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert all(r["kind"] == step_profile.kind_of(r["name"]) for r in profile["top"])
    md = (tmp_path / "paper-training.md").read_text()
    assert "Where a step's time goes: RDN/chunk T=16" in md and "| matmul |" in md
    with pytest.raises(SystemExit):
        training.main(["--profile", "1", "--steps", "1"])  # profiling belongs to paper mode


def test_profile_kinds_of_kernel_names():
    assert step_profile.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert step_profile.kind_of("aten::addmm") == "matmul"
    assert step_profile.kind_of("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert step_profile.kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "optimizer"
    assert step_profile.kind_of("flash_fwd_kernel") == "attention"
    assert step_profile.kind_of("aten::mul") == "other"
    kernels = step_profile.linmem_kernel_names()
    if kernels:  # Triton installed: linmem's own kernels are recognised by their exact names
        assert "output_kernel" in kernels and step_profile.kind_of("output_kernel") == "linmem kernels"
        assert step_profile.kind_of("state_pass_kernel") == "linmem kernels"
        for block in ("rms_norm_forward_kernel", "swiglu_backward_kernel", "short_conv_backward_pre_kernel",
                      "cross_entropy_forward_kernel"):  # the fused blocks, not the op (names alike in part)
            assert step_profile.kind_of(block) == "linmem blocks"
        assert step_profile.kind_of("my_forward_kernel") == "other"  # a name that only contains an op kernel's


def test_kernel_names_are_unique_across_linmem():
    """The profiler groups kernels by name: every Triton kernel linmem defines has a name of its own, so that a
    profile tells the SwiGLU's backward from the convolution's and the fused blocks from the op."""
    import ast

    root = Path(step_profile.__file__).resolve().parents[1] / "ops"
    where: dict[str, list[str]] = {}
    for package in ("triton", "fused"):
        for path in sorted((root / package).glob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                    where.setdefault(node.name, []).append(f"{package}/{path.name}")
    assert len(where) > 15
    assert {name: files for name, files in where.items() if len(files) > 1} == {}
    assert not any(name.startswith("_") for name in where)  # a name a profile table can be read by


def test_profile_counts_gpu_work_once():
    """On CUDA only kernels count: the autograd Function that launched Triton kernels (whose time the profiler also
    gives the Function), a user annotation on the GPU's timeline (the optimizer step's range, which spans its
    kernels), the driver's "Command Buffer Full" marker and the profiler's own records are left out."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEventAvg

    def event(key, device_type, annotation=False):
        e = FunctionEventAvg()
        e.key, e.device_type, e.is_user_annotation = key, device_type, annotation
        return e

    events = [event("output_kernel", DeviceType.CUDA), event("LinearMemoryFunction", DeviceType.CPU),
              event("Command Buffer Full", DeviceType.CUDA), event("aten::mm", DeviceType.CPU),
              event("Optimizer.step#AdamW.step", DeviceType.CUDA, annotation=True),
              event("Activity Buffer Request", DeviceType.CUDA),
              event("nvjet_sm90_tst_128x256", DeviceType.CUDA)]
    assert [e.key for e in step_profile.device_work(events)] == ["output_kernel", "nvjet_sm90_tst_128x256"]


def test_flops_attention_term_and_tied_head():
    from linmem.bench.flops import flops_per_token
    from linmem.models import LinMemConfig
    from linmem.train.params import count_model_parameters

    config = LinMemConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_heads=2, head_dim=16,
                          intermediate_size=48, attn_layers=[0, 2], attn_num_heads=4, tie_word_embeddings=True)
    flops = flops_per_token(config, 512)
    assert flops["attention"] == 6 * 2 * 4 * 8 * 512  # 2 layers, 4 heads of width 32 / 4
    assert flops["memory"] == 6 * 1 * 2 * 6 * 16 * 32  # one RDN layer, V = 16 x expand_v 2
    assert flops["matmul"] == 6 * count_model_parameters(config).total  # a tied table is the head's matmul
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(config, 0)


def test_profile_every_operator_covers_the_whole_step_by_name():
    """``top=None``: every operator, their shares summing to 1 (the whole step's own time); ``own_time_by_name`` keys
    those rows by name with their ms and calls per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    step = lambda: model(x).square().mean().backward()  # noqa: E731
    step()
    rows, kinds = step_profile.profile_steps(step, 2, torch.device("cpu"), top=None)
    assert len(rows) > 3 and sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert sum(kinds.values()) == pytest.approx(1.0)
    total = sum(r["ms_per_step"] for r in rows)
    assert all(r["share"] == pytest.approx(r["ms_per_step"] / total) for r in rows)
    by_name = step_profile.own_time_by_name(rows)
    assert list(by_name) == [r["name"] for r in rows]  # one row per name
    assert all(by_name[r["name"]] == dict(ms_per_step=r["ms_per_step"], calls_per_step=r["calls_per_step"],
                                          kind=r["kind"]) for r in rows)
    top, _ = step_profile.profile_steps(step, 2, torch.device("cpu"), top=3)
    assert len(top) == 3
