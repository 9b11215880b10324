"""Fresh-process executor for one-worker arms: same isolation as a Ray Train worker, without its start-up cost.

How to run me (``trainers.run.run_arm`` does this; by hand only to debug an arm)::

    python -m trainers.worker <spec.json> <result.json> [attempt [rank.json]]

Reads an ``ArmSpec`` as JSON, runs it with ``trainers.loop.run_worker`` and writes the ``WorkerResult`` JSON
atomically. Exit status 0 whenever a result was written, including a failed arm (the failure is inside the
result); a missing result file means the process died (SIGKILL, segfault) and the caller decides on a retry.

``rank.json`` (``trainers.run`` writes it for one rank of a multi-worker CPU arm, launched by its Ray Train worker):
``{"context": <WorkerContext fields>, "backend": "gloo", "group": <prefix of the group's store keys>, "timeout_s": ...,
"launcher_pid": ...}``. The process exits (status 3) as soon as its launching Train worker is gone, and joins the
arm's process group from the launcher variables its worker set (``trainers.train_backend.ARM_PROCESS_ENV``) before
the arm starts. A rank whose arm fails raises (the group's other ranks cannot go on), so it exits non-zero and leaves no
result; rank 0 leaves its partial measurements (``partial-<attempt>.state``) first.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _join_group(rank_doc: dict) -> None:
    """The arm's gloo process group, formed from the launcher variables as Ray's ``_setup_torch_process_group``
    forms it (``env://``: a TCPStore on rank 0), its keys under the group's own prefix (``rank_doc["group"]``, a
    nonce rank 0 broadcast with the port). The port is free when rank 0 picks it, not reserved: should another arm
    on the node take it first, this arm's ranks reach that arm's store, where the prefix keeps them out of its
    rendezvous (they time out, and this arm fails) instead of joining another arm's group."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    ctx = rank_doc["context"]
    rank, world_size, timeout_s = ctx["rank"], ctx["world_size"], float(rank_doc["timeout_s"])
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (host and port and rank_doc.get("group")):  # launched by hand: the variables as they are
        dist.init_process_group(backend=rank_doc["backend"], init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        wait_for_store(host, int(port), timeout_s)
    # One timeout for the whole join: the wait and the rendezvous share it.
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=left, multi_tenant=True)
    dist.init_process_group(backend=rank_doc["backend"], store=dist.PrefixStore(str(rank_doc["group"]), store),
                            rank=rank, world_size=world_size, timeout=left)


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
            try:
                poller = select.poll()  # not select(): a descriptor numbered past 1023 would raise there
                poller.register(fd, select.POLLIN)
                poller.poll()
            finally:
                os.close(fd)
        except Exception:  # noqa: BLE001 - gone already, no pidfd on this OS, any fault: the watch goes on by polling
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
    from trainers.host_malloc import apply as apply_host_allocator
    from trainers.hostload import reset_priority

    reset_priority()
    # Imports after argument parsing: a usage error should not pay for torch.
    from trainers.loop import run_worker
    from trainers.pairing import TurnGate
    from trainers.result import WorkerContext
    from trainers.spec import ArmSpec

    spec = ArmSpec.from_json(spec_path.read_text())
    apply_host_allocator(spec.host_allocator)  # before the arm allocates what its steps will free
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
    # A failed rank raises (its group cannot go on); it still leaves through os._exit: an interpreter shutdown
    # with a live gloo group can hang, and the launcher watch (a daemon thread) cannot run during it.
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the same exit status
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk; interpreter teardown after torch + dynamo imports costs ~2 s of module finalizers
    # that would only be billed to the arm as teardown badput.
    os._exit(status)
