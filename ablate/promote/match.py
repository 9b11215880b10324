"""Pair receipts into blocks, and refuse (with the reason) everything that is not a matched pair.

How to use: ``blocks, refusals = match_blocks(receipts, policy)``. A block is the unit of evidence: a baseline
arm and a candidate arm (or two A/A twins) run back to back on one host. Inside a block only the feature under
test may differ: both arms must agree on the flattened lane (except the feature's own path), tokens per step,
data fingerprint, software fingerprint, host, round and lane key. Across blocks of one lane key only the
policy's replication keys (seed) and the host may differ. Nothing is ever paired silently: every receipt ends
up in a block or in a ``Refusal`` whose reason names the mismatch.

The block's statistic is the log ratio of the two arms' projected time to the lane's horizon (the receipts'
``projection``; see ``ablate.receipts.derive``), so executor start-up, which no feature can change, never
enters it. Gates are exact on every candidate arm, failed or not: any code of a gated severity except
ARM_FAILED (the failure itself, a loss in the failure rates), a requested backend that did not run, a missing
exact counter, and an *observed* inert toggle (the candidate's execution record equals its own baseline's).

Three kinds of receipt never pair at all: one made by the test-only no-op arm executor (``identity.executor``
``simulated``, ``trainers.simulate``: no arm ran), one stating a feature value the registry does not know (it would be
promoted into ``defaults.yaml`` and printed into the report verbatim), and one whose per-step timings are
identical to another receipt id's (a replayed measurement: both copies are refused, by name).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np

from ablate.config.backends import fell_back
from ablate.config.features import BUNDLE, FEATURES
from ablate.config.lane_shape import DEVICE_CLASSES
from ablate.config.load import default_lane_with
from ablate.config.schema import ConfigError
from ablate.parallel import fork_map
from ablate.promote.policy import Policy
from ablate.receipts.derive import project_time
from ablate.receipts.schema import SIMULATED_EXECUTOR, WARN_CODES, Receipt, utc_moment

# Identity fields both arms of a block must share; a difference means the two runs are not one comparison.
_SHARED_IDENTITY = ("sweep_id", "campaign", "lane_key", "feature", "kind", "host", "software_fingerprint", "pairing",
                    "code_fingerprint", "hardware_fingerprint", "schedule")
# ``identity.feature`` of a bundle block: the candidate arm runs every value of ``feature_value`` (a mapping
# feature -> value, two or more registered speed features) together, against ``baseline_value`` (feature -> old
# value); nothing else in the lane differs. Judged by ``ablate.promote.bundle``, never a promotion test itself.
_OBSERVED_IDENTITY = ("software_fingerprint", "hardware_fingerprint", "pairing")
"""What an arm's worker observed (its hardware is hashed into both fingerprints; whether it took turns with its
partner): an arm whose worker died before reporting (a kill, a segfault, a timeout) has no fingerprint and is
written as not paired, so these are compared through their parts instead (software versions here; code, host and
lane above), and its failure stays in the block as a loss (found in review: an interleaved block whose candidate
crashed was refused for "arms differ in pairing", its failure dropped, and the test promoted)."""
FAILURE_CODE = "ARM_FAILED"
"""The only code a failed arm is spared at the gate: it *is* the failure, which counts as a loss instead."""

NOT_THE_FEATURES = frozenset({"LOW_PRIORITY", "HARDWARE_MISMATCH", "BACKEND_FAILED_NODE_CHECK", "INERT_TOGGLE"})
"""Gated codes that say nothing about what the feature made go wrong: a node's facts (its priority, its hardware, a
failed node check) and INERT_TOGGLE (the feature did nothing). A revalidation demotes on the others only."""


def moment_text(stamp: str) -> str:
    """A receipt's ``created_at`` spelled one way, ``datetime.isoformat`` of its UTC moment, so that text order is
    time order: the validator takes every spelling of the moment (``Z``, ``-00:00``, ISO-8601's basic format
    ``20260302T090300+00:00``), and the sequential test orders and cuts blocks by these strings. A basic-format
    stamp sorted after every extended one whatever its date, so an older round was read last and a rejection that
    stood became a PROMOTE (found in review)."""
    moment = utc_moment(stamp)
    return moment.isoformat() if moment is not None else stamp


def feature_gates(codes: Iterable[str]) -> set[str]:
    """The gated codes among ``codes`` that say what went wrong in the run (``NOT_THE_FEATURES`` left out)."""
    return set(codes) - NOT_THE_FEATURES


@dataclass(frozen=True)
class ArmView:
    """The few facts of one receipt that promotion uses (keeps the hot loops off pydantic objects)."""

    receipt_id: str
    role: str
    arm_index: int
    order: int
    attempt: int
    status: str
    tokens_per_s: Optional[float]
    """Projected tokens/s at the lane's horizon (``projection.tokens_per_s``): the promotion metric."""
    loss: Optional[float]
    codes: tuple[str, ...]
    gated_codes: tuple[str, ...]
    counters: dict[str, Optional[int]]
    peak_memory: Optional[int]
    created_at: str
    git_sha: Optional[str]
    git_dirty: Optional[bool]
    one_time_s: Optional[float] = None
    recurring_step_s: Optional[float] = None
    warm_budget_steps: int = 0
    startup_s: Optional[float] = None
    """Executor start-up (badput ``startup``): recorded, never compared; a block whose arms differ is flagged."""
    wall_s: Optional[float] = None
    contended: bool = False
    device_class: str = ""
    threads: Optional[int] = None
    """torch intra-op threads the arm ran with (observed), for the report's lane line."""
    execution: str = ""
    """What actually ran (resolved backends, compile posture, warmup as resolved, engine, model structure)."""
    gate_details: tuple[str, ...] = ()
    host: str = ""
    """The arm's own host (a refused block's gated arm has no block to say it)."""
    joules_per_token: Optional[float] = None
    energy_source: Optional[str] = None
    """Where ``joules_per_token`` came from (``Receipt.energy``); reported beside the speed-up, never decided on."""

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def projected_s(self, horizon: int) -> Optional[float]:
        if self.one_time_s is None or self.recurring_step_s is None or self.recurring_step_s <= 0:
            return None
        return project_time(self.one_time_s, self.recurring_step_s, self.warm_budget_steps, horizon)


