"""The decision: Holm across the campaign, then REJECT / PROMOTE clauses in a fixed order, else HOLD.

How to use: ``verdicts = decide_all(measured, policy, defaults)`` where ``measured`` comes from
``analysis.analyse``. REJECT clauses are checked first (an inert toggle, a gated disqualifier, a new graph
break, a flaky candidate, worse quality, a clearly absent win); then every PROMOTE clause must pass, and the
first that fails becomes the HOLD reason. Ties keep the incumbent: an interval that straddles 1 + delta is a
HOLD. Taxes never enter the family and always end as TAX-REPORTED.

Thresholds (departing from promotion-rule.md §5.5-5.6, see ``ThresholdPolicy``): PROMOTE needs the
Holm-adjusted lower bound above 1 + delta = (1 + min_effect) x exp(A/A bias bound). REJECT for "no meaningful
win" needs a calibrated lane (``min_aa_blocks``), at least ``min_blocks`` blocks, and the interval's upper bound,
widened by the bias bound, below 1 + min_effect: a threshold estimated from a handful of A/A blocks never
rejects, and a true win is never rejected because start-up jitter or bias hid it. In doubt: HOLD.

Sequential (``policy.sequential.enabled``, see ``ablate.promote.sequential``): the SPRT's upper crossing
replaces the block count and the Holm interval for PROMOTE (every other clause still applies: gates, quality,
rounds, hosts, per-host and per-round wins, order); its lower crossing in a calibrated lane is the REJECT for
"no meaningful win" when the mean block log ratio is one standard error below 1 + min_effect (otherwise a close
call between delta0 and delta1: HOLD, the incumbent stays); in between it HOLDs as undecided, and at the cap as
inconclusive (sticky).
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from typing import Any, Callable, Mapping, Optional

import numpy as np

from ablate.promote.analysis import (HOLD, PROMOTE, REJECT, TAX_REPORTED, Clause, FeatureVerdict, rates_ok,
                                     with_refused)
from ablate.promote.policy import Policy
from ablate.promote.sequential import CAP, LOWER, UPPER, SequentialState, SprtBounds, sequential_state
from ablate.promote.stats import (MIN_CLUSTERS, bootstrap_clusters, bootstrap_hl, holm, host_level_t,
                                  host_level_upper, quantile)


def _pct(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None or not math.isfinite(ratio) else f"{(ratio - 1) * 100:+.2f}%"


def apply_holm(verdicts: list[FeatureVerdict], policy: Policy) -> int:
    """Holm over every speed test with evidence; fills p_holm, alpha_adj, lower_adj. Returns the family size."""
    family = [v for v in verdicts if v.kind == "speed" and v.p_raw is not None]
    adjusted, levels = holm([v.p_raw for v in family], policy.family_alpha)
    for verdict, p_adj, level in zip(family, adjusted, levels):
        verdict.p_holm = float(p_adj)
        verdict.alpha_adj = float(level)
        assert verdict.work is not None
        verdict.lower_adj = math.exp(quantile(verdict.work.theta, float(level)))
    return len(family)


def sprt_of(v: FeatureVerdict, policy: Policy, num_tests: int = 1) -> SequentialState:
    """The SPRT on this test's blocks in time order (analysis keeps them in ``v.work``)."""
    work = v.work
    assert work is not None
    order = np.argsort(work.created_at.astype(str), kind="stable") if work.created_at.size else np.arange(0)
    bounds = SprtBounds.of(policy, None if v.bias_bound is None else math.log1p(v.bias_bound), num_tests)
    then = None
    if work.then and work.then_rank.size == work.log_ratios.size and (work.then_rank >= 0).all():
        # A look was first judged with the sweeps up to the latest one it had seen, then by every later promote
        # with the sweeps up to its own "today": all of those calibrations (uncalibrated ones are none).
        then = [[cal for cal in work.then[j:] if cal is not None]
                for j in np.maximum.accumulate(work.then_rank[order])]
    return sequential_state(work.log_ratios[order], work.hosts[order], work.round_ids[order].tolist(),
                            bounds=bounds, policy=policy, var_floor=work.aa_var_log or 0.0,
                            failed=work.candidate_failed[order], then=then,
                            seeds=work.seeds[order].tolist() if work.seeds.size == work.log_ratios.size else None)


NODE_FACTS = frozenset({"LOW_PRIORITY", "HARDWARE_MISMATCH"})
"""Gated codes about the machine an arm ran on (its CPU priority, hardware other than its partner's): the arm is
left out as evidence, and rejects nothing. One LOW_PRIORITY arm of twelve rejected a real 5% win (found in review):
a wrong verdict about the feature, from a fact about a machine. Still rejecting: INERT_TOGGLE on some candidate arms
(``not_inert`` leaves that case to this clause) and BACKEND_FAILED_NODE_CHECK (the arm ran a backend its node's
check found wrong: not a default to make while it computes wrong results somewhere)."""


