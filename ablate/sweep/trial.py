"""The Tune trial of one block, and what it needs: arm specs, stable receipt ids, attempt numbers.

How to run me: not directly; ``ablate.sweep.run`` wraps ``run_block`` with ``tune.with_parameters`` and
``tune.with_resources`` and Tune runs one trial per block in a Ray worker process.

``run_block`` runs the block's two arms back to back on this node, in the order the plan recorded, each through
``trainers.run_arm`` (fresh worker processes; the step budget lives inside the training loop, never a Tune
``stop=``), and reports each arm's receipt JSON with ``tune.report``. An arm that *failed* (crashed, not merely
disqualified) fails the trial, so ``tune.FailureConfig`` reruns the whole block as the next attempt. Receipt ids
are derived from (sweep, block, arm, attempt): a replayed result maps to the same MLflow run, and a rerun never
overwrites earlier evidence.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ablate.receipts.schema import Receipt, Status
from ablate.sweep.plan import ArmPlan, Block

if TYPE_CHECKING:
    from trainers.spec import ArmSpec

_RECEIPT_NS = uuid.UUID("7f1d9c2e-58a4-4c53-9d1e-2b7c0c6a4e11")
_ATTEMPT_FILE = "attempt.json"


def receipt_id(sweep_id: str, block_id: str, arm_index: int, attempt: int) -> str:
    """Deterministic: a replayed result or a re-sent receipt maps to the same MLflow run."""
    return str(uuid.uuid5(_RECEIPT_NS, f"{sweep_id}/{block_id}/{arm_index}/{attempt}"))


class ArmFailed(RuntimeError):
    """An arm crashed; Tune retries the block (``max_failures``) as a new attempt."""


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
                  attempt: int = 0, inject: Optional[dict[str, Any]] = None) -> "ArmSpec":
    """The trainer's input for one arm; ``scheduled_at`` starts the arm's wall clock now."""
    from trainers.spec import ArmSpec

    return ArmSpec(lane=arm.lane, sweep_id=sweep_id, campaign=campaign, block_id=block.block_id, arm=arm.arm,
                   arm_index=arm.arm_index, order=position, feature=block.feature, feature_value=arm.value,
                   baseline_value=block.baseline_value, kind=block.kind, lane_key=block.lane_key,
                   receipt_dir=receipt_dir, scheduled_at=time.time(), attempt=attempt,
                   receipt_id=receipt_id(sweep_id, block.block_id, arm.arm_index, attempt), inject=dict(inject or {}))


def run_block(config: dict[str, Any], context: Optional[dict[str, Any]] = None) -> None:
    """Tune function trainable: one block = its two arms, back to back on this node, in the recorded order."""
    import ray
    from ray import tune

    from trainers import run_arm

    assert context is not None, "run_block is wrapped with tune.with_parameters(context=...)"
    block = Block.from_dict(context["blocks"][config["block_id"]])
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
    failed: list[str] = []
    # Both arms always run: a failed arm is still half of a block, so promotion sees a failed candidate as a
    # loss (and a failed baseline as a block without a yardstick) instead of an unpaired receipt.
    for position, arm in block.run_order():
        spec = make_arm_spec(block, position, arm, sweep_id=context["sweep_id"], campaign=context["campaign"],
                             receipt_dir=context["receipt_dir"], attempt=attempt,
                             inject=inject if position == 0 else None)
        receipt: Receipt = run_arm(spec, **context["run_arm"])
        tune.report({"event": "arm", "block_id": block.block_id, "arm": arm.arm, "arm_index": arm.arm_index,
                     "order": position, "attempt": attempt, "status": receipt.identity.status.value,
                     "scheduled_at": spec.scheduled_at, "ended_at": time.time(), "node_id": node_id, "host": host,
                     "receipt": receipt.model_dump_json()})
        if receipt.identity.status is Status.failed:
            why = receipt.error.message if receipt.error else "no error recorded"
            failed.append(f"{arm.arm} arm failed: {why}")
    if failed:
        raise ArmFailed(f"block {block.block_id} attempt {attempt}: " + "; ".join(failed))


def block_progress(receipts: list[Receipt], sweep_id: str) -> tuple[list[str], dict[str, int]]:
    """From receipts on disk: blocks with a complete, non-failed attempt, and each block's next attempt number."""
    arms: dict[tuple[str, int], dict[int, Receipt]] = {}
    next_attempt: dict[str, int] = {}
    for receipt in receipts:
        ident = receipt.identity
        if ident.sweep_id != sweep_id:
            continue
        arms.setdefault((ident.block_id, ident.attempt), {})[ident.arm_index] = receipt
        next_attempt[ident.block_id] = max(next_attempt.get(ident.block_id, 0), ident.attempt + 1)
    completed = sorted({block_id for (block_id, _), pair in arms.items() if len(pair) == 2
                        and all(r.identity.status is not Status.failed for r in pair.values())})
    return completed, next_attempt


def trial_name(trial: Any) -> str:
    return str(trial.config["block_id"])


def trial_dirname(trial: Any) -> str:
    return f"{trial.config['block_id']}_{trial.trial_id}"
