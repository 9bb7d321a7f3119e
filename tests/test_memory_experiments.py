"""The memory lab's experiments and ``linmem probe`` on tiny random float64 models: every experiment runs and returns
its table and figure, the identities its metrics must meet hold, the random controls are drawn per item, the load
sweep keeps the prompt length, and the CLI runs single experiments."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401
import linmem.memory as mm
from linmem.cli import main
from linmem.data.sources import Document
from linmem.data.tokenizer import save_tokenizer, train_tokenizer, wrap_tokenizer
from linmem.memory import experiments as ex
from linmem.memory import metrics
from linmem.memory.components import mixer
from linmem.memory.evaluate import candidate_logits, make_batch
from linmem.memory.stats import bootstrap
from linmem.memory.tasks import TaskBuilder, TaskSpec, build_items, passages
from linmem.models import LinMemConfig

WORDS = "the of and to in that is was he for it with as his on be at by had not are but from or have".split()
KEYS = "Alice Bob Carol David Emma Frank".split()
VALUES = "red blue green yellow black white".split()
SPEC = TaskSpec(num_bindings=2, repeats=2, filler_tokens=24)


@pytest.fixture(scope="module")
def lab():
    rng = np.random.default_rng(0)
    docs = [Document("toy", f"toy:{i}", " ".join(rng.choice(WORDS, 150))) for i in range(10)]
    facts = [f" The code of {k} is {v}." for k in KEYS for v in VALUES] * 5
    tokenizer = wrap_tokenizer(train_tokenizer([d.text for d in docs] + facts, vocab_size=400))
    sources = passages(docs, tokenizer, 40)
    return docs, tokenizer, TaskBuilder(tokenizer, SPEC), sources


def tiny_model(vocab_size: int, seed: int = 0, **settings) -> torch.nn.Module:
    """A two-layer model (float32, CPU) whose projections are larger than the 0.02 init, so that edits of its
    memory move the logits; ``settings`` override the config (``mixer``, ``backend``, ...)."""
    torch.manual_seed(seed)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, expand_v=2.0, hidden_ratio=2)
    config = LinMemConfig(vocab_size=vocab_size, **{**sizes, **settings})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                p.normal_(0, 0.3)
    return model


def tiny(tokenizer, **settings) -> torch.nn.Module:
    """``tiny_model`` for this tokenizer, in float64, in eval mode."""
    return tiny_model(len(tokenizer), **settings).to(torch.float64).eval()


def rows_of(result, **match) -> list[dict]:
    return [r for r in result.rows if all(r.get(k) == v for k, v in match.items())]


@pytest.mark.slow
def test_every_experiment_runs_on_a_hybrid_residual_model(lab):
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="rdn", num_hidden_layers=3, attn_layers=[1], attn_num_heads=4,
                 attn_num_kv_heads=2)
    sources = sources[:5]
    items = build_items(builder, sources)
    chosen = mm.Component(0, 1, "S")
    results = [
        ex.head_scan(model, items), ex.lifecycle(model, items[:3], chosen),
        ex.head_interaction(model, items, items[:3], chosen),
        ex.four_facts(model, builder, sources, chosen), ex.hybrid_attribution(model, items), ex.s_vs_r(model, items),
        ex.sweep(model, tokenizer, sources, chosen, SPEC, "num_bindings", [1, 2]),
        ex.sweep(model, tokenizer, sources, chosen, SPEC, "gap", [0, 8]), ex.overlap(model, items[:3], chosen),
        ex.overlap_sweep(model, tokenizer, sources[:3], chosen, SPEC, [1, 2]),
        ex.logit_lens(model, items),
        ex.neutral_suppression(model, build_items(TaskBuilder(tokenizer, replace(SPEC, variant="neutral")),
                                                  sources), chosen),
        ex.joint_topk(model, items, items, ks=(1, 2)), ex.write_read_spearman(model, items[:3], draws=20),
        ex.write_reach(model, items[:3], chosen),
    ]
    for result in results:
        assert result.rows and result.figure is not None, result.name
        for r in result.rows:  # n = 0 only for a break rate without a non-target that was right before
            assert r.get("n", 1) > 0 or (r["metric"] == "break_rate" and np.isnan(r["mean"])), (result.name, r)
    hybrid = {r["cache"]: r for r in rows_of(results[4], metric="normalized_donor_effect")}
    assert hybrid["both"]["mean"] == pytest.approx(1.0) and hybrid["both"]["low"] == pytest.approx(1.0)
    assert set(hybrid) == {"recurrent", "kv", "both"}
    shares = rows_of(results[5], metric="share_of_layer", memory="S+R")
    assert shares and all(r["mean"] == pytest.approx(1.0) for r in shares)
    assert {(r["num_bindings"], r["edit"]) for r in rows_of(results[9], metric="target_margin_change")} == {
        (k, e) for k in (1, 2) for e in ("align", "orthogonal", "align, control head")}


def test_head_interaction_adds_up_and_finds_nothing_to_add_for_a_dead_head(lab):
    """The interaction is both blocks' change less the two single ones, item by item; a secondary head whose output
    projection is zero changes nothing, so blocking it with the hub is the hub's block alone (interaction 0). The
    secondary is the ranking's first component other than the hub."""
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="gdn", num_hidden_layers=2)
    items = build_items(builder, sources[:6])
    hub, other, dead = mm.Component(1, 0, "S"), mm.Component(0, 1, "S"), mm.Component(0, 0, "S")
    live = ex.head_interaction(model, items, items, hub, ranking=[other, hub, dead])
    assert live.summary["secondary"] == str(other) and live.figure is not None
    change = {r["blocked"]: r["mean"] for r in rows_of(live, metric="target_margin_change")}
    assert change["interaction"] == pytest.approx(change["both"] - change["hub"] - change["secondary"], abs=1e-9)
    assert change["hub + secondary"] == pytest.approx(change["hub"] + change["secondary"], abs=1e-9)
    assert min(abs(change["hub"]), abs(change["secondary"]), abs(change["both"] - change["hub"])) > 1e-6
    width = model.config.head_dim * 2  # expand_v = 2
    with torch.no_grad():
        mixer(model, dead.layer).o_proj.weight[:, dead.head * width:(dead.head + 1) * width] = 0
    result = ex.head_interaction(model, items, items, hub, ranking=[hub, dead, other])
    change = {r["blocked"]: r for r in rows_of(result, metric="target_margin_change")}
    assert result.summary["secondary"] == str(dead)
    assert change["secondary"]["mean"] == pytest.approx(0, abs=1e-9)
    assert change["both"]["mean"] == pytest.approx(change["hub"]["mean"], abs=1e-9)
    assert change["interaction"]["low"] == pytest.approx(0, abs=1e-9) and result.summary["additive"]
    with pytest.raises(ValueError, match="no second component"):
        ex.head_interaction(model, items, items, hub, ranking=[hub])


