"""The study file: models trained under one recipe, the seeds, the evaluation, the comparisons.

```yaml
name: rla-paper
seeds: [0, 1, 2]
recipe: {include: ../zoo/base.yaml, train: {steps: 3000}}   # data, optim, train shared by every model
eval: {tasks: [ppl, cloze, mqar, niah, stability], options: {split: test, max_tokens: all}}
models:
  - {name: rdn, config: ../zoo/rdn.yaml}
  - {name: rdn-tied-gamma, config: ../zoo/rdn.yaml, set: {model.gamma: tied}}
compare: [[rdn, gdn], [rdn, rdn-tied-gamma]]                # A vs B: A - B with a CI
claims:                                                     # decided with a Holm-corrected test; the rest exploratory
  - {a: rdn, b: gdn, metrics: [test_ppl, mqar]}
```

``claims`` are the comparisons the study sets out to decide, stated before its runs: each a pair of ``compare``
(A - B as written there) with the metrics it is about. Only they are decided (``linmem.study.tables``: a paired test
over seeds, Holm-corrected over every claimed metric of the study); every other comparison is exploratory.

Each model is a ``linmem train`` config (``config``, relative to the study file) with ``set`` overrides
(dotted keys). Its sections are resolved as ``linmem train`` would read them with the recipe merged over them, the
seed set to the study's, then checked key by key against the recipe: every key of ``data``, ``optim`` and ``train``
must equal the recipe's value, except

- ``PER_MODEL_KEYS`` (the peak learning rate and its floor): the stable peak rate depends on the architecture
  (the zoo's rate races chose 2e-3 to 5e-3 for mixers of one size); one shared rate favours the mixer it suits.
  A study lists the ones it lets differ under ``per_model`` and states them in each model's config, never in the
  recipe;
- ``UPDATE_NEUTRAL_KEYS``: settings that change no update (logging, checkpoint cadence, device, micro-batching,
  the loss computed in pieces, recomputed activations, the saved dtype);
- ``train.seed``, which the study sets.

Anything else that differs (data, tokens, batch, schedule shape, weight decay, clipping, recall mix) is refused
with the key and both values: the models of one study differ in their ``model`` section and allowed keys only.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from linmem.eval.runner import TASKS, EvalOptions
from linmem.eval.task_names import WHOLE_SPLIT
from linmem.train.config import TrainConfig, apply_overrides, parse_config, read_config_dict
from linmem.train.trainer import RESUME_FREE_KEYS

PER_MODEL_KEYS = ("optim.lr", "optim.min_lr")
UPDATE_NEUTRAL_KEYS = frozenset({k for k in RESUME_FREE_KEYS if k.split(".")[0] in ("data", "optim", "train")}
                                | {"train.gradient_checkpointing", "train.loss_chunk_tokens"})
RECIPE_SECTIONS = ("data", "optim", "train")
MIN_SEEDS = 3
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
STUDY_KEYS = {"name", "description", "seeds", "recipe", "per_model", "eval", "models", "compare", "claims"}
# eval options recorded only when a study sets them away from their defaults: the records of runs evaluated
# before these options existed hold the same settings without them, and stay comparable (runs.check_finished_run)
RECORDED_IF_SET = ("recall_template", "recall_keys", "recall_values", "recall_bindings")


@dataclass(frozen=True)
class StudyModel:
    """One model of a study: its name (a folder name), training config file and dotted overrides."""

    name: str
    config: Path
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """A comparison the study sets out to decide: ``a`` - ``b`` (a pair of ``compare``) on each of ``metrics``."""

    a: str
    b: str
    metrics: tuple[str, ...]


@dataclass
class Study:
    """A checked study file (``load_study``)."""

    path: Path
    name: str
    description: str
    seeds: list[int]
    recipe: dict[str, Any]  # data / optim / train as written (includes resolved)
    recipe_config: TrainConfig  # the recipe with every default filled in
    per_model: list[str]
    tasks: list[str]
    eval_options: EvalOptions
    models: list[StudyModel]
    compare: list[tuple[str, str]]
    claims: list[Claim] = field(default_factory=list)

    def model(self, name: str) -> StudyModel:
        for model in self.models:
            if model.name == name:
                return model
        raise ValueError(f"{self.path}: no model {name!r} in the study; models: {', '.join(self.model_names)}")

    @property
    def model_names(self) -> list[str]:
        return [m.name for m in self.models]

    def eval_record(self) -> dict[str, Any]:
        """The evaluation settings every run shares (device excluded), as recorded next to each run's results."""
        options = dataclasses.asdict(self.eval_options)
        options.pop("device")
        defaults = EvalOptions()
        for key in RECORDED_IF_SET:
            if options[key] == getattr(defaults, key):
                options.pop(key)
        return {"tasks": list(self.tasks), "options": {k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in options.items()}}


