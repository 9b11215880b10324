"""Block runs: sweep run -> block run -> its two arm runs, with the block's answer on the block run.

A block (two arms run back to back on one host) is what promotion counts, so it is a run of its own, tagged
``ablate.role=block`` (every search for ``ablate.role=arm`` or ``sweep`` runs is unchanged). It is created,
nested under the sweep run, when the first arm of a block attempt is logged; the arm runs nest under it. Once
both arms of that attempt are logged it carries the block's answer: the log ratio and speed-up at the lane's
horizon as promotion computes them (``Block.log_ratio``), the winner, the arm order, the differing toggle(s) as
params and one side-by-side picture, ``block.svg`` (SVG text, ``ablate.tracking.plots.block_svg``; the
matplotlib ``block.png`` only on demand: ``ablate.tracking.mlflow_store.log_pngs``). Found by tags (sweep id,
block id, attempt), so a resumed sweep or ``ablate receipts sync`` never makes a second one; answered once (tag
``ablate.logged``, set in the same call as the answer's params and metrics, after the picture).

Cost on the sweep driver's MLflow writer: the client remembers the block runs it found or made
(``TrackingClient.block_ids``; ``preload_blocks`` reads a sweep's once when the sweep opens) and the first arm it
logged into a block run it made (``TrackingClient.unpaired``), so the second arm answers its block without a
search, a ``get_run`` or a receipt read back. Any block the client does not know that way (a resumed sweep, a
sync) goes the long way: search, read back, answer.
"""

from __future__ import annotations

import functools
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ablate.receipts.schema import Receipt
from ablate.tracking.mapping import (NOTE_TAG, ROLE_ARM, ROLE_BLOCK, TAG, block_change, block_run_name, epoch_ms,
                                     round_short_id)

if TYPE_CHECKING:
    from ablate.promote.policy import Policy
    from ablate.tracking.mlflow_store import TrackingClient

log = logging.getLogger(__name__)

# MLflow's UI lists a run's metrics sorted by name (the run page's table; tests/tracking/test_mlflow_ui_browser.py
# checks it): a leading digit sorts before every letter, upper or lower case, so the block's answer is the first
# metric a reader sees. "0" rather than "_" (after capitals in ASCII) or "!" (MLflow allows only alphanumerics,
# "_", "-", ".", " ", "/" and ":" in metric names: mlflow/utils/validation.py, bad_character_message).
LOG_RATIO_METRIC = "0_log_ratio_at_horizon"
SPEEDUP_METRIC = "0_speedup_at_horizon"
DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "search_spaces" / "policies" / "default.yaml"
"""Only its ``failures.failed_log_ratio`` and gates matter here: the sweep answers blocks before any report."""


@dataclass
class BlockAnswer:
    log_ratio: Optional[float]
    """log(baseline time / candidate time) at the lane's horizon (> 0: the candidate finishes sooner)."""
    winner: str
    """candidate, baseline, tie (twin1/twin0 in an A/A block), or none when there is no ratio."""
    order: str
    horizon_steps: int
    toggles: dict[str, str]
    """Lane key -> ``baseline→candidate`` for every lane value the two arms ran differently."""
    why: str = ""
    """Why there is no ratio (a refused pair, a failed baseline); empty when there is one."""

    @property
    def speedup(self) -> Optional[float]:
        return None if self.log_ratio is None else math.exp(self.log_ratio)


@functools.lru_cache(maxsize=1)
def default_policy() -> "Policy":
    from ablate.promote.policy import load_policy

    return load_policy(DEFAULT_POLICY)


def _roles(receipts: list[Receipt]) -> tuple[Receipt, Receipt]:
    """(baseline, candidate); in an A/A block twin 0 plays baseline, as in ``ablate.promote.match``."""
    if receipts[0].identity.feature is None:
        first, second = sorted(receipts, key=lambda r: r.identity.arm_index)
        return first, second
    by_role = {r.identity.arm.value: r for r in receipts}
    return by_role.get("baseline", receipts[0]), by_role.get("candidate", receipts[1])


