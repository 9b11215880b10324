"""Simulated (no-op) arms: a real sweep runs end to end, and nothing it produces can ever reach a verdict."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import threading
from pathlib import Path

import pytest
from sweeps_common import REPO, fresh_mlflow_uri, tiny_smoke

from ablate.promote import promote
from ablate.receipts.schema import SIMULATED_EXECUTOR, validate_receipt
from ablate.receipts.store import load_receipts
from ablate.sweep.run import run_sweep
from ablate.tracking.mlflow_store import ROLE_SWEEP, TAG, TrackingClient

pytestmark = pytest.mark.ray


def test_simulated_sweep_runs_and_promotion_refuses_every_block(ray_address: str, tmp_path: Path) -> None:
    campaign = tiny_smoke(tmp_path / "campaign", blocks=3, aa_blocks=2)  # 2 features x 3 + 2 A/A = 8 blocks
    uri = fresh_mlflow_uri(tmp_path)
    ctrl_c = signal.getsignal(signal.SIGINT)
    summary = run_sweep(campaign, tracking_uri=uri, storage=str(tmp_path / "runs"), progress=False,
                        simulate_arms=True)
    assert (summary.blocks_total, summary.blocks_done, summary.blocks_errored, summary.exit_code) == (8, 8, 0, 0)
    assert signal.getsignal(signal.SIGINT) is ctrl_c, "Tune's Ctrl+C handler does not outlive its fit()"
    assert summary.executor == SIMULATED_EXECUTOR and summary.arms_logged == 16 and summary.spooled == 0

    receipts_dir = Path(summary.sweep_dir) / "receipts"
    on_disk, rejected = load_receipts(receipts_dir)
    assert rejected == [] and {r.identity.receipt_id for r in on_disk} == set(summary.receipt_ids)
    for path in sorted(receipts_dir.glob("*.json")):
        receipt = validate_receipt(json.loads(path.read_text()))  # the files as written, not the driver's copies
        assert receipt.identity.executor == SIMULATED_EXECUTOR and "simulated" in receipt.identity.software

    # Tune's copies name each receipt, never hold it: its result log (written after the driver took the receipt)
    # and its experiment state, which keeps every trial's last result for the whole sweep.
    tune_files = [p for p in Path(summary.tune_path).rglob("*") if p.is_file() and p.suffix == ".json"]
    taken = [json.loads(line)["receipt_taken"] for path in tune_files if path.name == "result.json"
             for line in path.read_text().splitlines() if '"receipt_taken"' in line]
    assert sorted(taken) == sorted(summary.receipt_ids)
    assert not [p.name for p in tune_files if b"schema_version" in p.read_bytes()], "a receipt in Tune's files"
    # Tune keeps every trial for the sweep: each ended one keeps its last result, not its running statistics
    # (a min/max/mean and two moving-average windows per reported number).
    state = max((p for p in tune_files if p.name.startswith("experiment_state")), key=lambda p: p.stat().st_mtime)
    kept = [json.loads(metadata) for _, metadata in json.loads(state.read_text())["trial_data"]]
    assert len(kept) == 8 and all(m["last_result"].get("event") == "arm" for m in kept)
    assert [(m["metric_analysis"], m["metric_n_steps"]) for m in kept] == [({}, {})] * 8

    client = TrackingClient(uri, "ablate")
    (parent,) = client.search([f"tags.`{TAG}role` = '{ROLE_SWEEP}'"])
    assert parent.data.params["arms"] == "simulated"
    # What the driver's MLflow writer logs per arm: the receipt and the goodput picture as SVG text (no matplotlib).
    arms = client.arm_runs(parent.data.tags[TAG + "sweep_id"])
    assert len(arms) == 16 and all(run.data.tags[TAG + "logged"] == "1" for run in arms.values())
    assert {a.path for a in client.client.list_artifacts(next(iter(arms.values())).info.run_id)} == \
        {"receipt.json", "goodput.svg"}
    # The local store was switched to WAL for the sweep and checkpointed at its close: mlflow.db alone holds it all.
    db = Path(uri.removeprefix("sqlite:///"))
    with contextlib.closing(sqlite3.connect(db)) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    wal = Path(f"{db}-wal")
    assert not wal.exists() or wal.stat().st_size == 0

    # The safety property: every block is refused, naming the simulation, and no verdict or defaults change exists.
    result = promote(on_disk, policy_path=REPO / "search_spaces" / "policies" / "single_node.yaml",
                     defaults_path=campaign.parent / "defaults.yaml")
    assert result.verdicts == [] and result.changes == [] and result.num_receipts == 16
    assert len(result.refusals) == 8
    assert all("simulated" in r.reason and "never evidence" in r.reason for r in result.refusals)


def test_trials_start_while_the_writer_opens_the_sweep_in_mlflow(ray_address: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's MLflow start-up runs on the driver's writer thread: Tune starts the first trial while the (real)
    opening is held, every receipt still lands under the parent run it makes, and the system-metrics sampler it
    starts is stopped with the sweep."""
    from ablate.sweep import run as sweep_run

    campaign = tiny_smoke(tmp_path / "campaign", blocks=1, aa_blocks=1)  # 2 features + A/A = 3 blocks
    uri = fresh_mlflow_uri(tmp_path)
    trial_started, held = threading.Event(), []
    real_open, real_start = sweep_run.MlflowStore.open_sweep, sweep_run._Recorder.on_trial_start

    def held_open(self: object, *args: object, **kwargs: object) -> object:
        held.append(trial_started.wait(60))  # True: a trial started while the sweep was not open in MLflow yet
        return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

    def on_trial_start(self: object, trial: object, **info: object) -> None:
        trial_started.set()
        real_start(self, trial, **info)  # type: ignore[arg-type]

    monkeypatch.setattr(sweep_run.MlflowStore, "open_sweep", held_open)
    monkeypatch.setattr(sweep_run._Recorder, "on_trial_start", on_trial_start)
    summary = run_sweep(campaign, tracking_uri=uri, storage=str(tmp_path / "runs"), progress=False,
                        simulate_arms=True)
    assert held == [True], "the driver waited for MLflow before starting Tune"
    assert (summary.blocks_done, summary.arms_logged, summary.spooled, summary.exit_code) == (3, 6, 0, 0)
    client = TrackingClient(uri, "ablate")
    arms = client.arm_runs(summary.sweep_id)
    assert set(arms) == set(summary.receipt_ids) and all(r.data.tags[TAG + "logged"] == "1" for r in arms.values())
    blocks = {run.data.tags["mlflow.parentRunId"] for run in arms.values()}
    assert {client.client.get_run(b).data.tags["mlflow.parentRunId"] for b in blocks} == {summary.parent_run_id}
    assert client.client.get_run(summary.parent_run_id).info.status == "FINISHED"
    assert not [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor" and t.is_alive()]


def test_a_storage_mirror_that_refuses_receipts_costs_the_mirror_never_the_sweep(
        ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remote storage (``file://``, as a bucket would be) whose receipts directory cannot be made: every block still
    runs, each receipt is in the campaign dir, in MLflow and in Tune's result (which Tune syncs to that storage), and
    the summary names the receipts the mirror lacks, with exit code 1."""
    campaign = tiny_smoke(tmp_path / "campaign", blocks=1, aa_blocks=1)  # 3 blocks
    mirror = tmp_path / "bucket" / "ablate" / "smoke"
    mirror.mkdir(parents=True)
    (mirror / "receipts").write_text("a file where the mirror's receipts directory goes\n")
    monkeypatch.chdir(tmp_path)  # the campaign dir of a sweep with remote storage is under the working directory
    uri = fresh_mlflow_uri(tmp_path)
    summary = run_sweep(campaign, tracking_uri=uri, storage=f"file://{tmp_path / 'bucket'}/ablate", progress=False,
                        simulate_arms=True)
    assert (summary.blocks_done, summary.blocks_total, summary.fatal, summary.arms_logged) == (3, 3, None, 6)
    assert summary.exit_code == 1 and sorted(rid for rid, _, _ in summary.unmirrored) == sorted(summary.receipt_ids)
    on_disk, _ = load_receipts(Path(summary.sweep_dir) / "receipts")
    assert {r.identity.receipt_id for r in on_disk} == set(summary.receipt_ids)
    assert set(TrackingClient(uri, "ablate").arm_runs(summary.sweep_id)) == set(summary.receipt_ids)
    kept = [json.loads(json.loads(line)["receipt"])["identity"]["receipt_id"]
            for path in (tmp_path / "bucket" / "ablate" / "_tune").rglob("result.json")
            for line in path.read_text().splitlines() if '"event": "arm"' in line]
    assert sorted(kept) == sorted(summary.receipt_ids)
    line = next(line for line in summary.render().splitlines() if "not in storage" in line)
    assert "6 receipt(s)" in line and "FileExistsError" in line and f"{mirror}/receipts/" in line


def test_no_cli_or_campaign_path_turns_simulation_on() -> None:
    # Only a Python caller of run_sweep (tests, benchmarks) can ask for no-op arms.
    assert "simulate" not in (REPO / "ablate" / "cli.py").read_text()
    assert "simulate" not in (REPO / "ablate" / "config" / "schema.py").read_text()


def test_an_until_decided_round_interrupted_before_tune_started_resumes_with_its_searcher(
        ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl+C while Ray started or the sweep was being set up (the round's metadata written, no Tune state yet):
    # the resume used to run every planned block as a grid, the decided tests' included.
    from ablate.sweep import run as sweep_run
    from ablate.sweep.until_decided import DECIDED, Standing, UntilDecidedSearcher, block_keys

    campaign = tiny_smoke(tmp_path / "campaign", blocks=2, aa_blocks=1)  # moe x2, mamba x2, A/A x1
    uri, storage = fresh_mlflow_uri(tmp_path), str(tmp_path / "runs")
    made: list[UntilDecidedSearcher] = []

    class Judged:
        def __init__(self, decided: dict) -> None:
            self.decided = decided

        def states(self) -> dict:
            return dict(self.decided)

    def factory(plan: object) -> UntilDecidedSearcher:
        keys = block_keys(plan)  # type: ignore[arg-type]
        moe = next(k for _, k in keys if k and k[0] == "moe_dispatch")
        made.append(UntilDecidedSearcher(keys, Judged({moe: Standing(feature=moe[0], value=moe[1], lane_key=moe[2],
                                                                     state=DECIDED, verdict="HOLD", why="decided")})))
        return made[-1]

    started = sweep_run.start_clock

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the main thread's last step before Tune (MLflow opens on the writer thread)

    monkeypatch.setattr(sweep_run, "start_clock", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(campaign, tracking_uri=uri, storage=storage, progress=False, simulate_arms=True,
                  searcher_factory=factory)
    monkeypatch.setattr(sweep_run, "start_clock", started)
    summary = run_sweep(campaign, resume=True, tracking_uri=uri, storage=storage, progress=False,
                        simulate_arms=True, searcher_factory=factory)
    assert len(made) == 2, "the resume built a searcher: Tune had saved none to restore"
    features = {validate_receipt(json.loads(p.read_text())).identity.feature
                for p in (Path(summary.sweep_dir) / "receipts").glob("*.json")}
    assert features == {"mamba_scan", None}, "the decided test's blocks are left out"
    assert (summary.blocks_total, summary.exit_code) == (3, 0)


def test_a_trial_process_reads_the_plans_blocks_once_from_the_object_store(ray_address: str) -> None:
    import ray

    from ablate.sweep import trial

    blocks = {"b0": {"block_id": "b0"}, "b1": {"block_id": "b1"}}
    ref = ray.put(blocks)
    first = trial.plan_blocks({"blocks": ref})
    assert first == blocks and trial.plan_blocks({"blocks": ref}) is first  # the next block: not read again
    other = ray.put({"c0": {"block_id": "c0"}})  # another sweep's plan in the same process
    assert list(trial.plan_blocks({"blocks": other})) == ["c0"] and len(trial._PLAN_BLOCKS) == 1
    assert trial.plan_blocks({"blocks": blocks}) is blocks  # a plain mapping, as a test hands run_block
