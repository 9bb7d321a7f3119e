"""``LinMemConfig``'s sub-configs ``attention`` and ``moe``: saved as tables, read from the flat fields of older
files and keyword arguments into the same objects, refused in one line when a table names a field they lack, and
checked against the architecture a weights file records (flat or nested)."""

from __future__ import annotations

import json

import pytest
import torch

import linmem.zoo
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.configuration import FLAT_FIELDS, attention_layers, nest_flat_fields
from linmem.models.loading import _rewrite_header_metadata, load_weights, read_linmem_config
from linmem.models.sub_configs import AttentionConfig, MoEConfig
from linmem.train.checkpoint import write_model
from linmem.train.config import build_model_config, parse_config

# every moved field away from its default, spelled the old, flat way
FLAT = dict(attn_layers=[1, 3], attn_num_heads=4, attn_num_kv_heads=2, attn_head_dim=8, attn_qkv_bias=True,
            attn_qk_norm=True, attn_qk_norm_over="all", attn_output_gate=True, attn_o_bias=True, attn_window_size=6,
            rope_theta=500.0, partial_rotary_factor=0.5, attn_norm_placement="post", num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=False,
            moe_layers=[0, 2])
NESTED = dict(attention=dict(layers=[1, 3], num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, qk_norm=True,
                             qk_norm_over="all", output_gate=True, o_bias=True, window_size=6, rope_theta=500.0,
                             partial_rotary_factor=0.5, norm_placement="post"),
              moe=dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16, shared_expert_intermediate_size=24,
                       norm_topk_prob=False, layers=[0, 2]))
SIZES = dict(vocab_size=61, hidden_size=32, num_hidden_layers=4, num_heads=2, head_dim=8, mixer="gdn",
             intermediate_size=40, hidden_ratio=None)
ZOO = ("gdn", "gdn-hybrid", "gla", "rdn", "rla", "sgla", "transformer")


def saved_fields(config: LinMemConfig) -> dict:
    """What ``config.json`` holds, without the fields that name where and by which version it was written."""
    return {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "_name_or_path")}


def test_the_flat_table_covers_every_sub_config_field():
    assert set(FLAT) == set(FLAT_FIELDS)
    assert sorted(FLAT_FIELDS.values()) == sorted(
        [("attention", name) for name in AttentionConfig.__dataclass_fields__]
        + [("moe", name) for name in MoEConfig.__dataclass_fields__])


def test_flat_arguments_build_the_nested_config():
    flat, nested = LinMemConfig(**SIZES, **FLAT), LinMemConfig(**SIZES, **NESTED)
    assert flat == nested
    assert flat.attention == AttentionConfig(**NESTED["attention"]) and flat.moe == MoEConfig(**NESTED["moe"])
    objects = LinMemConfig(**SIZES, attention=AttentionConfig(**NESTED["attention"]), moe=MoEConfig(**NESTED["moe"]))
    assert objects == nested
    torch.manual_seed(0)
    first = LinMemForCausalLM(flat).eval()
    torch.manual_seed(0)
    second = LinMemForCausalLM(nested).eval()
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)


def test_the_defaults_are_filled_from_the_model():
    config = LinMemConfig(**{**SIZES, "norm_placement": "post"}, attn_layers=[1])
    assert (config.attention.num_heads, config.attention.num_kv_heads) == (2, 2)
    assert config.attention.norm_placement == "post" and config.moe == MoEConfig()
    assert LinMemConfig(**SIZES, attention={"layers": [1], "num_heads": 4}).attention.num_kv_heads == 4


def test_config_json_saves_tables_and_round_trips(tmp_path):
    config = LinMemConfig(**SIZES, **FLAT)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attention"] == {**NESTED["attention"]} and saved["moe"] == NESTED["moe"]
    assert not set(saved) & set(FLAT_FIELDS)
    again = LinMemConfig.from_pretrained(tmp_path)
    assert again.attention == config.attention and again.moe == config.moe
    assert saved_fields(again) == saved_fields(config)


def test_a_flat_config_json_loads_equal_to_its_nested_save(tmp_path):
    flat = {**SIZES, **FLAT, "model_type": "linmem"}
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "config.json").write_text(json.dumps(flat))
    legacy = read_linmem_config(tmp_path / "flat")
    legacy.save_pretrained(tmp_path / "nested")
    nested = read_linmem_config(tmp_path / "nested")
    assert saved_fields(nested) == saved_fields(legacy) == saved_fields(LinMemConfig(**SIZES, **NESTED))


@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_config_json_is_flat_and_loads_into_the_sub_configs(name, tmp_path):
    folder = linmem.zoo.path(name)
    fields = json.loads((folder / "config.json").read_text())
    config = read_linmem_config(folder)
    assert config.attention.layers == fields.get("attn_layers", []) == attention_layers(fields)
    if fields.get("attn_layers"):
        assert (config.attention.num_heads, config.attention.rope_theta) == (fields["attn_num_heads"],
                                                                           fields["rope_theta"])
    config.save_pretrained(tmp_path)
    assert saved_fields(read_linmem_config(tmp_path)) == saved_fields(config)
    assert attention_layers(json.loads((tmp_path / "config.json").read_text())) == config.attention.layers


def test_the_zoo_loads_with_its_record_checked():
    model, folder = load_weights("zoo:gdn-hybrid")
    assert model.config.attention.layers == [2, 5] and (folder / "eval.json").is_file()