def _reject_clauses(v: FeatureVerdict, policy: Policy,
                    sprt: Optional[SequentialState] = None) -> list[Callable[[], Clause]]:
    gated = {code: n for code, n in v.gated_disqualifiers.items() if code not in NODE_FACTS}
    node_facts = {code: n for code, n in v.gated_disqualifiers.items() if code in NODE_FACTS}

    def inert() -> Clause:
        if v.inert_reason is not None and not v.inert_everywhere:
            # Observed inert on some candidate arms only: the toggle acted on the others. Those arms are gated
            # (no_disqualifier), which says so without claiming the toggle cannot act here.
            return Clause("not_inert", True, f"{v.inert_reason}, not on every one: the toggle acted on the others")
        return Clause("not_inert", v.inert_reason is None, v.inert_reason or "the toggle can act in this lane")

    def disqualified() -> Clause:
        def listed(codes: dict[str, int]) -> str:
            arms = [arm for arm in v.gated_arms if any(code in arm for code in codes)] or v.gated_arms
            named = "; ".join(arms[:2]) + (f"; and {len(arms) - 2} more" if len(arms) > 2 else "")
            return ", ".join(f"{c} x{n}" for c, n in sorted(codes.items())) + f" ({named})"

        if gated:
            return Clause("no_disqualifier", False, f"candidate arms disqualified: {listed(gated)}")
        if node_facts:
            return Clause("no_disqualifier", True, f"no gated disqualifier about the feature; candidate arms left out "
                                                   f"as evidence for their node's facts: {listed(node_facts)}")
        return Clause("no_disqualifier", True, "no gated disqualifier on any candidate arm")

    def counters() -> Clause:
        found = v.counter_violations
        return Clause("exact_counters", not found, "; ".join(found[:3]) if found else "no counter above baseline")

    # A REJECT stands on as much evidence as a PROMOTE would: enough blocks and hosts, and a calibrated lane.
    # It also demotes a promoted default on revalidation, so one or two blocks must never carry it.
    # Nor on a --sweep selection that left some of the test's arms out: it would choose the REJECT.
    few = [why for short, why in (
        (v.n_hosts < policy.evidence.min_hosts, f"{v.n_hosts} host(s) < {policy.evidence.min_hosts}"),
        (v.aa_blocks < policy.threshold.min_aa_blocks,
         f"{v.aa_blocks} A/A block(s) < {policy.threshold.min_aa_blocks}"),
        (bool(v.uncalibrated_hosts), f"no A/A block on host(s) {', '.join(v.uncalibrated_hosts)}: their slot bias "
                                     f"is not bounded"),
        (bool(v.left_out_arms), f"{len(v.left_out_arms)} arm(s) in sweeps the --sweep selection left out")) if short]

    def flaky() -> Clause:
        f, b = v.failures["candidate"], v.failures["baseline"]
        significant = v.fisher_p < policy.failures.fisher_alpha
        shown = f"candidate fails more often than baseline ({f['failed']}/{f['arms']} vs {b['failed']}/{b['arms']}, " \
                f"Fisher p={v.fisher_p:.3g})"
        # Failures on fewer hosts than a PROMOTE needs are those hosts' fact until others fail too (found in
        # review: 4 failed arms on one host, then 5 on one of three, rejected a feature, and on revalidation would
        # demote a global default). The PROMOTE side still holds such a test (failure_rate), so nothing flaky is
        # promoted while the evidence grows. (A calibration says nothing of failures; a --sweep selection that
        # left arms out holds below, by name.)
        thin = [why for short, why in (
            (v.failure_hosts < policy.evidence.min_hosts,
             f"candidate failures on {v.failure_hosts} host(s) < {policy.evidence.min_hosts}"),
            (f["arms"] < policy.evidence.min_blocks, f"{f['arms']} candidate arm(s) < {policy.evidence.min_blocks}"))
            if short]
        if significant and thin:
            return Clause("not_flaky", True, f"{shown}, but too little evidence to reject on: {'; '.join(thin)}")
        return Clause("not_flaky", not significant, shown if significant else f"Fisher p={v.fisher_p:.3g}")

    def quality() -> Clause:
        # Evidence first: a bootstrap of one loss delta returns it as both bounds, and an uncalibrated lane's
        # epsilon is the policy's floor, so a round-off-sized loss difference on one block rejected a real win
        # (found in review).
        thin = few + ([f"{v.loss_blocks} block(s) with a loss < {policy.evidence.min_blocks}"]
                      if v.loss_blocks < policy.evidence.min_blocks else [])
        worse = v.loss_bounds is not None and v.loss_bounds[0] > v.epsilon
        if worse and thin and v.loss_bounds:
            return Clause("quality_not_worse", True, f"loss looks worse (lower bound {v.loss_bounds[0]:+.4g} > "
                                                     f"epsilon {v.epsilon:.4g}) but too little evidence to reject "
                                                     f"on: {'; '.join(thin)}")
        detail = (f"loss worse: lower bound {v.loss_bounds[0]:+.4g} > epsilon {v.epsilon:.4g}" if worse and
                  v.loss_bounds else "loss not shown worse")
        return Clause("quality_not_worse", not worse, detail)

    def meaningful() -> Clause:
        enough = v.n_blocks >= policy.evidence.min_blocks
        floor = 1.0 + policy.threshold.min_effect
        # The upper bound is widened by the lane's bias bound: a bias against the candidate slot must not turn a
        # real win into a rejection. With few hosts the host bootstrap's interval is too narrow (3 hosts: 10
        # distinct resamples; a review's simulation rejected a win at the boundary in ~10% of campaigns, not
        # 2.5%), so the host-level t bound, the REJECT side's hosts_agree, widens it where it is wider.
        upper = v.ci95[1] if v.ci95 is not None else None
        work = v.work
        widened = ""
        if upper is not None and v.bootstrap_unit == "host" and work is not None:
            ran = ~work.candidate_failed
            t_upper = host_level_upper(work.log_ratios[ran], work.hosts[ran], 0.975)
            if math.isfinite(t_upper) and math.exp(t_upper) > upper:
                upper, widened = math.exp(t_upper), ", and by the hosts' t bound"
        upper = upper * (1.0 + (v.bias_bound or 0.0)) if upper is not None else None
        absent = enough and not few and upper is not None and upper < floor
        if absent and upper is not None:
            detail = (f"no meaningful win at {v.horizon_steps:,} steps: upper bound {upper:.4f} (widened by the A/A "
                      f"bias bound{widened}) < 1 + min_effect = {floor:.4f}")
        elif few:
            detail = f"not ruled out: too little evidence to reject on ({'; '.join(few)})"
        else:
            detail = "upper bound reaches 1 + min_effect (or too few blocks to rule the win out)"
        return Clause("win_possible", not absent, detail)

    def sprt_lower() -> Clause:
        assert sprt is not None
        mean, sd = sprt.variance.get("mean"), sprt.variance.get("mean_sd")
        bias = sprt.variance.get("bias") or 0.0
        # The lower crossing says "closer to delta0 than to delta1"; a win between them (a close call) is still a
        # win: only an estimate one standard error below the smallest effect worth a default is "no meaningful
        # win" (simulated: a true 2% win is then rejected in ~3% of campaigns instead of ~11%). The estimate is
        # raised by the A/A bias bound the crossing used, as the crossing and the fixed rule's bound are: a
        # candidate slot slow by the bias in every block measured a true 1.5% win as 0 and rejected it (review).
        small = mean is not None and sd is not None and mean + bias + sd <= math.log1p(policy.threshold.min_effect)
        absent = sprt.decision == LOWER and not few and small
        if absent and mean is not None:
            detail = (f"no meaningful win: {sprt.stop_reason}; mean block speed-up {_pct(math.exp(mean))}, raised by "
                      f"the A/A bias bound {_pct(math.exp(bias))}, one standard error below 1 + min_effect")
        elif sprt.decision != LOWER:
            detail = "the SPRT has not crossed its lower bound"
        elif few:
            detail = f"not ruled out: too little evidence to reject on ({'; '.join(few)}; {sprt.stop_reason})"
        else:
            detail = (f"not ruled out: {sprt.stop_reason}, but the mean block speed-up {_pct(math.exp(mean or 0))}, "
                      f"raised by the A/A bias bound {_pct(math.exp(bias))}, is not one standard error below 1 + "
                      f"min_effect: a close call, held")
        return Clause("win_possible", not absent, detail)

    return [inert, disqualified, counters, flaky, quality, meaningful if sprt is None else sprt_lower]