def block_answer(receipts: list[Receipt], policy: Optional["Policy"] = None) -> BlockAnswer:
    """The block's answer from its two receipts, by the promotion code itself (``match_blocks`` pairs and
    checks them, ``Block.log_ratio`` projects both to the lane's horizon): no second derivation to drift."""
    from ablate.promote.match import match_blocks, winner

    policy = policy or default_policy()
    base, cand = _roles(receipts)
    first = min(receipts, key=lambda r: r.identity.order)
    aa = base.identity.feature is None
    order = f"{'twin' + str(first.identity.arm_index) if aa else first.identity.arm.value} first"
    lane_b, lane_c = base.requested.lane, cand.requested.lane
    toggles = {k: f"{lane_b.get(k, '(absent)')}→{lane_c.get(k, '(absent)')}"
               for k in sorted(lane_b.keys() | lane_c.keys()) if lane_b.get(k) != lane_c.get(k)}
    horizon = int(base.requested.lane.get("budget.horizon_steps") or 0)
    blocks, refusals = match_blocks(receipts, policy)
    if not blocks:
        return BlockAnswer(None, "none", order, horizon, toggles,
                           why=refusals[0].reason if refusals else "not a matched pair")
    ratio = blocks[0].log_ratio(policy.failures.failed_log_ratio)
    if ratio is None:
        why = "the baseline arm failed: no yardstick" if blocks[0].baseline.failed else "no horizon projection"
        return BlockAnswer(None, "none", order, horizon, toggles, why=why)
    won = winner(ratio)
    if aa:
        won = {"candidate": "twin1", "baseline": "twin0"}.get(won, won)
    return BlockAnswer(ratio, won, order, horizon, toggles)


def _what(receipt: Receipt) -> str:
    if receipt.identity.feature is None:
        return "A/A noise-floor block (baseline twice)"
    return f"`{block_change(receipt)}`"


def block_note(receipt: Receipt) -> str:
    ident = receipt.identity
    return (f"Block **{ident.block_id}** of round {round_short_id(ident.sweep_id)} (campaign `{ident.campaign}`, "
            f"attempt {ident.attempt}): {_what(receipt)}; its two arm runs are nested below and the answer is "
            f"logged here once both are in.")


def answer_note(receipt: Receipt, answer: BlockAnswer) -> str:
    ident = receipt.identity
    head = f"Block **{ident.block_id}** of round {round_short_id(ident.sweep_id)}: {_what(receipt)}; "
    if answer.log_ratio is None:
        return head + f"no answer: {answer.why}."
    return (head + f"speed-up {answer.speedup:.3f}× (log ratio {answer.log_ratio:+.4f}) at the lane's "
                   f"{answer.horizon_steps:,}-step horizon, winner **{answer.winner}**, {answer.order}.")


BlockKey = tuple[str, str, str]
"""(sweep id, block id, attempt) as the runs' tags spell them: one block run per key."""


def block_key(receipt: Receipt) -> BlockKey:
    ident = receipt.identity
    return ident.sweep_id, ident.block_id, str(ident.attempt)


def _filters(key: BlockKey, role: str) -> list[str]:
    sweep_id, block_id, attempt = key
    return [f"tags.`{TAG}role` = '{role}'", f"tags.`{TAG}sweep_id` = '{sweep_id}'",
            f"tags.`{TAG}block_id` = '{block_id}'", f"tags.`{TAG}attempt` = '{attempt}'"]


def preload_blocks(client: "TrackingClient", sweep_id: str) -> None:
    """Remember every block run of the sweep (one search): ``open_block_run`` then searches no more for it."""
    for run in client.search([f"tags.`{TAG}role` = '{ROLE_BLOCK}'", f"tags.`{TAG}sweep_id` = '{sweep_id}'"]):
        _remember(client, run)
    client.blocks_known.add(sweep_id)