def test_hybrid_attribution_says_so_on_a_model_without_attention(lab):
    """Without attention layers the recurrent caches are every cache, so a share of 1.0 would say nothing: the
    experiment runs no edit and its note says the model is not a hybrid."""
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="gdn")
    result = ex.hybrid_attribution(model, build_items(builder, sources))
    assert result.rows == [] and result.figure is None
    assert "not a hybrid" in result.summary["note"]


def test_random_controls_draw_a_direction_per_item(lab):
    """Two identical items from two sources: the chosen edit's effect is the same on both (a CI of zero width),
    the equal-norm random edits differ (each item has its own Gaussian direction)."""
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="gdn")
    item = build_items(builder, sources)[0]
    twin = replace(item, source_id=item.source_id + "-twin")
    result = ex.lifecycle(model, [item, twin], mm.Component(1, 0, "S"))
    for intervention in ("state swap", "donor write", "output patch"):
        chosen = rows_of(result, intervention=intervention, target="chosen", metric="donor_margin_shift")[0]
        random = rows_of(result, intervention=intervention, target="random", metric="donor_margin_shift")[0]
        assert chosen["high"] - chosen["low"] < 1e-9, intervention
        assert random["high"] - random["low"] > 1e-6, intervention


def test_load_sweep_keeps_the_prompt_length(lab):
    _, tokenizer, builder, sources = lab
    base = replace(SPEC, filler_tokens=30)
    specs = ex.sweep_specs(tokenizer, base, "num_bindings", [1, 2, 3])
    lengths = {len(build_items(TaskBuilder(tokenizer, s), sources)[0].prompt()) for s in specs}
    assert len(lengths) == 1 and specs[0].filler_tokens == 30 and specs[2].filler_tokens < 30
    growing = ex.sweep_specs(tokenizer, base, "num_bindings", [1, 3], fixed_length=False)
    assert [s.filler_tokens for s in growing] == [30, 30]
    with pytest.raises(ValueError, match="rule 'fixed length'"):
        ex.sweep_specs(tokenizer, base, "num_bindings", [1, 6])
    with pytest.raises(ValueError, match="field_name"):
        ex.sweep_specs(tokenizer, base, "repeats", [1, 2])


