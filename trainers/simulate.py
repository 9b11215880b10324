"""A no-op arm executor for orchestration benchmarks and tests: the sweep runs for real, the arms do not.

How to use: ``run_sweep(campaign, simulate_arms=True)`` (a keyword argument only; no CLI flag, campaign key or
environment variable turns it on). ``ablate.sweep.trial.run_block`` then hands every arm to ``simulate_arm``
instead of ``trainers.run_arm``/``run_pair``, so the driver, Tune, the recorder, the receipt files and MLflow all
do their real work while each arm costs milliseconds (``benchmarks/bench_orchestration.py``).

The receipt goes through the executors' own path (``trainers.run._prepare`` -> ``build_receipt`` -> ``_finish``:
scratch dir, git state, code fingerprint, sealed receipt written atomically), from a worker result of no-op steps
timed like real ones, so it passes ``validate_receipt``. It can never count as evidence:
- ``identity.executor`` is ``simulated`` (``ablate.receipts.schema.SIMULATED_EXECUTOR``), and promotion refuses
  every block holding such a receipt, naming the simulation (``ablate.promote.match.match_blocks``);
- ``identity.software`` carries a ``simulated`` entry, so its software fingerprint never equals a real arm's and
  simulated receipts could not pool with real evidence even if that refusal were bypassed.
"""

from __future__ import annotations

import functools
import os
import time

from ablate.receipts.schema import SIMULATED_EXECUTOR, Receipt
from trainers.goodput import StepTracker
from trainers.provenance import host_name, software_versions
from trainers.result import Geometry, WorkerResult
from trainers.spec import ArmSpec

SIMULATED_MARK = "no-op arm executor (trainers.simulate): measures nothing; never evidence"
"""The value of ``identity.software["simulated"]`` on every simulated receipt."""


@functools.lru_cache(maxsize=1)
def _software() -> tuple[tuple[str, str | None], ...]:
    # A real arm reads these in its own fresh process; here once per trial process (the first call imports torch).
    return tuple(sorted(software_versions().items()))


def _no_op_result(spec: ArmSpec, node_id: str | None) -> WorkerResult:
    """A worker result whose steps are timed no-ops: every time part is measured, so the accounting closes."""
    lane = spec.lane
    geometry = Geometry(lane.batch.micro_batch, lane.batch.seq_len, lane.batch.grad_accum, lane.engine.workers)
    result = WorkerResult(rank=0, world_size=lane.engine.workers, attempt=spec.attempt, executor=SIMULATED_EXECUTOR,
                          pid=os.getpid(), host=host_name(), node_id=node_id, fn_start=time.time())
    result.software = {**dict(_software()), "simulated": SIMULATED_MARK}
    result.data = {"fingerprint": "simulated: no data read"}
    result.device = "cpu"
    result.features_at = time.time()
    posture = lane.compile.posture.value
    result.compile = {"posture_requested": posture, "posture_observed": posture,
                      "warmup_requested": lane.compile.warmup.value, "warmup_resolved": "explicit",
                      "warmup_reason": "simulated arm: no-op steps", "graph_breaks": 0, "recompiles": 0,
                      "recompiles_in_steady_state": 0}
    result.model = {"compile_posture": posture, "simulated": True}
    result.memory = {"kind": "unknown"}
    result.ready = time.time()
    tracker = StepTracker()
    tracker.start()
    for _ in range(max(1, lane.compile.warmup_steps)):
        tracker.begin(phase="warmup")
        tracker.data_done()
        tracker.end(tokens=0, compile_events=1)
    for _ in range(max(lane.budget.steps, lane.budget.min_steady_steps)):
        tracker.begin(phase="budget")
        tracker.data_done()
        tracker.end(tokens=geometry.tokens_per_step)
        result.tokens_per_step_observed.append(geometry.tokens_per_step)
    result.first_step_end = tracker.first_step_end
    result.loop = tracker.finish(warmup_resolved="explicit").to_dict()
    result.done = time.time()
    return result


def simulate_arm(spec: ArmSpec) -> Receipt:
    """``trainers.run_arm`` without the arm: the same preparation, receipt and disk write, no process started."""
    from trainers.run import _finish, _prepare

    spec, work, launch = _prepare(spec, SIMULATED_EXECUTOR, time.time())
    result = _no_op_result(spec, launch.node_id)
    launch.end = time.time()
    return _finish(spec, work, launch, result)
