"""The study files' declared claims (``claims:``, linmem.study.definition): every study file in configs/study loads
with valid claims, the studies docs/results.md draws verdicts from declare the paper's claims, no claim rests on a
proxy metric, and the tables kept in docs/study were rebuilt from the claims the files declare now. Fast: no
training, no evaluation, only the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from linmem.study.definition import load_study

ROOT = Path(__file__).resolve().parents[1]
STUDY_FILES = sorted(p for p in (ROOT / "configs" / "study").glob("*.yaml")
                     if "models" in (yaml.safe_load(p.read_text(encoding="utf-8")) or {}))
# the studies whose comparisons docs/results.md gives verdicts on
DECIDING = ("rla-paper", "remember-dictionary", "remember-dictionary-lr", "remember", "core-seeds")
# metrics docs/results.md labels "proxy: X for Y" (or, for `norm`, a post-norm stand-in for Fig. 4a's activations)
PROXIES = ("cloze", "mqar", "norm")
PROXY_PREFIXES = ("mqar@", "test_ppl@")


def _claimed(study) -> set[tuple[str, str, str]]:
    return {(c.a, c.b, metric) for c in study.claims for metric in c.metrics}


def test_every_study_file_is_found():
    assert {p.stem for p in STUDY_FILES} >= set(DECIDING)


@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda p: p.stem)
def test_claims_are_pairs_of_compare_with_known_metrics(path: Path):
    study = load_study(path)  # refuses a claim outside compare, twice claimed, or an unknown metric
    for claim in study.claims:
        assert (claim.a, claim.b) in study.compare
        assert claim.metrics


@pytest.mark.parametrize("name", DECIDING)
def test_studies_results_md_decides_from_declare_claims(name: str):
    assert load_study(ROOT / "configs" / "study" / f"{name}.yaml").claims, (
        f"configs/study/{name}.yaml: docs/results.md draws verdicts from this study, so it must declare its claims")


@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda p: p.stem)
def test_no_claim_rests_on_a_proxy(path: Path):
    proxies = [key for key in _claimed(load_study(path))
               if key[2] in PROXIES or key[2].startswith(PROXY_PREFIXES)]
    assert not proxies, f"{path.name}: claims on proxy metrics {proxies}; a proxy is reported, never decided"


@pytest.mark.parametrize("name", DECIDING)
def test_kept_tables_were_built_from_the_declared_claims(name: str):
    study = load_study(ROOT / "configs" / "study" / f"{name}.yaml")
    tables = json.loads((ROOT / "docs" / "study" / name / "results.json").read_text(encoding="utf-8"))
    in_tables = {(c["a"], c["b"], c["metric"]) for c in tables["comparisons"] if c.get("claim")}
    in_tables |= {(c["a"], c["b"], c["metric"]) for c in tables.get("claims_not_measured", [])}
    assert in_tables == _claimed(study), (
        f"docs/study/{name}/results.json: its claims differ from the study file's; rebuild it with "
        f"`linmem study configs/study/{name}.yaml --out DIR --report-only` and copy DIR/tables here")
