"""linmem study: the one-recipe check refuses by key, the bootstrap estimates against float64 references, and a tiny
study end to end (2 models x 3 seeds: tables with every seed, intervals around their values, a resumed interrupted
run, finished runs skipped, --report-only byte for byte)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from linmem.cli import main
from linmem.io.environment import environment
from linmem.io.folders import prepare_output_folder
from linmem.memory.experiment_names import CLEAN_RECALL_GATE
from linmem.memory.stats import Estimate
from linmem.study.definition import MIN_SEEDS, load_study, resolve_model
from linmem.study.estimates import ItemSet, item_estimate, paired_difference, seed_estimate
from linmem.study.runs import check_finished_runs, run_dir
from linmem.study.tables import _verdict, decide
from linmem.train.trainer import train
from tests.script_modules import load_script
from tests.test_train_support import TINY  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parent.parent
run_archive = load_script(REPO / "scripts" / "study" / "run_archive.py", "run_archive")
STUDY_SCRIPTS = REPO / "scripts" / "study"


def write_model_config(folder: Path, name: str, mixer: str, **sections) -> Path:
    """A tiny training config of ``mixer`` (``TINY``'s model; the study's recipe supplies data, optim, train)."""
    config = {"name": name, "model": {**copy.deepcopy(TINY["model"]), "mixer": mixer},
              "optim": {"lr": 3e-3, "min_lr": 3e-4}, **sections}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def write_study(folder: Path, dataset: Path, models: list[dict], **changes) -> Path:
    study = {
        "name": "tiny-study",
        "seeds": [0, 1, 2],
        "recipe": {"data": {"dir": str(dataset), "seq_len": 32, "recall_fraction": 0.25,
                            "recall": [{"name": "mqar", "num_kv_pairs": 4}]},
                   "optim": {"warmup_steps": 1},
                   "train": {"steps": 3, "batch_size": 4, "eval_interval": 3, "eval_tokens": 256,
                             "eval_recall_samples": 4, "checkpoint_interval": 1, "progress": False, "device": "cpu",
                             "eval_lab_recall": [{"template": "code", "keys": "names", "values": "colors",
                                                  "loads": [1], "items": 8, "filler": 40}]}},
        "eval": {"tasks": ["ppl", "mqar", "niah", "stability"],
                 "options": {"max_tokens": "all", "batch_size": 16, "mqar_pairs": [2, 4], "mqar_samples": 8,
                             "niah_lengths": [96, 128], "niah_depths": [0.0, 1.0], "niah_samples": 3,
                             "stability_windows": 2}},
        "models": models,
        "compare": [[models[1]["name"], models[0]["name"]]],
        **changes,
    }
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(study), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def configs(dataset, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("configs")
    return write_model_config(folder, "gdn", "gdn"), write_model_config(folder, "rla", "rla")


def two_models(configs) -> list[dict]:
    return [{"name": "gdn", "config": str(configs[0])}, {"name": "rla", "config": str(configs[1])}]


# ---------------------------------------------------------------- the one recipe


@pytest.mark.parametrize("change, error", [
    ({"set": {"optim.weight_decay": 0.0}}, r"model bad .*optim\.weight_decay = 0\.0, recipe 0\.1"),
    ({"set": {"train.steps": 4}}, r"train\.steps = 4, recipe 3"),
    ({"data": {"split_documents": True}}, r"data\.split_documents = True, recipe False"),
])
def test_a_model_off_the_recipe_is_refused(dataset, configs, tmp_path, change, error):
    bad = write_model_config(tmp_path, "bad", "gdn", **({"data": change["data"]} if "data" in change else {}))
    entry = {"name": "bad", "config": str(bad), **({"set": change["set"]} if "set" in change else {})}
    with pytest.raises(ValueError, match=error):
        load_study(write_study(tmp_path, dataset, [*two_models(configs), entry]))


def test_per_model_learning_rate_and_neutral_keys_pass(dataset, configs, tmp_path):
    entry = {"name": "fast", "config": str(configs[0]),
             "set": {"optim.lr": 5e-3, "optim.min_lr": 5e-4, "train.micro_batch_size": 2}}
    study = load_study(write_study(tmp_path, dataset, [*two_models(configs), entry]))
    config = resolve_model(study, study.model("fast"), 2)
    assert (config.optim.lr, config.train.seed, config.train.steps) == (5e-3, 2, 3)


def test_runs_take_only_update_neutral_settings_from_the_command_line(dataset, configs, tmp_path, capsys):
    path = write_study(tmp_path, dataset, two_models(configs))
    study = load_study(path)
    config = resolve_model(study, study.model("gdn"), 1, ["train.compile=true", "train.micro_batch_size=2"])
    assert (config.train.compile, config.train.micro_batch_size, config.train.seed) == (True, 2, 1)
    assert resolve_model(study, study.model("gdn"), 1).train.compile is False
    for item in ("optim.weight_decay=0", "train.steps=4", "data.seq_len=16"):
        with pytest.raises(ValueError, match="change no update"):
            resolve_model(study, study.model("gdn"), 1, [item])
    # the command refuses a recipe key before it trains or writes anything
    out = tmp_path / "out"
    assert main(["study", str(path), "--out", str(out), "--set", "optim.lr=1", "--no-progress"]) != 0
    assert "change no update" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("changes, error", [
    ({"seeds": [0, 1]}, r"at least 3 seeds"),
    ({"per_model": ["data.seq_len"]}, r"per_model may list only"),
    ({"eval": {"options": {"max_tokns": 5}}}, r"unknown key eval\.options\.max_tokns"),
    ({"compare": [["gdn", "nope"]]}, r"no model 'nope'"),
])
def test_study_file_errors_name_the_key(dataset, configs, tmp_path, changes, error):
    with pytest.raises(ValueError, match=error):
        load_study(write_study(tmp_path, dataset, two_models(configs), **changes))


def test_a_recipe_may_not_state_a_per_model_key(dataset, configs, tmp_path):
    path = write_study(tmp_path, dataset, two_models(configs))
    raw = yaml.safe_load(path.read_text())
    raw["recipe"]["optim"]["lr"] = 1e-3
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"recipe states optim\.lr"):
        load_study(path)


# ---------------------------------------------------------------- estimates


def test_item_estimate_matches_a_float64_reference():
    rng = np.random.default_rng()
    groups = np.repeat(["a", "b", "c"], 40)
    num, den = rng.random(120) * 5, rng.integers(1, 4, 120).astype(float)
    units = [f"u{i // 2}" for i in range(120)]  # two items per unit
    items = ItemSet.from_columns(units, groups, num, den)
    reference = np.mean([num[groups == g].sum() / den[groups == g].sum() for g in "abc"])
    estimate = item_estimate(items)
    assert estimate.mean == pytest.approx(reference, rel=1e-12)
    assert estimate.low < estimate.mean < estimate.high and (estimate.n, estimate.sources) == (120, 60)
    assert item_estimate(items, np.exp).mean == pytest.approx(np.exp(reference), rel=1e-12)


def test_seed_estimate_is_the_mean_of_the_seeds():
    values = dict(enumerate(np.random.default_rng().random(4)))
    estimate = seed_estimate(values)
    assert estimate.mean == pytest.approx(np.mean(list(values.values())), rel=1e-12)
    assert min(values.values()) <= estimate.low <= estimate.high <= max(values.values())


def shifted_items(rng: np.random.Generator, shift: float) -> ItemSet:
    """400 test items whose values scatter around 1 + shift."""
    num = rng.normal(1.0 + shift, 0.2, 400)
    return ItemSet.from_columns([f"w{i}" for i in range(400)], ["all"] * 400, num, np.ones(400))


def test_paired_difference_finds_a_shift_and_not_a_tie():
    rng = np.random.default_rng()
    a = {s: shifted_items(rng, 0.3) for s in range(3)}
    b = {s: shifted_items(rng, 0.0) for s in range(3)}
    shift = paired_difference(a, b)
    reference = np.mean([a[s].value() - b[s].value() for s in range(3)])
    assert shift.mean == pytest.approx(reference, rel=1e-12) and shift.low > 0.2 and shift.high < 0.4
    same = paired_difference(a, a)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)


def test_a_comparison_is_decided_only_over_enough_seeds():
    rng = np.random.default_rng()
    for seeds in range(1, MIN_SEEDS + 2):
        a = {s: shifted_items(rng, 0.3) for s in range(seeds)}
        b = {s: shifted_items(rng, 0.0) for s in range(seeds)}
        diff = paired_difference(a, b)
        assert diff.low > 0  # the items alone exclude zero at every seed count
        for higher in (True, False):
            verdict = decide(diff, 0.0, higher)
            assert verdict["decided"] == (seeds >= MIN_SEEDS)
            assert verdict["a_better"] == (higher if verdict["decided"] else None)
    # one seed of a scalar (a training loss): a zero-width interval away from zero decides nothing
    assert decide(Estimate(0.1, 0.1, 0.1, 1, 1), 0.0, False) == {"decided": False, "a_better": None}
    assert decide(Estimate(0.0, -0.1, 0.1, 3, 3), 0.0, True)["decided"] is False


# ---------------------------------------------------------------- end to end


def test_a_recall_lead_below_the_labs_gate_says_so():
    """A decided lead in the lab's recall between two models that both stay below its clean-recall gate is named
    as such; other verdicts read as before."""
    claim = {"a": "gdn", "b": "gla", "claim": True, "enough_seeds": True, "holm_p": 0.01}
    decided = {**claim, **decide(Estimate(0.03, 0.004, 0.065, 3, 3), 0.01, True)}
    assert _verdict(decided) == "gdn better"
    marked = _verdict({**decided, "below_gate": CLEAN_RECALL_GATE})
    assert marked == "gdn better (both below the lab's 0.5 recall gate)"
    undecided = {**claim, "holm_p": 0.2, **decide(Estimate(0.02, -0.01, 0.05, 3, 3), 0.2, True), "below_gate": 0.5}
    assert _verdict(undecided) == "not decided"


@pytest.mark.slow
def test_tiny_study_end_to_end(dataset, configs, tmp_path, capsys):
    path = write_study(tmp_path, dataset, two_models(configs),
                       claims=[{"a": "rla", "b": "gdn", "metrics": ["test_loss", "niah"]}])
    out = tmp_path / "out"
    study = load_study(path)
    prepare_output_folder(out, overwrite=False, kind="study")
    interrupted = run_dir(out, "gdn", 1)  # a run of the study stopped after 1 of its 3 updates
    train(resolve_model(study, study.model("gdn"), 1), interrupted, max_steps=1)

    assert main(["study", str(path), "--out", str(out), "--no-progress"]) == 0
    steps = [json.loads(line)["step"] for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # resumed, not restarted
    assert json.loads((interrupted / "model" / "train_info.json").read_text())["steps"] == 3
    tables = json.loads((out / "tables" / "results.json").read_text())
    for model in ("gdn", "rla"):
        entry = tables["models"][model]
        assert entry["seeds"] == [0, 1, 2] and entry["missing_seeds"] == []
        assert all(abs(d) < 1e-6 for s in entry["agreement"].values() for d in s.values()), entry["agreement"]
        for name in ("test_loss", "test_ppl", "mqar", "mqar@2", "niah", "norm", "train_loss"):
            metric = entry["metrics"][name]
            seeds = [metric["seeds"][str(s)]["mean"] for s in (0, 1, 2)]
            assert metric["seed_bootstrap"]["mean"] == pytest.approx(np.mean(seeds), rel=1e-5)
            assert metric["seed_bootstrap"]["low"] <= metric["seed_bootstrap"]["mean"] <= \
                metric["seed_bootstrap"]["high"]
            for value in metric["seeds"].values():
                if value["low"] is not None:
                    assert value["low"] <= value["mean"] <= value["high"]
    assert entry["metrics"]["test_ppl"]["seeds"]["0"]["mean"] == pytest.approx(
        np.exp(entry["metrics"]["test_loss"]["seeds"]["0"]["mean"]), rel=1e-5)
    compared = {c["metric"] for c in tables["comparisons"]}
    assert {"test_loss", "mqar", "niah"} <= compared
    # the claims alone are tested with Holm's correction; test perplexity resamples the windows' documents
    assert {c["metric"] for c in tables["comparisons"] if c["claim"]} == {"test_loss", "niah"}
    assert all((c["holm_p"] is None) != c["claim"] for c in tables["comparisons"])
    assert tables["test_resamples"] == "documents"
    # every run's record names what trained it: here this machine's CPU, torch and triton
    here = environment("cpu")
    cpu = f"cpu, torch {here['torch']}, triton {here['triton'] or 'not installed'}"
    assert [g["environment"] for g in tables["environments"]] == [cpu]
    assert sorted(tables["environments"][0]["runs"]) == [f"{m}:{s}" for m in ("gdn", "rla") for s in (0, 1, 2)]
    documents = json.loads((run_dir(out, "gdn", 0) / "items.json").read_text())["records"]["ppl"]["document"]
    assert 1 < len(set(documents)) < len(documents)
    assert {"metrics", "mqar", "loss_curves", "lab_recall", "norms", "differences"} <= set(tables["figures"])
    name = "val_lab_recall:code/names/colors@1"  # logged at the last update's evaluation, tabled per seed
    for seed in (0, 1, 2):
        logged = json.loads((run_dir(out, "rla", seed) / "metrics.jsonl").read_text().splitlines()[-1])[name]
        assert 0 <= logged <= 1 and entry["metrics"][name]["seeds"][str(seed)]["mean"] == pytest.approx(logged)
    markdown = (out / "tables" / "results.md").read_text()
    assert f"Trained on: {cpu} (6 runs)." in markdown
    assert "| rla | gdn | test_loss |" in markdown.split("## Claims")[1].split("## Exploratory")[0]
    assert "| rla | gdn | mqar |" in markdown.split("## Exploratory comparisons")[1]
    # a comparison of the lab's recall between two models both below its clean-recall gate is marked
    recall = [c for c in tables["comparisons"] if c["metric"].startswith(("lab_recall", "recall@", "val_lab_recall"))]
    assert recall
    for c in tables["comparisons"]:
        means = [tables["models"][m]["metrics"][c["metric"]]["seed_bootstrap"]["mean"] for m in (c["a"], c["b"])]
        assert ("below_gate" in c) == (c in recall and max(means) < CLEAN_RECALL_GATE), c

    before = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/items.json")}
    saved = {name: (out / "tables" / name).read_bytes() for name in ("results.json", "results.md")}
    assert main(["study", str(path), "--out", str(out), "--no-progress"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/items.json")} == before  # finished runs skipped
    assert main(["study", str(path), "--out", str(out), "--report-only", "--no-progress"]) == 0
    assert {name: (out / "tables" / name).read_bytes() for name in saved} == saved
    # a run recorded before an option existed counts at that option's default
    recorded = run_dir(out, "gdn", 2) / "config.yaml"
    old = yaml.safe_load(recorded.read_text())
    assert old["optim"].pop("fused") is False
    recorded.write_text(yaml.safe_dump(old))
    assert main(["study", str(path), "--out", str(out), "--report-only", "--no-progress"]) == 0
    assert {name: (out / "tables" / name).read_bytes() for name in saved} == saved
    # the study file edited after its runs: the report refuses the runs it no longer describes, naming what differs
    edited = tmp_path / "edited"
    edited.mkdir()
    models = [two_models(configs)[0], {**two_models(configs)[1], "set": {"optim.lr": 1e-3, "optim.min_lr": 1e-4}}]
    capsys.readouterr()
    assert main(["study", str(write_study(edited, dataset, models)), "--out", str(out), "--report-only"]) != 0
    assert re.search(r"rla seed 0: .* another config than the study file gives it \(optim\.lr, optim\.min_lr "
                     r"differ\)", capsys.readouterr().err)
    assert main(["study", str(write_study(edited, dataset, two_models(configs), eval={
        "tasks": ["ppl"], "options": {"max_tokens": "all"}})), "--out", str(out), "--report-only"]) != 0
    assert re.search(r"gdn seed 0: .*evaluated with other settings", capsys.readouterr().err)
    assert {name: (out / "tables" / name).read_bytes() for name in saved} == saved  # nothing rewritten

    # Perplexity per source of the windows: the tiny dataset has one source, so it is the whole split's.
    by_source = [name for name in entry["metrics"] if name.startswith("test_ppl@")]
    assert len(by_source) == 1
    assert entry["metrics"][by_source[0]]["seeds"]["2"]["mean"] == entry["metrics"]["test_ppl"]["seeds"]["2"]["mean"]
    # Records written before windows had sources or documents get the same labels from
    # scripts/study/label_window_sources.py.
    items = run_dir(out, "rla", 0) / "items.json"
    labelled = json.loads(items.read_text())
    assert {"source", "document"} <= set(labelled["records"]["ppl"])
    for missing in (["source"], ["document"], ["source", "document"]):
        unlabelled = copy.deepcopy(labelled)
        for column in missing:
            del unlabelled["records"]["ppl"][column]
        items.write_text(json.dumps(unlabelled))
        assert label_window_sources().label(items, None).startswith(f"labelled {' and '.join(missing)}")
        assert json.loads(items.read_text()) == labelled
    assert label_window_sources().label(items, None) == "already labelled"
    # a record whose sources are not the dataset's (other data) is refused, not labelled with documents it lacks
    wrong = copy.deepcopy(labelled)
    del wrong["records"]["ppl"]["document"]
    wrong["records"]["ppl"]["source"][0] = "elsewhere"
    items.write_text(json.dumps(wrong))
    with pytest.raises(ValueError, match="not the data the run was evaluated on"):
        label_window_sources().label(items, None)
    items.write_text(json.dumps(labelled))


def label_window_sources():
    path = STUDY_SCRIPTS / "label_window_sources.py"
    spec = importlib.util.spec_from_file_location("label_window_sources", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the loss-curve figure

RATES = ("eighth", "quarter", "half", "zoo", "double", "quad", "oct")  # a learning-rate study's tags, low to high


def write_training_logs(out: Path, rng, seeds: dict[str, int], steps: int = 40, every: int = 8) -> dict:
    """Random ``metrics.jsonl`` for ``seeds[model]`` seeds of each model under ``out`` (a training loss at every step,
    a validation loss every ``every`` steps); the study tables' ``models`` that name them."""
    for model, count in seeds.items():
        for seed in range(count):
            rows = [{"step": s, "tokens": 1000 * s, "loss": float(rng.uniform(2, 6)),
                     **({"val_loss": float(rng.uniform(2, 6))} if s % every == 0 else {})} for s in range(1, steps + 1)]
            run_dir(out, model, seed).mkdir(parents=True)
            (run_dir(out, model, seed) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"models": {model: {"seeds": list(range(count))} for model, count in seeds.items()}}


