"""scripts/study/rate_race.py: a study's learning-rate race read from its tables, and what it needs next."""

from __future__ import annotations

import copy
import json
import math
import random
import shlex
from pathlib import Path

import pytest
import yaml

from tests.script_modules import load_script, printed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "study" / "rate_race.py"
STUDY = ROOT / "configs" / "study" / "remember-dictionary-lr.yaml"
TABLES = ROOT / "docs" / "study" / "remember-dictionary-lr" / "results.json"

rate_race = load_script(SCRIPT, "rate_race")


def race(*args: str) -> str:
    """What the script prints."""
    return printed(rate_race.main, *args)


def refused(*args: str) -> str:
    with pytest.raises(SystemExit) as stop:
        race(*args)
    return str(stop.value)


def rows(text: str) -> dict[str, list[str]]:
    """The first table's rows: label -> cells."""
    out = {}
    for line in text.split("\n\n")[1].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = cells[1:]
    return out


def test_models_that_differ_only_in_the_rate_form_one_group_per_mixer():
    from linmem.study.definition import load_study

    groups = rate_race.rate_groups(load_study(STUDY), 0)
    assert [(g.label, g.models) for g in groups] == [
        ("gdn (GDN 12 x 512)", {1.25e-3: "gdn-half-lr", 2.5e-3: "gdn-shared-lr", 5e-3: "gdn-double-lr"}),
        ("rdn (RDN 12 x 512)", {1.25e-3: "rdn-half-lr", 2.5e-3: "rdn-shared-lr", 5e-3: "rdn-double-lr"})]
    assert [rate_race.rate_text(r) for r in (1.25e-3, 2.5e-3, 5e-3, 3e-4)] == ["1.25e-3", "2.5e-3", "5e-3", "3e-4"]


def test_the_winner_is_the_deciding_seeds_best_and_moves_with_the_numbers(tmp_path):
    tables = json.loads(TABLES.read_text())
    printed = race(str(STUDY), str(TABLES))
    seeds = {name: m["metrics"]["val_loss"]["seeds"] for name, m in tables["models"].items()}
    assert rows(printed)["rdn (RDN 12 x 512)"] == [
        "**" + " / ".join(f"{seeds['rdn-half-lr'][s]['mean']:.3f}" for s in "012") + "**",
        " / ".join(f"{seeds['rdn-shared-lr'][s]['mean']:.3f}" for s in "012"),
        f"{seeds['rdn-double-lr']['0']['mean']:.3f}"]
    # the doubled rate's seed 0 made best: the bold moves there, whatever the other seeds say
    edited = copy.deepcopy(tables)
    edited["models"]["gdn-double-lr"]["metrics"]["val_loss"]["seeds"]["0"]["mean"] = 1.0
    edited["models"]["gdn-shared-lr"]["metrics"]["val_loss"]["seeds"]["1"]["mean"] = 0.5  # not the deciding seed
    path = tmp_path / "results.json"
    path.write_text(json.dumps(edited))
    gdn = rows(race(str(STUDY), str(path)))["gdn (GDN 12 x 512)"]
    assert gdn[2] == "**1.000**" and not gdn[1].startswith("**")
    # a metric where higher is better is won by the highest value
    printed = race(str(STUDY), str(TABLES), "--metric", "mqar")
    mqar = {name: m["metrics"]["mqar"]["seeds"]["0"]["mean"] for name, m in tables["models"].items()}
    best = max(("half", "shared", "double"), key=lambda r: mqar[f"rdn-{r}-lr"])
    assert rows(printed)["rdn (RDN 12 x 512)"][["half", "shared", "double"].index(best)].startswith("**")
    # a rate whose deciding run is missing: no winner yet
    del edited["models"]["rdn-double-lr"]["metrics"]["val_loss"]["seeds"]["0"]
    path.write_text(json.dumps(edited))
    assert not any("**" in c for c in rows(race(str(STUDY), str(path)))["rdn (RDN 12 x 512)"])


