"""`ray job submit --working-dir . -- python -m ablate sweep ...` against a real `ray start --head` (token auth on,
dashboard on 127.0.0.1): the job attaches to that cluster and its receipts land in MLflow."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from sweeps_common import REPO, closed_port, fresh_mlflow_uri, tiny_smoke

from ablate.receipts.store import load_receipts
from ablate.tracking.mlflow_store import TrackingClient

pytestmark = [pytest.mark.ray, pytest.mark.slow]
BIN = Path(sys.executable).parent


def _ray(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str], str]]:
    """A head node in its own temp dir (so no other ``ray.init()`` on this machine finds it), stopped by SIGTERM to
    the ``ray start --block`` process we started: never ``ray stop``, which would stop every Ray on the host."""
    home = tmp_path_factory.mktemp("head")
    token = home / "auth_token"
    token.write_text(secrets.token_hex(16))
    temp_dir = tempfile.mkdtemp(prefix="ablrt", dir="/tmp")  # short: Unix socket paths are limited to ~107 bytes
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    dashboard = f"http://127.0.0.1:{closed_port()}"
    log = (home / "head.log").open("w")
    proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={closed_port()}",
                             f"--dashboard-port={dashboard.rsplit(':', 1)[1]}", "--dashboard-host=127.0.0.1",
                             # The job agent's HTTP port defaults to 52365: another Ray on the host (a local sweep
                             # running beside the tests) holds it, and jobs then find "no available agent".
                             f"--dashboard-agent-listen-port={closed_port()}",
                             "--num-cpus=2", f"--temp-dir={temp_dir}"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while _ray("job", "list", "--address", dashboard, env=env).returncode != 0:
            assert proc.poll() is None, (home / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job server did not come up"
            time.sleep(1)
        yield dashboard, env, str(home)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_runs_a_sweep_on_the_cluster(head: tuple[str, dict[str, str], str], tmp_path: Path) -> None:
    dashboard, env, home = head
    bad = Path(home) / "wrong_token"
    bad.write_text("not-the-token")
    denied = _ray("job", "list", "--address", dashboard, env={**env, "RAY_AUTH_TOKEN_PATH": str(bad)})
    assert denied.returncode != 0 and "Authentication" in denied.stdout + denied.stderr, "token auth is on"

    campaign = tiny_smoke(tmp_path / "campaign", name="jobsmoke", features={"moe_dispatch": ["jagged"]},
                          blocks=1, aa_blocks=0)
    uri = fresh_mlflow_uri(tmp_path)
    storage = tmp_path / "runs"
    submitted = _ray("job", "submit", "--address", dashboard, "--working-dir", str(REPO), "--",
                     "python", "-m", "ablate", "sweep", str(campaign), "--storage", str(storage),
                     "--tracking-uri", uri, "--no-progress", env=env, timeout=500)
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, output[-4000:]
    assert "succeeded" in output and "1/1 blocks done" in output
    # Tune's experiment-state snapshots are periodic, not forced by every block's checkpoint (they warned before).
    assert "snapshotting has been triggered" not in output, output[-4000:]
    # The node has no deep-check document here: one warning line naming what to run, and the sweep went on.
    assert "no-document: no document at" in output and "ablate doctor --deep --json" in output
    receipts, rejected = load_receipts(storage / "jobsmoke" / "receipts")
    assert rejected == [] and len(receipts) == 2
    # The job attached to the running cluster instead of starting its own Ray: one node, the head.
    nodes = _ray("list", "nodes", "--address", dashboard, "--format", "json", env=env)
    assert nodes.returncode == 0, nodes.stderr[-2000:]
    assert all(r.identity.node_id and r.identity.node_id in nodes.stdout for r in receipts)
    runs = TrackingClient(uri, "ablate").arm_runs()
    assert set(runs) == {r.identity.receipt_id for r in receipts}
