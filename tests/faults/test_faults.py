"""Faults on real processes: nothing lost, nothing promoted by accident.

The fault suite, one scenario per test, each a real Ray sweep (or a real `mlflow server` process):
1. an arm raises mid-run                      -> test_failed_nan_and_oom_arms_leave_receipts_and_the_sweep_goes_on
2. loss becomes NaN                           -> same sweep (its own block)
3. a Train worker is SIGKILLed                -> test_killed_train_worker_fails_its_arm_and_the_block_is_*
4. the sweep driver is killed, then --resume  -> tests/sweep/test_sweep_ray.py::test_resume_after_the_driver_is_killed
5. the MLflow server stops and comes back     -> test_tracking_server_outage_spools_and_sync_restores_exactly
6. out of memory                              -> same sweep as 1 (its own block)
7. the disk fills up mid-sweep                -> test_a_disk_that_fills_up_mid_sweep_loses_no_receipt (a real tmpfs)
Faults without Ray (a second sweep of a campaign, a stale lock, an arm whose receipts dir is full or read-only):
tests/faults/test_receipt_faults.py; a damaged or deleted mlflow.db: tests/tracking/test_tracking_mlflow.py;
Ctrl+C: tests/sweep/test_sweep_progress.py::test_a_real_sweep_interrupted_with_sigint_*.
Secrets planted in the driver's environment (5) are looked for in everything the sweep writes: receipts, spool,
Tune's experiment, the MLflow store and artifacts, stdout/stderr, and the session logs of the Ray it started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import quote

import pytest
from sweeps_common import (REPO, by_block, closed_port, fresh_mlflow_uri, start_mlflow_server, stop_mlflow_server,
                           tiny_smoke)

from ablate.promote import promote
from ablate.promote.match import match_blocks
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
    # Which arm fails is the run order's draw; say everything needed to tell why if a failure is ever dropped.
    seen = [(r.identity.block_id, r.identity.attempt, r.identity.arm.value, r.identity.status.value,
             r.identity.software_fingerprint[:12], r.identity.receipt_id[:8]) for r in receipts]
    assert len(failed_ids) == 3 and failed_ids <= set(verdict.receipt_ids) | refused, \
        f"no failure dropped silently: {seen}; superseded {verdict.superseded}; refusals " \
        f"{[(ref.block_id, ref.reason[:80]) for ref in result.refusals]}"
    assert failures == len(failed_ids & set(verdict.receipt_ids)) >= 1, "failed arms stay in the failure rates"
    def at_horizon(arms: list, role: str) -> float:
        return next(r.projection.tokens_per_s for r in arms if r.identity.arm.value == role)

    clean_wins = sum(1 for arms in (blocks["b003"],) if at_horizon(arms, "candidate") > at_horizon(arms, "baseline"))
    assert verdict.win_fraction is None or verdict.win_fraction * verdict.n_blocks <= clean_wins + 1e-9


def test_killed_train_worker_fails_its_arm_and_the_block_is_retried_as_a_pair(ray_address: str,
                                                                              tmp_path: Path) -> None:
    campaign = tiny_smoke(tmp_path / "campaign", name="killed", steps=4, lane={"engine": {"workers": 2}},
                          features={"bucket_cap_mb": [0.05]}, blocks=1, aa_blocks=0, max_failures=1)
    uri = fresh_mlflow_uri(tmp_path)
    summary = run_sweep(campaign, tracking_uri=uri, storage=str(tmp_path / "runs"), progress=False,
                        inject={"b000": {"kill_at_step": 2}})
    receipts, rejected = load_receipts(Path(summary.sweep_dir) / "receipts")
    assert rejected == [] and summary.executor == "ray_train"
    by_attempt = defaultdict(dict)
    for receipt in receipts:
        by_attempt[receipt.identity.attempt][receipt.identity.arm_index] = receipt
    # Attempt 0: the killed arm keeps its failed receipt beside its partner's; attempt 1 (Tune's retry of the
    # block) reruns both. A relaunch inside the arm would have numbered it attempt 1 beside a partner at 0.
    assert sorted(by_attempt) == [0, 1] and all(sorted(arms) == [0, 1] for arms in by_attempt.values())
    killed = next(r for r in by_attempt[0].values() if r.identity.order == 0)
    assert killed.identity.status is Status.failed and killed.identity.executor == "ray_train"
    assert all(r.identity.status is Status.valid for r in by_attempt[1].values())
    runs = _arm_runs(uri, summary.sweep_id)
    assert sorted(runs) == sorted(r.identity.receipt_id for r in receipts), "exactly one MLflow run per arm"
    # The retried block pairs, and the dead arm counts against its role.
    policy = load_policy(REPO / "search_spaces/policies/single_node.yaml")
    blocks, refusals = match_blocks(receipts, policy)
    assert refusals == [] and len(blocks) == 1
    assert blocks[0].baseline.attempt == blocks[0].candidate.attempt == 1
    role = killed.identity.arm.value
    assert blocks[0].earlier_failures.get(role) == 1


# --- a real MLflow tracking server that goes away and comes back ---

SECRETS = {"ABLATE_API_PASS": "apipass-3e4f5a6b7c", "ABLATE_DB_PWD": "dbpwd-8d9e0f1a2b",
           "ABLATE_TEST_TOKEN": "tok-9f8e7d6c5b4a", "WANDB_API_KEY": "wandb-0a1b2c3d4e5f",
           "DB_PASSWORD": "pw-q1w2e3r4t5y6", "AWS_SECRET_ACCESS_KEY": "aws-z9y8x7w6v5u4",
           "HF_TOKEN": "hf_tokenvalue123456", "RAY_AUTH_TOKEN_SECRET": "raysecret-112233"}
URI_PASSWORD = "uri@pw-77aa88bb99"
"""'@' inside: the URI's userinfo ends at the last '@' before the host, and the part after this '@' is looked for
too (the old redaction cut there and printed the rest)."""


def _leaks(haystacks: dict[str, bytes]) -> dict[str, list[str]]:
    """Planted secret -> the files (or streams) holding it, raw or URL-encoded."""
    wanted = {**SECRETS, "MLFLOW_TRACKING_URI password": URI_PASSWORD,
              "MLFLOW_TRACKING_URI password after its '@'": URI_PASSWORD.rpartition("@")[2]}
    found: dict[str, list[str]] = {}
    for name, value in wanted.items():
        forms = {value.encode(), quote(value, safe="").encode(), quote(value).encode()}
        hits = [where for where, hay in haystacks.items() if any(form in hay for form in forms)]
        if hits:
            found[name] = hits
    return found


def test_tracking_server_outage_spools_and_sync_restores_exactly(tmp_path: Path) -> None:
    """The sweep's driver starts its own local Ray, the embedded default, so everything it starts inherits the
    driver's environment with the planted secrets (an attached cluster, like the ``ray_address`` fixture, never
    sees it); ``RAY_TMPDIR`` puts that Ray's session logs where the test greps them.

    The feature is one whose arms both run eager (moe_dispatch), not fused_residual, whose candidate compiles
    with Inductor on CPU (12-15 s a block on 2 cores): nothing here is about compiling. Two blocks, run one at a
    time, keep the second block's receipts after the outage whatever the first one's timing."""
    # The server's store starts as the empty, migrated schema that fresh_mlflow_uri copies for every test (the
    # server would otherwise run the same migrations itself on its first start, 3-6 s on 2 cores).
    backend = Path(fresh_mlflow_uri(tmp_path / "server").removeprefix("sqlite:///"))
    artifacts, server_log = tmp_path / "artifacts", tmp_path / "server.log"
    port = closed_port()
    uri = f"http://ablate:{URI_PASSWORD}@127.0.0.1:{port}"
    plain_uri = f"http://127.0.0.1:{port}"
    campaign = tiny_smoke(tmp_path / "campaign", name="outage", steps=4, features={"moe_dispatch": ["jagged"]},
                          blocks=2, aa_blocks=0, resources={"cpus_per_worker": 1, "max_concurrent_blocks": 1})
    storage = tmp_path / "runs"
    server = start_mlflow_server(backend, artifacts, server_log, port)[0]
    driver: subprocess.Popen[bytes] | None = None
    ray_tmp = Path(tempfile.mkdtemp(prefix="ab-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **SECRETS, "PYTHONPATH": str(REPO),
               "RAY_TMPDIR": str(ray_tmp), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_TRACKING_URI": uri}
        driver_log = tmp_path / "driver.log"
        with driver_log.open("w") as log:
            driver = subprocess.Popen([sys.executable, "-m", "ablate", "sweep", str(campaign), "--storage", str(storage),
                                       "--no-progress"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            # The server goes away once the sweep's parent run exists, i.e. during the sweep (after Ray started).
            deadline = time.monotonic() + 240
            while not backend.exists() or b"ablate.role" not in backend.read_bytes():
                assert driver.poll() is None, driver_log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the sweep never reached the tracking server"
                time.sleep(0.3)
            stop_mlflow_server(server)
            assert driver.wait(timeout=300) == 0, driver_log.read_text()[-3000:]
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        if server.poll() is None:
            stop_mlflow_server(server)

    sweep_dir = storage / "outage"
    on_disk, rejected = load_receipts(sweep_dir / "receipts")
    assert rejected == [] and len(on_disk) == 4
    assert (sweep_dir / "spool.jsonl").exists(), "receipts the server could not take were spooled"

    server = start_mlflow_server(backend, artifacts, server_log, port)[0]
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
        stop_mlflow_server(server)

    # Secrets: nowhere the sweep wrote. Receipts, spool, sweep metadata, Tune's experiment (result.json, experiment
    # state) and Train storage are all under `storage`; then the MLflow store, its artifacts, every stream, and
    # the session of the Ray the driver started (runtime_env_agent.log printed Tune's trial runtime env).
    sessions = sorted((ray_tmp / "ray").glob("session_2*"))
    assert len(sessions) == 1, f"the driver started one local Ray under {ray_tmp}: {sessions}"
    agent_log = sessions[0] / "logs" / "runtime_env_agent.log"
    assert b"Creating runtime env" in agent_log.read_bytes(), "Tune's trial runtime envs were logged (and looked at)"
    files = [*storage.rglob("*"), *artifacts.rglob("*"), *sessions[0].rglob("*"), backend, server_log, driver_log,
             tmp_path / "sync.log"]
    haystacks = {str(p.relative_to(ray_tmp if p.is_relative_to(ray_tmp) else tmp_path)): p.read_bytes()
                 for p in files if p.is_file()}
    haystacks["MLflow params and tags"] = repr(params_and_tags).encode()
    assert any("result.json" in p for p in haystacks) and any("experiment_state" in p for p in haystacks)
    assert len([p for p in haystacks if p.startswith("ray/session_")]) > 5 and len(haystacks) > 30
    shutil.rmtree(ray_tmp, ignore_errors=True)
    leaks = _leaks(haystacks)
    assert not leaks, "planted secrets found:\n" + "\n".join(f"{name}: {len(where)} file(s): {sorted(where)}"
                                                          for name, where in leaks.items())


# --- a disk that fills up while the sweep runs ---


def test_a_disk_that_fills_up_mid_sweep_loses_no_receipt(ray_address: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    """Campaign dir, Tune state and mlflow.db on one small tmpfs that fills up once the first receipt is written.
    Before the fix: "Aborted.", a cascade of tracebacks, a 0-byte temporary receipt, and the arm's receipt lost.
    Now every receipt the driver received is on disk or in the fallback directory, whose path the summary gives
    with the command to run next."""
    import secrets
    import threading

    from fsfaults import can_mount, fill, tmpfs

    from ablate.receipts.store import FALLBACK_ENV, fallback_roots
    from ablate.tracking.mlflow_store import sync

    if not can_mount():
        pytest.skip("needs root with the right to mount a tmpfs; the write path is covered by tests/test_store.py")
    name = f"diskfull-{secrets.token_hex(3)}"
    fallback = tmp_path / "fallback"
    monkeypatch.setenv(FALLBACK_ENV, str(fallback))
    # moe_dispatch: both arms run eager. Nothing here is about compiling (a fused_residual candidate compiled with
    # Inductor, ~10 s on 2 cores whenever it ran first); each later arm still starts seconds after the first
    # receipt, after the filler has filled the disk.
    campaign = tiny_smoke(tmp_path / "campaign", name=name, steps=4, features={"moe_dispatch": ["jagged"]},
                          blocks=2, aa_blocks=0, max_failures=0, block_mode="sequential",
                          resources={"cpus_per_worker": 1, "max_concurrent_blocks": 1})
    try:
        with tmpfs(tmp_path / "disk", size_kb=4096) as disk:
            uri = fresh_mlflow_uri(disk)
            receipts_dir = disk / "runs" / name / "receipts"
            ended = threading.Event()

            def fill_after_first_receipt() -> None:
                while not ended.is_set() and not list(receipts_dir.glob("*.json")):
                    time.sleep(0.1)
                fill(disk)

            filler = threading.Thread(target=fill_after_first_receipt, daemon=True)
            filler.start()
            try:
                summary = run_sweep(campaign, tracking_uri=uri, storage=str(disk / "runs"), progress=False)
            finally:
                ended.set()
                filler.join(timeout=60)
            printed = capfd.readouterr()
            on_disk, rejected = load_receipts(receipts_dir)
            temporary = [p.name for p in receipts_dir.iterdir() if p.name.endswith(".tmp")]
    finally:
        for root in [r for r in fallback_roots() if r != fallback] + [Path.home() / ".local/state/ablate/fallback"]:
            # Ray's workers did not inherit the test's fallback variable: their copies went to the default root.
            subprocess.run(["rm", "-rf", str(root / name)], check=False)

    assert temporary == [] and rejected == [], "no temporary receipt and nothing unreadable left on the full disk"
    rescued, bad = load_receipts(fallback / name)
    assert bad == []
    received = set(summary.receipt_ids)
    kept = {r.identity.receipt_id for r in on_disk} | {r.identity.receipt_id for r in rescued}
    assert received and received <= kept, f"receipts lost: {sorted(received - kept)}"
    text = summary.render()
    print(text)  # shown with -rP: what a user reads
    assert summary.fallbacks and summary.exit_code == 1, text
    # One line per fault from Tune and MLflow, not a traceback per failed write.
    assert "Traceback" not in printed.out + printed.err, (printed.out + printed.err)[-5000:]
    assert f"they are in {fallback / name / 'receipts'}" in text and f"ablate receipts sync {fallback / name}" in text
    # What the summary says to run works: the fallback directory syncs into a store (the full disk's is useless).
    result = sync(fallback / name, fresh_mlflow_uri(tmp_path / "store"))
    assert result.rejected == [] and set(result.logged) == {r.identity.receipt_id for r in rescued}

