"""Reports read as a paper's figure captions: the probe's and the demo's report.html carry no Python reprs, every
section heading is followed by its caption, and every component name (``L0H1S``) is spelled out; the head
interaction is judged against the hub's own effect; ``linmem zoo list`` says what each headline number is."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest

from linmem.cli import main
from linmem.data.sources import Document
from linmem.data.tokenizer import save_tokenizer, train_tokenizer, wrap_tokenizer
from linmem.memory.experiments import additivity
from linmem.memory.report import spelled
from tests.test_memory_experiments import KEYS, VALUES, WORDS, tiny
from tests.test_zoo import NAME, shipped  # noqa: F401

REPRS = {"a call with keywords (a dataclass repr)": r"\w+\(\w+=", "None": r"\bNone\b",
         "a Python boolean": r"\bTrue\b|\bFalse\b", "a dict or JSON object": r"\{'|\{\"", "a JSON list": r"\[\""}
COMPONENT = re.compile(r"\bL(\d+)H(\d+)([SR])\b")


def readable_problems(page: str) -> list[str]:
    """What keeps ``page`` from reading as captioned figures: repr patterns, headings without a caption right
    after them, component names never spelled out."""
    text = html.unescape(re.sub(r"data:image/png;base64,[^\"']*", "", page))
    problems = [f"{what}: {m.group(0)!r} in ...{text[max(0, m.start() - 60):m.end() + 20]}..."
                for what, pattern in REPRS.items() for m in re.finditer(pattern, text)]
    for heading in re.finditer(r"<(h[23])>(.*?)</\1>", page):
        if not page[heading.end():].startswith("<p class='caption'>"):
            problems.append(f"no caption after the heading {heading.group(2)!r}")
    for name in sorted({m.group(0) for m in COMPONENT.finditer(text)}):
        if spelled(name) not in text:
            problems.append(f"{name} is never spelled out")
    return problems


@pytest.fixture(scope="module")
def probe_page(tmp_path_factory) -> str:
    """The default protocol of ``linmem probe`` (no sweeps, no extras) on a tiny random RDN: S and R components."""
    root = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(0)
    docs = [Document("toy", f"toy:{i}", " ".join(rng.choice(WORDS, 150))) for i in range(10)]
    facts = [f" The code of {k} is {v}." for k in KEYS for v in VALUES] * 5
    tokenizer = wrap_tokenizer(train_tokenizer([d.text for d in docs] + facts, vocab_size=400))
    (root / "texts").mkdir()
    for i, doc in enumerate(docs):
        (root / "texts" / f"{i:02d}.txt").write_text(doc.text)
    tiny(tokenizer, mixer="rdn").float().save_pretrained(root / "model")
    save_tokenizer(tokenizer, root / "model")
    assert main(["probe", str(root / "model"), "--out", str(root / "out"), "--filler", "24", "--bindings", "2",
                 "--repeats", "2", "--dev-sources", "3", "--confirm-sources", "3", "--device", "cpu", "--no-sweeps",
                 "--no-extras", "--sources", str(root / "texts"), "--min-clean-recall", "0"]) == 0
    return (root / "out" / "report.html").read_text()


def test_probe_report_reads_as_captioned_figures(probe_page):
    assert readable_problems(probe_page) == []
    assert "<h2>Head interaction: do two heads add</h2>" in probe_page and "Verdict: " in probe_page
    assert "TaskSpec" not in probe_page and "each prompt binds 2 keys" in probe_page
    assert "layer 0, head 0, residual memory R" in probe_page  # the head scan ranks every S and R memory


def test_demo_report_reads_as_captioned_figures(shipped, tmp_path):  # noqa: F811
    root, _ = shipped
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--zoo-dir", str(root / "zoo"), "--device", "cpu"]) == 0
    page = (out / "report.html").read_text()
    assert readable_problems(page) == []
    assert "<h2>The model cards' numbers</h2>" in page and "Wilson 95% intervals" in page


def test_interaction_is_judged_against_the_hub_effect():
    hub = {"mean": -2.0}
    small = additivity({"mean": -0.012, "low": -0.02, "high": -0.004}, hub)  # 0.6% of the hub's, CI off zero
    assert small["additive"] and not small["interacting"] and small["interaction_share"] == pytest.approx(-0.006)
    large = additivity({"mean": -0.8, "low": -1.0, "high": -0.6}, hub)
    assert large["interacting"] and not large["additive"]
    wide = additivity({"mean": 0.0, "low": -0.5, "high": 0.5}, hub)
    assert not wide["additive"] and not wide["interacting"]


def test_zoo_list_says_what_each_headline_number_is(shipped, capsys):  # noqa: F811
    root, _ = shipped
    assert main(["zoo", "list", "--zoo-dir", str(root / "zoo")]) == 0
    printed = capsys.readouterr().out
    assert "MQAR 8  MQAR mean  NIAH 256  NIAH mean  lab recall [95% CI]" in printed.splitlines()[0]
    assert "MQAR mean: the mean of the accuracies at 2, 4 pairs" in printed
    assert "NIAH mean: the mean over 64 tokens x 2 depths" in printed
    assert "on the test split of the held-out text" in printed and "8 items from" in printed