@dataclass
class Block:
    block_id: str
    round_id: str
    campaign: str
    lane_key: str
    software_fingerprint: str
    feature: Optional[str]
    value: Any
    baseline_value: Any
    kind: str
    host: str
    seed: Any
    baseline: ArmView
    candidate: ArmView
    """For A/A blocks: arm_index 0 is ``baseline`` and arm_index 1 is ``candidate``."""
    created_at: str
    lane: dict[str, Any]
    family_share: dict[str, Optional[float]]
    layer_counts: dict[str, int]
    earlier_failures: dict[str, int] = field(default_factory=dict)
    """Failed earlier attempts per role: a retried arm's failure still counts in the failure rates."""
    horizon_steps: int = 0
    tokens_per_step: int = 0
    device_class: str = ""
    schedule: str = "fixed"
    """``identity.schedule`` of both arms: until_decided blocks are judged by a sequential policy only."""
    earlier_gated: tuple[ArmView, ...] = ()
    """Candidate arms of earlier attempts (a retried block) that carry a gated code: each gates its test as the
    standing candidate's would, although only the latest attempt's pair is measured."""
    earlier_baseline_gated: bool = False
    """A baseline arm of an earlier attempt carried a gate about what ran (not in ``NOT_THE_FEATURES``): the other
    side of a revalidation's "gated more often than the baseline", as ``earlier_gated`` is the candidate's."""
    failure_hosts: tuple[str, ...] = ()
    """Hosts of the block's failed candidate arms, each its own (a retry may run on another node than ``host``)."""
    software_key: str = ""
    """``software_key`` of the arm whose fingerprint the block carries: places a refused block's crashes
    (``evidence.placed_failures``)."""

    @property
    def is_aa(self) -> bool:
        return self.feature is None

    @property
    def candidate_first(self) -> bool:
        return self.candidate.order == 0

    def log_ratio(self, failed_log_ratio: float, horizon: Optional[int] = None) -> Optional[float]:
        """log(baseline time / candidate time) to the horizon (the lane's by default): > 0 means the candidate
        finishes the production run sooner. None when the baseline failed (no yardstick)."""
        if self.baseline.failed:
            return None
        if self.candidate.failed:
            return failed_log_ratio
        h = horizon or self.horizon_steps
        base, cand = self.baseline.projected_s(h), self.candidate.projected_s(h)
        if base is None or cand is None or base <= 0 or cand <= 0:
            return None
        return math.log(base / cand)

    def steady_log_ratio(self) -> Optional[float]:
        """log(baseline / candidate recurring step time): the speed-up once every one-time cost is paid."""
        b, c = self.baseline.recurring_step_s, self.candidate.recurring_step_s
        if self.baseline.failed or self.candidate.failed or not b or not c or b <= 0 or c <= 0:
            return None
        return math.log(b / c)

    def one_time_delta(self) -> Optional[float]:
        """Candidate minus baseline one-time cost (setup + compile warmup), seconds."""
        b, c = self.baseline.one_time_s, self.candidate.one_time_s
        if self.baseline.failed or self.candidate.failed or b is None or c is None:
            return None
        return c - b

    def startup_log_ratio(self) -> Optional[float]:
        b, c = self.baseline.startup_s, self.candidate.startup_s
        if not b or not c or b <= 0 or c <= 0:
            return None
        return math.log(c / b)

    def loss_delta(self) -> Optional[float]:
        if self.baseline.loss is None or self.candidate.loss is None:
            return None
        if not (math.isfinite(self.baseline.loss) and math.isfinite(self.candidate.loss)):
            return None
        return self.candidate.loss - self.baseline.loss

    def receipt_ids(self) -> tuple[str, str]:
        return self.baseline.receipt_id, self.candidate.receipt_id


def winner(log_ratio: float) -> str:
    """Which arm a block's log ratio (``Block.log_ratio``) favours: > 0 means the candidate finished sooner."""
    return "candidate" if log_ratio > 0 else "baseline" if log_ratio < 0 else "tie"