def _remember(client: "TrackingClient", run: Any) -> None:
    tags = run.data.tags
    client.block_ids[(tags.get(TAG + "sweep_id", ""), tags.get(TAG + "block_id", ""),
                      tags.get(TAG + "attempt", "0"))] = run.info.run_id
    if tags.get(TAG + "logged") == "1":
        client.answered.add(run.info.run_id)


def open_block_run(client: "TrackingClient", receipt: Receipt, sweep_run_id: str) -> tuple[str, bool]:
    """(run id, made now) of the receipt's block attempt, found by tags (or in the client's memory) or created
    under the sweep run."""
    key = block_key(receipt)
    if key in client.block_ids:
        return client.block_ids[key], False
    if key[0] not in client.blocks_known:
        found = client.search(_filters(key, ROLE_BLOCK))
        if found:
            _remember(client, found[0])
            return found[0].info.run_id, False
    ident = receipt.identity
    tags = {TAG + key: str(value) for key, value in (
        ("role", ROLE_BLOCK), ("sweep_id", ident.sweep_id), ("campaign", ident.campaign),
        ("block_id", ident.block_id), ("attempt", ident.attempt), ("lane_key", ident.lane_key),
        ("feature", ident.feature or "A/A"), ("baseline_value", ident.baseline_value), ("kind", ident.kind),
        ("host", ident.host))}
    tags.update({"mlflow.parentRunId": sweep_run_id, NOTE_TAG: block_note(receipt)})
    end_ms = epoch_ms(ident.created_at) or int(time.time() * 1000)
    run = client.client.create_run(client.experiment_id, start_time=end_ms - int(receipt.time.wall_s * 1000),
                                   tags=tags, run_name=block_run_name(receipt))
    client.block_ids[key] = run.info.run_id
    client.block_artifacts[run.info.run_id] = run.info.artifact_uri
    return run.info.run_id, True


def answer_block(client: "TrackingClient", key: BlockKey, block_run_id: str,
                 known: Optional[Receipt] = None) -> bool:
    """Log the answer on the block run once both arms of its attempt are logged; True when it did. ``known``:
    an arm's receipt already at hand (the one just logged), so only its partner is read back."""
    from ablate.tracking.bulk_read import read_arm_runs

    first = client.unpaired.get(key)
    if known is not None and first is not None and first.identity.receipt_id != known.identity.receipt_id:
        # Both arms were logged by this client into the block run it made: the pair is at hand, unanswered.
        _log_answer(client, block_run_id, [first, known], block_answer([first, known]), key)
        return True
    if block_run_id in client.answered or \
            client.client.get_run(block_run_id).data.tags.get(TAG + "logged") == "1":
        return False
    arms = [run for run in client.search(_filters(key, ROLE_ARM)) if run.data.tags.get(TAG + "logged") == "1"]
    if len(arms) != 2:
        return False
    receipts = [known] if known is not None else []
    others = [run for run in arms if known is None or run.data.tags.get(TAG + "receipt_id") !=
              known.identity.receipt_id]
    receipts += [o.receipt for o in read_arm_runs(others, client.tracking_uri) if o.receipt is not None]
    if len(receipts) != 2:
        return False
    _log_answer(client, block_run_id, receipts, block_answer(receipts), key)
    return True


def try_answer_block(client: "TrackingClient", key: BlockKey, block_run_id: str,
                     known: Optional[Receipt] = None) -> bool:
    """``answer_block`` that never raises: the arms are already safe in MLflow, and a block run left without its
    answer is answered by the next ``settle_blocks`` (sweep close or resume, ``ablate receipts sync``)."""
    try:
        return answer_block(client, key, block_run_id, known)
    except Exception as exc:  # noqa: BLE001 - the answer is a view of receipts that are already logged
        log.warning("block %s attempt %s of %s: its MLflow answer was not logged (%s: %s); `ablate receipts sync` "
                    "retries it", key[1], key[2], key[0], type(exc).__name__, str(exc)[:300])
        return False


