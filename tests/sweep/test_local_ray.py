"""The local Ray runtime a sweep starts, and what its driver hands its trials through Ray: no idle worker processes
started for nothing, a shutdown that leaves nothing behind, and the scheduling stamp kept in Ray's key-value store
(no actor process of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from ablate.sweep.trial import SchedulingClock, driver_stamp, start_clock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_sweeps_local_ray_starts_no_idle_worker_that_no_trial_could_use(tmp_path) -> None:
    # Ray's default starts one idle worker per CPU for the first driver, outside any trial's runtime environment.
    driver = textwrap.dedent("""
        import logging
        import time
        import psutil
        import ray
        from ablate.sweep.run import ensure_ray

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("ablate.sweep.run").setLevel(logging.DEBUG)
        assert ensure_ray()
        print("get_node is Ray's own again", ray._private.services.get_node.__module__ == "ray._private.services",
              flush=True)
        raylet = next(p for p in psutil.process_iter(["cmdline"])
                      if (p.info["cmdline"] or [""])[0].endswith("/raylet") and
                      ray.get_runtime_context().get_node_id() in " ".join(p.info["cmdline"]))

        def idle_workers():
            return [c for c in raylet.children() if " ".join(c.cmdline()).startswith("ray::IDLE")]

        seen = 0
        deadline = time.monotonic() + 5  # Ray's prestart comes within ~1-2 s of the driver on 2 CPUs
        while time.monotonic() < deadline:
            seen = max(seen, len(idle_workers()))
            time.sleep(0.1)
        print("idle before any work", seen, flush=True)

        @ray.remote(num_cpus=0)
        def nothing():
            return None

        ray.get(nothing.remote())  # its worker goes back to the pool idle: the count above can see one
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not idle_workers():
            time.sleep(0.1)
        print("idle after a task", len(idle_workers()), flush=True)
        from ray._private.worker import _global_node
        from ablate.sweep.run import shutdown_ray

        (monitor,) = _global_node.all_processes["monitor"]
        shutdown_ray()
        time.sleep(0.5)  # a report of the monitor's death would reach this driver's console by now
        print("gone after shutdown", not psutil.pid_exists(monitor.process.pid) and not raylet.is_running(),
              ray.is_initialized(), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    # The start found its raylet by polling the GCS's node table, not at Ray's one-second tick, and put Ray's own
    # lookup back.
    seen = re.search(r"raylet registered (\d+\.\d+) s after Ray looked for it \((\d+) polls\)", out.stderr)
    assert seen is not None and int(seen.group(2)) >= 1, out.stderr[-3000:]
    assert "get_node is Ray's own again True" in out.stdout, out.stdout
    counts = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines() if line.startswith("idle "))
    assert counts["idle before any work"] == "0", out.stdout
    assert int(counts["idle after a task"]) >= 1, out.stdout  # the detector does see Ray's idle workers
    # ``shutdown_ray`` stops the runtime it started, its autoscaler monitor killed first (Ray waited 1 s for it
    # and then killed it anyway): all gone, and no "The autoscaler failed" report reached the driver.
    assert "gone after shutdown True False" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "autoscaler failed" not in out.stdout + out.stderr


def test_another_ray_layout_keeps_rays_own_node_wait(monkeypatch) -> None:
    from ray._private import services
    from ray.core.generated import gcs_service_pb2

    from ablate.sweep.node_wait import prompt_node_wait

    original = services.get_node
    monkeypatch.delattr(gcs_service_pb2, "GetAllNodeInfoRequest")
    with prompt_node_wait() as wait:
        assert services.get_node is original
    assert services.get_node is original
    assert wait.polls == 0 and "GetAllNodeInfoRequest" in wait.skipped
    assert wait.line().startswith("Ray's own node wait")


def test_the_node_wait_polls_until_registered_and_leaves_the_rest_to_ray(monkeypatch) -> None:
    from ablate.sweep import node_wait
    from ablate.sweep.node_wait import NodeWait, _poll

    answers = iter([False, False, True])
    timeouts: list[float] = []
    found = NodeWait()
    _poll(lambda timeout_s: timeouts.append(timeout_s) or next(answers), found)
    assert (found.polls, found.found) == (3, True) and found.line().startswith("raylet registered")
    assert all(0 < t <= node_wait.READ_TIMEOUT_S for t in timeouts)

    def unreachable(timeout_s: float) -> bool:
        raise RuntimeError("Timed out while waiting for GCS to become available.")

    gone = NodeWait()
    _poll(unreachable, gone)  # Ray's own lookup, called next, reports it
    assert gone.polls == 1 and not gone.found and "unreadable" in gone.line()

    monkeypatch.setattr(node_wait, "TIMEOUT_S", 0.1)
    never = NodeWait()
    _poll(lambda timeout_s: False, never)
    assert not never.found and never.seconds >= 0.1 and never.polls >= 2
    polls = never.polls
    _poll(lambda timeout_s: False, never)  # a second lookup of the same start: the limit is spent already
    assert never.polls == polls


def test_the_drivers_scheduling_stamp_reaches_another_process_and_is_forgotten_at_the_end(ray_address) -> None:
    import ray

    clock, other = SchedulingClock("sweep-a"), SchedulingClock("sweep-b")
    clock.stamp("b000", 1795953112.25)
    other.stamp("b000", 1.0)

    @ray.remote(num_cpus=0)
    def read(sweep_id: str, block_id: str) -> object:
        return driver_stamp(sweep_id, block_id, wait_s=0.2)

    assert ray.get(read.remote("sweep-a", "b000")) == 1795953112.25  # exact: the float's repr round-trips
    assert ray.get(read.remote("sweep-a", "b001")) is None  # never stamped: the trial's own clock, after wait_s
    clock.close()
    assert ray.get(read.remote("sweep-a", "b000")) is None
    assert ray.get(read.remote("sweep-b", "b000")) == 1.0  # another sweep's stamps stay
    start_clock("sweep-b")  # a resumed sweep's driver: the killed one's stamps are gone before any trial reads one
    assert ray.get(read.remote("sweep-b", "b000")) is None


def test_a_bare_trial_outside_ray_has_no_driver_stamp() -> None:
    code = ("from ablate.sweep.trial import SchedulingClock, driver_stamp, start_clock; "
            "print(driver_stamp('sweep-a', 'b000', wait_s=0.0)); SchedulingClock('sweep-a').close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert (out.returncode, out.stdout) == (0, "None\n"), out.stderr[-2000:]
