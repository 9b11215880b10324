"""Statistics of the promotion rule: Hodges-Lehmann, its clustered bootstrap, Holm, Fisher, a host-level t-test.

How to use: ``theta = bootstrap_hl(log_ratios, clusters=hosts, resamples=10_000, rng=rng)`` returns the
bootstrap distribution of the one-sample Hodges-Lehmann estimate (median of Walsh averages), resampling whole
clusters (hosts) with replacement, or single blocks when ``clusters`` is None.

Why it is fast: a bootstrap resample never needs its own Walsh averages. Resampling only changes how often each
original pair (i <= j) appears: ``c_i * c_j`` times for i < j and ``c_i (c_i + 1) / 2`` times for i = j, where
``c`` counts how often each block was drawn. So the Walsh averages are sorted once, and each resample's HL is a
weighted median over that fixed sorted array. With host clusters the weight of a pair depends only on its
(host, host) category, so the cumulative weight at any sorted position is ``W_b . Cum[:, p]`` (resample weights
per category times per-category cumulative pair counts) and the median position is found by a vectorised
bisection: O(B x categories x log P) instead of O(B x P). Block bootstraps with many blocks bisect over the
distinct Walsh averages instead (``_Ladder``): the weight at or below a value is a sum over the n blocks, so a
resample costs O(n log P) instead of the O(P) = O(n^2) of a cumulative sum over every pair; small ones keep that
cumulative sum. Every path selects the same Walsh average, so all give bit-identical results.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Optional, Sequence

import numpy as np

_CUMSUM_CHUNK_ELEMENTS = 65_536
"""Rows of the B x P weight matrix are processed in cache-sized chunks (measured: 6x faster than 2M-element ones)."""
_CATEGORY_CHUNK_ELEMENTS = 2_000_000
_CATEGORY_MAX_ELEMENTS = 16_000_000
"""Largest (categories x pairs) table of cumulative counts the category method builds (128 MB); beyond it, the
ladder or the cumulative sum (found in review)."""
_LADDER_CHUNK_ROWS = 256
_LADDER_CHUNK_ELEMENTS = 65_536
"""Resamples bisected together: at least 256, and as many as keep a (rows x blocks) gather near 64k elements, which
stays in cache: 2,000 resamples of 72 blocks 42 -> 33 ms, of 24 blocks 12 -> 8 ms, 250 blocks as before (median of 5,
interleaved; 1,024 rows of 250 blocks measured slower)."""
_LADDER_MAX_ELEMENTS = 8_000_000
"""Largest ladder (distinct averages x blocks) built: 32 MB of int32 (and 64 MB more while it is counted), ~250
blocks; beyond it the cumulative sum, as before (n=250, 10,000 resamples: 0.3 s against 5.8 s)."""


def walsh_averages(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (x_i + x_j) / 2 for i <= j, with their indices."""
    i, j = np.triu_indices(len(x))
    return (x[i] + x[j]) * 0.5, i, j


def hodges_lehmann(x: Sequence[float] | np.ndarray) -> float:
    """One-sample HL estimate: the median of Walsh averages (the typical per-block effect)."""
    arr = np.asarray(x, dtype=float)
    if arr.size == 0:
        return math.nan
    values, _, _ = walsh_averages(arr)
    return float(np.median(values))


class _SortedPairs:
    """Walsh averages sorted once, with the cluster of each pair's two members."""

    def __init__(self, x: np.ndarray, cluster: np.ndarray) -> None:
        values, i, j = walsh_averages(x)
        order = np.argsort(values, kind="stable")
        self.values = values[order]
        self.ci = cluster[i[order]]
        self.cj = cluster[j[order]]
        self.diag = i[order] == j[order]
        self.num_clusters = int(cluster.max()) + 1
        self.cluster_sizes = np.bincount(cluster, minlength=self.num_clusters)
        self._x, self._cluster = x, cluster
        self._ladder: Optional[_Ladder] = None

    @property
    def size(self) -> int:
        return int(self.values.size)

    def ladder(self) -> "_Ladder":
        if self._ladder is None:
            self._ladder = _Ladder(self._x, self._cluster, self.values)
        return self._ladder


