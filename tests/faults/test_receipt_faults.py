"""Faults around a sweep that must not lose a receipt, on real processes and real filesystems, without Ray.

1. two sweeps of one campaign in one directory  -> test_a_second_sweep_of_a_campaign_is_refused_naming_the_holder
2. a lock left by a killed driver; --wait        -> test_a_dead_drivers_lock_is_taken_over_and_a_waiting_sweep_gets_it
3. an arm whose receipts dir is full / read-only -> test_an_arm_whose_receipts_dir_refuses_writes_leaves_its_receipt
   (a real arm: its own worker process; the disk is a real tmpfs where the machine allows mounting, tests/fsfaults.py)
The driver's side of a full disk is a real sweep: tests/faults/test_faults.py::test_a_disk_that_fills_up_mid_sweep_*;
a damaged or deleted mlflow.db: tests/tracking/test_tracking_mlflow.py; Ctrl+C:
tests/sweep/test_sweep_progress.py::test_a_real_sweep_interrupted_with_sigint_*.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fsfaults import fault_dir
from sweeps_common import REPO, tiny_smoke

from ablate.receipts.schema import Status
from ablate.receipts.store import FALLBACK_ENV, load_receipts
from ablate.sweep.layout import LOCK_FILE, SweepLock, SweepLocked

_HOLD = ("import sys, time; from pathlib import Path; from ablate.sweep.layout import SweepLock; "
         "lock = SweepLock(Path(sys.argv[1])).acquire(sys.argv[2]); print('held', flush=True); "
         "time.sleep(float(sys.argv[3])); lock.release()")


def _holder(directory: Path, sweep_id: str, seconds: float) -> subprocess.Popen[str]:
    """A real driver-like process holding the campaign lock for ``seconds``, then releasing it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory), sweep_id, str(seconds)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_sweep_of_a_campaign_is_refused_naming_the_holder(tmp_path: Path) -> None:
    """Before the fix two sweeps of one campaign ran side by side in one directory, measuring each other."""
    from typer.testing import CliRunner

    from ablate.cli import app

    campaign = tiny_smoke(tmp_path / "campaign", name="locked")
    storage = tmp_path / "runs"
    holder = _holder(storage / "locked", "locked-first", 120)
    try:
        with pytest.raises(SweepLocked) as info:
            SweepLock(storage / "locked").acquire("locked-second")
        message = str(info.value)
        assert f"PID {holder.pid} on host {socket.gethostname()}" in message and "sweep locked-first" in message
        out = CliRunner().invoke(app, ["sweep", str(campaign), "--storage", str(storage), "--no-progress",
                                       "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])
        stderr = " ".join(out.stderr.split())
        assert out.exit_code == 2 and stderr.startswith("error: campaign directory"), out.output
        assert f"PID {holder.pid}" in stderr and "sweep locked-first" in stderr and "--wait" in stderr
        assert "Traceback" not in out.output
        assert not (storage / "locked" / "sweeps").exists(), "refused before it wrote anything"
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_drivers_lock_is_taken_over_and_a_waiting_sweep_gets_it(tmp_path: Path) -> None:
    directory = tmp_path / "runs" / "c"
    killed = _holder(directory, "c-killed", 120)
    os.kill(killed.pid, signal.SIGKILL)  # kill -9: no release, the lock file still names it
    killed.wait()
    assert "c-killed" in (directory / LOCK_FILE).read_text()
    lock = SweepLock(directory).acquire("c-next")
    assert lock.stale is not None and lock.stale["pid"] == killed.pid, "a stale lock is detected, not obeyed"
    lock.release()

    holder = _holder(directory, "c-running", 1.5)
    try:
        heard: list[str] = []
        started = time.monotonic()
        lock = SweepLock(directory).acquire("c-waiting", wait_s=60, on_wait=heard.append, poll_s=0.1)
        assert time.monotonic() - started > 0.5, "it waited for the running sweep"
        assert len(heard) == 1 and "c-running" in heard[0] and f"PID {holder.pid}" in heard[0]
        assert lock.stale is None, "a sweep that released its lock is not stale"
        lock.release()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_an_arm_whose_receipts_dir_refuses_writes_leaves_its_receipt(kind: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the fix an arm whose receipts/ had turned read-only raised before it started (no receipt anywhere,
    not even in the spool), and on a full disk the receipt write raised, leaving a 0-byte temporary file."""
    from ablate.config.load import load_sweep
    from ablate.sweep.plan import plan_sweep
    from ablate.sweep.trial import make_arm_spec
    from trainers import run_arm

    fallback = tmp_path / "fallback"
    monkeypatch.setenv(FALLBACK_ENV, str(fallback))
    sweep, _ = load_sweep(tiny_smoke(tmp_path / "campaign", name="refused", steps=3))
    block = next(b for b in plan_sweep(sweep, "refused-1").blocks if b.feature == "moe_dispatch")
    position, arm = block.run_order()[0]
    with fault_dir(kind, tmp_path, monkeypatch) as (campaign, how):
        if how == "injected":
            pytest.skip("a real arm needs a real full disk (its worker process cannot see an injected errno)")
        receipt = run_arm(make_arm_spec(block, position, arm, sweep_id="refused-1", campaign=sweep.name,
                                        receipt_dir=str(campaign / "receipts")))
        assert sorted(p.name for p in (campaign / "receipts").iterdir()) == [], "no temporary file, no scratch"
    found, rejected = load_receipts(fallback / "refused")
    assert rejected == [] and [r.identity.receipt_id for r in found] == [receipt.identity.receipt_id]
    if kind == "read-only":
        # The arm ran (a tiny lane may be disqualified, e.g. too few steady steps); only its receipt went elsewhere.
        assert receipt.identity.status is not Status.failed, receipt.error
    elif receipt.identity.status is not Status.valid:
        # The arm's own scratch may be on the full disk too: then it fails, and its receipt says why.
        assert receipt.error is not None and "No space left on device" in receipt.error.message


def test_a_worker_that_died_on_a_full_disk_says_so(tmp_path: Path) -> None:
    """A worker whose disk fills up dies without a result, and its traceback went to a log on that same disk: the
    failure names the full disk (and the sweep's console shows it as one disk-fault line, not a traceback)."""
    from fsfaults import can_mount, fill, tmpfs

    from trainers.receipt import LaunchInfo
    from trainers.run import _worker_outcome

    if not can_mount():
        pytest.skip("needs root with the right to mount a tmpfs (a real full disk)")
    with tmpfs(tmp_path / "disk", size_kb=256) as disk:
        work = disk / "arm"
        work.mkdir()
        log, said = work / "worker-0.log", work / "worker-1.log"
        log.touch()
        said.write_text("MemoryError")
        launch = LaunchInfo(executor="subprocess", run_start=0.0, end=0.0)
        assert _worker_outcome(None, launch, work / "result-0.state", log, 1, 0, None) is None  # type: ignore[arg-type]
        assert launch.failure is not None and "No space left" not in launch.failure["message"]  # space left
        fill(disk)
        assert _worker_outcome(None, launch, work / "result-0.state", log, 1, 0, None) is None  # type: ignore[arg-type]
        assert launch.failure["message"].startswith(
            f"worker process exited with status 1 before writing a result (attempt 0): the disk of {work} is full "
            "(No space left on device)")
        # A log that says why is the cause shown; the disk is named only when nothing else could be.
        assert _worker_outcome(None, launch, work / "result-1.state", said, 1, 0, None) is None  # type: ignore[arg-type]
        assert launch.failure["message"].endswith("(attempt 0)\nMemoryError")
