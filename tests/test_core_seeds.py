"""The core-seeds studies (configs/study/core-seeds*.yaml): the 8-seed comparison trains and evaluates as rla-paper
does, so that rla-paper's seeds of a model count there at that model's zoo rate; the rate bracket holds each of its
models at half, the same and double the zoo rate under the same recipe, on seeds the comparison does not use."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from linmem.study.definition import load_study, resolve_model
from linmem.study.runs import ITEMS, run_dir
from tests.script_modules import load_script, printed

STUDIES = Path(__file__).resolve().parents[1] / "configs" / "study"
BRACKET = {"half-lr": 0.5, "zoo-lr": 1.0, "double-lr": 2.0}
NEXT_OUT = {"quad-lr": 4.0, "oct-lr": 8.0, "quarter-lr": 0.25, "eighth-lr": 0.125}  # the next rates out, added for
# a model that won at an edge of its bracket (and again at the rate added)


@pytest.fixture(scope="module")
def studies():
    return {name: load_study(STUDIES / f"{name}.yaml") for name in ("core-seeds", "core-seeds-lr", "rla-paper")}


def test_core_seeds_trains_and_evaluates_as_rla_paper(studies):
    core, paper = studies["core-seeds"], studies["rla-paper"]
    assert len(core.seeds) >= 8
    assert core.recipe_config.to_dict() == paper.recipe_config.to_dict()
    assert core.eval_record() == paper.eval_record()
    shared = [m for m in core.model_names if m in paper.model_names]
    assert len(shared) == 12
    for name in shared:
        assert resolve_model(core, core.model(name), 0).model == resolve_model(paper, paper.model(name), 0).model


def test_core_seeds_lr_brackets_each_model_around_its_zoo_rate(studies):
    core, race = studies["core-seeds"], studies["core-seeds-lr"]
    assert race.recipe_config.to_dict() == core.recipe_config.to_dict()
    assert not set(race.seeds) & set(core.seeds)
    for model in core.models:
        chosen = resolve_model(core, model, 0)
        rates = {}
        for suffix, factor in BRACKET.items():
            config = resolve_model(race, race.model(f"{model.name}-{suffix}"), race.seeds[0])
            assert config.model == chosen.model
            assert config.optim.min_lr == pytest.approx(config.optim.lr / 10)
            rates[factor] = config.optim.lr
        assert rates[0.5] == pytest.approx(rates[1.0] / 2) and rates[2.0] == pytest.approx(rates[1.0] * 2)
        for suffix, factor in NEXT_OUT.items():
            name = f"{model.name}-{suffix}"
            if name in race.model_names:
                config = resolve_model(race, race.model(name), race.seeds[0])
                assert config.model == chosen.model
                assert config.optim.lr == pytest.approx(rates[1.0] * factor)
                assert config.optim.min_lr == pytest.approx(config.optim.lr / 10)
                rates[factor] = config.optim.lr
        assert any(chosen.optim.lr == pytest.approx(rate) for rate in rates.values())  # a rate the race ran
        assert chosen.optim.min_lr == pytest.approx(chosen.optim.lr / 10)
    suffixes = [*BRACKET, *NEXT_OUT]
    assert all(any(m.name == f"{c.name}-{s}" for c in core.models for s in suffixes) for m in race.models)
    assert len(race.models) >= len(BRACKET) * len(core.models)


def test_gdn_wide_holds_as_many_state_numbers_as_rdn(studies):
    core = studies["core-seeds"]

    def state_numbers(name: str) -> float:
        model = resolve_model(core, core.model(name), 0).model
        memories = 2 if model["mixer"] in ("rdn", "rla") else 1  # the base state S and the residual state R
        return memories * model["num_heads"] * model["head_dim"] ** 2 * model["expand_v"]

    assert state_numbers("gdn-wide") == state_numbers("rdn") == 2 * state_numbers("gdn")


def test_core_seeds_declares_rla_papers_claims_and_the_equal_state_control(studies):
    """The comparison's claims are declared before its runs: every claim rla-paper decides from, and RDN against
    the GDN that holds as many state numbers on the same metrics as RDN against GDN."""
    core, paper = studies["core-seeds"], studies["rla-paper"]

    def claimed(study):
        return {(c.a, c.b, metric) for c in study.claims for metric in c.metrics}

    assert claimed(paper) <= claimed(core)
    rdn_vs_gdn = {metric for c in paper.claims if (c.a, c.b) == ("rdn", "gdn") for metric in c.metrics}
    assert claimed(core) - claimed(paper) == {("rdn", "gdn-wide", metric) for metric in rdn_vs_gdn}


core_seeds_queue = load_script(STUDIES.parents[1] / "scripts" / "study" / "core_seeds_queue.py", "core_seeds_queue")


@pytest.mark.parametrize("size", [12, 7, 3])
def test_queues_hold_every_pending_run_once_with_each_pair_together(studies, tmp_path, size):
    """core_seeds_queue.py: every unfinished run of a model whose rate the file sets lands in exactly one queue of at
    most ``size`` runs; models without a rate wait; the two arms of a comparison at one seed share a queue wherever
    their comparison group fits in one."""
    core = studies["core-seeds"]
    ready, waiting = core_seeds_queue.ready_models(core)
    assert ready and set(ready).isdisjoint(waiting) and set(ready) | set(waiting) == set(core.model_names)
    assert all("optim.lr" in core.model(name).overrides for name in ready)
    rng = random.Random(size)
    finished = {(name, seed) for name in core.model_names for seed in core.seeds if rng.random() < 0.3}
    for name, seed in finished:
        folder = run_dir(tmp_path, name, seed)
        folder.mkdir(parents=True)
        (folder / ITEMS).write_text("{}", encoding="utf-8")
    planned = core_seeds_queue.queues(core, tmp_path, size)
    runs = [run for queue in planned for run in queue]
    assert all(0 < len(queue) <= size for queue in planned)
    assert len(runs) == len(set(runs))
    assert set(runs) == {(name, seed) for name in ready for seed in core.seeds} - finished
    where = {run: i for i, queue in enumerate(planned) for run in queue}
    largest = max(len(group) for group in core_seeds_queue.comparison_groups(core, ready))
    together = [(a, b, seed) for a, b in core.compare for seed in core.seeds
                if (a, seed) in where and (b, seed) in where]
    assert together
    if largest <= size:
        assert all(where[a, seed] == where[b, seed] for a, b, seed in together)
    printed_text = printed(core_seeds_queue.main, str(core.path), str(tmp_path), "--size", str(size))
    assert printed_text.splitlines()[1:1 + len(planned)] == [" ".join(f"{n}:{s}" for n, s in q) for q in planned]


def test_queues_of_named_models_hold_only_their_pending_runs(studies, tmp_path):
    """``--models``: a machine that holds none of the study's earlier runs queues only the models it names (those
    whose rate it has just set), earliest seeds first; a name the study lacks is refused."""
    core = studies["core-seeds"]
    ready, _ = core_seeds_queue.ready_models(core)
    named = ready[-2:]
    folder = run_dir(tmp_path, named[0], core.seeds[0])
    folder.mkdir(parents=True)
    (folder / ITEMS).write_text("{}", encoding="utf-8")
    planned = core_seeds_queue.queues(core, tmp_path, 5, named)
    runs = [run for queue in planned for run in queue]
    assert set(runs) == {(name, seed) for name in named for seed in core.seeds} - {(named[0], core.seeds[0])}
    assert [seed for _, seed in runs] == sorted(seed for _, seed in runs)
    assert all(len(queue) <= 5 for queue in planned)
    with pytest.raises(ValueError, match="no model nonesuch"):
        core_seeds_queue.queues(core, tmp_path, 5, ["nonesuch"])
    text = printed(core_seeds_queue.main, str(core.path), str(tmp_path), "--size", "5", "--models", *named)
    assert text.splitlines()[1] == " ".join(f"{n}:{s}" for n, s in planned[0])
