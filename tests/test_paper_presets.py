"""The RLA paper's 1.5B presets (configs/paper): Table 6's shapes and parameter counts within 1%, Table 7's recipe,
every ablation override of the README, and ``linmem params`` (meta-device counts that add up and match a real
model's)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from linmem.cli import main
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.train.config import load_config, parse_config
from linmem.train.params import count_config_parameters, count_model_parameters

PAPER = Path(__file__).resolve().parent.parent / "configs" / "paper"
# Table 6: parameters of each model; the linear models and the Transformer share hidden / MLP / depth.
TABLE_6 = {"sgla": 1.55e9, "gla": 1.55e9, "gdn": 1.55e9, "rla": 1.55e9, "rdn": 1.55e9, "transformer": 1.51e9}
BATCH_TOKENS = 4 * 2**20  # Table 7: "4M" tokens per update


def preset(name: str) -> Path:
    return PAPER / f"{name}-1.5b.yaml"


def test_every_model_of_table_6_has_a_preset():
    assert sorted(p.name for p in PAPER.glob("*.yaml")) == sorted(f"{n}-1.5b.yaml" for n in TABLE_6)


@pytest.mark.parametrize("name", list(TABLE_6))
def test_parameter_count_within_one_percent(name):
    count = count_config_parameters(load_config(preset(name)))
    assert count.total == pytest.approx(TABLE_6[name], rel=0.01), f"{name}: {count.total:,}"
    assert count.embeddings + count.lm_head == pytest.approx(0.41e9, rel=0.01)  # README: what Table 6 leaves


@pytest.mark.parametrize("name", list(TABLE_6))
def test_table_6_shape_and_table_7_recipe(name):
    config = load_config(preset(name))
    m, o, t, d = config.model, config.optim, config.train, config.data
    assert (m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]) == (2048, 8192, 16)
    if name == "transformer":
        assert m["attn_layers"] == list(range(16))
        assert (m["attn_num_heads"], m["attn_num_kv_heads"], m["attn_head_dim"]) == (32, 4, 128)
    else:
        assert m["mixer"] == name and not m.get("attn_layers")
        assert (m["num_heads"], m["head_dim"], m["expand_v"]) == (16, 128, 1.0)
    if name in ("rla", "rdn"):
        assert (m["clip"], m["residual_target"], m["gamma"], m["fit_history"], m["output_gates"]) == (
            1.0, "clip", "independent", True, True)
    assert (o.lr, o.min_lr, o.weight_decay, o.grad_clip, m["initializer_range"]) == (3e-4, 3e-5, 0.1, 1.0, 0.006)
    batch_tokens = t.batch_size * d.seq_len
    assert batch_tokens == BATCH_TOKENS
    assert t.steps * batch_tokens == pytest.approx(100e9, rel=1e-4)
    assert o.warmup_steps * batch_tokens == pytest.approx(0.5e9, rel=0.01)
    assert t.gradient_checkpointing and t.parallel == "fsdp" and t.dtype == "bfloat16"
    assert d.dir and d.tokenizer.endswith("tokenizer.json")  # paths the user supplies


def readme_overrides() -> list[tuple[str, list[str]]]:
    """Every ``--set`` list of the README's ablation table: ``(ablation, ["model.x=y", ...])``."""
    rows = []
    for line in (PAPER / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[-2].startswith("`--set"):
            rows.append((cells[1], shlex.split(cells[-2].strip("`"))[1::2]))
    return rows


def test_readme_lists_the_ablations():
    names = [name for name, _ in readme_overrides()]
    assert len(names) == 5 and any("fitting" in n for n in names) and any("γ" in n for n in names)


@pytest.mark.parametrize("base", ["rla", "rdn"])
@pytest.mark.parametrize("ablation, overrides", readme_overrides())
def test_readme_ablation_overrides_parse_and_change_one_switch(base, ablation, overrides):
    plain, changed = load_config(preset(base)), load_config(preset(base), overrides)
    diff = {f"model.{k}" for k in plain.model if plain.model[k] != changed.model.get(k)}
    diff |= {f"{s}.{k}" for s in ("data", "optim", "train")
             for k, v in vars(getattr(plain, s)).items() if getattr(changed, s).__dict__[k] != v}
    assert diff == {o.partition("=")[0] for o in overrides}, ablation
    if "train.steps" in diff:  # Tables 4 and 5: 50B tokens
        assert changed.train.steps * changed.train.batch_size * changed.data.seq_len == pytest.approx(50e9, rel=1e-4)
    count = count_config_parameters(changed)
    assert count.total == pytest.approx(1.55e9, rel=0.01)


def random_config(gen: torch.Generator) -> LinMemConfig:
    """A small model of random shape: mixer, depth, tying and an attention layer drawn from ``gen``."""
    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    layers = pick(2, 3, 4)
    return LinMemConfig(vocab_size=pick(97, 130, 256), hidden_size=pick(32, 64), num_hidden_layers=layers,
                        num_heads=2, head_dim=pick(8, 16), expand_v=pick(1.0, 2.0), intermediate_size=pick(48, 96),
                        mixer=pick("sgla", "gla", "gdn", "rla", "rdn"), attn_layers=pick([], [layers - 1]),
                        attn_num_heads=4, attn_num_kv_heads=2, tie_word_embeddings=pick(True, False))


@pytest.mark.parametrize("draw", range(4))
def test_meta_count_matches_a_real_model_and_adds_up(draw):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    config = random_config(gen)
    count = count_model_parameters(config)
    real = LinMemForCausalLM(config)
    named = dict(real.named_parameters())  # a tied weight appears once
    assert count.total == sum(p.numel() for p in named.values())
    assert count.total == (count.embeddings + count.lm_head + count.final_norm
                           + sum(kind.total for kind in count.blocks))
    assert (count.lm_head == 0) == config.tie_word_embeddings
    for kind in count.blocks:
        block = real.model.layers[kind.layers[0]]
        assert kind.parts["attn"] == sum(p.numel() for p in block.attn.parameters())
        assert sum(kind.mixer_parts.values()) == kind.parts["attn"]
    assert sum(len(k.layers) for k in count.blocks) == config.num_hidden_layers


def test_params_command(capsys, tmp_path):
    assert main(["params", str(preset("rdn")), "--set", "model.fit_history=false", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    count = count_config_parameters(load_config(preset("rdn"), ["model.fit_history=false"]))
    assert out["total"] == count.total and out["overrides"] == ["model.fit_history=false"]
    assert out["blocks"][0]["name"] == "rdn" and out["blocks"][0]["layers"] == list(range(16))
    assert main(["params", str(preset("transformer"))]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^total\s+1,518,405,632$", text, re.M) and "attention blocks (layers 0-15)" in text
    assert main(["params", str(tmp_path / "missing.yaml")]) == 2
    assert "no config file" in capsys.readouterr().err


def test_auto_vocabulary_is_the_dataset_one(tmp_path):
    raw = {"model": {"hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2, "head_dim": 16},
           "data": {"dir": str(tmp_path / "data"), "vocab_size": 1000}}
    count = count_config_parameters(parse_config(raw))
    assert count.vocab_size == 1024 and "data.vocab_size" in count.vocab_source  # rounded up to 64, as trained
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "index.json").write_text(json.dumps({"vocab_size": 3000}))
    count = count_config_parameters(parse_config(raw))
    assert count.vocab_size == 3008 and "dataset" in count.vocab_source
