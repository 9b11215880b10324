"""Honest resource accounting: what one block needs, what the Ray cluster has, and how many blocks run at once.

How to run me: ``python -m ablate.sweep.resources`` attaches to (or starts) Ray and prints every node's capacity.

Both arms of a block run back to back on the node of its Tune trial, so a block needs *one node* that can hold
one arm (the arms never overlap). The trial driver's own resources count:

- one-worker arms (``executor = subprocess``): the trial holds the arm's CPUs/GPUs itself and the fresh training
  process it starts uses exactly those. Nothing else is requested, so nothing can wait on anything.
- multi-worker arms (``executor = ray_train``): the Train workers request the CPUs/GPUs. The trial requests
  ``{"CPU": 0, DRIVER_CPU: workers * cpus_per_worker[, DRIVER_GPU: ...]}``. ``DRIVER_CPU``/``DRIVER_GPU`` are
  custom resources every node declares equal to its CPUs/GPUs (cluster.yaml does; a local runtime gets them from
  ``local_ray_init_kwargs``). They admit a trial onto a node only when that node's real CPUs/GPUs can hold its
  worker group, so trials spread over nodes and a trial never holds what its own workers need: the 2-CPU
  deadlock in shared/notes/ray-tune-train.md §3a (trial 1 CPU + 2 workers x 1 CPU on 2 CPUs) cannot happen.
  ``{"CPU": 0}`` alone is refused by Ray 2.60 (empty bundle), which the custom resource also avoids.

A campaign that no node can hold fails at once with a ``ResourceError`` naming what a block needs and what
each node has, instead of pending forever.
"""

from __future__ import annotations

import json
import os
import sys
import time
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from ablate.config.schema import ConfigError, Device, LaneConfig, ResourcesConfig
from ablate.sweep.plan import Block

DRIVER_CPU = "ablate_driver_cpu"
"""Custom node resource mirroring the node's CPU count; multi-worker trial drivers hold their arm's share."""
DRIVER_GPU = "ablate_driver_gpu"
"""Custom node resource mirroring the node's GPU count."""
WAIT_ENV = "ABLATE_WAIT_FOR_NODES_S"
"""Seconds to wait for an autoscaling cluster to add a node that fits (default 0: fail at once)."""


class ResourceError(ConfigError):
    """The campaign cannot run on this cluster; the message says what a block needs and what exists."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        self.key, self.value, self.allowed = "resources", None, message


@dataclass(frozen=True)
class BlockNeed:
    workers: int
    cpus_per_worker: int
    gpus_per_worker: int

    @property
    def executor(self) -> str:
        return "subprocess" if self.workers == 1 else "ray_train"

    @property
    def arm_cpus(self) -> int:
        return self.workers * self.cpus_per_worker

    @property
    def arm_gpus(self) -> int:
        return self.workers * self.gpus_per_worker

    def trial_resources(self) -> dict[str, float]:
        """What the Tune trial requests (``tune.with_resources``)."""
        if self.executor == "subprocess":
            wanted = {"CPU": float(self.cpus_per_worker), "GPU": float(self.gpus_per_worker)}
        else:
            wanted = {"CPU": 0.0, DRIVER_CPU: float(self.arm_cpus), DRIVER_GPU: float(self.arm_gpus)}
        return {name: amount for name, amount in wanted.items() if amount > 0 or name == "CPU"}

    def describe(self) -> str:
        gpus = f", {self.arm_gpus} GPU" if self.arm_gpus else ""
        shape = f"{self.workers} worker(s) x {self.cpus_per_worker} CPU" + (
            f" + {self.gpus_per_worker} GPU" if self.gpus_per_worker else "")
        if self.executor == "subprocess":
            driver = "the trial driver holds them and its fresh training process uses them"
        else:
            driver = (f"the trial driver holds 0 CPU plus {self.arm_cpus} {DRIVER_CPU}"
                      + (f" and {self.arm_gpus} {DRIVER_GPU}" if self.arm_gpus else "")
                      + " (the node's arm capacity)")
        return f"one node with {self.arm_cpus} CPU{gpus} for one arm ({shape}; {driver})"


def gpu_resources(lane: LaneConfig, resources: ResourcesConfig, cluster_gpus: float) -> ResourcesConfig:
    """What to ask for when the lane wants CUDA: refuse a GPU-less cluster before any trial starts, unless the
    lane allows a CPU fallback, whose arms then run on CPU and carry HARDWARE_MISMATCH.

    ``device: auto`` on a cluster with GPUs runs on CUDA (``trainers.loop.resolve_device``), so each worker is given
    a GPU of its own: Ray no longer hides the GPUs from a process that reserved none, and arms scheduled on CPUs
    alone would all land on GPU 0 at once, each timing the others' kernels in its CUDA events."""
    if lane.hardware.device is Device.auto:
        if cluster_gpus >= 1 and resources.gpus_per_worker < 1:
            return dataclasses.replace(resources, gpus_per_worker=1)
        return resources
    if lane.hardware.device is not Device.cuda or cluster_gpus >= 1:
        return resources
    if not lane.hardware.cpu_fallback:
        raise ConfigError("lane.hardware.device", "cuda", "auto or cpu: this Ray cluster has no GPUs (or set "
                                                          "lane.hardware.cpu_fallback: true to run on CPU, every "
                                                          "receipt then carries HARDWARE_MISMATCH)")
    return dataclasses.replace(resources, gpus_per_worker=0)


