"""The training loop: ``train(config, out)`` runs a config to the end (or to ``max_steps``), resumable bit for bit.

One update ``s``: the micro-batches of ``s`` (``TrainData.batch``) go forward and backward with the loss summed
over tokens (a recall answer weighted ``data.recall_loss_weight``, text 1) and divided by the global sum of those
weights over the update, so the gradient equals that of one big batch whatever the number of processes and
micro-batches; then clipping, AdamW at ``cosine_lr(s)``, and a line of ``metrics.jsonl``. A checkpoint holds
everything the next update depends on (weights, AdamW state, generator states, and the step, which fixes the data
position), so ``--resume`` continues exactly where the run stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from tqdm.auto import tqdm

from linmem.io.atomic import atomic_write, write_json_atomic
from linmem.io.environment import environment
from linmem.io.folders import (
    check_replaceable,
    mark_output_folder,
    output_file,
    prepare_output_folder,
    read_marker,
    staged_folder,
    staging_path,
)
from linmem.io.labels import IGNORE_INDEX
from linmem.io.manifest import MANIFEST_NAME, DamagedFileError, write_manifest
from linmem.io.run_info import TRAIN_INFO, total_tokens
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.special_tokens import declare_special_tokens, write_model_config
from linmem.ops.packing import document_starts
from linmem.train import checkpoint as ckpt
from linmem.train.compile import compile_blocks, compile_mode
from linmem.train.config import (
    TrainConfig,
    build_model_config,
    check_config,
    loss_chunk_tokens,
    micro_batch_size,
    parse_config,
)
from linmem.train.data import TrainData, eval_windows, open_train_data, recall_eval_batch
from linmem.train.distributed import (
    Distributed,
    all_reduce_sum,
    barrier,
    enable_gradient_checkpointing,
    first_error,
    init_distributed,
    is_fully_sharded,
    rank_batches,
    set_gradient_sync,
    shutdown,
    wrap_model,
)
from linmem.train.init_from import load_initial_weights, source_summary
from linmem.train.lab_recall import LabRecall, parse_entries
from linmem.train.memory_check import check_fits
from linmem.train.run_lock import LOCK_NAME, RunFolderLock, warn
from linmem.train.schedule import cosine_lr

METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
RUN_FILES = (METRICS, CONFIG)  # the run folder's own files, written through ``output_file``
MODEL_DIR = "model"
# What ``save_final_model`` writes into ``OUT/model`` (an old folder holding anything else is never replaced).
MODEL_FILES = ("config.json", "model.safetensors", TRAIN_INFO, MANIFEST_NAME, *ckpt.TOKENIZER_FILES)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class Run:
    """Everything one training process holds."""

    config: TrainConfig
    out: Path
    state: Distributed
    data: TrainData
    model_config: LinMemConfig
    model: nn.Module  # possibly wrapped (DDP / FSDP2)
    optimizer: torch.optim.Optimizer
    micro_batch_size: int
    accumulation: int
    autocast_dtype: torch.dtype | None
    step: int = 0  # updates done
    tokens: int = 0  # input tokens consumed, all processes
    init_from: dict[str, Any] | None = None  # the model it started from (``init_from.source_summary``)
    accept_changed_data: bool = False  # --resume may continue on a dataset whose fingerprint changed
    seconds_before: float = 0.0  # wall time of the earlier segments of a resumed run (up to its checkpoint)
    started: float = field(default_factory=time.perf_counter)  # when this segment's updates began

    @property
    def dataset_fingerprint(self) -> str:
        """The content hash of the dataset this segment opened (``linmem.data.shards.dataset_fingerprint``)."""
        return self.data.shards.fingerprint

    def train_seconds(self) -> float:
        """Wall time of the run so far, over every segment (``--resume`` adds to it)."""
        return self.seconds_before + time.perf_counter() - self.started

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.state.device.type, dtype=self.autocast_dtype)


# ---------------------------------------------------------------- building


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (2-d and up) only, never on norms, biases or ``_no_weight_decay`` tensors."""
    o = config.optim
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if param.dim() < 2 or getattr(param, "_no_weight_decay", False) else decay).append(param)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=o.fused or None)


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """``train.dtype`` as an autocast dtype (None: plain float32). ``auto``: bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return torch.bfloat16 if dtype == "bfloat16" else None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def setup(config: TrainConfig, out: Path, state: Distributed, where: str) -> Run:
    """Open the data, build the model (same seed on every process) and the optimizer."""
    check_config(config, where, state.world_size)
    micro, accumulation = micro_batch_size(config, state.world_size, where)
    data = open_train_data(config.data, config.train.seed, state, where)
    model_config = declare_special_tokens(build_model_config(config, data.vocab_size, where), data.folder)
    torch.manual_seed(config.train.seed)
    if state.device.type == "cuda":
        # tf32 tensor cores for the float32 products (the PyTorch memory backends run outside autocast)
        torch.set_float32_matmul_precision("high")
    model = LinMemForCausalLM(model_config)
    source = None
    if config.train.init_from:  # every process loads the same weights (before DDP / FSDP2 wraps the model)
        folder = load_initial_weights(model, config.train.init_from, model_config, data.folder,
                                      data.shards.tokenizer_hash, where)
        source = source_summary(config.train.init_from, folder)
    if config.train.gradient_checkpointing:  # before FSDP2 wraps the blocks: its hooks stay outside the recompute
        enable_gradient_checkpointing(model)
    mode = compile_mode(config.train.compile)
    if mode is not None:  # the blocks' parts, inside the checkpoint and under FSDP2's hooks
        compile_blocks(model, mode)
    model = wrap_model(model.to(state.device), config.train.parallel, state)
    optimizer = build_optimizer(model, config)
    return Run(config, out, state, data, model_config, model, optimizer, micro, accumulation,
               autocast_dtype(config.train.dtype, state.device), init_from=source)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


# ---------------------------------------------------------------- one update


def token_losses(run: Run, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy ``[B, T-1]`` in float32 (0 where the label is ignored); with a loss chunk size
    (``config.loss_chunk_tokens``) the model computes it piece by piece, never holding the whole logits. With
    ``data.split_documents`` the rows run as one packed row cut at every document start (``document_starts``)."""
    device = run.state.device
    input_ids, labels = input_ids.to(device), labels.to(device)
    batch, length = input_ids.shape
    packed: dict[str, torch.Tensor] = {}
    if run.config.data.split_documents:
        packed["cu_seqlens"] = document_starts(input_ids, run.data.shards.eos_id)
        input_ids = input_ids.reshape(1, batch * length)
    chunk = loss_chunk_tokens(run.config, run.micro_batch_size, run.model_config.vocab_size)
    if packed:  # one row: the first token of each row must not be a target of the row before
        labels = labels.clone()
        labels[:, 0] = IGNORE_INDEX
        labels = labels.reshape(1, batch * length)
    with run.autocast():
        losses = run.model(input_ids=input_ids, labels=labels, use_cache=False, loss_chunk_tokens=chunk,
                           **packed).token_losses.float()
    return F.pad(losses, (0, 1)).view(batch, length)[:, :-1] if packed else losses


