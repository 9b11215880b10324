"""Fresh-process executor for one-worker arms: same isolation as a Ray Train worker, without its start-up cost.

How to run me (``trainers.run.run_arm`` does this; by hand only to debug an arm)::

    python -m trainers.worker <spec.json> <result.json> [attempt]

Reads an ``ArmSpec`` as JSON, runs it with ``trainers.loop.run_worker`` and writes the ``WorkerResult`` JSON
atomically. Exit status 0 whenever a result was written, including a failed arm (the failure is inside the
result); a missing result file means the process died (SIGKILL, segfault) and the caller decides on a retry.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    attempt = int(argv[2]) if len(argv) == 3 else 0
    # Before the heavy imports: the arm's whole life runs at normal priority when the OS lets us reset it.
    from trainers.hostload import reset_priority

    reset_priority()
    # Imports after argument parsing: a usage error should not pay for torch.
    from trainers.loop import run_worker
    from trainers.pairing import TurnGate
    from trainers.result import WorkerContext
    from trainers.spec import ArmSpec

    spec = ArmSpec.from_json(spec_path.read_text())
    ctx = WorkerContext(attempt=attempt, executor="subprocess", work_dir=str(result_path.parent))
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
