"""Faults on real processes: nothing lost, nothing promoted by accident.

The fault suite, one scenario per test, each a real Ray sweep (or a real `mlflow server` process):
1. an arm raises mid-run                      -> test_failed_nan_and_oom_arms_leave_receipts_and_the_sweep_goes_on
2. loss becomes NaN                           -> same sweep (its own block)
3. a Train worker is SIGKILLed                -> test_killed_train_worker_is_retried_and_logged_once
4. the sweep driver is killed, then --resume  -> tests/sweep/test_sweep_ray.py::test_resume_after_the_driver_is_killed
5. the MLflow server stops and comes back     -> test_tracking_server_outage_spools_and_sync_restores_exactly
6. out of memory                              -> same sweep as 1 (its own block)
Secrets planted in the environment are looked for in every receipt, param, tag, artifact and log line (5).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from sweeps_common import REPO, by_block, fresh_mlflow_uri, tiny_smoke

from ablate.promote import promote
from ablate.promote.policy import load_policy
from ablate.receipts.schema import Code, Status
from ablate.receipts.store import load_receipts
from ablate.sweep.run import run_sweep
from ablate.tracking.mlflow_store import TAG, TrackingClient

pytestmark = pytest.mark.ray






def _arm_runs(uri: str, sweep_id: str) -> dict[str, object]:
    return TrackingClient(uri, "ablate").arm_runs(sweep_id)


def test_failed_nan_and_oom_arms_leave_receipts_and_the_sweep_goes_on(ray_address: str, tmp_path: Path) -> None:
    campaign = tiny_smoke(tmp_path / "campaign", name="faults", steps=5, features={"moe_dispatch": ["jagged"]},
                          blocks=4, aa_blocks=0, max_failures=0)
    uri = fresh_mlflow_uri(tmp_path)
    inject = {"b000": {"raise_at_step": 2}, "b001": {"nan_at_step": 2}, "b002": {"oom_at_step": 1}}
    summary = run_sweep(campaign, tracking_uri=uri, storage=str(tmp_path / "runs"), progress=False, inject=inject)

    receipts, rejected = load_receipts(Path(summary.sweep_dir) / "receipts")
    assert rejected == []
    blocks = by_block(receipts)
    assert set(blocks) == {"b000", "b001", "b002", "b003"}, "every block ran: one failure never stops the sweep"
    assert [r.identity.status for r in blocks["b003"]] == [Status.valid, Status.valid]

    raised = [r for r in blocks["b000"] if r.identity.status is Status.failed]
    assert len(raised) == 1 and "injected failure at budget step 2" in raised[0].error.message
    assert Code.ARM_FAILED.value in raised[0].codes()

    diverged = [r for r in blocks["b001"] if Code.NONFINITE_LOSS.value in r.codes()]
    assert len(diverged) == 1 and diverged[0].identity.status is not Status.valid
    assert diverged[0].steps.total < 5, "a NaN loss stops the arm early"

    oom = [r for r in blocks["b002"] if Code.OOM.value in r.codes()]
    assert len(oom) == 1 and oom[0].identity.status is Status.failed and oom[0].error is not None

    # Every receipt, failed ones included, reached MLflow with its status and cause.
    runs = _arm_runs(uri, summary.sweep_id)
    assert set(runs) == {r.identity.receipt_id for r in receipts}
    failed_run = runs[raised[0].identity.receipt_id]
    assert failed_run.data.tags[TAG + "status"] == "failed"  # type: ignore[attr-defined]
    assert "ARM_FAILED" in failed_run.data.tags[TAG + "disqualifiers"]  # type: ignore[attr-defined]

    # Nothing promoted by accident: a failed arm never makes its block a candidate win.
    policy = load_policy(REPO / "search_spaces/policies/single_node.yaml",
                         overrides={"evidence.min_blocks": 1, "evidence.min_rounds": 1,
                                    "evidence.min_blocks_per_round": 1, "threshold.min_aa_blocks": 2})
    result = promote(receipts, policy_path=policy, defaults_path=REPO / "search_spaces/defaults.yaml")
    (verdict,) = [v for v in result.verdicts if v.feature == "moe_dispatch"]
    assert verdict.verdict != "PROMOTE"
    failures = verdict.failures["candidate"]["failed"] + verdict.failures["baseline"]["failed"]
    refused = {rid for refusal in result.refusals for rid in refusal.receipt_ids}
    failed_ids = {r.identity.receipt_id for r in receipts if r.identity.status is Status.failed}
    assert len(failed_ids) == 3 and failed_ids <= set(verdict.receipt_ids) | refused, "no failure dropped silently"
    assert failures == len(failed_ids & set(verdict.receipt_ids)) >= 1, "failed arms stay in the failure rates"
    def at_horizon(arms: list, role: str) -> float:
        return next(r.projection.tokens_per_s for r in arms if r.identity.arm.value == role)

    clean_wins = sum(1 for arms in (blocks["b003"],) if at_horizon(arms, "candidate") > at_horizon(arms, "baseline"))
    assert verdict.win_fraction is None or verdict.win_fraction * verdict.n_blocks <= clean_wins + 1e-9


def test_killed_train_worker_is_retried_and_logged_once(ray_address: str, tmp_path: Path) -> None:
    campaign = tiny_smoke(tmp_path / "campaign", name="killed", steps=4, lane={"engine": {"workers": 2}},
                          features={"bucket_cap_mb": [0.05]}, blocks=1, aa_blocks=0, max_failures=1)
    uri = fresh_mlflow_uri(tmp_path)
    summary = run_sweep(campaign, tracking_uri=uri, storage=str(tmp_path / "runs"), progress=False,
                        inject={"b000": {"kill_at_step": 2}})
    receipts, rejected = load_receipts(Path(summary.sweep_dir) / "receipts")
    assert rejected == [] and summary.executor == "ray_train"
    by_arm = defaultdict(list)
    for receipt in receipts:
        by_arm[receipt.identity.arm_index].append(receipt)
    assert sorted(by_arm) == [0, 1] and all(len(arms) == 1 for arms in by_arm.values()), \
        "exactly one receipt per arm"
    first = [r for r in receipts if r.identity.order == 0][0]
    assert first.identity.attempt >= 1, "the killed worker group was restarted and the receipt says so"
    assert first.identity.status is Status.valid and first.identity.executor == "ray_train", [d.detail for d in first.disqualifiers]
    runs = _arm_runs(uri, summary.sweep_id)
    assert sorted(runs) == sorted(r.identity.receipt_id for r in receipts), "exactly one MLflow run per arm"


# --- a real MLflow tracking server that goes away and comes back ---

SECRETS = {"ABLATE_TEST_TOKEN": "tok-9f8e7d6c5b4a", "WANDB_API_KEY": "wandb-0a1b2c3d4e5f",
           "DB_PASSWORD": "pw-q1w2e3r4t5y6", "AWS_SECRET_ACCESS_KEY": "aws-z9y8x7w6v5u4",
           "HF_TOKEN": "hf_tokenvalue123456", "RAY_AUTH_TOKEN_SECRET": "raysecret-112233"}
URI_PASSWORD = "uri-pw-77aa88bb99"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(backend: Path, artifacts: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{backend}",
               "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    server = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            time.sleep(0.5)
    raise AssertionError("mlflow server did not start")


def _stop_server(server: subprocess.Popen[bytes]) -> None:
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


def test_tracking_server_outage_spools_and_sync_restores_exactly(ray_address: str, tmp_path: Path) -> None:
    backend, artifacts, server_log = tmp_path / "server.db", tmp_path / "artifacts", tmp_path / "server.log"
    port = _free_port()
    uri = f"http://ablate:{URI_PASSWORD}@127.0.0.1:{port}"
    plain_uri = f"http://127.0.0.1:{port}"
    campaign = tiny_smoke(tmp_path / "campaign", name="outage", steps=4, features={"fused_residual": ["on"]},
                          blocks=2, aa_blocks=0, resources={"cpus_per_worker": 1, "max_concurrent_blocks": 1})
    storage = tmp_path / "runs"
    server = _start_server(backend, artifacts, port, server_log)
    driver: subprocess.Popen[bytes] | None = None
    try:
        env = {**os.environ, **SECRETS, "RAY_ADDRESS": ray_address, "PYTHONPATH": str(REPO),
               "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_TRACKING_URI": uri}
        driver_log = tmp_path / "driver.log"
        with driver_log.open("w") as log:
            driver = subprocess.Popen([sys.executable, "-m", "ablate", "sweep", str(campaign), "--storage", str(storage),
                                       "--no-progress"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            # The server goes away once the sweep's parent run exists, i.e. during the sweep.
            deadline = time.monotonic() + 120
            while not backend.exists() or b"ablate.role" not in backend.read_bytes():
                assert driver.poll() is None, driver_log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the sweep never reached the tracking server"
                time.sleep(0.3)
            _stop_server(server)
            assert driver.wait(timeout=300) == 0, driver_log.read_text()[-3000:]
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        if server.poll() is None:
            _stop_server(server)

    sweep_dir = storage / "outage"
    on_disk, rejected = load_receipts(sweep_dir / "receipts")
    assert rejected == [] and len(on_disk) == 4
    assert (sweep_dir / "spool.jsonl").exists(), "receipts the server could not take were spooled"

    server = _start_server(backend, artifacts, port, server_log)
    try:
        sync_env = {**env, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
        for _ in range(2):  # a second sync must change nothing: replays are idempotent by receipt id
            out = subprocess.run([sys.executable, "-m", "ablate", "receipts", "sync", str(sweep_dir)], cwd=REPO,
                                 env=sync_env, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stdout + out.stderr
            (tmp_path / "sync.log").open("a").write(out.stdout + out.stderr)
            client = TrackingClient(plain_uri, "ablate")
            runs = client.search([f"tags.`{TAG}role` = 'arm'"])
            ids = sorted(r.data.tags[TAG + "receipt_id"] for r in runs)
            assert ids == sorted(r.identity.receipt_id for r in on_disk), "MLflow holds exactly the receipts on disk"
        params_and_tags = [(run.data.params, run.data.tags) for run in runs]
    finally:
        _stop_server(server)

    # Secrets: not in receipts, MLflow params/tags, the store, artifacts, or any log line we wrote.
    haystacks = [p.read_bytes() for p in sweep_dir.rglob("*") if p.is_file()]
    haystacks += [p.read_bytes() for p in artifacts.rglob("*") if p.is_file()]
    haystacks += [backend.read_bytes(), driver_log.read_bytes(), (tmp_path / "sync.log").read_bytes()]
    haystacks += [repr(params_and_tags).encode()]
    assert len(haystacks) > 10
    for secret in [*SECRETS.values(), URI_PASSWORD]:
        assert not any(secret.encode() in hay for hay in haystacks), f"secret {secret[:6]}... leaked"
