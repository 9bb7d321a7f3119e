"""The run folder of a study, and running it: every (model, seed) trained, evaluated and recorded, resumably.

```
OUT/study.json                          the study file's text and every resolved training config
OUT/runs/MODEL/seed-S/                  a linmem train run folder (checkpoints/, metrics.jsonl, model/)
OUT/runs/MODEL/seed-S/eval/             linmem.eval.runner's report (results.json, results.md, figures)
OUT/runs/MODEL/seed-S/items.json        per-item records (linmem.study.items), written last: the run is finished
OUT/tables/                             results.md, results.json and figures (linmem.study.tables)
```

A finished run (its ``items.json`` present) is skipped once its recorded training config and evaluation settings
are checked against the study's (a changed study is refused by key, never mixed into one table); an interrupted
run resumes from its newest checkpoint (``linmem train --resume``), or re-evaluates when only the evaluation was
cut short.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from linmem.eval.loading import load_model, open_heldout
from linmem.eval.runner import NEEDS_TEXT, evaluate
from linmem.io.atomic import write_json_atomic
from linmem.io.folders import prepare_output_folder, read_marker
from linmem.study.definition import Study, resolve_model
from linmem.study.items import agreement, item_records
from linmem.train.config import TrainConfig
from linmem.train.trainer import METRICS, MODEL_DIR, config_changes, read_metrics, train

RUNS = "runs"
ITEMS = "items.json"
EVAL_DIR = "eval"
STUDY_RECORD = "study.json"
KIND = "study"


def run_dir(out: Path, model: str, seed: int) -> Path:
    return out / RUNS / model / f"seed-{seed}"


def is_finished(out: Path, model: str, seed: int) -> bool:
    return (run_dir(out, model, seed) / ITEMS).is_file()


def read_items(out: Path, model: str, seed: int) -> dict[str, Any]:
    return json.loads((run_dir(out, model, seed) / ITEMS).read_text(encoding="utf-8"))


def training_log(folder: Path) -> list[dict[str, Any]]:
    path = folder / METRICS
    if not path.is_file():
        return []
    return read_metrics(path)


@dataclass
class StudyProgress:
    """What ``run_study`` did: runs trained and evaluated, runs skipped as finished, the run a signal stopped."""

    done: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, int]] = field(default_factory=list)
    interrupted: tuple[str, int] | None = None


def parse_seeds(text: str | None, study: Study) -> list[int]:
    """``--seeds 0,1,2`` (a subset of the study's seeds; None: all of them)."""
    if text is None:
        return list(study.seeds)
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers; got {text!r}") from None
    unknown = [s for s in seeds if s not in study.seeds]
    if not seeds or unknown:
        raise ValueError(f"--seeds {text!r}: the study's seeds are {study.seeds}; a run outside them would not be "
                         f"part of the study")
    return seeds


def check_study_folder(out: Path, study: Study) -> None:
    """``out`` is a study folder of ``study`` (or new): another study's folder is refused."""
    record = out / STUDY_RECORD
    if record.is_file():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if saved.get("name") != study.name:
            raise ValueError(f"{out}: holds study {saved.get('name')!r}, not {study.name!r}; choose another --out")


def write_study_record(out: Path, study: Study) -> None:
    configs = {m.name: {str(s): resolve_model(study, m, s).to_dict() for s in study.seeds} for m in study.models}
    write_json_atomic(out / STUDY_RECORD, {"name": study.name, "description": study.description,
                                           "study_file": study.path.read_text(encoding="utf-8"),
                                           "seeds": study.seeds, "per_model": study.per_model,
                                           "eval": study.eval_record(), "configs": configs})


def check_finished_run(out: Path, study: Study, model: str, seed: int, config: TrainConfig) -> None:
    """A finished run must have been trained with ``config`` and evaluated with the study's settings."""
    folder = run_dir(out, model, seed)
    where = f"{study.path}: {model} seed {seed}"
    saved = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    differ = config_changes(saved, config.to_dict())
    if differ:
        raise ValueError(f"{where}: {folder} was trained with another config than the study file gives it "
                         f"({', '.join(differ)} differ); restore the file, or move that run away to redo it")
    recorded = read_items(out, model, seed).get("eval")
    if recorded != study.eval_record():
        raise ValueError(f"{where}: {folder / ITEMS} was evaluated with other settings ({recorded}) than the study's "
                         f"({study.eval_record()}); a study evaluates every run alike: move that run away to redo it")


def check_finished_runs(out: Path, study: Study) -> list[tuple[str, int]]:
    """Every finished (model, seed) in ``out`` checked against the study file as it is now (``check_finished_run``),
    so that tables rebuilt from the folder never report a run under settings it was not trained or evaluated with."""
    finished = [(m.name, s) for m in study.models for s in study.seeds if is_finished(out, m.name, s)]
    for name, seed in finished:
        check_finished_run(out, study, name, seed, resolve_model(study, study.model(name), seed))
    return finished


def train_one(out: Path, study: Study, config: TrainConfig, model: str, seed: int) -> bool:
    """Train (or resume) one run; False when a signal stopped it (its checkpoint is written)."""
    folder = run_dir(out, model, seed)
    resume = folder.is_dir() and read_marker(folder) is not None
    info = train(config, folder, resume=resume, where=f"{study.path}: {model} seed {seed}")
    return not info.get("interrupted")


def evaluate_one(out: Path, study: Study, model: str, seed: int, device: str) -> None:
    """The eval runner's report and the per-item records of one trained run; ``items.json`` is written last."""
    folder = run_dir(out, model, seed)
    options = dataclasses.replace(study.eval_options, device=device)
    report = evaluate(folder / MODEL_DIR, study.tasks, options, out_dir=folder / EVAL_DIR, progress=False)
    em = load_model(folder / MODEL_DIR, device)
    split = open_heldout(em, options.data, options.split) if NEEDS_TEXT & set(study.tasks) else None
    records = item_records(em, split, study.tasks, options)
    metrics = {name: result.get("metrics", {}) for name, result in report["tasks"].items()}
    tables = {name: result["table"] for name, result in report["tasks"].items() if "table" in result}
    write_json_atomic(folder / ITEMS, {"model": model, "seed": seed, "eval": study.eval_record(),
                                       "records": records, "eval_metrics": metrics, "eval_tables": tables,
                                       "agreement": agreement(records, report)})


def run_study(study: Study, out: str | Path, seeds: Sequence[int] | None = None, only: Sequence[str] | None = None,
              device: str = "auto", progress: bool = True, settings: Sequence[str] = ()) -> StudyProgress:
    """Train and evaluate every (model, seed) of ``study`` (or the ``only`` models, the ``seeds``) into ``out``
    (module docstring), each with ``settings`` (``section.key=value`` that change no update, such as
    ``train.compile=true``); stops after a run a signal interrupted (``StudyProgress.interrupted``)."""
    out = Path(out)
    check_study_folder(out, study)
    prepare_output_folder(out, overwrite=False, kind=KIND)
    write_study_record(out, study)
    names = list(only) if only else study.model_names
    for name in names:
        study.model(name)
    pairs = [(name, seed) for name in names for seed in (seeds or study.seeds)]
    result = StudyProgress()
    bar = tqdm(pairs, disable=not progress, unit="run", desc=study.name)
    for name, seed in bar:
        bar.set_postfix(model=name, seed=seed)
        config = resolve_model(study, study.model(name), seed, settings)
        config.train.device = device
        config.train.progress = progress
        if is_finished(out, name, seed):
            check_finished_run(out, study, name, seed, config)
            result.skipped.append((name, seed))
            continue
        if not train_one(out, study, config, name, seed):
            result.interrupted = (name, seed)
            break
        evaluate_one(out, study, name, seed, device)
        result.done.append((name, seed))
    bar.close()
    return result
