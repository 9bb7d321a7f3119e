"""The shipped configs: every zoo config parses, builds a model of at most 5M parameters (10 MB in bf16), and all
share one budget (data, optimizer, run); the ablations differ from their base only in the switch they name. The
shared budget is written once (``include: base.yaml``), and every shipped config resolves to the dict recorded in
tests/fixtures/resolved_configs.json before that refactor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from linmem.models import LinMemForCausalLM
from linmem.train.config import TrainConfig, build_model_config, load_config, read_config_dict

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ROOT = CONFIGS.parent
ZOO = sorted(p for p in (CONFIGS / "zoo").glob("*.yaml") if p.name != "base.yaml")
MAIN = {"sgla", "gla", "gdn", "rla", "rdn", "gdn-hybrid", "transformer"}
ABLATIONS = {"no-fitting": {"fit_history": False}, "tied-gamma": {"gamma": "tied"},
             "plain-sum": {"output_gates": False}, "no-clip": {"residual_target": "identity"}}


def test_the_zoo_is_complete():
    names = {p.stem for p in ZOO}
    assert MAIN <= names
    assert {f"{base}-{a}" for base in ("rla", "rdn") for a in ABLATIONS} <= names


@pytest.mark.parametrize("path", ZOO, ids=lambda p: p.stem)
def test_zoo_model_fits_ten_megabytes(path):
    config = load_config(path)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = LinMemForCausalLM(build_model_config(config, 4096))
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert parameters * 2 <= 10_000_000, f"{path.stem}: {parameters:,} parameters"
    assert config.name == path.stem and config.train.save_dtype == "bfloat16"


def test_zoo_shares_one_budget():
    """Same data, steps, batch and schedule shape for every zoo model; only the peak learning rate (and its floor, a
    tenth of it) is each model's own, as scripts/zoo/lr_race.py chose it (docs/training.md), and the seed (the
    shipped RLA's first stage is seed 1; sGLA's, GLA's and the hybrid's seed 3)."""
    configs = {p.stem: load_config(p) for p in ZOO}

    def run(d):
        return {k: v for k, v in d["train"].items() if k != "seed"}

    reference = configs["gdn"].to_dict()
    for name, config in configs.items():
        d = config.to_dict()
        assert (d["data"], run(d)) == (reference["data"], run(reference)), name
        own = ("lr", "min_lr")
        assert {k: v for k, v in d["optim"].items() if k not in own} == \
            {k: v for k, v in reference["optim"].items() if k not in own}, name
        assert d["optim"]["min_lr"] == pytest.approx(d["optim"]["lr"] / 10), name
        assert 1e-3 <= d["optim"]["lr"] <= 1e-2, name


STAGE2 = sorted(p for p in (CONFIGS / "zoo" / "stage2").glob("*.yaml") if p.name != "base.yaml")
SAME_SEED_AS_FIRST_STAGE = {"rla"}  # as shipped: its second stage repeats the first's text windows (docs/training.md)


def test_second_stage_continues_each_main_model_with_one_budget():
    """configs/zoo/stage2: every main model, started from its shipped first stage (same architecture and name, so
    that it replaces it), all with the same data, run and optimizer, and another seed than the first stage (except
    RLA: its shipped first stage is seed 1, and its shipped second stage ran with seed 1 as well)."""
    assert {p.stem for p in STAGE2} == MAIN

    def budget(config):
        d = config.to_dict()
        return d["data"], d["optim"], {k: v for k, v in d["train"].items() if k != "init_from"}

    reference = budget(load_config(STAGE2[0]))
    for path in STAGE2:
        second, first = load_config(path), load_config(CONFIGS / "zoo" / path.name)
        assert second.model == first.model and second.name == first.name == path.stem
        assert second.train.init_from == f"zoo:{path.stem}"
        assert (second.train.seed == first.train.seed) == (path.stem in SAME_SEED_AS_FIRST_STAGE), path.stem
        assert budget(second) == reference, path.stem


THIRD_STAGES = {"stage3": "generated", "stage3-ids": "text"}  # folder: the template of the facts it adds


@pytest.mark.parametrize(("folder", "template"), THIRD_STAGES.items())
def test_third_stages_add_facts_in_new_formats_to_every_main_model_with_one_budget(folder, template):
    """configs/zoo/stage3 and stage3-ids: every main model, started from its shipped model, one budget for all, a
    seed no earlier stage used, and the second stage's recall mix plus facts in generated formats (stage3) or in
    text templates with keys and values drawn from every token id (stage3-ids); the held-out eval stays held out
    (tests/test_memory_analyses.py checks configs/ against HELD_OUT)."""
    stage = sorted(p for p in (CONFIGS / "zoo" / folder).glob("*.yaml") if p.name != "base.yaml")
    assert {p.stem for p in stage} == MAIN
    second = load_config(STAGE2[0]).data.recall
    reference = None
    for path in stage:
        third, first, earlier = load_config(path), load_config(CONFIGS / "zoo" / path.name), \
            load_config(CONFIGS / "zoo" / "stage2" / path.name)
        assert third.model == first.model and third.name == first.name == path.stem
        assert third.train.init_from == f"zoo:{path.stem}"
        assert third.train.seed not in (first.train.seed, earlier.train.seed), path.stem
        d = third.to_dict()
        budget = d["data"], d["optim"], {k: v for k, v in d["train"].items() if k not in ("init_from", "seed")}
        reference = reference or budget
        assert budget == reference, path.stem
    recall = load_config(stage[0]).data.recall
    added = [r for r in recall if r.get("template") == template]
    assert added and all(r["keys"] == r["values"] == "generated" for r in added)
    assert all(r.get("word_pool") == "ids" for r in added) == (template == "text")
    assert {r["name"] for r in recall} == {r["name"] for r in second}


@pytest.mark.parametrize("base", ["rla", "rdn"])
def test_ablations_change_one_switch(base):
    reference = load_config(CONFIGS / "zoo" / f"{base}.yaml").model
    for suffix, switch in ABLATIONS.items():
        model = load_config(CONFIGS / "zoo" / f"{base}-{suffix}.yaml").model
        changed = {k: v for k, v in model.items() if reference.get(k) != v}
        assert changed == switch, (base, suffix)


@pytest.mark.parametrize("path", ZOO, ids=lambda p: p.stem)
def test_every_parameter_gets_a_gradient(path):
    """DDP (find_unused_parameters=False) needs every parameter in the graph: a tiny copy of each zoo model."""
    config = load_config(path)
    config.model.update(hidden_size=32, num_heads=2, head_dim=16, intermediate_size=32)
    torch.manual_seed(0)
    model = LinMemForCausalLM(build_model_config(config, 64))
    ids = torch.randint(0, 64, (2, 12))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"{path.stem}: no gradient for {missing}"


def test_tiny_cpu_example_parses():
    config = load_config(CONFIGS / "tiny-cpu.yaml")
    assert config.train.device == "cpu" and config.data.sources == ["stdlib"]


def test_hybrid_and_transformer_layers():
    hybrid = build_model_config(load_config(CONFIGS / "zoo" / "gdn-hybrid.yaml"), 4096)
    assert hybrid.attention.layers == [2, 5]  # one layer of three
    transformer = build_model_config(load_config(CONFIGS / "zoo" / "transformer.yaml"), 4096)
    assert transformer.attention.layers == list(range(transformer.num_hidden_layers))


# --- include: a shared base --------------------------------------------------------------------------------


def test_every_shipped_config_resolves_as_recorded():
    """The zoo, second-stage and paper configs resolve (includes merged, defaults filled) to the recorded dicts."""
    recorded = json.loads((ROOT / "tests" / "fixtures" / "resolved_configs.json").read_text(encoding="utf-8"))
    shipped = sorted(str(p.relative_to(ROOT)) for p in [*ZOO, *STAGE2, *(CONFIGS / "paper").glob("*.yaml")])
    assert sorted(recorded) == shipped
    defaults = TrainConfig().to_dict()
    for name, expected in recorded.items():
        resolved = load_config(ROOT / name).to_dict()
        for section, values in resolved.items():
            if not isinstance(values, dict) or section == "model":
                assert values == expected[section], (name, section)
                continue
            # every recorded key as recorded; a key the config format gained since then sits at its default
            assert {k: values[k] for k in expected[section]} == expected[section], (name, section)
            assert all(values[k] == defaults[section][k] for k in set(values) - set(expected[section])), name


def test_zoo_configs_state_only_their_own_keys():
    """The shared sections live in base.yaml: a zoo file sets its model, peak rate and seed (stage 2: seed and
    starting point) and nothing else."""
    for path in ZOO:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert set(raw) == {"include", "name", "description", "model", "optim", "train"}, path.stem
        assert set(raw["optim"]) == {"lr", "min_lr"} and set(raw["train"]) == {"seed"}, path.stem
    for path in STAGE2:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert set(raw) == {"include", "train"} and set(raw["train"]) == {"seed", "init_from"}, path.stem


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")


def test_include_merges_deeply_and_the_including_file_wins(tmp_path):
    _write(tmp_path, {
        "shared/a.yaml": "data: {dir: d, seq_len: 64, recall: [{name: mqar}]}\noptim: {lr: 1.0e-3, min_lr: 1.0e-4}\n",
        "shared/b.yaml": "include: a.yaml\noptim: {warmup_steps: 7}\ntrain: {steps: 9, batch_size: 4}\n",
        "run.yaml": "include: shared/b.yaml\nmodel: {hidden_size: 32}\ndata: {seq_len: 128, recall: []}\n"
                    "train: {steps: 3}\n",
    })
    config = load_config(tmp_path / "run.yaml")
    assert (config.data.dir, config.data.seq_len, config.data.recall) == ("d", 128, [])  # lists replaced whole
    assert (config.optim.lr, config.optim.min_lr, config.optim.warmup_steps) == (1e-3, 1e-4, 7)
    assert (config.train.steps, config.train.batch_size) == (3, 4)
    assert config.model["hidden_size"] == 32
    overridden = load_config(tmp_path / "run.yaml", ["train.steps=11", "optim.warmup_steps=2"])  # --set comes last
    assert (overridden.train.steps, overridden.optim.warmup_steps) == (11, 2)


def test_a_list_of_includes_applies_in_order(tmp_path):
    _write(tmp_path, {"a.yaml": "data: {dir: a, seq_len: 8}\n", "b.yaml": "data: {dir: b}\n",
                      "run.yaml": "include: [a.yaml, b.yaml]\n"})
    raw = read_config_dict(tmp_path / "run.yaml")
    assert raw == {"data": {"dir": "b", "seq_len": 8}}


def test_include_cycles_and_missing_files_are_refused(tmp_path):
    _write(tmp_path, {"a.yaml": "include: b.yaml\n", "b.yaml": "include: [c.yaml, a.yaml]\n", "c.yaml": "{}\n",
                      "self.yaml": "include: self.yaml\n", "missing.yaml": "include: nowhere.yaml\n",
                      "bad.yaml": "include: {a: 1}\n"})
    with pytest.raises(ValueError, match="include cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ValueError, match="include cycle"):
        load_config(tmp_path / "self.yaml")
    with pytest.raises(FileNotFoundError, match="include names .*nowhere.yaml"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="include must be a file name or a list"):
        load_config(tmp_path / "bad.yaml")