@dataclass(frozen=True)
class Refusal:
    """Receipts that could not be used as evidence, and why (shown in the report, never dropped silently)."""

    reason: str
    receipt_ids: tuple[str, ...]
    block_id: str
    feature: Optional[str]
    lane_key: Optional[str]
    round_id: Optional[str]
    gated_candidates: tuple[ArmView, ...] = ()
    """Candidate arms of a refused block that carry a gated code (its baseline was disqualified, its partner is
    missing or aborted): the block measures nothing, but a candidate's fallback or OOM still gates its test."""
    value: Optional[str] = None
    """JSON of the candidate's feature value, and the fingerprint it ran under: which test those gates belong to."""
    software_fingerprint: Optional[str] = None
    baseline_gated: bool = False
    """Its baseline arm carried a gate about what ran (not a node's fact, nor INERT_TOGGLE): the other side of a
    revalidation's "gated more often than the baseline" (such a block is refused, so no kept block shows it)."""
    failures: dict[str, dict[str, int]] = field(default_factory=dict)
    """Role -> {"failed", "arms"}: the baseline and candidate arms (aborted ones left out, as a matched block leaves
    them) of a refused block that holds a failed arm and a candidate, when its arms ran their test but could not be
    paired (a partner missing or aborted, a disqualified baseline, a retry's pair that differs across attempts).
    Nothing is measured on them, and they cannot be told from a copy, so they only hold their test
    (``failure_rate``), never reject it (found in review: a candidate that crashed on every attempt of a
    candidate-first block left no baseline, the block was refused as unpaired, its crashes vanished and the test
    promoted; so did a retry's crash on another node, refused for "arms differ in host")."""
    arms_run: tuple["RefusedArm", ...] = ()
    """The arms ``failures`` counts, each to be placed on its own (``evidence.placed_failures``): a retry may have run
    on other hardware or under other code than the attempt before it."""
    ran_a_registered_value: bool = True
    """False for simulated arms (no arm ran) and an unregistered value (not a value the registry can promote): such a
    block says nothing about how the feature's values do in its lane (``engine._unjudged_lanes``)."""


@dataclass(frozen=True)
class RefusedArm:
    """One baseline or candidate arm of a refused block that ``Refusal.failures`` counts."""

    role: str
    failed: bool
    fingerprint: Optional[str]
    """Its own ``software_fingerprint``; an arm that died before observing its hardware takes an observed arm's of
    the same attempt, else None (``software`` places it)."""
    software: str
    """``software_key``: the packages and arm code it ran, known even when it observed nothing."""
    created_at: str


def execution_record(receipt: Receipt) -> dict[str, Any]:
    """What an arm actually executed, from observation only: two arms with equal records ran the same code."""
    obs = receipt.observed
    return {"backends": sorted((b.op, b.observed) for b in obs.backends),
            "compile": [obs.compile.posture_observed, obs.compile.warmup_resolved],
            "engine": obs.engine, "model": obs.model}


def _threads(hardware: dict[str, Any]) -> Optional[int]:
    cpu = hardware.get("cpu") if isinstance(hardware.get("cpu"), dict) else hardware
    value = cpu.get("torch_threads") if isinstance(cpu, dict) else None
    return value if isinstance(value, int) else None


def device_class(receipt: Receipt) -> str:
    """The device type the arm ran on (``observed.hardware.kind``), else the one its lane names; "" when neither says
    (an arm that died before it observed its hardware, in a lane with ``hardware.device: auto``)."""
    observed = receipt.observed.hardware.get("kind")
    if observed:
        return str(observed)
    return receipt.requested.device if receipt.requested.device in DEVICE_CLASSES else ""


def _arm_view(receipt: Receipt, policy: Policy) -> ArmView:
    ident = receipt.identity
    failed = ident.status.value == "failed"
    gated = {d.code.value for d in receipt.disqualifiers
             if (d.severity.value in policy.gates.severities or d.code not in WARN_CODES)
             and d.code.value != FAILURE_CODE}
    details = [f"{d.code.value}: {d.detail[:160]}" for d in receipt.disqualifiers
               if d.code.value in gated]
    # Requested is not observed: a backend that fell back is never evidence for the value that asked for it,
    # whether or not the receipt carries the disqualifier.
    posture = str(receipt.requested.lane.get("compile.posture", "eager"))
    fallbacks = [f"{b.op}: requested {b.requested}, ran {b.observed}" for b in receipt.observed.backends
                 if fell_back(b.op, b.requested, b.observed, posture)]
    if fallbacks:
        gated.add("BACKEND_FALLBACK")
        details.append("BACKEND_FALLBACK: " + "; ".join(fallbacks))
    compile_record = receipt.observed.compile
    counters = {name: getattr(compile_record, name, None) for name in policy.gates.exact_counters}
    missing = sorted(name for name, value in counters.items() if value is None)
    if missing and not failed:
        # A counter nobody recorded cannot be compared exactly: it gates instead of silently passing.
        gated.add("COUNTER_MISSING")
        details.append(f"COUNTER_MISSING: {', '.join(missing)} not recorded")
    if ident.status.value == "disqualified" and not gated:
        gated = set(receipt.codes()) or {"DISQUALIFIED"}
    memory = receipt.memory
    peak = memory.peak_allocated_bytes if memory.kind == "cuda" else memory.peak_rss_bytes
    proj = receipt.projection
    return ArmView(
        receipt_id=ident.receipt_id, role=ident.arm.value, arm_index=ident.arm_index, order=ident.order,
        attempt=ident.attempt, status=ident.status.value,
        tokens_per_s=proj.tokens_per_s if proj is not None else None,
        loss=getattr(receipt.quality, policy.quality.metric, None), codes=tuple(sorted(receipt.codes())),
        gated_codes=tuple(sorted(gated)), counters=counters, peak_memory=peak,
        created_at=moment_text(ident.created_at),
        git_sha=ident.git_sha, git_dirty=ident.git_dirty, host=ident.host or "",
        one_time_s=proj.one_time_s if proj is not None else None,
        recurring_step_s=proj.recurring_step_s if proj is not None else None,
        warm_budget_steps=proj.warm_budget_steps if proj is not None else 0,
        startup_s=receipt.time.badput_s.get("startup"), wall_s=receipt.time.wall_s,
        contended=receipt.host_load.contended, device_class=device_class(receipt),
        threads=_threads(receipt.observed.hardware),
        execution=json.dumps(execution_record(receipt), sort_keys=True, default=str),
        gate_details=tuple(details),
        joules_per_token=receipt.energy.joules_per_token if receipt.energy is not None else None,
        energy_source=receipt.energy.source if receipt.energy is not None else None)