def _log_answer(client: "TrackingClient", run_id: str, receipts: list[Receipt], answer: BlockAnswer,
                key: BlockKey) -> None:
    from mlflow.entities import Metric

    from ablate.tracking.plots import block_svg

    base, cand = _roles(receipts)
    now = int(time.time() * 1000)
    metrics = [] if answer.log_ratio is None else [
        Metric(LOG_RATIO_METRIC, answer.log_ratio, now, 0), Metric(SPEEDUP_METRIC, answer.speedup, now, 0)]
    metrics.append(Metric("horizon_steps", float(answer.horizon_steps), now, 0))
    params = {**answer.toggles, "winner": answer.winner, "arm_order": answer.order}
    tags = {TAG + "winner": answer.winner, TAG + "order": answer.order, NOTE_TAG: answer_note(cand, answer),
            TAG + "receipts": f"{base.identity.receipt_id},{cand.identity.receipt_id}",
            # Set only now: a baseline arm logged first does not know the candidate's value.
            TAG + "feature_value": str(cand.identity.feature_value),
            # Named from the candidate arm: the first arm logged may have been the baseline, which does not know
            # the candidate's value (MLflow renames the run when this tag is set).
            "mlflow.runName": block_run_name(cand), TAG + "logged": "1"}
    if answer.why:
        tags[TAG + "no_answer"] = answer.why[:4000]
    with tempfile.TemporaryDirectory(prefix="ablate-mlflow-") as tmp:
        block_svg(base, cand, Path(tmp) / "block.svg", title=block_run_name(cand))
        uri = client.block_artifacts.pop(run_id, None)
        if uri is None:  # a block run found, not made here: MLflow reads the run for its artifact URI
            client.client.log_artifacts(run_id, tmp)
        else:
            client.log_files(uri, tmp)
    client._log_batch(run_id, params=params, metrics=metrics, tags=tags)  # tags last: "logged" after the rest
    end_ms = max(epoch_ms(r.identity.created_at) or now for r in receipts)
    client.client.set_terminated(run_id, status="FINISHED", end_time=end_ms)
    client.answered.add(run_id)
    client.unpaired.pop(key, None)


def settle_blocks(client: "TrackingClient", sweep_id: str, final: bool = False) -> int:
    """Answer every block run of the sweep whose two arms are logged but which has no answer yet (a driver
    killed between the second arm and the answer); with ``final``, end those left with one arm (an attempt the
    sweep stopped at its first failed arm) as FAILED. Returns how many it answered."""
    runs = client.search([f"tags.`{TAG}role` = '{ROLE_BLOCK}'", f"tags.`{TAG}sweep_id` = '{sweep_id}'"])
    answered = 0
    for run in runs:
        tags = run.data.tags
        if tags.get(TAG + "logged") == "1" or run.info.run_id in client.answered:
            continue
        key = (sweep_id, tags.get(TAG + "block_id", ""), tags.get(TAG + "attempt", "0"))
        if try_answer_block(client, key, run.info.run_id):
            answered += 1
        elif final and run.info.status == "RUNNING":
            client.client.set_tag(run.info.run_id, TAG + "no_answer", "the attempt ended with one arm logged")
            client.client.set_terminated(run.info.run_id, status="FAILED")
    return answered


def block_runs(client: "TrackingClient", sweep_id: Optional[str] = None) -> dict[str, Any]:
    """run id -> run, for block runs (of one sweep)."""
    filters = [f"tags.`{TAG}role` = '{ROLE_BLOCK}'"]
    if sweep_id:
        filters.append(f"tags.`{TAG}sweep_id` = '{sweep_id}'")
    return {run.info.run_id: run for run in client.search(filters)}
