"""A tiny GDN trained here (250 AdamW steps, about a minute on 2 idle CPU cores) to recall key-value bindings in
natural filler: the head the scan picks on development sources moves the answer to the donor on held-out sources,
far above the equal-norm random swap; and ``linmem probe``'s protocol writes a readable report on it."""

from __future__ import annotations

import itertools
import json

import pytest

import linmem.memory as mm
from linmem.cli import main
from linmem.data.builtin import StdlibDocs
from linmem.data.tokenizer import save_tokenizer
from linmem.memory import experiments as ex
from linmem.memory.evaluate import candidate_logits, make_batch
from linmem.memory.metrics import compare
from linmem.memory.stats import bootstrap
from linmem.memory.tasks import TaskSpec, build_items, passages
from linmem.memory.toy import train_toy

MODULES = ["json", "collections", "os", "re", "string", "textwrap", "pathlib", "typing", "functools", "itertools",
           "dataclasses", "argparse", "logging", "unittest", "subprocess", "threading", "random", "math",
           "statistics", "datetime"]


@pytest.fixture(scope="module")
def trained():
    docs = [d for d in itertools.islice(StdlibDocs(modules=MODULES, topics=False).documents(), 400)
            if len(d.text) > 400]
    spec = TaskSpec(num_bindings=2, repeats=2, filler_tokens=32, keys="letters", values="colors")
    setup = train_toy([d.text[:4000] for d in docs], spec, mixer="gdn", steps=250, seq_len=96, batch_size=32)
    sources = passages(docs, setup.tokenizer, 40)
    return setup, docs, sources


@pytest.mark.slow
def test_chosen_head_swap_moves_the_answer_to_the_donor(trained):
    setup, _, sources = trained
    dev = [p for p in sources if p[1] == "dev"][:16]
    confirm = [p for p in sources if p[1] == "confirm"][:16]
    assert len(dev) >= 8 and len(confirm) >= 8 and not {p[0] for p in dev} & {p[0] for p in confirm}
    scan = ex.head_scan(setup.model, build_items(setup.builder, dev, per_source=2))
    chosen = mm.Component.parse(scan.summary["chosen"])
    batch = make_batch(build_items(setup.builder, confirm, per_source=2, seed=1))
    choice = candidate_logits(setup.model, batch, [[], [mm.StateSwap([chosen], batch.boundary)],
                                                   [mm.StateSwap([chosen], batch.boundary, control="random")]])
    swap = compare(choice[0], choice[1], batch.answer, batch.donor_answer)
    random = compare(choice[0], choice[2], batch.answer, batch.donor_answer)
    est = {name: {k: bootstrap(v.numpy(), batch.sources) for k, v in m.items()}
           for name, m in (("swap", swap), ("random", random))}
    print({name: {k: str(v) for k, v in e.items()} for name, e in est.items()})
    assert est["swap"]["clean_correct"].mean > 0.8
    assert est["swap"]["donor_answer"].low > 0.5 and est["random"]["donor_answer"].high < 0.2
    assert est["swap"]["donor_margin_shift"].low > 3 * max(est["random"]["donor_margin_shift"].high, 0.5)


@pytest.mark.slow
def test_linmem_probe_writes_a_report(trained, tmp_path):
    """``linmem probe MODEL_DIR`` on the saved toy model (its filler from other text than it was trained on)."""
    setup, docs, _ = trained
    (tmp_path / "texts").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "texts" / f"{i:03d}.txt").write_text(doc.text)
    setup.model.save_pretrained(tmp_path / "model")
    save_tokenizer(setup.tokenizer, tmp_path / "model")
    code = main(["probe", str(tmp_path / "model"), "--out", str(tmp_path / "probe"), "--filler", "32",
                 "--bindings", "2", "--repeats", "2", "--dev-sources", "4", "--confirm-sources", "4",
                 "--loads", "1", "2", "--gaps", "0", "8",
                 "--device", "cpu", "--sources", str(tmp_path / "texts")])
    assert code == 0
    page = (tmp_path / "probe" / "report.html").read_text()
    assert page.count("<img src=\"data:image/png;base64,") >= 10
    payload = json.loads((tmp_path / "probe" / "results.json").read_text())
    assert payload["header"]["confirmed_on_held_out"] is True
    results = payload["experiments"]
    assert {"head_scan", "lifecycle", "four_facts", "sweep_num_bindings", "logit_lens",
            "write_read_spearman", "joint_topk", "overlap", "neutral_suppression"} <= set(results)
    assert all(r["n"] > 0 for r in results["lifecycle"]["rows"])