def test_bad_input_is_refused_with_a_reason(tmp_path):
    other = json.loads(TABLES.read_text())
    other["study"] = "remember-dictionary"
    path = tmp_path / "results.json"
    path.write_text(json.dumps(other))
    assert "not 'remember-dictionary-lr'" in refused(str(STUDY), str(path))
    assert "no metric 'no_such_metric'" in refused(str(STUDY), str(TABLES), "--metric", "no_such_metric")
    from linmem.study.definition import load_study

    assert rate_race.rate_groups(load_study(ROOT / "configs" / "study" / "remember.yaml"), 0) == []  # one per mixer


def test_the_documented_tables_and_figure_are_what_the_tables_give(tmp_path):
    results = (ROOT / "docs" / "results.md").read_text()
    start = results.index("python scripts/study/rate_race.py configs/study/remember-dictionary-lr.yaml")
    words = shlex.split(results[start:results.index("```", start)].replace("\\\n", " "))[2:]
    figure = tmp_path / "race.png"
    plot = words.index("--plot")
    words[plot + 1] = str(figure)
    printed = race(*[str(ROOT / w) if w.endswith((".yaml", ".json")) else w for w in words])
    assert printed.strip() in results, "docs/results.md's race is not what the script prints: paste its output there"
    assert figure.stat().st_size > 10_000


# ---------------------------------------------------------------- what the race needs next

BRACKET = rate_race.Group("made-up", {2.5e-3: "half", 5e-3: "zoo", 1e-2: "double"})
SEEDS = [100, 101, 102]


def made_up(runs: dict[str, dict[int, float]], metric: str = "val_loss", higher: bool = False) -> dict:
    """Tables of made-up runs (model -> seed -> the metric's value), shaped as a study's ``results.json``."""
    models = {name: {"metrics": {metric: {"seeds": {str(s): {"mean": v} for s, v in seeds.items()}}}}
              for name, seeds in runs.items()}
    return {"study": "made-up", "metrics": {metric: {"label": metric, "higher_is_better": higher}}, "models": models}


def needs(runs: dict[str, dict[int, float]], seed: int = 100, close: float = 0.1, **metric) -> str:
    name = metric.get("metric", "val_loss")
    return rate_race.verdict(made_up(runs, **metric), BRACKET, name, seed, SEEDS, close)


def test_an_inner_winner_is_decided_and_an_edge_winner_gets_the_next_rate_out():
    runs = {"half": {100: 3.50}, "zoo": {100: 3.30}, "double": {100: 3.45}}
    assert needs(runs) == "decided: 5e-3"
    assert needs(runs, close=0.2) == "close: 5e-3 and 1e-2 within 0.15 (< 0.2) on seed 100: run seed 101 at both"
    runs["double"][100] = 3.10
    assert needs(runs) == "edge: wins at 1e-2, the top of its bracket: add 2e-2"
    runs["zoo"][100] = 2.90  # the inner rate improves past it
    assert needs(runs) == "decided: 5e-3"
    runs["half"][100] = 2.70
    assert needs(runs) == "edge: wins at 2.5e-3, the bottom of its bracket: add 1.25e-3"
    # the next rate out in the group: the old edge is inside its bracket
    wider = rate_race.Group("made-up", {**BRACKET.models, 1.25e-3: "quarter"})
    runs["quarter"] = {100: 3.20}
    assert rate_race.verdict(made_up(runs), wider, "val_loss", 100, SEEDS, 0.1) == "decided: 2.5e-3"