def assert_legends_inside(fig) -> None:
    fig.canvas.draw()
    for legend in fig.legends:
        box = legend.get_window_extent()
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, \
            (box, fig.bbox)


def test_a_rate_study_draws_the_validation_loss_in_a_panel_per_family(tmp_path):
    from linmem.study.figures import _loss_figure, _rate_families, loss_curves
    from linmem.study.runs import training_log

    rng = np.random.default_rng()
    families = {"gdn": ("double", "half", "zoo"), "rdn-tied-gamma": ("eighth", "zoo", "oct"), "rla": ("zoo", "quad"),
                "gdn-wide": ("quarter", "half"), "sgla": ("double",)}
    seeds = {f"{family}-{rate}-lr": int(rng.integers(1, 4)) for family, rates in families.items() for rate in rates}
    seeds["gdn-double-lr"] = 2  # at least one line of several seeds
    tables = write_training_logs(tmp_path, rng, {**seeds, "rla-no-clip-zoo-lr": 0})  # declared, never run: no panel
    fig = _loss_figure(tmp_path, tables)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == list(families)
    colours = {}
    for i, (ax, (family, rates)) in enumerate(zip(panels, families.items())):
        lines = ax.get_lines()
        assert [line.get_label().split()[0] for line in lines] == sorted(rates, key=RATES.index)
        for line in lines:
            rate = line.get_label().split()[0]
            model = f"{family}-{rate}-lr"
            logs = [training_log(run_dir(tmp_path, model, s)) for s in range(seeds[model])]
            expected = np.mean(np.array([[r["val_loss"] for r in log if "val_loss" in r] for log in logs],
                                        dtype=np.float64), axis=0)
            assert np.allclose(line.get_ydata(), expected, rtol=1e-12)
            assert np.allclose(line.get_xdata(), np.arange(8, 41, 8) / 1e3)
            assert colours.setdefault(rate, tuple(line.get_color())) == tuple(line.get_color())  # one per rate
        note = " ".join(text.get_text() for text in ax.texts)
        several = {seeds[f"{family}-{r}-lr"] for r in rates} - {1}
        assert all(f"{n} seeds" in note for n in several) and (several or note == "1 seed each"), note
        assert ax.get_xlim()[0] == 0
        assert ax.get_ylabel() == ("validation loss (nats/token)" if i % 4 == 0 else "")
    assert "2 seeds" in panels[0].texts[0].get_text() and "double" in panels[0].texts[0].get_text()
    assert len(set(colours.values())) == len(colours)
    assert len({ax.get_ylim() for ax in panels}) == 1  # one y scale: panels compare
    assert {ax.get_xlabel() for ax in panels[-4:]} == {"training tokens (millions)"}  # under each column's last
    legend, = fig.legends
    shown = [text.get_text().split()[0] for text in legend.get_texts()]
    assert shown == [r for r in RATES if r in colours]  # low to high, every rate drawn
    assert [tuple(handle.get_color()) for handle in legend.legend_handles] == [colours[r] for r in shown]
    assert_legends_inside(fig)
    assert loss_curves(None, tmp_path, tables, tmp_path / "loss.png") == "loss.png"

    assert _rate_families(["rdn-tied-gamma-quad-lr", "gdn-zoo-lr", "gdn-half-lr"]) == {
        "rdn-tied-gamma": {"quad": "rdn-tied-gamma-quad-lr"}, "gdn": {"zoo": "gdn-zoo-lr", "half": "gdn-half-lr"}}
    assert _rate_families(["gdn-zoo-lr", "gdn-half-lr"]) is None  # one family: the two-panel figure
    assert _rate_families(["gdn-zoo-lr", "rdn"]) is None  # a model without a rate tag
    assert _rate_families(["gdn-zoo-lr", "rdn-triple-lr"]) is None


