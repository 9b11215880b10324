"""``run_arm``: run one arm on a fresh process or a Ray Train worker group and leave its receipt on disk.

How to use (from a Ray Tune trial function, or any driver)::

    from trainers import run_arm
    receipt = run_arm(spec, max_failures=1)          # blocks; the receipt is also at <receipt_dir>/<id>.json

Executors: ``lane.engine.workers == 1`` runs ``trainers.worker`` in a process of its own, forked from the node's
fork server (``trainers.forkserver``: torch and the arm code already imported, nothing run; tens of milliseconds
instead of 2-4 s of imports per arm), or a fresh ``python -m trainers.worker`` when no server can be had; either
way a process that ran nothing before the arm, and the receipt says which (``identity.process``). A process that
dies (SIGKILL, segfault) is relaunched up to ``max_failures`` times. ``workers > 1`` runs a Ray Train
``TorchTrainer`` (gloo on CPU, NCCL on GPU) with ``ray.train.FailureConfig(max_failures)``; on CPU each worker
forks its rank's arm process from its node's fork server, which joins the gloo group itself, so no worker imports
torch (GPU arms train in the workers); rank 0 attaches the result to the final checkpoint, because Train persists
only checkpoint-attached metrics, and every rank reports exactly once. By default the worker group is pinned to
the caller's node (label selector on ``ray.io/node-id`` plus STRICT_PACK), so both arms of a block run on the same
machine.

``run_arm`` never raises for an arm that fails: the receipt says failed and why. A ``receipt_dir`` that refuses
the receipt (full disk, read-only) sends it to a fallback directory (``ablate.receipts.store``); when no
directory at all takes it, an error line says so and the receipt is still returned to the caller.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from ablate.receipts.schema import Receipt
from ablate.receipts.store import ARM_SCRATCH_DIR, ReceiptNotSaved, arm_scratch, write_receipt
from ablate.redact import process_env, process_env_only, redact_text
from trainers.forkserver import ForkServerUnavailable, Prepared, fork_arm
from trainers.provenance import code_fingerprint, git_state, host_name, software_versions
from trainers.pairing import ENV_CPUS as PAIR_CPUS_ENV, ENV_FD as TURN_FD_ENV, TurnCoordinator, cpu_slot
from trainers.receipt import LaunchInfo, build_receipt
from trainers.result import WorkerResult
from trainers.spec import ALLOTTED_CPUS_ENV, ArmSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
WORK_DIR = ARM_SCRATCH_DIR
"""Scratch under receipt_dir (spec, results, attempt markers, local Train storage); removed after the receipt.
The receipt store knows the name, so a leftover scratch dir of an arm that never wrote a receipt is listed."""


def _pythonpath(environ: Optional[Mapping[str, str]] = None) -> str:
    environ = os.environ if environ is None else environ
    parts = [str(REPO_ROOT)] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _private_caches(work: Path, restart: int = 0) -> dict[str, str]:
    """Compile caches of this arm alone, empty at its start: every arm pays its compile cold, as the first run of a
    job on a fresh node does. A cache shared on the node would bill the first arm's compile to it and hand the
    next arms a warm start, so one-time costs would depend on the order blocks happened to run in. A relaunch after
    a dead worker (``restart`` > 0) gets fresh ones too: the dead attempt's kernels would make its compile warm."""
    suffix = f"-restart{restart}" if restart else ""
    return {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-cache{suffix}"),
            "TRITON_CACHE_DIR": str(work / f"triton-cache{suffix}")}


PER_ARM_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", ALLOTTED_CPUS_ENV, PAIR_CPUS_ENV)
"""Variables an arm's launcher sets for that arm alone: its private caches, CPU allotment and pair slot."""
LAUNCHER_ENV_PREFIXES = ("TUNE_", "RAY_")
"""Variables Ray Tune sets in a trial's own process (``TUNE_ORIG_WORKING_DIR``, the driver's working directory), so
a Ray task on the same node has none, and those Ray sets in each of its workers (``RAY_RAYLET_PID``, ``RAY_JOB_ID``:
a driver that starts the node's server before Ray has none). No module the fork server imports reads them: it never
imports ray (``tests/trainers/test_forkserver.py`` checks)."""
LAUNCHER_ENV = ("PYTHONBREAKPOINT",)
"""Ray's workers' ``breakpoint()`` hook: read when ``breakpoint()`` is called, never at import."""