def test_a_close_pair_waits_for_a_spare_seed_whose_mean_decides():
    runs = {"half": {100: 3.50}, "zoo": {100: 3.30}, "double": {100: 3.35}}
    waiting = "close: 5e-3 and 1e-2 within 0.05 (< 0.1) on seed 100: run seed 101 at both"
    assert needs(runs) == waiting
    assert rate_race.need(made_up(runs), BRACKET, "val_loss", 100, SEEDS, 0.1).runs == ["zoo:101", "double:101"]
    runs["zoo"][101] = 3.40  # one of the two rates alone does not decide
    runs["half"][101] = 3.30
    assert needs(runs) == waiting
    assert rate_race.need(made_up(runs), BRACKET, "val_loss", 100, SEEDS, 0.1).runs == ["double:101"]
    runs["double"][101] = 3.38  # mean over seeds 100 and 101: 5e-3 3.350, 1e-2 3.365
    assert needs(runs) == "decided (seeds 100, 101): 5e-3"
    runs["double"][101] = 3.30  # 1e-2 3.325: the spare turns the race to the edge
    assert needs(runs) == "edge: wins at 1e-2, the top of its bracket: add 2e-2"
    runs["zoo"][102], runs["double"][102] = 3.20, 3.60  # a second spare counts too: 5e-3 3.300, 1e-2 3.417
    assert needs(runs) == "decided (seeds 100, 101, 102): 5e-3"
    # a later deciding seed takes the seeds after it as spares; the last one has none
    for seed, step in ((101, "run seed 102 at both"), (102, "the study has no spare seed left")):
        later = {"half": {seed: 3.50}, "zoo": {seed: 3.30}, "double": {seed: 3.35}}
        assert needs(later, seed=seed).endswith(f"on seed {seed}: {step}")
    assert rate_race.spare_seeds(SEEDS, 100) == [101, 102] and rate_race.spare_seeds(SEEDS, 7) == SEEDS


def test_every_rate_within_close_of_the_best_contends_not_only_the_runner_up():
    """Two rates a hair apart on the deciding seed both wait for the spare; which of them ranks second is noise."""
    wider = rate_race.Group("made-up", {**BRACKET.models, 2e-2: "quad"})
    runs = {"half": {100: 3.52}, "zoo": {100: 3.40}, "double": {100: 3.46567}, "quad": {100: 3.46562}}

    def state():
        return rate_race.need(made_up(runs), wider, "val_loss", 100, SEEDS, 0.1)

    assert state().text == ("close: 5e-3, 2e-2 and 1e-2 within 0.0657 (< 0.1) on seed 100: run seed 101 at each")
    assert state().runs == ["zoo:101", "quad:101", "double:101"]
    runs["zoo"][101], runs["quad"][101] = 3.51, 3.48  # the spare at two of the three does not decide yet
    assert state().runs == ["double:101"] and state().rate is None
    runs["double"][101] = 3.36  # means over seeds 100 and 101: 5e-3 3.455, 1e-2 3.413, 2e-2 3.473
    assert state().text == "decided (seeds 100, 101): 1e-2" and state().rate == 1e-2
    runs["half"][100] = 3.49  # 2.5e-3 contends too, without its spare: the race waits for it
    assert state().text.startswith("close: 5e-3, 2e-2, 1e-2 and 2.5e-3 within 0.09 (< 0.1)")
    assert state().runs == ["half:101"]


def test_a_missing_run_of_the_deciding_seed_leaves_the_race_incomplete():
    runs = {"half": {100: 3.50, 101: 3.40}, "zoo": {101: 3.30}, "double": {101: 3.45}}
    assert needs(runs) == "incomplete: no run of seed 100 at 5e-3, 1e-2"
    runs["zoo"][100] = 3.30
    assert needs(runs) == "incomplete: no run of seed 100 at 1e-2"
    runs["double"][100] = math.nan  # a diverged run ranks last
    assert needs(runs) == "decided: 5e-3"


def test_a_metric_where_higher_is_better_is_won_by_the_highest_value():
    mqar = {"metric": "mqar", "higher": True}
    runs = {"half": {100: 0.60}, "zoo": {100: 0.80}, "double": {100: 0.50}}
    assert needs(runs, **mqar) == "decided: 5e-3"
    runs["half"][100] = 0.75
    assert needs(runs, **mqar) == "close: 5e-3 and 2.5e-3 within 0.05 (< 0.1) on seed 100: run seed 101 at both"
    runs["zoo"][101], runs["half"][101] = 0.90, 0.70  # means 0.85 and 0.725
    assert needs(runs, **mqar) == "decided (seeds 100, 101): 5e-3"
    runs["zoo"][101], runs["half"][101] = 0.70, 0.90  # means 0.75 and 0.825
    assert needs(runs, **mqar) == "edge: wins at 2.5e-3, the bottom of its bracket: add 1.25e-3"


