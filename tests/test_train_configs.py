"""The shipped configs: every zoo config parses, builds a model of at most 5M parameters (10 MB in bf16), and all
share one budget (data, optimizer, run); the ablations differ from their base only in the switch they name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linmem.models import LinMemForCausalLM
from linmem.train.config import build_model_config, load_config
from tests.test_train_support import one_thread  # noqa: F401  (fixture)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ZOO = sorted((CONFIGS / "zoo").glob("*.yaml"))
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


STAGE2 = sorted((CONFIGS / "zoo" / "stage2").glob("*.yaml"))
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


@pytest.mark.parametrize("base", ["rla", "rdn"])
def test_ablations_change_one_switch(base):
    reference = load_config(CONFIGS / "zoo" / f"{base}.yaml").model
    for suffix, switch in ABLATIONS.items():
        model = load_config(CONFIGS / "zoo" / f"{base}-{suffix}.yaml").model
        changed = {k: v for k, v in model.items() if reference.get(k) != v}
        assert changed == switch, (base, suffix)


@pytest.mark.usefixtures("one_thread")
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
    assert hybrid.attn_layers == [2, 5]  # one layer of three
    transformer = build_model_config(load_config(CONFIGS / "zoo" / "transformer.yaml"), 4096)
    assert transformer.attn_layers == list(range(transformer.num_hidden_layers))
