"""Interleaved blocks: two real processes take strictly alternating turns, a dead partner holds no one up, and a
real interleaved pair of arms leaves two valid receipts whose step cadence excludes the partner's turns, and every
one-worker arm runs the torch threads its campaign allots it."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from ablate.config.schema import HardwareConfig
from ablate.receipts.schema import Status, validate_receipt
from trainer_helpers import make_spec, tiny_lane
from trainers.loop import _threads
from trainers.pairing import ENV_FD, SLOT_DIR, TurnCoordinator, TurnGate
import trainers.run
from trainers.provenance import code_fingerprint, git_state
from trainers.run import can_interleave, run_arm, run_pair

REPO = Path(__file__).resolve().parents[2]
TURNER = """
import os, sys, time
from trainers.pairing import TurnGate
gate = TurnGate.from_env()
name, turns, die_after, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
time.sleep(float(sys.argv[5]))           # a slow start-up must not let the other arm go first
for i in range(turns):
    if i == die_after:
        os._exit(1)                      # dies holding nothing, without a goodbye
    waited = gate.acquire()
    start = time.perf_counter()
    time.sleep(0.02)
    end = time.perf_counter()
    gate.release()
    with open(log, "a") as f:
        f.write(f"{name} {start} {end} {waited}\\n")
gate.close()
"""


def _pair(tmp_path: Path, turns: tuple[int, int], die_after: tuple[int, int] = (-1, -1),
          delays: tuple[float, float] = (0.0, 0.0)) -> list[tuple[str, float, float, float]]:
    log = tmp_path / "turns.log"
    coordinator = TurnCoordinator(first=0)
    procs = []
    for index, fd in enumerate(coordinator.child_fds()):
        env = dict(os.environ, PYTHONPATH=str(REPO), **{ENV_FD: str(fd)})
        procs.append(subprocess.Popen([sys.executable, "-c", TURNER, f"arm{index}", str(turns[index]),
                                       str(die_after[index]), str(log), str(delays[index])], env=env,
                                      pass_fds=(fd,), cwd=REPO))
    coordinator.start()
    for proc in procs:
        proc.wait(timeout=60)
    coordinator.close()
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(name, float(a), float(b), float(w)) for name, a, b, w in rows]


def test_turns_alternate_strictly_and_the_first_arm_goes_first(tmp_path: Path) -> None:
    # Arm 0 starts 0.5 s late: arm 1 must still wait for it (the block's recorded order decides who is first).
    rows = sorted(_pair(tmp_path, (6, 6), delays=(0.5, 0.0)), key=lambda r: r[1])
    assert [name for name, *_ in rows] == ["arm0", "arm1"] * 6
    for (_, _, end, _), (_, start, _, _) in zip(rows, rows[1:]):
        assert start >= end  # never two turns at once
    waits = {name: sum(w for n, _, _, w in rows if n == name) for name in ("arm0", "arm1")}
    assert waits["arm1"] >= 0.4  # arm 1 waited for the late arm 0's first turn, and that wait was recorded


def test_a_partner_that_dies_or_finishes_holds_no_one_up(tmp_path: Path) -> None:
    started = time.monotonic()
    rows = _pair(tmp_path, (8, 8), die_after=(3, -1))
    assert sum(1 for name, *_ in rows if name == "arm1") == 8 and time.monotonic() - started < 30
    (tmp_path / "b").mkdir()
    rows = _pair(tmp_path / "b", (2, 6))
    assert sum(1 for name, *_ in rows if name == "arm1") == 6  # arm 0 finished early; arm 1 went on alone


def test_an_unpaired_gate_grants_every_turn_at_once() -> None:
    gate = TurnGate(None)
    assert not gate.paired and gate.acquire() == 0.0
    gate.release()
    gate.close()


@pytest.mark.slow
def test_an_interleaved_pair_of_real_arms_leaves_two_valid_receipts(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    lane = tiny_lane(budget={"steps": 8, "family_sample_steps": 1, "min_steady_steps": 2})
    scheduled = time.time()
    first = make_spec(lane, tmp_path, scheduled_at=scheduled, block_id="b-pair")
    second = make_spec(lane, tmp_path, scheduled_at=scheduled, block_id="b-pair")
    second = type(second)(**{**second.__dict__, "arm_index": 1, "order": 1})
    reads: list[str] = []
    for name in ("git_state", "code_fingerprint"):
        real = getattr(trainers.run, name)
        monkeypatch.setattr(trainers.run, name, lambda *a, _real=real, _name=name, **k: reads.append(_name) or
                            _real(*a, **k))
    a, b = run_pair((first, second))
    # The pair reads its checkout once (it launches both arms from it at one instant), and both record that read.
    assert sorted(reads) == ["code_fingerprint", "git_state"]
    assert a.identity.code_fingerprint == b.identity.code_fingerprint == code_fingerprint(trainers.run.REPO_ROOT)
    assert (a.identity.git_sha, a.identity.git_dirty) == (b.identity.git_sha, b.identity.git_dirty) \
        == git_state(trainers.run.REPO_ROOT)
    for receipt in (a, b):
        validate_receipt(receipt)
        assert receipt.identity.status is Status.valid and receipt.identity.pairing == "interleaved"
        waits = receipt.steps.wait_s
        assert receipt.time.badput_s["paired_wait"] >= sum(waits) > 0
        # The partner's turns are never inside this arm's step cadence: the cadence is the arm's own work.
        for cadence, step, data, wait in zip(receipt.steps.cadence_s, receipt.steps.step_s, receipt.steps.data_s,
                                             waits):
            assert cadence < step + data + 0.05 and cadence < cadence + wait
    # Both start-ups ran at once (overlapping, never compared); the turns then alternated.
    assert abs(a.time.badput_s["queue_wait"] - b.time.badput_s["queue_wait"]) < 0.5
    assert a.steps.wait_s[1:] and b.steps.wait_s[1:]


TRIAL_SIDE = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from trainer_helpers import make_spec, tiny_lane
from trainers.inactive import SINGLE_BUCKET
from trainers.receipt import _unused_by_the_baseline_too
from trainers.run import can_interleave, run_pair
lane = tiny_lane(budget={"steps": 2, "family_sample_steps": 1, "min_steady_steps": 1})
first = make_spec(lane, Path(sys.argv[1]), scheduled_at=time.time(), block_id="b-torch-free")
second = type(first)(**{**first.__dict__, "arm_index": 1, "order": 1})
paired = can_interleave((first, second), node_has_gpu=False)
receipts = run_pair((first, second)) if paired else ()
bucket = type(first)(**{**first.__dict__, "feature": "bucket_cap_mb", "baseline_value": 1})
unused = _unused_by_the_baseline_too(bucket, {"inactive": {"bucket_cap_mb": SINGLE_BUCKET}, "buckets_bytes": [4096]})
print(json.dumps({"paired": paired, "statuses": [r.identity.status.value for r in receipts], "unused": unused,
                  "forked_by": [r.identity.process.how for r in receipts], "torch": "torch" in sys.modules}))
"""


