"""The study's decision rule: the paired t-test over seeds, the exact sign-flip test, Holm's correction over the
study's claims, the claims of a study file, and the test bootstrap over documents."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from linmem.data.windows import sequential_window_documents, sequential_window_sources
from linmem.memory.stats import Estimate
from linmem.study.definition import Claim, load_study
from linmem.study.estimates import (
    ALPHA,
    holm,
    item_estimate,
    paired_test,
    sign_flip_p,
    t_critical,
    t_two_sided_p,
)
from linmem.study.tables import Metric, _items, _test_resamples, _verdict, compare, decide, markdown
from tests.test_study import configs, two_models, write_study  # noqa: F401  (fixture)

DRAWS = 4000  # Monte-Carlo draws: the standard error of a 5% rate is 0.34 points


def monte_carlo_slack(rate: float, draws: int = DRAWS) -> float:
    return 3 * math.sqrt(rate * (1 - rate) / draws)


# ---------------------------------------------------------------- the t distribution's tail


@pytest.mark.parametrize("t, df", [(12.706, 1), (4.303, 2), (3.182, 3), (2.776, 4), (2.571, 5), (2.228, 10),
                                   (2.086, 20)])
def test_t_tail_gives_the_tables_five_percent_points(t, df):
    assert t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-4)
    assert t_two_sided_p(-t, df) == t_two_sided_p(t, df)
    assert t_critical(df) == pytest.approx(t, abs=2e-3)


def test_t_tail_at_known_points():
    assert t_two_sided_p(0.0, 3) == 1.0
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-12)  # Cauchy: P(|T| >= 1) = 1/2
    assert t_two_sided_p(math.sqrt(2), 2) == pytest.approx(1 - 1 / math.sqrt(2), abs=1e-12)  # df 2: 1 - t/sqrt(2+t^2)
    assert t_two_sided_p(9.925, 2) == pytest.approx(0.01, abs=1e-4)
    assert t_two_sided_p(1.96, 4000) == pytest.approx(0.05, abs=2e-4)  # close to the normal's
    with pytest.raises(ValueError, match="positive integer"):
        t_two_sided_p(2.0, 2.5)


# ---------------------------------------------------------------- the exact sign-flip test


def test_sign_flip_p_is_exact():
    assert sign_flip_p([0.3, 0.1, 0.2]) == 0.25  # the best two-sided p at 3 seeds: 2 of 8 patterns
    assert sign_flip_p([-0.3, -0.1, -0.2]) == 0.25
    assert sign_flip_p([0.3, -0.1, 0.2]) == 0.5  # |0.4| reached by (+-+), (-+-), (++ +), (---)
    assert sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    assert sign_flip_p(np.arange(1.0, 11.0)) == 2 / 1024
    assert sign_flip_p(np.ones(11)) is None and sign_flip_p([]) is None


# ---------------------------------------------------------------- Holm


@pytest.mark.parametrize("p, adjusted", [
    ([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),
    ([0.01, 0.02, 0.03, 0.04, 0.05], [0.05, 0.08, 0.09, 0.09, 0.09]),
    ([0.4, 0.6], [0.8, 0.8]),
    ([0.3], [0.3]),
    ([float("nan"), 0.01], [1.0, 0.02]),  # a claim not measured counts as p = 1 and still widens the family
    ([], []),
])
def test_holm_on_known_lists(p, adjusted):
    assert holm(p) == pytest.approx(adjusted, abs=1e-12)


# ---------------------------------------------------------------- error rate and power


def decisions(differences: np.ndarray) -> np.ndarray:
    """Whether each row of per-seed differences is decided by the paired t-test at ``ALPHA`` (one claim); the t
    statistics computed at once, each p by ``t_two_sided_p`` (``paired_test`` agrees on the first rows)."""
    n = differences.shape[1]
    t = differences.mean(1) / (differences.std(1, ddof=1) / math.sqrt(n))
    p = np.array([t_two_sided_p(x, n - 1) for x in t])
    assert [paired_test(row).p for row in differences[:50]] == pytest.approx(p[:50], rel=1e-9)
    return p < ALPHA


@pytest.mark.parametrize("seeds", [3, 5, 10])
def test_noise_is_decided_at_most_five_percent_of_the_time(seeds):
    """Pure noise (A and B alike): the rule decides at the test's level, where an interval that excludes zero over
    3 seeds fires in a quarter of the draws."""
    noise = np.random.default_rng(seeds).normal(size=(DRAWS, seeds))
    rate = decisions(noise).mean()
    assert rate <= ALPHA + monte_carlo_slack(ALPHA), rate
    all_one_side = (np.all(noise > 0, axis=1) | np.all(noise < 0, axis=1)).mean()
    assert seeds > 3 or all_one_side > 0.2  # the old rule's floor at 3 seeds: 2 / 2**3


def noncentral_t_power(effect: float, seeds: int, alpha: float = ALPHA) -> float:
    """The paired t-test's power for a true mean ``effect`` (in seed standard deviations): P(|T'| > c) with
    T' = (Z + effect sqrt(n)) / sqrt(V / df), integrated over V ~ chi-square(df) on a geometric grid."""
    df, c, shift = seeds - 1, t_critical(seeds - 1, alpha), effect * math.sqrt(seeds)
    v = np.geomspace(1e-9, df + 60 * math.sqrt(2 * df) + 60, 20_001)  # fine near 0, where df = 2 is largest
    density = np.exp((df / 2 - 1) * np.log(v) - v / 2 - (df / 2) * math.log(2) - math.lgamma(df / 2))
    normal_cdf = np.vectorize(lambda x: 0.5 * math.erfc(-x / math.sqrt(2)))
    bound = c * np.sqrt(v / df)
    power = normal_cdf(-bound + shift) + normal_cdf(-bound - shift)
    return float(np.trapezoid(density * power, v))


