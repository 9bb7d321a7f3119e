"""FSDP2 checkpoints sharded through torch.distributed.checkpoint, at 2 CPU processes on gloo (torchrun): each
process writes its own safetensors shards, ``--resume`` continues bit for bit, the shards joined in one process
(``linmem export``, ``OUT/model``) equal the state FSDP2 gathers, and a damaged shard is refused by name.

Run as a module (``torchrun -m tests.test_sharded_checkpoints CONFIG CHECKPOINT OUT``) it is the gathering side:
every process loads the checkpoint into an FSDP2 run and rank 0 writes the full model and AdamW state that FSDP2
gathers to ``OUT/{model,optimizer}.safetensors``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401  (registers the Auto classes)
from linmem.cli import main
from linmem.io.manifest import DamagedFileError
from linmem.train import checkpoint as ckpt
from linmem.train.export import export_model
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
SHARD = "shard-00002-model-00001-of-00001.safetensors"  # rank 1's file


def torchrun(*args: str, module: str = "linmem.cli") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               module, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def train_two(config: Path, out: Path, *flags: str) -> None:
    proc = torchrun("train", str(config), "--out", str(out), "--no-progress", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]


def metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]


@pytest.fixture(scope="module")
def config_path(dataset, tmp_path_factory) -> Path:
    config = tiny_config(dataset, train={"parallel": "fsdp", "steps": 4, "checkpoint_interval": 2,
                                         "eval_interval": 2})
    path = tmp_path_factory.mktemp("config") / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sharded_run(config_path, tmp_path_factory) -> Path:
    """The uninterrupted 2-process FSDP2 run (4 steps, checkpoints at 2 and 4)."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    train_two(config_path, out)
    return out


@pytest.mark.slow
def test_each_rank_writes_its_shards_and_resume_is_bit_exact(config_path, sharded_run, tmp_path):
    cut = tmp_path / "cut"
    train_two(config_path, cut, "--max-steps", "2")
    first = ckpt.latest_checkpoint(cut / "checkpoints")
    assert first.name == "step-00000002" and ckpt.is_sharded(first)
    listed = json.loads((first / "manifest.json").read_text(encoding="utf-8"))["files"]
    for folder in (ckpt.MODEL_SHARDS, ckpt.OPTIMIZER_SHARDS):
        shards = sorted(p.name for p in (first / folder).iterdir())
        assert shards == ["shard-00001-model-00001-of-00001.safetensors", SHARD]  # one file per rank
        assert all(f"{folder}/{name}" in listed for name in shards)
    assert not (first / "model.safetensors").exists()  # no rank gathered the whole model
    assert not [p for p in first.rglob("*") if p.suffix in (".pt", ".bin", ".pkl", ".distcp", ".metadata")]

    train_two(config_path, cut, "--resume")
    assert metrics(cut) == metrics(sharded_run)  # exact float equality, every logged step
    assert [r["step"] for r in metrics(cut)] == [1, 2, 3, 4]
    for name in ("model", "optimizer"):  # the final state, sharded, equal to the uninterrupted run's
        folder = ckpt.MODEL_SHARDS if name == "model" else ckpt.OPTIMIZER_SHARDS
        a = ckpt.join_shards(sharded_run / "checkpoints" / "step-00000004" / folder)
        b = ckpt.join_shards(cut / "checkpoints" / "step-00000004" / folder)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (load_file(str(out / "model" / "model.safetensors")) for out in (sharded_run, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_equals_consolidated(config_path, sharded_run, tmp_path):
    newest = sharded_run / "checkpoints" / "step-00000004"
    proc = torchrun(str(config_path), str(newest), str(tmp_path / "gathered"), module="tests.test_sharded_checkpoints")
    assert proc.returncode == 0, proc.stderr[-3000:]
    gathered = load_file(str(tmp_path / "gathered" / "model.safetensors"))
    assert main(["export", str(newest), str(tmp_path / "exported")]) == 0
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert "lm_head.weight" not in exported and torch.equal(gathered["lm_head.weight"],
                                                            gathered["model.embeddings.weight"])  # tied
    assert exported.keys() == gathered.keys() - {"lm_head.weight"}
    assert all(torch.equal(exported[k], gathered[k]) for k in exported)
    final = load_file(str(sharded_run / "model" / "model.safetensors"))
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)
    optimizer = load_file(str(tmp_path / "gathered" / "optimizer.safetensors"))
    joined = ckpt.join_shards(newest / ckpt.OPTIMIZER_SHARDS)
    assert joined.keys() == optimizer.keys() and all(torch.equal(joined[k], optimizer[k]) for k in joined)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    expected = AutoModelForCausalLM.from_pretrained(str(sharded_run / "model"))(ids).logits
    assert torch.equal(model(ids).logits, expected)
    half = export_model(newest, tmp_path / "half", dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(half / "model.safetensors")).values())


def test_damaged_shard_is_refused_by_name(config_path, sharded_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(sharded_run, copy)
    shard = copy / "checkpoints" / "step-00000004" / ckpt.MODEL_SHARDS / SHARD
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # one weight byte, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match=rf"{SHARD}: damaged \(SHA-256"):
        export_model(shard.parents[1], tmp_path / "exported")
    proc = torchrun("train", str(config_path), "--out", str(copy), "--resume", "--no-progress")
    assert proc.returncode != 0
    assert f"{SHARD}: damaged (SHA-256" in proc.stderr and "the checkpoint step-00000004 is damaged" in proc.stderr


def gather(config: Path, checkpoint: Path, out: Path) -> None:
    """Load ``checkpoint`` into a 2-process FSDP2 run of ``config``; rank 0 writes what FSDP2 gathers."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from linmem.train.config import load_config
    from linmem.train.distributed import init_distributed, shutdown
    from linmem.train.trainer import load_checkpoint, setup

    torch.set_num_threads(1)
    state = init_distributed("cpu")
    try:
        run = setup(load_config(config, []), out, state, "test")
        load_checkpoint(run, checkpoint, "test")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(run.model, options=options)
        optimizer_state = get_optimizer_state_dict(run.model, run.optimizer, options=options)
        if state.is_main:  # with cpu_offload, rank 0 alone receives the gathered state
            optimizer, _ = ckpt.flatten_optimizer_state(optimizer_state)
            out.mkdir(parents=True)
            save_file({k: v.contiguous().clone() for k, v in model.items()}, str(out / "model.safetensors"))
            save_file(optimizer, str(out / "optimizer.safetensors"))
    finally:
        shutdown(state)


if __name__ == "__main__":
    gather(*map(Path, sys.argv[1:4]))
