"""``linmem zoo ship``: evaluate trained run folders and package the chosen ones into the zoo.

For each run folder (``linmem train ... --out RUN``):

1. **stage** ``RUN/zoo/model``: the final model with bfloat16 weights (what is shipped, and what is evaluated);
2. **evaluate** it with ``linmem.eval``'s runner (``SHIP_EVAL``: every task at sizes that take a few minutes per
   model on a 2-core CPU) into ``RUN/zoo/eval/`` and write ``RUN/zoo/eval.json``: the evaluation, the training
   summary read from ``metrics.jsonl`` and ``train_info.json``, chance levels. An ``eval.json`` of the same weights
   and options is reused unless ``force``;
3. **ship** the chosen runs: ``<zoo dir>/<name>/`` with the staged files, ``eval.json`` and a model card
   ``README.md``; the held-out test split of the training dataset goes to ``<zoo dir>/_heldout/<dataset>/`` once.
   Each model folder must stay within ``SIZE_LIMIT`` and carries a SHA-256 ``manifest.json`` (checked at load).
   The zoo folder must be new, empty or a zoo (``.linmem-output.json`` of kind ``zoo``) unless ``overwrite``; an
   old model folder is replaced only if it holds nothing but linmem's files.

``docs/zoo.md`` (all evaluated runs) is written by ``linmem.zoo.cards.write_docs`` from the records.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from linmem.data.shards import INDEX_NAME, TokenShards
from linmem.eval.runner import TASKS, EvalOptions, evaluate
from linmem.io.atomic import atomic_write, write_json_atomic
from linmem.io.folders import check_output_subfolder, check_replaceable, prepare_output_folder, staged_folder
from linmem.io.manifest import MANIFEST_NAME, write_manifest
from linmem.io.manifest import sha256_file as sha256
from linmem.io.run_info import TRAIN_INFO
from linmem.models import LinMemConfig
from linmem.models.configuration import attention_layers
from linmem.models.special_tokens import declare_special_tokens
from linmem.train.checkpoint import copy_tokenizer, write_model
from linmem.train.init_from import earlier_stages
from linmem.zoo import HELDOUT_DIR, MAIN, SIZE_LIMIT, folder_bytes, order

STAGE = "zoo"  # RUN/zoo: staged model, eval report, eval.json
RECORD = "eval.json"
CARD = "README.md"
# What a shipped model folder holds (an old one holding anything else is never replaced).
ZOO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "generation_config.json", TRAIN_INFO, RECORD, CARD, MANIFEST_NAME)
CURVE_POINTS = 400  # points of the loss curve kept in eval.json
FINAL_WINDOW = 20  # updates averaged for the "final loss"

# Every task, sized to take a few minutes per zoo model (4.8M parameters, 512-token windows) on a 2-core CPU:
# 32K tokens of perplexity, 64 cloze passages, MQAR with 2..64 pairs (16 sequences each), NIAH at 256/512/1024
# tokens x 5 depths (4 trials per cell), 48 memory-lab items, 8 stability windows.
SHIP_EVAL = EvalOptions(split="test", batch_size=8, max_tokens=32_768, cloze_examples=64,
                        mqar_pairs=(2, 4, 8, 16, 32, 64), mqar_samples=16, niah_lengths=(256, 512, 1024),
                        niah_depths=(0.0, 0.25, 0.5, 0.75, 1.0), niah_samples=4, stability_windows=8,
                        recall_items=48, recall_filler=256, seed=0, device="auto")
NIAH_CHANCE = 1 / 9000  # a 4-digit number (1000-9999) guessed


@dataclass
class Run:
    """A training run folder: its final model, training record, config and metrics."""

    folder: Path
    model_dir: Path
    info: dict[str, Any]
    metrics: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return str(self.info.get("name") or self.folder.name)


def read_run(folder: str | Path) -> Run:
    """A run folder written by ``linmem train`` (``model/`` with ``train_info.json``, ``metrics.jsonl``)."""
    folder = Path(folder)
    model_dir = folder / "model"
    if not (model_dir / "config.json").is_file() or not (model_dir / TRAIN_INFO).is_file():
        raise FileNotFoundError(f"{folder}: not a finished training run (no model/config.json and "
                                f"model/{TRAIN_INFO}; linmem train writes them at the end of a run)")
    info = json.loads((model_dir / TRAIN_INFO).read_text(encoding="utf-8"))
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no metrics.jsonl")
    metrics = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not metrics:
        raise ValueError(f"{path}: empty")
    return Run(folder, model_dir, info, metrics)


# ---------------------------------------------------------------- training summary


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def update_seconds(metrics: list[dict[str, Any]]) -> float:
    """Seconds spent in updates: each logged update's tokens over its ``tokens_per_s``, spread over the updates
    between logged lines (``log_interval``)."""
    total, step, tokens = 0.0, 0, 0
    for m in metrics:
        steps = m["step"] - step
        if steps > 0 and m.get("tokens_per_s"):
            total += (m["tokens"] - tokens) / m["tokens_per_s"]
        step, tokens = m["step"], m["tokens"]
    return total


def loss_curve(metrics: list[dict[str, Any]], points: int = CURVE_POINTS) -> dict[str, list]:
    """Training loss at up to ``points`` evenly spaced logged updates (always the last), and every validation."""
    stride = max(1, -(-len(metrics) // points))
    kept = metrics[::stride] + ([metrics[-1]] if (len(metrics) - 1) % stride else [])
    val = [m for m in metrics if m.get("val_loss") is not None]
    return {"step": [m["step"] for m in kept], "loss": [round(m["loss"], 4) for m in kept],
            "val_step": [m["step"] for m in val], "val_loss": [round(m["val_loss"], 4) for m in val]}


def training_summary(run: Run) -> dict[str, Any]:
    """What the card and docs say about training, from ``metrics.jsonl`` and ``train_info.json``."""
    m, info = run.metrics, run.info
    config = info.get("config", {})
    seconds = update_seconds(m)
    last_val = next((x for x in reversed(m) if x.get("val_loss") is not None), {})
    tail = m[-FINAL_WINDOW:]
    return {"steps": m[-1]["step"], "tokens": m[-1]["tokens"], "update_seconds": round(seconds, 1),
            "tokens_per_s": m[-1]["tokens"] / seconds if seconds else None,
            "wall_seconds": info.get("train_seconds"), "device": info.get("device"),
            "world_size": info.get("world_size"),
            "final_loss": m[-1]["loss"], "final_loss_mean": _mean([x["loss"] for x in tail]),
            "final_text_loss": _mean([x.get("text_loss") for x in tail]),
            "final_recall_loss": _mean([x.get("recall_loss") for x in tail]), "final_window": len(tail),
            "val_loss": last_val.get("val_loss"), "val_ppl": last_val.get("val_ppl"),
            "val_recall_acc": last_val.get("val_recall_acc"), "val_step": last_val.get("step"),
            "batch_size": config.get("train", {}).get("batch_size"), "seq_len": info.get("seq_len"),
            "optim": config.get("optim", {}), "scheduled_steps": config.get("train", {}).get("steps"),
            "earlier_stages": earlier_stages(info.get("init_from")), "curve": loss_curve(m)}


# ---------------------------------------------------------------- staging and evaluation


def find_dataset(run: Run, data: str | Path | None = None) -> Path:
    """The run's dataset: ``data`` if given, else the folder ``train_info.json`` records, else the config's
    ``data.dir`` (relative to the working directory: a run trained on another machine)."""
    candidates = [Path(data)] if data else [Path(p) for p in (run.info.get("dataset"),
                                                              run.info.get("config", {}).get("data", {}).get("dir"))
                                            if p]
    for folder in candidates:
        if (folder / INDEX_NAME).is_file():
            return folder.resolve()
    raise FileNotFoundError(f"{run.folder}: its dataset is not here (tried {', '.join(map(str, candidates))}); pass "
                            f"--data DIR, the dataset it was trained on (linmem data build with the same sources)")


def stage_model(run: Run, dataset: Path) -> Path:
    """``RUN/zoo/model``: config, bfloat16 weights, tokenizer, ``train_info.json`` (dataset: ``dataset``)."""
    out = run.folder / STAGE / "model"
    with staged_folder(out) as tmp:
        config = declare_special_tokens(LinMemConfig.from_pretrained(str(run.model_dir)), run.model_dir)
        write_model(tmp, load_file(str(run.model_dir / "model.safetensors")), config, torch.bfloat16)
        copy_tokenizer(run.model_dir, tmp)
        write_json_atomic(tmp / TRAIN_INFO, {**run.info, "dataset": str(dataset)})
    return out


def options_dict(options: EvalOptions) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(options).items()}


def evaluation_seconds(tasks: dict[str, Any]) -> float:
    """A record's ``eval.seconds``: the sum of its tasks' run times."""
    return round(sum(t.get("seconds", 0) for t in tasks.values()), 1)


def chance_levels(vocab_size: int) -> dict[str, Any]:
    """What guessing scores on each task (MQAR: 1 / pairs, per row of its table)."""
    return {"ppl": vocab_size, "cloze": 0.0, "mqar": "1 / pairs", "niah": NIAH_CHANCE, "recall": 0.25}


def evaluate_run(run: Run, options: EvalOptions = SHIP_EVAL, data: str | Path | None = None, force: bool = False,
                 tasks: Sequence[str] = TASKS, progress: bool = True) -> dict[str, Any]:
    """Stage, evaluate and summarise ``run``; writes and returns ``RUN/zoo/eval.json``'s record."""
    dataset = find_dataset(run, data)
    staged = stage_model(run, dataset)
    options = replace(options, data=str(dataset))
    weights = sha256(staged / "model.safetensors")
    record_path = run.folder / STAGE / RECORD
    wanted = {"options": options_dict(options), "tasks": list(tasks)}
    if record_path.is_file() and not force:
        old = json.loads(record_path.read_text(encoding="utf-8"))
        if old.get("model_sha256") == weights and old.get("eval", {}).get("request") == wanted:
            return old
    report = evaluate(staged, list(tasks), options, out_dir=run.folder / STAGE / "eval", progress=progress)
    config = json.loads((staged / "config.json").read_text(encoding="utf-8"))
    shards = TokenShards(dataset)
    card = dataset / "data_card.json"
    record = {
        "name": run.name, "description": run.info.get("description", ""), "run": str(run.folder),
        "mixer": config.get("mixer"), "attn_layers": attention_layers(config),
        "parameters": report["parameters"], "model_sha256": weights, "model_config": config,
        "model_bytes": (staged / "model.safetensors").stat().st_size,
        "training": training_summary(run), "train_config": run.info.get("config", {}),
        "recall_generators": run.info.get("recall_generators", []),
        "data": {"dataset": dataset.name, "tokenizer_hash": shards.tokenizer_hash, "vocab_size": shards.vocab_size,
                 "card": json.loads(card.read_text(encoding="utf-8")) if card.is_file() else None},
        "chance": chance_levels(int(config["vocab_size"])),
        "eval": {"request": wanted, "tasks": report["tasks"],
                 "seconds": evaluation_seconds(report["tasks"])},
    }
    write_json_atomic(record_path, record)
    return record