@pytest.fixture(scope="module")
def small_study(tmp_path_factory) -> Path:
    """Four families: GDN at three rates, GDN with wide values (one mixer and shape), an RDN ablation, and RDN under
    names that share no word, at two rates each."""
    zoo = ROOT / "configs" / "zoo"
    half, double = {"optim.lr": 2.5e-3, "optim.min_lr": 2.5e-4}, {"optim.lr": 1e-2, "optim.min_lr": 1e-3}
    models = [{"name": "gdn-half-lr", "config": str(zoo / "gdn.yaml"), "set": half},
              {"name": "gdn-zoo-lr", "config": str(zoo / "gdn.yaml")},
              {"name": "gdn-double-lr", "config": str(zoo / "gdn.yaml"), "set": double},
              {"name": "gdn-wide-half-lr", "config": str(zoo / "gdn.yaml"), "set": {**half, "model.expand_v": 2.0}},
              {"name": "gdn-wide-zoo-lr", "config": str(zoo / "gdn.yaml"), "set": {"model.expand_v": 2.0}},
              {"name": "rdn-tied-gamma-half-lr", "config": str(zoo / "rdn-tied-gamma.yaml"), "set": half},
              {"name": "rdn-tied-gamma-zoo-lr", "config": str(zoo / "rdn-tied-gamma.yaml")},
              {"name": "slow", "config": str(zoo / "rdn.yaml"), "set": half},
              {"name": "zoo", "config": str(zoo / "rdn.yaml")}]
    study = {"name": "made-up", "seeds": SEEDS, "recipe": {"include": str(zoo / "base.yaml")},
             "per_model": ["optim.lr", "optim.min_lr"], "eval": {"tasks": ["ppl"]}, "models": models}
    path = tmp_path_factory.mktemp("study") / "made-up.yaml"
    path.write_text(yaml.safe_dump(study), encoding="utf-8")
    return path


def test_groups_are_labelled_by_their_models_common_name(small_study):
    from linmem.study.definition import load_study

    groups = rate_race.rate_groups(load_study(small_study), 100)
    assert [g.label for g in groups] == ["gdn (GDN 6 x 256)", "gdn-wide (GDN 6 x 256)",
                                         "rdn-tied-gamma (RDN 6 x 256)", "RDN 6 x 256"]
    assert [rate_race.name_stem(names) for names in (["rdn-no-fitting-lr", "rdn-no-clip-lr"], ["gdn-half", "gdn-high"],
                                                     ["gdn", "gdn-double"], ["slow", "zoo"])] == [
        "rdn-no", "gdn", "gdn", ""]


def test_the_script_prints_each_groups_next_step_under_the_studys_seeds(small_study, tmp_path):
    runs = {"gdn-half-lr": {100: 3.50}, "gdn-zoo-lr": {100: 3.45}, "gdn-double-lr": {100: 3.60},
            "gdn-wide-half-lr": {100: 3.40},
            "gdn-wide-zoo-lr": {100: 3.60}, "rdn-tied-gamma-zoo-lr": {100: 3.40}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(made_up(runs)))
    printed = race(str(small_study), str(path), "--decide-seed", "100")
    assert printed.split("\n\n")[-4:-2] == [
        "What the race needs next (val_loss on seed 100 decides; a winner at an edge of its bracket gets the next rate "
        "out first; where other rates lie less than 0.1 from the best, spare seeds 101, 102 decide among them)",
        "- gdn (GDN 6 x 256): close: 5e-3 and 2.5e-3 within 0.05 (< 0.1) on seed 100: run seed 101 at both\n"
        "- gdn-wide (GDN 6 x 256): edge: wins at 2.5e-3, the bottom of its bracket: add 1.25e-3\n"
        "- rdn-tied-gamma (RDN 6 x 256): incomplete: no run of seed 100 at 2.5e-3\n"
        "- RDN 6 x 256: incomplete: no run of seed 100 at 2.5e-3, 5e-3"]
    # the runs each step names, ready for a queue, and the rate the edge needs a model at first
    assert printed.split("\n\n")[-2:] == [
        "Runs to queue (MODEL:SEED, models the study file declares): gdn-zoo-lr:101 gdn-half-lr:101 "
        "rdn-tied-gamma-half-lr:100 slow:100 zoo:100",
        "Models to add to the study file first (the next rate out): gdn-wide at 1.25e-3\n"]
    printed = race(str(small_study), str(path), "--decide-seed", "100", "--close", "0.01")
    assert "less than 0.01 from the best" in printed and "- gdn (GDN 6 x 256): decided: 5e-3\n" in printed


