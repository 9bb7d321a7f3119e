"""scripts/study/claim_power.py: the power of a study's declared claims under its decision rule (paired t-test, Holm),
simulated, checked against the noncentral t distribution."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.script_modules import load_script, printed

ROOT = Path(__file__).resolve().parents[1]
claim_power = load_script(ROOT / "scripts" / "study" / "claim_power.py", "claim_power")
DRAWS = 4000
# two-sided one-sample t-test, from the noncentral t distribution (scipy.stats.nct, computed once offline):
# n = 8 seeds, alpha 0.05 / 13: power 0.201 at one standard deviation; 80% power at 1.889 deviations (1.157 at 0.05)
NCT_POWER_8_SEEDS_ONE_SD_STRICT = 0.201
NCT_DETECTABLE_8_SEEDS = {0.05: 1.157, 0.05 / 13: 1.889}


def _tolerance(p: float) -> float:
    return 4 * math.sqrt(p * (1 - p) / DRAWS)  # four Monte-Carlo standard errors


def test_without_a_difference_the_test_rejects_at_its_level():
    rng = np.random.default_rng()
    for level in (0.05, 0.01):
        assert claim_power.power(0.0, 8, level, DRAWS, rng) == pytest.approx(level, abs=_tolerance(level))


def test_simulated_power_matches_the_noncentral_t():
    rng = np.random.default_rng()
    found = claim_power.power(1.0, 8, 0.05 / 13, DRAWS, rng)
    assert found == pytest.approx(NCT_POWER_8_SEEDS_ONE_SD_STRICT, abs=_tolerance(0.2))
    for level, expected in NCT_DETECTABLE_8_SEEDS.items():
        assert claim_power.smallest_detectable(8, level, 0.8, DRAWS, rng) == pytest.approx(expected, abs=0.08)
    # more seeds find smaller differences
    assert claim_power.smallest_detectable(16, 0.05 / 13, 0.8, DRAWS, rng) < NCT_DETECTABLE_8_SEEDS[0.05 / 13] - 0.5


def test_differences_pair_the_seeds_both_models_have():
    tables = {"models": {
        "a": {"metrics": {"m": {"seeds": {"0": {"mean": 3.0}, "1": {"mean": 5.0}, "2": {"mean": 4.0}}}}},
        "b": {"metrics": {"m": {"seeds": {"1": {"mean": 1.0}, "2": {"mean": 1.5}, "10": {"mean": 0.0}}}}}}}
    assert claim_power.seed_differences(tables, "a", "b", "m") == [4.0, 2.5]
    assert claim_power.seed_differences(tables, "a", "missing", "m") == []
    assert claim_power.seed_differences(tables, "a", "b", "other") == []


def test_the_report_has_a_row_per_claim_and_says_where_no_record_is(tmp_path):
    text = printed(claim_power.main, str(ROOT / "configs" / "study" / "core-seeds.yaml"),
                   str(ROOT / "docs" / "study" / "rla-paper" / "results.json"), "--seeds", "8", "--draws", "300")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| A |")]
    assert len(rows) == 13 and "Holm over the 13 claimed metrics" in text
    wide = [row for row in rows if row.startswith("| rdn | gdn-wide |")]
    assert len(wide) == 2 and all("no record" in row and row.count("|") == 11 for row in wide)
    rdn = next(row for row in rows if row.startswith("| rdn | gdn | test_ppl |"))
    cells = [c.strip() for c in rdn.strip("|").split("|")]
    assert cells[3] == "3" and float(cells[4]) < 0 and cells[5] == "claim"  # lower perplexity: the claim's side
    assert 0 <= float(cells[7]) <= float(cells[8]) <= 1
    fitting = next(row for row in rows if row.startswith("| rla | rla-no-fitting | train_loss |"))
    assert "| against |" in fitting  # the ablation's training loss was the lower one in rla-paper
    study = yaml.safe_load((ROOT / "configs" / "study" / "clip-norms.yaml").read_text())
    del study["claims"]
    study["recipe"]["include"] = str(ROOT / "configs" / "zoo" / "base.yaml")
    for model in study["models"]:
        model["config"] = str(ROOT / "configs" / "zoo" / Path(model["config"]).name)
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(study))
    with pytest.raises(SystemExit, match="declares no claims"):
        claim_power.main([str(tmp_path / "none.yaml"), str(ROOT / "docs" / "study" / "rla-paper" / "results.json")])
