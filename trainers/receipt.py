"""Assemble an arm's receipt from the worker's result and the executor's stamps; compute its disqualifiers.

How to use: ``build_receipt(spec, result, launch)`` where ``result`` may be None (the worker never returned:
SIGKILL with no retry left, a worker group that failed to start). Every disqualifier is derived from measured
facts here, never typed in by a caller; ``status`` follows from them: failed (the arm did not finish its budget),
disqualified (a fatal disqualifier), valid.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ablate.config.backends import fell_back
from ablate.config.features import FEATURES
from ablate.config.load import flatten, lane_to_dict
from ablate.receipts.derive import project
from ablate.receipts.store import seal
from ablate.receipts.schema import (FAMILIES, TIME_TOLERANCE_FLOOR_S, UNATTRIBUTED_LIMIT, ArmRole, BackendRecord,
                                    Code, CompileRecord, Disqualifier, Energy, ErrorInfo, HostLoad, Identity, Memory, Observed,
                                    Projection, Quality, Receipt, Requested, Severity, Status, StepStats, Throughput,
                                    TimeAccounting, code_severity)
from trainers.inactive import SINGLE_BUCKET
from trainers.goodput import Accounting, LoopSummary, account_time, step_statistics
from ablate.redact import capture_env, redact_text
from trainers.provenance import evidence_fingerprint, hardware_fingerprint, software_versions
from trainers.result import Geometry, WorkerResult
from trainers.spec import ArmSpec

PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "NVL"), 835e12), (("H100", "PCIE"), 756e12), (("H100",), 989e12), (("H200",), 989e12),
    (("GB200",), 2.5e15), (("B200",), 2.25e15), (("A100",), 312e12), (("MI300X",), 1300e12),
)
"""Dense bf16 peak per device (torchtitan get_peak_flops); the first entry whose words all appear wins."""


@dataclass
class LaunchInfo:
    """What the executor saw, in ``time.time()`` stamps on the orchestrator side."""

    executor: str
    """subprocess or ray_train."""
    run_start: float
    """When ``run_arm`` began launching: everything before it since ``scheduled_at`` is queue wait."""
    end: float
    attempt_start: Optional[float] = None
    """Launch of the attempt that produced the result; time before it (failed attempts) is restart time."""
    restarts: int = 0
    extra_checkpoint_s: float = 0.0
    """Final report + checkpoint persistence measured by rank 0 after its result was written."""
    failure: Optional[dict[str, str]] = None
    """Executor-level failure (process killed, worker group failed): {type, message}."""
    git_sha: Optional[str] = None
    git_dirty: Optional[bool] = None
    host: str = ""
    node_id: Optional[str] = None
    software: dict[str, Optional[str]] = field(default_factory=dict)
    code_fingerprint: Optional[str] = None
    process: Optional[dict[str, Any]] = None
    """How the arm's process was prepared (``trainers.forkserver.Prepared.to_dict``), None when unknown."""


def config_hash(spec: ArmSpec) -> str:
    return hashlib.sha256(json.dumps(lane_to_dict(spec.lane), sort_keys=True).encode()).hexdigest()[:16]


def peak_flops(hardware: dict[str, Any], precision: str) -> Optional[float]:
    """Per-device peak for MFU, only where the table's dtype (bf16) is the compute dtype; else None."""
    if hardware.get("kind") != "cuda" or precision != "bf16":
        return None
    gpus = hardware.get("gpus") or []
    name = str(gpus[0].get("name") or "").upper() if gpus else ""
    for words, flops in PEAK_BF16_FLOPS:
        if name and all(word in name for word in words):
            return flops
    return None


def _letters(spec: ArmSpec) -> str:
    try:
        from ablate.config.pattern import parse_pattern

        return parse_pattern(spec.lane.model.pattern)
    except Exception:  # noqa: BLE001 - a receipt for an arm whose pattern cannot even be parsed still gets written
        return ""