def test_a_family_without_a_common_name_is_named_by_its_first_model_when_it_needs_a_rate(small_study, tmp_path):
    """The RDN family named "slow" and "zoo" shares no word: the line of models to add names it by its first model,
    not by its mixer and shape (which another family of the same shape could share)."""
    slow = 3.3 + 0.1 * random.random()  # "slow" (the lower rate) wins by more than the race's 0.1
    path = tmp_path / "results.json"
    path.write_text(json.dumps(made_up({"slow": {100: slow}, "zoo": {100: slow + 0.2 + 0.1 * random.random()}})))
    printed = race(str(small_study), str(path), "--decide-seed", "100")
    assert "- RDN 6 x 256: edge: wins at 2.5e-3, the bottom of its bracket: add 1.25e-3" in printed
    assert printed.rstrip().endswith("Models to add to the study file first (the next rate out): slow at 1.25e-3")


# ---------------------------------------------------------------- the run study's models at the decided rates


@pytest.fixture(scope="module")
def race_and_runs(tmp_path_factory) -> tuple[Path, Path]:
    """A race study (GDN at 1.25e-3 to 5e-3, GDN with wide values and RDN at 2.5e-3 to 1e-2) and the study that runs
    each family at its rate: gdn, gdn-wide (its value width in ``set``), rdn, and sgla, which no race covers."""
    zoo = ROOT / "configs" / "zoo"
    rates = {"quarter": 1.25e-3, "half": 2.5e-3, "zoo": None, "double": 1e-2}
    folder = tmp_path_factory.mktemp("studies")

    def at(rate: str, **rest) -> dict:
        return {**({"optim.lr": rates[rate], "optim.min_lr": rates[rate] / 10} if rates[rate] else {}), **rest}

    race_models = (
        [{"name": f"gdn-{r}-lr", "config": str(zoo / "gdn.yaml"), "set": at(r)} for r in ("quarter", "half", "zoo")]
        + [{"name": f"gdn-wide-{r}-lr", "config": str(zoo / "gdn.yaml"), "set": at(r, **{"model.expand_v": 2.0})}
           for r in ("half", "zoo", "double")]
        + [{"name": f"rdn-{r}-lr", "config": str(zoo / "rdn.yaml"), "set": at(r)} for r in ("half", "zoo", "double")])
    run_models = [{"name": "gdn", "config": "zoo/gdn.yaml"},
                  {"name": "gdn-wide", "config": "zoo/gdn.yaml", "set": {"model.expand_v": 2.0}},
                  {"name": "rdn", "config": "zoo/rdn.yaml"},
                  {"name": "sgla", "config": "zoo/sgla.yaml"}]
    (folder / "zoo").symlink_to(zoo)  # the run study names its configs relative to itself, as the real one does
    paths = []
    for name, models, seeds in (("race", race_models, SEEDS), ("runs", run_models, [0, 1, 2])):
        study = {"name": name, "seeds": seeds, "recipe": {"include": str(zoo / "base.yaml")},
                 "per_model": ["optim.lr", "optim.min_lr"], "eval": {"tasks": ["ppl"]}, "models": models}
        paths.append(folder / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(study, sort_keys=False), encoding="utf-8")
    return paths[0], paths[1]