class _Ladder:
    """The distinct Walsh averages, and for each of them how many partners of every block average at or below it.

    With blocks sorted by value, the averages of block i with its partners, ``(x_i + x_j) / 2`` over j, are
    non-decreasing in j; so the (ordered) pairs at or below a value v number ``below[v, i]`` for block i, and a
    resample's doubled weight at or below v is ``sum_i c_i * C[below[v, i]] + C[self_below[v]]`` (``c``: how often
    each sorted block was drawn, ``C``: its prefix sums; the second term adds each block's pair with itself once
    more, as ``c (c + 1) / 2`` counts it). Every average is the same float ``walsh_averages`` computes (the same
    expression; addition commutes), so the counts are exact, ties included.
    """

    def __init__(self, x: np.ndarray, cluster: np.ndarray, sorted_values: np.ndarray) -> None:
        order = np.argsort(x, kind="stable")
        xs = x[order]
        n = xs.size
        self.block_cluster = cluster[order]
        distinct = np.empty(sorted_values.size, dtype=bool)
        distinct[:1] = True
        np.not_equal(sorted_values[1:], sorted_values[:-1], out=distinct[1:])
        self.values = sorted_values[distinct]
        grid = (xs[:, None] + xs[None, :]) * 0.5
        # Count each ordered pair at its own distinct value, then accumulate over the values: below[v, i].
        where = np.searchsorted(self.values, grid, side="left") * n + np.arange(n)[:, None]
        hits = np.bincount(where.ravel(), minlength=self.values.size * n).reshape(self.values.size, n)
        self.below = np.cumsum(hits, axis=0, dtype=np.int32)
        self.self_below = np.searchsorted(np.diagonal(grid), self.values, side="right").astype(np.int32)

    @staticmethod
    def fits(pairs: _SortedPairs) -> bool:
        return pairs.size * int(pairs.cluster_sizes.sum()) <= _LADDER_MAX_ELEMENTS