def _require(condition: bool, where: Path, message: str) -> None:
    if not condition:
        raise ValueError(f"{where}: {message}")


def load_study(path: str | Path) -> Study:
    """Read and check a study file (``ValueError`` naming the key); every model's config is resolved and checked
    against the recipe (``resolve_model``) before anything runs."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no study file at {str(path)!r}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    _require(isinstance(raw, dict), path, "the top level must be a mapping")
    unknown = sorted(set(raw) - STUDY_KEYS)
    _require(not unknown, path, f"unknown key {', '.join(unknown)}; known keys: {', '.join(sorted(STUDY_KEYS))}")
    name = str(raw.get("name") or path.stem)
    seeds = _seeds(raw.get("seeds"), path)
    recipe, recipe_config, per_model = _recipe(raw, path)
    tasks, options = _eval_section(raw.get("eval") or {}, path)
    models = _models(raw.get("models"), path)
    study = Study(path, name, str(raw.get("description", "")), seeds, recipe, recipe_config, per_model, tasks,
                  options, models, [])
    study.compare = _comparisons(raw.get("compare") or [], study)
    study.claims = _claims(raw.get("claims") or [], study)
    for model in models:
        resolve_model(study, model, seeds[0])
    return study


def _seeds(value: Any, path: Path) -> list[int]:
    ok = isinstance(value, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)
    _require(ok, path, f"seeds must be a list of integers >= 0; got {value!r}")
    _require(len(set(value)) == len(value), path, f"seeds must be distinct; got {value}")
    _require(len(value) >= MIN_SEEDS, path, f"seeds: a study needs at least {MIN_SEEDS} seeds per model (every "
             f"seed is reported, none picked); got {value}")
    return list(value)


def _recipe(raw: dict[str, Any], path: Path) -> tuple[dict[str, Any], TrainConfig, list[str]]:
    recipe = raw.get("recipe")
    _require(isinstance(recipe, dict), path, "recipe must be a mapping with data, optim and train (include: allowed)")
    resolved = read_config_dict(path, yaml.safe_dump(recipe))
    extra = sorted(set(resolved) - set(RECIPE_SECTIONS))
    _require(not extra, path, f"recipe may hold only {', '.join(RECIPE_SECTIONS)} (and include); got {extra}")
    per_model = raw.get("per_model", list(PER_MODEL_KEYS))
    _require(isinstance(per_model, list) and all(k in PER_MODEL_KEYS for k in per_model), path,
             f"per_model may list only {', '.join(PER_MODEL_KEYS)} (the rest is the one recipe); got {per_model!r}")
    stated = [k for k in per_model if _get(resolved, k) is not _MISSING]
    _require(not stated, path, f"recipe states {', '.join(stated)}, which per_model lets each model choose: state it "
             "in the models' configs (or drop it from per_model to share it)")
    config = parse_config({**resolved, "model": {}}, where=f"{path}: recipe")
    return resolved, config, list(per_model)


def _eval_section(section: Any, path: Path) -> tuple[list[str], EvalOptions]:
    _require(isinstance(section, dict), path, "eval must be a mapping with tasks and options")
    unknown = sorted(set(section) - {"tasks", "options"})
    _require(not unknown, path, f"unknown key eval.{', eval.'.join(unknown)}; known: eval.tasks, eval.options")
    tasks = section.get("tasks", ["ppl"])
    _require(isinstance(tasks, list) and tasks and all(t in TASKS for t in tasks), path,
             f"eval.tasks must be a non-empty list of {', '.join(TASKS)}; got {tasks!r}")
    options = dict(section.get("options") or {})
    fields = {f.name for f in dataclasses.fields(EvalOptions)} - {"device"}
    unknown = sorted(set(options) - fields)
    _require(not unknown, path, f"unknown key eval.options.{', eval.options.'.join(unknown)}; known: "
             f"{', '.join(sorted(fields))} (the device is chosen with --device)")
    if options.get("max_tokens") == "all":
        options["max_tokens"] = WHOLE_SPLIT
    for key, value in options.items():
        default = getattr(EvalOptions(), key)
        kind = tuple if isinstance(default, tuple) else type(default) if default is not None else (int, type(None))
        if kind is tuple:
            _require(isinstance(value, list) and value, path, f"eval.options.{key} must be a non-empty list")
            options[key] = tuple(value)
        elif kind is float and isinstance(value, int):
            options[key] = float(value)
        else:
            _require(isinstance(value, kind) and not isinstance(value, bool), path,
                     f"eval.options.{key} must be {getattr(kind, '__name__', 'an integer')}; got {value!r}")
    try:
        return list(tasks), EvalOptions(**options)
    except ValueError as e:
        raise ValueError(f"{path}: eval.options: {e}") from None


def _models(value: Any, path: Path) -> list[StudyModel]:
    _require(isinstance(value, list) and len(value) >= 2, path, "models must be a list of at least two "
             "{name, config, set} mappings")
    models: list[StudyModel] = []
    for i, entry in enumerate(value):
        where = f"models[{i}]"
        _require(isinstance(entry, dict) and not set(entry) - {"name", "config", "set"}, path,
                 f"{where} must be a mapping with name, config and optional set")
        name, config = entry.get("name"), entry.get("config")
        _require(isinstance(name, str) and bool(NAME.match(name)), path,
                 f"{where}.name must be lower-case letters, digits, '.', '_' or '-'; got {name!r}")
        _require(name not in {m.name for m in models}, path, f"{where}.name {name!r} appears twice")
        _require(isinstance(config, str), path, f"{where}.config must be a training config path")
        overrides = entry.get("set") or {}
        _require(isinstance(overrides, dict), path, f"{where}.set must be a mapping of dotted keys to values")
        file = (path.parent / config).resolve()
        if not file.is_file():
            raise FileNotFoundError(f"{path}: {where}.config: no training config at {str(file)!r}")
        models.append(StudyModel(name, file, dict(overrides)))
    return models


def _comparisons(value: Any, study: Study) -> list[tuple[str, str]]:
    pairs = []
    for i, pair in enumerate(value):
        _require(isinstance(pair, list) and len(pair) == 2 and pair[0] != pair[1], study.path,
                 f"compare[{i}] must be [A, B] with two different model names; got {pair!r}")
        for name in pair:
            study.model(name)
        pairs.append((pair[0], pair[1]))
    return pairs


def _claims(value: Any, study: Study) -> list[Claim]:
    from linmem.study.tables import metric_names  # the tables define the metrics (and import this module)

    where = study.path
    _require(isinstance(value, list), where, "claims must be a list of {a, b, metrics} mappings")
    names, prefixes = metric_names(study)
    claims: list[Claim] = []
    for i, entry in enumerate(value):
        _require(isinstance(entry, dict) and set(entry) == {"a", "b", "metrics"}, where,
                 f"claims[{i}] must be a mapping with a, b and metrics (a pair of compare, the metrics it is about)")
        pair, metrics = (entry["a"], entry["b"]), entry["metrics"]
        _require(pair in study.compare, where, f"claims[{i}]: [{pair[0]}, {pair[1]}] is not in compare; a claim is "
                 "one of the compared pairs, in the order compare gives it (add it there)")
        _require(pair not in {(c.a, c.b) for c in claims}, where, f"claims[{i}]: [{pair[0]}, {pair[1]}] is claimed "
                 "twice; list all its metrics in one entry")
        _require(isinstance(metrics, list) and metrics and len(set(map(str, metrics))) == len(metrics), where,
                 f"claims[{i}].metrics must be a non-empty list of distinct metric names; got {metrics!r}")
        unknown = [m for m in metrics if not isinstance(m, str) or (m not in names and not m.startswith(prefixes))]
        _require(not unknown, where, f"claims[{i}].metrics: {', '.join(map(repr, unknown))} not a metric of this "
                 f"study; its tasks give {', '.join(sorted(names))}" + "".join(f", {p}..." for p in prefixes))
        claims.append(Claim(pair[0], pair[1], tuple(metrics)))
    return claims


_MISSING = object()


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def flat_sections(config: TrainConfig) -> dict[str, Any]:
    """``{"data.seq_len": 512, ...}`` over the recipe sections of ``config``."""
    out = {}
    for section in RECIPE_SECTIONS:
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            out[f"{section}.{key}"] = value
    return out


def check_settings(settings: Sequence[str]) -> list[str]:
    """``section.key=value`` items given to a study's runs from outside the study file (``linmem study --set``):
    only settings that change no update (``UPDATE_NEUTRAL_KEYS``), so that the recipe stays the file's."""
    for item in settings:
        key = item.partition("=")[0].strip()
        if key not in UPDATE_NEUTRAL_KEYS:
            raise ValueError(f"--set {item!r}: a study's runs take only settings that change no update "
                             f"({', '.join(sorted(UPDATE_NEUTRAL_KEYS))}); the recipe is the study file's")
    return list(settings)