def _fmt(value: Any) -> str:
    return json.dumps(value, default=str)


def _lane_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k, "<absent>") != b.get(k, "<absent>"))


def _unobserved_failure(receipt: Receipt) -> bool:
    return receipt.identity.status.value == "failed" and receipt.identity.hardware_fingerprint is None


_RETRY_MAY_CHANGE = ("host", "software_fingerprint", "hardware_fingerprint", "code_fingerprint", "pairing")
"""What a retry of a block may run differently from the attempt before it (another node, a resumed sweep's code)."""


def _check_pair(base: Receipt, cand: Receipt, check_order: bool = True, node_too: bool = True) -> Optional[str]:
    """Why the two arms are not one matched block, or None when they are. ``node_too=False`` leaves out what a
    retry may change (``_RETRY_MAY_CHANGE``, packages, process preparation): the arms still ran one test."""
    bi, ci = base.identity, cand.identity
    roles = sorted((bi.arm.value, ci.arm.value))
    if roles not in (["baseline", "candidate"], ["aa", "aa"]):
        return f"arm roles {roles[0]} and {roles[1]} do not form a block (baseline+candidate or aa+aa)"
    unobserved = _unobserved_failure(base) or _unobserved_failure(cand)
    for name in _SHARED_IDENTITY:
        if (unobserved and name in _OBSERVED_IDENTITY) or (not node_too and name in _RETRY_MAY_CHANGE):
            continue
        if getattr(bi, name) != getattr(ci, name):
            return f"arms differ in {name}: {getattr(bi, name)!r} vs {getattr(ci, name)!r}"
    if unobserved and node_too and bi.software != ci.software:
        return f"arms differ in software: {bi.software!r} vs {ci.software!r}"
    base_how, cand_how = (bi.process.how if bi.process else None), (ci.process.how if ci.process else None)
    if base_how != cand_how and node_too:
        # A forked arm's process starts with the fork server's pages mapped (peak RSS) and its imports already
        # paid; a fresh interpreter's does not: only arms prepared the same way compare.
        return f"arms differ in process preparation: {base_how!r} vs {cand_how!r} (identity.process.how)"
    if check_order and sorted((bi.order, ci.order)) != [0, 1]:
        return f"arm orders {bi.order} and {ci.order}: one arm must run first (0) and the other second (1)"
    if base.requested.tokens_per_step != cand.requested.tokens_per_step:
        return (f"different work: tokens_per_step {base.requested.tokens_per_step} vs "
                f"{cand.requested.tokens_per_step}")
    if base.requested.data_fingerprint != cand.requested.data_fingerprint:
        return (f"different data: data_fingerprint {base.requested.data_fingerprint!r} vs "
                f"{cand.requested.data_fingerprint!r}")
    base_kind, cand_kind = base.observed.hardware.get("kind"), cand.observed.hardware.get("kind")
    if base_kind and cand_kind and base_kind != cand_kind:
        return f"arms ran on different device types: {base_kind} vs {cand_kind}"
    if bi.arm.value == "aa":
        diff = _lane_diff(base.requested.lane, cand.requested.lane)
        if diff:
            return f"A/A twins ran different lanes at {', '.join(diff[:5])}"
        return None
    if bi.feature == BUNDLE:
        return _check_bundle_pair(base, cand)
    if bi.feature not in FEATURES:
        return f"unknown feature {bi.feature!r}; registered: {', '.join(sorted(FEATURES))}"
    spec = FEATURES[bi.feature]
    if bi.kind != spec.kind:
        return f"receipt says kind {bi.kind!r} but the registry says {spec.kind!r} for {bi.feature}"
    # identity.feature_value is each arm's own value (the sweep writes the baseline's value on the baseline arm).
    if _fmt(bi.baseline_value) != _fmt(ci.baseline_value):
        return f"arms disagree on the baseline value: {bi.baseline_value!r} vs {ci.baseline_value!r}"
    if bi.feature_value is not None and str(bi.feature_value) != str(bi.baseline_value):
        return f"baseline arm says it ran {bi.feature_value!r}, not the baseline value {bi.baseline_value!r}"
    extra = [k for k in _lane_diff(base.requested.lane, cand.requested.lane) if k != spec.path]
    if extra:
        shown = ", ".join(f"{k} ({base.requested.lane.get(k)!r} vs {cand.requested.lane.get(k)!r})"
                          for k in extra[:4])
        return f"lanes differ beyond the feature under test ({spec.path}) at: {shown}"
    ran_base, ran_cand = base.requested.lane.get(spec.path), cand.requested.lane.get(spec.path)
    if str(ran_base) != str(bi.baseline_value):
        return f"baseline arm ran {spec.path}={ran_base!r}, not the declared baseline {bi.baseline_value!r}"
    if str(ran_cand) != str(ci.feature_value):
        return f"candidate arm ran {spec.path}={ran_cand!r}, not the tested value {ci.feature_value!r}"
    if str(ran_base) == str(ran_cand):
        return f"both arms ran {spec.path}={ran_base!r}: the candidate does not differ from its baseline"
    return None