def test_loss_curves_of_many_models_tell_them_apart_with_the_whole_legend_shown(tmp_path):
    from matplotlib.colors import to_rgba

    from linmem.study.figures import _loss_figure

    rng = np.random.default_rng()
    seeds = {f"model-{i}": int(rng.integers(1, 3)) for i in range(26)}
    fig = _loss_figure(tmp_path, write_training_logs(tmp_path, rng, seeds))
    assert [ax.get_xlabel() for ax in fig.axes] == ["training tokens (millions)"] * 2
    for ax in fig.axes:
        styles = [(tuple(to_rgba(line.get_color())), line.get_linestyle()) for line in ax.get_lines()]
        assert len(styles) == 26 and len(set(styles)) == 26, styles
    legend, = fig.legends
    assert [text.get_text() for text in legend.get_texts()] == [
        f"{m} ({n} seed{'s' if n > 1 else ''})" for m, n in seeds.items()]
    assert_legends_inside(fig)

def test_layer_norm_figure_draws_each_seeds_readout_on_a_log_scale_and_the_mean_output_from_zero():
    from matplotlib.colors import to_rgba

    from linmem.study.figures import layer_norm_figure

    rng = np.random.default_rng()
    layers = int(rng.integers(3, 7))

    def table(memory: list[bool]) -> list[dict]:
        return [{"output_norm_mean": float(rng.uniform(1, 40)),
                 "readout_norm_mean": float(np.exp(rng.uniform(-7, 4))) if has else None} for has in memory]

    attention_at = int(rng.integers(layers))  # a hybrid's attention layer has no read-out: a gap in its line
    hybrid = [i != attention_at for i in range(layers)]
    stability = {"rla": {s: table([True] * layers) for s in range(3)},
                 "hybrid": {s: table(hybrid) for s in range(2)},
                 "transformer": {0: table([False] * layers)},  # no memory: the left panel only
                 "not-run": {}}
    fig = layer_norm_figure(stability)
    output, readout = fig.axes
    assert output.get_ylim()[0] == 0 and readout.get_yscale() == "log"
    means = {line.get_label().split(" (")[0]: line.get_ydata() for line in output.get_lines()}
    assert list(means) == ["rla", "hybrid", "transformer"]
    for model, seeds in stability.items():
        if seeds:
            expected = np.mean([[r["output_norm_mean"] for r in t] for t in seeds.values()], axis=0)
            assert np.allclose(means[model], expected, rtol=1e-12)
    drawn = [np.asarray(line.get_ydata(), dtype=float) for line in readout.get_lines()]
    expected = [[np.nan if r["readout_norm_mean"] is None else r["readout_norm_mean"] for r in t]
                for model in ("rla", "hybrid") for t in stability[model].values()]
    assert len(drawn) == 5 and all(np.allclose(d, e, equal_nan=True) for d, e in zip(drawn, expected))
    legend, = fig.legends  # one legend for both panels, the seed counts in it
    assert [t.get_text() for t in legend.get_texts()] == ["rla (3 seeds)", "hybrid (2 seeds)", "transformer (1 seed)"]
    style = {line.get_label().split(" (")[0]: (to_rgba(line.get_color()), line.get_linestyle())
             for line in output.get_lines()}
    assert [(to_rgba(line.get_color()), line.get_linestyle()) for line in readout.get_lines()] == \
        [style["rla"]] * 3 + [style["hybrid"]] * 2
    only_output = layer_norm_figure({"transformer": stability["transformer"]})
    assert len(only_output.axes) == 1 and layer_norm_figure({"not-run": {}}) is None
    # thirteen models (a study's size): a colour and line style each, in both panels
    many = layer_norm_figure({f"model-{i}": {0: table([True] * layers)} for i in range(13)})
    styles = {(to_rgba(line.get_color()), line.get_linestyle()) for line in many.axes[0].get_lines()}
    assert len(styles) == 13


