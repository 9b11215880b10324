"""The progress line: blocks done / total, arms failed, elapsed and an ETA from this session's pace.

The fake trials carry what the display reads from Tune's ``Trial`` (``status``, ``config["block_id"]``), and the
hooks are called in the order Tune 2.60's ``TuneController`` calls them (see ``ablate.sweep.progress``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sweeps_common import REPO, fresh_mlflow_uri, tiny_smoke

from ablate.receipts.store import load_receipts
from ablate.sweep.layout import Layout
from ablate.sweep.progress import SweepProgress


@dataclass
class _Trial:
    block_id: str
    status: str = "PENDING"
    config: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.config = {"block_id": self.block_id}


def _started(display: SweepProgress, trial: _Trial, attempt: int = 0) -> None:
    display.on_trial_result(iteration=0, trials=[], trial=trial, result={
        "event": "block_started", "block_id": trial.block_id, "attempt": attempt})


def _arm(display: SweepProgress, trial: _Trial, arm_index: int, attempt: int = 0, status: str = "valid") -> None:
    # What ablate.sweep.trial.run_block reports per arm (the receipt JSON left out).
    display.on_trial_result(iteration=0, trials=[], trial=trial, result={
        "event": "arm", "block_id": trial.block_id, "arm_index": arm_index, "order": arm_index, "attempt": attempt,
        "status": status})


def _complete(display: SweepProgress, trials: list[_Trial], trial: _Trial) -> None:
    # Tune calls on_trial_complete while the trial is still RUNNING and marks it TERMINATED right after.
    display.on_trial_complete(iteration=0, trials=trials, trial=trial)
    trial.status = "TERMINATED"


def test_counts_eta_and_plain_log_lines() -> None:
    console = Console(record=True, width=200, force_terminal=False)
    display = SweepProgress(4, title="s1", console=console, live=False)
    trials = [_Trial("b000", "TERMINATED"), _Trial("b001", "RUNNING"), _Trial("b002", "RUNNING"), _Trial("b003")]
    display.on_step_end(iteration=1, trials=trials)
    assert display.counts.done_at_start == 1, "a resumed sweep starts from what already finished"
    assert display.eta() is None, "no pace yet in this session"
    b001, b002 = trials[1], trials[2]
    _started(display, b001)
    _arm(display, b001, 0, status="failed")
    _arm(display, b001, 1)
    display.started -= 10.0  # ten seconds into the session
    _complete(display, trials, b001)
    b002.status = "ERROR"
    display.on_trial_error(iteration=3, trials=trials, trial=b002)
    eta = display.eta()
    assert eta is not None and 4.0 < eta < 6.0, "2 blocks finished in 10 s here, 1 left: about 5 s"
    line = display.line()
    assert "blocks 2/4 done" in line and "1 errored" in line and "arms 2 (1 failed" in line and "ETA 0:0" in line
    assert "interrupted" not in line
    display.on_experiment_end(trials=trials)
    printed = console.export_text()
    assert printed.count("blocks 2/4 done, 0 running, 1 errored") == 1, \
        "plain logs print a line per change, not per redraw"
    assert "blocks 1/4 done" in printed


def test_sigint_does_not_count_the_interrupted_blocks_as_done() -> None:
    """The callback sequence of a Ctrl+C in a resumed session: Tune stops its loop, saves the experiment, sets
    every running trial TERMINATED *without* on_trial_complete, then calls on_experiment_end. Before the fix the
    final line counted every TERMINATED trial, "blocks 5/6 done", although three blocks were finished (the field
    report: 2/14 with 2 receipts)."""
    console = Console(record=True, width=200, force_terminal=False)
    display = SweepProgress(6, title="s2", console=console, live=False)
    trials = [_Trial(f"b00{i}") for i in range(6)]
    restored, skipped, finished, cut, retried, _ = trials
    restored.status = "TERMINATED"  # finished in an earlier session: Tune restores it as TERMINATED
    for trial in (skipped, finished, cut, retried):
        trial.status = "RUNNING"
    display.on_step_end(iteration=1, trials=trials)
    # Receipts on disk although the killed driver never saved Tune's state: the trial skips the block.
    display.on_trial_result(iteration=1, trials=trials, trial=skipped,
                            result={"event": "block_skipped", "block_id": skipped.block_id})
    _complete(display, trials, skipped)
    _started(display, finished)
    _arm(display, finished, 1)
    _arm(display, finished, 0)
    _complete(display, trials, finished)  # both arms, trial completed
    _started(display, cut)
    _arm(display, cut, 1)  # one arm reported; the second arm is running when SIGINT arrives
    # The retried block failed attempt 0 (both receipts) and is rerun as attempt 1 (Tune: on_trial_recover,
    # PENDING, RUNNING again), which has one receipt so far.
    _started(display, retried, attempt=0)
    _arm(display, retried, 0, attempt=0, status="failed")
    _arm(display, retried, 1, attempt=0)
    _started(display, retried, attempt=1)
    _arm(display, retried, 0, attempt=1)
    display.on_step_end(iteration=2, trials=trials)
    assert (display.counts.done, display.counts.running, display.counts.done_at_start) == (3, 2, 1)

    # SIGINT: TuneController._cleanup_trials -> _schedule_trial_stop sets RUNNING trials TERMINATED, no callback.
    for trial in (cut, retried):
        trial.status = "TERMINATED"
    display.on_experiment_end(trials=trials)
    counts = display.counts
    assert (counts.done, counts.interrupted, counts.running, counts.errored) == (3, 2, 0, 0)
    line = display.line()
    assert "blocks 3/6 done" in line and "2 interrupted" in line and "arms 6 (1 failed" in line
    assert "blocks 5/6 done" not in console.export_text()


def test_the_line_shows_each_features_running_speed_up_from_finished_blocks() -> None:
    import json
    import math

    def arm(trial: _Trial, index: int, role: str, feature: Any, tps: float, status: str = "valid") -> None:
        receipt = {"identity": {"status": status, "arm": role, "feature": feature, "kind": "speed",
                                "feature_value": "jagged" if feature else None},
                   "projection": {"tokens_per_s": tps}}
        display.on_trial_result(iteration=0, trials=[], trial=trial, result={
            "event": "arm", "block_id": trial.block_id, "arm_index": index, "attempt": 0, "status": status,
            "receipt": json.dumps(receipt)})

    display = SweepProgress(4, title="s1", console=Console(record=True, width=300), live=False)
    b0, b1, b2, aa = _Trial("b000"), _Trial("b001"), _Trial("b002"), _Trial("b003")
    arm(b0, 0, "baseline", "moe_dispatch", 1000.0)
    assert "moe_dispatch" not in display.line(), "one arm is no ratio yet"
    arm(b0, 1, "candidate", "moe_dispatch", 1200.0)
    arm(b1, 1, "candidate", "moe_dispatch", 1500.0)
    arm(b1, 0, "baseline", "moe_dispatch", 1000.0)
    arm(b2, 0, "baseline", "moe_dispatch", 1000.0)
    arm(b2, 1, "candidate", "moe_dispatch", 9000.0, status="disqualified")  # never counted
    arm(aa, 0, "baseline", None, 1000.0)
    arm(aa, 1, "candidate", None, 1100.0)
    line = display.line()
    assert f"moe_dispatch=jagged {math.sqrt(1.2 * 1.5):.2f}x (2)" in line, line
    assert line.count("x (") == 1, "A/A blocks and disqualified arms add nothing"


def test_the_console_of_a_real_sweep_is_progress_and_summary_only(tmp_path: Path) -> None:
    campaign = tiny_smoke(tmp_path / "campaign", name="quiet", features={"mamba_scan": ["chunked"]}, blocks=1,
                          aa_blocks=0)
    uri = fresh_mlflow_uri(tmp_path)
    loaded = tmp_path / "driver_modules.json"
    # `python -m ablate sweep ...`, and at exit the driver's own record of the heavy modules it imported.
    driver = ("import atexit, json, runpy, sys\n"
              f"atexit.register(lambda: open({str(loaded)!r}, 'w').write(json.dumps(sorted(m for m in sys.modules "
              "if m.split('.')[0] in ('torch', 'tensorboardX')))))\n"
              "sys.argv[0] = 'ablate'\n"
              "runpy.run_module('ablate', run_name='__main__', alter_sys=True)\n")
    out = subprocess.run([sys.executable, "-c", driver, "sweep", str(campaign), "--storage", str(tmp_path / "runs"),
                          "--tracking-uri", uri], cwd=tmp_path, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"})
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-4000:]
    # The driver plans, checks nodes and runs Tune without torch (2-3 s of its start): arms import it, it never
    # does; Tune keeps its JSON and CSV result logs but writes no TensorBoard files (tensorboardX imports torch).
    assert json.loads(loaded.read_text()) == [], "the sweep driver imported torch or tensorboardX"
    tune_files = [p.name for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert "result.json" in tune_files and "progress.csv" in tune_files
    assert not [name for name in tune_files if name.startswith("events.out.tfevents")], tune_files
    for noise in ("snapshotting has been triggered", "Configuration for experiment", "View detailed results",
                  "TensorBoard", "Checkpoint successfully created", "INFO mlflow", "Started a local Ray instance",
                  "Wrote the latest version"):
        assert noise not in output, (noise, output[-4000:])
    # No Ray Tune warning block (nor any other warning or Tune status table) anywhere in a clean sweep's console.
    # The one exception is Ray core's token-authentication notice when `ray.init` starts a local cluster: a
    # security setting of the user's Ray, which the sweep passes on rather than hides.
    warned = [line for line in output.splitlines()
              if (re.search(r"(?i)\bwarn(ing)?s?\b", line) and "authentication_token_setup.py" not in line)
              or any(mark in line for mark in ("Trial status", "Trial name", "tune_controller", "Tip: "))]
    assert warned == [], warned[:20]
    # stderr ends on the progress line: nothing is printed after it, so the summary on stdout comes last. Ray core's
    # token-authentication notice (the exception above) is printed by Ray's own logger and may land after it.
    ours = [line for line in out.stderr.splitlines() if line.strip() and "authentication_token_setup.py" not in line]
    assert ours[-1].startswith("quiet-"), out.stderr[-2000:]
    # Progress goes to stderr (the display), the summary to stdout (what a script keeps).
    progress = [line for line in out.stderr.splitlines() if line.startswith("quiet-")]
    assert progress and "blocks 1/1 done" in progress[-1] and "mamba_scan=chunked" in progress[-1]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    summary = lines[-6:]
    assert len(lines) == 6, out.stdout  # nothing but the summary
    assert summary[0].startswith("sweep quiet-") and "1/1 blocks done" in summary[0], lines[-8:]
    assert summary[3].startswith("next:     ablate promote --tracking-uri") and "--sweep quiet" in summary[3]
    assert summary[-1].strip().startswith("mlflow ui --backend-store-uri sqlite:"), lines[-8:]


@pytest.mark.ray
@pytest.mark.slow
def test_a_real_sweep_interrupted_with_sigint_reports_the_running_block_as_interrupted(tmp_path: Path) -> None:
    """Ctrl+C on a real driver once block b000 has one of its two receipts. Before the fix the last progress
    line said "blocks 1/2 done, ... arms 1", and run_sweep's summary counted the stopped trial as done too (it
    ends TERMINATED without an error). And (issue 17) a receipt the running arm wrote as the driver stopped
    listening stayed on disk only, in neither MLflow nor the spool, and the only hint was Ray's
    ``Tuner.restore(...)``, not ``ablate sweep --resume``."""
    # Sequential blocks: an interleaved pair writes both receipts together at its end, so there would be no
    # moment with one receipt of a still-running block to interrupt. moe_dispatch: both arms run eager (a
    # fused_residual candidate compiled with Inductor, ~10 s of each block on 2 cores, and interrupting is not
    # about compiling); b000's second arm still needs its start-up (seconds) and 30 steps after the first receipt.
    campaign = tiny_smoke(tmp_path / "campaign", name="sigint", steps=30, features={"moe_dispatch": ["jagged"]},
                          blocks=2, aa_blocks=0, resources={"cpus_per_worker": 1, "max_concurrent_blocks": 1},
                          block_mode="sequential")
    uri = fresh_mlflow_uri(tmp_path)
    storage = str(tmp_path / "runs")
    receipts_dir = Layout.for_campaign("sigint", storage).receipts_dir
    code = (f"from ablate.sweep.run import run_sweep; s = run_sweep({str(campaign)!r}, tracking_uri={uri!r}, "
            f"storage={storage!r}, progress=True); print('SUMMARY', s.blocks_done, s.blocks_total, s.exit_code); "
            f"print(s.render())")
    log_path = tmp_path / "driver.log"
    with log_path.open("w") as log:
        driver = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 300
        while not (receipts_dir.exists() and load_receipts(receipts_dir)[0]):
            assert driver.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no receipt in time"
            time.sleep(0.2)
        driver.send_signal(signal.SIGINT)  # what Ctrl+C delivers to the driver
        driver.wait(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
    output = log_path.read_text()
    # The arm running at SIGINT may still finish and write its receipt to disk (--resume then skips b000); the
    # driver stopped listening, and Tune never completed the trial: the block is interrupted, not done.
    lines = re.findall(r"sigint-\S+: blocks .*", output)
    assert lines and "blocks 0/2 done" in lines[-1] and "1 interrupted" in lines[-1], output[-3000:]
    assert "SUMMARY 0 2 1" in output, output[-3000:]
    # What to run next is ablate's command, not Ray's.
    assert "Tuner.restore" not in output and f"ablate sweep {campaign} --resume --storage {storage}" in output, \
        output[-3000:]
    # Every receipt on disk once the driver is gone is in MLflow or in the spool.
    from ablate.tracking.mlflow_store import TrackingClient

    on_disk = {r.identity.receipt_id for r in load_receipts(receipts_dir)[0]}
    logged = set(TrackingClient(uri, "ablate").arm_runs())
    spool = receipts_dir.parent / "spool.jsonl"
    spooled = {r.identity.receipt_id for r in load_receipts(spool)[0]} if spool.exists() else set()
    assert on_disk and on_disk <= logged | spooled, (on_disk - logged - spooled, output[-3000:])


def test_a_blocks_failed_arms_are_one_console_line_and_other_errors_keep_their_traceback() -> None:
    """Tune logs a trial that raised ``ArmFailed`` with Ray's traceback around our one raise: during a sweep that
    record is one line, each failed arm's first and last line (the whole failure is in its receipt); any other
    error keeps its traceback (found when a full disk left a worker's log empty, so its failure named no fault)."""
    import io
    import logging

    from ray.exceptions import RayTaskError

    from ablate.sweep.run import _faults_in_one_line
    from ablate.sweep.trial import arm_failed

    dead = ("baseline arm failed: worker process exited with status 1 before writing a result (attempt 0)\n"
            "Traceback (most recent call last):\n  File \"trainers/loop.py\", line 3, in run\n"
            "torch.OutOfMemoryError: CPU out of memory\n")
    train = ("candidate arm failed: Training failed due to worker errors:\n[Rank 0 Error Snippet]:\n"
             "A worker health check failed.\n[Rank 1 Error Snippet]:\nRuntimeError: Connection closed by peer")
    failure = arm_failed("b000", 0, [dead, train])
    wrapped = RayTaskError("train", f"Traceback (most recent call last):\n  ...\nablate.sweep.trial.ArmFailed: "
                                    f"{failure}", failure).as_instanceof_cause()
    logger = logging.getLogger("ray.tune.execution.tune_controller")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        with _faults_in_one_line():
            for exc in (wrapped, ValueError("a bug of ours")):
                try:
                    raise exc
                except Exception:  # noqa: BLE001
                    logger.error("Trial task failed for trial b000", exc_info=True)
        try:
            raise wrapped
        except Exception:  # noqa: BLE001 - outside a sweep: Tune's record as it is
            logger.error("Trial task failed for trial b001", exc_info=True)
    finally:
        logger.removeHandler(handler)
    arm_line, rest = stream.getvalue().split("\n", 1)
    assert arm_line == ("Trial task failed for trial b000: block b000 attempt 0: baseline arm failed: worker process "
                        "exited with status 1 before writing a result (attempt 0) ... torch.OutOfMemoryError: CPU out "
                        "of memory; candidate arm failed: Training failed due to worker errors: ... RuntimeError: "
                        "Connection closed by peer")
    assert rest.startswith("Trial task failed for trial b000\nTraceback") and "ValueError: a bug of ours" in rest
    assert "Trial task failed for trial b001\nTraceback" in rest
    assert str(failure).startswith("block b000 attempt 0: " + dead)    # the whole failure stays the message


def test_tunes_ctrl_c_handler_does_not_outlive_the_fit() -> None:
    """Tune installs its SIGINT and SIGUSR1 handlers when a run starts and puts the previous ones back only when
    such a signal arrives: after a fit that ended on its own, the sweep's first Ctrl+C would only log Tune's
    "ending Ray Tune run". ``tune_signal_handlers_restored`` (around ``Tuner.fit``) puts them back."""
    from ray.tune.tune import _setup_signal_catching

    from ablate.sweep.resources import tune_signal_handlers_restored

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGUSR1)}
    try:
        _setup_signal_catching()  # what Tuner.fit runs first
        assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT], "Ray changed: Tune installs none"
        for sig, handler in before.items():
            signal.signal(sig, handler)
        with tune_signal_handlers_restored():
            _setup_signal_catching()
        assert {sig: signal.getsignal(sig) for sig in before} == before
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