def _check_bundle_pair(base: Receipt, cand: Receipt) -> Optional[str]:
    """Why a bundle pair is not old defaults vs every new value together (None when it is)."""
    new, old = cand.identity.feature_value, base.identity.baseline_value
    if not isinstance(new, dict) or not isinstance(old, dict) or sorted(new) != sorted(old) or len(new) < 2:
        return (f"a bundle block names two or more features with their new (feature_value) and old "
                f"(baseline_value) values, the same features in both; got {new!r} and {old!r}")
    if _fmt(cand.identity.baseline_value) != _fmt(old):
        return f"arms disagree on the bundle's old values: {old!r} vs {cand.identity.baseline_value!r}"
    unknown = [f for f in new if f not in FEATURES or FEATURES[f].kind != "speed"]
    if unknown:
        return f"bundle features {unknown} are not registered speed features"
    paths = {FEATURES[f].path: f for f in new}
    extra = [k for k in _lane_diff(base.requested.lane, cand.requested.lane) if k not in paths]
    if extra:
        return f"bundle lanes differ beyond the bundle's features at: {', '.join(extra[:4])}"
    for path, name in paths.items():
        ran_base, ran_cand = base.requested.lane.get(path), cand.requested.lane.get(path)
        if str(ran_base) != str(old[name]) or str(ran_cand) != str(new[name]) or str(ran_base) == str(ran_cand):
            return (f"bundle arm values at {path}: baseline ran {ran_base!r} (declared {old[name]!r}), candidate "
                    f"ran {ran_cand!r} (declared {new[name]!r}); each must run its own, and they must differ")
    return None


@functools.lru_cache(maxsize=4096)
def _unregistered(name: str, encoded: str) -> Optional[str]:
    """What the lane field of feature ``name`` allows, when the JSON-encoded value is not one of them; else None.

    Exact: the lane must hold the value itself, not a coercion of it (OmegaConf reads ``"true"`` and ``1`` as a
    bool, ``"25"`` as a float, ``"MoEDispatch.jagged"`` as ``jagged``): a receipt's value is written into
    ``defaults.yaml`` and the report verbatim, so only the registry's own spelling is evidence.
    """
    value = json.loads(encoded)
    try:
        got = FEATURES[name].get(default_lane_with(name, value))
    except ConfigError as exc:
        return exc.allowed
    if isinstance(got, bool) != isinstance(value, bool) or type(value) not in (str, int, float, bool) or \
            got != value:
        try:  # what the field allows, as the loader words it: provoke its error with a value nothing accepts
            default_lane_with(name, "\x00")
        except ConfigError as exc:
            return f"{exc.allowed}, spelled exactly so; this value only coerces to {got!r}"
        return f"values spelled exactly as the lane field holds them; this one only coerces to {got!r}"
    return None


_PLAIN_SCALARS = (str, int, bool, type(None))
"""Values whose JSON spelling is a function of (type, value) and never fails; floats are left to the JSON path
(``-0.0``, NaN)."""


@functools.lru_cache(maxsize=4096)
def _unregistered_scalar(name: str, kind: type, value: Any) -> Optional[str]:
    # Keyed on the type too (True == 1); saves one json.dumps per stated value, ~10 per receipt.
    return _unregistered(name, json.dumps(value, sort_keys=True, allow_nan=False))


def unregistered_values(receipt: Receipt) -> list[str]:
    """Every feature value the receipt states (its lane, its tested and baseline value) that the feature registry
    does not know, described; empty when all are registered. Such a value never pairs, never reaches a report
    heading or ``defaults.yaml``."""
    ident = receipt.identity
    stated: list[tuple[str, str, Any]] = [(f"requested.lane[{spec.path!r}]", name, receipt.requested.lane[spec.path])
                                          for name, spec in FEATURES.items() if spec.path in receipt.requested.lane]
    if ident.feature == BUNDLE:
        for field_name in ("feature_value", "baseline_value"):
            values = getattr(ident, field_name)
            if not isinstance(values, dict) or any(name not in FEATURES for name in values):
                return [f"identity.{field_name} of a bundle must map registered features to values; got {values!r}"]
            stated += [(f"identity.{field_name}[{name!r}]", name, value) for name, value in values.items()]
    elif ident.feature is not None:
        if ident.feature not in FEATURES:
            return [f"identity.feature {ident.feature!r} is not a registered feature; registered: "
                    f"{', '.join(sorted(FEATURES))}"]
        stated += [("identity.feature_value", ident.feature, ident.feature_value),
                   ("identity.baseline_value", ident.feature, ident.baseline_value)]
    problems = []
    for where, name, value in stated:
        if value is None and where.startswith("identity."):
            continue  # older receipts leave the identity's values out; the lane (checked too) says what ran
        if type(value) in _PLAIN_SCALARS:
            allowed = _unregistered_scalar(name, type(value), value)
        else:
            try:
                encoded = json.dumps(value, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError):
                problems.append(f"{where} = {value!r} is not a registered value of {name}")
                continue
            allowed = _unregistered(name, encoded)
        if allowed is not None:
            problems.append(f"{where} = {value!r} is not a registered value of {name} (allowed: {allowed})")
    return problems