def test_the_run_study_gets_its_models_lines_at_the_decided_rates(race_and_runs, tmp_path):
    race_path, runs_path = race_and_runs
    runs = {"gdn-quarter-lr": {100: 3.60}, "gdn-half-lr": {100: 3.30}, "gdn-zoo-lr": {100: 3.50},  # decided: 2.5e-3
            "gdn-wide-half-lr": {100: 3.60}, "gdn-wide-zoo-lr": {100: 3.30}, "gdn-wide-double-lr": {100: 3.50},
            "rdn-half-lr": {100: 3.40}, "rdn-zoo-lr": {100: 3.45}, "rdn-double-lr": {100: 3.70}}  # rdn: bottom edge
    tables = made_up(runs)
    tables["study"] = "race"
    path = tmp_path / "results.json"
    path.write_text(json.dumps(tables))
    printed = race(str(race_path), str(path), "--decide-seed", "100", "--core-seeds", str(runs_path))
    block = printed[printed.index("runs models at the decided rates"):]
    lines = block.split("```yaml\n")[1].split("```")[0].splitlines()
    assert len(lines) == 4
    # a decided family: its entry with lr the winner, min_lr a tenth of it, its own set keys and config path kept,
    # the rates written as the study files write them (a point in the mantissa: PyYAML reads 2.5e-3 as a float)
    assert lines[0] == "  - {name: gdn, config: zoo/gdn.yaml, set: {optim.lr: 2.5e-3, optim.min_lr: 2.5e-4}}"
    assert yaml.safe_load(lines[0]) == [{"name": "gdn", "config": "zoo/gdn.yaml",
                                         "set": {"optim.lr": 2.5e-3, "optim.min_lr": 2.5e-4}}]
    wide, note = lines[1].split("   # ")
    assert yaml.safe_load(wide) == [{"name": "gdn-wide", "config": "zoo/gdn.yaml",
                                     "set": {"optim.lr": 5e-3, "optim.min_lr": 5e-4, "model.expand_v": 2.0}}]
    assert "optim.lr: 5.0e-3, optim.min_lr: 5.0e-4" in wide
    assert "# " + note == rate_race.ZOO_RATE_NOTE  # the winner is gdn.yaml's own rate; gdn's 2.5e-3 is not
    # an undecided family: a comment with its race's state; a model no race covers says so
    assert lines[2] == "# rdn: not decided (edge: wins at 2.5e-3, the bottom of its bracket: add 1.25e-3)"
    assert lines[3] == "# sgla: no race in the study file"
    assert block.rstrip("\n").splitlines()[-1] == "2 of 4 runs models decided"
    # the race moves: gdn-wide's top rate wins on the spare seed's mean (an edge again), rdn's zoo rate wins clear
    runs["gdn-wide-zoo-lr"][100], runs["gdn-wide-double-lr"][100] = 3.30, 3.35
    runs["gdn-wide-zoo-lr"][101], runs["gdn-wide-double-lr"][101] = 3.40, 3.20
    runs["rdn-half-lr"][100], runs["rdn-zoo-lr"][100] = 3.60, 3.45
    tables = made_up(runs)
    tables["study"] = "race"
    path.write_text(json.dumps(tables))
    printed = race(str(race_path), str(path), "--decide-seed", "100", "--core-seeds", str(runs_path))
    lines = printed.split("```yaml\n")[1].split("```")[0].splitlines()
    assert lines[1] == "# gdn-wide: not decided (edge: wins at 1e-2, the top of its bracket: add 2e-2)"
    assert lines[2] == ("  - {name: rdn, config: zoo/rdn.yaml, set: {optim.lr: 5.0e-3, optim.min_lr: 5.0e-4}}   "
                        + rate_race.ZOO_RATE_NOTE)
    assert printed.rstrip("\n").splitlines()[-1] == "2 of 4 runs models decided"
    # without --core-seeds the output ends with the race's next steps
    assert "decided rates" not in race(str(race_path), str(path), "--decide-seed", "100")


def test_rates_are_written_with_a_point_in_the_mantissa():
    rates = (3e-3, 1.2e-2, 2.5e-4, 1e-2, 1.25e-3, 0.1, 2.4e-2 / 10)
    assert [rate_race.rate_yaml(r) for r in rates] == [
        "3.0e-3", "1.2e-2", "2.5e-4", "1.0e-2", "1.25e-3", "1.0e-1", "2.4e-3"]
    assert all(yaml.safe_load(rate_race.rate_yaml(r)) == pytest.approx(r, rel=1e-12) for r in rates)