@pytest.mark.slow
def test_the_trial_side_of_an_interleaved_pair_never_imports_torch(tmp_path: Path) -> None:
    """A Tune trial runs its block's pair from a Ray worker that only orchestrates: its arms train in processes the
    fork server makes. The pairing check once imported torch there (for the warmup rule) and a bucket-cap receipt
    did too (for one text): ~1.1 s of the first block's start on 2 CPUs, and torch's memory in every trial process.
    """
    out = subprocess.run([sys.executable, "-c", TRIAL_SIDE, str(tmp_path), str(Path(__file__).parent)], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["paired"] and seen["statuses"] == ["valid", "valid"] and seen["unused"] is True
    assert seen["forked_by"] == ["fork_server", "fork_server"]
    assert seen["torch"] is False


def test_arms_with_different_warmup_turns_run_one_after_the_other(tmp_path: Path) -> None:
    """An arm with more turns (``compile.warmup: skip`` against ``explicit``: its warmup steps become budget steps)
    took its last steps alone after its partner ended, and counted them steady (found in review: ~10% faster than
    beside the partner). Such a pair is not interleaved; equal turns still are, on CPU, one worker each."""
    def spec(**compile_: object) -> object:
        return make_spec(tiny_lane(compile={"warmup_steps": 2, **compile_}), tmp_path)

    explicit, skip = spec(warmup="explicit"), spec(warmup="skip")
    assert can_interleave((explicit, spec(warmup="explicit")), node_has_gpu=False)
    assert can_interleave((explicit, spec(warmup="auto")), node_has_gpu=False)  # auto warms up explicitly on CPU
    assert not can_interleave((explicit, skip), node_has_gpu=False)
    assert not can_interleave((explicit, spec(warmup="explicit", warmup_steps=3)), node_has_gpu=False)
    two_workers = make_spec(tiny_lane(engine={"workers": 2}), tmp_path)
    assert not can_interleave((two_workers, two_workers), node_has_gpu=False)


def test_automatic_threads_never_exceed_the_cpus_the_campaign_allots_an_arm(monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    auto, two = HardwareConfig(), HardwareConfig(threads=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # Ray's allotment, or a user's export Ray left alone
    assert _threads(auto, 1) == 4 and _threads(auto, 1, allotted_cpus=1) == 1 and _threads(auto, 1, 8) == 4
    assert _threads(two, 1, allotted_cpus=1) == 2  # the lane's own number is the lane's to answer for
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpus = len(os.sched_getaffinity(0))
    assert _threads(auto, 1) == cpus and _threads(auto, 1, allotted_cpus=1) == 1


@pytest.mark.slow
def test_one_worker_arms_run_the_threads_the_campaign_allots_pinned_or_not_whatever_omp_num_threads_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by benchmarks/bench_arm_start.py, which runs pairs outside Ray: the arms sized torch's pool before their
    first turn pinned them to one CPU, so two OpenMP threads spin-waited on one core (0.07 s -> 2.3 s a step). A
    sweep under a user's exported OMP_NUM_THREADS did the same. Pinned, unpinned (no free CPU: another block holds
    them) or one after the other, every arm of a 1-CPU campaign runs 1 thread: its hardware fingerprint, which
    counts threads, is the same for every block."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    lane = tiny_lane(hardware={"threads": 0}, budget={"steps": 4, "family_sample_steps": 1, "min_steady_steps": 2})
    first = make_spec(lane, tmp_path, scheduled_at=time.time(), block_id="b-threads")
    second = type(first)(**{**first.__dict__, "arm_index": 1, "order": 1})
    with ExitStack() as held:  # every CPU slot of the node taken, as by other blocks' pairs
        for cpu in os.sched_getaffinity(0):
            SLOT_DIR.mkdir(parents=True, exist_ok=True)
            fcntl.flock(held.enter_context(open(SLOT_DIR / f"cpu{cpu}.lock", "w")), fcntl.LOCK_EX)
        unpinned = run_pair((first, second), cpus=1)
    assert [r.observed.hardware["pinned_cpus"] for r in unpinned] == [None, None]
    pinned = run_pair((type(first)(**{**first.__dict__, "block_id": "b-pinned"}),
                       type(second)(**{**second.__dict__, "block_id": "b-pinned"})), cpus=1)
    alone = run_arm(type(first)(**{**first.__dict__, "block_id": "b-alone"}), resources_per_worker={"CPU": 1.0})
    for receipt in (*unpinned, *pinned, alone):
        hardware = receipt.observed.hardware
        assert receipt.identity.status is Status.valid and receipt.env["OMP_NUM_THREADS"] == "2"
        assert hardware["torch_threads"] == 1, (receipt.identity.block_id, hardware)
    fingerprints = {r.identity.hardware_fingerprint for r in (*unpinned, *pinned, alone)}
    assert fingerprints == {alone.identity.hardware_fingerprint}