def target_weights(batch: dict[str, torch.Tensor], recall_weight: float) -> torch.Tensor:
    """``[B, T-1]`` float32 loss weight of each target: 0 where ignored, ``recall_weight`` on the answers of
    synthetic rows, 1 on text."""
    counted = (batch["labels"][:, 1:] != IGNORE_INDEX).float()
    row = torch.where(batch["synthetic"].bool(), recall_weight, 1.0).float()
    return counted * row[:, None]


def loss_sums(losses: torch.Tensor, labels: torch.Tensor, synthetic: torch.Tensor) -> torch.Tensor:
    """``[text loss sum, text targets, recall loss sum, recall targets]`` (float64, on the losses' device: no
    host sync per micro-batch) of a micro-batch."""
    device = losses.device
    counts = (labels[:, 1:] != IGNORE_INDEX).sum(1).to(device, torch.float64)
    rows = losses.detach().sum(1).to(torch.float64)
    synthetic = synthetic.bool().to(device)
    return torch.stack([rows[~synthetic].sum(), counts[~synthetic].sum(), rows[synthetic].sum(),
                        counts[synthetic].sum()])


def train_step(run: Run, step: int) -> dict[str, Any]:
    """Update ``step`` (0-based); returns its metrics line."""
    c, state = run.config, run.state
    start = time.perf_counter()
    lr = cosine_lr(step, c.optim.lr, c.optim.min_lr, c.optim.warmup_steps, c.train.steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batches = [run.data.batch(step, i, run.accumulation, run.micro_batch_size, state.rank, state.world_size)
               for i in range(run.accumulation)]
    weights = [target_weights(b, c.data.recall_loss_weight) for b in batches]
    local_weight = sum(float(w.sum()) for w in weights)
    total_weight = float(all_reduce_sum(torch.tensor([local_weight]), state)[0])
    sums = torch.zeros(4, dtype=torch.float64, device=state.device)
    for i, (batch, weight) in enumerate(zip(batches, weights)):
        set_gradient_sync(run.model, i == len(batches) - 1)
        losses = token_losses(run, batch["input_ids"], batch["labels"])
        ((losses * weight.to(losses.device)).sum() * (state.world_size / max(total_weight, 1.0))).backward()
        sums += loss_sums(losses, batch["labels"], batch["synthetic"])
    grad_norm = clip_gradients(run.model, c.optim.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    sums = all_reduce_sum(sums, state)
    step_tokens = c.train.batch_size * c.data.seq_len
    run.tokens += step_tokens
    seconds = time.perf_counter() - start
    text, text_n, recall, recall_n = sums.tolist()
    return {"step": step + 1, "loss": (text + recall) / max(text_n + recall_n, 1.0),
            "text_loss": text / text_n if text_n else None, "recall_loss": recall / recall_n if recall_n else None,
            "lr": lr, "grad_norm": grad_norm, "tokens": run.tokens, "tokens_per_s": step_tokens / seconds}


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm`` (0: measure only); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor
        norm = norm.full_tensor()
    return float(norm)


# ---------------------------------------------------------------- held-out evaluation


@torch.no_grad()
def evaluate(run: Run, windows: torch.Tensor, recall: dict[str, torch.Tensor] | None,
             lab_recall: LabRecall | None = None) -> dict[str, Any]:
    """Validation loss on ``windows [N, T]`` and recall accuracy on held-out synthetic samples, over all
    processes: each window and sample is scored on exactly one process (``rank_batches``: uneven shares, equal
    numbers of forward passes so FSDP's collectives line up) and the sums of losses and targets are reduced, so
    the numbers equal those of one process. ``lab_recall`` adds the memory lab's recall in the formats of
    ``train.eval_lab_recall`` (every process scores every item)."""
    run.model.eval()
    state, out = run.state, {}
    sums = torch.zeros(4, dtype=torch.float64)  # text loss, text targets, recall hits, recall targets
    for chunk, counted in rank_batches(windows, state, run.micro_batch_size):
        losses = token_losses(run, chunk, chunk)
        if counted:
            sums[0] += float(losses.double().sum())
            sums[1] += losses.numel()
    if recall is not None:
        rows = torch.arange(len(recall["input_ids"]))
        for chunk, counted in rank_batches(rows, state, run.micro_batch_size):
            chunk_ids, chunk_labels = recall["input_ids"][chunk], recall["labels"][chunk]
            with run.autocast():
                logits = run.model(input_ids=chunk_ids.to(state.device), use_cache=False).logits
            if not counted:
                continue
            mask = chunk_labels[:, 1:] != IGNORE_INDEX
            hits = logits[:, :-1].argmax(-1).cpu() == chunk_labels[:, 1:]
            sums[2] += float((hits & mask).sum())
            sums[3] += float(mask.sum())
    sums = all_reduce_sum(sums, state)
    if lab_recall is not None:
        out.update(lab_recall())
    run.model.train()
    if sums[1] > 0:
        out["val_loss"] = float(sums[0] / sums[1])
        out["val_ppl"] = float(torch.exp(sums[0] / sums[1]))
    if sums[3] > 0:
        out["val_recall_acc"] = float(sums[2] / sums[3])
    return out


# ---------------------------------------------------------------- checkpoints and the final model


def trainer_state(run: Run) -> dict[str, Any]:
    return {"step": run.step, "tokens": run.tokens, "next_data_step": run.step, "world_size": run.state.world_size,
            "train_seconds": round(run.train_seconds(), 2), "config": run.config.to_dict(),
            "dataset": str(run.data.folder.resolve()), "dataset_fingerprint": run.dataset_fingerprint}


def save_checkpoint(run: Run) -> Path | None:
    """Write checkpoint ``run.step`` atomically (all processes take part); returns its folder on rank 0.

    Under FSDP2 every process writes its own shards of the weights and AdamW state (``ckpt.write_sharded``);
    otherwise rank 0 writes the full state dicts. Either way the files go to a hidden folder that rank 0 renames
    into place, with its manifest, after every process has finished writing."""
    sharded = is_fully_sharded(run.model)
    options = StateDictOptions(full_state_dict=False) if sharded else FULL
    model_state = get_model_state_dict(run.model, options=options)
    optimizer_state = get_optimizer_state_dict(run.model, run.optimizer, options=options)
    root, state = run.out / "checkpoints", run.state
    if state.is_main:
        ckpt.prepare_temp_dir(root, run.step)
    barrier(state)
    tmp = ckpt.temp_dir(root, run.step)
    ckpt.write_rng(tmp, state.rank, ckpt.capture_rng(state.device))
    if sharded:
        ckpt.write_sharded(tmp, model_state, optimizer_state, state.is_main, ckpt.tied_names(unwrap(run.model)))
    barrier(state)
    final = None
    if state.is_main:
        if sharded:
            write_model_config(tmp, run.model_config, next(unwrap(run.model).parameters()).dtype)
        else:
            ckpt.write_model(tmp, model_state, run.model_config)
            ckpt.write_optimizer(tmp, optimizer_state)
        ckpt.copy_tokenizer(run.data.folder, tmp)
        write_json_atomic(tmp / "trainer_state.json", {**trainer_state(run), "sharded": sharded})
        final = ckpt.finish_checkpoint(root, run.step, run.config.train.keep_checkpoints)
    barrier(state)
    return final


def load_checkpoint(run: Run, path: Path, where: str) -> None:
    """Restore weights, AdamW state, generator states and the step from checkpoint ``path`` (full or sharded; a
    sharded one is read slice by slice into this run's layout, and its manifest is checked by all processes,
    each hashing its share of the files)."""
    if ckpt.is_sharded(path):
        saved_state = ckpt.read_trainer_state(path)
        check_resumable(saved_state, run, path, where)
        error = None
        try:
            ckpt.verify_checkpoint(path, (run.state.rank, run.state.world_size))
        except DamagedFileError as damaged:
            error = str(damaged)
        error = first_error(error, run.state)
        if error is not None:
            raise DamagedFileError(error)
        model_state = get_model_state_dict(run.model)
        optimizer_state = ckpt.read_sharded(path, model_state, get_optimizer_state_dict(run.model, run.optimizer),
                                            ckpt.tied_names(unwrap(run.model)))
        set_model_state_dict(run.model, model_state)
        set_optimizer_state_dict(run.model, run.optimizer, optimizer_state)
    else:
        saved = ckpt.read_checkpoint(path)
        saved_state = saved.trainer_state
        check_resumable(saved_state, run, path, where)
        model_state = ckpt.with_tied_head(saved.model_state, run.model_config)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(run.model, model_state, options=options)
        set_optimizer_state_dict(run.model, run.optimizer, saved.optimizer_state, options=options)
    rng = ckpt.read_rng(path, run.state.rank)
    if rng is not None:
        ckpt.restore_rng(rng, run.state.device)
    run.step, run.tokens = int(saved_state["step"]), int(saved_state["tokens"])
    run.seconds_before = float(saved_state.get("train_seconds", 0.0))


# Keys a resumed run may change: they do not change what an update computes (device, micro-batches and compilation
# change only its rounding).
RESUME_FREE_KEYS = {"train.eval_interval", "train.checkpoint_interval", "train.keep_checkpoints", "train.progress",
                    "train.log_interval", "train.device", "train.parallel", "train.micro_batch_size",
                    "train.save_dtype", "train.eval_tokens", "train.eval_recall_samples", "train.compile",
                    "train.eval_lab_recall", "train.backend", "name", "description"}


def changed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The dotted keys (``optim.lr``) whose values differ between two config dicts, ``RESUME_FREE_KEYS`` aside."""
    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        items: dict[str, Any] = {}
        for k, v in d.items():
            items.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and prefix == "" else {f"{prefix}{k}": v})
        return items

    a, b = flat(saved), flat(current)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in RESUME_FREE_KEYS)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``changed_keys`` between a saved config (a checkpoint's, a finished run's) and ``current``, the saved one read
    through the config parser first, so that an option added after it was saved counts at its default; a saved
    config the parser no longer reads is compared as saved, so its unknown keys are named among the differences."""
    try:
        saved = parse_config(saved, where="saved config").to_dict()
    except ValueError:
        pass
    return changed_keys(saved, current)


def check_resumable(saved_state: dict[str, Any], run: Run, path: Path, where: str) -> None:
    """Checkpoint ``path`` (its ``trainer_state``: ``saved_state``) continues in ``run``: same config
    (``check_same_run``) and same dataset content (``check_same_data``)."""
    check_same_run(saved_state["config"], run.config.to_dict(), path, where)
    check_same_data(saved_state.get("dataset_fingerprint"), run, path, where)


def check_same_data(saved: str | None, run: Run, path: Path, where: str) -> None:
    """The dataset must hold the tokens the run started on (its fingerprint at the start, ``saved``; a checkpoint
    that predates fingerprints has none and is not checked), unless ``run.accept_changed_data``: then the change
    is stated and the new fingerprint is recorded from here on."""
    current = run.dataset_fingerprint
    if saved is None or saved == current:
        return
    change = (f"the dataset {run.data.folder} changed since the run started (fingerprint {saved} in {path.name}, "
              f"{current} now)")
    if not run.accept_changed_data:
        raise ValueError(f"{where}: --resume: {change}; rebuild it as it was, or pass --accept-changed-data to "
                         "continue on the new data")
    if run.state.is_main:
        warn(f"{change}; continuing on it (--accept-changed-data)")


def check_same_run(saved: dict[str, Any], current: dict[str, Any], path: Path, where: str) -> None:
    """A resumed run must have the config it was started with (``config_changes``: up to ``RESUME_FREE_KEYS``, and
    options added since at their defaults)."""
    differ = config_changes(saved, current)
    if differ:
        raise ValueError(f"{where}: --resume from {path} with a changed config: {', '.join(differ)} differ from "
                         f"the checkpoint's; restore them or start a new --out")


def save_final_model(run: Run, info: dict[str, Any]) -> Path | None:
    """``OUT/model``: config, weights (``train.save_dtype``), tokenizer, ``train_info.json`` and a SHA-256
    manifest, all written into a hidden folder that is renamed into place once complete, so the model and its
    record appear together (rank 0). Under FSDP2 rank 0 joins the weights from the shard files of checkpoint
    ``run.step`` (written just before), so no process gathers the whole model; otherwise all processes gather
    them. An old ``OUT/model`` is replaced only if it holds nothing but linmem's files
    (``linmem.io.folders.replace_folder``)."""
    if is_fully_sharded(run.model):
        model_state = None
        if run.state.is_main:
            checkpoint = run.out / "checkpoints" / ckpt.step_dir_name(run.step)
            model_state = ckpt.consolidated_model_state(checkpoint)
    else:
        model_state = get_model_state_dict(run.model, options=FULL)
    if not run.state.is_main:
        return None
    final = run.out / MODEL_DIR
    dtype = torch.bfloat16 if run.config.train.save_dtype == "bfloat16" else None
    with staged_folder(final) as tmp:
        ckpt.write_model(tmp, model_state, run.model_config, dtype)
        ckpt.copy_tokenizer(run.data.folder, tmp)
        write_json_atomic(tmp / TRAIN_INFO, info)
        write_manifest(tmp)
    return final


def finished_model_info(out: Path, step: int) -> dict[str, Any] | None:
    """``OUT/model/train_info.json`` if the final model there was saved at update ``step``, else None."""
    path = out / MODEL_DIR / TRAIN_INFO
    if not path.is_file():
        return None
    info = json.loads(path.read_text(encoding="utf-8"))
    return info if info.get("steps") == step else None


def logged_metrics(out: Path, step: int) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of update ``step`` (the final metrics of a run that stopped there), or ``{}``."""
    path = out / METRICS
    if not path.is_file():
        return {}
    return next((r for r in reversed(read_metrics(path)) if r.get("step") == step), {})


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``. A last line that is not a JSON object was cut short by a crash while it
    was written: it is dropped with a warning naming the file. Such a line anywhere else means the file was damaged
    otherwise: ``ValueError`` naming the file and the line."""
    lines = [(number, line) for number, line in
             enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1) if line.strip()]
    records = []
    for number, line in lines:
        record = metrics_record(line)
        if record is not None:
            records.append(record)
        elif number == lines[-1][0]:
            warn(f"{path}: dropping line {number}, cut short (the run stopped while writing it)")
        else:
            raise ValueError(f"{path}: line {number} is not a JSON record (damage inside the log, not a line cut "
                             "short at its end); repair or delete that line, then --resume again")
    return records


def metrics_record(line: str) -> dict[str, Any] | None:
    """One ``metrics.jsonl`` line as its record, or None when it is not a JSON object."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def train_info(run: Run, last: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What the model folder records about its training (read by ``linmem eval`` for defaults), with the device and
    software it ran on (``linmem.io.environment``)."""
    return {"name": run.config.name, "description": run.config.description, "steps": run.step,
            "tokens": run.tokens, "parameters": count_parameters(unwrap(run.model)),
            "dataset": str(run.data.folder.resolve()), "dataset_fingerprint": run.dataset_fingerprint,
            "tokenizer_hash": run.data.shards.tokenizer_hash,
            "seq_len": run.config.data.seq_len, "recall_generators": run.data.generator_specs,
            "final_metrics": last, "world_size": run.state.world_size, "device": str(run.state.device),
            "environment": environment(run.state.device),
            "train_seconds": round(seconds, 2),
            "total_tokens": total_tokens({"tokens": run.tokens, "init_from": run.init_from}),
            "config": run.config.to_dict(),
            **({"init_from": run.init_from} if run.init_from else {})}


# ---------------------------------------------------------------- the run


class StopRequests:
    """SIGTERM / SIGINT (a job scheduler's time limit, Ctrl-C) ask the loop to stop after the current update:
    it writes a checkpoint there and returns, so ``--resume`` loses nothing. A second signal stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.previous = {}

    def __enter__(self) -> StopRequests:
        with contextlib.suppress(ValueError):  # not the main thread: signals stay as they are
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: stopping after this update (a checkpoint is written; --resume "
              "continues)", flush=True)

    def agreed(self, state: Distributed) -> bool:
        """True when any process was asked to stop (all processes must stop at the same update)."""
        if not state.active:
            return self.requested
        return bool(all_reduce_sum(torch.tensor([float(self.requested)]), state)[0] > 0)


class MetricsLog:
    """``OUT/metrics.jsonl`` on rank 0: one JSON object per line; on resume, lines after the checkpoint go. Its path
    comes from ``output_file`` and appends never follow a symbolic link."""

    def __init__(self, out: Path, keep_until: int | None, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        self.path = path = output_file(out, METRICS)
        kept = []
        if keep_until is not None and path.is_file():
            kept = [record for record in read_metrics(path) if record.get("step", 0) <= keep_until]
        with atomic_write(path, "w") as f:  # a crash here keeps the old log whole
            f.write("".join(json.dumps(record) + "\n" for record in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            with open(fd, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def main_decides(state: Distributed, decide) -> None:
    """Run ``decide()`` on rank 0 only; if it raises, every process raises (rank 0 its own error), so that no
    process waits at a barrier for one that has stopped."""
    error = None
    if state.is_main:
        try:
            decide()
        except (ValueError, OSError) as e:
            error = e
    failed = error is not None
    if state.active:
        failed = bool(all_reduce_sum(torch.tensor([float(failed)]), state)[0] > 0)
    if error is not None:
        raise error
    if failed:
        raise ValueError("rank 0 refused the output folder (its error message says why)")


def prepare_run_folder(out: Path, resume: bool, overwrite: bool, lock: RunFolderLock) -> None:
    """Rank 0's checks of ``out`` before anything is written: a new run takes a new, empty or own folder
    (``prepare_output_folder``); ``--resume`` needs an existing run folder. Then ``lock`` takes the folder (a
    folder another trainer writes is refused before its files are touched), the run's files and folders are
    checked to lie inside it (``output_file``, ``check_run_folders``), leftovers of interrupted writes go, and an
    ``OUT/model`` that holds files linmem did not write is refused now rather than after training."""
    if resume:
        if not out.is_dir():
            raise FileNotFoundError(f"--resume: {out} does not exist; drop --resume to start a new run there")
        marker = read_marker(out)
        if marker is None and ckpt.latest_checkpoint(out / "checkpoints") is None:
            raise ValueError(f"--resume: {out} is not a linmem train run folder (no checkpoints, no "
                             f".linmem-output.json)")
        lock.acquire(out)
        if marker is None:  # a run folder of a linmem without markers: its files are linmem's
            mark_output_folder(out, "train", written=[p.name for p in out.iterdir() if p.name != LOCK_NAME])
    else:
        if overwrite:  # refused before the folder is adopted
            check_replaceable(out / MODEL_DIR, MODEL_FILES)
        prepare_output_folder(out, overwrite=overwrite, kind="train", files=RUN_FILES)
        lock.acquire(out)
    check_run_folders(out)
    for name in RUN_FILES:
        output_file(out, name)
    ckpt.remove_stale_temp(out / "checkpoints")
    shutil.rmtree(staging_path(out / MODEL_DIR), ignore_errors=True)
    check_replaceable(out / MODEL_DIR, MODEL_FILES)


def check_run_folders(out: Path) -> None:
    """``OUT/checkpoints`` and ``OUT/model`` (and its staging folder) must not be symbolic links: through one,
    checkpoint writes and pruning, or the model's replacement, would act outside the run folder."""
    for path in (out / "checkpoints", out / MODEL_DIR, staging_path(out / MODEL_DIR)):
        if path.is_symlink():
            raise ValueError(f"{path}: is a symbolic link; linmem train writes and deletes only inside its run "
                             "folder: remove the link, or give --out on the disk where the run should go")


def start_run(config: TrainConfig, out: Path, state: Distributed, resume: bool, where: str, lock: RunFolderLock,
              overwrite: bool = False, accept_changed_data: bool = False) -> Run:
    """Check and lock the folder (rank 0), set up, then resume from the newest complete checkpoint (``resume``) or
    refuse to overwrite one."""
    main_decides(state, lambda: prepare_run_folder(out, resume, overwrite, lock))
    barrier(state)
    latest = ckpt.latest_checkpoint(out / "checkpoints")
    if latest is not None and not resume:
        raise ValueError(f"{out} already has checkpoints (newest {latest.name}): pass --resume to continue, or "
                         f"choose another --out")
    run = setup(config, out, state, where)
    run.accept_changed_data = accept_changed_data
    if resume and latest is not None:
        load_checkpoint(run, latest, where)
    if state.is_main:
        with atomic_write(output_file(out, CONFIG), "w") as f:
            f.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return run


def train(config: TrainConfig, out: str | Path, max_steps: int | None = None, resume: bool = False,
          where: str = "config", overwrite: bool = False, accept_changed_data: bool = False) -> dict[str, Any]:
    """Train ``config`` into ``out`` (see the module docstring); stops after update ``max_steps`` if given (the
    schedule still follows ``train.steps``). Returns the final model's ``train_info`` (rank 0) or ``{}``; after a
    SIGTERM / SIGINT (see ``StopRequests``), ``{"interrupted": True, "steps": n}`` once a checkpoint is written.

    ``out`` must be new, empty or a folder of an earlier ``linmem train``, unless ``overwrite``
    (``linmem.io.folders.prepare_output_folder``). ``resume`` on a run that already saved its final model at the
    last update returns that model's ``train_info`` and changes nothing. Rank 0 holds the run folder's lock
    (``linmem.train.run_lock``) from the folder checks to the end, so a second trainer on ``out`` is refused.
    ``resume`` refuses a dataset whose content changed since the run started (``check_same_data``) unless
    ``accept_changed_data``."""
    state = init_distributed(config.train.device)
    lock = RunFolderLock()
    try:
        return _train(config, Path(out), state, max_steps, resume, where, lock, overwrite, accept_changed_data)
    finally:
        lock.release()
        shutdown(state)


def _train(config: TrainConfig, out: Path, state: Distributed, max_steps: int | None, resume: bool,
           where: str, lock: RunFolderLock, overwrite: bool = False, accept_changed_data: bool = False
           ) -> dict[str, Any]:
    run = start_run(config, out, state, resume, where, lock, overwrite, accept_changed_data)
    t = config.train
    stop = min(t.steps, max_steps) if max_steps is not None else t.steps
    if run.step >= stop:  # resumed at (or past) its end: the run is finished, or was killed writing its model
        done = finished_model_info(out, run.step)
        if done is None:
            info = train_info(run, logged_metrics(out, run.step), run.seconds_before)
            save_final_model(run, info)
            done = info
        return done if state.is_main else {}
    check_fits(lambda ids, labels: token_losses(run, ids, labels), run.model, run.micro_batch_size,
               config.data.seq_len, state.device, where)
    log = MetricsLog(out, run.step if resume else None, state.is_main)
    windows = eval_windows(run.data.shards, config.data.eval_split, config.data.seq_len, t.eval_tokens)
    recall = None
    if run.data.recall is not None and t.eval_recall_samples:
        recall = recall_eval_batch(run.data.recall, t.eval_recall_samples)
    lab_recall = None
    if t.eval_lab_recall:
        lab_recall = LabRecall(parse_entries(t.eval_lab_recall, where), unwrap(run.model), run.data.folder,
                               config.data.eval_split, state.device)
    bar = tqdm(total=stop, initial=run.step, disable=not (state.is_main and t.progress), unit="step")
    run.started, last = time.perf_counter(), {}
    with StopRequests() as stop_requests:
        interrupted = _loop(run, log, windows, recall, lab_recall, bar, stop, stop_requests, last)
    bar.close()
    if interrupted:
        return {"interrupted": True, "steps": run.step} if state.is_main else {}
    info = train_info(run, last, run.train_seconds())
    save_final_model(run, info)
    return info if state.is_main else {}


def _loop(run: Run, log: MetricsLog, windows: torch.Tensor, recall: dict[str, torch.Tensor] | None,
          lab_recall: LabRecall | None, bar, stop: int, stop_requests: StopRequests, last: dict[str, Any]) -> bool:
    """Updates until ``stop`` (``last`` receives the newest metrics); True when a signal ended it early (after a
    checkpoint)."""
    t = run.config.train
    while run.step < stop:
        record = train_step(run, run.step)
        run.step += 1
        last.clear()
        last.update(record)
        if t.eval_interval and (run.step % t.eval_interval == 0 or run.step == stop):
            record.update(evaluate(run, windows, recall, lab_recall))
        if run.step % t.log_interval == 0 or "val_loss" in record or run.step == stop:
            log.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}")
        last.update({k: v for k, v in record.items() if k.startswith("val_")})
        interrupted = run.step < stop and stop_requests.agreed(run.state)
        if (t.checkpoint_interval and run.step % t.checkpoint_interval == 0) or run.step == stop or interrupted:
            save_checkpoint(run)
        if interrupted:
            return True
    return False