def test_four_facts_needs_one_recipient_for_both_facts(lab):
    _, tokenizer, _, sources = lab
    model = tiny(tokenizer, mixer="gdn")
    latest = TaskBuilder(tokenizer, replace(SPEC, variant="latest", repeats=2))
    with pytest.raises(ValueError, match="rule 'shared recipient'"):
        ex.four_facts(model, latest, sources, mm.Component(0, 0))
    with pytest.raises(ValueError, match="rule 'two facts'"):
        ex.four_facts(model, TaskBuilder(tokenizer, replace(SPEC, num_bindings=1)), sources, mm.Component(0, 0))


def test_frobenius_parts_add_up_and_controls_match_their_norms(lab, monkeypatch):
    """The parallel and orthogonal parts of Δ_A sum to Δ_A, the parallel one is a multiple of Δ_B, and each
    Gaussian control has its part's Frobenius norm."""
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="gdn")
    items_a, items_b = ex.fact_pairs(builder, sources, 0, None)
    added = []
    monkeypatch.setattr(ex, "StateAdd", lambda comps, at, delta: added.append(delta) or mm.StateAdd(comps, at, delta))
    ex.frobenius_split(model, items_a, items_b, mm.Component(1, 1))
    full, full_noise, parallel, parallel_noise, orthogonal, orthogonal_noise = added
    norm = lambda x: x.flatten(1).norm(dim=1)  # noqa: E731
    assert torch.allclose(parallel + orthogonal, full, atol=1e-12)
    assert (parallel * orthogonal).sum((1, 2)).abs().max() < 1e-9 * norm(full).max() ** 2
    for part, noise in ((full, full_noise), (parallel, parallel_noise), (orthogonal, orthogonal_noise)):
        assert torch.allclose(norm(part), norm(noise), rtol=1e-9)


@pytest.fixture(scope="module")
def model_dir(lab, tmp_path_factory):
    docs, tokenizer, _, _ = lab
    root = tmp_path_factory.mktemp("probe")
    (root / "texts").mkdir()
    for i, doc in enumerate(docs):
        (root / "texts" / f"{i:02d}.txt").write_text(doc.text)
    tiny(tokenizer, mixer="gdn").float().save_pretrained(root / "model")
    save_tokenizer(tokenizer, root / "model")
    return root


def probe(root, *extra) -> int:
    return main(["probe", str(root / "model"), "--out", str(root / "out"), "--filler", "24", "--bindings", "2",
                 "--repeats", "2", "--dev-sources", "3", "--confirm-sources", "3", "--device", "cpu",
                 "--sources", str(root / "texts"), "--min-clean-recall", "0", *extra])  # random weights: no gate