@pytest.mark.parametrize("seeds, effect", [(3, 2.0), (5, 1.2), (10, 0.8)])
def test_a_real_shift_is_found_with_the_tests_power(seeds, effect):
    power = noncentral_t_power(effect, seeds)
    assert 0.3 < power < 0.95  # a shift the test finds often but not always
    draws = np.random.default_rng(seeds).normal(effect, 1.0, size=(DRAWS, seeds))
    assert decisions(draws).mean() == pytest.approx(power, abs=monte_carlo_slack(power))
    assert noncentral_t_power(0.0, seeds) == pytest.approx(ALPHA, abs=1e-4)  # the integration's own check


def test_paired_test_reports_t_interval_and_sign_flip():
    test = paired_test([0.9, 1.1, 1.0])
    assert (test.name, test.seeds, test.df) == ("paired t", 3, 2)
    assert test.t == pytest.approx(1.0 / (0.1 / math.sqrt(3)))
    assert test.low == pytest.approx(1.0 - 4.3027 * 0.1 / math.sqrt(3), abs=1e-4)
    assert test.high == pytest.approx(1.0 + 4.3027 * 0.1 / math.sqrt(3), abs=1e-4)
    assert test.sign_flip_p == 0.25
    same = paired_test([0.2, 0.2, 0.2])  # no spread: the exact test decides, and 3 seeds cannot pass it
    assert (same.p, same.t) == (0.25, math.inf)
    assert paired_test([-0.2] * 8).p == pytest.approx(2 / 2**8)
    assert paired_test([0.0, 0.0, 0.0]).p == 1.0
    assert math.isnan(paired_test([0.3]).p)


# ---------------------------------------------------------------- claims and exploratory comparisons


def scalar_metric(name: str, higher: bool = False) -> Metric:
    return Metric(name, name, lambda record, folder: None, higher)


def comparisons_of(claims, differences: dict[tuple[str, str], list[float]], metric_names=("loss", "other")):
    """``compare`` over seed-level values: model B at 0, model A at B + the given per-seed differences."""
    study = SimpleNamespace(compare=list(differences), claims=claims)
    metrics = [scalar_metric(n) for n in metric_names]
    measured = {m.name: {} for m in metrics}
    for (a, b), diffs in differences.items():
        for m in metrics:
            measured[m.name][a] = {s: float(d) for s, d in enumerate(diffs)}
            measured[m.name][b] = {s: 0.0 for s in range(len(diffs))}
    return compare(study, metrics, measured, {})


