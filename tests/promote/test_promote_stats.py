"""The vectorised bootstrap is exact: each resample's HL equals HL of the expanded resample."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ablate.promote.stats import bootstrap_hl, hl_from_counts, hodges_lehmann, holm, pvalue_at_most


def _expanded_hl(x: np.ndarray, cluster: np.ndarray, counts: np.ndarray) -> float:
    picked = np.concatenate([x[cluster == c] for c in range(counts.size) for _ in range(counts[c])])
    return hodges_lehmann(picked)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-50, 50), min_size=1, max_size=14), st.integers(1, 14), st.integers(0, 2**31))
def test_weighted_median_equals_brute_force(values: list[int], num_clusters: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = np.asarray(values, dtype=float) / 10  # ties are common: the median must still be exact
    k = min(num_clusters, x.size)
    cluster = np.sort(rng.integers(0, k, size=x.size))
    _, cluster = np.unique(cluster, return_inverse=True)
    k = int(cluster.max()) + 1
    counts = rng.multinomial(k, np.full(k, 1 / k), size=40)  # > 2 x distinct vectors for small k: dedup path
    got = hl_from_counts(x, cluster, counts)
    want = [_expanded_hl(x, cluster, row) for row in counts]
    np.testing.assert_allclose(got, want)


def test_hodges_lehmann_is_median_of_walsh_averages() -> None:
    # Walsh averages of (1, 2, 9): 1, 1.5, 2, 5, 5.5, 9 -> median 3.5 (the plain median would be 2).
    assert hodges_lehmann([1.0, 2.0, 9.0]) == 3.5
    assert math.isclose(hodges_lehmann([0.0, 10.0]), 5.0)


def test_cluster_bootstrap_is_wider_than_block_bootstrap_under_host_noise() -> None:
    # Host-correlated candidate effects: resampling hosts must show that uncertainty, resampling blocks hides it.
    rng = np.random.default_rng(0)
    hosts = np.repeat(np.arange(3), 8)
    x = np.array([-0.02, 0.0, 0.03])[hosts] + rng.normal(0, 0.002, hosts.size)
    by_host = bootstrap_hl(x, hosts, 2000, np.random.default_rng(1))
    by_block = bootstrap_hl(x, None, 2000, np.random.default_rng(1))
    width = lambda t: np.quantile(t, 0.975) - np.quantile(t, 0.025)  # noqa: E731
    assert width(by_host) > 1.8 * width(by_block)


def test_holm_matches_step_down_definition() -> None:
    p = [0.01, 0.04, 0.03, 0.005]
    adjusted, levels = holm(p, 0.05)
    np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02])
    # The step-down stops at 0.03 (x2 > 0.05): 0.04, never reached, is read at that stop's level, not at 0.05 / 1.
    np.testing.assert_allclose(levels, [0.05 / 3, 0.05 / 2, 0.05 / 2, 0.05 / 4])
    # So a test's raw p clears its own level exactly when its adjusted p clears alpha: the lower bound read at
    # that level never contradicts the verdict.
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = rng.uniform(0, 0.1, size=int(rng.integers(1, 8)))
        adjusted, levels = holm(p, 0.05)
        assert ((p <= levels) == (adjusted <= 0.05)).all(), (p, adjusted, levels)


def test_pvalue_counts_resamples_at_or_below_the_null() -> None:
    theta = np.array([0.01, 0.02, 0.03, 0.04])
    assert pvalue_at_most(theta, 0.025) == (1 + 2) / 5
    assert pvalue_at_most(theta, 0.0) == 1 / 5


def _pairs(x: np.ndarray, cluster: np.ndarray):
    from ablate.promote.stats import _SortedPairs

    return _SortedPairs(np.asarray(x, dtype=float), np.asarray(cluster))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-30, 30), min_size=1, max_size=16), st.integers(1, 16), st.integers(0, 2**31))
def test_ladder_bisection_selects_what_the_cumulative_sum_selects(values: list[int], num_clusters: int,
                                                                  seed: int) -> None:
    from ablate.promote.stats import _hl_by_cumsum, _hl_by_ladder

    rng = np.random.default_rng(seed)
    x = np.asarray(values, dtype=float) / 10  # ties, and all-equal samples, are common here
    k = min(num_clusters, x.size)
    _, cluster = np.unique(rng.integers(0, k, size=x.size), return_inverse=True)
    k = int(cluster.max()) + 1
    counts = rng.multinomial(k, np.full(k, 1 / k), size=int(rng.integers(1, 300)))
    ladder = _hl_by_ladder(_pairs(x, cluster), counts)
    # Both pick the same Walsh average out of the same array: equal to the bit, not within a tolerance.
    assert np.array_equal(ladder, _hl_by_cumsum(_pairs(x, cluster), counts))
    np.testing.assert_allclose(ladder[:20], [_expanded_hl(x, cluster, row) for row in counts[:20]])


def test_a_large_block_bootstrap_takes_the_ladder_and_gives_the_same_distribution() -> None:
    from ablate.promote.stats import _hl_by_cumsum, _hl_chunks

    rng = np.random.default_rng(7)
    x = np.round(rng.normal(0.03, 0.02, 120), 4)  # rounded: ties between Walsh averages
    counts = rng.multinomial(x.size, np.full(x.size, 1 / x.size), size=3000)
    pairs = _pairs(x, np.arange(x.size))
    got = _hl_chunks(pairs, counts)
    assert pairs._ladder is not None, "120 blocks x 3,000 resamples should bisect, not sum every pair"
    assert np.array_equal(got, _hl_by_cumsum(_pairs(x, np.arange(x.size)), counts))


def test_ladder_weights_switch_to_int64_when_a_resample_is_huge() -> None:
    from ablate.promote.stats import _hl_by_cumsum, _hl_by_ladder

    # 50,001 draws: doubled weights pass 2**31, so int32 would wrap and pick a wrong average.
    x, cluster = np.array([0.1, 0.5, 0.2]), np.arange(3)
    counts = np.array([[50_000, 0, 1], [1, 50_000, 0], [0, 25_000, 25_001]])
    got = _hl_by_ladder(_pairs(x, cluster), counts)
    assert np.array_equal(got, _hl_by_cumsum(_pairs(x, cluster), counts))
    assert got[0] == 0.1 and got[1] == 0.5


def test_host_level_t_is_students_t_on_the_host_means() -> None:
    from scipy.stats import ttest_1samp

    from ablate.promote.stats import host_level_t

    hosts = ["a", "a", "b", "b", "c", "c"]
    x = np.array([0.030, 0.032, 0.061, 0.059, 0.020, 0.022])
    p, t, means = host_level_t(x, hosts, 0.01)
    ref = ttest_1samp([0.031, 0.060, 0.021], 0.01, alternative="greater")
    assert means == pytest.approx([0.031, 0.060, 0.021])
    assert t == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue)
    assert host_level_t(x, ["a"] * 6, 0.01)[0] != host_level_t(x, ["a"] * 6, 0.01)[0]  # one host: NaN, no claim


def test_host_level_t_never_takes_coinciding_host_means_as_certain() -> None:
    from ablate.promote.stats import host_level_t

    # Three hosts whose means coincide at +2% while their blocks spread +-5%: the spread of the means (0) is not
    # the uncertainty of the mean host; the blocks' own spread floors it.
    x = np.array([-0.03, 0.07, 0.07, -0.03, 0.02, 0.02, -0.03, 0.07])
    hosts = ["a", "a", "b", "b", "c", "c", "c", "c"]
    p, _, means = host_level_t(x, hosts, 0.01)
    assert np.allclose(means, 0.02) and 0.2 < p < 0.5
    # Deterministic twins (no spread at all) are decided by where they sit.
    assert host_level_t(np.full(6, 0.02), hosts[:6], 0.01)[0] == 0.0
    assert host_level_t(np.full(6, 0.005), hosts[:6], 0.01)[0] == 1.0


def test_many_hosts_never_build_the_category_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """~100 hosts x 700 blocks made a 10 GB (categories x pairs) table: past its cap another exact method runs."""
    from ablate.promote import stats

    rng = np.random.default_rng(4)
    x = rng.integers(-20, 20, size=30).astype(float) / 10
    cluster = np.arange(30) % 10
    counts = rng.multinomial(10, np.full(10, 0.1), size=12)
    want = [_expanded_hl(x, cluster, row) for row in counts]
    np.testing.assert_allclose(hl_from_counts(x, cluster, counts), want)  # categories: within the cap

    def refused(*_: object) -> None:
        raise AssertionError("the category table was built past its cap")

    monkeypatch.setattr(stats, "_CATEGORY_MAX_ELEMENTS", 1000)
    monkeypatch.setattr(stats, "_hl_by_categories", refused)
    np.testing.assert_allclose(hl_from_counts(x, cluster, counts), want)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(1, 12), st.integers(0, 2**31), st.booleans())
def test_a_curves_points_at_once_are_each_points_bootstrap(blocks: int, hosts: int, points: int, seed: int,
                                                          small_groups: bool) -> None:
    """``hl_curve_with_bootstrap`` gives, point for point and to the bit, what ``hl_with_bootstrap`` gives called
    once per point on one generator: the same HL, the same draws, the same resample medians; with few clusters
    (points bisected together, also in groups a small table cap forces), with many (the point-by-point fallback),
    with ties between Walsh averages, and per block (a cluster each)."""
    from ablate.promote import stats

    rng = np.random.default_rng(seed)
    base = np.round(rng.normal(0.03, 0.02, blocks), 3)  # rounded: ties between Walsh averages
    curve = [np.round(base + rng.normal(0, 0.01, blocks) * i, 3) for i in range(points)]
    cluster = stats.cluster_codes(rng.integers(0, hosts, size=blocks) if hosts > 1 else None, blocks)
    resamples = int(rng.integers(20, 400))
    draws = np.random.default_rng(seed + 1)
    want = [stats.hl_with_bootstrap(x, cluster, resamples, draws) for x in curve]
    cap = stats._CATEGORY_MAX_ELEMENTS
    try:
        if small_groups:  # room for about one point's table at a time
            stats._CATEGORY_MAX_ELEMENTS = max(1, (2 * 8 + 28) * blocks * (blocks + 1) // 2)
        got = stats.hl_curve_with_bootstrap(curve, cluster, resamples, np.random.default_rng(seed + 1))
    finally:
        stats._CATEGORY_MAX_ELEMENTS = cap
    assert len(got) == len(want)
    for (hl, theta), (hl_want, theta_want) in zip(got, want):
        assert hl == hl_want and np.array_equal(theta, theta_want)


def test_a_curve_with_few_hosts_bisects_its_points_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four hosts, 26 points of 72 blocks (the 10,000-receipt campaign's curves): one bisection for all of them,
    never one per point, and still each point's own numbers."""
    from ablate.promote import stats

    rng = np.random.default_rng(3)
    base = rng.normal(0.03, 0.02, 72)
    curve = [base + rng.normal(0, 0.005, 72) * i for i in range(26)]
    cluster = np.repeat(np.arange(4), 18)
    draws = np.random.default_rng(8)
    want = [stats.hl_with_bootstrap(x, cluster, 400, draws) for x in curve]
    calls: list[int] = []
    together = stats._categories_together
    monkeypatch.setattr(stats, "_categories_together", lambda v, *a: calls.append(len(v)) or together(v, *a))
    monkeypatch.setattr(stats, "_hl_chunks", None)  # the point-by-point fallback must not run
    got = stats.hl_curve_with_bootstrap(curve, cluster, 400, np.random.default_rng(8))
    assert calls == [26]
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(got, want))


def test_a_curve_over_many_hosts_takes_each_points_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty hosts: C(39, 20) distinct resamples, far more than are drawn, so nothing repeats to share; each point
    goes through ``_hl_chunks`` as ``hl_with_bootstrap`` would, never the bisection together, with the same
    numbers."""
    from ablate.promote import stats

    rng = np.random.default_rng(11)
    curve = [np.round(rng.normal(0.03, 0.02, 60), 3) for _ in range(5)]
    cluster = np.arange(60) % 20
    draws = np.random.default_rng(2)
    want = [stats.hl_with_bootstrap(x, cluster, 400, draws) for x in curve]
    monkeypatch.setattr(stats, "_categories_together", None)
    got = stats.hl_curve_with_bootstrap(curve, cluster, 400, np.random.default_rng(2))
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(got, want))
