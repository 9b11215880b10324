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

``engine.details`` (the receipt's ``observed.engine``) is read back from the engine that was built, never copied
from the lane: DDP's reducer (its byte cap and, once DDP rebuilt them, its real buckets) and DeepSpeed's ZeRO
optimizer. A requested setting that cannot act in the built engine is ``None`` and named in ``inactive`` with the
reason, so two arms whose engines ran the same code have equal records and arms whose engines differ do not.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ablate.config.schema import LaneConfig
from trainers.inactive import ONE_WORKER, SINGLE_BUCKET

MicroBatch = tuple[torch.Tensor, torch.Tensor]

_MIB = 2 ** 20


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
        """Effective engine settings for the receipt, read back from the built engine (never from the lane).

        Updated in place after a step when a fact appears only during training (DDP's rebuilt buckets): a holder
        of this dict sees the final record once the arm ends."""
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
        self._observe()
        assert totals["loss"] is not None
        return StepOutput(totals["loss"], totals["lm_loss"], totals["aux_loss"], totals["stp_loss"])

    def _observe(self) -> None:
        """After a step: record engine facts that only exist once training ran (DDP's rebuilt buckets)."""

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
        self._ddp: Optional[DistributedDataParallel] = None
        self._buckets_seen = False
        # Under whole compile Dynamo's DDPOptimizer also splits the graph by the cap (in its own parameter order),
        # so one reducer bucket does not prove the cap idle there.
        self._cap_splits_graph = whole_compile is not None
        if world_size > 1:
            module = self._ddp = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=lane.engine.bucket_cap_mb)
            details = _ddp_details(self._ddp)
        else:
            # One worker has no gradient all-reduce: no DDP wrapper, and bucket_cap_mb cannot act (INERT_TOGGLE).
            details = {"engine": "ddp", "wrapper": None, "world_size": 1, "backend": None, "bucket_cap_mb": None,
                       "bucket_cap_bytes": None, "buckets_bytes": None, "gradient_as_bucket_view": None,
                       "static_graph": None, "find_unused_parameters": None,
                       "inactive": {"bucket_cap_mb": ONE_WORKER}}
        if whole_compile is not None:
            module = whole_compile(module)
        super().__init__(lane, device, module, optimizer, details)

    def _backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        scaled = loss / self.lane.batch.grad_accum
        if self._ddp is not None and not last_micro:
            # Accumulation micro-batches skip the all-reduce; only the last one communicates.
            with self._ddp.no_sync():
                scaled.backward()
        else:
            scaled.backward()

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _observe(self) -> None:
        # DDP starts with one bucket of every gradient (the cap is not used while find_unused_parameters is off)
        # and rebuilds its buckets by the cap, in gradient-ready order, at the first forward after a synced
        # backward; its logger reports the rebuilt sizes from the next synced forward on.
        if self._ddp is None or self._buckets_seen:
            return
        sizes = _rebuilt_bucket_sizes(self._ddp)
        if sizes is None:
            return
        self._buckets_seen = True
        self.details["buckets_bytes"] = sizes
        if len(sizes) == 1 and not self._cap_splits_graph:
            self.details["bucket_cap_mb"] = self.details["bucket_cap_bytes"] = None
            self.details["inactive"]["bucket_cap_mb"] = SINGLE_BUCKET


def _ddp_details(ddp: DistributedDataParallel) -> dict[str, Any]:
    """What the DDP wrapper and its reducer hold (torch 2.13: ``bucket_bytes_cap`` is the reducer's byte cap)."""
    group = ddp.process_group
    cap_bytes = int(ddp.bucket_bytes_cap)
    return {"engine": "ddp", "wrapper": type(ddp).__name__, "world_size": dist.get_world_size(group),
            "backend": dist.get_backend(group),
            "bucket_cap_mb": cap_bytes / _MIB,
            "bucket_cap_bytes": cap_bytes,
            "buckets_bytes": None,
            "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view), "static_graph": bool(ddp.static_graph),
            "find_unused_parameters": bool(ddp.find_unused_parameters), "inactive": {}}