def test_only_claims_are_decided_and_holm_counts_every_claim():
    strong = [0.50, 0.51, 0.49]  # t(2) = 86.6, p = 1.3e-4
    claims = [Claim("a", "b", ("loss",)), Claim("c", "d", ("loss", "missing"))]
    comparisons, missing = comparisons_of(claims, {("a", "b"): strong, ("c", "d"): [0.1, -0.2, 0.05]})
    by_key = {(c["a"], c["b"], c["metric"]): c for c in comparisons}
    assert missing == [{"a": "c", "b": "d", "metric": "missing"}]
    claimed = by_key[("a", "b", "loss")]
    assert claimed["claim"] and claimed["decided"] and claimed["a_better"] is False  # lower is better: B wins
    assert claimed["holm_p"] == pytest.approx(3 * claimed["test"]["p"], rel=1e-5)  # 3 claims, the not-measured one too
    assert _verdict(claimed) == "b better"
    exploratory = by_key[("a", "b", "other")]  # the same numbers, not claimed
    assert not exploratory["claim"] and not exploratory["decided"] and exploratory["holm_p"] is None
    assert _verdict(exploratory) == "exploratory"
    assert not by_key[("c", "d", "loss")]["decided"] and _verdict(by_key[("c", "d", "loss")]) == "not decided"


def test_holm_family_of_noise_claims_errs_at_most_five_percent():
    """Four claims of pure noise at 3 seeds: the chance that any of them is decided stays at the level."""
    rng, draws, errors = np.random.default_rng(7), 250, 0
    claims = [Claim(f"a{i}", f"b{i}", ("loss",)) for i in range(4)]
    for _ in range(draws):
        comparisons, _ = comparisons_of(claims, {(f"a{i}", f"b{i}"): rng.normal(size=3) for i in range(4)},
                                        ("loss",))
        errors += any(c["decided"] for c in comparisons)
    assert errors / draws <= ALPHA + monte_carlo_slack(ALPHA, draws)


def test_a_claim_needs_enough_seeds_and_the_test_sets_interval():
    interval = Estimate(0.5, 0.2, 0.8, 3, 3)
    assert decide(interval, 0.01, True) == {"decided": True, "a_better": True}
    assert decide(interval, 0.06, True)["decided"] is False
    assert decide(Estimate(0.5, 0.2, 0.8, 2, 2), 0.0, True)["decided"] is False
    holds_zero = {"a": "a", "b": "b", "claim": True, "enough_seeds": True, "holm_p": 0.01,
                  **decide(Estimate(0.5, -0.1, 0.8, 3, 3), 0.01, True)}
    assert _verdict(holds_zero) == "not decided (the test set's interval holds 0)"


def test_markdown_separates_claims_from_exploratory_comparisons():
    comparisons, missing = comparisons_of([Claim("a", "b", ("loss", "missing"))], {("a", "b"): [0.5, 0.51, 0.49]})
    tables = {"study": "s", "description": "", "seeds": [0, 1, 2], "tasks": ["ppl"],
              "eval": {"options": {"max_tokens": 1000, "split": "test"}}, "metrics": {}, "models": {},
              "comparisons": comparisons, "claims_not_measured": missing, "test_resamples": "windows"}
    text = markdown(tables)
    claims, exploratory = text.split("## Claims")[1].split("## Exploratory comparisons")
    assert "| a | b | loss |" in claims and "| paired t(2) = " in claims and "| b better |" in claims
    assert "| a | b | missing | – | 0 |" in claims and "not measured" in claims
    assert "Holm-corrected over the 2 claimed metrics" in claims
    assert "| a | b | other |" in exploratory and "never decided" in exploratory
    assert "resample test windows" in exploratory
    tables.update(comparisons=comparisons_of([], {("a", "b"): [0.5, 0.51, 0.49]})[0], claims_not_measured=[])
    assert "declares no claims" in markdown(tables) and "better" not in markdown(tables)


