"""Fresh-process executor for one-worker arms: same isolation as a Ray Train worker, without its start-up cost.

How to run me (``trainers.run.run_arm`` does this; by hand only to debug an arm)::

    python -m trainers.worker <spec.json> <result.json> [attempt [rank.json]]

Reads an ``ArmSpec`` as JSON, runs it with ``trainers.loop.run_worker`` and writes the ``WorkerResult`` JSON
atomically. Exit status 0 whenever a result was written, including a failed arm (the failure is inside the
result); a missing result file means the process died (SIGKILL, segfault) and the caller decides on a retry.

``rank.json`` (``trainers.run`` writes it for one rank of a multi-worker CPU arm, launched by its Ray Train worker):
``{"context": <WorkerContext fields>, "backend": "gloo", "timeout_s": ..., "launcher_pid": ...}``. The process
exits (status 3) as soon as its launching Train worker is gone, and joins the arm's process
group from the launcher variables its worker set (``trainers.train_backend.ARM_PROCESS_ENV``) before the arm
starts. A rank whose arm fails raises (the group's other ranks cannot go on), so it exits non-zero and leaves no
result; rank 0 leaves its partial measurements (``partial-<attempt>.state``) first.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _join_group(rank_doc: dict) -> None:
    """The arm's gloo process group, formed as Ray's ``_setup_torch_process_group`` forms it (``env://``)."""
    from datetime import timedelta

    import torch.distributed as dist

    ctx = rank_doc["context"]
    if ctx["rank"] != 0 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), float(rank_doc["timeout_s"]))
    dist.init_process_group(backend=rank_doc["backend"], init_method="env://", rank=ctx["rank"],
                            world_size=ctx["world_size"], timeout=timedelta(seconds=rank_doc["timeout_s"]))


STORE_POLL_S = 0.01


def wait_for_store(host: str, port: int, timeout_s: float) -> bool:
    """Wait until rank 0's TCPStore at ``host:port`` accepts a connection; False after ``timeout_s`` (then
    ``init_process_group`` waits and reports as it always did). The ranks of an arm are forked within milliseconds
    of each other, so a rank often asks before rank 0 listens: torch's store client is refused and retries after a
    growing back-off, which let the group form 0.07-0.8 s after the store was up
    (``benchmarks/bench_store_join.py``). A bare connect polled every 10 ms is closed by the store, harmlessly."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(STORE_POLL_S)


LAUNCHER_GONE_STATUS = 3
"""Exit status of a rank whose launching Train worker went away (``_die_with_launcher``)."""


def _die_with_launcher(pid: int) -> None:
    """A rank's process never outlives the Train worker that launched it. Train kills a failed group's workers;
    a rank left behind would train on (or wait in a collective) on the CPUs the next arm is measured on. A forked
    rank is also killed by its fork server when the worker's connection closes; a fresh-interpreter rank (no
    server could be had) has only this. The watch blocks on a pidfd: no CPU while the worker lives."""
    import select
    import threading
    import time

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # gone already, or no pidfd on this OS: poll instead
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:  # alive, someone else's: cannot be ours, but keep watching
                    pass
                time.sleep(1.0)
        print(f"trainers.worker: the Train worker that launched this rank (pid {pid}) is gone; stopping",
              file=sys.stderr, flush=True)
        os._exit(LAUNCHER_GONE_STATUS)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    attempt = int(argv[2]) if len(argv) >= 3 else 0
    rank_doc = json.loads(Path(argv[3]).read_text()) if len(argv) == 4 else None
    if rank_doc is not None and rank_doc.get("launcher_pid"):
        _die_with_launcher(int(rank_doc["launcher_pid"]))
    # Before the heavy imports: the arm's whole life runs at normal priority when the OS lets us reset it.
    from trainers.hostload import reset_priority

    reset_priority()
    # Imports after argument parsing: a usage error should not pay for torch.
    from trainers.loop import run_worker
    from trainers.pairing import TurnGate
    from trainers.result import WorkerContext
    from trainers.spec import ArmSpec

    spec = ArmSpec.from_json(spec_path.read_text())
    if rank_doc is None:
        ctx = WorkerContext(attempt=attempt, executor="subprocess", work_dir=str(result_path.parent))
    else:
        ctx = WorkerContext(**rank_doc["context"])
        _join_group(rank_doc)
    result = run_worker(spec, ctx, gate=TurnGate.from_env())
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(result.to_json())
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk; interpreter teardown after torch + dynamo imports costs ~2 s of module finalizers
    # that would only be billed to the arm as teardown badput.
    os._exit(status)