def test_differences_draw_every_claimed_metric_beside_the_headline(tmp_path, monkeypatch):
    import linmem.study.figures as figures

    drawn = []
    monkeypatch.setattr(figures, "_save", lambda plt, fig, path: drawn.append(
        [ax.get_title() for ax in fig.axes if ax.get_visible()]) or path.name)
    rng = np.random.default_rng()

    def row(metric: str, claim: bool) -> dict:
        mean = float(rng.normal())
        return {"a": "rla", "b": "rla-no-clip", "metric": metric, "claim": claim, "enough_seeds": True,
                "difference": {"mean": mean, "low": mean - 1, "high": mean + 1, "n": 6}}

    tables = {"comparisons": [row("train_loss", True), row("log_readout_norm", True), row("val_loss", False),
                              row("readout_norm", False), row("test_loss", False)]}
    assert figures.differences(tables, tmp_path / "d.png") == "d.png"
    tables["comparisons"][1]["claim"] = False  # the same metric, no longer claimed: not drawn
    figures.differences(tables, tmp_path / "e.png")
    assert drawn == [["train_loss: A - B", "log_readout_norm: A - B", "test_loss: A - B"],
                     ["train_loss: A - B", "test_loss: A - B"]]
    assert figures.differences({"comparisons": [row("val_loss", False)]}, tmp_path / "f.png") is None


