"""The Tune trial of one block, and what it needs: arm specs, stable receipt ids, attempt numbers.

How to run me: not directly; ``ablate.sweep.run`` wraps ``run_block`` with ``tune.with_parameters`` and
``tune.with_resources`` and Tune runs one trial per block in a Ray worker process.

``run_block`` runs the block's two arms on this node, each in its own fresh worker process (the step budget lives
inside the training loop, never a Tune ``stop=``), and reports each arm's receipt JSON with ``tune.report``. With
``block_mode: interleaved`` (the default) and two one-worker CPU arms, ``trainers.run_pair`` starts both processes
together and they take turns step by step, the plan's first arm first, so both sample the same machine drift;
otherwise (multi-worker or GPU arms, or ``sequential``) ``trainers.run_arm`` runs them back to back in the
recorded order. Each receipt records which way it ran (``identity.pairing``). An arm that *failed* (crashed, not merely
disqualified) fails the trial, so ``tune.FailureConfig`` reruns the whole block as the next attempt. Receipt ids
are derived from (sweep, block, arm, attempt): a replayed result maps to the same MLflow run, and a rerun never
overwrites earlier evidence.
"""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from ablate.receipts.outline import ReceiptLike, outline
from ablate.receipts.schema import Receipt, Status
from ablate.sweep.plan import ArmPlan, Block

if TYPE_CHECKING:
    from trainers.spec import ArmSpec

log = logging.getLogger(__name__)
_RECEIPT_NS = uuid.UUID("7f1d9c2e-58a4-4c53-9d1e-2b7c0c6a4e11")
_ATTEMPT_FILE = "attempt.json"
CLOCK_WAIT_S = 5.0
"""How long a trial waits for the driver's scheduling stamp before falling back to its own (and saying so)."""


CLOCK_NAMESPACE = "ablate-clock"
"""The namespace of the scheduling stamps in Ray's key-value store (its GCS): one key per sweep and block."""


def _clock_key(sweep_id: str, block_id: str) -> str:
    return f"{sweep_id}/{block_id}"