def _rebuilt_bucket_sizes(ddp: DistributedDataParallel) -> Optional[list[int]]:
    """Bytes per bucket after DDP's one-time rebuild, or None until its logger has them (private API: guarded)."""
    try:
        if not ddp._has_rebuilt_buckets:
            return None
        text = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes")
    except Exception:  # noqa: BLE001 - a torch without these privates leaves the layout unobserved (null)
        return None
    if not text:
        return None
    return [int(size) for size in re.findall(r"\d+", str(text))]


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
        super().__init__(lane, device, ds_engine, optimizer, _deepspeed_details(ds_engine, optimizer))

    def _backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        # DeepSpeed scales by gradient_accumulation_steps itself and all-reduces at the boundary.
        self.module.backward(loss)
        self.module.step()

    def _optimizer_step(self) -> None:
        # engine.step() after every micro-batch already stepped the optimizer at the accumulation boundary.
        pass


# Why a DeepSpeed bucket or overlap request cannot act, as read in deepspeed 0.19.8 (runtime/engine.py,
# runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py, runtime/utils.py). ablate/config/features.py states the
# same facts statically; the texts carry no requested value, so equal engines give equal records.
STAGE0_REDUCE = ("ZeRO stage 0 has no ZeRO optimizer: the engine all-reduces gradients in "
                 "buffered_allreduce_fallback with its fixed MEMORY_OPT_ALLREDUCE_SIZE buffer "
                 "(allreduce_bucket_elements), never this bucket")
STAGE0_ALLGATHER = "ZeRO stage 0 keeps whole parameters on every rank: nothing is all-gathered"
STAGE0_OVERLAP = "ZeRO stage 0: overlap_comm is read only by the ZeRO optimizers of stages 1-3"
GATHER_INTO_TENSOR = ("the communication backend has all_gather_into_tensor, so ZeRO all-gathers each updated "
                      "partition in one call (all_gather_dp_groups) and never splits it by allgather_bucket_size")
STAGE3_ALLGATHER = ("ZeRO-3 gathers parameters by stage3_prefetch_bucket_size; allgather_bucket_size is not passed "
                    "to its optimizer")
SYNCHRONIZED_OVERLAP = ("the accelerator is a synchronized device (CPU): ZeRO-3 creates no side stream for "
                        "reduction or all-gather whatever overlap_comm says, and reads it nowhere else")


def _deepspeed_details(ds_engine: Any, optimizer: Any) -> dict[str, Any]:
    """Stage, buckets and overlap as the built ZeRO optimizer holds them; inactive ones are None with a reason."""
    import deepspeed.comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    stage = int(ds_engine.zero_optimization_stage())
    group = ds_engine.data_parallel_group
    accelerator = get_accelerator()
    inactive: dict[str, str] = {}
    details: dict[str, Any] = {"engine": "deepspeed", "world_size": dist.get_world_size(group),
                               "backend": dist.get_backend(group), "accelerator": accelerator.device_name(),
                               "zero_stage": stage, "optimizer": type(optimizer).__name__, "inactive": inactive}
    if stage == 0:
        from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

        details.update(reduce_bucket_size=None, allgather_bucket_size=None, overlap_comm=None,
                       allreduce_bucket_elements=int(MEMORY_OPT_ALLREDUCE_SIZE))
        inactive.update(reduce_bucket_size=STAGE0_REDUCE, allgather_bucket_size=STAGE0_ALLGATHER,
                        overlap_comm=STAGE0_OVERLAP)
        return details
    details["reduce_bucket_size"] = int(optimizer.reduce_bucket_size)
    if stage == 3:
        details["allgather_bucket_size"] = None
        inactive["allgather_bucket_size"] = STAGE3_ALLGATHER
        # The stage-3 optimizer keeps no overlap flag, only the stream it chose from it.
        if accelerator.is_synchronized_device():
            details["overlap_comm"] = None
            inactive["overlap_comm"] = SYNCHRONIZED_OVERLAP
        else:
            details["overlap_comm"] = bool(ds_engine.zero_overlap_comm())
        return details
    details["overlap_comm"] = bool(optimizer.overlap_comm)
    if ds_comm.has_all_gather_into_tensor():
        details["allgather_bucket_size"] = None
        inactive["allgather_bucket_size"] = GATHER_INTO_TENSOR
    else:
        details["allgather_bucket_size"] = int(optimizer.allgather_bucket_size)
    return details


def build_engine(lane: LaneConfig, model: nn.Module, device: torch.device, world_size: int,
                 whole_compile: Optional[Callable[[nn.Module], nn.Module]] = None) -> Engine:
    if lane.engine.name.value == "deepspeed":
        return DeepSpeedEngine(lane, model, device, world_size, whole_compile)
    return DDPEngine(lane, model, device, world_size, whole_compile)
