"""scripts/study/rate_race.py: a study's learning-rate race read from its tables."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest

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
        ("GDN 12 x 512", {1.25e-3: "gdn-half-lr", 2.5e-3: "gdn-shared-lr", 5e-3: "gdn-double-lr"}),
        ("RDN 12 x 512", {1.25e-3: "rdn-half-lr", 2.5e-3: "rdn-shared-lr", 5e-3: "rdn-double-lr"})]
    assert [rate_race.rate_text(r) for r in (1.25e-3, 2.5e-3, 5e-3, 3e-4)] == ["1.25e-3", "2.5e-3", "5e-3", "3e-4"]


def test_the_winner_is_the_deciding_seeds_best_and_moves_with_the_numbers(tmp_path):
    tables = json.loads(TABLES.read_text())
    printed = race(str(STUDY), str(TABLES))
    seeds = {name: m["metrics"]["val_loss"]["seeds"] for name, m in tables["models"].items()}
    assert rows(printed)["RDN 12 x 512"] == [
        "**" + " / ".join(f"{seeds['rdn-half-lr'][s]['mean']:.3f}" for s in "012") + "**",
        " / ".join(f"{seeds['rdn-shared-lr'][s]['mean']:.3f}" for s in "012"),
        f"{seeds['rdn-double-lr']['0']['mean']:.3f}"]
    # the doubled rate's seed 0 made best: the bold moves there, whatever the other seeds say
    edited = copy.deepcopy(tables)
    edited["models"]["gdn-double-lr"]["metrics"]["val_loss"]["seeds"]["0"]["mean"] = 1.0
    edited["models"]["gdn-shared-lr"]["metrics"]["val_loss"]["seeds"]["1"]["mean"] = 0.5  # not the deciding seed
    path = tmp_path / "results.json"
    path.write_text(json.dumps(edited))
    gdn = rows(race(str(STUDY), str(path)))["GDN 12 x 512"]
    assert gdn[2] == "**1.000**" and not gdn[1].startswith("**")
    # a metric where higher is better is won by the highest value
    printed = race(str(STUDY), str(TABLES), "--metric", "mqar")
    mqar = {name: m["metrics"]["mqar"]["seeds"]["0"]["mean"] for name, m in tables["models"].items()}
    best = max(("half", "shared", "double"), key=lambda r: mqar[f"rdn-{r}-lr"])
    assert rows(printed)["RDN 12 x 512"][["half", "shared", "double"].index(best)].startswith("**")
    # a rate whose deciding run is missing: no winner yet
    del edited["models"]["rdn-double-lr"]["metrics"]["val_loss"]["seeds"]["0"]
    path.write_text(json.dumps(edited))
    assert not any("**" in c for c in rows(race(str(STUDY), str(path)))["RDN 12 x 512"])


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
    assert printed.strip() in results
    assert figure.stat().st_size > 10_000