def test_tables_of_separate_machines_are_read_as_one_and_write_sets_only_bare_lines(race_and_runs, tmp_path):
    """Two tables (a shipped one and a machine's new runs) decide as their union would, a later file's value at a
    seed replacing an earlier one's; ``--write`` puts each decided rate into the run study's line that sets none,
    keeps its comment, leaves a line that sets a rate alone and says which lines it changed."""
    race_path, _ = race_and_runs
    zoo = ROOT / "configs" / "zoo"
    runs_path = tmp_path / "runs.yaml"
    runs_path.write_text(
        "name: runs\nseeds: [0, 1, 2]\n"
        f"recipe: {{include: {zoo / 'base.yaml'}}}\n"
        "per_model: [optim.lr, optim.min_lr]\neval: {tasks: [ppl]}\nmodels:\n"
        f"  - {{name: gdn, config: {zoo / 'gdn.yaml'}}}   # the first family\n"
        f"  - {{name: gdn-wide, config: {zoo / 'gdn.yaml'}, set: {{optim.lr: 1.0e-2, optim.min_lr: 1.0e-3,"
        " model.expand_v: 2.0}}\n"
        f"  - {{name: rdn, config: {zoo / 'rdn.yaml'}}}\n", encoding="utf-8")
    shipped = {"gdn-quarter-lr": {100: 3.60}, "gdn-half-lr": {100: 3.30},
               "gdn-wide-half-lr": {100: 3.60}, "gdn-wide-zoo-lr": {100: 3.30}, "gdn-wide-double-lr": {100: 3.50},
               "rdn-half-lr": {100: 3.60}, "rdn-zoo-lr": {100: 3.65}, "rdn-double-lr": {100: 3.70}}
    new = {"gdn-zoo-lr": {100: 3.50}, "rdn-zoo-lr": {100: 3.35}}  # gdn's missing run, and a replaced value
    paths = []
    for name, runs in (("shipped", shipped), ("new", new)):
        tables = made_up(runs)
        tables["study"] = "race"
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(tables))
    alone = race(str(race_path), str(paths[0]), "--decide-seed", "100")
    assert "incomplete: no run of seed 100 at 5e-3" in alone  # gdn's zoo rate lacks its run in the shipped table
    assert "edge: wins at 2.5e-3, the bottom of its bracket" in alone  # rdn, before its zoo rate's new value
    before = runs_path.read_text(encoding="utf-8")
    printed_text = race(str(race_path), str(paths[0]), str(paths[1]), "--decide-seed", "100",
                        "--core-seeds", str(runs_path), "--write")
    assert printed_text.rstrip("\n").splitlines()[-1] == "written: gdn rdn"
    after = runs_path.read_text(encoding="utf-8").splitlines()
    assert after[-3] == (f"  - {{name: gdn, config: {zoo / 'gdn.yaml'}, set: {{optim.lr: 2.5e-3, "
                         "optim.min_lr: 2.5e-4}}   # the first family")
    assert after[-2] == before.splitlines()[-2]  # gdn-wide sets a rate already: never rewritten
    assert after[-1] == (f"  - {{name: rdn, config: {zoo / 'rdn.yaml'}, set: {{optim.lr: 5.0e-3, "
                         f"optim.min_lr: 5.0e-4}}}}   {rate_race.ZOO_RATE_NOTE}")  # 3.35 replaced 3.65
    study = rate_race.load_study(runs_path)
    assert study.model("gdn").overrides["optim.lr"] == pytest.approx(2.5e-3)
    assert study.model("rdn").overrides["optim.min_lr"] == pytest.approx(5e-4)
    # nothing newly decided: the file stays as it is
    again = race(str(race_path), str(paths[0]), str(paths[1]), "--decide-seed", "100",
                 "--core-seeds", str(runs_path), "--write")
    assert again.rstrip("\n").splitlines()[-1] == "written: "
    assert runs_path.read_text(encoding="utf-8").splitlines() == after
    assert "--write needs --core-seeds" in refused(str(race_path), str(paths[0]), "--write")
    other = made_up(new)
    other["study"] = "another"
    paths[1].write_text(json.dumps(other))
    assert "not 'race'" in refused(str(race_path), str(paths[0]), str(paths[1]))