def _loho_lower(v: FeatureVerdict, policy: Policy) -> Optional[float]:
    """Smallest one-sided lower bound (as a ratio) when any one host is left out; None with < 2 hosts."""
    assert v.work is not None
    hosts = sorted(set(v.work.hosts.tolist()))
    if len(hosts) < 2:
        return None
    rng = np.random.default_rng([policy.bootstrap.seed, zlib.crc32(v.test_key.encode())])
    lowers = []
    for host in hosts:
        keep = v.work.hosts != host
        clusters = bootstrap_clusters(v.work.hosts[keep])
        theta = bootstrap_hl(v.work.log_ratios[keep], clusters, policy.bootstrap.loss_resamples, rng)
        lowers.append(math.exp(quantile(theta, policy.family_alpha)))
    return min(lowers)


def family_min_blocks(policy: Policy, num_tests: int) -> int:
    """The fewest blocks whose best case (every block wins: one-sided p = 1/2^n) is below the smallest Holm level
    of ``num_tests`` tests (promotion-rule.md §5.5.2): 5 for one test at alpha 0.05, 8 for ten, 9 for 21."""
    return math.floor(math.log2(max(1, num_tests) / policy.family_alpha)) + 1


def _promote_clauses(v: FeatureVerdict, policy: Policy, defaults: Mapping[str, Any],
                     sprt: Optional[SequentialState] = None, num_tests: int = 1) -> list[Callable[[], Clause]]:
    ev, cons = policy.evidence, policy.consistency
    log_threshold = math.log1p(v.delta)
    work = v.work
    assert work is not None

    def every_arm_read() -> Clause:
        # An arm whose receipt is unreadable may be the failure or the gated candidate that decides this test; the
        # arms that remain cannot say it was not (ablate.receipts.rejection).
        unread, left, refused = v.unread_arms, v.left_out_arms, v.refused_arms
        if unread:
            return Clause("every_arm_read", False,
                          f"{len(unread)} arm(s) of this test or its lane's A/A blocks could not be read "
                          f"({_named(unread)}): restore, sync or repair them (see the rejected lines), then promote "
                          f"again")
        if left:
            # Choosing the sweeps to promote on must not choose the verdict: a test with evidence in sweeps the
            # selection left out is decided on all of it or not at all (found in review: --sweep r1 --sweep r3
            # promoted on the winning rounds of a test whose r2 lost).
            return Clause("every_arm_read", False,
                          f"{len(left)} arm(s) of this feature in this lane are in sweeps the --sweep selection "
                          f"left out ({_named(left)}): promote with them (name their sweeps too, or drop --sweep)")
        if refused:
            # Readable receipts: "restore or repair them" would send the user after files that are fine.
            return Clause("every_arm_read", False,
                          f"{len(refused)} candidate arm(s) of newer software than this test's blocks are in blocks "
                          f"that were refused ({_named(refused)}): nothing measured that software on this lane, so "
                          f"the older evidence is not current; run the round again once what refused it is fixed")
        return Clause("every_arm_read", True, "every arm of this test and its lane's A/A blocks was read")

    def current_baseline() -> Clause:
        # The lane's own default: a lane override (keyed by lane shape) beats the global value, or a lane that
        # already runs its promoted override would be told it measured against the wrong baseline; a feature the
        # file does not list runs the registry's reference. Without it, a campaign that pinned bucket_cap_mb 50
        # and won with 100 was written as moving every lane from the reference 25 to 100, and a demotion then
        # "restored" 50, a value no lane ran (found by review helper 9). A plain mapping (older callers) holds
        # global values only.
        default = (defaults.lane_default(v.feature, v.lane_shape) if hasattr(defaults, "lane_default")
                   else defaults.get(v.feature))
        ok = default is None or str(default) == str(v.baseline_value)
        return Clause("baseline_is_default", ok,
                      f"measured against {v.baseline_value!r}, the default is {default!r}" if not ok else
                      f"measured against the current default {v.baseline_value!r}")

    def calibrated() -> Clause:
        ok = v.aa_blocks >= policy.threshold.min_aa_blocks and not v.uncalibrated_hosts
        bias = _pct(None if v.bias_bound is None else 1 + v.bias_bound)
        where = ("contains 1" if v.aa_interval[0] <= 1.0 <= v.aa_interval[1] else "excludes 1: systematic bias"
                 ) if v.aa_interval else "none"
        missing = (f"; no A/A block on host(s) {', '.join(v.uncalibrated_hosts)}, where this test ran: their slot "
                   f"bias is not bounded (run A/A blocks there)" if v.uncalibrated_hosts else "")
        return Clause("calibrated", ok, f"{v.aa_blocks} A/A blocks beside this test's rounds (need "
                                        f"{policy.threshold.min_aa_blocks}); bias bound {bias}, A/A interval {where}"
                                        f"{missing}")

    def failure_rate() -> Clause:
        # Crashes in blocks that could not be paired hold the test as a matched block's would, and only hold: the
        # clause must pass with and without them (found in review: a refused block's crashed baseline lowered the
        # bar and cleared a hold set by a matched crash), and they never reach Fisher's REJECT
        # (``FeatureVerdict.refused_failures``).
        c, b = v.failures["candidate"], v.failures["baseline"]
        ok = rates_ok(c, b, policy.failures.max_candidate_rate)
        detail = (f"candidate failed {c['failed']}/{c['arms']}, baseline {b['failed']}/{b['arms']} (max candidate "
                  f"rate {policy.failures.max_candidate_rate:g})")
        if v.refused_failure_blocks:
            rc, rb = (with_refused(v.failures, v.refused_failures, role) for role in ("candidate", "baseline"))
            ok = ok and rates_ok(rc, rb, policy.failures.max_candidate_rate)
            detail += (f"; with the arms of {len(v.refused_failure_blocks)} refused block(s) (e.g. "
                       f"{v.refused_failure_blocks[0]}): candidate {rc['failed']}/{rc['arms']}, baseline "
                       f"{rb['failed']}/{rb['arms']}")
        return Clause("failure_rate", ok, detail)

    def amount() -> Clause:
        problems = []
        if v.n_blocks < ev.min_blocks and sprt is None:  # the SPRT's own min_blocks and bounds replace it
            problems.append(f"{v.n_blocks} blocks < {ev.min_blocks}")
        least = family_min_blocks(policy, num_tests)
        if sprt is None and ev.min_blocks <= v.n_blocks < least:
            # A bootstrap bound can clear the Holm level on fewer blocks than any rank test could: the fixed
            # min_blocks covers about ten tests, a larger family needs more.
            problems.append(f"{v.n_blocks} blocks < {least}, the fewest whose best case (1/2^n) is below the Holm "
                            f"level of {num_tests} tests at family alpha {policy.family_alpha:g}")
        if v.n_hosts < ev.min_hosts:
            problems.append(f"{v.n_hosts} host(s) < {ev.min_hosts}")
        if v.n_seeds < ev.min_seeds:
            problems.append(f"{v.n_seeds} seed(s) < {ev.min_seeds}")
        if v.n_rounds < ev.min_rounds:
            short = [f"{r.round_id}: {r.blocks} block(s) on {r.hosts} host(s)" for r in v.rounds if not r.counted]
            problems.append(f"{v.n_rounds} counted round(s) < {ev.min_rounds}"
                            + (" (software fingerprint changed: count restarted)" if v.superseded["blocks"] else "")
                            + (f"; a round counts with {ev.round_needs} ({'; '.join(short[:3])})" if short else ""))
        return Clause("enough_evidence", not problems, "; ".join(problems) or
                      f"{v.n_blocks} blocks, {v.n_hosts} hosts, {v.n_seeds} seeds, {v.n_rounds} rounds")

    def lower_bound() -> Clause:
        ok = v.p_holm is not None and v.p_holm <= policy.family_alpha
        lower = v.lower_adj if v.lower_adj is not None else math.nan
        at = f" at {v.horizon_steps:,} steps"
        if ok:
            detail = f"Holm-adjusted lower bound{at} {lower:.4f} > 1 + delta = {1 + v.delta:.4f}"
        else:
            detail = (f"tie, the incumbent stays: Holm-adjusted lower bound{at} {lower:.4f} is not above 1 + delta "
                      f"= {1 + v.delta:.4f} (p_holm={v.p_holm if v.p_holm is None else round(v.p_holm, 4)})")
        return Clause("lower_bound", ok, detail)

    def sprt_upper() -> Clause:
        assert sprt is not None
        if sprt.decision == LOWER:  # a close call the reject clause held: the test is over, the incumbent stays
            return Clause("sprt_upper", False, f"close call, the incumbent stays: {sprt.stop_reason}; mean block "
                                               f"speed-up {_pct(math.exp(sprt.variance.get('mean') or 0.0))}")
        return Clause("sprt_upper", sprt.decision == UPPER, sprt.stop_reason)

    def win_fraction() -> Clause:
        frac = v.win_fraction or 0.0
        return Clause("win_fraction", frac >= cons.min_win_fraction,
                      f"{frac:.0%} of blocks won (need {cons.min_win_fraction:.0%})")

    def host_medians() -> Clause:
        losers = [h.host for h in v.hosts if h.median_speedup is None or h.median_speedup <= 1.0]
        losers += [f"{host} (its blocks all after the sequential stop)" for host in v.later_losing_hosts]
        ok = not cons.every_host_median_wins or not losers
        return Clause("every_host_wins", ok, f"host median not a win on {', '.join(losers)}" if losers else
                      "every host's median block won")

    def leave_one_out() -> Clause:
        if not cons.leave_one_host_out or v.n_hosts < 2:
            return Clause("leave_one_host_out", True, "not applicable (one host or disabled by the policy)")
        v.loho_min_lower = _loho_lower(v, policy)
        ok = v.loho_min_lower is not None and v.loho_min_lower > 1.0
        return Clause("leave_one_host_out", ok, f"smallest lower bound with one host left out: "
                                                f"{v.loho_min_lower:.4f} (must exceed 1)")

    def hosts_agree() -> Clause:
        if not cons.hosts_agree or v.n_hosts < MIN_CLUSTERS:
            # Below MIN_CLUSTERS hosts the bootstrap resamples blocks, whose noise it already carries.
            return Clause("hosts_agree", True, f"not applicable (fewer than {MIN_CLUSTERS} hosts: the bootstrap "
                                               f"resamples blocks; or disabled by the policy)")
        # Failed candidate arms are the failure clauses' to judge (their fixed log ratio would swamp a host mean).
        ran = ~work.candidate_failed
        p, t, means = host_level_t(work.log_ratios[ran], work.hosts[ran], log_threshold)
        # Bonferroni over the report's speed tests: Holm's levels follow the bootstrap's ordering, not this test's.
        level = policy.family_alpha / max(1, num_tests)
        shown = ", ".join(_pct(math.exp(m)) for m in means)
        ok = p <= level
        detail = (f"{means.size} hosts agree: their mean speed-ups ({shown}) put the mean host above 1 + delta = "
                  f"{1 + v.delta:.4f} (t = {t:.2f}, p = {p:.3g} <= {level:.3g})" if ok else
                  f"the hosts disagree: with {means.size} hosts whose mean speed-ups are {shown}, the mean host is "
                  f"not shown above 1 + delta = {1 + v.delta:.4f} (host-level t = {t:.2f}, p = {p:.3g} > "
                  f"{level:.3g} = alpha / {max(1, num_tests)} test(s)); more hosts would tell")
        return Clause("hosts_agree", ok, detail)

    def every_round() -> Clause:
        bad = [r.round_id for r in v.rounds if r.counted and (r.speedup is None or r.speedup <= 1.0)]
        # A whole round after the sequential stop that loses is bad news the stop could not weigh, as a later host
        # is (``later_losing_hosts``): "every time" includes it (found by review helper 8: a third round 6% slower
        # on the same three hosts, and the sequential policy promoted on rounds 1-2 where the fixed one held).
        bad += [f"{r.round_id} (after the sequential stop)" for r in v.rounds_after_stop
                if r.counted and (r.speedup is None or r.speedup <= 1.0)]
        ok = not cons.every_round_wins or not bad
        return Clause("every_round_wins", ok, f"round(s) without a win: {', '.join(bad)}" if bad else
                      "every counted round won on its own")

    def order() -> Clause:
        first, second = work.log_ratios[work.candidate_first], work.log_ratios[~work.candidate_first]
        v.order = {"candidate_first": int(first.size), "baseline_first": int(second.size), "effect": None}
        if first.size == 0 or second.size == 0:
            ok = not policy.order.require_both_orders
            which = "baseline" if first.size == 0 else "candidate"
            return Clause("no_order_effect", ok, f"all {work.log_ratios.size} blocks ran the {which} first: the "
                                                 f"order was not randomised, so drift cannot be told from the "
                                                 f"feature")
        effect = float(np.median(second) - np.median(first))
        v.order["effect"] = math.expm1(effect)
        limit = policy.order.max_effect_in_thresholds * log_threshold
        detail = f"baseline-first minus candidate-first median {_pct(math.exp(effect))} (limit {_pct(math.exp(limit))}"
        if abs(effect) < limit:
            return Clause("no_order_effect", True, detail + ")")
        from scipy.stats import mannwhitneyu  # only when the medians differ beyond the limit

        p = float(mannwhitneyu(second, first, alternative="two-sided").pvalue)
        v.order["p"] = p
        return Clause("no_order_effect", p >= policy.order.alpha,
                      detail + f"; Mann-Whitney p={p:.3g}, significant below {policy.order.alpha:g})")

    def quality() -> Clause:
        if v.loss_bounds is None:
            ok = not policy.quality.require_loss
            return Clause("quality_non_inferior", ok, f"no {policy.quality.metric} recorded on both arms")
        # As much evidence as the speed decision stands on: a bootstrap of one loss delta returns it as both
        # bounds, so one block with a loss recorded on both arms promoted a feature that made the loss worse
        # whenever the other arms lacked it (found in review: 3 of 10 such campaigns).
        floor = policy.sequential.min_blocks if sprt is not None else ev.min_blocks
        if v.loss_blocks < floor:
            thin = (f"{policy.quality.metric} on both arms in {v.loss_blocks} of {v.n_blocks} block(s), fewer than "
                    f"{floor}")
            if policy.quality.require_loss:
                return Clause("quality_non_inferior", False, f"{thin}: too few to show the loss is not worse; "
                                                             f"record the loss on every arm")
            # Counted as none, as no loss at all would be, unless what little there is looks worse (found in
            # review: a 5% worse loss on 7 of 12 blocks promoted, the REJECT side being too thin to reject on).
            worse = v.loss_bounds[1] > v.epsilon
            return Clause("quality_non_inferior", not worse,
                          f"{thin}: " + (f"too few to show the loss is not worse, and its upper bound "
                                         f"{v.loss_bounds[1]:+.4g} is above epsilon {v.epsilon:.4g}" if worse else
                                         "too few to judge, counted as none (quality.require_loss is false)"))
        upper = v.loss_bounds[1]
        return Clause("quality_non_inferior", upper <= v.epsilon,
                      f"loss delta {v.loss_delta:+.4g}, upper bound {upper:+.4g} vs epsilon {v.epsilon:.4g}")

    def loss_not_lower() -> Clause:
        # A speed feature is meant to compute the same thing (promotion-rule.md §5.5.6): a loss clearly *lower*
        # than its baseline's is as suspect as a higher one (a kernel that leaks future tokens or skips work), so
        # it holds the test until someone looks, instead of passing the one-sided quality clause.
        if v.loss_bounds is None or v.kind != "speed":
            return Clause("loss_not_lower", True, "no loss interval to compare" if v.loss_bounds is None else
                          f"{v.kind} test: a lower loss may be its point")
        upper = v.loss_bounds[1]
        return Clause("loss_not_lower", upper >= -v.epsilon,
                      f"loss lower than the baseline's: upper bound {upper:+.4g} < -epsilon {-v.epsilon:.4g}; a "
                      f"speed feature should not change what is computed (check it against its reference)"
                      if upper < -v.epsilon else f"upper bound {upper:+.4g} >= -epsilon {-v.epsilon:.4g}")

    def not_suspicious() -> Clause:
        s = v.speedup or 1.0
        amdahl = v.amdahl
        share = amdahl.get("share")
        if amdahl.get("family") is not None and share is not None and share < 1.0:
            bound = 1.0 / (1.0 - share)
            steady = v.steady_speedup or s
            limit = bound * (1.0 + policy.suspicious.amdahl_slack)
            v.suspicious = steady > limit
            why = (f"steady speed-up {steady:.3f}x exceeds Amdahl's {bound:.3f}x for a {amdahl['family']} share of "
                   f"{share:.0%} (+{policy.suspicious.amdahl_slack:.0%}): the share is under-measured or work is "
                   f"being skipped")
            fine = f"steady {steady:.3f}x is within Amdahl's {bound:.3f}x ({amdahl['family']} share {share:.0%})"
        else:
            limit = policy.suspicious.max_speedup
            v.suspicious = s > limit
            why = f"a whole-step win of {s:.3f}x > {limit:.3f}x"
            fine = f"{s:.3f}x is within {limit:.3f}x"
        if not v.suspicious:
            return Clause("not_suspicious", True, fine)
        counted = [r for r in v.rounds + v.rounds_after_stop if r.counted]
        needed = policy.evidence.min_rounds + policy.suspicious.confirming_rounds
        latest = counted[-1] if counted else None
        # Every round after the ones the win was found on must confirm it, not only the latest: a confirmation that
        # failed and was run again until one passed is the multiple testing the confirmation is there to avoid
        # (found by review helper 8: a 1.9x win, its third round at 1.01x, a fourth at 1.9x, and it promoted).
        unconfirmed = [r.round_id for r in counted[policy.evidence.min_rounds:]
                       if r.speedup is None or r.speedup <= 1.0 + v.delta]
        confirmed = (len(counted) >= needed and latest is not None and latest.speedup is not None
                     and latest.speedup > 1.0 + v.delta and not unconfirmed)
        detail = (f"suspicious: {why}; " +
                  (f"confirmed by round {latest.round_id}" if confirmed and latest else
                   f"round(s) {', '.join(unconfirmed)} did not confirm it (speed-up not above 1 + delta = "
                   f"{1 + v.delta:.4f}), and a confirmation that failed is not run again until one passes; look at "
                   f"kernel traces" if unconfirmed else
                   f"needs a confirming round ({len(counted)} of {needed} rounds) and a look at kernel traces"))
        return Clause("not_suspicious", confirmed, detail)

    if sprt is not None and sprt.decision in (LOWER, CAP):
        # The test is over and no later block is looked at: its stop is the reason, not a clause that more
        # evidence could meet ("1 counted round < 2" told users to run a round that could change nothing).
        return [every_arm_read, sprt_upper, current_baseline, calibrated, failure_rate, amount, win_fraction,
                host_medians, leave_one_out, hosts_agree, every_round, order, quality, loss_not_lower, not_suspicious]
    return [every_arm_read, current_baseline, calibrated, failure_rate, amount,
            lower_bound if sprt is None else sprt_upper, win_fraction, host_medians,
            leave_one_out, hosts_agree, every_round, order, quality, loss_not_lower, not_suspicious]


