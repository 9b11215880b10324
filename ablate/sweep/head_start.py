"""A head start for the first arms: each node that will run one-worker arms starts its fork server
(``trainers.forkserver``) as soon as Ray is up, while Tune starts the trials, instead of when the first arm asks.

How to use (``ablate.sweep.run`` does, before ``Tuner.fit``)::

    pending = start_fork_servers(capacity)   # one Ray task per node that fits an arm; returns at once
    ...                                       # the sweep runs
    log_fork_servers(pending)                 # debug lines for the tasks that ended; never raises

Why: the server imports torch, dynamo and the arm code once per node and sweep (2-3 s on 2 CPUs), and until now
the first arms waited for that after Tune had started their trials. The task is what an arm does first
(``trainers.run.prestart_fork_server``), so the server is the one the arms fork from, and it still has run nothing
before them. It asks for no CPU: a trial that holds the node's CPUs is not delayed by it. Only nodes with a CPU no
trial holds get one: where the trials take every CPU, the server's imports take CPU their start needed (2 CPUs, 2
blocks at once: the first arms' time to first step 4.35 -> 1.92 s, the sweep's wall time unchanged or worse,
21.43 -> 22.26 s; with a CPU free, 4.14 -> 1.50 s and 24.53 -> 22.18 s: benchmarks/bench_first_arms.py).

Only where the task's environment is provably the trials' (the server is keyed by it): one-worker arms of one CPU
and no GPU. Ray gives a process ``OMP_NUM_THREADS`` = its CPUs when unset (1 for this task, as for a 1-CPU trial)
and ``CUDA_VISIBLE_DEVICES`` = its GPUs, and Tune copies some driver variables into its trial actors (mirrored
here: a remote cluster's raylet does not have them). Multi-CPU or GPU arms, and multi-worker arms (Train sets their
workers' environment), start their server as before: a head start keyed otherwise would import torch a second time
beside the first arms (found in review).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ablate.sweep.resources import Capacity

log = logging.getLogger(__name__)


def start_fork_servers(capacity: Capacity) -> list[Any]:
    """Submit ``trainers.run.prestart_fork_server`` to every node that runs arms and keeps a CPU free while they
    run; the refs, not waited for."""
    need = capacity.need
    if need.executor != "subprocess" or need.cpus_per_worker != 1 or need.gpus_per_worker:
        return []
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trainers.run import prestart_fork_server

    task = ray.remote(num_cpus=0, max_retries=0, runtime_env={"env_vars": _trial_actor_env()})(prestart_fork_server)
    return [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                         name="ablate-fork-server-head-start").remote()
            for node in capacity.nodes
            if node.arms > 0
            and node.resources.get("CPU", 0.0) - min(node.arms, capacity.max_concurrent) * need.cpus_per_worker >= 1]


def _trial_actor_env() -> dict[str, str]:
    """The variables Tune adds to every trial actor's runtime environment (``class_cache``), less secret-named ones
    (``tune_env_filter`` drops those for the trials too)."""
    from ablate.redact import is_secret_name

    try:
        from ray.tune.execution import class_cache
    except ImportError:  # another Ray layout: the trials' own server, started by their first arm, is used
        return {}
    names = getattr(class_cache, "ENV_VARS_TO_PROPAGATE", ())
    added = {**getattr(class_cache, "DEFAULT_ENV_VARS", {}),
             **{name: os.environ[name] for name in names if name in os.environ}}
    return {name: value for name, value in added.items() if not is_secret_name(name)}


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
