"""Organise matched blocks into tests (feature x value x lane), rounds and per-lane A/A calibration.

How to use: ``tests, calibrations, lanes = organise(blocks, policy)``. A test collects every block of one
feature value in one lane across rounds (sweeps). Evidence only counts under the lane's *current* software
fingerprint (the one of its most recent block): a changed fingerprint restarts the round count, and the
older blocks are kept aside as ``superseded`` so the report can say what was dropped and why.

A round is a separate run in time, not a sweep id: sweeps that started less than ``evidence.min_round_gap_s``
apart, or while the previous one was still writing receipts, are merged into one round (``merge_sweeps``), and
the report says which and why.

Calibration (departing from promotion-rule.md §5.3, see ``ThresholdPolicy``): the A/A blocks bound the lane's
*systematic* bias — the Hodges-Lehmann of their signed log ratios and its bootstrap interval; the bias bound is
the larger end of that interval in absolute value — and show whether the A/A interval contains 1 (calibrated).
Their single-block spread is reported but is not the win threshold (the suspicious-win check reads Amdahl's bound,
not the spread).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Optional

import numpy as np

from ablate.config.features import FEATURES
from ablate.config.lane_shape import on_device
from ablate.promote.match import ArmView, Block, Refusal, RefusedArm
from ablate.promote.policy import Policy
from ablate.promote.stats import (abs_quantile, bootstrap_clusters, bootstrap_hl, hodges_lehmann, normal_abs_quantile,
                                  quantile)
from ablate.receipts.rejection import UnreadArm

STARTUP_FLAG_MADS = 4.0
"""A block whose arms' start-up log ratio lies beyond median + this many MADs of the lane's is flagged."""
STARTUP_FLAG_FLOOR = math.log(1.25)
"""... and never for less than a 25% difference: start-up jitter that size is ordinary on a busy node."""


@dataclass(frozen=True)
class RoundInfo:
    round_id: str
    """The sweep id, or the sweep ids joined by `` + `` when several sweeps were one run in time."""
    num_blocks: int
    first_at: str
    last_at: str
    counted: bool
    """False when the round has fewer blocks than ``evidence.min_blocks_per_round``, or its blocks ran on fewer hosts
    than ``evidence.min_hosts_per_round``."""
    members: tuple[str, ...] = ()
    """The sweep ids (``Block.round_id``) this round is made of."""
    note: str = ""
    """Why several sweeps count as this one round (empty for a round of one sweep)."""
    num_hosts: int = 0


@dataclass(frozen=True)
class SweepWindow:
    """When a sweep ran: its first arm's start (receipt time minus the arm's wall time) to its last receipt."""

    sweep_id: str
    start: float
    end: float


def epoch_s(stamp: str) -> float:
    # The validator accepted the stamp as ISO-8601; a naive one is read as UTC (the project writes UTC).
    moment = datetime.fromisoformat(stamp)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def sweep_windows(blocks: list[Block]) -> dict[str, SweepWindow]:
    """Each sweep's time window over all its blocks (every feature and lane it ran), by sweep id."""
    spans: dict[str, list[float]] = {}
    for block in blocks:
        for arm in (block.baseline, block.candidate):
            end = epoch_s(arm.created_at)
            start = end - (arm.wall_s or 0.0)
            span = spans.setdefault(block.round_id, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
    return {sweep: SweepWindow(sweep, start, end) for sweep, (start, end) in spans.items()}


@dataclass
class Calibration:
    """A lane's A/A evidence under one software fingerprint: systematic bias bound, spread, loss spread."""

    lane_key: str
    software_fingerprint: str
    num_blocks: int
    noise_floor_log: Optional[float]
    """The policy quantile of single-block |log ratio| over A/A blocks (the spread; None without A/A blocks)."""
    loss_spread: Optional[float]
    """The policy quantile of |loss delta| over A/A blocks: the smaller of the empirical one and the one read as
    normal noise from their median (``normal_abs_quantile``)."""
    aa_hl_log: Optional[float]
    """Hodges-Lehmann of the signed A/A log ratios: the lane's systematic bias estimate."""
    aa_interval_log: Optional[tuple[float, float]] = None
    """Two-sided bootstrap interval of ``aa_hl_log`` at ``threshold.bias_confidence``."""
    bias_bound_log: Optional[float] = None
    """max(|lo|, |hi|) of that interval: what delta adds to the policy's minimum effect."""
    first_at: Optional[str] = None
    last_at: Optional[str] = None
    aa_var_log: Optional[float] = None
    """Variance of the A/A log ratios: pure noise, the sequential test's floor on a feature's block variance."""
    hosts: tuple[str, ...] = ()
    """Where those A/A blocks ran: the bias bound says nothing of another host's slot bias."""

    def uncovered(self, hosts: Iterable[str]) -> list[str]:
        """Those of ``hosts`` on which no A/A block of this calibration ran."""
        return sorted(set(hosts) - set(self.hosts))

    @property
    def noise_floor(self) -> Optional[float]:
        """The single-block A/A spread as a fraction (0.012 = 1.2%)."""
        return None if self.noise_floor_log is None else math.expm1(self.noise_floor_log)

    @property
    def bias_bound(self) -> Optional[float]:
        return None if self.bias_bound_log is None else math.expm1(self.bias_bound_log)

    @property
    def contains_one(self) -> Optional[bool]:
        """Whether the A/A interval contains a ratio of 1 (no detectable systematic bias)."""
        if self.aa_interval_log is None:
            return None
        return self.aa_interval_log[0] <= 0.0 <= self.aa_interval_log[1]

    def delta(self, policy: Policy) -> float:
        """Win threshold as a fraction: (1 + min_effect) x exp(bias bound) - 1 (min_effect when uncalibrated)."""
        return math.expm1(math.log1p(policy.threshold.min_effect) + (self.bias_bound_log or 0.0))

    def epsilon(self, policy: Policy) -> float:
        """Loss non-inferiority margin: max(policy floor, A/A loss spread)."""
        return max(policy.quality.min_epsilon, self.loss_spread or 0.0)


def shape_key(lane: dict[str, Any], policy: Policy, device: Optional[str] = None) -> str:
    """The lane without any feature toggle or replication key: stays the same when a default flips. ``device``:
    the device class the arms ran on, which ``hardware.device: auto`` resolves to (``ablate.config.lane_shape``).

    A lane key hashes the baseline lane, so promoting a value changes the key of every later campaign; the
    shape key is what links recorded evidence to later measurements of "the same lane" for revalidation.
    """
    skip = {spec.path for spec in FEATURES.values()} | set(policy.matching.replication_keys)
    text = json.dumps({k: v for k, v in on_device(lane, device).items() if k not in skip}, sort_keys=True,
                      default=str)
    return "shape-" + hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class LaneState:
    lane_key: str
    shape_key: str
    last_at: str
    current_fingerprint: str
    fingerprints: list[str]
    """Every fingerprint seen on the lane, oldest first."""
    lane: dict[str, Any]
    hosts: list[str]
    devices: dict[str, DeviceRuns] = field(default_factory=dict)
    """Device class -> what ran there last: an ``auto`` lane's key is the same on every device, and a record won on
    one device is about the software that device runs (``defaults_writer.find_revalidations``)."""


@dataclass(frozen=True)
class DeviceRuns:
    shape_key: str
    last_at: str
    current_fingerprint: str


@dataclass
class TestEvidence:
    feature: str
    value: Any
    baseline_value: Any
    kind: str
    lane_key: str
    software_fingerprint: str
    blocks: list[Block]
    superseded: list[Block] = field(default_factory=list)
    rounds: list[RoundInfo] = field(default_factory=list)
    refused_gates: list[tuple[str, ArmView]] = field(default_factory=list)
    """(block id, candidate arm) of refused blocks of this test whose candidate carries a gated code."""
    refused_blocks: int = 0
    """Refused blocks of the test that carry a gate on either arm (``refused_gates`` lists the candidates')."""
    refused_baseline_gated: int = 0
    """Of those, the blocks whose baseline arm carried a gate about what ran (``Refusal.baseline_gated``)."""
    refused_failures: list[Refusal] = field(default_factory=list)
    """Refused blocks of this test that hold a failed arm (``Refusal.failures``): they hold it, never reject it."""
    unread: list[UnreadArm] = field(default_factory=list)
    """Arms of this test (or A/A arms of its lane) under its fingerprint whose receipts could not be read."""
    calibration: Optional[Calibration] = None
    """From the lane's A/A blocks of this test's own rounds (``organise``)."""
    calibration_then: list[tuple[str, Calibration]] = field(default_factory=list)
    """Sequential policies only: (sweep id, calibration from the A/A blocks of this test's sweeps that started no
    later than it), sweeps in start order; the last is ``calibration``. The SPRT judges each look with the one it
    had, so a later round cannot reopen a decision (``ablate.promote.sequential``)."""

    @property
    def key(self) -> str:
        return f"{self.feature}={json.dumps(self.value, default=str)}@{self.lane_key}"

    @property
    def counted_rounds(self) -> list[RoundInfo]:
        return [r for r in self.rounds if r.counted]


OVERLAP_SLACK_S = 1.0
"""Clock slack when asking whether a sweep started before the previous one's last receipt was written."""


def merge_sweeps(sweeps: list[str], windows: dict[str, SweepWindow], policy: Policy) -> list[tuple[list[str], str]]:
    """Group sweep ids into rounds: separate runs in time. Returns (sweep ids, why merged) per round, oldest first.

    A sweep joins the round before it when it started less than ``evidence.min_round_gap_s`` after that round's
    first start, or before that round's last receipt was written (they ran at the same time, or one run was
    relabelled into two sweep ids): neither is a repetition at another time, which is what a round is for.
    """
    ordered = sorted(sweeps, key=lambda s: (windows[s].start, s))
    groups: list[tuple[list[str], list[str]]] = []
    start = end = 0.0
    for sweep in ordered:
        w = windows[sweep]
        if groups:
            gap = w.start - start
            if gap < policy.evidence.min_round_gap_s:
                groups[-1][0].append(sweep)
                groups[-1][1].append(f"{sweep} started {gap:.0f} s after {groups[-1][0][0]} (less than "
                                     f"evidence.min_round_gap_s = {policy.evidence.min_round_gap_s:g} s)")
                end = max(end, w.end)
                continue
            if w.start < end - OVERLAP_SLACK_S:
                groups[-1][0].append(sweep)
                groups[-1][1].append(f"{sweep} started {end - w.start:.0f} s before {groups[-1][0][-2]}'s "
                                     f"last receipt: the sweeps ran at the same time")
                end = max(end, w.end)
                continue
        groups.append(([sweep], []))
        start, end = w.start, w.end
    return [(members, "; ".join(notes)) for members, notes in groups]


def _rounds(blocks: list[Block], policy: Policy, windows: Optional[dict[str, SweepWindow]] = None) -> list[RoundInfo]:
    by_round: dict[str, list[Block]] = defaultdict(list)
    for block in blocks:
        by_round[block.round_id].append(block)
    windows = windows or sweep_windows(blocks)
    rounds = []
    for sweeps, note in merge_sweeps(list(by_round), windows, policy):
        members = [b for sweep in sweeps for b in by_round[sweep]]
        stamps = sorted(b.created_at for b in members)
        hosts = len({b.host for b in members})
        rounds.append(RoundInfo(round_id=" + ".join(sweeps), num_blocks=len(members), first_at=stamps[0],
                                last_at=stamps[-1], counted=policy.evidence.round_counts(len(members), hosts),
                                members=tuple(sweeps), note=note, num_hosts=hosts))
    return rounds


def _measurable(blocks: list[Block], policy: Policy) -> list[Block]:
    """The blocks that give their test a ratio (analysis's rows): a round is counted on these only, or blocks whose
    baseline failed (no ratio) would make a one-block round a confirming one (found in review)."""
    return [b for b in blocks
            if not b.candidate.gated_codes and b.log_ratio(policy.failures.failed_log_ratio) is not None]


def rounds_of_test(blocks: list[Block], policy: Policy, windows: dict[str, SweepWindow]) -> list[RoundInfo]:
    """A test's rounds, counted on its measurable blocks (``windows``: of every block read, as ``organise``)."""
    return _rounds(_measurable(blocks, policy), policy, windows)


def _calibrate(lane_key: str, fingerprint: str, blocks: list[Block], policy: Policy) -> Calibration:
    rows = [(b.host, r) for b, r in ((b, b.log_ratio(policy.failures.failed_log_ratio)) for b in blocks)
            if r is not None]
    ratios = np.asarray([r for _, r in rows], dtype=float)
    losses = [d for d in (b.loss_delta() for b in blocks) if d is not None]
    stamps = sorted(b.created_at for b in blocks)
    interval: Optional[tuple[float, float]] = None
    bound: Optional[float] = None
    if ratios.size >= 2:
        hosts = np.asarray([h for h, _ in rows], dtype=object)
        rng = np.random.default_rng([policy.bootstrap.seed, zlib.crc32(f"aa@{lane_key}".encode())])
        theta = bootstrap_hl(ratios, bootstrap_clusters(hosts), policy.bootstrap.resamples, rng)
        tail = (1.0 - policy.threshold.bias_confidence) / 2.0
        interval = (quantile(theta, tail), quantile(theta, 1.0 - tail))
        bound = max(abs(interval[0]), abs(interval[1]))
    return Calibration(
        lane_key=lane_key, software_fingerprint=fingerprint, num_blocks=int(ratios.size),
        noise_floor_log=abs_quantile(ratios, policy.threshold.noise_quantile) if ratios.size else None,
        # Never above the largest A/A delta (the median of a handful of blocks, scaled up, is noisy), never set by
        # one wild block (the empirical 0.95 quantile of a handful is their largest): the smaller of the two.
        loss_spread=min(normal_abs_quantile(losses, policy.quality.spread_quantile),
                        abs_quantile(losses, policy.quality.spread_quantile)) if losses else None,
        aa_hl_log=hodges_lehmann(ratios) if ratios.size else None, aa_interval_log=interval, bias_bound_log=bound,
        first_at=stamps[0] if stamps else None, last_at=stamps[-1] if stamps else None,
        aa_var_log=float(np.var(ratios, ddof=1)) if ratios.size >= 2 else None,
        hosts=tuple(sorted({h for h, _ in rows})))


def startup_outliers(blocks: list[Block]) -> dict[str, str]:
    """Blocks whose two arms' executor start-up differ beyond the lane's usual spread: block id -> why.

    Start-up is excluded from the comparison because no feature can change it; a block where it differs a lot
    anyway means either a disturbed node or a feature that does work before its toggle is read — worth a look.
    """
    by_lane: dict[str, list[tuple[Block, float]]] = defaultdict(list)
    for block in blocks:
        ratio = block.startup_log_ratio()
        if ratio is not None:
            by_lane[block.lane_key].append((block, ratio))
    flagged: dict[str, str] = {}
    for rows in by_lane.values():
        values = np.asarray([r for _, r in rows])
        median = float(np.median(values))
        mad = float(np.median(np.abs(values - median)))
        limit = max(STARTUP_FLAG_FLOOR, STARTUP_FLAG_MADS * mad)
        for block, ratio in rows:
            if abs(ratio - median) > limit:
                flagged[block.block_id] = (f"start-up {block.candidate.startup_s:.2f}s vs baseline "
                                           f"{block.baseline.startup_s:.2f}s (lane's usual spread "
                                           f"±{math.expm1(limit):.0%})")
    return flagged


def _lane_states(blocks: list[Block], policy: Policy) -> dict[str, LaneState]:
    by_lane: dict[str, list[Block]] = defaultdict(list)
    for block in blocks:
        by_lane[block.lane_key].append(block)
    states = {}
    for lane_key, members in by_lane.items():
        members.sort(key=lambda b: (epoch_s(b.created_at), b.round_id))
        fingerprints: list[str] = []
        for block in members:
            if block.software_fingerprint not in fingerprints:
                fingerprints.append(block.software_fingerprint)
        # The most recent block defines the lane's current software: older evidence no longer describes it.
        current = members[-1].software_fingerprint
        fingerprints.remove(current)
        fingerprints.append(current)
        # The newest block that names its device (an arm that died unobserved names none) resolves an auto lane.
        device = next((b.device_class for b in reversed(members) if b.device_class), "")
        newest = {b.device_class: b for b in members if b.device_class}  # oldest first: the last one stays
        # One shape per device hashed, not one per block (~20 us each, on the promotion's serial path).
        devices = {d: DeviceRuns(shape_key(b.lane, policy, d), b.created_at, b.software_fingerprint)
                   for d, b in newest.items()}
        states[lane_key] = LaneState(lane_key=lane_key, shape_key=shape_key(members[-1].lane, policy, device),
                                     last_at=members[-1].created_at, current_fingerprint=current,
                                     fingerprints=fingerprints,
                                     lane=members[-1].lane, hosts=sorted({b.host for b in members}),
                                     devices=devices)
    return states


@dataclass(frozen=True)
class SoftwarePlaces:
    """What places a refused arm in one lane (``placed_failures``), computed once per lane and current software."""

    current: frozenset[str]
    current_keys: frozenset[str]
    seen_prints: frozenset[str]
    seen_keys: frozenset[str]
    newest: Optional[float]

    @classmethod
    def of(cls, current: Iterable[str], lane_blocks: list[Block]) -> "SoftwarePlaces":
        current = frozenset(current)
        return cls(current=current,
                   current_keys=frozenset(b.software_key for b in lane_blocks if b.software_fingerprint in current),
                   seen_prints=frozenset(b.software_fingerprint for b in lane_blocks),
                   seen_keys=frozenset(b.software_key for b in lane_blocks),
                   newest=max((epoch_s(b.created_at) for b in lane_blocks), default=None))


def placed_failures(refusal: Refusal, places: SoftwarePlaces) -> Optional[Refusal]:
    """``refusal`` with ``failures`` counted over its arms that belong to the lane's current test, or None when no
    failed arm does. An arm belongs when it ran the current fingerprint, or its packages and code (another machine,
    or one that died before observing its hardware); not when a matched block of the lane ran its software (that
    software's own, superseded or other, evidence). Software no matched block ran belongs when written after the
    lane's newest block: newer than the evidence, it holds the current test, as an unread arm's does (found in
    review: a newer software's crashes in refused blocks only were dropped and the old evidence promoted; and one
    block's crashes were all placed by whichever receipt was read last)."""
    def here(arm: RefusedArm) -> bool:
        if arm.fingerprint in places.current or arm.software in places.current_keys:
            return True
        if arm.fingerprint in places.seen_prints or arm.software in places.seen_keys:
            return False
        return places.newest is None or epoch_s(arm.created_at) > places.newest

    placed = [arm for arm in refusal.arms_run if here(arm)]
    if not any(arm.failed for arm in placed):
        return None
    counts = {role: {"failed": sum(a.failed for a in placed if a.role == role),
                     "arms": sum(a.role == role for a in placed)} for role in ("baseline", "candidate")}
    return dataclasses.replace(refusal, failures=counts, arms_run=tuple(placed))


def organise(blocks: list[Block], policy: Policy, refusals: Iterable[Refusal] = (),
             unread: Iterable[UnreadArm] = (), windows: Optional[dict[str, SweepWindow]] = None
             ) -> tuple[list[TestEvidence], dict[str, Calibration], dict[str, LaneState]]:
    """Tests (sorted by feature, lane, value), per-lane calibration under the current fingerprint, lane states.
    ``refusals``: the candidate gates they carry join their test's (same feature, value, lane, fingerprint).
    ``unread``: arms whose receipts could not be read join every test they may have been evidence for (their
    value is not compared: a damaged receipt's value is not trusted to route it). ``windows``: each sweep's time
    span over every block read, bundle blocks included (default: over ``blocks``)."""
    unread, refusals = list(unread), list(refusals)
    lanes = _lane_states(blocks, policy)
    aa_current: dict[str, list[Block]] = defaultdict(list)
    grouped: dict[tuple[str, str, str], list[Block]] = defaultdict(list)
    for block in blocks:
        if block.is_aa:
            if block.software_fingerprint == lanes[block.lane_key].current_fingerprint:
                aa_current[block.lane_key].append(block)
            continue
        grouped[(str(block.feature), json.dumps(block.value, default=str), block.lane_key)].append(block)
    calibrations = {lane_key: _calibrate(lane_key, state.current_fingerprint, aa_current.get(lane_key, []), policy)
                    for lane_key, state in lanes.items()}
    # A test's noise floor and bias bound come from the A/A blocks that ran beside its own blocks (same sweeps):
    # a bias its rounds show must not be washed out by quiet A/A blocks of another campaign or week in the lane,
    # which would shrink delta and promote a feature that is not faster (found in review). Tests of one lane
    # over the same rounds share one calibration.
    own: dict[tuple[str, frozenset[str]], Calibration] = {}

    def calibration_of(lane_key: str, rounds: frozenset[str]) -> Calibration:
        if (lane_key, rounds) not in own:
            state = lanes[lane_key]
            beside = [b for b in aa_current.get(lane_key, []) if b.round_id in rounds]
            own[(lane_key, rounds)] = (calibrations[lane_key] if len(beside) == len(aa_current.get(lane_key, []))
                                       else _calibrate(lane_key, state.current_fingerprint, beside, policy))
        return own[(lane_key, rounds)]

    def calibration_then(lane_key: str, sweeps: set[str]) -> list[tuple[str, Calibration]]:
        if not policy.sequential.enabled:
            return []
        ordered = sorted(sweeps, key=lambda s: (windows[s].start, s))
        return [(sweep, calibration_of(lane_key, frozenset(ordered[:j + 1]))) for j, sweep in enumerate(ordered)]

    windows = windows or sweep_windows(blocks)
    by_lane: dict[str, list[Block]] = defaultdict(list)
    for block in blocks:
        by_lane[block.lane_key].append(block)
    places: dict[str, SoftwarePlaces] = {}
    crashes: dict[tuple[Any, Any, Any], list[Refusal]] = defaultdict(list)
    for refusal in refusals:
        if refusal.failures:
            crashes[(refusal.feature, refusal.value, refusal.lane_key)].append(refusal)
    tests = []
    for (feature, _, lane_key), members in sorted(grouped.items()):
        current = lanes[lane_key].current_fingerprint
        kept = [b for b in members if b.software_fingerprint == current]
        old = [b for b in members if b.software_fingerprint != current]
        first = (kept or members)[0]
        value = json.dumps(first.value, default=str)
        refused = [r for r in refusals if (r.gated_candidates or r.baseline_gated) and r.feature == feature and
                   r.value == value and r.lane_key == lane_key and r.software_fingerprint == current]
        gates = [(r.block_id, view) for r in refused for view in r.gated_candidates]
        if lane_key not in places:
            places[lane_key] = SoftwarePlaces.of({current}, by_lane[lane_key])
        failing = [placed for r in crashes.get((feature, value, lane_key), ())
                   for placed in [placed_failures(r, places[lane_key])] if placed is not None]
        tests.append(TestEvidence(
            feature=feature, value=first.value, baseline_value=first.baseline_value, kind=first.kind,
            lane_key=lane_key, software_fingerprint=current, blocks=kept, superseded=old,
            rounds=rounds_of_test(kept, policy, windows), refused_gates=gates,
            refused_blocks=len({r.block_id for r in refused}),
            refused_baseline_gated=len({r.block_id for r in refused if r.baseline_gated}),
            refused_failures=failing,
            unread=[arm for arm in unread if arm.concerns(feature, lane_key, current)],
            calibration=calibration_of(lane_key, frozenset(b.round_id for b in kept)),
            calibration_then=calibration_then(lane_key, {b.round_id for b in kept})))
    return tests, calibrations, lanes