# ---------------------------------------------------------------- shipping


def heldout_name(dataset: Path, tokenizer_hash: str) -> str:
    return f"{dataset.name}-{tokenizer_hash[:8]}"


def ship_heldout(dataset: Path, zoo_dir: Path, split: str = "test") -> Path:
    """Copy ``split`` of ``dataset`` (shards, index restricted to it, data card) to ``<zoo>/_heldout/<name>``."""
    shards = TokenShards(dataset)
    out = zoo_dir / HELDOUT_DIR / heldout_name(dataset, shards.tokenizer_hash)
    if (out / INDEX_NAME).is_file() and TokenShards(out).tokenizer_hash == shards.tokenizer_hash:
        return out
    entries = shards.index["splits"][split]
    tokens = sum(e["num_tokens"] for e in entries)
    with staged_folder(out) as tmp:
        for entry in entries:
            shutil.copyfile(dataset / entry["file"], tmp / entry["file"])
        for name in ("data_card.json",):
            if (dataset / name).is_file():
                shutil.copyfile(dataset / name, tmp / name)
        write_json_atomic(tmp / INDEX_NAME, {**shards.index, "splits": {split: entries}})
        (tmp / "README.md").write_text(
            f"Held-out text of the `{dataset.name}` dataset: its `{split}` split only ({tokens:,} tokens), as token "
            f"shards (`linmem.data.shards`), for `linmem eval` and `linmem demo` on the shipped models.\n"
            f"Sources and licences: see the model cards (Python standard library docs: PSF License; Shakespeare and "
            f"the King James Bible: public domain).\n", encoding="utf-8")
    return out


