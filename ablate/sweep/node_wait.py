"""A local Ray start that notices its new node as soon as the raylet registers it, not at Ray's next one-second tick.

How to use (``ablate.sweep.run.ensure_ray`` does)::

    with prompt_node_wait() as wait:
        ray.init(address="local", ...)
    wait.line()   # "raylet registered 0.86 s after Ray looked for it (43 polls)", for a debug log

Why: ``ray.init`` of a new local runtime starts the raylet, then asks the GCS for the new node through
``ray._private.services.get_node``, whose C++ accessor (``GlobalStateAccessor::GetNode``) sleeps a fixed second
between asks. The raylet registers 0.7-1.6 s after it starts on 2 CPUs (it waits for the dashboard agent), so every
start paid up to a second of nothing, all of it before the first trial: ``ensure_ray`` took 3.67-3.84 s in three
smoke campaigns and 2.58-2.82 s with this wait, alternating, and the first trial started ~1 s sooner (stop 57;
``benchmarks/bench_ray_start.py`` keeps the record). This polls the GCS's node table (one non-blocking read) every
``POLL_S`` until the node is there, then lets Ray's own ``get_node`` read it, which then finds it at once.

Ray's own wait stays the judge: a node that never registers, a table that cannot be read, or a Ray whose layout
differs (no ``services.get_node`` to stand in for) leaves everything to Ray, as before. Ray's function is back in
place when the block ends.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

POLL_S = 0.02
TIMEOUT_S = 30.0
"""Ray's own limit for the raylet to register (``Node.__init__``'s ``raylet_start_wait_time_s``)."""


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
        from ray._private import services, state

        original: Callable[..., Any] = services.get_node
        client_options: Callable[[str], Any] = services._get_gcs_client_options
    except (ImportError, AttributeError) as exc:  # another Ray layout: its own wait, unchanged
        wait.skipped = f"{type(exc).__name__}: {exc}"
        yield wait
        return

    def get_node(gcs_address: str, node_id: str) -> Any:
        _poll(state, client_options(gcs_address), node_id, wait)
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield wait
    finally:
        services.get_node = original


def _poll(state: Any, options: Any, node_id: str, wait: NodeWait) -> None:
    started = time.monotonic()
    table: Optional[Any] = None
    try:
        table = state.GlobalState()
        table._initialize_global_state(options)
        while time.monotonic() - started < TIMEOUT_S:
            wait.polls += 1
            if any(row.get("NodeID") == node_id and row.get("Alive") for row in table.node_table()):
                wait.found = True
                break
            time.sleep(POLL_S)
    except Exception as exc:  # noqa: BLE001 - Ray's get_node, called next, waits and reports as it always did
        wait.skipped = f"node table unreadable: {type(exc).__name__}: {exc}"
    finally:
        wait.seconds = time.monotonic() - started
        if table is not None:
            with contextlib.suppress(Exception):
                table.disconnect()