def decide(v: FeatureVerdict, policy: Policy, defaults: Mapping[str, Any], num_tests: int = 1) -> FeatureVerdict:
    """Fill clauses, verdict and reason (the first failing clause) for one measured test; ``num_tests`` speed
    tests share the sequential alpha (Bonferroni)."""
    if v.kind == "tax":
        v.verdict = TAX_REPORTED
        v.reason = "taxes are never promoted: opt-in only"
        if v.within_budget is False:
            if v.ci95:
                lowered = v.ci95[0] / (1.0 + (v.bias_bound or 0.0))
                v.reason = (f"over budget: lower bound {v.ci95[0]:.4f}"
                            + (f", lowered by the A/A bias bound {_pct(1 + v.bias_bound)} to {lowered:.4f}"
                               if v.bias_bound else "") + f" < {1 - (v.budget or 0):.4f}")
        return v
    if not v.receipt_ids:
        v.verdict, v.reason = HOLD, "no block under the lane's current software fingerprint (count restarted)"
        return v
    if v.until_decided_rounds and not policy.sequential.enabled:
        # Those rounds stopped giving this test blocks when the SPRT decided it: optional stopping the fixed rule's
        # intervals and Holm levels do not account for (a lucky early run would be promoted more often than alpha).
        v.verdict = HOLD
        v.reason = (f"blocks from --until-decided round(s) {', '.join(v.until_decided_rounds[:3])}"
                    f"{' ...' if len(v.until_decided_rounds) > 3 else ''} stopped when the sequential test decided: "
                    f"the fixed rule of {policy.ref} cannot judge them; promote with a policy whose sequential test is "
                    f"on (its *_sequential twin)")
        v.clauses.append(Clause("judged_by_its_stopping_rule", False, v.reason))
        return v
    if v.stop_unmatched:
        v.verdict = HOLD
        v.reason = f"not judged: {v.stop_unmatched}"
        v.clauses.append(Clause("judged_as_it_stopped", False, v.stop_unmatched))
        return v
    sprt = None
    if policy.sequential.enabled and v.work is not None and v.n_blocks:
        sprt = sprt_of(v, policy, num_tests)
        v.sequential = sprt.to_dict()
    rejects = _reject_clauses(v, policy, sprt)
    for at, make in enumerate(rejects):
        clause = make()
        v.clauses.append(clause)
        if not clause.passed:
            # The clauses are pure: what the later ones say too, for a revalidation whose deciding gate is too thin
            # to demote on (a lost win behind one LOW_PRIORITY arm was kept for good, found in review).
            v.also_rejected = [c for c in (later() for later in rejects[at + 1:]) if not c.passed]
            if v.left_out_arms:
                # Every REJECT clause, not only the statistical ones: a selection that made older software's
                # evidence current (its gate, its failures) or kept the round that failed chose the verdict.
                v.verdict = HOLD
                v.reason = (f"{clause.name} would reject ({clause.detail}), but {len(v.left_out_arms)} arm(s) of "
                            f"this feature in this lane are in sweeps the --sweep selection left out: promote with "
                            f"them (name their sweeps too, or drop --sweep)")
                return v
            v.verdict, v.reason = REJECT, clause.detail
            return v
    if v.n_blocks == 0:
        v.verdict, v.reason = HOLD, "no usable block: every baseline arm failed"
        return v
    for make in _promote_clauses(v, policy, defaults, sprt, num_tests):
        clause = make()
        v.clauses.append(clause)
        if not clause.passed:
            v.verdict, v.reason = HOLD, clause.detail
            return v
    v.verdict, v.reason = PROMOTE, "every clause holds"
    return v