def _time(spec: ArmSpec, result: Optional[WorkerResult], launch: LaunchInfo) -> Accounting:
    wall = launch.end - spec.scheduled_at
    queue_wait = launch.run_start - spec.scheduled_at
    if result is None:
        return account_time(wall, queue_wait, 0.0, 0.0, None, restart_s=launch.end - launch.run_start)
    attempt_start = launch.run_start
    if launch.restarts:
        # Time before the attempt that produced the result was lost to failed attempts (restart).
        # Ray Train restarts inside fit(): the surviving attempt began when its train function did.
        attempt_start = launch.attempt_start if launch.attempt_start is not None else result.fn_start
    done = result.done or launch.end
    # Executor start-up ends where the lane's features are first read; setup ends when the engine is built. An
    # arm that failed earlier bills what it reached to the last stage it entered.
    features_at = result.features_at or done
    ready = result.ready or done
    teardown = max(0.0, launch.end - done - launch.extra_checkpoint_s)
    # The wait for the setup turn (interleaved blocks) lies just before features_at: it is not start-up.
    startup = features_at - attempt_start - result.setup_wait_s
    return account_time(wall, queue_wait, startup, ready - features_at, result.loop_summary,
                        restart_s=attempt_start - launch.run_start, teardown_s=teardown,
                        extra_checkpoint_s=launch.extra_checkpoint_s, setup_wait_s=result.setup_wait_s)


def _unused_by_the_baseline_too(spec: ArmSpec, engine: dict[str, Any]) -> bool:
    """Whether the candidate engine's "setting unused" fact makes the toggle inert, i.e. holds for the baseline's
    value too. One DDP bucket under the candidate's cap says every cap at least as large runs the same reducer; a
    smaller baseline cap may still split the gradients (found in review: raising the cap from 0.05 to 1 MiB merged
    three buckets into one and was rejected as inert). Left to the block's observed comparison, which sees both
    arms' buckets, whenever the baseline cap could split them."""
    if spec.feature != "bucket_cap_mb" or engine["inactive"][spec.feature] != SINGLE_BUCKET:
        return True
    try:
        baseline_bytes = float(spec.baseline_value) * 2**20
    except (TypeError, ValueError):
        return False
    return baseline_bytes >= sum(engine.get("buckets_bytes") or [math.inf])