@pytest.mark.slow
def test_probe_runs_single_experiments(model_dir):
    assert probe(model_dir, "--only", "logit_lens") == 0
    payload = json.loads((model_dir / "out" / "results.json").read_text())
    assert set(payload["experiments"]) == {"clean_recall", "logit_lens"} and payload["header"]["chosen"] is None
    assert probe(model_dir, "--only", "overlap") == 0  # needs a component: the head scan runs first
    payload = json.loads((model_dir / "out" / "results.json").read_text())
    assert set(payload["experiments"]) == {"clean_recall", "head_scan", "overlap"}
    assert probe(model_dir, "--only", "write_reach", "--component", "L1H0S") == 0
    payload = json.loads((model_dir / "out" / "results.json").read_text())
    assert set(payload["experiments"]) == {"clean_recall", "write_reach"}
    assert probe(model_dir, "--only", "lifecycle", "--component", "L1H0S") == 0
    payload = json.loads((model_dir / "out" / "results.json").read_text())
    assert set(payload["experiments"]) == {"clean_recall", "lifecycle"} and payload["header"]["chosen"] == "L1H0S"
    assert isinstance(payload["header"]["confirmed_on_held_out"], bool)


@pytest.mark.slow
def test_probe_widens_the_write_edits_it_is_asked_to(model_dir, capsys):
    """``--write-tokens-after D``: the lifecycle's write block and donor write cover the fact and the D tokens after
    it, the numbers write_reach gives at d = D by its own path; the other edits, and write_reach itself (always
    from the fact's own tokens), are as without the option; the header records D and the notes say it; a negative D
    is refused before anything runs."""
    def run(*extra) -> dict:
        assert probe(model_dir, "--only", "lifecycle", "write_reach", "--component", "L1H0S", *extra) == 0
        return json.loads((model_dir / "out" / "results.json").read_text())

    plain, wide = run(), run("--write-tokens-after", "2")
    assert (plain["header"]["write_tokens_after"], wide["header"]["write_tokens_after"]) == (0, 2)
    assert any("the 2 token(s) after it" in note for note in wide["header"]["notes"])
    assert not any("token(s) after it" in note for note in plain["header"]["notes"])
    rows = lambda record, name: record["experiments"][name]["rows"]  # noqa: E731
    assert rows(plain, "write_reach") == rows(wide, "write_reach")
    for intervention, metrics_ in (("write block", ("edited_correct", "target_margin_change")),
                                   ("donor write", ("donor_answer", "donor_margin_shift"))):
        for target in ("chosen", "control head"):
            for metric in metrics_:
                pick = dict(intervention=intervention, target=target, metric=metric)
                reach = [r for r in rows(plain, "write_reach") if r["tokens_after"] == 2
                         and all(r[k] == v for k, v in pick.items())]
                life = [r for r in rows(wide, "lifecycle") if all(r[k] == v for k, v in pick.items())]
                assert len(reach) == len(life) == 1
                assert life[0]["mean"] == pytest.approx(reach[0]["mean"], rel=1e-4, abs=1e-7), pick  # float32
    block = lambda record: next(r["mean"] for r in rows(record, "lifecycle") if (  # noqa: E731
        r["intervention"], r["target"], r["metric"]) == ("write block", "chosen", "target_margin_change"))
    assert abs(block(wide) - block(plain)) > 1e-3 * abs(block(plain))  # the widening changed the lifecycle
    unwidened = [r for r in rows(plain, "lifecycle") if r["intervention"] not in ("write block", "donor write")]
    assert unwidened == [r for r in rows(wide, "lifecycle") if r["intervention"] not in ("write block", "donor write")]
    with pytest.raises(SystemExit):
        probe(model_dir, "--only", "lifecycle", "--component", "L1H0S", "--write-tokens-after", "-1")
    assert "must be >= 0" in capsys.readouterr().err


def test_probe_reports_bad_options_before_running(model_dir, capsys):
    assert probe(model_dir, "--only", "lifecycle", "--component", "L0H5S") == 2
    assert "head must be in [0, 2)" in capsys.readouterr().err
    assert probe(model_dir, "--only", "sweep_num_bindings", "--component", "L0H0S", "--loads", "1", "3") == 2
    assert "rule" in capsys.readouterr().err


@pytest.mark.slow
def test_benchmark_scans_agree(lab):
    """``python -m linmem.bench.memory`` times two ways of one head scan: they must compute the same logits."""
    from linmem.bench.memory import full_reruns, suffix_only

    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="rdn")
    batch = make_batch(build_items(builder, sources)[:3])
    components = mm.heads(model)
    fast, slow = suffix_only(model, batch, components, chunk=3), full_reruns(model, batch, components)
    assert fast.shape == slow.shape == (len(components), 3, len(tokenizer))
    assert (fast - slow).abs().max() < 1e-9