def _measurement_key(receipt: Receipt) -> Optional[str]:
    """Digest of the arm's raw per-step timings, or None when there are too few to identify a measurement.

    Wall-clock step times are measured to the nanosecond: two real arms never record the same series, so two
    receipt ids carrying one series are one measurement filed twice (a round copied as another round, a sweep
    relabelled), whatever their ids, timestamps or sweep ids say.
    """
    st = receipt.steps
    if len([s for s in st.step_s if s > 0]) < 2:
        return None
    series = (st.step_s, st.cadence_s, st.data_s, st.phase_s)
    # The float64 bytes of each series (the schema holds floats), after their lengths: the same series, the same
    # digest, in a third of the time of their JSON text (0.7 -> 0.2 s over 10,000 receipts).
    digest = hashlib.sha256(struct.pack("<4q", *map(len, series)))
    for values in series:
        digest.update(np.asarray(values, dtype="<f8").tobytes())
    return digest.hexdigest()


def find_replays(receipts: Iterable[Receipt]) -> dict[str, list[str]]:
    """Receipt id -> the other receipt ids carrying the identical per-step timing series (replayed evidence)."""
    by_key: dict[str, set[str]] = defaultdict(set)
    for receipt in receipts:
        key = _measurement_key(receipt)
        if key is not None:
            by_key[key].add(receipt.identity.receipt_id)
    return {rid: sorted(ids - {rid}) for ids in by_key.values() if len(ids) > 1 for rid in ids}


def _select_attempt(receipts: list[Receipt]) -> tuple[dict[int, Receipt], dict[str, int], bool, Optional[str]]:
    """The arms that stand for the block, failed arms of earlier attempts per role, whether the pair spans two
    attempts, or why the receipts are ambiguous.

    The sweep retries a whole block after a failed arm and stops an attempt at its first failed arm, so the
    latest attempt normally holds both arms. When the last attempt holds only a failed arm (retries ran out),
    it is paired with its partner from the latest earlier attempt: a failed candidate is still a loss and a
    failed baseline still a baseline failure; no throughput is ever compared across attempts.
    """
    by_attempt: dict[int, dict[int, Receipt]] = defaultdict(dict)
    for receipt in receipts:
        ident = receipt.identity
        if ident.arm_index in by_attempt[ident.attempt]:
            ids = [by_attempt[ident.attempt][ident.arm_index].identity.receipt_id, ident.receipt_id]
            return {}, {}, False, f"two receipts for arm_index {ident.arm_index} attempt {ident.attempt}: {ids}"
        by_attempt[ident.attempt][ident.arm_index] = receipt
    attempts = sorted(by_attempt)
    # A retry cut off after one arm that did not fail (the driver killed, the node preempted) measured nothing:
    # the block stands on the attempts before it, whose failed candidate is still a loss (found in review: the
    # block was refused for its missing partner, which dropped the earlier crashes and promoted the test).
    while len(attempts) > 1 and len(by_attempt[attempts[-1]]) == 1 and \
            next(iter(by_attempt[attempts[-1]].values())).identity.status.value != "failed":
        attempts.pop()
    chosen = dict(by_attempt[attempts[-1]])
    cross = False
    if len(chosen) == 1 and next(iter(chosen.values())).identity.status.value == "failed":
        missing = 1 - next(iter(chosen))
        for attempt in reversed(attempts[:-1]):
            if missing in by_attempt[attempt]:
                chosen[missing] = by_attempt[attempt][missing]
                cross = True
                break
    used = {id(r) for r in chosen.values()}
    earlier: dict[str, int] = Counter()
    for attempt in attempts:
        for receipt in by_attempt[attempt].values():
            if id(receipt) not in used and receipt.identity.status.value == "failed":
                earlier[receipt.identity.arm.value] += 1
    return chosen, dict(earlier), cross, None


def _refuse(reason: str, receipts: Iterable[Receipt], block_id: str, gates: Optional[Policy] = None,
            failures: bool = True, ran_a_registered_value: bool = True) -> Refusal:
    """``gates``: the policy, when the block's own candidate arms are trustworthy enough to gate their test.
    ``failures``: False when what failed cannot be told apart or placed (two receipts for one arm, replayed
    copies, simulated arms, an unregistered value), so their failures are not counted."""
    receipts = list(receipts)
    first = receipts[0].identity if receipts else None
    gated: tuple[ArmView, ...] = ()
    value = fingerprint = None
    baseline_gated = False
    if gates is not None:
        candidates = [r for r in receipts if r.identity.arm.value == "candidate"]
        # A code the baseline shares (low priority, a failed node check) is the host's, not the feature's.
        shared = {code for r in receipts if r.identity.arm.value != "candidate"
                  for code in _arm_view(r, gates).gated_codes}
        views = [_arm_view(r, gates) for r in candidates]
        gated = tuple(dataclasses.replace(view, gated_codes=tuple(c for c in view.gated_codes if c not in shared),
                                          gate_details=tuple(d for d in view.gate_details
                                                             if d.split(":", 1)[0] not in shared))
                      for view in views if set(view.gated_codes) - shared)
        baseline_gated = bool(feature_gates(shared))
        if candidates and (gated or baseline_gated):
            value = json.dumps(candidates[0].identity.feature_value, default=str)
            fingerprint = candidates[0].identity.software_fingerprint
    failures, arms_run = _refused_failures(receipts) if failures else ({}, ())
    if failures and value is None:
        value = json.dumps(next(r for r in receipts if r.identity.arm.value == "candidate").identity.feature_value,
                           default=str)
    return Refusal(reason=reason, receipt_ids=tuple(r.identity.receipt_id for r in receipts), block_id=block_id,
                   feature=first.feature if first else None, lane_key=first.lane_key if first else None,
                   round_id=first.sweep_id if first else None, gated_candidates=gated, value=value,
                   software_fingerprint=fingerprint, baseline_gated=baseline_gated, failures=failures,
                   arms_run=arms_run, ran_a_registered_value=ran_a_registered_value)