def _disqualifiers(spec: ArmSpec, result: Optional[WorkerResult], launch: LaunchInfo, accounting: Accounting,
                   compile_record: CompileRecord, steady: int, tokens_per_step: int) -> list[Disqualifier]:
    found: list[Disqualifier] = []

    def add(code: Code, detail: str, step: Optional[int] = None) -> None:
        found.append(Disqualifier(code=code, severity=code_severity(code), detail=redact_text(detail)[:2000], step=step))

    lane = spec.lane
    error = (result.error if result is not None else None) or launch.failure
    if error is not None:
        category = error.get("category", "exception")
        step = error.get("step") if isinstance(error.get("step"), int) else None
        if category == "nonfinite":
            add(Code.NONFINITE_LOSS, error.get("message", ""), step)
        elif category == "oom":
            add(Code.OOM, error.get("message", "")[:500], step)
        add(Code.ARM_FAILED, f"{error.get('type')}: {error.get('message', '')[:500]}", step)
    if result is not None:
        posture = lane.compile.posture.value
        fallbacks = [b for b in result.backends
                     if fell_back(str(b.get("op")), str(b.get("requested")), str(b.get("observed")), posture)]
        if fallbacks:
            add(Code.BACKEND_FALLBACK, "; ".join(f"{b['op']}: requested {b['requested']}, ran {b['observed']} "
                                                 f"({b.get('reason', '')})" for b in fallbacks))
        wrong = (result.node_check or {}).get("wrong") or []
        if wrong:
            doc = result.node_check
            add(Code.BACKEND_FAILED_NODE_CHECK, f"{', '.join(wrong)}: fails its reference twin in {doc.get('path')} "
                                                f"(sha256 {doc.get('sha256')}); fix the kernel or run another backend")
        if result.device == "cpu" and lane.hardware.device.value == "cuda":
            add(Code.HARDWARE_MISMATCH, "lane asked for cuda; no CUDA here, ran on CPU (lane.hardware.cpu_fallback)")
        drift = [t for t in result.tokens_per_step_observed if t != tokens_per_step]
        # A size-mismatch recompile is geometry evidence only once the steady state began (warmup may legitimately
        # see several shapes, e.g. regional blocks whose first input does not require grad).
        size_recompiles = ([r for r in compile_record.recompile_reasons if "size mismatch" in r]
                           if (compile_record.recompiles_in_steady_state or 0) > 0 else [])
        if drift or size_recompiles:
            add(Code.BATCH_GEOMETRY_CHANGED, f"requested {tokens_per_step} tokens/step; observed "
                                             f"{sorted(set(result.tokens_per_step_observed))}"
                                             + (f"; recompile: {size_recompiles[0]}" if size_recompiles else ""))
    if (compile_record.graph_breaks or 0) > 0 or (error or {}).get("category") == "graph_break":
        reasons = compile_record.graph_break_reasons or [str((error or {}).get("message", ""))[:300]]
        add(Code.GRAPH_BREAK, f"{compile_record.graph_breaks or 'fullgraph'} graph break(s): {reasons[0]}")
    if (compile_record.recompiles_in_steady_state or 0) > 0:
        add(Code.RECOMPILE_IN_STEADY_STATE, f"{compile_record.recompiles_in_steady_state} compile event(s) after "
                                            "warmup; reasons: " + "; ".join(compile_record.recompile_reasons[-3:]))
    if spec.feature is not None and spec.feature in FEATURES:
        # Against the block's baseline value: for the baseline arm itself only baseline-independent rules fire.
        reason = FEATURES[spec.feature].inert_reason(lane, spec.baseline_value)
        engine = (result.engine if result is not None else None) or {}
        inactive = engine.get("inactive") or {}
        if reason is None and spec.arm == "candidate" and spec.feature in inactive \
                and _unused_by_the_baseline_too(spec, engine):
            # Observed: the running engine reports the setting under test has no effect in it.
            reason = f"the running engine does not use it: {inactive[spec.feature]}"
        if reason:
            add(Code.INERT_TOGGLE, f"{spec.feature}: {reason}")
    if error is None and steady < lane.budget.min_steady_steps:   # a failed arm's cause is its failure
        add(Code.INSUFFICIENT_STEADY_STEPS, f"{steady} steady steps < lane.budget.min_steady_steps "
                                            f"({lane.budget.min_steady_steps})")
    violation = accounting.violation
    limit = max(UNATTRIBUTED_LIMIT * accounting.wall_s, TIME_TOLERANCE_FLOOR_S)
    unattributed = accounting.badput_s.get("unattributed", 0.0)
    if violation is None and error is None and unattributed > limit:
        violation = (f"{unattributed:.3f}s ({unattributed / max(accounting.wall_s, 1e-9):.1%} of wall) is not "
                     f"explained by any measured part (limit {UNATTRIBUTED_LIMIT:.0%})")
    if violation:
        add(Code.TIME_ACCOUNTING_VIOLATION, violation)
    host = (result.host_load if result is not None else None) or {}
    if host.get("niceness") is not None and host["niceness"] > 0:
        add(Code.LOW_PRIORITY, f"the arm ran at niceness {host['niceness']} (inherited "
                               f"{host.get('niceness_inherited')}) and could not reset it: any other process on the "
                               "node pre-empts it. Start Ray with RAY_worker_niceness=0 (ablate does for local "
                               "runtimes; cluster.yaml does on every node) or grant the workers CAP_SYS_NICE")
    if host.get("contended"):
        found.append(Disqualifier(code=Code.HOST_CONTENDED, severity=code_severity(Code.HOST_CONTENDED),
                                  detail=redact_text(str(host.get("detail", "")))[:500]))
    return found


def _compile_record(spec: ArmSpec, result: Optional[WorkerResult]) -> CompileRecord:
    if result is not None and result.compile is not None:
        return CompileRecord(**result.compile)
    warmup = (result.warmup if result is not None else None) or {}
    return CompileRecord(posture_requested=spec.lane.compile.posture.value, posture_observed="not_reached",
                         warmup_requested=spec.lane.compile.warmup.value,
                         warmup_resolved=warmup.get("resolved", "not_reached"),
                         warmup_reason=warmup.get("reason", "the arm ended before its warmup policy was resolved"))