@pytest.mark.slow
def test_write_reach_widens_the_lifecycles_write_edits_through_the_short_convolutions(lab):
    """``d`` = 0 is the lifecycle's write block and donor write (the same numbers by another code path); the row at
    each ``d`` edits the fact's spans and the ``d`` tokens after them, on the chosen and the control head: recomputed
    here from hand-widened spans through the model's own hook points (β zeroed, or k, v and β taken from the
    donor's run), all items in one forward per row, apart from the lab's replay; the offsets run 0..W for short
    convolutions of width W, and 0..1 without them."""
    _, tokenizer, builder, sources = lab
    items = build_items(builder, sources)  # one item per source
    chosen, control = mm.Component(1, 0, "S"), mm.Component(0, 1, "S")
    model = tiny(tokenizer, mixer="gdn", use_short_conv=True, conv_size=3)
    result = ex.write_reach(model, items, chosen, control)
    assert result.summary["conv_width"] == 3 and result.figure is not None
    assert sorted({r["tokens_after"] for r in result.rows}) == [0, 1, 2, 3]
    life = ex.lifecycle(model, items, chosen, control)
    measured = {"write block": ("edited_correct", "target_margin_change"),
                "donor write": ("donor_answer", "donor_margin_shift")}
    for intervention, names in measured.items():
        assert {r["metric"] for r in result.rows if r["intervention"] == intervention} == set(names)
        for metric in names:
            ours = rows_of(result, intervention=intervention, target="chosen", tokens_after=0, metric=metric)[0]
            theirs = rows_of(life, intervention=intervention, target="chosen", metric=metric)[0]
            assert ours["mean"] == pytest.approx(theirs["mean"], abs=1e-12), (intervention, metric)
    batch = make_batch(items)
    points = {"write block": ("beta",), "donor write": ("k", "v", "beta")}
    names = lambda comp, intervention: [f"model.layers.{comp.layer}.attn.hook_{p}"  # noqa: E731
                                        for p in points[intervention]]
    with torch.no_grad():
        _, donor = model.run_with_cache(batch.donor, names=names(chosen, "donor write") + names(control, "donor write"))

    def edited_spans(comp: mm.Component, d: int, intervention: str):
        def edit(tensor: torch.Tensor, name: str) -> None:
            for b, item in enumerate(items):
                for start, end in item.target_writes:
                    span = slice(start, min(end + d, item.boundary))
                    tensor[b, span, comp.head] = 0 if intervention == "write block" else donor[name][b, span, comp.head]
        return [(name, edit) for name in names(comp, intervention)]

    def candidates(hooks) -> torch.Tensor:
        with torch.no_grad():
            logits = model.run_with_hooks(batch.recipient, hooks=hooks).logits[:, -1]
        return metrics.choice_logits(logits, batch.candidates)

    margin = {"write block": lambda choice: metrics.target_margin(choice, batch.answer),
              "donor write": lambda choice: metrics.donor_margin(choice, batch.answer, batch.donor_answer)}
    clean = candidates([])
    for intervention, metric in (("write block", "target_margin_change"), ("donor write", "donor_margin_shift")):
        for target, comp in (("chosen", chosen), ("control head", control)):
            for d in range(4):
                edited = candidates(edited_spans(comp, d, intervention))
                change = margin[intervention](edited) - margin[intervention](clean)
                row = rows_of(result, intervention=intervention, target=target, tokens_after=d, metric=metric)[0]
                assert row["mean"] == pytest.approx(float(change.mean()), abs=1e-9), (intervention, target, d)
        # widening moves the chosen head's margin: the rows are not the same edit four times
        by_d = [rows_of(result, intervention=intervention, target="chosen", tokens_after=d, metric=metric)[0]["mean"]
                for d in range(4)]
        assert max(by_d) - min(by_d) > 1e-6, intervention
    plain = ex.write_reach(tiny(tokenizer, mixer="gdn", use_short_conv=False), items[:3], chosen, control)
    assert plain.summary["conv_width"] == 1 and sorted({r["tokens_after"] for r in plain.rows}) == [0, 1]
    assert plain.summary["blocked_through_conv_reach"] == plain.summary["blocked_fact_tokens"]
    assert plain.summary["donor_through_conv_reach"] == plain.summary["donor_fact_tokens"]