def resolve_model(study: Study, model: StudyModel, seed: int, settings: Sequence[str] = ()) -> TrainConfig:
    """The training config of ``model`` at ``seed``: its file, the recipe over it (the per-model keys left as
    the file has them), its ``set`` overrides, ``train.seed``, then ``settings`` (``check_settings``);
    ``ValueError`` when a section key differs from the recipe (see the module docstring)."""
    shared = json.loads(json.dumps(study.recipe))  # a deep copy
    text = yaml.safe_dump({"include": [str(model.config)], **shared})
    raw = read_config_dict(study.path.parent / f".{model.name}.study.yaml", text)
    raw = apply_overrides(raw, [f"{k}={json.dumps(v)}" for k, v in model.overrides.items()]
                          + check_settings(settings))
    raw.setdefault("train", {})["seed"] = seed
    raw["name"] = model.name
    where = f"{study.path}: model {model.name} ({model.config.name})"
    config = parse_config(raw, where=where)
    ours, recipe = flat_sections(config), flat_sections(study.recipe_config)
    free = set(study.per_model) | UPDATE_NEUTRAL_KEYS | {"train.seed"}
    differ = [k for k in ours if k not in free and ours[k] != recipe[k]]
    if differ:
        shown = "; ".join(f"{k} = {ours[k]!r}, recipe {recipe[k]!r}" for k in differ)
        raise ValueError(f"{where}: differs from the study's recipe: {shown}. Every model of a study trains under one "
                         f"recipe: state the key in the recipe, or remove it from the model's config or set "
                         f"(only {', '.join(PER_MODEL_KEYS)} may differ per model, listed under per_model)")
    return config