def software_key(ident: Any) -> str:
    """The packages and the arm code an arm ran, without the hardware: what an arm that died before observing its
    hardware still records (its ``software_fingerprint`` then hashes no hardware part)."""
    return json.dumps([ident.software, ident.code_fingerprint], sort_keys=True, default=str)


def _refused_failures(receipts: list[Receipt]) -> tuple[dict[str, dict[str, int]], tuple[RefusedArm, ...]]:
    """``Refusal.failures`` and ``arms_run`` of a refused block's receipts."""
    roles = {role: [r for r in receipts if r.identity.arm.value == role and r.identity.status.value != "aborted"]
             for role in ("baseline", "candidate")}
    failed = {role: [r for r in arms if r.identity.status.value == "failed"] for role, arms in roles.items()}
    if not roles["candidate"] or not (failed["baseline"] or failed["candidate"]):
        return {}, ()
    counts = {role: {"failed": len(failed[role]), "arms": len(roles[role])} for role in roles}
    observed = {r.identity.attempt: r.identity.software_fingerprint for arms in roles.values() for r in arms
                if not _unobserved_failure(r)}
    arms = tuple(RefusedArm(role=role, failed=r.identity.status.value == "failed",
                            fingerprint=(observed.get(r.identity.attempt) if _unobserved_failure(r)
                                         else r.identity.software_fingerprint),
                            software=software_key(r.identity), created_at=moment_text(r.identity.created_at))
                 for role, members in roles.items() for r in members)
    return counts, arms


def _make_block(block_id: str, receipts: list[Receipt], policy: Policy) -> Block | Refusal:
    latest, earlier_failed, cross_attempt, ambiguous = _select_attempt(receipts)
    if ambiguous:
        return _refuse(ambiguous, receipts, block_id, failures=False)
    if sorted(latest) != [0, 1]:
        present = ", ".join(f"{latest[i].identity.arm.value}#{i}" for i in sorted(latest))
        return _refuse(f"block has arm(s) {present} only: its partner arm is missing (never paired elsewhere)",
                       receipts, block_id, gates=policy)
    first, second = latest[0], latest[1]
    if first.identity.arm.value == "candidate":
        base, cand = second, first
    else:
        base, cand = first, second
    reason = _check_pair(base, cand, check_order=not cross_attempt)
    if reason:
        # A pair across attempts may differ in what a retry may change (its node, its code); any other mismatch, or
        # one within an attempt, says the arms did not run one test (another lane, value, work): not its crashes.
        ran_one_test = cross_attempt and _check_pair(base, cand, check_order=False, node_too=False) is None
        return _refuse(reason, receipts, block_id, failures=ran_one_test)
    base_view, cand_view = _arm_view(base, policy), _arm_view(cand, policy)
    for view in (base_view, cand_view):
        if view.status == "aborted":
            return _refuse(f"{view.role} arm #{view.arm_index} was aborted: neither evidence nor a failure",
                           receipts, block_id, gates=policy)
    aa = base_view.role == "aa"
    if not aa and not base_view.failed and not cand_view.failed and base_view.execution == cand_view.execution:
        # Observed inertness: the candidate ran exactly the code its own baseline ran, whatever the list predicted.
        cand_view = dataclasses.replace(
            cand_view, gated_codes=tuple(sorted({*cand_view.gated_codes, "INERT_TOGGLE"})),
            codes=tuple(sorted({*cand_view.codes, "INERT_TOGGLE"})),
            gate_details=(*cand_view.gate_details, "INERT_TOGGLE: observed: the candidate resolved the same "
                                                   "backends, compile posture, warmup, engine and model as its "
                                                   "baseline"))
    if base_view.gated_codes or (aa and cand_view.gated_codes):
        codes = ", ".join(sorted(set(base_view.gated_codes) | (set(cand_view.gated_codes) if aa else set())))
        what = "an A/A arm" if aa else "the baseline arm"
        return _refuse(f"{what} is disqualified ({codes}): the block cannot measure anything", receipts, block_id,
                       gates=None if aa else policy)
    if aa and (base_view.failed or cand_view.failed):
        return _refuse("an A/A arm failed: the block cannot calibrate the noise floor", receipts, block_id)
    standing = {id(base), id(cand)}
    earlier_gated = tuple(view for view in (_arm_view(r, policy) for r in receipts if id(r) not in standing
                                            and r.identity.arm.value == "candidate") if view.gated_codes)
    earlier_baseline_gated = any(feature_gates(_arm_view(r, policy).gated_codes) for r in receipts
                                 if id(r) not in standing and r.identity.arm.value == "baseline")
    ident = base.identity
    # A baseline whose worker died unobserved has no fingerprint of its own: the block is its candidate's.
    observed = cand.identity if _unobserved_failure(base) else ident
    return Block(
        block_id=block_id, round_id=ident.sweep_id, campaign=ident.campaign, lane_key=ident.lane_key,
        software_fingerprint=observed.software_fingerprint, feature=ident.feature,
        value=None if aa else cand.identity.feature_value, baseline_value=None if aa else ident.baseline_value,
        kind=ident.kind, host=ident.host, seed=base.requested.lane.get("seed"), baseline=base_view,
        candidate=cand_view, created_at=min(base_view.created_at, cand_view.created_at),
        lane=base.requested.lane, family_share=dict(base.family_share),
        layer_counts=dict(base.requested.layer_counts), earlier_failures=earlier_failed,
        failure_hosts=tuple(sorted({r.identity.host for r in receipts if r.identity.arm.value == "candidate"
                                    and r.identity.status.value == "failed"})),
        horizon_steps=int(base.requested.lane.get("budget.horizon_steps") or 0),
        tokens_per_step=base.requested.tokens_per_step, schedule=ident.schedule, earlier_gated=earlier_gated,
        earlier_baseline_gated=earlier_baseline_gated, software_key=software_key(observed),
        device_class=base_view.device_class if base_view.device_class else cand_view.device_class)