@pytest.mark.slow
def test_qualified_donor_rate_counts_only_items_both_prompts_answer(lab):
    """The lifecycle's ``qualified_donor_answer``: the donor-answer rate over the items whose recipient and donor
    prompts both give their own answer unedited, recomputed here from the two clean runs. The untrained model
    answers some prompts and not others, so the qualified set is neither empty nor everything."""
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="gdn")
    items = build_items(builder, sources, per_source=8)
    chosen = mm.Component(1, 0, "S")
    result = ex.lifecycle(model, items, chosen)
    batch = make_batch(items)
    recipient = candidate_logits(model, batch, [[], [mm.StateSwap([chosen], batch.boundary)]])
    own = candidate_logits(model, replace(batch, recipient=batch.donor), [[]], use_donor=False)
    qualified = (recipient[0].argmax(-1) == batch.answer) & (own[0].argmax(-1) == batch.donor_answer)
    assert 0 < int(qualified.sum()) < len(items)
    assert (result.summary["qualified_items"], result.summary["items"]) == (int(qualified.sum()), len(items))
    moved = (recipient[1].argmax(-1) == batch.donor_answer)[qualified].double()
    row = rows_of(result, metric="qualified_donor_answer", intervention="state swap", target="chosen")[0]
    assert row["mean"] == pytest.approx(float(moved.mean()), abs=1e-12) and row["n"] == int(qualified.sum())
    assert rows_of(result, metric="donor_answer", intervention="state swap", target="chosen")[0]["n"] == len(items)


def test_non_target_breaks_share_the_prefix_runs_and_match_running_each_binding_alone(lab):
    """The bindings' prompts share facts and filler: one prefix run (recipient and donor caches, picked by row)
    serves every binding and gives the logits that a separate run per binding gives, on a hybrid RDN (attention
    caches, both states, short-convolution states); a prefix of other prompts is refused."""
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="rdn", num_hidden_layers=3, attn_layers=[1], attn_num_heads=4,
                 attn_num_kv_heads=2)
    items = build_items(builder, sources[:6])
    at = items[0].boundary
    sets = [[], [mm.StateSwap([mm.Component(0, 1, "S")], at)],
            [mm.StateSwap([mm.Component(2, 0, "R")], at, "random")]]
    ids = lambda rows: torch.tensor(rows, dtype=torch.long)  # noqa: E731
    prefix = mm.intervene.shared_prefix(model, ids([it.recipient for it in items]), ids([it.donor for it in items]),
                                        sets)
    for j in range(SPEC.num_bindings):
        keep = [i for i, it in enumerate(items) if it.target != j][::-1]  # rows in another order than the prefix's
        sub = make_batch([items[i] for i in keep], binding=j)
        shared = candidate_logits(model, sub, sets, prefix=prefix.select(keep))
        alone = candidate_logits(model, sub, sets)
        torch.testing.assert_close(shared, alone, rtol=1e-12, atol=1e-12)
        assert not torch.equal(shared[0], shared[1])  # the swap moves the logits: the check compares something
    with pytest.raises(ValueError, match="shared prefix is of"):
        candidate_logits(model, sub, sets, prefix=prefix)
    broken, owners, rate, denominator = ex.non_target_breaks(model, items, sets[1:2])[0]
    assert len(owners) == len(broken) == sum(it.target != j for it in items for j in range(SPEC.num_bindings))
    assert denominator == int((~torch.isnan(broken)).sum()) and rate == pytest.approx(float(np.nanmean(broken)))


