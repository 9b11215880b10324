"""A head start for the first arms: each node that will run one-worker arms starts its fork server
(``trainers.forkserver``) as soon as Ray is up, while Tune starts the trials, instead of when the first arm asks;
on a local runtime of a machine without a GPU the driver starts it even before Ray (``start_local_fork_server``).

How to use (``ablate.sweep.run`` does)::

    early = start_local_fork_server(need)   # before ensure_ray(); a thread, or None
    ...                                     # ray.init waits for Ray's processes meanwhile
    pending = start_fork_servers(capacity)   # one Ray task per node that fits an arm; returns at once
    ...                                       # the sweep runs
    log_fork_servers(pending, early)          # debug lines for what ended; never raises

Why: the server imports torch, dynamo and the arm code once per node and sweep (2-3 s on 2 CPUs), and until now
the first arms waited for that after Tune had started their trials. The task is what an arm does first
(``trainers.run.prestart_fork_server``), so the server is the one the arms fork from, and it still has run nothing
before them. It asks for no CPU: a trial that holds the node's CPUs is not delayed by it. Only nodes with a CPU no
trial holds get one: where the trials take every CPU, the server's imports take CPU their start needed.

A local runtime's driver starts its machine's server before ``ray.init`` instead, from a thread: ``ray.init`` mostly
waits for Ray's processes (one of 2 CPUs idle for ~3 s), and the imports fit there. 2 CPUs, 2 blocks at once, every
server stopped before each run: the first block's time to first step 3.92 -> 1.70 s and the command's wall time
18.31 -> 17.38 s (medians of 4, benchmarks/results/first_arms.json, stop 51; the stop-50 records of the Ray-task
head start let a run find the server an earlier run of the same tree left listening).

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
import threading
import time
from typing import Any, Mapping, Optional

from ablate.sweep.resources import BlockNeed, Capacity

log = logging.getLogger(__name__)


def start_fork_servers(capacity: Capacity) -> list[Any]:
    """Submit ``trainers.run.prestart_fork_server`` to every node that runs arms and keeps a CPU free while they
    run; the refs, not waited for."""
    need = capacity.need
    if not _one_cpu_arms(need):
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


def _one_cpu_arms(need: BlockNeed) -> bool:
    return need.executor == "subprocess" and need.cpus_per_worker == 1 and not need.gpus_per_worker


ACCELERATOR_OVERRIDE_ENV = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
"""Set, Ray writes every accelerator's visible-devices variable (an empty ``CUDA_VISIBLE_DEVICES``) into workers
that hold none (``ray._private.utils.set_visible_accelerator_ids``)."""


class EarlyStart(threading.Thread):
    """``trainers.run.prestart_fork_server`` on a thread of the driver; ``line`` says what happened once it ended."""

    def __init__(self, environ: dict[str, str]) -> None:
        super().__init__(name="ablate-fork-server-early", daemon=True)
        from trainers.forkserver import server_directory
        from trainers.provenance import code_fingerprint
        from trainers.run import REPO_ROOT, prestart_fork_server

        # Imported, found and fingerprinted here (the fingerprint runs git with this process's environment): while
        # the thread runs, ``ensure_ray`` empties os.environ around ``ray.init``, and nothing on it may read it then.
        self._prestart, self._environ = prestart_fork_server, environ
        self._directory, self._code = server_directory(), code_fingerprint(REPO_ROOT)
        self.line = ""

    def run(self) -> None:
        started = time.monotonic()
        line = self._prestart(self._environ, self._directory, self._code)
        self.line = f"{line} in {time.monotonic() - started:.2f} s"


def start_local_fork_server(need: BlockNeed) -> Optional[EarlyStart]:
    """Before the driver starts a local runtime (``ensure_ray``): start this machine's fork server for arms of
    ``need``, on a thread, keyed from the environment their trials will have (``local_trial_env``). Its imports
    (2-3 s of CPU on 2 CPUs) then run while ``ray.init`` waits for Ray's processes, which leaves a CPU mostly idle,
    instead of while the first arms wait for them. None where the arms' environment is not provably that one: a
    cluster to attach to (the Ray-task head start covers its nodes), arms of another shape than
    ``start_fork_servers`` starts for, Ray told to set the accelerators' variables in workers without one
    (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO``: an empty ``CUDA_VISIBLE_DEVICES`` would key the trials' server), and
    a machine with a GPU (Ray 2.60 leaves a CPU trial's ``CUDA_VISIBLE_DEVICES`` alone, but no GPU run has checked
    that the key matches there). None, never an exception, where the thread cannot be started (no server directory,
    say); a server that fails to start on the thread says so in its ``line``, and the first arm, as before.

    It starts before Ray says what the cluster runs, so a sweep refused after it (a device or resume check) leaves
    the server to idle out (``trainers.forkserver.IDLE_S``)."""
    import ray

    from ablate.sweep.resources import detect_local

    override = os.environ.get(ACCELERATOR_OVERRIDE_ENV, "").strip().lower() not in ("", "0", "false")
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS") or override or not _one_cpu_arms(need):
        return None
    try:
        if detect_local()[1]:
            return None
        thread = EarlyStart(local_trial_env())
        thread.start()
    except Exception as exc:  # noqa: BLE001 - a head start only: the arms start their server, or fall back
        from ablate.redact import redact_text

        log.debug("%s", redact_text(f"fork server not started before Ray: {type(exc).__name__}: {exc}"))
        return None
    return thread


def local_trial_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment a 1-CPU trial of a local runtime this process starts will have, as far as it keys the fork
    server: this process's (``ensure_ray`` passes it to Ray's processes, less what ``process_env`` drops, which the
    arms drop too), with ``OMP_NUM_THREADS`` as Ray sets it where unset (``set_omp_num_threads_if_unset``: the CPUs
    the worker holds, here 1). What Ray and Tune add besides (``RAY_*``, ``TUNE_*``, ``PYTHONBREAKPOINT``) keys no
    server (``trainers.run.LAUNCHER_ENV_PREFIXES``)."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


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


def log_fork_servers(pending: list[Any], early: Optional[EarlyStart] = None) -> None:
    """Debug lines for the head starts that ended; one still running (a node slow to start it) is left alone."""
    if early is not None and not early.is_alive():
        from ablate.redact import redact_text

        log.debug("%s (started before Ray)", redact_text(early.line))  # the driver's whole environment is back
    if not pending:
        return
    import ray

    try:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for line in ray.get(done, timeout=5):
            log.debug("%s", line)
    except Exception as exc:  # noqa: BLE001 - a node that went away took its task: the arms said how they started
        log.debug("fork server head starts not read back: %s", exc)
