"""Training engines: DDP (``bucket_cap_mb``) and DeepSpeed ZeRO 0-3 (buckets, ``overlap_comm``), one interface.

How to use::

    engine = build_engine(lane, model, device, world_size, posture_backend)
    out = engine.step(micro_batches)     # forward + backward over grad_accum micro-batches + optimizer step
    engine.set_lr(0.0); ...; engine.set_lr(lane.budget.lr); engine.reset_optimizer_state()

Both engines use a client ``torch.optim.AdamW``: DeepSpeed then JIT-builds no C++ op (its fused Adam and its CPU
shared-memory allreduce are kept off), so the same code runs over gloo on CPU and NCCL on GPU. The process group
must already exist when ``world_size > 1`` (Ray Train sets it up) or for DeepSpeed with one worker
(``init_single_process_group``). DDP buckets are in MiB; DeepSpeed buckets count elements.

``bf16`` precision is autocast over fp32 master weights for both engines, so the two engines differ only in
how they communicate and shard, not in numerics.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ablate.config.schema import LaneConfig

MicroBatch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepOutput:
    """Detached per-step losses (mean over micro-batches), still on the device: reading them syncs CUDA."""

    loss: torch.Tensor
    lm_loss: Optional[torch.Tensor]
    aux_loss: Optional[torch.Tensor]
    stp_loss: Optional[torch.Tensor]


def init_single_process_group(backend: str = "gloo") -> None:
    """A world of one (DeepSpeed needs a process group even alone); a free local port, no launcher."""
    if dist.is_available() and dist.is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _autocast(device: torch.device, lane: LaneConfig) -> contextlib.AbstractContextManager[Any]:
    if lane.precision.value == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # DeepSpeed's ZeRO optimizers wrap the client optimizer as ``.optimizer`` (stage 0 returns it as is).
    current = optimizer
    while not isinstance(current, torch.optim.Optimizer) and hasattr(current, "optimizer"):
        current = current.optimizer
    assert isinstance(current, torch.optim.Optimizer), f"no torch optimizer inside {type(optimizer).__name__}"
    return current


class Engine:
    """Common step logic; subclasses say how a micro-batch runs backward and how the optimizer steps."""

    name = "base"

    def __init__(self, lane: LaneConfig, device: torch.device, module: Any, optimizer: Any,
                 details: dict[str, Any]) -> None:
        self.lane, self.device, self.module, self.optimizer = lane, device, module, optimizer
        self.details = details
        """Effective engine settings for the receipt (what the engine resolved, not what was asked)."""
        self.loss_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        """Test-only fault injection: rewrites the loss before backward (e.g. to NaN)."""

    def _forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor) -> Any:
        with _autocast(self.device, self.lane):
            return self.module(tokens_BT, targets_BT)

    def _backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        raise NotImplementedError

    def _optimizer_step(self) -> None:
        raise NotImplementedError

    def step(self, micro_batches: list[MicroBatch]) -> StepOutput:
        count = len(micro_batches)
        totals: dict[str, Optional[torch.Tensor]] = {"loss": None, "lm_loss": None, "aux_loss": None,
                                                     "stp_loss": None}
        for index, (tokens_BT, targets_BT) in enumerate(micro_batches):
            out = self._forward(tokens_BT, targets_BT)
            loss = out.loss if self.loss_hook is None else self.loss_hook(out.loss)
            self._backward(loss, last_micro=index == count - 1)
            for key in totals:
                value = loss if key == "loss" else getattr(out, key, None)
                if isinstance(value, torch.Tensor):
                    value = value.detach().float() / count
                    totals[key] = value if totals[key] is None else totals[key] + value
        self._optimizer_step()
        assert totals["loss"] is not None
        return StepOutput(totals["loss"], totals["lm_loss"], totals["aux_loss"], totals["stp_loss"])

    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups():
            group["lr"] = lr

    def reset_optimizer_state(self) -> None:
        """Zero Adam's moments and step count in place: identical to a fresh optimizer, layout untouched.

        Explicit warmup runs real steps at lr 0 (weights unchanged) and then this, so an arm that warmed up and
        one that skipped warmup start their token budget from the same weights and optimizer state.
        """
        inner = _innermost_optimizer(self.optimizer)
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif key == "step":
                    state[key] = 0


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, lane: LaneConfig, model: nn.Module, device: torch.device, world_size: int,
                 whole_compile: Optional[Callable[[nn.Module], nn.Module]]) -> None:
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lane.budget.lr)
        module: nn.Module = model
        details: dict[str, Any] = {"engine": "ddp", "world_size": world_size}
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                             bucket_cap_mb=lane.engine.bucket_cap_mb)
            details["bucket_cap_mb"] = lane.engine.bucket_cap_mb
            details["backend"] = dist.get_backend()
        else:
            # One worker has no gradient all-reduce: no DDP wrapper, and bucket_cap_mb cannot act (INERT_TOGGLE).
            details["bucket_cap_mb"] = None
        if whole_compile is not None:
            module = whole_compile(module)
        super().__init__(lane, device, module, optimizer, details)
        self._ddp = module if world_size > 1 else None

    def _backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        scaled = loss / self.lane.batch.grad_accum
        ddp = getattr(self.module, "_orig_mod", self.module)
        if self._ddp is not None and not last_micro and hasattr(ddp, "no_sync"):
            # Accumulation micro-batches skip the all-reduce; only the last one communicates.
            with ddp.no_sync():
                scaled.backward()
        else:
            scaled.backward()

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, lane: LaneConfig, model: nn.Module, device: torch.device, world_size: int,
                 whole_compile: Optional[Callable[[nn.Module], nn.Module]]) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
        if not dist.is_initialized():
            init_single_process_group("nccl" if device.type == "cuda" else "gloo")
        import deepspeed
        import deepspeed.ops

        if device.type == "cpu":
            # The CPU shared-memory allreduce is a JIT-built C++ op (g++ + ~1 min on a cold cache); gloo does
            # the same job, and a hidden compile inside startup would blur the receipt.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        zero = {"stage": lane.engine.zero_stage, "reduce_bucket_size": lane.engine.reduce_bucket_size,
                "allgather_bucket_size": lane.engine.allgather_bucket_size, "overlap_comm": lane.engine.overlap_comm}
        config = {"train_micro_batch_size_per_gpu": lane.batch.micro_batch,
                  "gradient_accumulation_steps": lane.batch.grad_accum,
                  "train_batch_size": lane.batch.micro_batch * lane.batch.grad_accum * world_size,
                  "zero_optimization": zero, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        model = model.to(device)
        if whole_compile is not None:
            model = whole_compile(model)
        client_optimizer = torch.optim.AdamW(model.parameters(), lr=lane.budget.lr)
        ds_engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer, config=config,
                                                          dist_init_required=False)
        details = {"engine": "deepspeed", "world_size": world_size, "zero_stage": ds_engine.zero_optimization_stage(),
                   "reduce_bucket_size": lane.engine.reduce_bucket_size,
                   "allgather_bucket_size": lane.engine.allgather_bucket_size,
                   "overlap_comm": bool(ds_engine.zero_overlap_comm()) if lane.engine.zero_stage > 0 else None,
                   "optimizer": type(optimizer).__name__, "backend": dist.get_backend()}
        super().__init__(lane, device, ds_engine, optimizer, details)

    def _backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        # DeepSpeed scales by gradient_accumulation_steps itself and all-reduces at the boundary.
        self.module.backward(loss)
        self.module.step()

    def _optimizer_step(self) -> None:
        # engine.step() after every micro-batch already stepped the optimizer at the accumulation boundary.
        pass


def build_engine(lane: LaneConfig, model: nn.Module, device: torch.device, world_size: int,
                 whole_compile: Optional[Callable[[nn.Module], nn.Module]] = None) -> Engine:
    if lane.engine.name.value == "deepspeed":
        return DeepSpeedEngine(lane, model, device, world_size, whole_compile)
    return DDPEngine(lane, model, device, world_size, whole_compile)