def _steps(spec: ArmSpec, result: Optional[WorkerResult], loop: Optional[LoopSummary]) -> StepStats:
    if loop is None or result is None:
        return StepStats(total=0, warmup=0, steady=0)
    steady_s = [s.step_s for s in loop.steps if s.label == "steady"]
    stats = step_statistics(steady_s)
    budget = [s for s in loop.steps if s.phase == "budget"]
    return StepStats(total=len(loop.steps), warmup=sum(1 for s in loop.steps if s.label == "compile_warmup"),
                     steady=len(steady_s), **stats,
                     time_to_first_step_s=(result.first_step_end - spec.scheduled_at
                                           if result.first_step_end is not None else None),
                     first_step_s=loop.steps[0].step_s if loop.steps else None,
                     series=[s.step_s for s in budget],
                     loss_series=[v if math.isfinite(v) else None for v in result.losses],
                     phases=[s.phase for s in loop.steps], compile_events=[s.compile_events for s in loop.steps],
                     sampled=[s.sampled for s in loop.steps], labels=[s.label for s in loop.steps],
                     step_s=[s.step_s for s in loop.steps], data_s=[s.data_s for s in loop.steps],
                     cadence_s=[s.cadence_s for s in loop.steps], phase_s=[s.phase_s for s in loop.steps],
                     wait_s=[s.wait_s for s in loop.steps],
                     tokens=[s.tokens for s in loop.steps], data_is_badput=loop.data_is_badput)


def _projection(spec: ArmSpec, loop: Optional[LoopSummary], accounting: Accounting,
                tokens_per_step: int) -> Optional[Projection]:
    if loop is None:
        return None
    proj = project(accounting.badput_s["setup"], loop.views(), spec.lane.budget.horizon_steps, tokens_per_step)
    return proj if proj.projected_s is not None else None


