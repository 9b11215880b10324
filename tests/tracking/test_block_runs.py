"""Block runs (sweep run -> block run -> two arm runs), run names, descriptions and the experiment's type, on a
real SQLite MLflow store with the receipts of one real smoke block (``block_arms`` in conftest.py)."""

from __future__ import annotations

import math
from pathlib import Path
from xml.etree import ElementTree

import pytest
from sweeps_common import fresh_mlflow_uri

from ablate.promote.match import match_blocks
from ablate.receipts.schema import Receipt
from ablate.receipts.store import write_receipt
from ablate.tracking.blocks import LOG_RATIO_METRIC, SPEEDUP_METRIC, block_answer, default_policy, settle_blocks
from ablate.tracking.mapping import (EXPERIMENT_KIND_TAG, MACHINE_LEARNING, NOTE_TAG, ROLE_BLOCK, TAG,
                                     round_short_id, sweep_run_name)
from ablate.tracking.mlflow_store import MlflowStore, TrackingClient, sync

SWEEP_ID = "smoke-20261123-001547-3f2a"
"""The sweep id of ``block_arms`` (conftest.py)."""


def _blocks(client: TrackingClient) -> list:
    return client.search([f"tags.`{TAG}role` = '{ROLE_BLOCK}'"])


def test_names_lead_with_the_round_and_stay_unique_across_rounds() -> None:
    assert round_short_id(SWEEP_ID) == "r3f2a"
    assert sweep_run_name(SWEEP_ID) == "r3f2a·smoke·20261123-001547"
    # Another round of the same campaign a second later: a different token, so different names throughout.
    assert round_short_id("smoke-20261123-001548-9c01") == "r9c01"
    # A sweep id of another shape still gets a stable 4-hex round id.
    assert round_short_id("track-1") == round_short_id("track-1") != round_short_id("track-2")
    assert len(round_short_id("track-1")) == 5


def test_a_block_is_a_run_between_the_sweep_and_its_arms(block_arms: list[Receipt], tmp_path: Path) -> None:
    client = TrackingClient(fresh_mlflow_uri(tmp_path), "exp")
    sweep_run, _ = client.parent_run(SWEEP_ID, "smoke")
    first, second = block_arms
    arm0, _ = client.log_receipt(first, sweep_run)
    (block,) = _blocks(client)
    # Created with the first arm, nested under the sweep run, unanswered until the second arm is in.
    assert block.data.tags["mlflow.parentRunId"] == sweep_run and block.info.status == "RUNNING"
    assert block.info.run_name.startswith("r3f2a·b000·moe_dispatch=padded→")  # "…" when the baseline ran first
    assert LOG_RATIO_METRIC not in block.data.metrics and TAG + "logged" not in block.data.tags
    assert client.client.get_run(arm0).data.tags["mlflow.parentRunId"] == block.info.run_id
    arm1, _ = client.log_receipt(second, sweep_run)
    (block,) = _blocks(client)
    assert client.client.get_run(arm1).data.tags["mlflow.parentRunId"] == block.info.run_id
    assert block.info.status == "FINISHED" and block.data.tags[TAG + "logged"] == "1"
    assert block.info.run_name == "r3f2a·b000·moe_dispatch=padded→jagged"
    assert block.data.tags[TAG + "feature_value"] == "jagged" and block.data.tags[TAG + "baseline_value"] == "padded"

    # The answer is promotion's own: match_blocks pairs the arms, Block.log_ratio projects them to the horizon.
    (matched,), _ = match_blocks(block_arms, default_policy())
    expected = matched.log_ratio(default_policy().failures.failed_log_ratio)
    assert expected is not None
    metrics, params = block.data.metrics, block.data.params
    assert metrics[LOG_RATIO_METRIC] == pytest.approx(expected)
    assert metrics[SPEEDUP_METRIC] == pytest.approx(math.exp(expected))
    assert metrics["horizon_steps"] == matched.horizon_steps > 0
    won = "candidate" if expected > 0 else "baseline"
    assert params["winner"] == block.data.tags[TAG + "winner"] == won
    assert params["arm_order"] == f"{first.identity.arm.value} first"
    assert params["features.moe_dispatch"] == "padded→jagged"
    # The answer metrics are what the UI lists first (it sorts metric names, ignoring case).
    assert sorted(metrics, key=str.lower)[:2] == [LOG_RATIO_METRIC, SPEEDUP_METRIC]
    note = block.data.tags[NOTE_TAG]
    assert "b000" in note and f"winner **{won}**" in note and f"{math.exp(expected):.3f}×" in note
    artifacts = {a.path for a in client.client.list_artifacts(block.info.run_id)}
    assert artifacts == {"block.svg"}  # SVG text: MLflow's artifact view shows it like a PNG
    svg = Path(client.client.download_artifacts(block.info.run_id, "block.svg", str(tmp_path / "svg"))).read_text()
    assert ElementTree.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg" and block.info.run_name in svg
    # Every other search sees what it saw: two arm runs, one sweep run.
    assert len(client.arm_runs(SWEEP_ID)) == 2
    assert len(client.search([f"tags.`{TAG}role` = 'sweep'"])) == 1