def compact_json(path: Path) -> None:
    """Rewrite a JSON file without indentation."""
    text = json.dumps(json.loads(path.read_text(encoding="utf-8")), ensure_ascii=False, separators=(",", ":"))
    path.write_text(text, encoding="utf-8")


def ship_model(run: Run, record: dict[str, Any], zoo_dir: Path, card: str) -> Path:
    """``<zoo>/<name>/``: the staged model with ``train_info.json`` pointing at the shipped held-out text,
    ``eval.json`` and the card; ``ValueError`` if it exceeds ``SIZE_LIMIT``."""
    staged = run.folder / STAGE / "model"
    dataset = Path(json.loads((staged / TRAIN_INFO).read_text(encoding="utf-8"))["dataset"])
    heldout = ship_heldout(dataset, zoo_dir)
    out = zoo_dir / record["name"]
    info = {**run.info, "dataset": f"../{HELDOUT_DIR}/{heldout.name}", "trained_on": run.info.get("dataset")}
    with staged_folder(out) as tmp:
        shutil.copytree(staged, tmp, dirs_exist_ok=True)  # also gives tmp the staged folder's mode
        write_json_atomic(tmp / TRAIN_INFO, info)
        compact_json(tmp / "tokenizer.json")  # the same tokenizer (and hash) in about 60% of the bytes
        write_json_atomic(tmp / RECORD, record)
        (tmp / CARD).write_text(card, encoding="utf-8")
        write_manifest(tmp)
        for file in tmp.iterdir():
            file.chmod(0o644)  # safetensors writes 0600; a package's data must be readable by every user
        size = folder_bytes(tmp)
        if size > SIZE_LIMIT:  # raised inside the block: the staging folder goes, the shipped folder stays
            raise ValueError(f"{record['name']}: the model folder would be {size / 1e6:.2f} MB, over the zoo's "
                             f"limit of {SIZE_LIMIT / 1e6:.3g} MB; ship a smaller model")
    return out