def resolve_competition(verdicts: list[FeatureVerdict]) -> None:
    """Two values of one feature promoted in one lane: the higher adjusted lower bound wins, the other HOLDs."""
    by_lane: dict[tuple[str, str], list[FeatureVerdict]] = defaultdict(list)
    for v in verdicts:
        if v.verdict == PROMOTE:
            by_lane[(v.feature, v.lane_key)].append(v)
    for rivals in by_lane.values():
        if len(rivals) < 2:
            continue
        rivals.sort(key=lambda r: (r.lower_adj or 0.0, r.speedup or 0.0), reverse=True)
        for loser in rivals[1:]:
            loser.verdict = HOLD
            loser.reason = (f"value {rivals[0].value!r} also promoted in this lane with a higher adjusted lower "
                            f"bound ({rivals[0].lower_adj:.4f} vs {loser.lower_adj:.4f})")
            loser.clauses.append(Clause("best_value", False, loser.reason))


def decide_all(measured: list[FeatureVerdict], policy: Policy, defaults: Mapping[str, Any]) -> int:
    """Holm, then a verdict for every test; returns the size of the Holm family."""
    family = apply_holm(measured, policy)
    for v in measured:
        decide(v, policy, defaults, max(1, family))
    resolve_competition(measured)
    return family


def _named(arms: list[str]) -> str:
    """The first two arms a clause names, and how many more."""
    return "; ".join(arms[:2]) + (f"; and {len(arms) - 2} more" if len(arms) > 2 else "")