class SchedulingClock:
    """Driver -> trial hand-off of "when the driver handed this block to Ray", kept in Ray's own key-value store.

    The first arm's wall clock, and so its queue wait, starts at the driver's stamp rather than inside the trial,
    where it would be ~0 by construction. The second arm is scheduled by the trial when the first one ends. Not an
    actor: one cost a Ray worker process of its own (~2 s of CPU on 2 cores) and one of the node's worker start-up
    slots at the moment the first trials' processes were starting.
    """

    def __init__(self, sweep_id: str) -> None:
        self.sweep_id = sweep_id

    def stamp(self, block_id: str, at: float) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(_clock_key(self.sweep_id, block_id), repr(at), overwrite=True, namespace=CLOCK_NAMESPACE)

    def close(self) -> None:
        """Forget this sweep's stamps (a long-lived cluster runs many sweeps). Never raises."""
        try:
            from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_initialized

            if _internal_kv_initialized():
                _internal_kv_del(_clock_key(self.sweep_id, ""), del_by_prefix=True, namespace=CLOCK_NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - a cluster already gone keeps nothing to forget
            log.debug("scheduling stamps of %s not removed: %s", self.sweep_id, exc)


def start_clock(sweep_id: str) -> SchedulingClock:
    """The sweep's clock, without stamps a killed driver of the same sweep left (``--resume``): a stamp whose put
    fails must leave the trial on its own clock, never on the dead driver's time."""
    clock = SchedulingClock(sweep_id)
    clock.close()
    return clock


def driver_stamp(sweep_id: str, block_id: str, wait_s: float = CLOCK_WAIT_S) -> Optional[float]:
    """The driver's scheduling stamp of ``block_id``; None when there is none within ``wait_s`` (``run_block``
    called bare, outside a sweep's driver)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return None
    deadline = time.monotonic() + wait_s
    while True:
        # Tune calls the driver's on_trial_start before it submits the trial's work, but the two reach the
        # store from different processes: a short poll covers the race.
        value = _internal_kv_get(_clock_key(sweep_id, block_id), namespace=CLOCK_NAMESPACE)
        if value is not None:
            return float(value)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def receipt_id(sweep_id: str, block_id: str, arm_index: int, attempt: int) -> str:
    """Deterministic: a replayed result or a re-sent receipt maps to the same MLflow run."""
    return str(uuid.uuid5(_RECEIPT_NS, f"{sweep_id}/{block_id}/{arm_index}/{attempt}"))


class ArmFailed(RuntimeError):
    """An arm crashed; Tune retries the block (``max_failures``) as a new attempt. ``brief``: one line for the
    console, each failed arm's first and last line (its full failure, tracebacks included, is the message and the
    receipt's)."""

    def __init__(self, message: str, brief: str = "") -> None:
        super().__init__(message)
        self.brief = brief or " ".join(message.split())


def arm_failed(block_id: str, attempt: int, failures: list[str]) -> ArmFailed:
    """The error a block's trial raises when arms failed (``failures``: "<role> arm failed: <why>" each)."""
    head = f"block {block_id} attempt {attempt}: "
    return ArmFailed(head + "; ".join(failures), head + "; ".join(_brief(failure) for failure in failures))


def _brief(failure: str, limit: int = 300) -> str:
    lines = [line.strip() for line in failure.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _attempt(floor: int) -> int:
    """This run of the block's attempt number: one more than its last checkpointed attempt, and never below
    ``floor`` (the driver's count from receipts on disk, which survives a driver killed before Tune saved the
    checkpoint into its experiment state), so a rerun never reuses the receipt ids of earlier evidence."""
    from ray import tune

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return floor
    with checkpoint.as_directory() as directory:
        last = int(json.loads((Path(directory) / _ATTEMPT_FILE).read_text())["attempt"])
    return max(floor, last + 1)


def make_arm_spec(block: Block, position: int, arm: ArmPlan, *, sweep_id: str, campaign: str, receipt_dir: str,
                  attempt: int = 0, inject: Optional[dict[str, Any]] = None, scheduled_at: Optional[float] = None,
                  hashes: Optional[dict[str, Optional[str]]] = None,
                  node_check_path: Optional[str] = None, schedule: str = "fixed",
                  device: Optional[str] = None, host_allocator: Optional[str] = None) -> "ArmSpec":
    """The trainer's input for one arm; its wall clock starts at ``scheduled_at`` (the driver's stamp), or now."""
    from trainers.spec import ArmSpec

    return ArmSpec(lane=arm.lane, sweep_id=sweep_id, campaign=campaign, block_id=block.block_id, arm=arm.arm,
                   arm_index=arm.arm_index, order=position, feature=block.feature, feature_value=arm.value,
                   baseline_value=block.baseline_value, kind=block.kind, lane_key=block.lane_key,
                   receipt_dir=receipt_dir, scheduled_at=time.time() if scheduled_at is None else scheduled_at,
                   clock="trial" if scheduled_at is None else "driver",
                   campaign_sha256=(hashes or {}).get("campaign"), defaults_sha256=(hashes or {}).get("defaults"),
                   attempt=attempt, receipt_id=receipt_id(sweep_id, block.block_id, arm.arm_index, attempt),
                   inject=dict(inject or {}), schedule=schedule, device=device,
                   **({"node_check_path": node_check_path} if node_check_path else {}),
                   **({"host_allocator": host_allocator} if host_allocator else {}))


_PLAN_BLOCKS: dict[str, dict[str, Any]] = {}
"""The plan's blocks this trial process read last, by the hex of their object ref (one entry)."""


def plan_blocks(context: dict[str, Any]) -> dict[str, Any]:
    """Block id -> block mapping of the sweep's plan. ``run_sweep`` puts them in the object store once and passes the
    ref inside the trial context: ``tune.with_parameters`` deserializes the whole context at every trial start, and
    with the blocks in it that grew with the campaign (~50 ms per trial at 1,000 blocks on 2 CPUs). Read once per
    trial process (Tune reuses it for the next block); a plain mapping (a test calling ``run_block``) as given."""
    blocks = context["blocks"]
    if isinstance(blocks, dict):
        return blocks
    import ray

    key = blocks.hex()
    if key not in _PLAN_BLOCKS:
        _PLAN_BLOCKS.clear()  # another sweep's plan in this process (a worker Ray kept between sweeps)
        _PLAN_BLOCKS[key] = ray.get(blocks)
    return _PLAN_BLOCKS[key]


def run_block(config: dict[str, Any], context: Optional[dict[str, Any]] = None) -> None:
    """Tune function trainable: one block = its two arms, back to back on this node, in the recorded order."""
    import ray
    from ray import tune

    from trainers import run_arm
    from trainers.run import can_interleave, run_pair

    assert context is not None, "run_block is wrapped with tune.with_parameters(context=...)"
    # Each block saves its attempt marker as a checkpoint; Ray logs every save at INFO and forwards it to the
    # driver's console. Warnings and errors still go through.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    block = Block.from_dict(plan_blocks(context)[config["block_id"]])
    node_id, host = ray.get_runtime_context().get_node_id(), socket.gethostname()
    if block.block_id in context.get("completed", ()):
        # Resumed sweep whose driver died before Tune recorded this block as finished: its receipts exist.
        tune.report({"event": "block_skipped", "block_id": block.block_id, "node_id": node_id, "host": host})
        return
    attempt = _attempt(context.get("next_attempt", {}).get(block.block_id, 0))
    # A checkpoint that records the attempt: a retry (Tune restores the latest checkpoint) knows it is attempt
    # n + 1 and gets fresh receipt ids instead of overwriting attempt n's evidence.
    with tempfile.TemporaryDirectory(prefix="ablate-attempt-") as directory:
        (Path(directory) / _ATTEMPT_FILE).write_text(json.dumps({"attempt": attempt}))
        tune.report({"event": "block_started", "block_id": block.block_id, "attempt": attempt,
                     "node_id": node_id, "host": host, "at": time.time()},
                    checkpoint=tune.Checkpoint.from_directory(directory))
    inject = context.get("inject", {}).get(block.block_id, {}) if attempt == 0 else {}
    # Only the first attempt's first arm starts at the driver's stamp; a retry is scheduled by Tune's recovery.
    scheduled = driver_stamp(context["sweep_id"], block.block_id) if attempt == context.get(
        "next_attempt", {}).get(block.block_id, 0) else None
    failed: list[str] = []

    def report(position: int, arm: ArmPlan, spec: "ArmSpec", receipt: Receipt) -> None:
        tune.report({"event": "arm", "block_id": block.block_id, "arm": arm.arm, "arm_index": arm.arm_index,
                     "order": position, "attempt": attempt, "status": receipt.identity.status.value,
                     "scheduled_at": spec.scheduled_at, "ended_at": time.time(), "node_id": node_id, "host": host,
                     "receipt": receipt.model_dump_json()})
        if receipt.identity.status is Status.failed:
            why = receipt.error.message if receipt.error else "no error recorded"
            failed.append(f"{arm.arm} arm failed: {why}")

    # Both arms always run: a failed arm is still half of a block, so promotion sees a failed candidate as a
    # loss (and a failed baseline as a block without a yardstick) instead of an unpaired receipt.
    order = block.run_order()
    # Test-only (``run_sweep(simulate_arms=True)``): no-op arms whose receipts say so and never count as evidence.
    simulated = context.get("simulate_arms") is True

    def run_one(spec: "ArmSpec") -> Receipt:
        if simulated:
            from trainers.simulate import simulate_arm

            return simulate_arm(spec)
        return run_arm(spec, **context["run_arm"])

    if context.get("block_mode", "interleaved") == "interleaved" and not simulated:
        specs = tuple(make_arm_spec(block, position, arm, sweep_id=context["sweep_id"], campaign=context["campaign"],
                                    receipt_dir=context["receipt_dir"], attempt=attempt,
                                    inject=inject if position == 0 else None, scheduled_at=scheduled,
                                    hashes=context.get("hashes"), node_check_path=context.get("node_check_path"),
                                    schedule=context.get("schedule", "fixed"), device=context.get("device"),
                                    host_allocator=context.get("host_allocator"))
                      for position, arm in order)
        if can_interleave(specs, node_has_gpu=ray.cluster_resources().get("GPU", 0) > 0):  # type: ignore[arg-type]
            cpus = int(context["run_arm"].get("resources_per_worker", {}).get("CPU", 1))
            receipts = run_pair(specs, timeout_s=context["run_arm"].get("timeout_s"),  # type: ignore[arg-type]
                                cpus=cpus)
            for (position, arm), spec, receipt in zip(order, specs, receipts):
                report(position, arm, spec, receipt)
            order = []
    for position, arm in order:
        spec = make_arm_spec(block, position, arm, sweep_id=context["sweep_id"], campaign=context["campaign"],
                             receipt_dir=context["receipt_dir"], attempt=attempt,
                             inject=inject if position == 0 else None,
                             scheduled_at=scheduled if position == 0 else None, hashes=context.get("hashes"),
                             node_check_path=context.get("node_check_path"),
                             schedule=context.get("schedule", "fixed"), device=context.get("device"),
                             host_allocator=context.get("host_allocator"))
        report(position, arm, spec, run_one(spec))
    if failed:
        raise arm_failed(block.block_id, attempt, failed)


def block_progress(receipts: Iterable[ReceiptLike], sweep_id: str) -> tuple[list[str], dict[str, int]]:
    """From receipts on disk: blocks with a complete, non-failed attempt, and each block's next attempt number."""
    arms: dict[tuple[str, int], dict[int, Status]] = {}
    next_attempt: dict[str, int] = {}
    for arm in map(outline, receipts):
        if arm.sweep_id != sweep_id:
            continue
        arms.setdefault((arm.block_id, arm.attempt), {})[arm.arm_index] = arm.status
        next_attempt[arm.block_id] = max(next_attempt.get(arm.block_id, 0), arm.attempt + 1)
    completed = sorted({block_id for (block_id, _), pair in arms.items() if len(pair) == 2
                        and all(status is not Status.failed for status in pair.values())})
    return completed, next_attempt


def clear_interrupted_scratch(receipt_dir: str | Path, sweep_id: str, block_ids: list[str],
                              attempts: int) -> list[str]:
    """Scratch dirs (``<receipts>/.work/<receipt id>``) of this sweep's arms that never wrote a receipt: arms a
    killed driver left behind. A resumed sweep reruns their blocks as a new attempt, so they are removed (the
    receipt store would otherwise list them on every read). Returns the receipt ids cleared."""
    import shutil

    from ablate.receipts.store import ARM_SCRATCH_DIR

    root = Path(receipt_dir)
    cleared = []
    for block_id in block_ids:
        for arm_index in (0, 1):
            for attempt in range(attempts):
                rid = receipt_id(sweep_id, block_id, arm_index, attempt)
                scratch = root / ARM_SCRATCH_DIR / rid
                if scratch.is_dir() and not (root / f"{rid}.json").exists():
                    shutil.rmtree(scratch, ignore_errors=True)
                    cleared.append(rid)
    return cleared


def trial_name(trial: Any) -> str:
    return str(trial.config["block_id"])


def trial_dirname(trial: Any) -> str:
    return f"{trial.config['block_id']}_{trial.trial_id}"