# ---------------------------------------------------------------- the shipped studies


@pytest.mark.parametrize("name", ["rla-paper", "remember", "remember-fixed"])
def test_shipped_studies_hold_one_recipe(name):
    study = load_study(Path(__file__).resolve().parent.parent / "configs" / "study" / f"{name}.yaml")
    configs = {m.name: resolve_model(study, m, study.seeds[0]) for m in study.models}
    assert len(study.seeds) >= 3 and all(c.train.steps == study.recipe_config.train.steps for c in configs.values())
    if name == "rla-paper":
        switches = {(k, v) for c in configs.values() for k, v in c.model.items()
                    if k in ("fit_history", "gamma", "output_gates", "residual_target")}
        assert switches == {("fit_history", False), ("gamma", "tied"), ("output_gates", False),
                            ("residual_target", "identity"), ("residual_target", "tanh")}
        assert {c.model["mixer"] for c in configs.values()} == {"sgla", "gdn", "rla", "rdn"}


@pytest.mark.parametrize("record", sorted({p.parent.name for p in (REPO / "docs" / "study").glob("*/runs-*.tar.xz")}))
def test_every_shipped_run_record_matches_its_study_file(record, tmp_path):
    """The records that docs/results.md's study tables are rebuilt from (every part, in order) were trained and
    evaluated as the study file now says (what `linmem study --report-only` checks before it writes a table)."""
    run_archive.unpack(record, tmp_path, REPO / "docs" / "study")
    study = load_study(REPO / "configs" / "study" / f"{record}.yaml")
    finished = check_finished_runs(tmp_path / record, study)
    tables = json.loads((REPO / "docs" / "study" / record / "results.json").read_text())
    assert sorted(finished) == sorted((m, s) for m, e in tables["models"].items() for s in e["seeds"])


