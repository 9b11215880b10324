"""Sweeps on a real local Ray runtime (2 CPUs, one per module): end to end into MLflow, fail-fast resources,
the no-deadlock trial shape, and resuming a sweep whose driver was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sweeps_common import REPO, by_block, fresh_mlflow_uri, tiny_smoke

from ablate.config.load import load_sweep
from ablate.receipts.schema import Status
from ablate.receipts.store import load_receipts
from ablate.sweep.layout import Layout
from ablate.sweep.plan import plan_sweep
from ablate.sweep.resources import BlockNeed, ResourceError, check_cluster
from ablate.sweep.run import run_sweep
from ablate.tracking.mapping import round_short_id
from ablate.tracking.mlflow_store import ROLE_SWEEP, TAG, TrackingClient
from trainers.forkserver import server_directory

pytestmark = pytest.mark.ray






def test_smoke_sweep_end_to_end(ray_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    campaign = tiny_smoke(tmp_path / "campaign")
    uri = fresh_mlflow_uri(tmp_path)
    # b001's first arm raises on its first attempt: Tune's FailureConfig reruns the whole block as attempt 1.
    summary = run_sweep(campaign, tracking_uri=uri, storage=str(tmp_path / "runs"), progress=True,
                        inject={"b001": {"raise_at_step": 1}})
    assert (summary.blocks_total, summary.blocks_done, summary.blocks_errored, summary.exit_code) == (3, 3, 0, 0)
    assert summary.max_concurrent == 2 and summary.executor == "subprocess"
    assert summary.arms_logged == 8 and summary.arms_failed == 1 and summary.spooled == 0

    on_disk, rejected = load_receipts(Path(summary.sweep_dir) / "receipts")
    assert rejected == [] and len(on_disk) == 8
    assert {r.identity.receipt_id for r in on_disk} == set(summary.receipt_ids)
    sweep, _ = load_sweep(campaign)
    plan = {b.block_id: b for b in plan_sweep(sweep, summary.sweep_id).blocks}
    for block_id, mine in by_block(on_disk).items():
        for attempt in {r.identity.attempt for r in mine}:
            arms = [r for r in mine if r.identity.attempt == attempt]
            assert len({(r.identity.node_id, r.identity.host) for r in arms}) == 1, "both arms on one node"
            for receipt in arms:
                # The recorded order is the order that ran.
                assert plan[block_id].order[receipt.identity.order] == receipt.identity.arm_index
                assert receipt.identity.lane_key == plan[block_id].lane_key
    # Interleaved blocks; the first attempt's arms start their wall clock at the driver's scheduling stamp, so
    # queue wait is the driver's hand-off to Ray, not ~0 by construction; the receipt names its campaign file.
    import hashlib

    campaign_sha = hashlib.sha256(campaign.read_bytes()).hexdigest()
    assert {r.identity.pairing for r in on_disk} == {"interleaved"}
    first = [r for r in on_disk if r.identity.attempt == 0]
    assert {r.time.clock for r in first} == {"driver"} and all(r.time.badput_s["queue_wait"] > 0 for r in first)
    assert {r.identity.campaign_sha256 for r in on_disk} == {campaign_sha}
    assert all(r.identity.code_fingerprint and r.identity.hardware_fingerprint for r in on_disk)
    retried = [r for r in on_disk if r.identity.block_id == "b001"]
    assert sorted((r.identity.attempt, r.identity.status is Status.failed) for r in retried) == [
        (0, False), (0, True), (1, False), (1, False)]

    # N free CPUs keep N arms busy: arms of different blocks overlapped in time.
    spans = [(block, arm["scheduled_at"], arm["ended_at"]) for block, entry in summary.timeline.items()
             for arm in entry["arms"]]
    assert any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a in spans for b in spans)

    client = TrackingClient(uri, "ablate")
    parents = client.search([f"tags.`{TAG}role` = '{ROLE_SWEEP}'"])
    assert [p.info.run_id for p in parents] == [summary.parent_run_id]
    parent = client.client.get_run(summary.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.params["design"] == "one_at_a_time"
    assert parent.data.params["lane.model.pattern"] == "AEMR"
    assert parent.data.params["resources.host_allocator"] == "retain"  # the value, never the enum's repr
    assert any(key.startswith("system/") for key in parent.data.metrics), "MLflow system metrics on the sweep run"
    assert {a.path for a in client.client.list_artifacts(summary.parent_run_id)} >= {"summary.svg", "summary.json"}
    children = client.arm_runs(summary.sweep_id)
    assert set(children) == set(summary.receipt_ids), "one child run per arm"
    names = [run.info.run_name for run in children.values()]
    assert len(set(names)) == 8 and f"{round_short_id(summary.sweep_id)}·b001·aa·twin0" not in names
    assert all(name.startswith(round_short_id(summary.sweep_id) + "·") for name in names)
    assert any(name.endswith("·retry1") for name in names)
    # sweep run -> block run (one per block attempt) -> arm runs. Interleaved arms both finish even when one
    # fails, so b001's first attempt is answered too: a failed candidate loses, a failed baseline gives no ratio.
    blocks = {run.info.run_id: run for run in client.search([f"tags.`{TAG}role` = 'block'"])}
    attempts = {(b.data.tags[TAG + "block_id"], b.data.tags[TAG + "attempt"]): b for b in blocks.values()}
    assert sorted(attempts) == [("b000", "0"), ("b001", "0"), ("b001", "1"), ("b002", "0")]
    assert all(b.info.status == "FINISHED" and b.data.tags["mlflow.parentRunId"] == summary.parent_run_id
               for b in blocks.values())
    failed_arm = next(r for r in on_disk if r.identity.status is Status.failed).identity.arm.value
    assert attempts[("b001", "0")].data.tags[TAG + "winner"] == {"candidate": "baseline"}.get(failed_arm, "none")
    for run in children.values():
        assert run.data.tags["mlflow.parentRunId"] in blocks
        assert {"goodput_fraction", "step_p50_s"} <= set(run.data.metrics) or \
            run.data.tags[TAG + "status"] == "failed"

    progress = capsys.readouterr().err
    assert "blocks 3/3 done" in progress and "1 failed" in progress and "ETA" in progress

    # Promote from that MLflow store: the trade-off plot lands on the sweep's parent run and the report says where.
    out = subprocess.run([sys.executable, "-m", "ablate", "promote", "--tracking-uri", uri, "--sweep", "smoke",
                          "--policy", "search_spaces/policies/single_node.yaml", "--out", str(tmp_path / "reports")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    report_id = next((tmp_path / "reports").glob("promote-*.json")).stem
    plots = [a.path for a in client.client.list_artifacts(summary.parent_run_id, f"promotion/{report_id}")]
    assert plots and all(path.endswith(".png") for path in plots)
    assert f"artifact promotion/{report_id}/" in out.stdout and "### Trade-off" in out.stdout


def test_a_campaign_no_node_can_hold_fails_at_once(ray_address: str, tmp_path: Path) -> None:
    campaign = tiny_smoke(tmp_path, lane={"engine": {"workers": 2}}, resources={"cpus_per_worker": 2})
    started = time.monotonic()
    with pytest.raises(ResourceError) as info:
        run_sweep(campaign, tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", storage=str(tmp_path / "runs"),
                  progress=False)
    assert time.monotonic() - started < 20
    message = str(info.value)
    assert "one node with 4 CPU" in message and "2 worker(s) x 2 CPU" in message
    assert ": 2 CPU" in message and "2 CPU < 4" in message
    assert not (tmp_path / "m.db").exists(), "refused before anything was tracked or submitted"
    fits = check_cluster(BlockNeed(workers=2, cpus_per_worker=1, gpus_per_worker=0), campaign="x", wait_s=0)
    assert fits.max_concurrent == 1


def test_multi_worker_trial_shape_cannot_deadlock_on_two_cpus(ray_address: str, tmp_path: Path) -> None:
    """Shared notes §3a: a trial holding 1 CPU whose two 1-CPU workers need the other 2 never starts.
    Like Ray Train, the trial here asks for a STRICT_PACK placement group of two 1-CPU workers; with the driver
    shape ablate uses for multi-worker arms (no CPU held) it is placed at once, with the naive one never."""
    from ray import tune
    from ray.util.placement_group import placement_group, remove_placement_group

    def trial(config: dict[str, Any]) -> None:
        group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
        placed = group.wait(timeout_seconds=config["timeout"])
        remove_placement_group(group)
        tune.report({"placed": int(placed)})

    def run(resources: dict[str, float], timeout: float) -> int:
        tuner = tune.Tuner(tune.with_resources(trial, resources), param_space={"timeout": timeout},
                           run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0))
        return int(tuner.fit()[0].metrics["placed"])

    assert run(BlockNeed(workers=2, cpus_per_worker=1, gpus_per_worker=0).trial_resources(), timeout=60) == 1
    assert run({"CPU": 1.0}, timeout=3) == 0, "control: the naive shape starves its own workers"


def test_the_head_start_starts_the_server_a_trials_arms_fork_from(ray_address: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's head start runs in a plain Ray task on each node; a Tune trial's process has variables of its own
    (``TUNE_ORIG_WORKING_DIR``), and others Tune copies from the driver, which a remote cluster's raylet lacks: the
    server the task starts must still be the one the trial's arms ask for (found measuring: a second server, started
    by the first arms, importing torch beside the first)."""
    import ray
    from ray import tune

    from ablate.sweep.head_start import start_fork_servers
    from ablate.sweep.resources import Capacity, NodeFit

    # Set in the driver only, not in this runtime's raylet: as on a remote cluster, only Tune's copy reaches trials.
    monkeypatch.setenv("RAY_CHDIR_TO_TRIAL_DIR", "0")
    node = ray.get_runtime_context().get_node_id()
    one_worker = BlockNeed(workers=1, cpus_per_worker=1, gpus_per_worker=0)
    nodes = [NodeFit(node, "here", {"CPU": 2.0}, arms=2), NodeFit("f" * 56, "full", {"CPU": 0.0}, arms=0)]
    assert start_fork_servers(Capacity(need=one_worker, nodes=nodes, max_concurrent=2)) == [], \
        "no CPU left free by the trials: the server's imports would slow their start"
    pending = start_fork_servers(Capacity(need=one_worker, nodes=nodes, max_concurrent=1))
    assert len(pending) == 1, "only nodes that run arms"
    line = ray.get(pending[0], timeout=180)
    assert line.endswith((" started", " already listening")), line
    started_key = line.split()[-2] if line.endswith(" started") else line.split()[-3]

    def trial(config: dict[str, Any]) -> None:
        from trainers.forkserver import server_key
        from trainers.provenance import code_fingerprint
        from trainers.run import REPO_ROOT, _worker_env
        from trainers.spec import ALLOTTED_CPUS_ENV

        base, overlay = _worker_env(Path(config["work"]), {ALLOTTED_CPUS_ENV: "1"})
        tune.report({"key": server_key(base, code_fingerprint(REPO_ROOT)),
                     "tune_vars": sorted(name for name in overlay if name.startswith("TUNE_"))})

    result = tune.Tuner(tune.with_resources(trial, one_worker.trial_resources()), param_space={"work": str(tmp_path)},
                        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0)).fit()[0]
    assert result.metrics["key"] == started_key
    assert "TUNE_ORIG_WORKING_DIR" in result.metrics["tune_vars"], "the arm still gets Tune's variables"
    # No head start where the task's environment is not the trials': Train sets its workers' (multi-worker arms),
    # Ray gives a trial of 2 CPUs OMP_NUM_THREADS=2 and a GPU trial its CUDA_VISIBLE_DEVICES.
    for workers, cpus, gpus in ((2, 1, 0), (1, 2, 0), (1, 1, 1)):
        need = BlockNeed(workers=workers, cpus_per_worker=cpus, gpus_per_worker=gpus)
        assert start_fork_servers(Capacity(need=need, nodes=nodes, max_concurrent=1)) == []


