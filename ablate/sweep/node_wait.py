"""A local Ray start that notices its new node as soon as the raylet registers it, not at Ray's next one-second tick.

How to use (``ablate.sweep.run.ensure_ray`` does)::

    with prompt_node_wait() as wait:
        ray.init(address="local", ...)
    wait.line()   # "raylet registered 0.86 s after Ray looked for it (43 polls)", for a debug log

Why: ``ray.init`` of a new local runtime starts the raylet, then asks the GCS for the new node through
``ray._private.services.get_node``, whose C++ accessor (``GlobalStateAccessor::GetNode``) sleeps a fixed second
between asks. The raylet registers 0.7-1.6 s after it starts on 2 CPUs (it waits for the dashboard agent), so every
start paid up to a second of nothing, all of it before the first trial. Beside the fork server's imports
(``benchmarks/bench_ray_start.py``, two records of 5 starts per mode, alternating), ``ensure_ray`` took 2.2-2.9 s
with this wait, and 2.2-2.4 s or 3.3-3.4 s without it: the later tick 5 times in 10. In three smoke campaigns each,
a prototype of it took 2.58-2.82 s against 3.67-3.84 s, and the first trial started ~1 s sooner (stop 57's note).
This asks the GCS for the new node's row every ``POLL_S`` (one read, bounded by ``READ_TIMEOUT_S``) until it is
there, then lets Ray's own ``get_node`` read it, which then finds it at once. Attached to a running cluster, Ray
looks its node up once: one read.

Ray's own wait stays the judge: a node not registered within ``TIMEOUT_S``, a GCS that does not answer, or a Ray
whose layout differs (no ``services.get_node`` to stand in for) leaves the rest to Ray, as before. Ray's function
is back in place when the block ends.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

POLL_S = 0.02
READ_TIMEOUT_S = 1.0
"""The longest one read of the node table may take: a GCS that stops answering ends the wait, not the start."""
TIMEOUT_S = 30.0
"""Ray's own limit for the raylet to register (``Node.__init__``'s ``raylet_start_wait_time_s``); past it, Ray's own
lookup decides at once."""


@dataclass
class NodeWait:
    """What the wait saw; ``polls`` stays 0 when Ray's layout left it out."""

    polls: int = 0
    seconds: float = 0.0
    found: bool = False
    skipped: str = ""

    def line(self) -> str:
        if self.skipped:
            return f"Ray's own node wait ({self.skipped})"
        state = "registered" if self.found else "not seen"
        return f"raylet {state} {self.seconds:.2f} s after Ray looked for it ({self.polls} polls)"


@contextlib.contextmanager
def prompt_node_wait() -> Iterator[NodeWait]:
    """Around ``ray.init`` of a new local runtime: see the module docstring."""
    wait = NodeWait()
    try:
        from ray._private import services
        from ray._raylet import GcsClient, NodeID
        from ray.core.generated.gcs_pb2 import GcsNodeInfo
        from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest

        original: Callable[..., Any] = services.get_node
    except (ImportError, AttributeError) as exc:  # another Ray layout: its own wait, unchanged
        wait.skipped = f"{type(exc).__name__}: {exc}"
        yield wait
        return

    def get_node(gcs_address: str, node_id: str) -> Any:
        client = None

        def registered(timeout_s: float) -> bool:
            # One bounded read of this node's row, alive only (as Ray's ``get_node_to_connect_for_driver`` asks). The
            # client is made here, inside the poll, so a GCS that cannot be reached leaves the lookup to Ray.
            nonlocal client
            client = client or GcsClient(address=gcs_address)
            selector = GetAllNodeInfoRequest.NodeSelector(node_id=NodeID.from_hex(node_id).binary())
            return bool(client.get_all_node_info(timeout=timeout_s, node_selectors=[selector],
                                                 state_filter=GcsNodeInfo.GcsNodeState.ALIVE))

        _poll(registered, wait)
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield wait
    finally:
        if services.get_node is get_node:  # an inner or later swap, left in place, is its owner's to undo
            services.get_node = original


def _poll(registered: Callable[[float], bool], wait: NodeWait) -> None:
    """Ask ``registered`` (with a per-read timeout) every ``POLL_S`` until it says yes or ``TIMEOUT_S`` has passed
    since the first ask, over all the lookups of one ``ray.init``."""
    started = time.monotonic()
    deadline = started + max(0.0, TIMEOUT_S - wait.seconds)
    try:
        while (left := deadline - time.monotonic()) > 0:
            wait.polls += 1
            if registered(min(left, READ_TIMEOUT_S)):
                wait.found = True
                break
            time.sleep(POLL_S)
    except Exception as exc:  # noqa: BLE001 - Ray's get_node, called next, waits and reports as it always did
        wait.skipped = f"node table unreadable: {type(exc).__name__}: {exc}"
    finally:
        wait.seconds += time.monotonic() - started