def test_block_runs_are_not_duplicated_by_a_resume_or_a_sync(block_arms: list[Receipt], tmp_path: Path) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    sweep_dir = tmp_path / "sweep"
    for receipt in block_arms:
        write_receipt(receipt, sweep_dir / "receipts")
    store = MlflowStore(uri, "exp", sweep_dir)
    store.open_sweep(SWEEP_ID, "smoke", {}, {}, system_metrics=False)
    for receipt in block_arms:
        store.log_receipt(receipt)
    client = TrackingClient(uri, "exp")
    (block,) = _blocks(client)
    # A driver killed between the second arm and the answer: the resumed sweep answers the same block run.
    client.client.delete_tag(block.info.run_id, TAG + "logged")
    resumed = MlflowStore(uri, "exp", sweep_dir)
    resumed.open_sweep(SWEEP_ID, "smoke", {}, {}, system_metrics=False)
    for receipt in block_arms:
        resumed.log_receipt(receipt)
    result = sync(sweep_dir, uri, experiment="exp")
    assert sorted(result.already) == sorted(r.identity.receipt_id for r in block_arms) and result.logged == []
    (again,) = _blocks(client)
    assert again.info.run_id == block.info.run_id and again.data.tags[TAG + "logged"] == "1"
    assert len(client.arm_runs()) == 2 and len(client.search([f"tags.`{TAG}role` = 'sweep'"])) == 1


def test_an_attempt_that_ended_with_one_arm_is_closed_failed(block_arms: list[Receipt], tmp_path: Path) -> None:
    client = TrackingClient(fresh_mlflow_uri(tmp_path), "exp")
    sweep_run, _ = client.parent_run(SWEEP_ID, "smoke")
    client.log_receipt(block_arms[0], sweep_run)
    assert settle_blocks(client, SWEEP_ID) == 0 and _blocks(client)[0].info.status == "RUNNING"
    settle_blocks(client, SWEEP_ID, final=True)
    (block,) = _blocks(client)
    assert block.info.status == "FAILED" and "one arm" in block.data.tags[TAG + "no_answer"]


def test_every_run_says_what_it_is_and_the_experiment_is_a_training_one(block_arms: list[Receipt],
                                                                         tmp_path: Path) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    client = TrackingClient(uri, "exp")
    assert client.client.get_experiment(client.experiment_id).tags[EXPERIMENT_KIND_TAG] == MACHINE_LEARNING
    sweep_run, _ = client.parent_run(SWEEP_ID, "smoke")
    sweep = client.client.get_run(sweep_run)
    assert sweep.info.run_name == "r3f2a·smoke·20261123-001547"
    arms = [client.client.get_run(client.log_receipt(r, sweep_run)[0]) for r in block_arms]
    (block,) = _blocks(client)
    notes = [run.data.tags[NOTE_TAG] for run in (sweep, block, *arms)]
    assert notes[0].startswith("Round **r3f2a**") and "block" in notes[0]
    assert notes[1].startswith("Block **b000** of round r3f2a")
    assert all(note.startswith("Round r3f2a, block **b000**") for note in notes[2:])
    assert {run.info.run_name for run in arms} == {"r3f2a·b000·baseline·moe_dispatch=padded",
                                                   "r3f2a·b000·candidate·moe_dispatch=jagged"}
    # An experiment made before ablate typed it gets the type; one a user typed otherwise keeps theirs.
    from mlflow import MlflowClient

    raw = MlflowClient(tracking_uri=uri)
    old = raw.create_experiment("old")
    assert TrackingClient(uri, "old") and raw.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == MACHINE_LEARNING
    mine = raw.create_experiment("mine", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert TrackingClient(uri, "mine") and raw.get_experiment(mine).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_a_failed_candidate_is_the_loss_promotion_counts(block_arms: list[Receipt]) -> None:
    base = next(r for r in block_arms if r.identity.arm.value == "baseline")
    cand = next(r for r in block_arms if r.identity.arm.value == "candidate")
    failed = cand.model_copy(deep=True)
    failed.identity.status = type(cand.identity.status)("failed")
    answer = block_answer([base, failed])
    # A failed candidate is a loss at the policy's failed_log_ratio, exactly as promotion counts it.
    assert answer.log_ratio == default_policy().failures.failed_log_ratio and answer.winner == "baseline"


def test_a_failing_answer_never_costs_an_arm_and_is_retried_at_close(block_arms: list[Receipt], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.tracking import blocks

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug in the block answer")

    uri = fresh_mlflow_uri(tmp_path)
    store = MlflowStore(uri, "exp", tmp_path / "sweep")
    store.open_sweep(SWEEP_ID, "smoke", {}, {}, system_metrics=False)
    with monkeypatch.context() as patch:
        patch.setattr(blocks, "block_answer", broken)
        ids = [store.log_receipt(receipt) for receipt in block_arms]
    # Both arms logged, the store still online (nothing spooled), the block run waiting for its answer.
    assert all(ids) and store.online and store.spooled == 0
    client = TrackingClient(uri, "exp")
    assert TAG + "logged" not in _blocks(client)[0].data.tags
    store.close_sweep(SWEEP_ID, list(block_arms), failed=False)
    (block,) = _blocks(client)
    assert block.data.tags[TAG + "logged"] == "1" and LOG_RATIO_METRIC in block.data.metrics