def choose_shipped(runs: Sequence[Run], ship: Sequence[str] | None) -> list[str]:
    """The run names to ship: ``ship`` (each must be among ``runs``), default the main models among them."""
    have = [r.name for r in runs]
    if len(set(have)) != len(have):
        raise ValueError(f"two runs share a name: {', '.join(sorted({n for n in have if have.count(n) > 1}))}")
    if ship is None:
        return [n for n in MAIN if n in have]
    missing = [n for n in ship if n not in have]
    if missing:
        raise ValueError(f"--ship names {', '.join(missing)} but no run folder given has that name; runs: "
                         f"{', '.join(have)}")
    return order(ship)


def ship(run_dirs: Sequence[str | Path], ship_names: Sequence[str] | None = None, zoo_dir: str | Path | None = None,
         docs: str | Path | None = None, options: EvalOptions = SHIP_EVAL, data: str | Path | None = None,
         force: bool = False, progress: bool = True, overwrite: bool = False) -> list[dict[str, Any]]:
    """Evaluate every run, ship ``ship_names`` (default: the main models among them) into ``zoo_dir`` (default:
    ``linmem.zoo.root()``; new, empty or a zoo unless ``overwrite``) and write ``docs`` (with its figures in
    ``<docs stem>/``) over all runs. Returns the records in table order."""
    from linmem import zoo
    from linmem.zoo import cards

    runs = [read_run(d) for d in run_dirs]
    chosen = choose_shipped(runs, ship_names)
    root = zoo.root(zoo_dir)
    if chosen:  # checked before the evaluations
        prepare_output_folder(root, overwrite=overwrite, kind="zoo")
        check_output_subfolder(root, HELDOUT_DIR)  # the held-out text's folder: not a link out of the zoo
        for name in chosen:
            check_output_subfolder(root, name)
            check_replaceable(root / name, ZOO_FILES)
    by_name = {r.name: r for r in runs}
    records = {}
    for name in order(by_name):
        if progress:
            print(f"[zoo] evaluating {name} ({by_name[name].folder})", flush=True)
        records[name] = evaluate_run(by_name[name], options, data, force, progress=progress)
    for name in chosen:
        out = ship_model(by_name[name], records[name], root, cards.model_card(records[name]))
        if progress:
            print(f"[zoo] shipped {name}: {out} ({folder_bytes(out) / 1e6:.2f} MB)", flush=True)
    if docs is not None:
        path = cards.write_docs(list(records.values()), Path(docs), shipped=chosen)
        if progress:
            print(f"[zoo] wrote {path}", flush=True)
    return list(records.values())