_EARLY_START = """
import json, os, sys
from ablate.sweep.head_start import start_local_fork_server
from ablate.sweep.resources import BlockNeed
from ablate.sweep.run import ensure_ray, shutdown_ray

one = BlockNeed(workers=1, cpus_per_worker=1, gpus_per_worker=0)
others = [start_local_fork_server(BlockNeed(workers=w, cpus_per_worker=c, gpus_per_worker=g))
          for w, c, g in ((2, 1, 0), (1, 2, 0), (1, 1, 1))]
refused = []
for name, value in (("RAY_ADDRESS", "auto"), ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1"), ("TMPDIR", "/nonexistent/x")):
    before = os.environ.get(name)
    os.environ[name] = value
    refused.append(start_local_fork_server(one) is None)  # attaching; trials' CUDA_VISIBLE_DEVICES; no server dir
    if before is None:
        del os.environ[name]
    else:
        os.environ[name] = before
early = start_local_fork_server(one)
ensure_ray()
again = start_local_fork_server(one)
from ray import tune

def trial(config):
    from trainers.run import prestart_fork_server  # what each arm of the trial asks for first
    tune.report({"line": prestart_fork_server()})

result = tune.Tuner(tune.with_resources(trial, one.trial_resources()),
                    run_config=tune.RunConfig(storage_path=sys.argv[1], verbose=0)).fit()[0]
early.join(180)
print(json.dumps({"early": early.line, "trial": result.metrics["line"], "others": [o is None for o in others],
                  "refused": refused, "again": again is None}))
shutdown_ray()
"""