def test_load_vs_gap_pairs_each_sources_drops_and_equals_the_sweeps_clean_recall(lab):
    """Each condition's clean recall is the sweep's at that point (same items); each drop and the difference of the
    drops are recomputed from per-item values of independently built items, paired by source."""
    _, tokenizer, _, sources = lab
    model = tiny(tokenizer, mixer="gdn")
    sources = sources[:6]
    result = ex.load_vs_gap(model, tokenizer, sources, SPEC, [2, 1], [8, 0])  # ends taken whatever the order
    assert result.figure is not None and result.summary["loads"] == [1, 2] and result.summary["gaps"] == [0, 8]
    chosen = mm.Component(0, 0, "S")
    for field_name, swept in (("num_bindings", [1, 2]), ("gap", [0, 8])):
        sweep = ex.sweep(model, tokenizer, sources, chosen, SPEC, field_name, swept)
        condition = "load" if field_name == "num_bindings" else "gap"
        for value in swept:
            mine = rows_of(result, condition=condition, value=value, metric="clean_correct")[0]
            theirs = rows_of(sweep, **{field_name: value}, edit="chosen", metric="clean_correct")[0]
            assert mine["mean"] == pytest.approx(theirs["mean"]) and mine["low"] == pytest.approx(theirs["low"])

    def per_source(spec: TaskSpec) -> dict[str, tuple[float, float]]:
        items = build_items(TaskBuilder(tokenizer, spec), sources)
        batch = make_batch(items)
        clean = candidate_logits(model, batch, [[]])[0]
        margin = metrics.target_margin(clean, batch.answer)
        correct = (clean.argmax(-1) == batch.answer).double()
        return {s: (float(c), float(m)) for s, c, m in zip(batch.sources, correct, margin)}

    few, many = (per_source(s) for s in ex.sweep_specs(tokenizer, SPEC, "num_bindings", [1, 2]))
    short, long_ = per_source(replace(SPEC, gap=0)), per_source(replace(SPEC, gap=8))
    for k, metric in enumerate(("clean_correct", "target_margin")):
        drops = {"load drop": [few[s][k] - many[s][k] for s in few],
                 "gap drop": [short[s][k] - long_[s][k] for s in few]}
        drops["load drop − gap drop"] = [a - b for a, b in zip(drops["load drop"], drops["gap drop"])]
        for name, values in drops.items():
            row = rows_of(result, comparison=name, metric=metric)[0]
            expected = bootstrap(values, list(few))
            assert (row["mean"], row["low"], row["high"]) == pytest.approx(
                (expected.mean, expected.low, expected.high)), (name, metric)
    margin = rows_of(result, comparison="load drop − gap drop", metric="target_margin")[0]
    assert result.summary["margin_difference"] == {k: margin[k] for k in ("mean", "low", "high")}
    assert result.summary["more_facts_hurt_more_margin"] == (margin["low"] > 0)
    with pytest.raises(ValueError, match="two loads and two gaps"):
        ex.load_vs_gap(model, tokenizer, sources, SPEC, [1, 1], [0, 8])


@pytest.mark.slow
def test_probe_runs_load_vs_gap_only_where_two_loads_and_two_gaps_fit(model_dir, capsys):
    assert probe(model_dir, "--only", "load_vs_gap", "--loads", "1", "2", "--gaps", "0", "8") == 0
    payload = json.loads((model_dir / "out" / "results.json").read_text())
    assert set(payload["experiments"]) == {"clean_recall", "load_vs_gap"} and payload["header"]["chosen"] is None
    assert payload["header"]["loads"] == [1, 2] and payload["header"]["gaps"] == [0, 8]
    assert probe(model_dir, "--only", "load_vs_gap", "--loads", "1", "--gaps", "0", "8") == 2  # asked for: refused
    assert "load_vs_gap compares two loads and two gaps" in capsys.readouterr().err
    # in the whole protocol it is left out, and the report says so
    assert probe(model_dir, "--no-extras", "--component", "L1H0S", "--loads", "1", "--gaps", "0", "8") == 0
    payload = json.loads((model_dir / "out" / "results.json").read_text())
    assert "load_vs_gap" not in payload["experiments"] and "sweep_gap" in payload["experiments"]
    assert any(note.startswith("load_vs_gap compares two loads and two gaps") and note.endswith("not run")
               for note in payload["header"]["notes"])