# ---------------------------------------------------------------- re-measuring shipped models


def recorded_device(record: dict[str, Any], task: str) -> str:
    """The device that measured ``task``'s current numbers in a shipped ``record``: its last re-measure's, else the
    shipping evaluation's; ``"cuda"`` becomes ``"cpu"`` (said on stdout) where no GPU is present, since CPU and
    CUDA kernels round differently (up to about 1e-3 relative in perplexity)."""
    device = record["eval"].get("remeasured", {}).get(task, {}).get("device") or \
        record["eval"]["request"]["options"].get("device") or "cpu"
    if device == "auto" or device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"[zoo] {record['name']}: {task} was measured on {device}; no GPU here, measuring on cpu "
                  "(rounding may differ in the last digits)", flush=True)
            return "cpu"
        return "cuda" if device == "auto" else device
    return device


def remeasure(names: Sequence[str], tasks: Sequence[str], why: str, zoo_dir: str | Path | None = None,
              device: str = "recorded", progress: bool = True) -> list[dict[str, Any]]:
    """Run ``tasks`` again on shipped models, with the settings their records were made with, on the zoo's own
    held-out text; replace those tasks in each ``eval.json``, note when, where and ``why`` under
    ``eval["remeasured"]``, and re-render the model card. For a task whose protocol changed after the models were
    shipped (the runs that made them need not exist any more). Weights and every other number stay as they are.
    ``device="recorded"`` measures each task on the device its current numbers came from (``recorded_device``),
    so that an unchanged protocol reproduces them exactly."""
    import datetime
    import tempfile

    from linmem import zoo
    from linmem.zoo import cards

    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown or list(tasks)}; choose from {', '.join(TASKS)}")
    if not why.strip():
        raise ValueError("say why the tasks are measured again (--why): the record keeps it")
    records = []
    for name in names:
        folder = zoo.path(name, zoo_dir)
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        if sha256(folder / "model.safetensors") != record["model_sha256"]:
            raise ValueError(f"{name}: model.safetensors is not the file its {RECORD} was measured on")
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in record["eval"]["request"]["options"].items()}
        by_device: dict[str, list[str]] = {}
        for task in tasks:
            by_device.setdefault(recorded_device(record, task) if device == "recorded" else device, []).append(task)
        when = datetime.date.today().isoformat()
        for where, group in by_device.items():
            options = replace(EvalOptions(**settings), data=None, device=where)  # data: the shipped held-out text
            if progress:
                print(f"[zoo] measuring {', '.join(group)} of {name} again on {where}", flush=True)
            with tempfile.TemporaryDirectory() as scratch:  # the runner's report; the package folder is untouched
                report = evaluate(folder, group, options, out_dir=scratch, progress=progress)
            for task in group:
                record["eval"]["tasks"][task] = report["tasks"][task]
                record["eval"].setdefault("remeasured", {})[task] = {"date": when, "device": where, "why": why}
        record["eval"]["seconds"] = evaluation_seconds(record["eval"]["tasks"])
        write_json_atomic(folder / RECORD, record)
        with atomic_write(folder / CARD, "w") as f:  # a card in place is never half-written
            f.write(cards.model_card(record))
        write_manifest(folder)
        records.append(record)
    return records
