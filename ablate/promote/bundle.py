"""Bundle check: two or more values promoted in one lane are written only if they win together.

How to use: ``checks = check_bundles(verdicts, bundle_blocks, policy)`` inside ``promote`` after the verdicts;
``held_keys(checks)`` are the test keys ``plan_changes`` must not write. Each feature's own verdict stays what
its evidence says; what is held is the *set* for ``--write`` (promotion-rule.md §5.5 "Bundle check").

Why: single-feature blocks measure each value against the old defaults with every other toggle at its old
value. Written together, the values run together, and effects need not add up (two fusions competing for one
buffer, a dispatch that only pays off with the scan it replaces). Bundle blocks (``match.BUNDLE``: the
candidate runs every new value of the set, the baseline the old defaults) measure what ``--write`` would ship.

Rule: the bundle's Hodges-Lehmann speed-up must reach the largest single feature's, within the lane's delta
(log(bundle) >= max log(single) - log(1 + delta)); the report shows the interaction estimate, log(bundle) minus
the sum of the singles' logs (0 = additive, < 0 = the wins overlap or fight). Too few bundle blocks: the set is
held with "bundle not measured" and the campaign to run. Before any of that, as for a single test, the set fails
on a gated candidate (matched or in a refused block, any attempt), a candidate failure rate above the baseline's
(earlier attempts of retried blocks included), a significant excess of failures, or a counter above its baseline.

Across lanes (``unmeasured_together``, run by ``plan_changes``): values promoted in different lanes also run
together once written (a global flip lands on every lane, an override on its shape). Under ``bundle.required`` a
set that would land together on some lane and that no passed check measured is held the same way.
"""

from __future__ import annotations

import json
import math
import zlib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np

from ablate.promote.analysis import (PROMOTE, FeatureVerdict, _counter_violations, _failures, rates_ok,
                                     refused_failures, with_refused)
from ablate.promote.match import BUNDLE, Block, Refusal
from ablate.promote.policy import Policy
from ablate.promote.stats import bootstrap_clusters, bootstrap_hl, fisher_more_failures, hodges_lehmann, quantile
from ablate.receipts.rejection import UnreadArm

if TYPE_CHECKING:
    from ablate.promote.defaults_writer import DefaultsChange
    from ablate.promote.evidence import SweepWindow

PASSED, FAILED, NOT_MEASURED = "passed", "failed", "not_measured"


@dataclass
class BundleCheck:
    lane_key: str
    values: dict[str, Any]
    """Feature -> the promoted value (the set ``--write`` would change in this lane)."""
    old: dict[str, Any]
    status: str
    reason: str
    test_keys: list[str] = field(default_factory=list)
    num_blocks: int = 0
    bundle_speedup: Optional[float] = None
    bundle_ci95: Optional[tuple[float, float]] = None
    singles: dict[str, float] = field(default_factory=dict)
    """Feature -> its own promoted speed-up (HL at the horizon)."""
    interaction: Optional[float] = None
    """log(bundle) - sum of log(single): 0 when the wins add up, negative when they overlap or fight."""
    delta: float = 0.0

    @property
    def held(self) -> bool:
        return self.status != PASSED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _key(values: Any) -> str:
    return json.dumps(values, sort_keys=True, default=str)


def _campaign_hint(values: dict[str, Any], policy: Policy, where: str = "this lane") -> str:
    shown = ", ".join(f"{f}={v}" for f, v in sorted(values.items()))
    return (f"run >= {policy.bundle.min_blocks} bundle blocks in {where} ({shown} together against the "
            f"current defaults): add `bundle_blocks: {policy.bundle.min_blocks}` to the campaign that tests them "
            f"(each feature with that one value) and run a round")


