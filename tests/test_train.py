"""Trainer: config errors name the key, the schedule, bit-for-bit resume (also after a lost checkpoint),
atomic checkpoints under a crash mid-write, checkpoint contents, and 2-process torchrun (DDP, FSDP2) on gloo
matching one process."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401  (registers the Auto classes)
from linmem.cli import main
from linmem.train import checkpoint as ckpt
from linmem.train.config import parse_config
from linmem.train.schedule import cosine_lr
from linmem.train.trainer import train
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)

COMPARED = ("step", "loss", "text_loss", "recall_loss", "lr", "grad_norm", "val_loss", "val_recall_acc")


@pytest.fixture(scope="module")
def full_run(dataset, tmp_path_factory) -> Path:
    """The uninterrupted reference run (6 steps, checkpoints every 2)."""
    out = tmp_path_factory.mktemp("full")
    train(parse_config(tiny_config(dataset)), out)
    return out


def metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: r.get(k) for k in COMPARED} for r in map(json.loads, lines)]


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("change, error", [
    ({"optim": {"lrr": 1.0}}, r"unknown key optim\.lrr"),
    ({"modle": {}}, r"unknown key modle"),
    ({"model": {"hidden_sise": 64}}, r"unknown key model\.hidden_sise"),
    ({"train": {"batch_size": "eight"}}, r"train\.batch_size must be int"),
    ({"train": {"batch_size": 8, "micro_batch_size": 3}}, r"train\.batch_size \(8\) must be a multiple of "
                                                           r"train\.micro_batch_size \(3\)"),
    ({"optim": {"lr": 1e-5, "min_lr": 1e-4}}, r"optim\.min_lr <= optim\.lr"),
    ({"data": {"recall_fraction": 0.5, "recall": []}}, r"data\.recall"),
    ({"train": {"dtype": "fp8"}}, r"train\.dtype must be one of"),
    ({"train": {"micro_batch_size": 0}}, r"train\.micro_batch_size must be >= 1"),
])
def test_config_errors_name_the_key(dataset, change, error):
    with pytest.raises(ValueError, match=error):
        parse_config(tiny_config(dataset, **change))


@pytest.mark.parametrize("change, error", [
    ({"data": {"seq_len": 100_000}}, r"data\.seq_len: split 'train' has no shard of at least"),
    ({"model": {"vocab_size": 100}}, r"model\.vocab_size \(100\) must be 'auto' or an integer >= the dataset"),
    ({"model": {"num_heads": 0}}, r"model: num_heads must be a positive integer"),
    ({"data": {"recall": [{"name": "mqar", "vocab_range": [0, 100]}]}}, r"data\.recall\[0\]\.vocab_range"),
    ({"data": {"recall": [{"name": "no-such"}]}}, r"data\.recall\[0\]\.name 'no-such' is not a registered"),
    ({"data": {"recall": [{"name": "mqar", "num_kv_pairs": 20}]}}, r"data\.recall with data\.seq_len 32: MQAR"),
    ({"data": {"recall": [{"name": "kv-filler", "keys": "nope"}]}}, r"data\.recall\[0\]: keys must be one of"),
    ({"data": {"recall": [{"name": "kv-filler", "num_bindings": 4}]}}, r"data\.recall with data\.seq_len 32: "
                                                                       r"rule 'sequence length'"),
])
def test_shape_errors_name_the_key(dataset, tmp_path, change, error):
    config = parse_config(tiny_config(dataset, **change))
    with pytest.raises(ValueError, match=error):
        train(config, tmp_path / "out", max_steps=1)


def test_missing_data_and_cli_errors(tmp_path, capsys):
    config = parse_config(tiny_config(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"data\.dir .*nowhere.* holds no dataset .*data\.sources is empty"):
        train(config, tmp_path / "out")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, optim={"lrr": 1})), encoding="utf-8")
    assert main(["train", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "unknown key optim.lrr" in capsys.readouterr().err


def test_yaml_floats_and_defaults(dataset):
    config = parse_config(tiny_config(dataset))
    assert config.optim.lr == 3e-3 and isinstance(config.optim.min_lr, float)  # "3e-3" is a YAML string
    assert config.model["initializer_range"] == 0.006 and config.optim.weight_decay == 0.1  # RLA Table 7
    assert config.optim.grad_clip == 1.0 and config.data.splits == "0.96,0.02,0.02"


def test_cosine_schedule():
    lrs = [cosine_lr(s, 3e-4, 3e-5, 10, 100) for s in range(120)]
    assert lrs[0] == pytest.approx(3e-5) and lrs[9] == pytest.approx(3e-4)
    assert all(a >= b for a, b in zip(lrs[9:100], lrs[10:100]))
    assert lrs[55] == pytest.approx((3e-4 + 3e-5) / 2, rel=1e-2)
    assert lrs[99] == pytest.approx(3e-5, rel=1e-2) and lrs[110] == 3e-5


@pytest.mark.parametrize("weight,loss_chunk", [(1.0, None), (8.0, None), (8.0, 7)])
def test_recall_loss_weight_is_the_weighted_mean(dataset, tmp_path, weight, loss_chunk):
    """An update's gradient is that of the mean loss with answers of synthetic rows counted ``weight`` times, also
    when the loss runs over chunks of ``loss_chunk`` tokens (the whole logits never exist)."""
    import torch.nn.functional as F

    from linmem.train import trainer
    from linmem.train.distributed import init_distributed

    config = parse_config(tiny_config(dataset, data={"recall_fraction": 0.5, "recall_loss_weight": weight},
                                      train={"micro_batch_size": 8, "loss_chunk_tokens": loss_chunk}))
    run = trainer.setup(config, tmp_path, init_distributed("cpu"), "test")
    batch = run.data.batch(0, 0, 1, 8, 0, 1)
    assert batch["synthetic"].any() and not batch["synthetic"].all()
    logits = run.model(input_ids=batch["input_ids"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    counts = (targets != -100).float() * torch.where(batch["synthetic"], weight, 1.0)[:, None]
    expected = torch.autograd.grad((losses.view(targets.shape) * counts).sum() / counts.sum(),
                                   list(run.model.parameters()))
    seen = []
    run.optimizer.step = lambda: seen.extend(p.grad.clone() for p in run.model.parameters())
    trainer.train_step(run, 0)
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_recall_loss_weight_must_be_positive(dataset):
    with pytest.raises(ValueError, match=r"data\.recall_loss_weight must be a positive number"):
        parse_config(tiny_config(dataset, data={"recall_loss_weight": 0}))


# ---------------------------------------------------------------- resume and checkpoints


def test_resume_is_bit_for_bit(dataset, full_run, tmp_path):
    config = parse_config(tiny_config(dataset))
    cut = tmp_path / "cut"
    train(config, cut, max_steps=3)
    train(config, cut, max_steps=5, resume=True)
    shutil.rmtree(cut / "checkpoints" / "step-00000005")  # as if killed before step 5's checkpoint was written
    train(config, cut, resume=True)  # resumes at 4: the logged step 5 is dropped and redone
    assert metrics(cut) == metrics(full_run)  # exact float equality, every step
    assert [r["step"] for r in metrics(cut)] == [1, 2, 3, 4, 5, 6]
    a, b = load_file(str(full_run / "model" / "model.safetensors")), load_file(str(cut / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_and_resume_continues(dataset, full_run, tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM during update 3: the run writes checkpoint 3 and stops (exit 130), and --resume then
    equals the uninterrupted run."""
    import signal

    from linmem.train import trainer

    real_step = trainer.train_step

    def step_then_terminate(run, step):
        record = real_step(run, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(dataset)), encoding="utf-8")
    cut = tmp_path / "cut"
    monkeypatch.setattr(trainer, "train_step", step_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", str(path), "--out", str(cut), "--no-progress"]) == 130
    assert "stopped after step 3" in capsys.readouterr().out
    assert ckpt.latest_checkpoint(cut / "checkpoints").name == "step-00000003" and not (cut / "model").exists()
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
    monkeypatch.setattr(trainer, "train_step", real_step)
    assert main(["train", str(path), "--out", str(cut), "--resume", "--no-progress"]) == 0
    assert metrics(cut) == metrics(full_run)


def test_crash_mid_checkpoint_leaves_no_complete_checkpoint(dataset, full_run, tmp_path, monkeypatch):
    config, out = parse_config(tiny_config(dataset)), tmp_path / "crash"
    real, calls = ckpt.write_optimizer, []

    def failing(folder, state):
        calls.append(folder)
        if len(calls) == 2:  # the step-4 checkpoint: half a file, then the "crash"
            (folder / "optimizer.safetensors").write_bytes(b"\0" * 100)
            raise RuntimeError("disk full")
        real(folder, state)

    monkeypatch.setattr(ckpt, "write_optimizer", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        train(config, out)
    root = out / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000002"]
    assert (root / ".tmp-step-00000004").is_dir() and not (root / "step-00000004").exists()
    monkeypatch.setattr(ckpt, "write_optimizer", real)
    train(config, out, resume=True)
    assert not list(root.glob(".tmp-*"))
    assert metrics(out) == metrics(full_run)


def test_the_model_folder_names_the_device_and_software_it_was_trained_with(full_run):
    info = json.loads((full_run / "model" / "train_info.json").read_text(encoding="utf-8"))
    env = info["environment"]
    assert env["device"] == info["device"] == "cpu" and env["gpu"] is None
    assert env["torch"] == torch.__version__ and env["linmem"] == linmem.__version__
    assert env["transformers"] == transformers.__version__ and env["python"] == platform.python_version()


def test_checkpoint_contents_and_guards(dataset, full_run, tmp_path):
    root = full_run / "checkpoints"
    newest = ckpt.latest_checkpoint(root)
    assert newest.name == "step-00000006"
    names = {p.name for p in newest.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.safetensors", "optimizer.json",
            "rng-rank0.json", "trainer_state.json", "manifest.json"} <= names
    assert not any(n.endswith((".pt", ".bin", ".pkl")) for n in names)  # nothing pickled
    state = ckpt.read_checkpoint(newest)
    assert state.step == 6 and state.trainer_state["next_data_step"] == 6
    assert all(k.startswith("model.") for k in state.optimizer_state["state"])  # keyed by parameter name
    model = AutoModelForCausalLM.from_pretrained(str(newest))
    final = AutoModelForCausalLM.from_pretrained(str(full_run / "model"))
    ids = torch.arange(1, 20)[None]
    assert torch.equal(model(ids).logits, final(ids).logits)
    with pytest.raises(ValueError, match="already has checkpoints .* --resume"):
        train(parse_config(tiny_config(dataset)), full_run)
    with pytest.raises(ValueError, match=r"changed config: optim\.lr differ"):
        train(parse_config(tiny_config(dataset, optim={"lr": 1e-3})), full_run, resume=True)
    copy = tmp_path / "copy"
    shutil.copytree(newest, copy)
    (copy / "model.safetensors").write_bytes(b"short")
    with pytest.raises(ValueError, match="damaged"):
        ckpt.read_checkpoint(copy)


def test_keep_last_checkpoints(dataset, tmp_path):
    config = parse_config(tiny_config(dataset, train={"steps": 5, "checkpoint_interval": 1, "keep_checkpoints": 2,
                                                      "eval_interval": 0}))
    train(config, tmp_path / "out")
    kept = [p.name for p in ckpt.complete_checkpoints(tmp_path / "out" / "checkpoints")]
    assert kept == ["step-00000004", "step-00000005"]


# ---------------------------------------------------------------- torchrun, 2 CPU processes on gloo


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_two_processes_match_one(dataset, full_run, tmp_path, parallel):
    config = tiny_config(dataset, train={"parallel": parallel})
    path, out = tmp_path / "config.yaml", tmp_path / "two"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "linmem.cli", "train", str(path), "--out", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = metrics(full_run), metrics(out)
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(one, two):
        for key in ("loss", "text_loss", "recall_loss", "grad_norm", "val_loss", "lr"):
            assert (a[key] is None) == (b[key] is None)
            if a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), (key, a["step"])
    newest = ckpt.latest_checkpoint(out / "checkpoints")
    assert newest.name == "step-00000006"
    assert (newest / "rng-rank0.json").is_file() and (newest / "rng-rank1.json").is_file()
    assert json.loads((newest / "trainer_state.json").read_text())["world_size"] == 2
    assert (out / "model" / "model.safetensors").is_file()


def test_bfloat16_autocast_runs(dataset, full_run, tmp_path):
    config = parse_config(tiny_config(dataset, train={"dtype": "bfloat16", "steps": 2, "eval_interval": 0,
                                                      "save_dtype": "bfloat16"}))
    train(config, tmp_path / "bf16")
    bf16, fp32 = metrics(tmp_path / "bf16"), metrics(full_run)
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=1e-2) and bf16[0]["loss"] != fp32[0]["loss"]
    weights = load_file(str(tmp_path / "bf16" / "model" / "model.safetensors"))
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
