"""A head start for the first arms: each node that will run one-worker arms starts its fork server
(``trainers.forkserver``) as soon as Ray is up, while Tune starts the trials, instead of when the first arm asks.

How to use (``ablate.sweep.run`` does, before ``Tuner.fit``)::

    pending = start_fork_servers(capacity)   # one Ray task per node that fits an arm; returns at once
    ...                                       # the sweep runs
    log_fork_servers(pending)                 # debug lines for the tasks that ended; never raises

Why: the server imports torch, dynamo and the arm code once per node and sweep (2-3 s on 2 CPUs), and until now
the first arms waited for that after Tune had started their trials. The task is what an arm does first
(``trainers.run.prestart_fork_server``), so the server is the one the arms fork from, and it still has run nothing
before them. It asks for no CPU: a trial that holds the node's CPUs is not delayed by it. Multi-worker arms
(``executor: ray_train``) fork their ranks from Train workers, whose environment Train sets, so they get none.
"""

from __future__ import annotations

import logging
from typing import Any

from ablate.sweep.resources import Capacity

log = logging.getLogger(__name__)


def start_fork_servers(capacity: Capacity) -> list[Any]:
    """Submit ``trainers.run.prestart_fork_server`` to every node that runs arms; the refs, not waited for."""
    if capacity.need.executor != "subprocess":
        return []
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trainers.run import prestart_fork_server

    task = ray.remote(num_cpus=0, max_retries=0)(prestart_fork_server)
    return [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                         name="ablate-fork-server-head-start").remote()
            for node in capacity.nodes if node.arms > 0]


def log_fork_servers(pending: list[Any]) -> None:
    """Debug lines for the head starts that ended; one still running (a node slow to start it) is left alone."""
    if not pending:
        return
    import ray

    try:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for line in ray.get(done, timeout=5):
            log.debug("%s", line)
    except Exception as exc:  # noqa: BLE001 - a node that went away took its task: the arms said how they started
        log.debug("fork server head starts not read back: %s", exc)