def check_bundles(verdicts: list[FeatureVerdict], bundle_blocks: list[Block], policy: Policy,
                  unread: Iterable[UnreadArm] = (), refusals: Iterable[Refusal] = (),
                  windows: Optional[dict[str, SweepWindow]] = None,
                  lane_blocks: Optional[list[Block]] = None) -> list[BundleCheck]:
    """One check per lane where two or more features promoted (see the module docstring). ``unread``: arms whose
    receipts could not be read; one from a bundle block of the lane fails its set. ``refusals``: refused blocks,
    whose gated bundle candidates (a fallback beside a missing partner) fail their set as a matched one's do.
    ``windows``: each sweep's span over every block read (``sweep_windows``), so sweeps that overlapped are one
    round here as for the single tests (default: over the bundle blocks alone). ``lane_blocks``: every block read
    (bundle blocks included; default: the bundle blocks), which places a refused bundle block's crashes in time and
    software (``evidence.placed_failures``)."""
    from ablate.promote.evidence import SoftwarePlaces, placed_failures

    lane_blocks = lane_blocks if lane_blocks is not None else bundle_blocks
    unread, refusals = list(unread), list(refusals)
    refused_bundles = [r for r in refusals if r.feature == BUNDLE and r.gated_candidates and r.value is not None]
    by_lane: dict[str, list[FeatureVerdict]] = defaultdict(list)
    for v in verdicts:
        if v.verdict == PROMOTE and v.kind == "speed":
            by_lane[v.lane_key].append(v)
    checks = []
    for lane_key, promoted in sorted(by_lane.items()):
        if len({v.feature for v in promoted}) < 2:
            continue
        values = {v.feature: v.value for v in promoted}
        old = {v.feature: v.baseline_value for v in promoted}
        singles = {v.feature: float(v.speedup or 1.0) for v in promoted}
        delta = max(v.delta for v in promoted)
        check = BundleCheck(lane_key=lane_key, values=values, old=old, status=NOT_MEASURED, reason="",
                            test_keys=[v.test_key for v in promoted], singles=singles, delta=delta)
        # Evidence under the lane's current software only, as for the singles: older bundle blocks measured
        # other code (the single tests treat them as superseded).
        current = {v.software_fingerprint for v in promoted}
        same = [b for b in bundle_blocks if b.lane_key == lane_key and _key(b.value) == _key(values)]
        stale = sum(b.software_fingerprint not in current for b in same)
        # The values together are the only test of the combination: a candidate arm of it that fell back (or hit
        # any other gated code, in any attempt) fails the set, as one such arm rejects a single test.
        gated = Counter(code for b in same if b.software_fingerprint in current
                        for view in (b.candidate, *b.earlier_gated) for code in view.gated_codes)
        gated.update(code for r in refused_bundles if r.lane_key == lane_key and r.software_fingerprint in current
                     and _key(json.loads(r.value or "null")) == _key(values)
                     for view in r.gated_candidates for code in view.gated_codes)
        missing = [arm for arm in unread if arm.feature == BUNDLE and arm.lane_key == lane_key
                   and arm.software_fingerprint in current | {None}]
        if missing:
            check.status = FAILED
            how = ("are in sweeps the --sweep selection left out" if all(a.left_out for a in missing) else
                   "could not be read")
            check.reason = (f"{len(missing)} bundle arm(s) {how} ({missing[0].describe()}): the "
                            f"combination cannot be judged without them; the set is not written")
            checks.append(check)
            continue
        if gated:
            check.status = FAILED
            check.reason = ("bundle candidate arms disqualified: "
                            + ", ".join(f"{code} x{count}" for code, count in sorted(gated.items()))
                            + f" ({len(values)} values together); the set is not written")
            checks.append(check)
            continue
        # As for a single test (clauses failure_rate, not_flaky, exact_counters): the combination's crashes, in
        # any attempt (a retried block keeps its earlier failures), and a counter above its baseline's fail the
        # set. The check had none of them: a set that crashed once in every block and passed on retry was written
        # (found in review).
        measured = [b for b in same if b.software_fingerprint in current]
        places = SoftwarePlaces.of(current, [b for b in lane_blocks if b.lane_key == lane_key])
        crashed = [placed for r in refusals if r.failures and r.feature == BUNDLE and r.lane_key == lane_key
                   and _key(json.loads(r.value or "null")) == _key(values)
                   for placed in [placed_failures(r, places)] if placed is not None]
        problems = _failure_problems(measured, policy, crashed) + _counter_violations(measured, policy)[:3]
        if problems:
            check.status = FAILED
            check.reason = (f"bundle of {len(values)} values together: " + "; ".join(problems)
                            + "; the set is not written")
            checks.append(check)
            continue
        rows = [(b, b.log_ratio(policy.failures.failed_log_ratio)) for b in measured]
        rows = [(b, r) for b, r in rows if r is not None]
        check.num_blocks = len(rows)
        shortfall = _shortfall([b for b, _ in rows], policy, windows)
        if len(rows) < policy.bundle.min_blocks or shortfall:
            why = shortfall or f"need {policy.bundle.min_blocks}"
            check.reason = (f"bundle not measured: {len(rows)} bundle block(s) of {len(values)} values together "
                            f"({why}){f'; {stale} more under older software, not counted' if stale else ''}; "
                            f"{_campaign_hint(values, policy)}")
            checks.append(check)
            continue
        d = np.asarray([r for _, r in rows], dtype=float)
        hosts = np.asarray([b.host for b, _ in rows], dtype=object)
        rng = np.random.default_rng([policy.bootstrap.seed, zlib.crc32(f"bundle@{lane_key}".encode())])
        theta = bootstrap_hl(d, bootstrap_clusters(hosts), policy.bootstrap.loss_resamples,
                             rng)
        bundle_log = hodges_lehmann(d)
        best_feature, best = max(singles.items(), key=lambda kv: kv[1])
        check.bundle_speedup = math.exp(bundle_log)
        check.bundle_ci95 = (math.exp(quantile(theta, 0.025)), math.exp(quantile(theta, 0.975)))
        check.interaction = bundle_log - sum(math.log(s) for s in singles.values())
        ok = bundle_log >= math.log(best) - math.log1p(delta)
        gates = _gates(check, [b for b, _ in rows], promoted, policy)
        check.status = PASSED if ok and not gates else FAILED
        check.reason = (f"bundle {check.bundle_speedup:.4f}x over {len(rows)} block(s) "
                        f"{'reaches' if ok else 'falls short of'} the best single ({best_feature} {best:.4f}x) "
                        f"within delta {delta:.2%}; interaction estimate {check.interaction:+.4f} (log; "
                        f"{math.expm1(check.interaction):+.2%} vs the product of the singles)"
                        + "".join(f"; {gate}" for gate in gates))
        checks.append(check)
    return checks