def test_study_file_claims(dataset, configs, tmp_path):  # noqa: F811  (fixture)
    claims = [{"a": "rla", "b": "gdn", "metrics": ["test_ppl", "mqar@4", "test_ppl@stdlib", "train_loss"]}]
    study = load_study(write_study(tmp_path, dataset, two_models(configs), claims=claims))
    assert study.claims == [Claim("rla", "gdn", ("test_ppl", "mqar@4", "test_ppl@stdlib", "train_loss"))]
    assert load_study(write_study(tmp_path, dataset, two_models(configs))).claims == []


@pytest.mark.parametrize("claims, error", [
    ([{"a": "gdn", "b": "rla", "metrics": ["test_ppl"]}], r"claims\[0\]: \[gdn, rla\] is not in compare"),
    ([{"a": "rla", "b": "gdn", "metrics": ["cloze"]}], r"claims\[0\]\.metrics: 'cloze' not a metric of this study"),
    ([{"a": "rla", "b": "gdn", "metrics": ["mqar@64"]}], r"'mqar@64' not a metric"),
    ([{"a": "rla", "b": "gdn", "metrics": []}], r"claims\[0\]\.metrics must be a non-empty list"),
    ([{"a": "rla", "b": "gdn"}], r"claims\[0\] must be a mapping with a, b and metrics"),
    ([{"a": "rla", "b": "gdn", "metrics": ["norm"]}] * 2, r"claims\[1\]: \[rla, gdn\] is claimed twice"),
    ({"a": "rla"}, r"claims must be a list"),
])
def test_study_file_claim_errors_name_the_claim(dataset, configs, tmp_path, claims, error):  # noqa: F811
    with pytest.raises(ValueError, match=error):
        load_study(write_study(tmp_path, dataset, two_models(configs), claims=claims))


# ---------------------------------------------------------------- the test bootstrap over documents


def test_window_documents_are_the_documents_holding_most_targets():
    entry = {"doc_starts": [0, 7, 15], "doc_lengths": [6, 7, 5], "source_ids": ["s:a", "t:b", "s:c"],
             "sources": [0, 1, 0]}
    split = SimpleNamespace(shards=[np.arange(20)], source_names=["s", "t"], entries=[entry])
    # windows of 5 tokens start at 0, 5, 10, 15; their targets are tokens 1-4, 6-9, 11-14, 16-19
    assert sequential_window_documents(split, 5) == ["s:a", "t:b", "t:b", "s:c"]
    assert sequential_window_sources(split, 5) == ["s", "t", "t", "s"]


def ppl_record(documents: list[str] | None, rng: np.random.Generator) -> dict:
    """A perplexity record of 40 windows in 4 documents: windows of one document share its loss level."""
    level = {d: rng.normal(3.0, 0.5) for d in "abcd"}
    docs = [d for d in "abcd" for _ in range(10)]
    columns = {"unit": [f"w{i}" for i in range(40)], "group": ["all"] * 40,
               "num": [100 * (level[d] + rng.normal(0, 0.01)) for d in docs], "den": [100] * 40}
    if documents is not None:
        columns["document"] = documents
    return {"records": {"ppl": columns}}


def test_test_perplexity_resamples_documents_and_old_records_stay_readable():
    rng = np.random.default_rng(0)
    documents = [d for d in "abcd" for _ in range(10)]
    read = _items("ppl", unit="document")
    new, old = read(ppl_record(documents, rng), None), read(ppl_record(None, rng), None)
    assert new.unit_count == 4 and old.unit_count == 40  # a record without documents resamples its windows
    assert new.value() == pytest.approx(np.mean(ppl_record(documents, np.random.default_rng(0))["records"]["ppl"][
        "num"]) / 100)
    by_document, by_window = item_estimate(new), item_estimate(read(ppl_record(None, np.random.default_rng(0)), None))
    assert by_document.mean == pytest.approx(by_window.mean)
    assert (by_document.high - by_document.low) > 3 * (by_window.high - by_window.low)  # one document, one draw
    with_docs = {"m": {0: ppl_record(documents, rng)}}
    assert _test_resamples(with_docs) == "documents"
    assert _test_resamples({"m": {**with_docs["m"], 1: ppl_record(None, rng)}}) == "windows"
    assert _test_resamples({"m": {0: {"records": {}}}}) is None