def test_a_local_runtimes_server_starts_before_ray_and_is_the_one_its_trials_arms_fork_from(tmp_path: Path) -> None:
    """The driver of a local runtime starts the fork server before ``ray.init``, from its own environment: the
    trials' differs by what Ray adds to each of its workers (``RAY_RAYLET_PID``, ``OMP_NUM_THREADS``, ...) and by
    Tune's own variables, and the server must still be the one their arms ask for. Never for arms of another shape,
    nor where the driver attaches to a cluster, Ray is already up, or Ray would set CUDA_VISIBLE_DEVICES in
    trials; and where no server can be started, no exception either."""
    # A key of this test's own (ABLATE_* reaches the arms and keys their server), OMP_NUM_THREADS as Ray sets it,
    # no GPU visible (a machine with one gets no early start).
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS")},
           "PYTHONPATH": str(REPO), "ABLATE_TEST_RUN": str(time.time()), "RAY_CHDIR_TO_TRIAL_DIR": "0",
           "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", _EARLY_START, str(tmp_path / "tune")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert " started in " in seen["early"], seen
    assert seen["trial"].endswith(" already listening"), seen
    key = seen["early"].split(" fork server ")[1].split()[0]
    assert seen["trial"].split(" fork server ")[1].split()[0] == key, "the trial's arms ask for another server"
    assert seen["others"] == [True, True, True] and seen["refused"] == [True, True, True] and seen["again"], seen
    pid = int((server_directory() / f"{key}.pid").read_text())
    os.kill(pid, signal.SIGTERM)  # this test's own server: gone now, not idling for minutes


