"""The receipt: the typed, versioned record of one arm, and its validator.

A receipt says what was requested, what actually ran, where every second of wall time went and why the arm can
or cannot count as evidence. Field sources and the disqualifier codes follow shared/notes/receipt-schema.md §9;
missing values are ``None`` (JSON null), never 0. JSON on disk, one file per arm: ``Receipt.model_dump_json()``.

``validate_receipt(obj)`` is the single gate promotion uses: it refuses unknown schema majors, incomplete
records, and every derived figure (time parts, throughput, the horizon projection that promotion compares)
that does not follow from the receipt's raw per-step fields (``ablate.receipts.derive`` holds the one
definition both the trainer and the validator use), so an edited number never validates.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ablate.receipts import derive
from ablate.receipts.derive import Projection

SCHEMA_VERSION = "2.4.0"
"""2.4: ``identity.process`` (how the arm's process was prepared: forked from a fork server that had imported
torch and the arm code, or a fresh interpreter, or a Ray Train worker); optional, absent on older receipts.
2.3: ``identity.schedule`` (fixed, or until_decided: the block was scheduled by the sequential searcher, so
only a sequential policy may judge it); optional, absent reads as fixed.
2.2: ``energy`` (joules over the budget steps, per token, with source and scope, or null with the reason) and
``observed.node_check`` (the node's ``ablate doctor --deep`` document the arm ran under); both optional.
2.1: ``digest``, the sha256 of the receipt's canonical JSON without it (``ablate.receipts.store``), set when
the receipt is written and checked when it is read; optional, so 2.0 receipts (which have none) still validate.
2.0: the arm's time splits into executor start-up (``startup``), feature-dependent ``setup`` and per-step
records (phase, label, compile events, step/data/cadence seconds, tokens), from which ``projection`` (the
promotion metric at the lane's horizon) and every other derived figure is recomputed on validation; ``other``
is replaced by measured ``sampling``/``restart``/``teardown`` and a checked ``unattributed``; ``host`` records
niceness, affinity and load; identity carries code and hardware fingerprints and the campaign/defaults hashes.
1.x receipts measured wall tokens/s over the whole arm, mostly process start-up: they are not evidence."""
SUPPORTED_MAJORS = frozenset({2})
TIME_TOLERANCE = 0.01
"""Goodput plus badput must equal wall time within 1% (plus a 50 ms floor for very short arms)."""
TIME_TOLERANCE_FLOOR_S = 0.05
FUTURE_SLACK = dt.timedelta(hours=1)
"""A receipt written later than now (plus clock skew between nodes) cannot be real: it is refused."""
UNATTRIBUTED_LIMIT = 0.02
"""An arm that finished may leave at most 2% of its wall time (or the floor) unexplained by measured parts."""

BADPUT_CATEGORIES = ("queue_wait", "startup", "setup", "compile_warmup", "recompile", "data_wait", "checkpoint",
                     "eval", "idle", "sampling", "paired_wait", "restart", "teardown", "unattributed")
"""Named badput. Every category is measured on its own except ``unattributed`` (wall minus everything else),
which is the check: small, and never below minus the tolerance."""

FAMILIES = ("A", "E", "M", "R")


class Status(str, enum.Enum):
    valid = "valid"
    disqualified = "disqualified"
    failed = "failed"
    aborted = "aborted"


class ArmRole(str, enum.Enum):
    baseline = "baseline"
    candidate = "candidate"
    aa = "aa"
    """Both arms of an A/A block run the baseline; they measure the lane's noise floor."""


class Severity(str, enum.Enum):
    fatal = "fatal"
    warn = "warn"


class Code(str, enum.Enum):
    BACKEND_FALLBACK = "BACKEND_FALLBACK"
    GRAPH_BREAK = "GRAPH_BREAK"
    RECOMPILE_IN_STEADY_STATE = "RECOMPILE_IN_STEADY_STATE"
    HARDWARE_MISMATCH = "HARDWARE_MISMATCH"
    BATCH_GEOMETRY_CHANGED = "BATCH_GEOMETRY_CHANGED"
    NONFINITE_LOSS = "NONFINITE_LOSS"
    OOM = "OOM"
    INERT_TOGGLE = "INERT_TOGGLE"
    INSUFFICIENT_STEADY_STEPS = "INSUFFICIENT_STEADY_STEPS"
    TIME_ACCOUNTING_VIOLATION = "TIME_ACCOUNTING_VIOLATION"
    ARM_FAILED = "ARM_FAILED"
    LOW_PRIORITY = "LOW_PRIORITY"
    """The arm ran at a lowered CPU priority (inherited niceness it could not reset): not measured fairly."""
    BACKEND_FAILED_NODE_CHECK = "BACKEND_FAILED_NODE_CHECK"
    """A backend the arm ran is marked wrong (fails its reference twin) in its node's ``ablate doctor --deep``
    document: its time is the time of a kernel that computes something else."""
    HOST_CONTENDED = "HOST_CONTENDED"
    """Foreign processes wanted more CPU than the node had left while the arm ran (warn: flagged in reports)."""


WARN_CODES = frozenset({Code.HOST_CONTENDED})
"""Codes about the host, not about what ran: the only ones a trainer writes at ``warn``. Every other code is a fact
about the run (a fallback, a graph break, an inert toggle) and is written ``fatal``; promotion gates those whatever
severity a receipt claims, so editing a code down to ``warn`` changes nothing."""


def code_severity(code: Code) -> Severity:
    """The one severity a trainer writes for ``code``."""
    return Severity.warn if code in WARN_CODES else Severity.fatal


class _Model(BaseModel):
    # ser_json_inf_nan is pydantic's default, stated because figure_errors relies on it: the model's own JSON holds
    # null where a number is NaN or infinite, never a token that decodes to one.
    model_config = ConfigDict(extra="forbid", use_enum_values=False, ser_json_inf_nan="null")


class Disqualifier(_Model):
    code: Code
    severity: Severity = Severity.fatal
    detail: str = ""
    step: Optional[int] = None


SIMULATED_EXECUTOR = "simulated"
"""``identity.executor`` of a receipt made by the test-only no-op arm executor (``trainers.simulate``): it went
through the real sweep, recorder and MLflow, but no arm ran; promotion refuses every block that holds one."""


class ProcessStart(_Model):
    """How an arm's process came to be. Every arm runs in a process that ran nothing before it; this says
    whether its imports were paid on the arm's clock (fresh_interpreter) or by a fork server beforehand."""

    how: Literal["fork_server", "fresh_interpreter", "ray_train_worker"]
    server_pid: Optional[int] = None
    server_started_at: Optional[float] = None
    forks_before: Optional[int] = None
    """Arms the fork server had forked before this one: 0 means this arm's request started the server."""
    request_s: Optional[float] = None
    """Fork request sent -> child pid back (the server's own start-up included when this request started it)."""
    fallback_reason: Optional[str] = None
    """Why a one-worker arm ran in a fresh interpreter instead of a forked one."""


class Identity(_Model):
    receipt_id: str
    sweep_id: str
    campaign: str
    block_id: str
    arm: ArmRole
    arm_index: int
    """0 or 1: which of the block's two arms this is (A/A blocks use it to tell the twins apart)."""
    order: int
    """Position in the block as run: 0 = ran first, 1 = ran second."""
    feature: Optional[str]
    """The feature under test (None for A/A blocks)."""
    feature_value: Optional[Any]
    baseline_value: Optional[Any]
    kind: str
    """speed or tax, from the feature registry."""
    lane_key: str
    """Hash of the block's baseline lane: identical for both arms of a block and across rounds."""
    config_hash: str
    """Hash of exactly what this arm ran (the lane with the feature value applied)."""
    software_fingerprint: str
    """Package versions, the project's own arm code and the hardware together: evidence pools only within one."""
    code_fingerprint: Optional[str] = None
    """Content hash of the project's code an arm runs (kernels/, trainers/), dirty or not."""
    hardware_fingerprint: Optional[str] = None
    """Device model and count, driver, CUDA/NCCL/cuDNN versions, CPU model."""
    campaign_sha256: Optional[str] = None
    defaults_sha256: Optional[str] = None
    attempt: int = 0
    status: Status
    host: str
    node_id: Optional[str] = None
    pid: Optional[int] = None
    executor: str
    """subprocess (one-worker arm in a fresh process) or ray_train (TorchTrainer worker group); ``simulated``
    (``SIMULATED_EXECUTOR``) for the test-only no-op arms of ``trainers.simulate``, which promotion refuses."""
    process: Optional[ProcessStart] = None
    """How the process behind ``pid`` was prepared (2.4); None on older receipts."""
    pairing: str = "sequential"
    """interleaved (both arms of the block side by side, taking turns step by step) or sequential (back to back)."""
    schedule: Literal["fixed", "until_decided"] = "fixed"
    """fixed (the campaign ran every planned block) or until_decided (``ablate sweep --until-decided`` scheduled
    the block while its test was undecided: the fixed rule's error rates do not hold on such optionally stopped
    evidence, so only a policy with the sequential test on may judge it)."""
    git_sha: Optional[str] = None
    git_dirty: Optional[bool] = None
    created_at: str
    software: dict[str, Optional[str]]


class Requested(_Model):
    lane: dict[str, Any]
    """The flattened lane config with stable dotted names (``features.moe_dispatch`` ...)."""
    pattern: str
    layer_counts: dict[str, int]
    params_total: Optional[int]
    params_active: Optional[int]
    tokens_per_step: int
    data_fingerprint: str
    world_size: int
    device: str


class BackendRecord(_Model):
    op: str
    requested: str
    observed: str
    reason: str = ""


class CompileRecord(_Model):
    posture_requested: str
    posture_observed: str
    warmup_requested: str
    warmup_resolved: str
    warmup_reason: str
    unique_graphs: Optional[int] = None
    graph_breaks: Optional[int] = None
    graph_break_reasons: list[str] = Field(default_factory=list)
    recompiles: Optional[int] = None
    recompiles_in_steady_state: Optional[int] = None
    recompile_reasons: list[str] = Field(default_factory=list)
    """dynamo's recompile_reason per recompile (a size mismatch there is a batch-geometry change)."""
    compile_time_s: Optional[float] = None
    cache_hits: Optional[int] = None
    cache_misses: Optional[int] = None


class Observed(_Model):
    hardware: dict[str, Any]
    """nvidia-ml-py facts per GPU (name, memory, driver, clocks, power, throttle reasons) or the CPU model/threads."""
    backends: list[BackendRecord]
    compile: CompileRecord
    tokens_per_step: Optional[int] = None
    """Tokens per optimizer step as observed (differs from requested only on geometry drift)."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """Effective engine settings read back from the running engine (DDP's bucket cap, DeepSpeed's config)."""
    model: dict[str, Any] = Field(default_factory=dict)
    """Structural facts of the built model that a toggle can change (e.g. the STP head)."""
    node_check: dict[str, Any] = Field(default_factory=dict)
    """The node's deep-check document the arm ran under: path, sha256, device, torch, ok (or why there is none)."""


class TimeAccounting(_Model):
    wall_s: float
    goodput_s: float
    badput_s: dict[str, float]
    """Every category of BADPUT_CATEGORIES plus ``other`` (the non-negative remainder)."""
    goodput_fraction: float
    clock: str = "driver"
    """Where ``wall_s`` starts: driver (the sweep driver's scheduling stamp) or caller (``run_arm``'s caller)."""


class StepStats(_Model):
    total: int
    warmup: int
    steady: int
    p50_s: Optional[float] = None
    p90_s: Optional[float] = None
    mean_s: Optional[float] = None
    ideal_s: Optional[float] = None
    """Mean of steady steps at or under median + 3 MAD (Google goodput); no 1 s floor."""
    anomalous: int = 0
    anomalous_extra_s: float = 0.0
    time_to_first_step_s: Optional[float] = None
    first_step_s: Optional[float] = None
    series: list[float] = Field(default_factory=list)
    """Every measured step's wall time, in order (for per-step charts)."""
    loss_series: list[Optional[float]] = Field(default_factory=list)
    """Loss per budget step; null where it was not finite."""
    phases: list[str] = Field(default_factory=list)
    """Per executed step (warmup included), in order: warmup or budget. The lists below are parallel to it."""
    compile_events: list[int] = Field(default_factory=list)
    sampled: list[bool] = Field(default_factory=list)
    labels: list[str] = Field(default_factory=list)
    step_s: list[float] = Field(default_factory=list)
    data_s: list[float] = Field(default_factory=list)
    cadence_s: list[float] = Field(default_factory=list)
    """End of the previous step (or the loop start) to the end of this one, on the step clock."""
    phase_s: list[float] = Field(default_factory=list)
    wait_s: list[float] = Field(default_factory=list)
    """Interleaved blocks: time waited for each step's turn (empty or zeros when the arm ran alone)."""
    tokens: list[int] = Field(default_factory=list)
    data_is_badput: bool = True
    """CPU: host data time is on the critical path; CUDA: it overlaps device work (then only idle counts)."""

    def views(self) -> list[derive.Step]:
        waits = self.wait_s or [0.0] * len(self.phases)
        return [derive.Step(phase=p, label=lb, step_s=s, data_s=d, cadence_s=c, tokens=t, phase_s=ph, wait_s=w)
                for p, lb, s, d, c, t, ph, w in zip(self.phases, self.labels, self.step_s, self.data_s,
                                                    self.cadence_s, self.tokens, self.phase_s, waits)]


class HostLoad(_Model):
    """How fairly the arm was measured: its priority, CPUs and what else ran on the node meanwhile."""

    niceness: Optional[int] = None
    niceness_inherited: Optional[int] = None
    """The niceness the arm's process started with (Ray workers run at 15 unless told otherwise)."""
    affinity: Optional[list[int]] = None
    logical_cpus: Optional[int] = None
    loadavg_start: Optional[list[float]] = None
    loadavg_end: Optional[list[float]] = None
    window_s: Optional[float] = None
    """The measured loop, over which the CPU figures below are taken."""
    own_cpus: Optional[float] = None
    """CPUs this arm kept busy on the node (all its local ranks)."""
    foreign_cpus: Optional[float] = None
    """CPUs other processes kept busy on the node during the window."""
    run_delay_s: Optional[float] = None
    """Time the arm's threads were runnable but waiting for a CPU during the window (kernel schedstat); an
    interleaved arm's (``identity.pairing``), during its own turns only, unless its coordinator went away mid-run
    (then the window's, as for an unpaired arm; ``detail`` names the basis when it flags the arm)."""
    run_delay_share: Optional[float] = None
    """``run_delay_s`` over the time it was taken on: the window, less any partner's turns; an interleaved arm's
    own turns. Above ``trainers.hostload.CONTENDED_RUN_DELAY``: ``contended``."""
    contended: bool = False
    detail: str = ""


class Throughput(_Model):
    tokens: int
    wall_tokens_per_s: Optional[float]
    """tokens / arm wall time. Diagnostic only: over a short arm it is mostly start-up; promotion compares
    ``projection.tokens_per_s``."""
    steady_tokens_per_s: Optional[float]
    """Tokens of steady steps / their compute time."""
    flops_per_token: Optional[float] = None
    flops_coverage_missing: list[str] = Field(default_factory=list)
    mfu: Optional[float] = None
    """Null, never zero, when the peak is unknown (e.g. CPU) or FLOPs coverage is incomplete."""
    peak_flops: Optional[float] = None


class Energy(_Model):
    """Energy the arm's budget steps drew (``trainers.energy``). Reported beside tokens/s; no verdict uses it."""

    source: Optional[str] = None
    """nvml_energy_counter | nvml_power_samples | rapl (``+``-joined across ranks); None: not measured."""
    scope: str = ""
    """What the joules cover: the GPU board(s), or the host's CPU packages (host-wide)."""
    joules: Optional[float] = None
    seconds: Optional[float] = None
    tokens: Optional[int] = None
    joules_per_token: Optional[float] = None
    mean_watts: Optional[float] = None
    why: str = ""
    """Why there is no number (no RAPL, counters readable by root only, NVML without an energy counter...)."""


class Memory(_Model):
    kind: str
    """cuda (allocator peaks) or cpu (peak RSS of the worker process)."""
    peak_allocated_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None
    peak_rss_bytes: Optional[int] = None


class Quality(_Model):
    loss_final: Optional[float] = None
    loss_mean_last_k: Optional[float] = None
    lm_loss_final: Optional[float] = None
    stp_loss_final: Optional[float] = None
    aux_loss_final: Optional[float] = None


class ErrorInfo(_Model):
    type: str
    message: str


class Receipt(_Model):
    schema_version: str = SCHEMA_VERSION
    identity: Identity
    requested: Requested
    observed: Observed
    time: TimeAccounting
    steps: StepStats
    throughput: Throughput
    memory: Memory
    projection: Optional[Projection] = None
    """None when the arm produced no steady step (failed or too short)."""
    host_load: HostLoad = Field(default_factory=HostLoad)
    energy: Optional[Energy] = None
    """None in receipts before 2.2; an Energy with ``source`` None when the arm could not measure."""
    family_share: dict[str, Optional[float]]
    """Fraction of step time in A/E/M/R blocks (sampled); families absent from the pattern are None."""
    family_share_method: Optional[str] = None
    """hooks (timed on the blocks that ran) or eager_proxy (whole-model compile: sampled steps ran eager)."""
    quality: Quality
    disqualifiers: list[Disqualifier] = Field(default_factory=list)
    error: Optional[ErrorInfo] = None
    env: dict[str, str] = Field(default_factory=dict)
    """Allowlisted, redacted environment (CUDA_*, NCCL_*, OMP_*, ...): never secrets."""
    digest: Optional[str] = None
    """sha256 of the canonical JSON of everything else (``ablate.receipts.store.content_digest``), set when the
    receipt is written; a copy whose content no longer matches it is refused on read. None in 2.0 receipts."""

    def codes(self) -> set[str]:
        return {d.code.value for d in self.disqualifiers}

    def fatal_codes(self) -> set[str]:
        return {d.code.value for d in self.disqualifiers if d.severity is Severity.fatal}


class InvalidReceipt(ValueError):
    """A receipt that cannot be used as evidence; the message says why."""


def _finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def time_accounting_errors(time: TimeAccounting, finished: bool = True) -> list[str]:
    """Parts present, finite and non-negative, summing to wall; ``unattributed`` small when ``finished``."""
    errors = []
    missing = [c for c in BADPUT_CATEGORIES if c not in time.badput_s]
    unknown = sorted(set(time.badput_s) - set(BADPUT_CATEGORIES))
    if missing or unknown:
        errors.append(f"time.badput_s: missing {missing}, unknown {unknown}; allowed: {list(BADPUT_CATEGORIES)}")
        return errors
    values = [time.wall_s, time.goodput_s, *time.badput_s.values()]
    if not all(math.isfinite(v) for v in values):
        return ["time accounting has non-finite values"]
    if time.wall_s <= 0:
        errors.append(f"time.wall_s is {time.wall_s}; a run takes time")
    tolerance = max(TIME_TOLERANCE * time.wall_s, TIME_TOLERANCE_FLOOR_S)
    negative = {k: v for k, v in time.badput_s.items() if v < 0 and k != "unattributed"}
    if negative or time.goodput_s < 0:
        errors.append(f"negative time in accounting: goodput={time.goodput_s}, badput={negative}")
    total = time.goodput_s + sum(time.badput_s.values())
    if abs(total - time.wall_s) > tolerance:
        errors.append(f"goodput + badput = {total:.3f}s but wall = {time.wall_s:.3f}s (tolerance {tolerance:.3f}s)")
    unattributed = time.badput_s["unattributed"]
    if unattributed < -tolerance:
        errors.append(f"measured parts exceed wall by {-unattributed:.3f}s (tolerance {tolerance:.3f}s)")
    limit = max(UNATTRIBUTED_LIMIT * time.wall_s, TIME_TOLERANCE_FLOOR_S)
    if finished and unattributed > limit:
        errors.append(f"{unattributed:.3f}s of wall time ({unattributed / time.wall_s:.1%}) is unattributed "
                      f"(limit {limit:.3f}s, {UNATTRIBUTED_LIMIT:.0%} of wall)")
    if time.wall_s > 0 and not derive.close_enough(time.goodput_fraction, time.goodput_s / time.wall_s):
        errors.append(f"time.goodput_fraction {time.goodput_fraction} != goodput_s / wall_s "
                      f"({time.goodput_s / time.wall_s})")
    return errors


CADENCE_TOLERANCE_S = 1e-6
"""Rounding between a cadence and the parts it holds, each a difference of the same clock's readings."""


def _mismatch(name: str, stored: Optional[float], derived: Optional[float]) -> Optional[str]:
    if derive.close_enough(stored, derived):
        return None
    return f"{name} is {stored!r} but the receipt's raw fields give {derived!r}"


def derived_figure_errors(receipt: "Receipt") -> list[str]:
    """Recompute every derived figure from the per-step records and compare with what the receipt states."""
    st, time, tp = receipt.steps, receipt.time, receipt.throughput
    lists = {"compile_events": st.compile_events, "sampled": st.sampled, "labels": st.labels,
             "step_s": st.step_s, "data_s": st.data_s, "cadence_s": st.cadence_s, "phase_s": st.phase_s,
             "tokens": st.tokens}
    bad_len = sorted(k for k, v in lists.items() if len(v) != len(st.phases))
    if bad_len:
        return [f"steps.{bad_len[0]} has {len(lists[bad_len[0]])} entries for {len(st.phases)} steps"]
    if st.wait_s and len(st.wait_s) != len(st.phases):
        return [f"steps.wait_s has {len(st.wait_s)} entries for {len(st.phases)} steps"]
    floats = [*st.step_s, *st.data_s, *st.cadence_s, *st.phase_s, *st.wait_s]
    if not all(math.isfinite(x) and x >= 0 for x in floats) or any(t < 0 for t in st.tokens):
        return ["steps: per-step times and tokens must be finite and non-negative"]
    if any(p not in derive.PHASES for p in st.phases):
        return [f"steps.phases: allowed values {list(derive.PHASES)}"]
    errors: list[str] = []
    # A step's cadence holds its own compute (and, where data loading is badput, its data wait): the trainer's
    # clocks make it so, and a cadence shorter than that is the projection's recurring time edited on its own.
    short = [i for i, (c, s, d) in enumerate(zip(st.cadence_s, st.step_s, st.data_s))
             if c < s + (d if st.data_is_badput else 0.0) - CADENCE_TOLERANCE_S]
    if short:
        parts = "step_s + data_s" if st.data_is_badput else "step_s"
        errors.append(f"steps.cadence_s is shorter than the step's own time ({parts}) at {len(short)} step(s), "
                      f"first at index {short[0]}")
    labels = derive.classify(st.phases, st.compile_events, st.sampled, receipt.observed.compile.warmup_resolved)
    if labels != st.labels:
        errors.append("steps.labels do not follow from phases, compile events, sampling and the warmup decision")
        return errors
    steps = st.views()
    parts = derive.loop_parts(steps, st.data_is_badput)
    checks = [("time.goodput_s", time.goodput_s, parts.goodput_s),
              ("time.badput_s.compile_warmup", time.badput_s.get("compile_warmup"), parts.compile_warmup_s),
              ("time.badput_s.recompile", time.badput_s.get("recompile"), parts.recompile_s),
              ("time.badput_s.data_wait", time.badput_s.get("data_wait"), parts.data_wait_s),
              ("time.badput_s.idle", time.badput_s.get("idle"), parts.idle_s),
              ("time.badput_s.sampling", time.badput_s.get("sampling"), parts.sampling_s)]
    budget = [s for s in steps if s.phase == "budget"]
    steady = [s for s in steps if s.label == "steady"]
    tokens = sum(s.tokens for s in budget)
    steady_time = sum(s.step_s for s in steady)
    checks += [("throughput.wall_tokens_per_s", tp.wall_tokens_per_s,
                tokens / time.wall_s if time.wall_s > 0 and budget else None),
               ("throughput.steady_tokens_per_s", tp.steady_tokens_per_s,
                sum(s.tokens for s in steady) / steady_time if steady_time > 0 else None)]
    setup_wait = receipt.time.badput_s.get("paired_wait", 0.0) - parts.paired_wait_s
    if steps and setup_wait < -max(TIME_TOLERANCE_FLOOR_S, 1e-6):
        errors.append(f"time.badput_s.paired_wait {time.badput_s.get('paired_wait')!r} is less than the steps' own "
                      f"waits ({parts.paired_wait_s!r})")
    errors += [m for m in (_mismatch(*c) for c in checks) if m]
    if tp.tokens != tokens:
        errors.append(f"throughput.tokens is {tp.tokens} but the budget steps carry {tokens}")
    off = sorted({s.tokens for s in budget} - {receipt.requested.tokens_per_step})
    if off and receipt.identity.status is Status.valid:
        errors.append(f"steps.tokens: a valid arm's budget steps each carry requested.tokens_per_step "
                      f"({receipt.requested.tokens_per_step}); found {off[:3]}")
    if st.total != len(steps) or st.steady != len(steady):
        errors.append(f"steps.total/steady ({st.total}/{st.steady}) do not match the per-step records "
                      f"({len(steps)}/{len(steady)})")
    errors += _disqualifying_facts(receipt, len(steady))
    setup = time.badput_s.get("setup", 0.0)
    stated = receipt.requested.lane.get("budget.horizon_steps", 0)
    try:
        horizon = int(stated or 0)
    except (TypeError, ValueError):  # the lane is a free-form mapping: its value is checked here, not by the schema
        errors.append(f"requested.lane budget.horizon_steps is {stated!r}; allowed: a positive whole number of steps")
        return errors
    if horizon <= 0:
        errors.append("requested.lane has no positive budget.horizon_steps")
        return errors
    proj = derive.project(setup, steps, horizon, receipt.requested.tokens_per_step)
    stored = receipt.projection
    if proj.projected_s is None:
        if stored is not None and stored.projected_s is not None:
            errors.append("projection states a projected time but the receipt has no steady step to project from")
        return errors
    if stored is None:
        errors.append("projection is missing although the receipt has steady steps")
        return errors
    if stored.horizon_steps != horizon or stored.warm_budget_steps != proj.warm_budget_steps or \
            stored.recurring_steps != proj.recurring_steps:
        errors.append("projection step counts do not follow from the lane's horizon and the per-step records")
    for name in ("setup_s", "warm_s", "one_time_s", "recurring_step_s", "projected_s", "tokens_per_s"):
        problem = _mismatch(f"projection.{name}", getattr(stored, name), getattr(proj, name))
        if problem:
            errors.append(problem)
    return errors


def _disqualifying_facts(receipt: "Receipt", steady: int) -> list[str]:
    """What the per-step records show that the trainer disqualifies for, on a receipt that says otherwise: the
    codes and counters are the trainer's word, the records are the measurement (found in review: a valid receipt
    with a 2-step steady window, or a steady-state recompile and a counter of 0, paired into blocks)."""
    errors = []
    recompile_events = sum(events for events, label in zip(receipt.steps.compile_events, receipt.steps.labels)
                           if label == "recompile")
    stated = receipt.observed.compile.recompiles_in_steady_state
    if stated is not None and stated != recompile_events:
        errors.append(f"observed.compile.recompiles_in_steady_state is {stated} but the steps labelled recompile "
                      f"carry {recompile_events} compile event(s)")
    if receipt.identity.status is not Status.valid:
        return errors
    if recompile_events:
        errors.append(f"a valid arm's steps carry {recompile_events} compile event(s) after warmup (labelled "
                      f"recompile): {Code.RECOMPILE_IN_STEADY_STATE.value} disqualifies it")
    least = receipt.requested.lane.get("budget.min_steady_steps")
    if isinstance(least, int) and not isinstance(least, bool) and steady < least:
        errors.append(f"a valid arm has {steady} steady step(s) < budget.min_steady_steps ({least}): "
                      f"{Code.INSUFFICIENT_STEADY_STEPS.value} disqualifies it")
    return errors


_NON_NEGATIVE = ("throughput", "steps", "memory", "projection", "family_share", "observed.compile", "energy")
"""Sections whose every number is a count, a duration, a size, a rate or a share: never below zero."""
_SIGNED = frozenset({"steps.loss_series", "steps.time_to_first_step_s"})
"""Numbers in those sections that may be negative: a loss, and the one span measured across two machines' clocks
(the driver's scheduling stamp to the worker's first step), which clock skew can turn negative; refusing such a
receipt would drop a real arm (a failed one included) from the evidence, so the skew is kept visible instead."""


def _numbers(node: Any, path: str) -> list[tuple[str, float]]:
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return []
    if isinstance(node, (int, float)):
        return [(path, node)]
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in _numbers(v, f"{path}.{k}" if path else str(k))]
    if isinstance(node, (list, tuple)):
        return [x for i, v in enumerate(node) for x in _numbers(v, f"{path}[{i}]")]
    return []


def _all_finite(node: Any) -> bool:
    """True when every number under ``node`` is finite. Reading 10,000 receipts back spent most of its validation
    visiting numbers one call each: this walks with a stack, and a list of numbers (the per-step series) is summed
    in C (``math.fsum`` of finite numbers is finite or raises), visited item by item only when that does not
    settle it."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            try:
                if math.isfinite(math.fsum(item)):
                    continue
            except (TypeError, ValueError, OverflowError):  # None or a nested list inside; inf - inf; huge ints
                pass
            stack.extend(item)
    return True  # what is left is int (bool included), str or None: never infinite or NaN


def _none_negative(node: Any) -> bool:
    """True when no number under ``node`` is below zero (every number already known to be finite). ``min`` in C
    settles a flat list of numbers; anything else (None, strings, nested lists) is visited item by item."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, (int, float)):
            if item < 0:
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            try:
                if min(item, default=0) < 0:
                    return False
                continue
            except TypeError:  # None, a string or a nested list inside
                stack.extend(item)
    return True


def figure_errors(receipt: "Receipt", own_json: Optional[dict[str, Any]] = None) -> list[str]:
    """Numbers no measurement produces: NaN or infinity anywhere (the trainer writes null for what it could not
    measure), a negative count, duration, size, rate or share, a family share above 1. ``own_json``: the receipt's
    own JSON (``model_dump_json``), decoded, when the caller has it; its numbers are the model's, all finite (see
    ``_Model``), so neither a dump of the model nor the walk for NaN is needed (over 10,000 receipts read back, the
    two were a fifth of each receipt's checks)."""
    if own_json is not None:
        data = own_json
    else:
        data = receipt.model_dump(mode="python", exclude={"digest"})
        if not _all_finite(data):
            return [f"{path} is {value!r}: a receipt holds finite numbers only (null for what was not measured)"
                    for path, value in _numbers(data, "") if isinstance(value, float) and not math.isfinite(value)]
    errors: list[str] = []
    for section in _NON_NEGATIVE:
        node: Any = data
        for part in section.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if _none_negative(node):
            continue
        for path, value in _numbers(node, section):
            if value < 0 and path.split("[")[0] not in _SIGNED:
                errors.append(f"{path} is {value!r}: a count, duration, size, rate or share is never negative")
    errors += [f"family_share.{k} is {v!r}: a share of step time is at most 1"
               for k, v in receipt.family_share.items() if v is not None and v > 1.0 + 1e-9]
    energy = receipt.energy
    if energy is not None and energy.joules is not None and energy.tokens and energy.joules_per_token is not None \
            and not math.isclose(energy.joules_per_token, energy.joules / energy.tokens, rel_tol=1e-9):
        errors.append(f"energy.joules_per_token is {energy.joules_per_token!r}, but joules / tokens is "
                      f"{energy.joules / energy.tokens!r}")
    return errors


def schema_major(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError as exc:
        raise InvalidReceipt(f"schema_version {version!r} is not semver; supported majors: "
                             f"{sorted(SUPPORTED_MAJORS)}") from exc


def utc_moment(stamp: Any) -> Optional[dt.datetime]:
    """The moment an ``identity.created_at`` names, when it is on the one clock the trainer writes (an ISO-8601
    date and time with a UTC offset of +00:00); None for anything else, which places nothing in time."""
    if not isinstance(stamp, str) or "T" not in stamp:
        return None
    try:
        moment = dt.datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None and moment.utcoffset() == dt.timedelta(0) else None


def in_the_future(created_at: str) -> bool:
    """Whether a UTC ISO-8601 ``created_at`` lies beyond this machine's clock (plus ``FUTURE_SLACK``): the one check
    whose answer depends on when and where it runs, so it is repeated on every payload remembered as accepted
    (``ablate.receipts.accepted``), which another machine's clock may have passed."""
    return dt.datetime.fromisoformat(created_at) > dt.datetime.now(dt.timezone.utc) + FUTURE_SLACK


def validate_receipt(obj: dict[str, Any] | Receipt) -> Receipt:
    """Parse and check one receipt; raise ``InvalidReceipt`` naming what is wrong."""
    return _validated(obj, None)[0]


def validate_decoded(obj: Any, source: bytes) -> tuple[Receipt, bool]:
    """``validate_receipt(obj)`` for ``obj`` decoded from the JSON bytes ``source``, and whether ``source`` is
    exactly the receipt's own JSON (``model_dump_json``: what every writer logs), which the checks then read."""
    return _validated(obj, source)


def _validated(obj: Any, source: Optional[bytes]) -> tuple[Receipt, bool]:
    if isinstance(obj, Receipt):
        data = obj.model_dump(mode="json")
    else:
        data = obj
    if not isinstance(data, dict):
        raise InvalidReceipt(f"a receipt must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version is None:
        raise InvalidReceipt("schema_version is missing")
    major = schema_major(version)
    if major == 1:
        raise InvalidReceipt(f"schema_version {version!r}: 1.x receipts compared wall tokens/s over the whole arm "
                             f"(mostly process start-up) and cannot be re-projected to a horizon; re-run the "
                             f"campaign (supported majors: {sorted(SUPPORTED_MAJORS)})")
    if major not in SUPPORTED_MAJORS:
        raise InvalidReceipt(f"schema_version {version!r}: unknown major {major}; supported majors: "
                             f"{sorted(SUPPORTED_MAJORS)}")
    try:
        receipt = Receipt.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:8])
        raise InvalidReceipt(f"receipt does not match schema {SCHEMA_VERSION}: {problems}") from exc
    try:
        dt.datetime.fromisoformat(receipt.identity.created_at)
    except ValueError:
        raise InvalidReceipt(f"identity.created_at {receipt.identity.created_at!r} is not an ISO-8601 time") from None
    if utc_moment(receipt.identity.created_at) is None:
        # Rounds are told apart by these times and receipts are ordered by them (the newest picks a lane's current
        # software): a bare date, a time without its offset or one in another zone is not on the one clock the
        # trainer writes (ISO-8601 UTC, +00:00).
        raise InvalidReceipt(f"identity.created_at {receipt.identity.created_at!r} is not an ISO-8601 date and time "
                             f"with a UTC offset of +00:00 (e.g. 2026-11-22T18:07:17+00:00)")
    if in_the_future(receipt.identity.created_at):
        raise InvalidReceipt(f"identity.created_at {receipt.identity.created_at!r} is in the future: no arm has run "
                             f"then")
    try:
        own = source is not None and receipt.model_dump_json().encode("utf-8") == source
    except ValueError:  # a string JSON can hold and UTF-8 cannot (a lone surrogate): not the model's own JSON
        own = False
    errors = figure_errors(receipt, own_json=data if own else None)
    if errors:
        raise InvalidReceipt("; ".join(errors[:4]))
    failed = receipt.identity.status is Status.failed
    # An arm whose own receipt declares the unattributed time (TIME_ACCOUNTING_VIOLATION, so not valid) is evidence
    # of a disqualified arm: its block is counted, never its ratio. Refusing it dropped the arm and left its block
    # without an answer. Only the unattributed limit is waived; the parts must still add up to the wall time.
    declared = Code.TIME_ACCOUNTING_VIOLATION.value in receipt.fatal_codes() and \
        receipt.identity.status is not Status.valid
    errors = time_accounting_errors(receipt.time, finished=not failed and not declared)
    if errors and not failed:
        raise InvalidReceipt("; ".join(errors))
    errors = derived_figure_errors(receipt)
    if errors:
        raise InvalidReceipt("; ".join(errors[:4]))
    if receipt.identity.status is Status.valid and (not receipt.throughput.tokens or receipt.projection is None):
        raise InvalidReceipt("a valid receipt must have trained tokens and a projection to the horizon")
    return receipt, own