def test_the_repositorys_studies_load_and_the_remember_studies_share_one_recipe():
    folder = Path(__file__).resolve().parents[1] / "configs" / "study"
    studies = {path.stem: load_study(path) for path in sorted(folder.glob("*.yaml")) if "recipe" not in path.stem}
    assert {"rla-paper", "remember", "remember-wide"} <= set(studies)
    for study in studies.values():  # every model resolves under its study's recipe
        for model in study.models:
            resolve_model(study, model, study.seeds[0])
    small, wide = studies["remember"], studies["remember-wide"]
    assert wide.recipe_config.to_dict() == small.recipe_config.to_dict()
    assert wide.eval_record() == small.eval_record()
    assert {m.name for m in wide.models} == {m.name for m in small.models}
    assert {resolve_model(wide, m, 0).model["hidden_size"] for m in wide.models} == {512}
    # the dictionary study: remember-wide's GDN and RDN and recipe, with the dictionary added to the text, and the
    # remember study's GDN and RDN at the zoo's size beside them
    more_text = studies["remember-dictionary"]
    recipe, base = more_text.recipe_config.to_dict(), wide.recipe_config.to_dict()
    assert recipe["data"]["sources"] == base["data"]["sources"] + ["gcide"]
    assert recipe["data"]["tokenizer"] == "data/zoo-4k/tokenizer.json" and recipe["data"]["dir"] != base["data"]["dir"]
    for section in ("data", "optim", "train"):
        same = {k: v for k, v in recipe[section].items() if k not in ("dir", "sources", "tokenizer")}
        assert same == {k: v for k, v in base[section].items() if k not in ("dir", "sources", "tokenizer")}
    assert more_text.eval_record() == wide.eval_record()
    for model in more_text.models:
        name, size = model.name.removesuffix("-small"), small if model.name.endswith("-small") else wide
        mine, theirs = resolve_model(more_text, model, 0), resolve_model(size, size.model(name), 0)
        assert mine.model == theirs.model and mine.optim == theirs.optim
    assert {m.name for m in more_text.models} == {"gdn", "rdn", "gdn-small", "rdn-small"}
    # the rate race of the dictionary study's wide models: the same recipe, evaluation and models, the peak rate
    # and its floor halved, kept and doubled; the kept rate's runs are the dictionary study's own, copied, so their
    # configs must be the same in every seed
    race = studies["remember-dictionary-lr"]
    assert race.recipe_config.to_dict() == more_text.recipe_config.to_dict()
    assert race.eval_record() == more_text.eval_record()
    for model in race.models:
        name, factor = model.name.split("-")[0], {"half-lr": 0.5, "shared-lr": 1.0,
                                                  "double-lr": 2.0}[model.name.split("-", 1)[1]]
        mine, theirs = resolve_model(race, model, 0), resolve_model(more_text, more_text.model(name), 0)
        assert mine.model == theirs.model
        assert dataclasses.replace(mine.optim, lr=theirs.optim.lr, min_lr=theirs.optim.min_lr) == theirs.optim
        assert (mine.optim.lr, mine.optim.min_lr) == pytest.approx((factor * theirs.optim.lr,
                                                                    factor * theirs.optim.min_lr))
        if factor == 1.0:  # all but the run's name
            for seed in race.seeds:
                copied = resolve_model(more_text, more_text.model(name), seed).to_dict()
                assert resolve_model(race, model, seed).to_dict() == {**copied, "name": model.name}
    assert len(race.models) == 6 and race.compare[0] == ("rdn-half-lr", "gdn-shared-lr")


def test_detached_pieces_carry_weights_larger_than_a_command_returns(tmp_path):
    """scripts/study/detached.sh pieces / join: a run's weights cut into pieces over several commands come back
    byte for byte; a missing or altered piece is refused and leaves no file."""
    script = STUDY_SCRIPTS / "detached.sh"
    weights = np.random.default_rng().integers(0, 256, 1000, dtype=np.uint8).tobytes()  # fresh bytes each run
    model_dir = tmp_path / "remote" / "study-x" / "runs" / "gdn" / "seed-2" / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "model.safetensors").write_bytes(weights)
    env = {**os.environ, "PIECE_BYTES": "300"}
    run = functools.partial(subprocess.run, capture_output=True, text=True, env=env)
    out = str(tmp_path / "remote" / "study-x")
    first = run(["bash", str(script), "pieces", str(tmp_path / "call1"), out, "gdn:2", "1", "2"], check=True)
    assert "4 pieces of 300 bytes; wrote pieces 1 to 2" in first.stdout
    run(["bash", str(script), "pieces", str(tmp_path / "call2"), out, "gdn:2", "3", "4"], check=True)
    names = sorted(p.name for p in (tmp_path / "call2").iterdir())
    assert names == ["study-x-gdn-seed-2.safetensors.003-of-004", "study-x-gdn-seed-2.safetensors.004-of-004",
                     "study-x-gdn-seed-2.safetensors.sha256"]
    files = sorted(map(str, [*(tmp_path / "call2").iterdir(), *(tmp_path / "call1").iterdir()]))  # any order
    here = tmp_path / "here" / "model"
    missing = run(["bash", str(script), "join", str(here), *[f for f in files if "003-of" not in f]])
    assert missing.returncode != 0 and "piece 3 of 004 is missing" in missing.stderr
    assert not (here / "model.safetensors").exists()
    joined = run(["bash", str(script), "join", str(here), *files], check=True)
    assert "joined 4 pieces" in joined.stdout and (here / "model.safetensors").read_bytes() == weights
    piece = tmp_path / "call1" / "study-x-gdn-seed-2.safetensors.002-of-004"
    altered = bytearray(piece.read_bytes())
    altered[7] ^= 1
    piece.write_bytes(bytes(altered))
    (here / "model.safetensors").unlink()
    refused = run(["bash", str(script), "join", str(here), *files])
    assert refused.returncode != 0 and "is not the recorded" in refused.stderr
    assert list(here.iterdir()) == []


def test_detached_watch_says_how_long_each_run_has_left(tmp_path):
    """The watch reads each run's last update, its total (the run's config) and its last speed: the seconds to the
    last update while it trains, "evaluating" after it, "evaluated" once its items are written."""
    script = STUDY_SCRIPTS / "detached.sh"
    out = tmp_path / "study"
    (tmp_path / "study-logs").mkdir()
    (tmp_path / "study-logs" / "queue.log").write_text("2026-12-03T00:00:00Z start a seed 0\n")
    config = "model:\n  hidden_size: 8\noptim:\n  warmup_steps: 10\ntrain:\n  steps: 300\n  batch_size: 2\nname: a\n"
    lines = {"a/seed-0": [{"step": 1, "tokens": 10, "tokens_per_s": 5.0},
                          {"step": 100, "tokens": 1000, "tokens_per_s": 50.0}],  # 10 tokens an update, 5 a second
             "a/seed-1": [{"step": 300, "tokens": 3000, "tokens_per_s": 50.0}],
             "b/seed-0": [{"step": 300, "tokens": 3000, "tokens_per_s": 50.0}]}
    for name, rows in lines.items():
        run = out / "runs" / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(config)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "runs" / "b" / "seed-0" / "items.json").write_text("{}")
    watched = subprocess.run(["bash", str(script), "watch", "1", str(out)], capture_output=True, text=True,
                             env={**os.environ, "WATCH_INTERVAL": "1"}, timeout=30, check=True).stdout
    assert "  a/seed-0: update 100 of 300, about 40 s to the last update" in watched  # 200 updates x 10 / 50
    assert "  a/seed-1: update 300 of 300, evaluating" in watched
    assert "  b/seed-0: evaluated" in watched
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)  # no verb: every verb's lines
    assert usage.returncode == 2 and usage.stderr.startswith("#   bash scripts/study/detached.sh start")
    assert usage.stderr.rstrip().endswith("unless every piece is there and the sha256 matches")