def _canonical_lane(block: Block, policy: Policy) -> str:
    skip = set(policy.matching.replication_keys)
    return json.dumps({k: v for k, v in block.lane.items() if k not in skip}, sort_keys=True, default=str)


def _enforce_lane_consistency(blocks: list[Block], policy: Policy) -> tuple[list[Block], list[Refusal]]:
    """Blocks sharing a lane key must share the baseline lane up to replication keys; the majority defines it."""
    by_lane: dict[str, list[tuple[str, Block]]] = defaultdict(list)
    for block in blocks:
        by_lane[block.lane_key].append((_canonical_lane(block, policy), block))
    kept: list[Block] = []
    refused: list[Refusal] = []
    for lane_key, entries in by_lane.items():
        majority, _ = Counter(c for c, _ in entries).most_common(1)[0]
        reference = next(b for c, b in entries if c == majority)
        for canonical, block in entries:
            if canonical == majority:
                kept.append(block)
                continue
            diff = [k for k in _lane_diff(reference.lane, block.lane) if k not in policy.matching.replication_keys]
            refused.append(Refusal(
                reason=(f"lane_key {lane_key} is shared with blocks whose baseline lane differs at "
                        f"{', '.join(diff[:5])}: not the same lane"),
                receipt_ids=block.receipt_ids(), block_id=block.block_id, feature=block.feature,
                lane_key=lane_key, round_id=block.round_id))
    return kept, refused


def match_blocks(receipts: Iterable[Receipt], policy: Policy) -> tuple[list[Block], list[Refusal]]:
    """Group receipts by block id, check each pair, and return (matched blocks, refusals with reasons)."""
    # Block ids restart in every sweep (b000, b001, ...): a block is identified by its round and its id.
    receipts = list(receipts)
    by_block: dict[str, list[Receipt]] = defaultdict(list)
    for receipt in receipts:
        by_block[f"{receipt.identity.sweep_id}/{receipt.identity.block_id}"].append(receipt)
    replays = find_replays(receipts)
    # Each block is checked on its own (~0.3 ms of pure Python; 5,000 blocks are 1.5 s): split over the CPUs when
    # the command owns its process (``ablate.parallel``), in block order either way.
    made = fork_map(lambda item: _matched(item[0], item[1], replays, policy), list(by_block.items()),
                    min_share=MATCH_MIN_SHARE)
    blocks = [m for m in made if isinstance(m, Block)]
    refusals = [m for m in made if isinstance(m, Refusal)]
    blocks, inconsistent = _enforce_lane_consistency(blocks, policy)
    return blocks, refusals + inconsistent


MATCH_MIN_SHARE = 500
"""Blocks per process below which matching stays in one process (a fork and the results' way back cost more)."""


def _matched(block_id: str, members: list[Receipt], replays: dict[str, list[str]], policy: Policy) -> Block | Refusal:
    """One block's receipts as a matched block, or why they are not one."""
    simulated = [r.identity.receipt_id for r in members if r.identity.executor == SIMULATED_EXECUTOR
                 or "simulated" in r.identity.software]
    if simulated:
        # First, before anything reads their figures: no-op arms of an orchestration test measure nothing.
        return _refuse(f"simulated arms ({', '.join(simulated[:2])}"
                       f"{f' and {len(simulated) - 2} more' if len(simulated) > 2 else ''}): made by "
                       f"the test-only no-op arm executor (trainers.simulate); no arm ran, so the block "
                       f"measures nothing and is never evidence", members, block_id, failures=False,
                       ran_a_registered_value=False)
    copied = [(r.identity.receipt_id, replays[r.identity.receipt_id]) for r in members
              if r.identity.receipt_id in replays]
    if copied:
        shown = "; ".join(f"{rid} has the per-step timings of {', '.join(others[:3])}" for rid, others in copied)
        return _refuse(f"replayed measurements: {shown}. A measurement filed under two receipt ids (a "
                       f"round copied as another round, a relabelled sweep) is not new evidence; "
                       f"neither copy counts", members, block_id, failures=False)
    unknown = [f"{r.identity.receipt_id}: {p}" for r in members for p in unregistered_values(r)]
    if unknown:
        return _refuse("unregistered feature value: " + "; ".join(unknown[:3]), members, block_id, failures=False,
                       ran_a_registered_value=False)
    return _make_block(block_id, members, policy)
