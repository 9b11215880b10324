"""The torch process-group backend of a multi-worker (Ray Train) arm, importable without torch.

How to use: ``TorchTrainer(fn, torch_config=ArmTorchConfig(backend="gloo"), ...)`` in the place of Ray's
``TorchConfig(backend="gloo")`` (``TorchTrainer`` only reads its ``backend``); ``trainers.run._backend_config``
picks it under Train V2.

Why not ``TorchConfig``: Train pickles the backend config into its controller actor (the backend and accelerator
set-up callbacks hold it). ``ray.train.torch.config`` imports
torch at module level, and the ``ray.train.torch`` package around it imports more: unpickling it costs a fresh
controller process about 5 s of CPU on a 2-core host (``python -c "import ray.train.torch"``: 5.2 s, against
1.8 s for the controller's own modules), before it can even ask for the worker group. The controller never runs
torch: it only tells the workers what to call. Here the controller side imports nothing of torch, and every call
it sends runs Ray's own torch set-up *on the workers* (``_setup_torch_process_group``,
``_set_torch_distributed_env_vars``, ``_shutdown_torch``, ``TorchConfigContextManager``), which import torch
anyway to train. So the process group, its environment variables (MASTER_ADDR/PORT, RANK, LOCAL_RANK, ...),
the CUDA device of each worker and the shutdown are Ray's, step for step as ``_TorchBackend`` orders them for
Train V2; only the modules the controller loads change (``tests/trainers/test_train_start.py``). The process that
builds the trainer still imports torch (``TorchTrainer`` lives in ``ray.train.torch``), once per trial process.

With ``arm_process=True`` (CPU arms) the workers stay free of torch as well: each worker only launches its rank's
arm in a process forked from the node's fork server (``trainers.run``), which imported torch and the arm code once
per sweep, and that process sets up the gloo group itself (``trainers.worker``). Here the backend then sets only
what the group needs to find itself (MASTER_ADDR/PORT and the torch launcher variables, the same values Ray's
``_set_torch_distributed_env_vars`` gives; the train function picks the port again just before the fork): a
worker skips importing ``ray.train.torch`` and torch (~2 s of CPU per worker on a 2-core host, both workers at
once) and the arm skips its own imports (~2 s more). GPU arms keep Ray's set-up in the worker (its per-worker
CUDA device handling has not run forked on a GPU here).

Train V2 only: V1 sets the torch variables in ``on_training_start``, once its session exists, which this backend
does not do, so ``trainers.run._backend_config`` hands V1 (``RAY_TRAIN_V2_ENABLED=0``) Ray's ``TorchConfig``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

log = logging.getLogger(__name__)


def _address_and_port() -> tuple[str, int]:
    from ray.train._internal.utils import get_address_and_port

    return get_address_and_port()


def free_port() -> int:
    """A port free on this node now (bound and released, as Ray's own set-up picks the group's)."""
    return _address_and_port()[1]


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_distributed_env() -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


ARM_PROCESS_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "RANK", "WORLD_SIZE",
                   "ACCELERATE_TORCH_DEVICE")
"""What a worker hands its rank's arm process so the process group can form (``init_method="env://"``)."""


def _set_arm_process_env() -> None:
    """``_set_torch_distributed_env_vars`` without torch, for a CPU worker whose arm runs in a forked process."""
    import ray.train

    context = ray.train.get_context()
    os.environ["LOCAL_RANK"] = str(context.get_local_rank())
    os.environ["LOCAL_WORLD_SIZE"] = str(context.get_local_world_size())
    os.environ["NODE_RANK"] = str(context.get_node_rank())
    os.environ["RANK"] = str(context.get_world_rank())
    os.environ["WORLD_SIZE"] = str(context.get_world_size())
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"


def _setup_process_group(**kwargs: Any) -> None:
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(**kwargs)


def _shutdown(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


class WorkerDeviceContext:
    """Ray's ``TorchConfigContextManager`` (each worker's train function runs on its own CUDA device), entered on
    the worker: the class that names it here is what gets pickled."""

    def __enter__(self) -> Any:
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)


class ArmTorchBackend(Backend):
    """``ray.train.torch.config._TorchBackend`` for ``init_method="env"`` on CPU and CUDA (what arms use)."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: "ArmTorchConfig") -> None:
        addr, port = worker_group.execute_single(0, _address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        if backend_config.arm_process:
            worker_group.execute(_set_arm_process_env)
            return
        worker_group.execute(_set_distributed_env)
        ray.get([worker_group.execute_single_async(rank, _setup_process_group, backend=backend_config.backend,
                                                   world_rank=rank, world_size=len(worker_group),
                                                   init_method="env://", timeout_s=backend_config.timeout_s)
                 for rank in range(len(worker_group))])

    def on_shutdown(self, worker_group: Any, backend_config: "ArmTorchConfig") -> None:
        if backend_config.arm_process:  # the group lived and died with the arm's processes
            return
        from ray.exceptions import GetTimeoutError

        futures = worker_group.execute_async(_shutdown, destroy_process_group=len(worker_group) > 1)
        timeout_s = int(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                       DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            log.warning("torch process group shutdown timed out after %s s", timeout_s)


@dataclass
class ArmTorchConfig(BackendConfig):
    backend: str = "gloo"
    """``gloo`` (CPU) or ``nccl`` (CUDA): named by the caller, as ``TorchTrainer`` does from ``use_gpu``."""
    timeout_s: int = 1800
    arm_process: bool = False
    """Each rank's arm runs in a forked process that sets up the group itself; the workers never import torch.
    CPU (gloo) only."""

    def __post_init__(self) -> None:
        if self.arm_process and self.backend != "gloo":
            raise ValueError(f"ArmTorchConfig.arm_process is for gloo (CPU) arms; backend is {self.backend!r}")

    @property
    def backend_cls(self) -> type:
        return ArmTorchBackend

    @property
    def train_func_context(self) -> type:
        # No CUDA device to pick on a CPU arm, and Ray's context manager would import torch into the worker.
        return contextlib.nullcontext if self.arm_process else WorkerDeviceContext

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        """What Train's run state and dashboard show for the backend (``TorchConfig``'s keys, and ``arm_process``)."""
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s,
                "arm_process": self.arm_process}