def _median_positions(total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # 0-based ranks of the two middle elements of a multiset of size N (equal when N is odd).
    return (total - 1) // 2, total // 2


def _hl_by_categories(pairs: _SortedPairs, counts: np.ndarray) -> np.ndarray:
    """Weighted medians via per-category cumulative counts and bisection (cheap when categories are few)."""
    k = pairs.num_clusters
    lo_c, hi_c = np.minimum(pairs.ci, pairs.cj), np.maximum(pairs.ci, pairs.cj)
    # Category of a pair: (low cluster, high cluster, is the block paired with itself).
    codes = (lo_c * k + hi_c) * 2 + pairs.diag
    categories, inverse = np.unique(codes, return_inverse=True)
    cat_lo, cat_hi, cat_diag = (categories // 2) // k, (categories // 2) % k, (categories % 2).astype(bool)
    cum = np.zeros((categories.size, pairs.size), dtype=np.float64)
    cum[inverse, np.arange(pairs.size)] = 1.0
    np.cumsum(cum, axis=1, out=cum)
    ca, cb = counts[:, cat_lo].astype(np.float64), counts[:, cat_hi].astype(np.float64)
    weights = np.where(cat_diag, ca * (ca + 1.0) * 0.5, ca * cb)  # (B, categories)
    total = weights @ cum[:, -1]
    out = np.zeros(counts.shape[0])
    for rank in _median_positions(np.rint(total).astype(np.int64)):
        # Smallest sorted position whose cumulative weight exceeds the rank (vectorised bisection).
        lo = np.zeros(counts.shape[0], dtype=np.int64)
        hi = np.full(counts.shape[0], pairs.size - 1, dtype=np.int64)
        for _ in range(int(math.ceil(math.log2(max(pairs.size, 2)))) + 1):
            mid = (lo + hi) // 2
            above = np.einsum("bc,cb->b", weights, cum[:, mid]) > rank
            hi = np.where(above, mid, hi)
            lo = np.where(above, lo, np.minimum(mid + 1, hi))
        out += pairs.values[hi] * 0.5
    return out


def _hl_by_cumsum(pairs: _SortedPairs, counts: np.ndarray) -> np.ndarray:
    """Weighted medians via a per-resample cumulative sum over all pairs (block bootstrap, many clusters)."""
    rows = counts.shape[0]
    # int32 halves memory traffic (this path is bandwidth-bound); fall back to int64 if the offsets could overflow.
    most = int((counts @ pairs.cluster_sizes).max())  # blocks in the largest resample
    stride = most * (most + 1) // 2 + 1
    dtype = np.int32 if stride * rows < np.iinfo(np.int32).max else np.int64
    counts = counts.astype(dtype, copy=False)
    ca, cb = counts[:, pairs.ci], counts[:, pairs.cj]
    weights = ca * cb
    weights[:, pairs.diag] = (weights[:, pairs.diag] + ca[:, pairs.diag]) // 2
    np.cumsum(weights, axis=1, out=weights)
    total = weights[:, -1].copy()
    # Offsetting each row by more than any row's total makes the flattened array sorted, so one searchsorted
    # call finds every row's median position.
    offsets = np.arange(rows, dtype=dtype) * dtype(stride)
    weights += offsets[:, None]
    flat = weights.ravel()
    out = np.zeros(rows)
    for rank in _median_positions(total):
        position = np.searchsorted(flat, rank + offsets, side="right") - np.arange(rows) * pairs.size
        out += pairs.values[position] * 0.5
    return out


def _doubled_weight_below(c: np.ndarray, prefix: np.ndarray, ladder: _Ladder, at: np.ndarray) -> np.ndarray:
    rows = np.arange(c.shape[0])
    return (c * prefix[rows[:, None], ladder.below[at]]).sum(axis=1) + prefix[rows, ladder.self_below[at]]


def _first_above(c: np.ndarray, prefix: np.ndarray, ladder: _Ladder, lo: np.ndarray, doubled_rank: np.ndarray
                 ) -> np.ndarray:
    """Per row, the smallest distinct-value index >= lo whose weight at or below it exceeds the rank."""
    hi = np.full(lo.size, ladder.values.size - 1, dtype=np.intp)
    for _ in range(int(math.ceil(math.log2(max(ladder.values.size, 2)))) + 1):
        mid = (lo + hi) // 2
        above = _doubled_weight_below(c, prefix, ladder, mid) > doubled_rank
        hi = np.where(above, mid, hi)
        lo = np.where(above, lo, np.minimum(mid + 1, hi))
    return hi


def _hl_by_ladder(pairs: _SortedPairs, counts: np.ndarray) -> np.ndarray:
    """Weighted medians by bisection over the distinct Walsh averages (block bootstrap, many blocks)."""
    ladder = pairs.ladder()
    out = np.zeros(counts.shape[0])
    rows = max(_LADDER_CHUNK_ROWS, _LADDER_CHUNK_ELEMENTS // max(1, ladder.block_cluster.size))
    for start in range(0, counts.shape[0], rows):
        c = counts[start:start + rows][:, ladder.block_cluster]
        most = int(c.sum(axis=1).max())
        # Doubled weights reach most * (most + 1): int32 while that fits (faster gathers), else int64.
        c = c.astype(np.int32 if most * (most + 1) < np.iinfo(np.int32).max else np.int64)
        prefix = np.zeros((c.shape[0], c.shape[1] + 1), dtype=c.dtype)
        np.cumsum(c, axis=1, out=prefix[:, 1:])
        total = prefix[:, -1].astype(np.int64)
        lower, upper = _median_positions(total * (total + 1) // 2)
        first = _first_above(c, prefix, ladder, np.zeros(c.shape[0], dtype=np.intp), 2 * lower)
        second = first.copy()
        # The upper middle shares the lower one's value unless that value's weight stops at or below its rank.
        differ = np.flatnonzero(upper != lower)
        if differ.size:
            moves = differ[_doubled_weight_below(c[differ], prefix[differ], ladder, first[differ])
                           <= 2 * upper[differ]]
            if moves.size:
                second[moves] = _first_above(c[moves], prefix[moves], ladder,
                                             np.minimum(first[moves] + 1, ladder.values.size - 1), 2 * upper[moves])
        out[start:start + c.shape[0]] = ladder.values[first] * 0.5 + ladder.values[second] * 0.5
    return out


def hl_from_counts(x: np.ndarray, cluster: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """HL of each resample given how often each cluster was drawn (rows of ``counts``); exposed for tests."""
    pairs = _SortedPairs(np.asarray(x, dtype=float), np.asarray(cluster))
    return _hl_chunks(pairs, np.asarray(counts, dtype=np.int64))


def _hl_chunks(pairs: _SortedPairs, counts: np.ndarray) -> np.ndarray:
    k = pairs.num_clusters
    # With few clusters most resamples repeat: 4 hosts have only C(7, 4) = 35 distinct count vectors, so
    # computing each distinct resample once and broadcasting is exact and far cheaper than B medians.
    if math.comb(2 * k - 1, k) < counts.shape[0] // 2:
        # One integer per count vector (base k + 1 digits) keeps np.unique one-dimensional and fast.
        codes = counts.astype(np.int64) @ ((k + 1) ** np.arange(k, dtype=np.int64))
        _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        if first.size < counts.shape[0]:
            return _hl_chunks(pairs, counts[first])[inverse.ravel()]
    if _categories_pay(k, pairs.size):
        return _in_chunks(_hl_by_categories, pairs, counts, max(1, _CATEGORY_CHUNK_ELEMENTS // _num_categories(k)))
    steps = math.log2(max(pairs.size, 2)) + 1
    blocks = int(pairs.cluster_sizes.sum())
    # Per resample: the cumulative sum touches every pair, the ladder ~2 gathers per block and bisection step
    # (measured ~2x a summed element each); building the ladder costs about one summed element per (distinct
    # average, block) (benchmarks/results/bootstrap.json: 28 ms for 250 blocks, where 400 cumulative sums took 208).
    ladder_cost = counts.shape[0] * 2 * blocks * steps + pairs.size * blocks
    if ladder_cost < counts.shape[0] * pairs.size and _Ladder.fits(pairs):
        return _hl_by_ladder(pairs, counts)
    return _in_chunks(_hl_by_cumsum, pairs, counts, max(1, _CUMSUM_CHUNK_ELEMENTS // pairs.size))


def _num_categories(k: int) -> int:
    return 2 * k + k * (k - 1) // 2


def _categories_pay(k: int, size: int) -> bool:
    """Whether the category bisection is the cheaper exact method for ``k`` clusters over ``size`` pairs, and its
    (categories x pairs) table fits: ~100 hosts and 700 blocks would be 10 GB of it."""
    return (_num_categories(k) * 2 * (math.log2(max(size, 2)) + 1) < 6 * size
            and _num_categories(k) * size <= _CATEGORY_MAX_ELEMENTS)


def _in_chunks(method: Callable[[_SortedPairs, np.ndarray], np.ndarray], pairs: _SortedPairs, counts: np.ndarray,
               chunk: int) -> np.ndarray:
    parts = [method(pairs, counts[start:start + chunk]) for start in range(0, counts.shape[0], chunk)]
    return np.concatenate(parts) if parts else np.zeros(0)


def cluster_codes(clusters: Optional[Sequence[object]], size: int) -> np.ndarray:
    """Each block's resampling unit as 0..k-1: its cluster's rank among the labels (as text), or, if None, itself."""
    if clusters is None:
        return np.arange(size)
    _, cluster = np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)
    return cluster.reshape(-1)


def bootstrap_hl(x: Sequence[float] | np.ndarray, clusters: Optional[Sequence[object]], resamples: int,
                 rng: np.random.Generator) -> np.ndarray:
    """Bootstrap distribution (length ``resamples``) of HL(x), resampling clusters or, if None, blocks."""
    arr = np.asarray(x, dtype=float)
    if arr.size == 0:
        return np.full(resamples, math.nan)
    return _bootstrap_pairs(_SortedPairs(arr, cluster_codes(clusters, arr.size)), resamples, rng)


def hl_with_bootstrap(x: np.ndarray, cluster: np.ndarray, resamples: int, rng: np.random.Generator
                      ) -> tuple[float, np.ndarray]:
    """``(hodges_lehmann(x), bootstrap_hl(x, clusters, resamples, rng))`` (``cluster``: ``cluster_codes`` of the
    clusters), the same numbers from one sort of the Walsh averages; ``x`` must not be empty."""
    pairs = _SortedPairs(np.asarray(x, dtype=float), cluster)
    return float(np.median(pairs.values)), _bootstrap_pairs(pairs, resamples, rng)


def hl_curve_with_bootstrap(points: Sequence[np.ndarray], cluster: np.ndarray, resamples: int,
                            rng: np.random.Generator) -> list[tuple[float, np.ndarray]]:
    """``[hl_with_bootstrap(x, cluster, resamples, rng) for x in points]`` (points of equal length): the same numbers,
    from the same draws (one ``multinomial`` call draws what one call per point draws, in order). Every point shares
    the clusters, so with few of them the distinct resamples are found once and the medians of every point are
    bisected together: over 10,000 receipts the curves' 26 points each, one small bisection per point, were a third
    of the analysis."""
    if not points:
        return []
    x = np.stack([np.asarray(p, dtype=float) for p in points])
    k = int(cluster.max()) + 1
    counts = rng.multinomial(k, np.full(k, 1.0 / k), size=resamples * len(x)).reshape(len(x), resamples, k)
    size = x.shape[1] * (x.shape[1] + 1) // 2
    # The cases where _hl_chunks would find each point's distinct resamples and bisect them by category.
    if math.comb(2 * k - 1, k) >= resamples // 2 or not _categories_pay(k, size):
        pairs = [_SortedPairs(row, cluster) for row in x]  # what hl_with_bootstrap does once it has drawn
        return [(float(np.median(p.values)), _hl_chunks(p, c)) for p, c in zip(pairs, counts)]
    codes = counts.astype(np.int64) @ ((k + 1) ** np.arange(k, dtype=np.int64))  # few clusters: no overflow
    _, first, inverse = np.unique(codes.ravel(), return_index=True, return_inverse=True)
    distinct = counts.reshape(-1, k)[first]
    i, j = np.triu_indices(x.shape[1])
    values = (x[:, i] + x[:, j]) * 0.5  # walsh_averages of every point
    order = np.argsort(values, axis=1, kind="stable")
    values = np.take_along_axis(values, order, axis=1)
    lo_c, hi_c = np.minimum(cluster[i], cluster[j]), np.maximum(cluster[i], cluster[j])
    pair_codes = ((lo_c * k + hi_c) * 2 + (i == j))[order]  # each sorted pair's category code, per point
    hl = np.empty((len(x), distinct.shape[0]))
    per_group = max(1, _CATEGORY_MAX_ELEMENTS // (_num_categories(k) * size))
    for start in range(0, len(x), per_group):
        part = slice(start, start + per_group)
        hl[part] = _categories_together(values[part], pair_codes[part], k, distinct)
    inverse = inverse.reshape(len(x), resamples)
    return [(float(np.median(v)), hl[p][inverse[p]]) for p, v in enumerate(values)]


def _categories_together(values: np.ndarray, codes: np.ndarray, k: int, counts: np.ndarray) -> np.ndarray:
    """``_hl_by_categories`` of the resamples ``counts`` at each point (rows of ``values``: its sorted Walsh averages,
    of ``codes``: their pairs' categories), the points' bisections run together. Weights, counts and cumulative
    weights are integers, so each median selects the Walsh average ``_hl_by_categories`` selects."""
    points, size = values.shape
    categories = np.unique(codes[0])  # the same pairs in another order: the same categories at every point
    cat_lo, cat_hi, cat_diag = (categories // 2) // k, (categories // 2) % k, (categories % 2).astype(bool)
    cum = np.zeros((points, categories.size, size), dtype=np.int32)
    cum[np.arange(points)[:, None], np.searchsorted(categories, codes), np.arange(size)[None, :]] = 1
    np.cumsum(cum, axis=2, out=cum)
    ca, cb = counts[:, cat_lo].astype(np.int64), counts[:, cat_hi].astype(np.int64)
    weights = np.where(cat_diag, ca * (ca + 1) // 2, ca * cb)  # (resamples, categories)
    rows = np.arange(points)[:, None]
    out = np.zeros((points, counts.shape[0]))
    for rank in _median_positions(weights @ cum[0, :, -1].astype(np.int64)):
        lo = np.zeros((points, counts.shape[0]), dtype=np.int64)
        hi = np.full((points, counts.shape[0]), size - 1, dtype=np.int64)
        for _ in range(int(math.ceil(math.log2(max(size, 2)))) + 1):
            mid = (lo + hi) // 2
            above = (cum[rows, :, mid] * weights).sum(axis=2) > rank  # cum[rows, :, mid]: (points, resamples, cats)
            hi = np.where(above, mid, hi)
            lo = np.where(above, lo, np.minimum(mid + 1, hi))
        out += values[rows, hi] * 0.5
    return out


def _bootstrap_pairs(pairs: _SortedPairs, resamples: int, rng: np.random.Generator) -> np.ndarray:
    k = pairs.num_clusters
    counts = rng.multinomial(k, np.full(k, 1.0 / k), size=resamples)
    return _hl_chunks(pairs, counts)


def pvalue_at_most(theta: np.ndarray, null: float) -> float:
    """Percentile-bootstrap p-value of H0: effect <= null (small when nearly every resample lies above it)."""
    finite = theta[np.isfinite(theta)]
    if finite.size == 0:
        return 1.0
    return float((1 + np.count_nonzero(finite <= null)) / (finite.size + 1))


def quantile(theta: np.ndarray, q: float) -> float:
    finite = theta[np.isfinite(theta)]
    return float(np.quantile(finite, q)) if finite.size else math.nan


def quantiles(theta: np.ndarray, qs: Sequence[float]) -> list[float]:
    """``[quantile(theta, q) for q in qs]`` from one pass over ``theta``."""
    finite = theta[np.isfinite(theta)]
    return [float(v) for v in np.quantile(finite, qs)] if finite.size else [math.nan] * len(qs)


def holm(pvalues: Sequence[float], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Holm step-down: adjusted p-values and each test's own level alpha / (m - rank).

    A test is rejected (here: promoted past the lower-bound clause) iff its adjusted p <= alpha; the per-test
    level is what its Holm-adjusted one-sided lower bound is read at. Once the step-down stops at a rank, every
    later rank keeps that rank's level: read at its own, looser level, a test the step-down never reached showed a
    lower bound above 1 + delta beside a "tie" verdict (found in review).
    """
    p = np.asarray(pvalues, dtype=float)
    m = p.size
    if m == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(p, kind="stable")
    factors = m - np.arange(m)
    adjusted_sorted = np.minimum(np.maximum.accumulate(factors * p[order]), 1.0)
    adjusted, levels = np.empty(m), np.empty(m)
    adjusted[order] = adjusted_sorted
    sorted_levels = alpha / factors
    stopped = np.flatnonzero(factors * p[order] > alpha)
    if stopped.size:
        sorted_levels[stopped[0]:] = sorted_levels[stopped[0]]
    levels[order] = sorted_levels
    return adjusted, levels


def fisher_more_failures(cand_failed: int, cand_total: int, base_failed: int, base_total: int) -> float:
    """One-sided Fisher exact p that the candidate fails more often than the baseline (1.0 without data)."""
    if cand_total == 0 or base_total == 0 or cand_failed == 0:
        return 1.0
    from scipy.stats import fisher_exact  # scipy.stats is slow to import; only needed when something failed

    table = [[cand_failed, cand_total - cand_failed], [base_failed, base_total - base_failed]]
    return float(fisher_exact(table, alternative="greater").pvalue)


def host_level_t(x: Sequence[float] | np.ndarray, hosts: Sequence[object], threshold: float
                 ) -> tuple[float, float, np.ndarray]:
    """(one-sided p, t, per-host means) of "the mean host effect exceeds ``threshold``": Student's t on the hosts'
    mean block log ratios, g - 1 degrees of freedom.

    Why beside the host-clustered bootstrap: with g hosts that bootstrap has only C(2g - 1, g) distinct resamples
    (10 for 3 hosts), and once every host's effect passes the threshold its p-value is 1/(B + 1) however far apart
    the hosts are, so a feature that helps some hosts and not others in general looked certain after three lucky
    ones (a review's simulation: 1.5-4.1% false promotions per test, 0.10-0.23 over ten;
    ``benchmarks/bench_few_hosts.py``). A t-test on the cluster means is the usual remedy for few clusters: its
    level holds for normal host effects with any number of hosts, at the price of power when hosts are few and
    disagree. The spread of the host means is floored at what their own blocks' spread alone would give (the
    mean of within-host variance / blocks), so hosts whose means happen to coincide are not taken as certain."""
    means, variance = _host_means(x, hosts)
    g = means.size
    if g < 2:
        return math.nan, math.nan, means
    diff = float(means.mean()) - threshold
    if variance == 0.0:  # every block of every host alike (deterministic twins)
        return (0.0 if diff > 0 else 1.0), math.copysign(math.inf, diff) if diff else 0.0, means
    from scipy.special import stdtr  # Student's t CDF; scipy.stats would add a second to every promote

    t = diff / math.sqrt(variance / g)
    return float(stdtr(g - 1, -t)), t, means


def _host_means(x: Sequence[float] | np.ndarray, hosts: Sequence[object]) -> tuple[np.ndarray, float]:
    """Per-host mean log ratios and their variance, floored at the mean within-host variance / blocks."""
    values = np.asarray(x, dtype=float)
    labels = np.asarray(list(hosts), dtype=object)
    groups = [values[labels == h] for h in dict.fromkeys(labels.tolist())]
    means = np.asarray([g.mean() for g in groups], dtype=float)
    if means.size < 2:
        return means, math.nan
    within = [float(np.var(grp, ddof=1)) / grp.size for grp in groups if grp.size >= 2]
    return means, max(float(means.var(ddof=1)), float(np.mean(within)) if within else 0.0)


def host_level_upper(x: Sequence[float] | np.ndarray, hosts: Sequence[object], q: float) -> float:
    """The ``q`` upper confidence bound of the mean host effect (log), Student's t with g - 1 degrees of freedom
    on the hosts' mean log ratios (the spread floored as in ``host_level_t``); nan below two hosts."""
    means, variance = _host_means(x, hosts)
    if means.size < 2:
        return math.nan
    from scipy.special import stdtrit  # inverse of Student's t CDF

    return float(means.mean()) + float(stdtrit(means.size - 1, q)) * math.sqrt(variance / means.size)


MIN_CLUSTERS = 3
"""Fewest hosts a bootstrap resamples as clusters. Two hosts give three distinct resamples (either host twice, or
both): once both hosts' estimates clear a threshold the p-value is 1/(B + 1) and the interval is the range of the
two host estimates, whatever their blocks' noise. A review's simulation (16 blocks, 1.5% block noise, a true
effect at delta): 12% of campaigns promoted as two hosts, 1.75% as one. Below three hosts the blocks are the unit."""


def bootstrap_clusters(hosts: Sequence[object] | np.ndarray) -> Optional[np.ndarray]:
    """The host labels to resample as clusters, or None to resample blocks (fewer than ``MIN_CLUSTERS`` hosts)."""
    labels = np.asarray(list(hosts), dtype=object)
    return labels if len(set(labels.tolist())) >= MIN_CLUSTERS else None


def abs_quantile(x: Sequence[float] | np.ndarray, q: float) -> float:
    arr = np.abs(np.asarray(x, dtype=float))
    return float(np.quantile(arr, q)) if arr.size else math.nan


def normal_abs_quantile(x: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-quantile of |x| for x ~ N(0, sigma), sigma from the median |x|. With the usual 4-12 A/A blocks the
    empirical 0.95 quantile is their largest value, so one wild block set the whole loss margin and a feature that
    made the loss clearly worse was promoted (found in review); the median ignores a few wild blocks."""
    arr = np.abs(np.asarray(x, dtype=float))
    if not arr.size:
        return math.nan
    normal = statistics.NormalDist()
    return float(np.median(arr)) / normal.inv_cdf(0.75) * normal.inv_cdf((1.0 + q) / 2.0)
