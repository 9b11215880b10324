"""Warm, still isolated Ray Train processes: the raylet starts the next arm's processes (and they import torch and
the arm code) while nothing is measured, so a two-worker arm's actors find them idle instead of spawning Python.

How to use (``trainers.run`` does this for every multi-worker arm)::

    envs = expected_envs(caller_env, controller_env_vars, worker_env_vars)  # what Ray Train's actors will carry
    prestart(envs, num_workers)                         # after an arm's fit: processes for the next one
    evidence = process_evidence(created_after=fit_start)  # inside a Train worker: how its process was prepared

Why: each arm's Train controller, synchronisation actor, placement-group cleaner and workers were fresh Python
processes started after ``fit()``; on 2 CPUs that was most of the ~10 s from scheduled to first step (process
start 1-2 s each, plus 3-4 s importing torch in every worker).

How Ray hands out pooled processes (Ray 2.60, measured; ``src/ray/raylet/worker_pool.cc`` ``WorkerFitForLease``):
an idle worker serves an actor only if its job matches, it never ran a normal task (``is_actor_worker``) and its
runtime-env hash equals the actor's. The hash is over the serialized runtime env: an actor with no runtime env, or
``{"env_vars": {}}``, inherits its parent's string verbatim; any other runtime env is merged with the parent's by the
core worker and re-serialized compactly with sorted keys (``merged_env``). Ray Train always gives its controller
and workers env vars, so the pool is started with those merged strings through the raylet's own
``PrestartWorkers`` RPC (``keep_alive_duration_secs`` keeps them from the idle-worker reaper). The raylet starts at
most ``worker_maximum_startup_concurrency`` (= CPUs) at a time and drops the rest of a request, so ``prestart``
asks in small batches from a background thread, each once the last one registered (``GetNodeStats``).

What keeps arms isolated: an actor's process exits with the actor and is never handed out again, a process that
ran a normal task never becomes an actor, and a pooled Train worker ran only ``setup_hook`` (imports, as the fork
server does: no op, no compile, no CUDA) before its arm. ``process_evidence`` checks it from the process's own
state (start time before the arm's ``fit()``, the hook's record, a module-level mark no earlier arm set) and the
receipt says which way the process came (``identity.process``).
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import threading
import time
from typing import Any, Optional

HOOK = "trainers.ray_pool.setup_hook"
"""Ray's ``worker_process_setup_hook``, given to the Train workers only (``hook_env_vars``): Ray runs it as each of
their processes starts, before the process takes any work, so a pooled process has imported torch before an arm
asks for it. The Train controller, Tune trials and the rest of the job do not import torch for it."""
CONTROLLER_PROCESSES = 3
"""Processes Ray Train 2.60 starts per run with the controller's runtime env: the controller, its placement-group
cleaner and the synchronisation actor."""
KEEP_ALIVE_S = 600
REGISTER_TIMEOUT_S = 30.0
"""Longest wait for one prestart batch to register before the next is sent anyway."""

_HOOK_RECORD: Optional[dict[str, Any]] = None
_CLAIMED_BY: Optional[float] = None
"""Module-level mark: the ``created_after`` of the arm that ran in this process. Set by the first arm; any later
arm seeing it set would prove a process was reused (Ray never does that to an actor's process)."""
_LEARNED: dict[str, str] = {}
"""Predicted runtime-env string -> the one a Train worker actually carried, when the prediction was wrong."""


def hook_env_vars() -> dict[str, str]:
    """Env vars that make Ray run ``setup_hook`` in a process it starts: what ``ray.init(runtime_env=
    {"worker_process_setup_hook": "<module.func>"})`` writes for the job (``ray._private.runtime_env.setup_hook.
    export_setup_func_module``), here for the Train workers' runtime env alone. Empty on a Ray without it."""
    try:
        from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    except ImportError:
        return {}
    return {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: HOOK}


def setup_hook() -> None:
    """Ray's ``worker_process_setup_hook`` in a Train worker's process: import what every arm imports (the fork
    server's list, ``trainers.forkserver.PRELOAD``). Never raises (Ray would end the process): a failed import is
    paid again by the arm, and the hook's record says why."""
    global _HOOK_RECORD
    start = time.time()
    record: dict[str, Any] = {"hook_start": start}
    try:
        from trainers.forkserver import PRELOAD, PRELOAD_CPU_BUILD

        for name in PRELOAD:
            importlib.import_module(name)
        import torch

        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            for name in PRELOAD_CPU_BUILD:
                importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - the arm imports again and its receipt says so
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    record["hook_end"] = time.time()
    _HOOK_RECORD = record


def _process_start_time(pid: int) -> Optional[float]:
    """Epoch seconds the process started (procfs: boot time + start ticks); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_evidence(created_after: float) -> dict[str, Any]:
    """In a Train worker, before the arm runs: how this process was prepared, from its own state. ``how`` is
    ``ray_prestarted_worker`` when the process started before the arm's ``fit()`` (``created_after``), with
    ``hook`` saying when it imported the arm code (None: no hook ran, the arm imports torch itself);
    ``ray_train_worker`` when Ray started it for this arm. ``reused`` would say an earlier arm ran
    here (never seen; Ray ends an actor's process with the actor)."""
    global _CLAIMED_BY
    started = _process_start_time(os.getpid())
    hook = _HOOK_RECORD
    pooled = started is not None and started < created_after  # ran nothing but (maybe) the hook before this arm
    evidence: dict[str, Any] = {"how": "ray_prestarted_worker" if pooled else "ray_train_worker", "pid": os.getpid(),
                                "process_started_at": started, "arm_created_after": created_after,
                                "hook": hook, "reused": _CLAIMED_BY is not None}
    _CLAIMED_BY = created_after
    try:
        import ray

        evidence["runtime_env"] = ray._private.worker.global_worker.core_worker.get_current_runtime_env()
    except Exception:  # noqa: BLE001 - only used to correct the pool's prediction
        pass
    return evidence


def merged_env(parent: str, env_vars: dict[str, str]) -> str:
    """The serialized runtime env Ray gives an actor created with ``runtime_env={"env_vars": env_vars}`` by a
    process whose own runtime env is ``parent``: the parent's verbatim when there is nothing to add, otherwise the
    merge the core worker writes (env vars over the parent's, keys sorted, no spaces)."""
    if not env_vars:
        return parent
    base = json.loads(parent) if parent else {}
    merged = {**base, "env_vars": {**base.get("env_vars", {}), **env_vars}}
    return json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def expected_envs(caller_env: str, controller_env_vars: dict[str, str],
                  worker_env_vars: dict[str, str]) -> tuple[str, str]:
    """(controller's, workers') serialized runtime env for a Train run started from a process whose runtime env is
    ``caller_env``: the controller is created by the caller, the workers by the controller."""
    controller = merged_env(caller_env, controller_env_vars)
    worker = merged_env(controller, worker_env_vars)
    return controller, _LEARNED.get(worker, worker)


def learn(predicted_worker_env: str, evidence: dict[str, Any]) -> None:
    """Keep what a Train worker really carried, so later prestarts use it if the prediction was wrong."""
    actual = evidence.get("runtime_env")
    if actual and actual != predicted_worker_env:
        _LEARNED[predicted_worker_env] = actual


def _raylet_stub() -> tuple[Any, int]:
    """This node's raylet (gRPC, Ray's own channel: token auth included) and its CPU count."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2_grpc

    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    cpus = int((node.get("Resources") or {}).get("CPU", 1))
    return node_manager_pb2_grpc.NodeManagerServiceStub(channel), max(1, cpus)


def _request(stub: Any, serialized_env: str, num_workers: int, keep_alive_s: int) -> None:
    import ray
    from ray.core.generated import common_pb2, node_manager_pb2

    core_worker = ray._private.worker.global_worker.core_worker
    request = node_manager_pb2.PrestartWorkersRequest(language=common_pb2.PYTHON, num_workers=num_workers,
                                                      job_id=core_worker.get_current_job_id().binary(),
                                                      keep_alive_duration_secs=keep_alive_s)
    request.runtime_env_info.CopyFrom(core_worker.get_job_config().runtime_env_info)
    request.runtime_env_info.serialized_runtime_env = serialized_env
    stub.PrestartWorkers(request, timeout=10)


def _registered_pids(stub: Any) -> set[int]:
    from ray.core.generated import node_manager_pb2

    reply = stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(include_memory_info=False), timeout=10)
    return {stats.pid for stats in reply.core_workers_stats}


def prestart(envs: tuple[str, str], num_workers: int, *, arms: int = 1, keep_alive_s: int = KEEP_ALIVE_S,
             batch: Optional[int] = None) -> threading.Thread:
    """Ask this node's raylet for the next ``arms`` arms' processes, from a daemon thread, in batches of ``batch``
    (default: the node's CPUs, Ray's start-up concurrency; the raylet drops what is over it), each sent once the
    previous one's processes registered: the controller's first (``fit()`` needs it at once), then workers and
    controller-env processes alternately (the workers' imports are the long ones; they are needed a few seconds
    into ``fit()``). Failures are ignored: an arm then gets fresh processes, as without a pool, and the workers'
    evidence says so."""
    controller_env, worker_env = envs
    workers, controllers = [worker_env] * num_workers * arms, [controller_env] * CONTROLLER_PROCESSES * arms
    wanted = [env for pair in itertools.zip_longest(controllers, workers) for env in pair if env is not None]

    def run() -> None:
        try:
            stub, cpus = _raylet_stub()
            size = batch or cpus
            known = _registered_pids(stub)
            for index in range(0, len(wanted), size):
                chunk = wanted[index:index + size]
                for env in dict.fromkeys(chunk):
                    _request(stub, env, chunk.count(env), keep_alive_s)
                deadline = time.monotonic() + REGISTER_TIMEOUT_S
                while time.monotonic() < deadline:
                    time.sleep(0.25)
                    now = _registered_pids(stub)
                    if len(now - known) >= len(chunk):
                        break
                known = now
        except Exception:  # noqa: BLE001 - no pool: fresh processes, as before
            pass

    thread = threading.Thread(target=run, name="ablate-ray-prestart", daemon=True)
    thread.start()
    return thread