def _failure_problems(blocks: list[Block], policy: Policy, refused: Iterable[Refusal] = ()) -> list[str]:
    """The failure clauses of a single test (``rule.failure_rate`` and ``rule.flaky``) on the bundle blocks; crashes
    in refused bundle blocks (``Refusal.failures``) count in the rate, as for a single test."""
    refused = list(refused)
    if not blocks and not refused:
        return []
    f, extra = _failures(blocks), refused_failures(refused)
    c, b = f["candidate"], f["baseline"]
    rc, rb = (with_refused(f, extra, role) for role in ("candidate", "baseline"))
    problems = []
    # Refused blocks' arms only tighten the rate: it must hold with and without them (a refused block's crashed
    # baseline must not clear a matched crash; found in review).
    most = policy.failures.max_candidate_rate
    if not (rates_ok(c, b, most) and rates_ok(rc, rb, most)):
        problems.append(f"candidate failed {c['failed']}/{c['arms']}, baseline {b['failed']}/{b['arms']} (max "
                        f"candidate rate {policy.failures.max_candidate_rate:g})"
                        + (f"; with {len(refused)} refused bundle block(s): candidate {rc['failed']}/{rc['arms']} "
                           f"({extra['candidate']['failed']} of the candidate's failures there), baseline "
                           f"{rb['failed']}/{rb['arms']}" if refused else ""))
    p = fisher_more_failures(c["failed"], c["arms"], b["failed"], b["arms"])
    if p < policy.failures.fisher_alpha:
        problems.append(f"candidate fails more often than baseline (Fisher p={p:.3g})")
    return problems


def _shortfall(blocks: list[Block], policy: Policy, windows: Optional[dict[str, SweepWindow]] = None) -> str:
    """Why the bundle's evidence is too thin to judge (rounds separate in time, hosts), as for a single test."""
    from ablate.promote.evidence import _rounds

    rounds = [r for r in _rounds(blocks, policy, windows) if r.counted] if blocks else []
    hosts = {b.host for b in blocks}
    problems = []
    if len(rounds) < policy.evidence.min_rounds:
        problems.append(f"{len(rounds)} counted round(s), need {policy.evidence.min_rounds} separate in time")
    if len(hosts) < policy.evidence.min_hosts:
        problems.append(f"{len(hosts)} host(s), need {policy.evidence.min_hosts}")
    return "; ".join(problems)


def _gates(check: BundleCheck, blocks: list[Block], promoted: list[FeatureVerdict], policy: Policy) -> list[str]:
    """What besides the size must hold for the set, as for any promotion: a win that excludes none at all, and a
    loss no worse together than the lane's epsilon."""
    gates = []
    if check.bundle_ci95 is not None and check.bundle_ci95[0] <= 1.0:
        gates.append(f"its 95% interval [{check.bundle_ci95[0]:.4f}x, {check.bundle_ci95[1]:.4f}x] does not exclude "
                     f"no win")
    losses = [(b.host, d) for b in blocks if (d := b.loss_delta()) is not None]
    epsilon = max(v.epsilon for v in promoted)
    if losses:
        hosts = np.asarray([h for h, _ in losses], dtype=object)
        rng = np.random.default_rng([policy.bootstrap.seed, zlib.crc32(f"bundle-loss@{check.lane_key}".encode())])
        theta = bootstrap_hl(np.asarray([d for _, d in losses], dtype=float),
                             bootstrap_clusters(hosts), policy.bootstrap.loss_resamples, rng)
        upper = quantile(theta, 1.0 - policy.quality.alpha)
        if upper > epsilon:
            gates.append(f"the loss is worse together: upper bound {upper:+.4g} > epsilon {epsilon:.4g}")
    elif policy.quality.require_loss:
        gates.append("no loss was measured on the bundle blocks (quality.require_loss)")
    return gates