@pytest.mark.parametrize(("fields", "message"), [
    (dict(attention={"heads": 4}), "attention has no field 'heads'; its fields: layers, num_heads, num_kv_heads"),
    (dict(moe={"experts": 2, "top_k": 1}), "moe has no field 'experts', 'top_k'; its fields: num_experts"),
    (dict(attention=[1, 2]), "attention must be a table of its fields; got [1, 2]"),
    (dict(attn_layers=[1], attention={"layers": [2]}), "attn_layers = [1] and attention.layers = [2] are both given"),
    (dict(attention={"layers": [0], "num_heads": 3}), "hidden_size (32) = attention.num_heads (3)"),
    (dict(attention={"layers": [7]}), "attention.layers must lie in [0, num_hidden_layers = 4)"),
    (dict(attention={"rope_theta": float("nan")}), "attention.rope_theta must be a finite number; got nan"),
    (dict(attention={"qk_norm": "yes"}), "attention.qk_norm must be true or false; got 'yes'"),
    (dict(moe={"num_experts": 2}), "moe.intermediate_size must be a positive integer; got None"),
    (dict(num_experts=2, moe_intermediate_size=8, moe_layers=[4]), "moe.layers must be distinct layer indices"),
    (dict(num_experts=2, moe_intermediate_size=8, num_experts_per_tok=3), "moe.num_experts_per_tok must be <="),
])
def test_bad_sub_configs_are_one_line_naming_the_field(fields, message):
    with pytest.raises(ValueError) as error:
        LinMemConfig(**SIZES, **fields)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 1


def test_the_same_value_flat_and_nested_is_accepted():
    assert LinMemConfig(**SIZES, attn_layers=[1], attention={"layers": [1]}).attention.layers == [1]


def test_an_unknown_field_in_a_config_json_table_names_the_file(tmp_path):
    LinMemConfig(**SIZES).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields["moe"]["experts"] = 3
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=r"config\.json: moe has no field 'experts'"):
        read_linmem_config(tmp_path)


def recorded(folder, **fields):
    config = LinMemConfig(**{**SIZES, **fields})
    torch.manual_seed(0)
    folder.mkdir()
    write_model(folder, LinMemForCausalLM(config).state_dict(), config)
    return folder


def edit_table(folder, table: str, **changes):
    fields = json.loads((folder / "config.json").read_text())
    fields[table].update(changes)
    (folder / "config.json").write_text(json.dumps(fields))


def test_a_sub_config_edited_away_from_the_record_is_refused(tmp_path):
    folder = recorded(tmp_path / "m", attn_layers=[1], attn_num_kv_heads=1)
    assert load_weights(folder)[0].config.attention.num_kv_heads == 1
    edit_table(folder, "attention", num_kv_heads=2)
    with pytest.raises(ValueError, match=r"attention\.num_kv_heads 1 in the header of model\.safetensors, 2 in "
                                         r"config\.json"):
        load_weights(folder)


def test_a_flat_record_of_an_older_save_is_still_checked(tmp_path):
    """Weights an older linmem saved record ``attn_layers`` and ``rope_theta`` flat; they compare with the tables."""
    folder = recorded(tmp_path / "m", attn_layers=[1])
    config = read_linmem_config(folder)
    flat = {**{k: v for k, v in config.to_dict().items() if k not in ("attention", "moe")},
            "attn_layers": [1], "attn_num_heads": 2, "rope_theta": 10000.0, "num_experts": 0}
    _rewrite_header_metadata(folder / "model.safetensors", {"linmem_architecture": json.dumps(flat)})
    load_weights(folder)
    edit_table(folder, "attention", rope_theta=500.0)
    with pytest.raises(ValueError, match=r"attention\.rope_theta 10000\.0 in the header of model\.safetensors, "
                                         r"500\.0 in config\.json"):
        load_weights(folder)


def test_the_zoo_record_in_eval_json_checks_the_attention_table(tmp_path):
    source = linmem.zoo.path("gdn-hybrid")
    folder = tmp_path / "gdn-hybrid"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "eval.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    edit = json.loads((folder / "config.json").read_text())
    edit["attn_layers"] = [2, 4]
    (folder / "config.json").write_text(json.dumps(edit))
    with pytest.raises(ValueError, match=r"attention\.layers \[2, 5\] in eval\.json .*\[2, 4\] in config\.json"):
        load_weights(folder)


def test_nest_flat_fields_leaves_other_fields_and_reads_objects():
    nested = nest_flat_fields({"mixer": "gdn", "attention": AttentionConfig(layers=[0]), "num_experts": 0})
    assert nested["mixer"] == "gdn" and nested["attention"]["layers"] == [0] and nested["moe"] == {"num_experts": 0}


@pytest.mark.parametrize("model", [dict(SIZES, **FLAT), dict(SIZES, **NESTED)], ids=["flat", "nested"])
def test_a_training_config_takes_either_spelling(model):
    config = parse_config({"model": model})
    assert build_model_config(config, 61) == LinMemConfig(**SIZES, **NESTED, initializer_range=0.006)


def test_a_training_config_refuses_an_unknown_sub_config_key():
    with pytest.raises(ValueError, match=r"unknown key model\.attention\.heads"):
        parse_config({"model": {"attention": {"heads": 4}}})


def test_from_pretrained_overrides_a_sub_config_field_flat_or_as_a_table(tmp_path):
    saved = LinMemConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
                         attn_layers=[1], attn_window_size=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16)
    saved.save_pretrained(tmp_path)
    assert LinMemConfig.from_pretrained(tmp_path).attention.window_size == 8
    flat = LinMemConfig.from_pretrained(tmp_path, attn_window_size=3)
    assert flat.attention.window_size == 3 and flat.attention.layers == [1]
    table = LinMemConfig.from_pretrained(tmp_path, attention={"window_size": 5}, num_experts_per_tok=1)
    assert table.attention.window_size == 5 and table.attention.layers == [1]
    assert table.moe.num_experts_per_tok == 1 and table.moe.num_experts == 4