def test_resume_after_the_driver_is_killed(ray_address: str, tmp_path: Path) -> None:
    # moe_dispatch: both arms run eager; resuming is not about compiling (a fused_residual candidate compiles
    # with Inductor, ~10 s a block on 2 cores).
    # host_allocator: the campaign's resources reach every arm's process, before and after the resume.
    campaign = tiny_smoke(tmp_path / "campaign", name="resume", features={"moe_dispatch": ["jagged"]}, blocks=1,
                          aa_blocks=1, resources={"cpus_per_worker": 1, "max_concurrent_blocks": 1,
                                                  "host_allocator": "system"})
    uri = fresh_mlflow_uri(tmp_path)
    storage = str(tmp_path / "runs")
    layout = Layout.for_campaign("resume", storage)
    code = (f"from ablate.sweep.run import run_sweep; run_sweep({str(campaign)!r}, tracking_uri={uri!r}, "
            f"storage={storage!r}, progress=False)")
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "RAY_ADDRESS": ray_address},
                              stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 150
    finished: set[str] = set()
    while not finished:
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no block finished in time"
        time.sleep(0.3)
        found, _ = load_receipts(layout.receipts_dir) if layout.receipts_dir.exists() else ([], [])
        finished = {b for b, arms in by_block(found).items() if len({r.identity.arm_index for r in arms}) == 2}
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    before, _ = load_receipts(layout.receipts_dir)
    sweep_id = (layout.local_dir / "LATEST").read_text().strip()
    ids_before = {b: {r.identity.receipt_id for r in arms} for b, arms in by_block(before).items()}

    summary = run_sweep(campaign, resume=True, tracking_uri=uri, storage=storage, progress=False)
    assert summary.resumed and summary.sweep_id == sweep_id
    assert (summary.blocks_done, summary.blocks_total, summary.exit_code) == (2, 2, 0)
    after, rejected = load_receipts(layout.receipts_dir)
    assert rejected == []
    for block_id in finished:
        mine = {r.identity.receipt_id for r in after if r.identity.block_id == block_id}
        assert mine == ids_before[block_id], f"finished block {block_id} was rerun"
    assert not any(r.identity.block_id in finished for r in
                   [r for r in after if r.identity.receipt_id in set(summary.receipt_ids)])
    complete = {b for b, arms in by_block(after).items() if len({r.identity.arm_index for r in arms}) == 2}
    assert complete == {"b000", "b001"}
    assert {r.observed.hardware.get("host_allocator") for r in after} == {"system"}
    client = TrackingClient(uri, "ablate")
    runs = client.search([f"tags.`{TAG}sweep_id` = '{sweep_id}'", f"tags.`{TAG}role` = 'arm'"])
    assert sorted(r.data.tags[TAG + "receipt_id"] for r in runs) == sorted(r.identity.receipt_id for r in after), \
        "MLflow holds every receipt on disk exactly once"
    assert len(client.search([f"tags.`{TAG}sweep_id` = '{sweep_id}'", f"tags.`{TAG}role` = 'sweep'"])) == 1
    blocks = client.search([f"tags.`{TAG}sweep_id` = '{sweep_id}'", f"tags.`{TAG}role` = 'block'"])
    keys = [(b.data.tags[TAG + "block_id"], b.data.tags[TAG + "attempt"]) for b in blocks]
    assert len(keys) == len(set(keys)), f"a resumed sweep duplicated block runs: {sorted(keys)}"
    meta = json.loads((layout.local_dir / "sweeps" / f"{sweep_id}.json").read_text())
    # The resume dealt the A/A blocks again (one node here: no targets) and the record says so beside the first deal.
    assert [set(run) for run in meta["resumes"]] == [{"at", "aa_targets"}]
    assert meta["resumes"][0]["aa_targets"] == meta["aa_targets"] == {}