def _split_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(what the node's fork server is started with and keyed by, what only the forked arm gets on top): the arm
    still sees all of ``env``, while every kind of arm, and ``prestart_fork_server`` in a plain Ray task, key the
    same server."""
    per_arm = {name: value for name, value in env.items()
               if name in PER_ARM_ENV or name in LAUNCHER_ENV or name.startswith(LAUNCHER_ENV_PREFIXES)}
    return {name: value for name, value in env.items() if name not in per_arm}, per_arm


def _arm_env(work: Path, environ: Optional[Mapping[str, str]] = None, **extra: str) -> dict[str, str]:
    """A worker process's environment: allowlisted variables only (``ablate.redact.process_env``: no secret-named
    variable, no credentials inside a URI), this checkout on ``PYTHONPATH``, the arm's private caches. The arm's
    receipt records what it saw, so nothing it was never given can leak from it. ``environ``: the launcher's
    environment (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    return {**process_env(environ), "PYTHONPATH": _pythonpath(environ), **_private_caches(work), **extra}


def _worker_argv(spec_path: Path, result_path: Path, attempt: int) -> list[str]:
    return [str(spec_path), str(result_path), str(attempt)]


def _worker_outcome(spec: ArmSpec, launch: LaunchInfo, result_path: Path, log_path: Path, code: Optional[int],
                    attempt: int, timeout_s: Optional[float]) -> Optional[WorkerResult]:
    """The worker's result, or None with ``launch.failure`` saying how the process ended without one."""
    if result_path.exists():
        launch.failure = None
        return WorkerResult.from_json(result_path.read_text())
    how = f"timed out after {timeout_s}s" if code is None else (
        f"killed by signal {-code}" if code < 0 else f"exited with status {code}")
    tail = _tail(log_path)
    # An empty log says nothing of why; on a full disk the traceback itself was lost (the log is on that disk).
    why = _full_disk(result_path.parent) if not tail.strip() else ""
    launch.failure = {"type": "WorkerDied", "category": "exception",
                      "message": f"worker process {how} before writing a result (attempt {attempt}){why}\n{tail}"}
    return None


FULL_BELOW_BYTES = 64 * 1024
"""Free space under which a dead worker's directory counts as full: its writes failed, and so did its log."""


def _full_disk(directory: Path) -> str:
    """``: the disk of <directory> is full (No space left on device)`` when this process could write no more there
    (bytes or inodes; root may use the blocks a filesystem keeps back for it), else empty. In the error's own words:
    the receipt and the sweep's console then name the fault to act on."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return ""
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    blocks, inodes = (stat.f_bfree, stat.f_ffree) if root else (stat.f_bavail, stat.f_favail)
    if blocks * stat.f_frsize >= FULL_BELOW_BYTES and (inodes > 0 or stat.f_files == 0):
        return ""
    return f": the disk of {directory} is full (No space left on device)"


def _worker_env(work: Path, overlay: dict[str, str], environ: Optional[Mapping[str, str]] = None
                ) -> tuple[dict[str, str], dict[str, str]]:
    """(the environment of the fork server an arm forks from, which keys it; the arm's own variables on top):
    together, ``_arm_env(work, environ)`` with ``overlay`` applied."""
    base, own = _split_env(_arm_env(work, environ))
    overlay = {**own, **_private_caches(work), **overlay}
    return {name: value for name, value in base.items() if name not in overlay}, overlay


def _start_worker(argv: list[str], work: Path, log: Any, *, code: Optional[str], fork_server: bool = True,
                  pass_fd: Optional[tuple[str, int]] = None, **overlay: str) -> tuple[Any, dict[str, Any]]:
    """The arm's worker process, ``python -m trainers.worker <argv>``: forked from the node's fork server (imports
    already paid, ``trainers.forkserver``) or, when none can be had, a fresh interpreter. Either way a process
    that ran nothing before this arm. Returns it with how it was prepared (the receipt's ``identity.process``).
    ``overlay``: this arm's own variables, kept out of the server's key so arms share the server."""
    base, overlay = _worker_env(work, overlay)
    reason = "fork_server=False (asked for a fresh interpreter)"
    if fork_server:
        try:
            proc = fork_arm(base, overlay, argv, Path(log.name), code=code, pass_fd=pass_fd)
            return proc, proc.prepared.to_dict()
        except ForkServerUnavailable as exc:
            reason = redact_text(str(exc))[-500:]
            print(f"warning: arm {work.name} runs in a fresh interpreter: {reason}", file=sys.stderr, flush=True)
    env = {**base, **overlay, **({pass_fd[0]: str(pass_fd[1])} if pass_fd else {})}
    proc = subprocess.Popen([sys.executable, "-m", "trainers.worker", *argv], cwd=REPO_ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, pass_fds=(pass_fd[1],) if pass_fd else ())
    return proc, Prepared("fresh_interpreter", fallback_reason=reason).to_dict()


def prestart_fork_server(environ: Optional[Mapping[str, str]] = None, directory: Optional[Path] = None,
                         code: Optional[str] = None) -> str:
    """Start this node's fork server for the arms a sweep is about to run here (``trainers.forkserver.prestart``),
    keyed as ``_start_worker`` keys it from this process's environment; a Ray task on the node gets the environment
    Ray gives the trials there. ``environ``: the trials' environment as far as it keys the server, when this process
    is not one of Ray's (``ablate.sweep.head_start.start_local_fork_server``, which then reads nothing else of
    ``os.environ`` here); ``directory`` (the servers' directory) and ``code`` (``code_fingerprint``), found
    beforehand. Never raises: what happened, in a line (the sweep logs it at debug level); an arm that then finds no
    server starts one itself, as before."""
    from trainers.forkserver import prestart, server_key

    try:
        base, _ = _worker_env(REPO_ROOT, {}, environ)  # the arms' own key; the work directory only names their caches
        code = code or code_fingerprint(REPO_ROOT)
        started = prestart(base, code, directory)
        return f"{host_name()}: fork server {server_key(base, code)} {'started' if started else 'already listening'}"
    except Exception as exc:  # noqa: BLE001 - a head start only: the first arm starts the server, or falls back
        return redact_text(f"{host_name()}: fork server not started ahead of the arms: {type(exc).__name__}: {exc}",
                           environ)


def _wait(proc: Any, timeout_s: Optional[float]) -> Optional[int]:
    """The process's exit status, or None after killing it at ``timeout_s``."""
    try:
        return int(proc.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _allotment(cpus: Optional[float]) -> dict[str, str]:
    """The arm's ``ALLOTTED_CPUS_ENV`` overlay: the CPUs the campaign gives each worker (none: no cap)."""
    return {ALLOTTED_CPUS_ENV: str(max(1, int(cpus)))} if cpus else {}


def _run_subprocess(spec: ArmSpec, work: Path, max_failures: int, timeout_s: Optional[float],
                    launch: LaunchInfo, fork_server: bool = True,
                    allotted_cpus: Optional[float] = None) -> Optional[WorkerResult]:
    spec_path = work / "spec.json"
    spec_path.write_text(spec.to_json())
    result: Optional[WorkerResult] = None
    for index in range(max_failures + 1):
        result_path = work / f"result-{index}.state"
        log_path = work / f"worker-{index}.log"
        launch.attempt_start = time.time() if index else None
        launch.restarts = index
        with log_path.open("w") as log:
            proc, launch.process = _start_worker(_worker_argv(spec_path, result_path, spec.attempt + index), work,
                                                 log, code=launch.code_fingerprint, fork_server=fork_server,
                                                 **_private_caches(work, restart=index), **_allotment(allotted_cpus))
            code = _wait(proc, timeout_s)
        result = _worker_outcome(spec, launch, result_path, log_path, code, spec.attempt + index, timeout_s)
        if result is not None:
            return result
    return None


def _claim_attempt(work: Path) -> int:
    """Rank 0 claims the next attempt number with an exclusive create (Train restarts the whole group)."""
    for number in itertools.count():
        try:
            os.close(os.open(work / f"attempt-{number}.state", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return number
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _group_attempt(work: Path, rank: int) -> int:
    """This worker group's attempt within the arm, the same on every rank: rank 0 claims it (its claims are the
    arm's restart count) and Train V2 broadcasts it (``_fit_arm``'s ``worker_runtime_env`` is V2's: arms need it)."""
    from ray.train.collective import broadcast_from_rank_zero

    return int(broadcast_from_rank_zero(_claim_attempt(work) if rank == 0 else None))


def _report(rank: int, work: Path, result: WorkerResult) -> None:
    """Every rank reports once, after its arm ended; rank 0 attaches the arm's result to the final checkpoint
    (Train persists only checkpoint-attached metrics). The report's own time is billed as checkpoint badput."""
    import ray.train

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            (Path(tmp) / "result.json").write_text(result.to_json())
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"status": "failed" if result.error else "done", "attempt": result.attempt},
                         checkpoint=checkpoint)
    if rank == 0:
        (work / f"report-{result.attempt}.state").write_text(json.dumps(time.perf_counter() - start))


class ArmProcessDied(RuntimeError):
    """A rank's arm process ended without a result: the arm failed on that rank (its log's end says why)."""


def _train_loop_in_arm_process(config: dict[str, Any]) -> None:
    """Ray Train worker function of a CPU arm (``ArmTorchConfig.arm_process``): this rank's arm runs in a process
    forked from the node's fork server (torch and the arm code imported once, nothing run; ``trainers.forkserver``),
    which joins the arm's gloo group itself (``trainers.worker``). This worker never imports torch: it launches that
    process, waits for it and reports its result. The process dies with this worker (it watches this worker's pid,
    ``trainers.worker._die_with_launcher``; a forked one is also killed by its server when this worker's connection
    closes), so Train's restart of a group leaves no rank of the old one behind."""
    from trainers.hostload import reset_priority

    reset_priority()  # the fork server this worker may start inherits its niceness
    import ray
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    from trainers.result import WorkerContext
    from trainers.train_backend import ARM_PROCESS_ENV, free_port

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    work = Path(config["work_dir"])
    # One broadcast carries the group's attempt, the rendezvous port, picked here rather than in the backend's
    # on_start (rank 0's arm process binds it a fork later, not after the whole train-function start-up), and the
    # prefix of the group's keys in its store (``trainers.worker._join_group``).
    restarts, port, group = broadcast_from_rank_zero(
        (_claim_attempt(work), free_port(), uuid.uuid4().hex) if rank == 0 else None)
    os.environ["MASTER_PORT"] = str(port)
    spec = ArmSpec.from_json(config["spec"])
    wctx = WorkerContext(rank=rank, world_size=ctx.get_world_size(), local_rank=ctx.get_local_rank(),
                         local_world_size=ctx.get_local_world_size(), attempt=spec.attempt + restarts,
                         executor="ray_train", work_dir=str(work), node_id=ray.get_runtime_context().get_node_id())
    stem = f"rank{rank}-{wctx.attempt}"
    spec_path, rank_path = work / f"{stem}.spec.json", work / f"{stem}.rank.json"
    result_path, log_path = work / f"{stem}.result.state", work / f"{stem}.log"
    spec_path.write_text(config["spec"])
    rank_path.write_text(json.dumps({"context": dataclasses.asdict(wctx), "backend": "gloo", "group": group,
                                     "timeout_s": config["timeout_s"], "launcher_pid": os.getpid()}))
    # This attempt's compile caches and the variables the group forms from are the rank's own: they stay out of
    # the fork server's key, so every rank of every arm shares the node's server.
    overlay = {**_private_caches(work, restart=restarts),
               **{name: os.environ[name] for name in ARM_PROCESS_ENV if name in os.environ}}
    with log_path.open("w") as log:
        proc, prepared = _start_worker([*_worker_argv(spec_path, result_path, wctx.attempt), str(rank_path)], work,
                                       log, code=config["code"], fork_server=config.get("fork_server", True),
                                       **overlay)
        (work / f"process-{wctx.attempt}-rank{rank}.state").write_text(json.dumps(prepared))
        code = _wait(proc, None)
    if not result_path.exists():
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        raise ArmProcessDied(redact_text(f"rank {rank}'s arm process (pid {proc.pid}) {how} without a result; its log "
                                         f"ends:\n{_tail(log_path, 2000)}"))
    _report(rank, work, WorkerResult.from_json(result_path.read_text()))


def _train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker function: one arm on this rank; rank 0 attaches the result to the final checkpoint."""
    if config.get("arm_process"):
        _train_loop_in_arm_process(config)
        return
    from trainers.hostload import reset_priority

    reset_priority()
    import ray
    import ray.train
    import torch

    from trainers.host_malloc import apply as apply_host_allocator
    from trainers.loop import run_worker
    from trainers.result import WorkerContext

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    work = Path(config["work_dir"])
    restarts = _group_attempt(work, rank)
    # Compile caches of this worker group's attempt, set before anything compiles (Inductor and Triton read the
    # variables when they first compile): a group Train restarts inside the arm compiles cold again, as a
    # relaunched one-worker arm does, and every arm's worker runtime env is the same.
    os.environ.update(_private_caches(work, restart=restarts))
    spec = ArmSpec.from_json(config["spec"])
    apply_host_allocator(spec.host_allocator)
    cuda_index = None
    if torch.cuda.is_available():
        import ray.train.torch

        cuda_index = ray.train.torch.get_device().index
    wctx = WorkerContext(rank=rank, world_size=ctx.get_world_size(), local_rank=ctx.get_local_rank(),
                         local_world_size=ctx.get_local_world_size(), attempt=spec.attempt + restarts,
                         executor="ray_train", work_dir=str(work), cuda_index=cuda_index,
                         node_id=ray.get_runtime_context().get_node_id())

    run_worker(spec, wctx, lambda result: _report(rank, work, result))


TRAIN_ENV_DEFAULTS: dict[str, str] = {
    # The controller steps its state machine once per poll of its workers, every 2 s by default: an arm waited
    # whole intervals to start and up to one more before fit() returned. A timed-out poll is kept and awaited again
    # (hang detection is RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, 10 min), so a short interval costs only a few
    # tiny actor calls per second. Same value as ablate's local runtimes (ablate.sweep.resources), whose runtime
    # env sets it for trial processes already; this default covers run_arm called from anywhere else.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # The preemption watcher is one more actor process per worker group (python + ray + its imports), started just
    # as the workers import torch. A drained node still fails the arm and the sweep retries its block; what is lost
    # is only Train's grace window for a drain with a deadline.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Prometheus gauges of the controller and workers; receipts carry their own timings.
    "RAY_TRAIN_METRICS_ENABLED": "0",
}
"""Ray Train settings for an arm's Train run, read from the launching process's environment when ``fit()`` starts
(Train propagates them to its controller and workers). A value already set there wins. The workers' environment
holds them too, so every receipt records what its arm ran with (``RAY_TRAIN_*`` is allowlisted)."""


@contextlib.contextmanager
def _train_env() -> Iterator[dict[str, str]]:
    """``TRAIN_ENV_DEFAULTS`` in this process's environment while an arm's trainer is built and fitted, restored
    after, so one-worker arms launched later from this process do not inherit them. Yields the values in force."""
    added = [name for name in TRAIN_ENV_DEFAULTS if name not in os.environ]
    for name in added:
        os.environ[name] = TRAIN_ENV_DEFAULTS[name]
    try:
        yield {name: os.environ[name] for name in TRAIN_ENV_DEFAULTS}
    finally:
        for name in added:
            os.environ.pop(name, None)


@functools.cache
def _trainer_class() -> type:
    """``TorchTrainer`` without two of Train 2.60's default callbacks where they would only cost an actor process
    (python, Ray and its imports, started just as the two workers import torch: seconds of CPU on a 2-core node):
    - the Ray Data callback when the arm passes no datasets (arms read their own token files): its
      ``DatasetManager`` actor is never called;
    - the placement-group cleaner when the cluster serves no State API (``state_api_served``; the embedded default
      runs Ray without a dashboard): the cleaner watches the controller through that API, so there it only logs
      that the API is unavailable, once a second, and the controller waits for it to start before its workers run
      (measured: median 14.87 -> 13.14 s to the first step, 17.58 -> 14.84 s an arm, benchmarks/results/
      train_start.json). Where the API answers (a cluster started with its dashboard, as ``ray job submit`` needs)
      the cleaner stays: it removes the arm's placement group if the controller dies."""
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:  # another Ray layout: keep Train's callbacks as they are
        return TorchTrainer

    class ArmTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            unused: tuple[type, ...] = () if getattr(self, "datasets", None) else (DatasetsCallback,)
            if not state_api_served():
                unused += (PlacementGroupCleanerCallback,)
            return [callback for callback in super()._create_default_callbacks()
                    if not isinstance(callback, unused)]

    return ArmTrainer


def state_api_served(timeout_s: float = 2.0) -> bool:
    """Whether Ray's State API (the dashboard's HTTP server) answers for the cluster this process is connected to.
    False only when nothing listens at its address: Ray records that address even when it starts no dashboard. Any
    answer (an HTTP error included) or a slow one counts as served, so an unsure probe keeps Train's defaults."""
    import urllib.error
    import urllib.request

    from ray._private import ray_constants
    from ray.experimental import internal_kv

    address = os.environ.get(ray_constants.RAY_API_SERVER_ADDRESS_ENVIRONMENT_VARIABLE, "").strip()
    if not address:
        try:
            raw = internal_kv._internal_kv_get(ray_constants.DASHBOARD_ADDRESS,
                                               namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
        except Exception:  # noqa: BLE001 - not connected, or another Ray: cannot tell
            return True
        if not raw:
            return False
        address = raw.decode()
    url = address if "://" in address else f"http://{address}"
    try:
        urllib.request.urlopen(f"{url.rstrip('/')}/api/version", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return True
    except urllib.error.URLError as exc:  # urlopen wraps a refused connection in one
        return not isinstance(exc.reason, ConnectionRefusedError)
    except (OSError, ValueError):  # a timeout, an address urllib cannot use: cannot tell
        return True
    return True


def _run_ray_train(spec: ArmSpec, work: Path, max_failures: int, launch: LaunchInfo, node_id: Optional[str],
                   use_gpu: Optional[bool], resources_per_worker: Optional[dict[str, float]],
                   storage_path: Optional[str], fork_server: bool = True) -> Optional[WorkerResult]:
    import ray

    if not ray.is_initialized():
        with process_env_only():  # a local runtime's processes inherit the environment: allowlisted variables only
            ray.init(runtime_env={"env_vars": {"PYTHONPATH": _pythonpath()}})
    lane = spec.lane
    if use_gpu is None:
        use_gpu = lane.hardware.device.value != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    # Ray starts workers at niceness 15 by default; an arm measured at low priority is pre-empted by anything.
    # No per-arm value here (the compile caches are set per attempt in the train function): every arm's workers
    # get the same runtime env.
    env_vars = {"PYTHONPATH": _pythonpath(), "RAY_worker_niceness": "0"}
    if not use_gpu:
        env_vars["DS_ACCELERATOR"] = "cpu"
    scaling: dict[str, Any] = {"num_workers": lane.engine.workers, "use_gpu": use_gpu}
    if resources_per_worker is not None:
        scaling["resources_per_worker"] = resources_per_worker
    if node_id is not None:
        # Both arms of a block must share a node: select it by Ray's node-id label and keep the group together.
        scaling["label_selector"] = {ray._raylet.RAY_NODE_ID_KEY: node_id}
        scaling["placement_strategy"] = "STRICT_PACK"
    if node_id is not None:
        launch.node_id = node_id
    # A group not pinned to a node can still span only one when the cluster has one (a local runtime).
    one_node = node_id is not None or sum(1 for node in ray.nodes() if node.get("Alive")) <= 1
    with _train_env() as train_env:
        env_vars.update(train_env)
        result = _fit_arm(spec, work, max_failures, launch, use_gpu, scaling, env_vars, storage_path,
                          fork_server=fork_server, one_node=one_node)
    return _collect_arm(work, spec, launch, result)


def _collect_arm(work: Path, spec: ArmSpec, launch: LaunchInfo,
                 result: Optional[WorkerResult]) -> Optional[WorkerResult]:
    """After the fit: the result (or, when it failed, rank 0's latest partial measurements), and in ``launch``
    the restarts, the checkpoint report's time and how the processes of the result's own attempt were prepared."""
    attempts = sorted(work.glob("attempt-*.state"))
    launch.restarts = max(0, len(attempts) - 1)
    if result is None:
        # A failed multi-worker attempt leaves rank 0's partial measurements; keep the latest one.
        partials = sorted(work.glob("partial-*.state"), key=lambda p: int(p.stem.split("-")[1]))
        if partials:
            result = WorkerResult.from_json(partials[-1].read_text())
    # The processes of the attempt the measurements come from (a partial may be an earlier attempt's).
    ranks_process = _ranks_process(work, result.attempt if result is not None else launch.restarts + spec.attempt)
    if ranks_process is not None:
        launch.process = ranks_process
    if result is not None:
        report = work / f"report-{result.attempt}.state"
        if report.exists():
            launch.extra_checkpoint_s = float(json.loads(report.read_text()))
        if result.error is None and launch.failure is not None:
            result.error = launch.failure
    return result


def _ranks_process(work: Path, attempt: int) -> Optional[dict[str, Any]]:
    """How a CPU arm's rank processes of ``attempt`` were prepared (each rank wrote its own record), for the
    receipt: rank 0's when every rank was forked, else the first rank that fell back to a fresh interpreter (its
    imports ran on the whole group's clock: rank 0 waits for it to join). None when no rank was launched."""
    records = sorted(work.glob(f"process-{attempt}-rank*.state"),
                     key=lambda path: int(path.stem.rpartition("rank")[2]))
    prepared = []
    for path in records:
        try:
            prepared.append((path.stem.rpartition("rank")[2], json.loads(path.read_text())))
        except (OSError, ValueError):  # cut short by a kill mid-write: that rank's record is missing, not the arm's
            continue
    fallback = next(((rank, record) for rank, record in prepared if record.get("how") != "fork_server"), None)
    if fallback is not None:
        rank, record = fallback
        return {**record, "fallback_reason": f"rank {rank}: {record.get('fallback_reason')}"}
    return prepared[0][1] if prepared else None


def _backend_config(use_gpu: bool, one_node: bool = True) -> Any:
    """The workers' torch process group while Train's controller stays free of torch (``trainers.train_backend``):
    on GPU NCCL, set up by Ray's own torch code on the workers; on CPU gloo, formed by each rank's arm process
    (``arm_process``), so the workers stay free of torch too. That needs the arm's scratch directory on every
    rank's node, where its rank files go: only a group on one node (``one_node``; every sweep pins its arms to the
    trial's node) has it for sure, so a group free to span nodes trains in its workers. ``TorchTrainer`` takes it
    in the place of its ``TorchConfig``, whose ``backend`` it only reads. Under Train V1, or a Ray without V2's
    layout, Ray's ``TorchConfig`` itself (the arm then trains in the worker): that backend is written for V2's
    order of calls."""
    backend = "nccl" if use_gpu else "gloo"
    try:
        from ray.train.v2._internal.constants import is_v2_enabled

        from trainers.train_backend import ArmTorchConfig
    except ImportError:
        is_v2_enabled = None  # type: ignore[assignment]
    if is_v2_enabled is not None and is_v2_enabled():
        return ArmTorchConfig(backend=backend, arm_process=not use_gpu and one_node)
    from ray.train.torch import TorchConfig

    return TorchConfig(backend=backend)


def _fit_arm(spec: ArmSpec, work: Path, max_failures: int, launch: LaunchInfo, use_gpu: bool,
             scaling: dict[str, Any], env_vars: dict[str, str], storage_path: Optional[str], *,
             fork_server: bool = True, one_node: bool = True) -> Optional[WorkerResult]:
    """Build and fit the arm's trainer; the result rank 0 attached to the final checkpoint, or None."""
    import ray.train

    backend = _backend_config(use_gpu, one_node)
    trainer = _trainer_class()(
        _train_loop_per_worker,
        train_loop_config={"spec": spec.to_json(), "work_dir": str(work), "code": launch.code_fingerprint,
                           "arm_process": getattr(backend, "arm_process", False), "fork_server": fork_server,
                           "timeout_s": getattr(backend, "timeout_s", None)},
        scaling_config=ray.train.ScalingConfig(**scaling),
        torch_config=backend,
        # A fresh run name per call: a reused name would make Train resume a stale run and hand back its checkpoint.
        run_config=ray.train.RunConfig(name=f"arm-{spec.receipt_id}-{uuid.uuid4().hex[:8]}",
                                       storage_path=storage_path or str(work / "ray"),
                                       failure_config=ray.train.FailureConfig(max_failures=max_failures),
                                       worker_runtime_env={"env_vars": env_vars}),
    )
    result: Optional[WorkerResult] = None
    try:
        fit = trainer.fit()
        if fit.checkpoint is not None:
            with fit.checkpoint.as_directory() as directory:
                result = WorkerResult.from_json((Path(directory) / "result.json").read_text())
    except Exception as exc:  # noqa: BLE001 - WorkerGroupError / TrainingFailedError: the arm failed
        launch.failure = {"type": type(exc).__name__, "category": "exception",
                          "message": redact_text(str(exc))[-3000:]}
    return result


def _caller_node_id() -> Optional[str]:
    """The Ray node this call runs on, when Ray is already up here (a Tune trial); never starts Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _with_absolute_paths(spec: ArmSpec) -> ArmSpec:
    """Workers run in other directories (Ray Train chdirs): resolve a relative data path against the caller's cwd.

    Only the executed copy changes; the receipt keeps the lane as requested, so config hashes stay portable.
    """
    path = spec.lane.data.path
    if not path or Path(path).expanduser().is_absolute():
        return spec
    lane = copy.deepcopy(spec.lane)
    lane.data.path = str(Path.cwd() / path)
    return dataclasses.replace(spec, lane=lane)


def _code_state() -> tuple[Optional[str], Optional[bool], Optional[str]]:
    """(HEAD sha, dirty, code fingerprint) of the checkout the arms run from: four git calls and ~30 file reads."""
    sha, dirty = git_state(REPO_ROOT)
    try:
        code = code_fingerprint(REPO_ROOT)
    except (OSError, ValueError):
        code = None  # an installed copy without kernels/ and trainers/ beside it: recorded as unknown
    return sha, dirty, code


def _prepare(spec: ArmSpec, executor: str, run_start: float,
             code_state: Optional[tuple[Optional[str], Optional[bool], Optional[str]]] = None
             ) -> tuple[ArmSpec, Path, LaunchInfo]:
    """``code_state``: ``_code_state()`` read once for arms launched together from one checkout (a pair)."""
    spec = dataclasses.replace(spec, receipt_id=spec.receipt_id or uuid.uuid4().hex)
    assert spec.receipt_id is not None
    work = arm_scratch(spec.receipt_dir, spec.receipt_id)  # elsewhere when receipt_dir is read-only
    sha, dirty, code = _code_state() if code_state is None else code_state
    launch = LaunchInfo(executor=executor, run_start=run_start, end=run_start, git_sha=sha, git_dirty=dirty,
                        host=host_name(), node_id=_caller_node_id(), code_fingerprint=code)
    return spec, work, launch


def _finish(spec: ArmSpec, work: Path, launch: LaunchInfo, result: Optional[WorkerResult]) -> Receipt:
    """Build, write and return the receipt; scratch goes. A result we cannot read still leaves a receipt."""
    if result is None and launch.failure is None:
        launch.failure = {"type": "NoResult", "category": "exception", "message": "the worker returned no result"}
    if result is None:
        launch.software = software_versions()
    try:
        receipt = build_receipt(spec, result, launch)
    except Exception as exc:  # noqa: BLE001 - a result we cannot read is still an arm that left a receipt
        launch.failure = {"type": type(exc).__name__, "category": "exception",
                          "message": redact_text(f"receipt assembly failed: {exc}\n{traceback.format_exc(limit=6)}")}
        launch.software = launch.software or software_versions()
        receipt = build_receipt(spec, None, launch)
    try:
        write_receipt(receipt, spec.receipt_dir)  # or a fallback directory, named in an error line
    except ReceiptNotSaved as exc:  # no disk took it: the caller (the sweep driver) still gets it, and says so
        print(f"error: {exc}", file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.parent.rmdir()  # only when no other arm is using the scratch root
    except OSError:
        pass
    return receipt


def run_arm(spec: ArmSpec, *, max_failures: int = 0, node_id: Optional[str] = "current",
            use_gpu: Optional[bool] = None, resources_per_worker: Optional[dict[str, float]] = None,
            storage_path: Optional[str] = None, timeout_s: Optional[float] = None,
            fork_server: bool = True) -> Receipt:
    """Run one arm and return its receipt, also written atomically to ``spec.receipt_dir``.

    Args:
        spec: the arm; ``spec.scheduled_at`` (the orchestrator's stamp) starts its wall clock.
        max_failures: relaunches of a dead worker process / Ray Train worker-group restarts.
        node_id: Ray node to pin a multi-worker arm to; "current" (default) = the caller's node, None = anywhere.
        use_gpu: Ray Train ``use_gpu``; None = when the lane allows CUDA and the cluster has GPUs.
        resources_per_worker: Ray Train ``resources_per_worker`` (e.g. ``{"CPU": 2}``).
        storage_path: Ray Train storage (shared S3/GCS/NFS on multi-node); default a scratch dir per arm.
        timeout_s: wall limit of a one-worker arm's process (per attempt).
        fork_server: fork a one-worker arm's process, or each rank's of a multi-worker CPU arm, from the node's
            fork server (``trainers.forkserver``); False starts a fresh interpreter (imports on the arm's clock), as
            a fallback does.
    """
    executor = "subprocess" if spec.lane.engine.workers == 1 else "ray_train"
    spec, work, launch = _prepare(spec, executor, time.time())
    worker_spec = _with_absolute_paths(spec)
    result: Optional[WorkerResult] = None
    try:
        if executor == "subprocess":
            result = _run_subprocess(worker_spec, work, max_failures, timeout_s, launch, fork_server,
                                     (resources_per_worker or {}).get("CPU"))
        else:
            launch.process = Prepared("ray_train_worker").to_dict()
            if node_id == "current":
                node_id = _caller_node_id()
            result = _run_ray_train(worker_spec, work, max_failures, launch, node_id, use_gpu,
                                    resources_per_worker, storage_path, fork_server=fork_server)
    except Exception as exc:  # noqa: BLE001 - an executor bug still ends in a failed receipt
        launch.failure = {"type": type(exc).__name__, "category": "exception",
                          "message": redact_text(f"{exc}\n{traceback.format_exc(limit=6)}")[-3000:]}
    launch.end = time.time()
    return _finish(spec, work, launch, result)


def _turns_on_cpu(spec: ArmSpec) -> tuple[int, int]:
    """(explicit warmup steps, budget steps) the arm will take turns for on CPU, as the trainer resolves them."""
    from ablate.config.pattern import parse_pattern
    from ablate.config.warmup import resolve_warmup  # torch-free: the trial that calls this has no use for torch

    lane = spec.lane
    warmup = resolve_warmup(lane.compile.warmup, "cpu", lane.compile.posture.value, parse_pattern(lane.model.pattern),
                            lane.compile.warmup_steps)
    return warmup.steps, lane.budget.steps


def can_interleave(specs: tuple[ArmSpec, ArmSpec], node_has_gpu: bool) -> bool:
    """Interleaving needs two one-worker arms that will run on CPU: a Ray Train group cannot take turns, and on
    CUDA a turn boundary would have to synchronise the device every step (the receipt design syncs at phase
    boundaries only). ``device: auto`` runs on CPU where the cluster has no GPU.

    And as many turns on both sides: the arm with more (``compile.warmup: skip`` against ``explicit``) took its
    last steps alone, after its partner had ended, and counted them steady (found in review: ~10% faster than
    its turns beside the partner, the first one or two twice as slow beside the partner's exit). Such a block
    runs its arms one after the other."""
    def on_cpu(spec: ArmSpec) -> bool:
        device = spec.lane.hardware.device.value
        return device == "cpu" or (device == "auto" and not node_has_gpu)

    if not all(s.lane.engine.workers == 1 and on_cpu(s) for s in specs):
        return False
    return _turns_on_cpu(specs[0]) == _turns_on_cpu(specs[1])


def run_pair(specs: tuple[ArmSpec, ArmSpec], *, timeout_s: Optional[float] = None,
             cpus: Optional[int] = None, fork_server: bool = True) -> tuple[Receipt, Receipt]:
    """Both arms of an interleaved block, in run order: two fresh worker processes start together (start-up
    overlaps and is never compared), then take turns for setup and every step, ``specs[0]`` first
    (``trainers.pairing``). Each arm still gets its own process, receipt and wall clock.

    No relaunch of a dead worker here: its partner's turns would no longer be interleaved, so the arm fails and
    the sweep retries the whole block as its next attempt.
    """
    count = cpus or max(1, specs[0].lane.hardware.threads)
    with cpu_slot(count) as slot:
        return _run_pair(specs, timeout_s, slot, fork_server, count)


def _run_pair(specs: tuple[ArmSpec, ArmSpec], timeout_s: Optional[float],
              slot: Optional[list[int]], fork_server: bool, count: int) -> tuple[Receipt, Receipt]:
    coordinator = TurnCoordinator(first=0)
    run_start = time.time()
    # One read of the checkout for both: they start from it at the same instant, and each read is four git
    # subprocesses on a node whose other slots are measuring steps.
    code_state = _code_state()
    prepared = [_prepare(spec, "subprocess", run_start, code_state) for spec in specs]
    procs: list[Any] = []
    paths: list[tuple[Path, Path]] = []
    ended = [run_start, run_start]
    try:
        for (spec, work, launch), fd in zip(prepared, coordinator.child_fds()):
            spec_path = work / "spec.json"
            spec_path.write_text(_with_absolute_paths(spec).to_json())
            result_path, log_path = work / "result-0.state", work / "worker-0.log"
            paths.append((result_path, log_path))
            # Pinned to the slot or not (no free CPUs left), the arm is sized for the slot it asked for.
            cpus = {PAIR_CPUS_ENV: ",".join(str(c) for c in slot)} if slot is not None else {}
            cpus.update(_allotment(count))
            with log_path.open("w") as log:
                proc, launch.process = _start_worker(_worker_argv(spec_path, result_path, spec.attempt), work, log,
                                                     code=launch.code_fingerprint, fork_server=fork_server,
                                                     pass_fd=(TURN_FD_ENV, fd), **cpus)
                procs.append(proc)
        coordinator.start()
        codes: list[Optional[int]] = [None, None]

        def wait(index: int) -> None:
            codes[index] = _wait(procs[index], timeout_s)
            ended[index] = time.time()

        waiters = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(procs))]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        coordinator.close()
    receipts = []
    for index, (spec, work, launch) in enumerate(prepared):
        launch.end = ended[index]
        result = (_worker_outcome(spec, launch, *paths[index], codes[index], spec.attempt, timeout_s)
                  if index < len(paths) else None)
        receipts.append(_finish(spec, work, launch, result))
    return receipts[0], receipts[1]