def build_receipt(spec: ArmSpec, result: Optional[WorkerResult], launch: LaunchInfo) -> Receipt:
    lane = spec.lane
    assert spec.receipt_id is not None, "run_arm assigns the receipt id before launching"
    geometry = Geometry(lane.batch.micro_batch, lane.batch.seq_len, lane.batch.grad_accum, lane.engine.workers)
    accounting = _time(spec, result, launch)
    loop = result.loop_summary if result is not None else None
    compile_record = _compile_record(spec, result)
    steps = _steps(spec, result, loop)
    disqualifiers = _disqualifiers(spec, result, launch, accounting, compile_record, steps.steady,
                                   geometry.tokens_per_step)
    error = (result.error if result is not None else None) or launch.failure
    status = (Status.failed if error is not None else
              Status.disqualified if any(d.severity is Severity.fatal for d in disqualifiers) else Status.valid)
    software = (result.software if result is not None and result.software else None) or launch.software or \
        software_versions()
    if result is not None and result.data:
        fingerprint = str(result.data.get("fingerprint"))
    else:
        try:
            from trainers.data import fingerprint_of   # reads the corpus (and imports torch): only without a result

            fingerprint = fingerprint_of(lane.data, lane.model.vocab_size)
        except Exception as exc:  # noqa: BLE001 - an unreadable corpus is itself the failure being recorded
            fingerprint = f"unavailable: {type(exc).__name__}"

    budget_steps = [s for s in loop.steps if s.phase == "budget"] if loop else []
    steady_steps = [s for s in budget_steps if s.label == "steady"]
    tokens = sum(s.tokens for s in budget_steps)
    steady_time = sum(s.step_s for s in steady_steps)
    flops = (result.flops if result is not None else None) or {}
    hardware = (result.hardware if result is not None else None) or {}
    peak = peak_flops(hardware, lane.precision.value)
    steady_tps = sum(s.tokens for s in steady_steps) / steady_time if steady_time > 0 else None
    projection = _projection(spec, loop, accounting, geometry.tokens_per_step)
    mfu = None
    if peak and steady_tps and flops.get("total") and not flops.get("coverage_missing"):
        mfu = flops["total"] * steady_tps / (peak * geometry.world_size)
    observed_tokens = next((t for t in (result.tokens_per_step_observed if result else [])
                            if t != geometry.tokens_per_step), geometry.tokens_per_step if result else None)
    hw_fingerprint = hardware_fingerprint(hardware, software) if hardware else None
    counts = (result.layer_counts if result is not None and result.layer_counts else
              {family: _letters(spec).count(family) for family in FAMILIES})
    params = (result.params if result is not None else None) or {}

    # Sealed here (digest over the content), so every copy, the one sent to the driver included, can be checked.
    return seal(Receipt(
        identity=Identity(
            receipt_id=spec.receipt_id, sweep_id=spec.sweep_id, campaign=spec.campaign, block_id=spec.block_id,
            arm=ArmRole(spec.arm), arm_index=spec.arm_index, order=spec.order, feature=spec.feature,
            feature_value=spec.feature_value, baseline_value=spec.baseline_value, kind=spec.kind,
            lane_key=spec.lane_key, config_hash=config_hash(spec),
            software_fingerprint=evidence_fingerprint(software, launch.code_fingerprint, hw_fingerprint),
            code_fingerprint=launch.code_fingerprint, hardware_fingerprint=hw_fingerprint,
            attempt=spec.attempt + launch.restarts, status=status,
            host=result.host if result is not None else launch.host,
            node_id=(result.node_id if result is not None else None) or launch.node_id,
            pid=result.pid if result is not None else None, executor=launch.executor,
            process=launch.process,
            pairing="interleaved" if result is not None and result.paired else "sequential", git_sha=launch.git_sha,
            schedule=spec.schedule,
            git_dirty=launch.git_dirty, created_at=dt.datetime.now(dt.timezone.utc).isoformat(), software=software,
            campaign_sha256=spec.campaign_sha256, defaults_sha256=spec.defaults_sha256),
        requested=Requested(
            lane=flatten(lane_to_dict(lane)), pattern=lane.model.pattern, layer_counts=counts,
            params_total=params.get("total"), params_active=params.get("active"),
            tokens_per_step=geometry.tokens_per_step, data_fingerprint=fingerprint, world_size=geometry.world_size,
            device=lane.hardware.device.value),
        observed=Observed(hardware=hardware, backends=[BackendRecord(**b) for b in (result.backends if result else [])],
                          compile=compile_record, tokens_per_step=observed_tokens,
                          engine=(result.engine if result is not None else None) or {},
                          model=(result.model if result is not None else None) or {},
                          node_check=(result.node_check if result is not None else None) or {}),
        time=TimeAccounting(wall_s=accounting.wall_s, goodput_s=accounting.goodput_s, badput_s=accounting.badput_s,
                            goodput_fraction=accounting.goodput_fraction, clock=spec.clock),
        steps=steps,
        projection=projection,
        host_load=HostLoad(**((result.host_load if result is not None else None) or {})),
        energy=Energy(**result.energy) if result is not None and result.energy else
        Energy(why="the arm ended before its budget steps were measured"),
        throughput=Throughput(tokens=tokens, wall_tokens_per_s=tokens / accounting.wall_s
                              if accounting.wall_s > 0 and budget_steps else None,
                              steady_tokens_per_s=steady_tps, flops_per_token=flops.get("total"),
                              flops_coverage_missing=list(flops.get("coverage_missing") or []), mfu=mfu,
                              peak_flops=peak),
        memory=Memory(**((result.memory if result is not None and result.memory else None) or {"kind": "unknown"})),
        family_share=(result.family_share if result is not None and result.family_share else
                      {letter: None for letter in FAMILIES}),
        family_share_method=result.family_method if result is not None else None,
        quality=Quality(**((result.quality if result is not None else None) or {})),
        disqualifiers=disqualifiers,
        error=ErrorInfo(type=str(error.get("type")), message=redact_text(str(error.get("message")))) if error else None,
        env=(result.env if result is not None and result.env else capture_env()),
    ))
