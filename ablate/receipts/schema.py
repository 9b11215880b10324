"""The receipt: the typed, versioned record of one arm, and its validator.

A receipt says what was requested, what actually ran, where every second of wall time went and why the arm can
or cannot count as evidence. Field sources and the disqualifier codes follow shared/notes/receipt-schema.md §9;
missing values are ``None`` (JSON null), never 0. JSON on disk, one file per arm: ``Receipt.model_dump_json()``.

``validate_receipt(obj)`` is the single gate promotion uses: it refuses unknown schema majors, incomplete
records, and time accounting that does not add up.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = "1.1.0"
"""1.1 (additive, all optional): CompileRecord.recompile_reasons, Observed.engine, TimeAccounting.detail,
Receipt.family_share_method; StepStats.loss_series entries may be null (non-finite)."""
SUPPORTED_MAJORS = frozenset({1})
TIME_TOLERANCE = 0.01
"""Goodput plus badput must equal wall time within 1% (plus a 50 ms floor for very short arms)."""
TIME_TOLERANCE_FLOOR_S = 0.05

BADPUT_CATEGORIES = ("queue_wait", "startup", "compile_warmup", "recompile", "data_wait", "checkpoint", "eval",
                     "idle")
"""Named badput; ``other`` is the non-negative remainder and is stored alongside."""

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


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=False)


class Disqualifier(_Model):
    code: Code
    severity: Severity = Severity.fatal
    detail: str = ""
    step: Optional[int] = None


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
    attempt: int = 0
    status: Status
    host: str
    node_id: Optional[str] = None
    pid: Optional[int] = None
    executor: str
    """subprocess (one-worker arm in a fresh process) or ray_train (TorchTrainer worker group)."""
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
    """Effective engine settings as resolved (e.g. DeepSpeed's ZeRO stage, the process-group backend)."""


class TimeAccounting(_Model):
    wall_s: float
    goodput_s: float
    badput_s: dict[str, float]
    """Every category of BADPUT_CATEGORIES plus ``other`` (the non-negative remainder)."""
    goodput_fraction: float
    detail: dict[str, float] = Field(default_factory=dict)
    """Informational split of ``badput_s.other`` (family_sampling, restart, teardown, unattributed); not summed."""


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


class Throughput(_Model):
    tokens: int
    wall_tokens_per_s: Optional[float]
    """tokens / arm wall time: the promotion metric (goodput-adjusted throughput over a fixed token budget)."""
    steady_tokens_per_s: Optional[float]
    flops_per_token: Optional[float] = None
    flops_coverage_missing: list[str] = Field(default_factory=list)
    mfu: Optional[float] = None
    """Null, never zero, when the peak is unknown (e.g. CPU) or FLOPs coverage is incomplete."""
    peak_flops: Optional[float] = None


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
    family_share: dict[str, Optional[float]]
    """Fraction of step time in A/E/M/R blocks (sampled); families absent from the pattern are None."""
    family_share_method: Optional[str] = None
    """hooks (timed on the blocks that ran) or eager_proxy (whole-model compile: sampled steps ran eager)."""
    quality: Quality
    disqualifiers: list[Disqualifier] = Field(default_factory=list)
    error: Optional[ErrorInfo] = None
    env: dict[str, str] = Field(default_factory=dict)
    """Allowlisted, redacted environment (CUDA_*, NCCL_*, OMP_*, ...): never secrets."""

    def codes(self) -> set[str]:
        return {d.code.value for d in self.disqualifiers}

    def fatal_codes(self) -> set[str]:
        return {d.code.value for d in self.disqualifiers if d.severity is Severity.fatal}


class InvalidReceipt(ValueError):
    """A receipt that cannot be used as evidence; the message says why."""


def time_accounting_errors(time: TimeAccounting) -> list[str]:
    errors = []
    missing = [c for c in (*BADPUT_CATEGORIES, "other") if c not in time.badput_s]
    if missing:
        errors.append(f"time.badput_s lacks {missing}")
    values = [time.wall_s, time.goodput_s, *time.badput_s.values()]
    if not all(math.isfinite(v) for v in values):
        errors.append("time accounting has non-finite values")
        return errors
    negative = {k: v for k, v in time.badput_s.items() if v < 0}
    if negative or time.goodput_s < 0:
        errors.append(f"negative time in accounting: goodput={time.goodput_s}, badput={negative}")
    total = time.goodput_s + sum(time.badput_s.values())
    tolerance = max(TIME_TOLERANCE * time.wall_s, TIME_TOLERANCE_FLOOR_S)
    if abs(total - time.wall_s) > tolerance:
        errors.append(f"goodput + badput = {total:.3f}s but wall = {time.wall_s:.3f}s (tolerance {tolerance:.3f}s)")
    return errors


def schema_major(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError as exc:
        raise InvalidReceipt(f"schema_version {version!r} is not semver; supported majors: "
                             f"{sorted(SUPPORTED_MAJORS)}") from exc


def validate_receipt(obj: dict[str, Any] | Receipt) -> Receipt:
    """Parse and check one receipt; raise ``InvalidReceipt`` naming what is wrong."""
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
    if major not in SUPPORTED_MAJORS:
        raise InvalidReceipt(f"schema_version {version!r}: unknown major {major}; supported majors: "
                             f"{sorted(SUPPORTED_MAJORS)}")
    try:
        receipt = Receipt.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:8])
        raise InvalidReceipt(f"receipt does not match schema {SCHEMA_VERSION}: {problems}") from exc
    errors = time_accounting_errors(receipt.time)
    if errors and receipt.identity.status is not Status.failed:
        raise InvalidReceipt("; ".join(errors))
    return receipt