def test_detached_watch_waits_for_every_queue_started_on_a_folder(tmp_path):
    """A folder's queue log keeps every queue started on it: `start` says a new queue in the log before it returns,
    and the watch takes the folder for done only when the log ends in "queue done" and every queue said there has
    ended, so neither an earlier queue's end nor that of a shorter queue started beside it stops the watch."""
    script = STUDY_SCRIPTS / "detached.sh"
    out = tmp_path / "study"
    log = tmp_path / "study-logs" / "queue.log"
    log.parent.mkdir()
    log.write_text("2026-12-03T00:00:00Z start a seed 0\n2026-12-03T00:01:00Z end a seed 0 rc 0\n"
                   "2026-12-03T00:01:00Z queue done\n")
    runs = tmp_path / "python"  # a run of model `quick` takes 1 s, any other 6 s, and each fails
    runs.write_text('#!/bin/sh\ncase "$*" in *"--only quick "*) sleep 1 ;; *) sleep 6 ;; esac\nexit 1\n')
    runs.chmod(0o755)
    env = {**os.environ, "WATCH_INTERVAL": "1", "PYTHON": str(runs)}

    def blocks(seconds):  # how many times the watch printed the runs: once if it took the queues for done
        watched = subprocess.run(["bash", str(script), "watch", str(seconds), str(out)], capture_output=True,
                                 text=True, env=env, timeout=60, check=True).stdout
        return sum(line == str(out) for line in watched.splitlines()), watched

    def start(pair):
        subprocess.run(["bash", str(script), "start", "study.yaml", str(out), "1", pair], capture_output=True,
                       env=env, timeout=30, check=True)

    assert blocks(3)[0] == 1
    start("slow:0")
    assert log.read_text().splitlines()[3].endswith(" queued slow:0")
    assert blocks(2)[0] >= 2  # the new queue is still running
    start("quick:0")
    time.sleep(3)  # the quick queue has ended, the slow one has not
    lines = log.read_text().splitlines()
    assert lines[-1].endswith("queue done") and sum(line.endswith("queue done") for line in lines) == 2
    assert blocks(2)[0] >= 2
    count, watched = blocks(30)  # until the slow one is done too
    assert count < 30 and watched.count("failed: ") >= 2
    assert sum(line.endswith("queue done") for line in log.read_text().splitlines()) == 3


def test_detached_watch_returns_soon_after_the_queue_ends_whatever_its_report_interval(tmp_path):
    """The watch checks for the queues' end every WATCH_CHECK seconds and prints the runs every WATCH_INTERVAL and
    once at the end: a queue that ends 2 s in ends a watch whose interval is 600 s within a few seconds, so that the
    pack after it still fits in the command."""
    script = STUDY_SCRIPTS / "detached.sh"
    out = tmp_path / "study"
    runs = tmp_path / "python"  # every run takes 2 s
    runs.write_text("#!/bin/sh\nsleep 2\n")
    runs.chmod(0o755)
    env = {**os.environ, "WATCH_INTERVAL": "600", "WATCH_CHECK": "1", "PYTHON": str(runs)}
    subprocess.run(["bash", str(script), "start", "study.yaml", str(out), "1", "a:0"], capture_output=True,
                   env=env, timeout=30, check=True)
    began = time.monotonic()
    watched = subprocess.run(["bash", str(script), "watch", "120", str(out)], capture_output=True, text=True,
                             env=env, timeout=60, check=True).stdout
    assert time.monotonic() - began < 15
    assert sum(line == str(out) for line in watched.splitlines()) == 2  # at the start and at the end
    assert (tmp_path / "study-logs" / "queue.log").read_text().splitlines()[-1].endswith("queue done")