def held_keys(checks: list[BundleCheck], policy: Policy) -> set[str]:
    """Test keys whose values ``--write`` must not change: every set that failed, or (when the policy requires
    it) was not measured."""
    held: set[str] = set()
    for check in checks:
        if check.status == FAILED or (check.status == NOT_MEASURED and policy.bundle.required):
            held.update(check.test_keys)
    return held


ALL_LANES = "every lane"
"""The lanes a global flip lands on: all of them, whatever their shape."""


def unmeasured_together(changes: list["DefaultsChange"], checks: Iterable[BundleCheck], policy: Policy,
                        standing: Optional[dict[str, dict[str, tuple[str, Optional[str]]]]] = None,
                        measured_shapes: Optional[dict[str, set[str]]] = None) -> dict[str, str]:
    """Feature -> why its change must be held: with it, two or more new values would become effective together on
    some lane (global flips land on every lane, an override on its shape) and no passed bundle check measured that
    set. ``check_bundles`` only sees features promoted in one lane; two features each promoted in its own lane
    and both written would make every lane run them together, never measured so. Applied until nothing more is
    held: holding one value changes the set another lane would run. Empty unless ``bundle.required``. ``checks``:
    ``check_bundles``' results; a set counts as measured only when a check of exactly those values passed.

    ``standing``: lane shape -> feature -> (value, report) of the overrides defaults.yaml already has, which an
    earlier ``--write`` made; ``measured_shapes``: feature -> shapes of the lanes that promoted this run's value. A
    global flip lands on those overrides' lanes too: unless one of its promoting lanes has that shape (its baseline
    ran the override), the flip and the override were never measured together, and the flip is held (found by
    review helper 9: a CPU lane's mamba_scan override written by one --write, a CUDA lane's moe_dispatch flipped
    globally by the next, and the CPU lanes ran both; the same two verdicts in one run were held)."""
    if not policy.bundle.required:
        return {}
    passed = [{feature: str(value) for feature, value in check.values.items()} for check in checks
              if check.status == PASSED]
    reasons: dict[str, str] = {}
    while True:
        flips = {c.feature: str(c.new) for c in changes if c.scope == "global" and c.feature not in reasons}
        landing: dict[str, dict[str, str]] = {ALL_LANES: dict(flips)}
        for c in changes:
            if c.feature in reasons:
                continue
            for shape, value in c.overrides.items():
                landing.setdefault(shape, dict(flips))[c.feature] = str(value)
        fresh = {}
        for where, values in sorted(landing.items()):
            if len(values) < 2 or values in passed:
                continue
            shown = ", ".join(f"{f}={v}" for f, v in sorted(values.items()))
            lanes = "every lane" if where == ALL_LANES else f"lanes of {where}"
            for feature in values:
                fresh.setdefault(feature, (
                    f"bundle not measured: {shown} would run together on {lanes}, and no bundle check measured "
                    f"them together (each was promoted on its own lane); the value is held from --write: "
                    + _campaign_hint(values, policy, "a lane where they all act")))
        rewritten = {(shape, c.feature) for c in changes if c.feature not in reasons for shape in c.overrides}
        for shape, overridden in sorted((standing or {}).items()):
            for feature, value in sorted(flips.items()):
                # An override beats the global value, so one of a feature flipping now still runs on its shape.
                others = {f: v for f, v in overridden.items() if f != feature and (shape, f) not in rewritten}
                if not others or feature in fresh or shape in (measured_shapes or {}).get(feature, set()):
                    continue
                shown = ", ".join(f"{f}={v} (report {r or 'unknown'})" for f, (v, r) in sorted(others.items()))
                together = {feature: value, **{f: v for f, (v, _) in others.items()}}
                fresh[feature] = (f"bundle not measured: the global flip {feature}={value} would run on lanes of "
                                  f"{shape} together with their lane override {shown}, and no lane of that shape "
                                  f"measured them together; the value is held from --write: "
                                  + _campaign_hint(together, policy, f"a lane of {shape}"))
        if not fresh:
            return reasons
        reasons.update(fresh)