def block_need(blocks: Iterable[Block], resources: ResourcesConfig) -> BlockNeed:
    workers = {arm.lane.engine.workers for block in blocks for arm in block.arms}
    if len(workers) > 1:
        raise ConfigError("lane.engine.workers", sorted(workers), "one worker count for every arm of a campaign")
    return BlockNeed(workers=workers.pop() if workers else 1, cpus_per_worker=resources.cpus_per_worker,
                     gpus_per_worker=resources.gpus_per_worker)


@dataclass
class NodeFit:
    node_id: str
    host: str
    resources: dict[str, float]
    arms: int
    """How many arms (= blocks) this node runs at once."""
    why_not: str = ""

    def describe(self) -> str:
        have = ", ".join(f"{self.resources.get(k, 0):g} {k}" for k in ("CPU", "GPU", DRIVER_CPU, DRIVER_GPU)
                         if k in ("CPU", "GPU") or k in self.resources)
        verdict = f"{self.arms} arm(s) at once" if self.arms else f"none ({self.why_not})"
        return f"node {self.node_id[:8]} ({self.host}): {have} -> {verdict}"


def fit_node(need: BlockNeed, node_id: str, host: str, resources: dict[str, float]) -> NodeFit:
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    fits = [int(cpus // need.arm_cpus)]
    if need.arm_gpus:
        fits.append(int(gpus // need.arm_gpus))
    if need.executor == "ray_train":
        fits.append(int(resources.get(DRIVER_CPU, 0.0) // need.arm_cpus))
        if need.arm_gpus:
            fits.append(int(resources.get(DRIVER_GPU, 0.0) // need.arm_gpus))
    arms = max(0, min(fits))
    why = ""
    if arms == 0:
        if cpus < need.arm_cpus:
            why = f"{cpus:g} CPU < {need.arm_cpus}"
        elif need.arm_gpus and gpus < need.arm_gpus:
            why = f"{gpus:g} GPU < {need.arm_gpus}"
        else:
            cpu_short = resources.get(DRIVER_CPU, 0.0) < need.arm_cpus
            missing, wanted, unit = (DRIVER_CPU, need.arm_cpus, "CPUs") if cpu_short else \
                (DRIVER_GPU, need.arm_gpus, "GPUs")
            declare = json.dumps({DRIVER_CPU: cpus, DRIVER_GPU: gpus})
            why = (f"{missing} {resources.get(missing, 0.0):g} < the arm's {wanted}: declare it equal to the node's "
                   f"{unit}, e.g. ray start --resources='{declare}' (cluster.yaml does)")
    return NodeFit(node_id=node_id, host=host, resources=dict(resources), arms=arms, why_not=why)


@dataclass
class Capacity:
    need: BlockNeed
    nodes: list[NodeFit]
    max_concurrent: int
    """Tune ``max_concurrent_trials``: blocks that run at once."""
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"each block needs {self.need.describe()}", *(f"  {n.describe()}" for n in self.nodes),
                 f"-> {self.max_concurrent} block(s) at once"]
        return "\n".join(lines + self.notes)


def plan_capacity(need: BlockNeed, nodes: list[NodeFit], *, campaign: str, max_concurrent_blocks: int = 0,
                  num_blocks: Optional[int] = None) -> Capacity:
    """Concurrency from per-node fits; a ``ResourceError`` when no node holds an arm."""
    total = sum(node.arms for node in nodes)
    if total == 0:
        have = "\n".join(f"  {node.describe()}" for node in nodes) or "  (no alive nodes)"
        raise ResourceError(
            f"campaign {campaign!r} cannot run on this Ray cluster: each block needs {need.describe()}.\n"
            f"The cluster has {len(nodes)} node(s):\n{have}\n"
            f"Lower lane.engine.workers, resources.cpus_per_worker or resources.gpus_per_worker, or add a node "
            f"that fits (on an autoscaling cluster set {WAIT_ENV} to wait for one).")
    limit = total
    notes = []
    if max_concurrent_blocks:
        # An explicit cap may exceed today's nodes: extra trials wait PENDING while holding nothing, which is
        # what makes an autoscaling cluster add nodes. It can delay blocks but cannot deadlock them.
        limit = max_concurrent_blocks
        notes.append(f"set by resources.max_concurrent_blocks = {max_concurrent_blocks}"
                     + (f" (the nodes now hold {total}; the rest wait for the autoscaler)" if limit > total else ""))
    if num_blocks is not None:
        limit = max(1, min(limit, num_blocks))
    return Capacity(need=need, nodes=nodes, max_concurrent=limit, notes=notes)


def cluster_nodes(need: BlockNeed) -> list[NodeFit]:
    """Alive nodes of the connected Ray cluster, with what each can hold."""
    import ray

    return [fit_node(need, node["NodeID"], node.get("NodeManagerHostname") or node.get("NodeManagerAddress", "?"),
                     dict(node.get("Resources") or {}))
            for node in ray.nodes() if node.get("Alive")]


def check_cluster(need: BlockNeed, *, campaign: str, max_concurrent_blocks: int = 0,
                  num_blocks: Optional[int] = None, wait_s: Optional[float] = None) -> Capacity:
    """Fail fast, or (autoscaling clusters, ``wait_s`` > 0) ask the autoscaler for a node and wait for it."""
    wait_s = float(os.environ.get(WAIT_ENV, "0") or 0) if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    requested = False
    while True:
        nodes = cluster_nodes(need)
        try:
            return plan_capacity(need, nodes, campaign=campaign, max_concurrent_blocks=max_concurrent_blocks,
                                 num_blocks=num_blocks)
        except ResourceError:
            if time.monotonic() >= deadline:
                raise
        if not requested:
            from ray.autoscaler.sdk import request_resources

            bundle = {"CPU": need.arm_cpus, **({"GPU": need.arm_gpus} if need.arm_gpus else {})}
            request_resources(bundles=[bundle])
            requested = True
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))


def detect_local(num_cpus: Optional[int] = None, num_gpus: Optional[int] = None) -> tuple[int, int]:
    """CPUs and GPUs the way Ray itself would detect them on this machine (cgroup limits, CUDA_VISIBLE_DEVICES)."""
    if num_cpus is None:
        from ray._private.utils import get_num_cpus

        num_cpus = int(get_num_cpus())
    if num_gpus is None:
        try:
            from ray._private.accelerators import get_accelerator_manager_for_resource

            manager = get_accelerator_manager_for_resource("GPU")
            visible = manager.get_current_process_visible_accelerator_ids()
            detected = manager.get_current_node_num_accelerators()
            # As Ray counts them (never more than NVML sees), and "-1" hides them all, as for
            # ``ablate.config.auto_device.local_device_class``: a local runtime never offers a GPU no arm can use
            # (found in review: CUDA_VISIBLE_DEVICES=-1 or 0 on a machine without one counted one).
            hidden = visible is not None and [v.strip() for v in visible] in ([], [""], ["-1"])
            num_gpus = 0 if hidden else (min(detected, len(visible)) if visible is not None else detected)
        except Exception:  # noqa: BLE001 - no driver / no NVML: a CPU machine
            num_gpus = 0
    return num_cpus, int(num_gpus)


TRAIN_ENV_DEFAULTS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_worker_niceness": "0"}
"""Train V2's controller advances its state machine once per health-check interval (2 s by default), so a
two-worker arm waited whole intervals before its first step; 0.5 s cut scheduled -> first step from ~16 s to
~13 s on 2 CPUs (benchmarks/bench_runner.py). Ray starts worker processes at niceness 15 unless the runtime
environment says otherwise, and an arm inherits it: measured at low priority, anything else on the node
pre-empts it (trainers/hostload.py). A value the user exported wins."""


def local_ray_init_kwargs(num_cpus: Optional[int] = None, num_gpus: Optional[int] = None) -> dict[str, Any]:
    """``ray.init`` arguments for a local runtime whose driver resources mirror its CPUs/GPUs."""
    cpus, gpus = detect_local(num_cpus, num_gpus)
    resources = {DRIVER_CPU: float(cpus), **({DRIVER_GPU: float(gpus)} if gpus else {})}
    env = {name: os.environ.get(name, value) for name, value in TRAIN_ENV_DEFAULTS.items()}
    return {"num_cpus": cpus, "num_gpus": gpus, "resources": resources, "runtime_env": {"env_vars": env},
            # A copy: Ray writes the session's spill settings into the dict it is given, and a later local start
            # in this process (until-decided rounds, revalidation campaigns) would spill into that old session.
            "_system_config": dict(LOCAL_RAY_SYSTEM_CONFIG)}


LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
"""Ray starts one idle worker process per CPU for the first driver, without the runtime environment any trial runs
under (Tune adds variables to each trial actor's), so none of them ever takes a trial: on 2 CPUs they spent ~1.1 s
of CPU, and two of the node's worker start-up slots, while the first trials' processes waited for theirs."""


@contextmanager
def tune_signal_handlers_restored() -> Iterator[None]:
    """Around ``Tuner.fit``: Tune installs its own SIGINT (and SIGUSR1) handler and puts the previous one back only
    when such a signal arrives (``ray.tune.tune._setup_signal_catching``). After a fit that ended on its own, the
    first Ctrl+C in the rest of the sweep (the summary, the bundle, the next ``--until-decided`` round) only logged
    Tune's "ending Ray Tune run" and set an event nobody waits on: the handlers are put back here."""
    import signal
    import threading

    names = [name for name in ("SIGINT", "SIGUSR1") if hasattr(signal, name)]
    if threading.current_thread() is not threading.main_thread():  # Tune installs none off the main thread
        yield
        return
    before = {name: signal.getsignal(getattr(signal, name)) for name in names}
    try:
        yield
    finally:
        for name, handler in before.items():
            if handler is not None:  # None: a handler not installed from Python, which Python cannot put back
                signal.signal(getattr(signal, name), handler)


@contextmanager
def tune_env_filter() -> Iterator[None]:
    """Around ``Tuner.fit``: Tune copies some driver variables into the runtime env of every trial actor
    (``ray.tune.execution.class_cache.ENV_VARS_TO_PROPAGATE``: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, ``RAY_TRAIN_*``, ...) and Ray's ``runtime_env_agent.log`` prints that runtime env
    verbatim. For the duration the set loses every secret-named variable. ``os.environ`` stays untouched:
    the driver's MLflow writer thread still needs its credentials. Trials on S3/GCS storage find theirs by
    reference (``AWS_PROFILE``, instance profile, ``GOOGLE_APPLICATION_CREDENTIALS``)."""
    from ablate.redact import is_secret_name

    try:
        from ray.tune.execution import class_cache
    except ImportError:  # pragma: no cover - another Ray layout; tests/faults greps Ray's logs for the result
        yield
        return
    names = getattr(class_cache, "ENV_VARS_TO_PROPAGATE", None)
    if not isinstance(names, (set, frozenset)):
        yield
        return
    class_cache.ENV_VARS_TO_PROPAGATE = {name for name in names if not is_secret_name(name)}
    try:
        yield
    finally:
        class_cache.ENV_VARS_TO_PROPAGATE = names


def _main() -> int:
    import ray

    from ablate.redact import process_env_only
    from ablate.sweep.node_wait import prompt_node_wait

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            # Ray's processes inherit the environment: allowlisted variables only.
            with process_env_only(), prompt_node_wait():
                ray.init(**local_ray_init_kwargs())
    for workers in (1, 2):
        need = BlockNeed(workers=workers, cpus_per_worker=1, gpus_per_worker=0)
        print(f"{workers} worker(s) per arm, 1 CPU each:")
        try:
            print(check_cluster(need, campaign="probe", wait_s=0).describe())
        except ResourceError as exc:
            print(exc)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