@pytest.mark.slow
def test_detached_queue_watch_and_pack_carry_runs_off_a_machine(dataset, configs, tmp_path):
    """scripts/study/detached.sh: a queue that outlives its command, a watch that waits for it, and a pack of the
    evaluated runs (no checkpoints) that rebuilds the same tables in another folder."""
    script = STUDY_SCRIPTS / "detached.sh"
    path = write_study(tmp_path, dataset, two_models(configs))
    out = tmp_path / "remote" / "tiny-study"
    env = {**os.environ, "PYTHON": sys.executable, "WATCH_INTERVAL": "1"}
    run = functools.partial(subprocess.run, capture_output=True, text=True, env=env, check=True)
    nothing = subprocess.run(["bash", str(script), "watch", "300", str(out)], capture_output=True, text=True,
                             env=env, timeout=30)  # no queue here: said at once, not watched for 300 s
    assert nothing.returncode == 1 and "no queue for" in nothing.stderr
    empty = subprocess.run(["bash", str(script), "pack", str(tmp_path / "none"), str(out)], capture_output=True,
                           text=True, env=env)
    assert empty.returncode == 1 and "no study folder" in empty.stderr
    started = run(["bash", str(script), "start", str(path), str(out), "2", "gdn:0", "rla:0"])
    assert "queue started" in started.stdout  # returns before the runs finish
    watched = run(["bash", str(script), "watch", "300", str(out)])
    assert (out.parent / "tiny-study-logs" / "queue.log").read_text().count(" rc 0") == 2, watched.stdout
    assert "gdn/seed-0: evaluated" in watched.stdout and "failed" not in watched.stdout
    (run_dir(out, "gdn", 0) / "checkpoints").mkdir(exist_ok=True)  # what a pack leaves behind
    packed = run(["bash", str(script), "pack", str(tmp_path / "packed"), str(out)])
    assert "packed 2 evaluated run(s)" in packed.stdout
    tars = sorted(p.name for p in (tmp_path / "packed").iterdir())
    assert tars == ["tiny-study-gdn-seed-0.tar", "tiny-study-logs.tar", "tiny-study-rla-seed-0.tar"]
    here = tmp_path / "here"
    for name in tars:
        with tarfile.open(tmp_path / "packed" / name) as tar:
            names = tar.getnames()
            assert not any("checkpoints" in n for n in names)
            assert name != "tiny-study-gdn-seed-0.tar" or "tiny-study/runs/gdn/seed-0/items.json" in names
            tar.extractall(here, filter="data")
    assert (here / "tiny-study-logs" / "queue.log").is_file() and (here / "tiny-study" / "study.json").is_file()
    assert list((here / "tiny-study").glob("runs/*/seed-0/model/*.safetensors"))
    light = run(["bash", str(script), "pack", "--no-weights", str(tmp_path / "light"), str(out)])
    assert "packed 2" in light.stdout
    with tarfile.open(tmp_path / "light" / "tiny-study-rla-seed-0.tar") as tar:
        assert not any(n.endswith(".safetensors") for n in tar.getnames())
    assert main(["study", str(path), "--out", str(here / "tiny-study"), "--report-only", "--seeds", "0",
                 "--no-progress"]) == 0
    assert main(["study", str(path), "--out", str(out), "--report-only", "--seeds", "0", "--no-progress"]) == 0
    assert (here / "tiny-study" / "tables" / "results.json").read_text() == \
        (out / "tables" / "results.json").read_text()

    # the analyses that need the weights, where the weights are: a second recall format under the study's own
    # recall settings, the value prior, the probe; one tar per run, each step logged
    analyses = script.parent / "device_analyses.sh"
    env.update(DEVICE="cpu", FORMAT="code/letters/colors", PROBE_OPTIONS="--keys letters --loads 1 --filler 40")
    done = run(["bash", str(analyses), str(tmp_path / "analyses"), str(out), "gdn:0", "rla:2"])
    assert "rla seed 2: not evaluated, skipped" in done.stdout
    assert sorted(p.name for p in (tmp_path / "analyses").iterdir()) == ["tiny-study-gdn-seed-0-analyses.tar"]
    with tarfile.open(tmp_path / "analyses" / "tiny-study-gdn-seed-0-analyses.tar") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    log = (tmp_path / "unpacked" / "steps.log").read_text()
    assert log.count(": rc ") == 3 and log.count(": rc 0") == 3, log  # every step ran, and finished
    recall = json.loads((tmp_path / "unpacked" / "recall-code-letters-colors" / "results.json").read_text())
    # the study records no recall settings, so they are linmem eval's defaults, in the format asked for
    from linmem.eval.runner import EvalOptions

    defaults, used = EvalOptions(), recall["options"]
    assert (used["recall_template"], used["recall_keys"], used["recall_values"]) == ("code", "letters", "colors")
    assert [used[k] for k in ("recall_items", "recall_filler", "batch_size", "split")] == \
        [defaults.recall_items, defaults.recall_filler, 16, "test"]  # the study's batch size, its split
    assert list(used["recall_bindings"]) == list(defaults.recall_bindings)
    prior = json.loads((tmp_path / "unpacked" / "prior.json").read_text())
    assert [key.split()[-1] for key in prior] == ["code/names/colors", "code/letters/colors"]  # test format first
    assert (tmp_path / "unpacked" / "probe" / "results.json").is_file()
    # a probe filler that cannot be read on this machine stops the script before any step, not after the others
    missing = tmp_path / "no-such-text"
    stopped = subprocess.run(["bash", str(analyses), str(tmp_path / "stopped"), str(out), "gdn:0"], capture_output=True,
                             text=True, env={**env, "PROBE_OPTIONS": f"--keys letters --sources {missing}"})
    assert stopped.returncode != 0 and "the probe's filler text cannot be read here" in stopped.stderr
    assert str(missing) in stopped.stderr and not (tmp_path / "stopped").exists()

    # the two formats side by side, read from the tar and the study's own evaluation; this study evaluated no
    # recall, which is said, and then its run gets the recall evaluation a study with recall in its tasks makes
    table = tmp_path / "formats" / "formats.md"
    tabulate = [sys.executable, str(script.parent / "format_table.py"), str(table), "--study", str(out),
                str(tmp_path / "analyses" / "tiny-study-gdn-seed-0-analyses.tar"), "--plot", str(tmp_path / "f.png")]
    no_recall = subprocess.run(tabulate, capture_output=True, text=True, env=env)
    assert no_recall.returncode != 0 and "has no recall task" in no_recall.stderr
    assert main(["eval", str(run_dir(out, "gdn", 0) / "model"), "--tasks", "recall", "--device", "cpu",
                 "--out", str(run_dir(out, "gdn", 0) / "eval"), "--overwrite"]) == 0
    run(tabulate)
    rows = json.loads(table.with_suffix(".json").read_text())
    own = json.loads((run_dir(out, "gdn", 0) / "eval" / "results.json").read_text())["tasks"]["recall"]
    assert [r["measured_by"] for r in rows] == ["study", "analyses"]
    for row, results in zip(rows, (own, recall["tasks"]["recall"])):
        m = results["metrics"]
        assert row["format"] == f"{m['template']}/{m['keys']}/{m['values']}"
        assert row["accuracy"] == [m["accuracy"], m["ci_low"], m["ci_high"]]
        assert row["prior"]["entropy_fraction"] == next(v["entropy_fraction"] for k, v in prior.items()
                                                         if k.endswith(row["format"]))
    assert rows[1]["by_load"] == {str(t["num_bindings"]): [t["accuracy"], t["ci_low"], t["ci_high"]]
                                  for t in recall["tasks"]["recall"]["table"]}
    assert "| gdn | 0 | code/letters/colors |" in table.read_text() and (tmp_path / "f.png").stat().st_size > 0
    misnamed = tmp_path / "other-gdn-seed-0-analyses.tar"
    misnamed.write_bytes((tmp_path / "analyses" / "tiny-study-gdn-seed-0-analyses.tar").read_bytes())
    refused = subprocess.run([sys.executable, str(script.parent / "format_table.py"), str(table), "--study",
                              str(out), str(misnamed)], capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "not named tiny-study-MODEL-seed-S-analyses" in refused.stderr
