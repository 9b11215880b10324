"""The per-worker arm: build the lane, warm up by policy, run the token budget, measure, return a result.

How to run me: not directly. ``trainers.worker`` (a fresh process, one-worker arms) and ``trainers.run``'s Ray
Train loop (multi-worker arms) call ``run_worker(spec, ctx)``; ``trainers.receipt`` turns the returned
``WorkerResult`` into the arm's receipt.

Order of events (times in the result are ``time.time()`` stamps so the orchestrator can close its wall clock):
``fn_start`` -> device, threads, model, compile posture, engine, data -> ``ready`` -> explicit warmup (real steps at
lr 0, then the optimizer state is zeroed, so the budget starts from the same weights whatever the policy) ->
``budget.steps`` steps, the last ``family_sample_steps`` of them sampled for family time share -> ``done``.

Failures: with one worker every exception becomes ``error`` in a returned result (status failed later). With
several workers an exception may be on one rank only while the others wait in a collective, so rank 0 writes
what it measured to ``ctx.work_dir`` and the exception goes up to Ray Train (restart or fail). A non-finite
loss is agreed on collectively every step (it rides on the loss all-reduce), so every rank stops together.

Fault injection (tests only, ``spec.inject``): raise_at_step, nan_at_step, oom_at_step, kill_at_step (SIGKILL
on rank 0, attempt 0 only), geometry_change_at_step, recompile_at_step, graph_break, compile_backend.
"""

from __future__ import annotations

import collections
import math
import os
import resource
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ablate.config.schema import ConfigError, HardwareConfig
from ablate.sweep.node_check import failed_backends, read_document
from ablate.config.warmup import WarmupDecision, resolve_warmup
from trainers.compile import CompileWatch, compile_regions, is_graph_break_error
from trainers.data import build_source
from trainers.energy import EnergyMeter, combine_energy, open_meter
from trainers.engines import Engine, StepOutput, build_engine
from trainers.family import FamilySampler
from trainers.goodput import StepRecord, StepTracker
from trainers.hostload import HostLoadProbe
from trainers.pairing import TurnGate
from ablate.redact import capture_env, redact_text
from trainers.provenance import host_name, observe_hardware, software_versions
from trainers.result import Geometry, WorkerContext, WorkerResult
from trainers.spec import ALLOTTED_CPUS_ENV, ArmSpec


def resolve_device(hardware: HardwareConfig, cuda_index: Optional[int], planned: Optional[str] = None
                   ) -> torch.device:
    """The device that will run: auto -> CUDA when present, unless the driver planned the arm for CPU (``planned``:
    it then reserved no GPU, and its defaults were chosen for the lane on CPU); cuda without CUDA -> CPU only with
    cpu_fallback."""
    requested = hardware.device.value
    if requested == "auto" and planned == "cpu":
        return torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    if requested == "auto" and planned == "cuda" and not has_cuda:
        # Its GPU is reserved and its baseline chosen for the lane on CUDA: trained on CPU, it would be evidence for
        # a lane it was not planned as.
        raise ConfigError("lane.hardware.device", "auto", "a node where torch sees CUDA: the sweep planned this arm "
                                                         "for cuda (its cluster has GPUs), but this process sees "
                                                         "none (a CPU-only torch build?)")
    if requested == "cuda" and not has_cuda:
        if not hardware.cpu_fallback:
            raise ConfigError("lane.hardware.device", "cuda", "auto or cpu on a machine without CUDA, or set "
                                                             "lane.hardware.cpu_fallback: true (HARDWARE_MISMATCH)")
        return torch.device("cpu")
    if requested in ("cuda", "auto") and has_cuda:
        return torch.device("cuda", cuda_index or 0)
    return torch.device("cpu")


def _threads(hardware: HardwareConfig, local_world_size: int, allotted_cpus: Optional[int] = None) -> int:
    """Torch's intra-op threads: the lane's ``hardware.threads``, else what this process was allotted, never more
    than ``allotted_cpus`` (``trainers.spec.ALLOTTED_CPUS_ENV``)."""
    if hardware.threads > 0:
        return hardware.threads
    # Ray sets OMP_NUM_THREADS to the CPUs the scheduler gave this process (the trial's, for a one-worker arm):
    # honouring it keeps two concurrent arms on two CPUs from oversubscribing each other.
    allotted = os.environ.get("OMP_NUM_THREADS", "")
    if allotted.isdigit() and int(allotted) > 0:
        threads = int(allotted)
    else:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        threads = max(1, cpus // max(1, local_world_size))
    # OMP_NUM_THREADS may be a user's export Ray left alone, and the affinity is the node's until an interleaved
    # arm's first turn pins it to its slot: two OpenMP threads pinned to one CPU spin-wait on each other (smoke
    # lane, measured: 0.07 s -> 2.3 s a step).
    return min(threads, allotted_cpus) if allotted_cpus else threads


def _allotted_cpus() -> Optional[int]:
    value = os.environ.get(ALLOTTED_CPUS_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


LOSS_LAG_STEPS = 4
"""How many steps the host may run ahead of the loss it reads on CUDA. Fixed, not "whenever the event is done":
every rank must see a non-finite loss at the same step, or one rank stops while the others wait in a collective."""


class _Ready:
    """The CPU twin of a recorded CUDA event: the copy it guards is already complete."""

    def synchronize(self) -> None:
        pass


class LossMonitor:
    """Per-step loss, averaged over ranks, with a collective non-finite flag.

    One CPU rank reads the value at once (it is already on the host). Otherwise the loss and the flag are copied to
    host memory behind a fence and read ``lag`` steps later, so the host never waits for a step it queued recently:
    on CUDA the only synchronisation is on a step ``lag`` steps back (long finished in a device-bound loop) and at
    ``flush`` (phase boundaries). A NaN stop therefore lags by exactly ``lag`` steps on every rank. ``deferred``
    forces the same ring on CPU, where the fence is already signalled (the tested twin of the CUDA path).
    """

    def __init__(self, world_size: int, device: torch.device, lag: int = LOSS_LAG_STEPS,
                 deferred: Optional[bool] = None) -> None:
        self.world_size, self.device = world_size, device
        self.cuda = device.type == "cuda"
        self.deferred = self.cuda if deferred is None else deferred
        self.lag = max(1, lag)
        self.values: list[float] = []
        self.nonfinite_step: Optional[int] = None
        self.waits = 0
        """Fences read before the host ran ``lag`` steps ahead of them (``flush``): the syncs this monitor cost."""
        self._pending: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()

    def push(self, step: int, loss: torch.Tensor) -> None:
        if self.world_size == 1 and not self.deferred:
            # One rank on CPU: the value is already on the host; no collective, no extra tensor ops.
            value = float(loss)
            self._record(step, value, not math.isfinite(value))
            return
        flag = (~torch.isfinite(loss)).float()
        vec = torch.stack([torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0), flag])
        if self.world_size > 1:
            dist.all_reduce(vec)
        if not self.deferred:
            self._record(step, float(vec[0]), float(vec[1]) > 0)
            return
        if self.cuda:
            host = torch.empty(2, pin_memory=True)
            host.copy_(vec, non_blocking=True)
            fence: Any = torch.cuda.Event()
            fence.record()
        else:
            host, fence = vec.detach().clone(), _Ready()
        self._pending.append((step, host, fence))
        while len(self._pending) > self.lag:
            self._read(self._pending.popleft())

    def prime(self) -> None:
        """Run this monitor's own tensor path once, recording nothing, before the step clock starts: the first
        launch of its kernels (CUDA lazy module loading) and the first pinned host buffer are one-time costs,
        and without this they fell in the first budget step, which explicit warmup counts as steady (found in
        review). Collectives are left out: the engine's set-up already formed the process group."""
        if self.world_size == 1 and not self.deferred:
            return
        loss = torch.zeros((), device=self.device)
        vec = torch.stack([torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0), (~torch.isfinite(loss)).float()])
        if self.cuda:
            torch.empty(2, pin_memory=True).copy_(vec, non_blocking=True)
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        """Read every pending step (a phase boundary: the end of the budget, a failure)."""
        while self._pending:
            self.waits += 1
            self._read(self._pending.popleft())

    def drop(self) -> None:
        """Forget the unread steps (their device work failed: there is nothing left to read)."""
        self._pending.clear()

    def _read(self, pending: tuple[int, torch.Tensor, Any]) -> None:
        step, host, fence = pending
        fence.synchronize()
        self._record(step, float(host[0]), float(host[1]) > 0)

    def _record(self, step: int, total: float, nonfinite: bool) -> None:
        if nonfinite:
            self.values.append(float("nan"))
            if self.nonfinite_step is None:
                self.nonfinite_step = step
        else:
            self.values.append(total / self.world_size)


def _param_counts(model: Any) -> dict[str, Optional[int]]:
    counts = model.param_counts()
    if isinstance(counts, dict):
        return {k: counts.get(k) for k in ("total", "active", "embedding")}
    if isinstance(counts, (tuple, list)):
        return dict(zip(("total", "active", "embedding"), counts))
    return {k: getattr(counts, k, None) for k in ("total", "active", "embedding")}


def _memory(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"kind": "cuda", "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device), "peak_rss_bytes": None}
    # ru_maxrss is KiB on Linux: this process's peak, which is the arm's since the worker is fresh.
    return {"kind": "cpu", "peak_allocated_bytes": None, "peak_reserved_bytes": None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _inject_graph_break(blocks: list[tuple[str, torch.nn.Module]]) -> None:
    # A pre-hook on the inner block is traced with it: fullgraph=True (regional) raises, whole compile counts it.
    def hook(module: torch.nn.Module, args: Any) -> None:
        torch._dynamo.graph_break()

    blocks[0][1].register_forward_pre_hook(hook)


def _write_partial(ctx: WorkerContext, result: WorkerResult) -> None:
    if ctx.work_dir is None or ctx.rank != 0:
        return
    path = Path(ctx.work_dir) / f"partial-{ctx.attempt}.state"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(result.to_json())
    os.replace(tmp, path)


def measured_step(engine: Engine, make_batches: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
                  tracker: StepTracker, watch: CompileWatch, phase: str, sampler: Optional[FamilySampler] = None,
                  monitor: Optional[LossMonitor] = None, step: int = 0,
                  world_size: int = 1, gate: Optional[TurnGate] = None,
                  meter: Optional[EnergyMeter] = None) -> tuple[StepOutput, StepRecord]:
    """One optimizer step with its instruments: tracker times, compile events, family hooks when sampled, loss.

    In an interleaved block the step is one turn: the wait for it is recorded and kept out of the cadence.
    ``meter`` (host-synchronous CPU steps) sums energy over this arm's own turns only, not its partner's.
    The benchmark (benchmarks/bench_tracker.py) runs this same function against a bare ``engine.step`` loop.
    """
    waited = gate.acquire() if gate is not None else 0.0
    if meter is not None:
        meter.begin()
    try:
        return _step(engine, make_batches, tracker, watch, phase, sampler, monitor, step, world_size, waited)
    finally:
        if meter is not None:
            meter.end()
        if gate is not None:
            gate.release()


def _step(engine: Engine, make_batches: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]], tracker: StepTracker,
          watch: CompileWatch, phase: str, sampler: Optional[FamilySampler], monitor: Optional[LossMonitor],
          step: int, world_size: int, waited: float) -> tuple[StepOutput, StepRecord]:
    tracker.begin(phase, sampled=sampler is not None)
    micro = make_batches()
    tracker.data_done()
    events, seconds = watch.events, watch.seconds
    if sampler is not None:
        with sampler.sampling():
            out = engine.step(micro)
    else:
        out = engine.step(micro)
    if monitor is not None:
        monitor.push(step, out.loss)
    tokens = sum(t.numel() for t, _ in micro) * world_size if phase == "budget" else 0
    record = tracker.end(tokens=tokens, compile_events=watch.events - events, compile_s=watch.seconds - seconds,
                         wait_s=waited)
    if sampler is not None:
        sampler.add_step(record.step_s)
    return out, record


def run_worker(spec: ArmSpec, ctx: WorkerContext, finalize: Optional[Callable[[WorkerResult], None]] = None,
               gate: Optional[TurnGate] = None) -> WorkerResult:
    """Run one arm on this worker and return what it measured (never raises with one worker).

    ``gate``: in an interleaved block, setup and every step run as turns alternating with the partner arm.
    """
    gate = gate or TurnGate(None)
    result = WorkerResult(rank=ctx.rank, world_size=ctx.world_size, attempt=ctx.attempt, executor=ctx.executor,
                          pid=os.getpid(), host=host_name(), node_id=ctx.node_id, fn_start=time.time())
    lane, inject = spec.lane, spec.inject
    st = _ArmState()
    step = -1
    try:
        from trainers.model import HybridLM
        from trainers.model.flops import flops_per_token
        from ablate.config.pattern import parse_pattern
        from kernels.dispatch import Dispatcher

        result.software = software_versions()
        result.env = capture_env()
        node_doc = read_document(spec.node_check_path, ctx.node_id or "") if ctx.rank == 0 else None
        if node_doc is not None:
            result.node_check = node_doc.summary()
        device = resolve_device(lane.hardware, ctx.cuda_index, spec.device)
        result.device = device.type
        torch.set_num_threads(_threads(lane.hardware, ctx.local_world_size, _allotted_cpus()))
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(lane.seed)
        st.letters = parse_pattern(lane.model.pattern)
        geometry = Geometry(lane.batch.micro_batch, lane.batch.seq_len, lane.batch.grad_accum, ctx.world_size)
        # The data path does not depend on any feature toggle: build it before the split point below.
        source = build_source(lane.data, lane.model.vocab_size)
        result.data = {"fingerprint": source.fingerprint, "files": source.files, "num_tokens": source.num_tokens}

        # Dynamo's callbacks must be installed before the first compiled call; installing them imports
        # torch._dynamo (~1.5 s on 2 CPUs) whatever the posture, so it is start-up, not any feature's cost.
        watch = st.watch = CompileWatch()

        # Executor start-up (spawn, imports, device, threads, data) ends here; what follows depends on the lane's
        # features (model, kernels, compile posture, engine) and is the arm's one-time setup cost.
        result.setup_wait_s = gate.acquire()
        result.paired = gate.paired
        result.features_at = time.time()
        # The dispatcher must know whether ops will run inside a compiled graph: there a fused backend may be
        # its reference, and the receipt must say what really ran (observed inertness compares these records).
        st.dispatcher = Dispatcher(device, strict=False, compile_posture=lane.compile.posture.value)
        model = HybridLM(lane.model, lane.features, st.dispatcher, precision=lane.precision)
        if node_doc is not None:
            result.node_check["wrong"] = failed_backends(node_doc, device.type, st.dispatcher.table())
        result.layer_counts = dict(model.layer_counts())
        result.params = _param_counts(model)
        flops = flops_per_token(lane.model, lane.features, lane.batch.seq_len)
        result.flops = {"total": flops.total, "per_family": dict(flops.per_family),
                        "coverage_missing": list(flops.coverage_missing)}

        posture = st.posture = lane.compile.posture.value
        decision = st.decision = resolve_warmup(lane.compile.warmup, device.type, posture, st.letters,
                                                lane.compile.warmup_steps)
        result.warmup = asdict(decision)
        backend = str(inject.get("compile_backend", "inductor"))
        regions = list(model.blocks())
        if inject.get("graph_break") and posture != "eager":
            _inject_graph_break(regions)
        whole = None
        if posture == "regional":
            regions = compile_regions(model, regions, backend=backend, fullgraph=True)
        elif posture == "whole":
            # fullgraph=False: a break-tolerant whole-model compile whose breaks are counted (GRAPH_BREAK).
            def whole(module: torch.nn.Module) -> torch.nn.Module:
                return torch.compile(module, backend=backend, fullgraph=False)  # type: ignore[return-value]
        engine: Engine = build_engine(lane, model, device, ctx.world_size, whole)
        st.engine = engine
        result.engine = dict(engine.details)
        if "nan_at_step" in inject:
            nan_step = int(inject["nan_at_step"])
            engine.loss_hook = lambda loss: loss * float("nan") if step == nan_step else loss
        sampler = st.sampler = FamilySampler(regions, cuda=device.type == "cuda", whole_compiled=posture == "whole")
        monitor = st.monitor = LossMonitor(ctx.world_size, device)
        monitor.prime()
        # Opened here, in set-up (both arms alike): NVML's init and handle lookup, or RAPL's file scan, must not
        # fall between steps on the step clock.
        meter = st.meter = open_meter(device)
        result.ready = time.time()
        gate.release()

        result.model = {"stp_head": bool(getattr(model, "stp_head", None) is not None),
                        "compile_posture": posture, "warmup": decision.resolved, "warmup_steps": decision.steps}
        tracker = st.tracker = StepTracker(cuda=device.type == "cuda")
        st.probe = HostLoadProbe(local_ranks=ctx.local_world_size)
        st.probe.start(turns=gate)  # interleaved: its run delay is taken over its own turns
        tracker.start()

        def batches(index: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            out = []
            for micro in range(geometry.grad_accum):
                tokens_BT, targets_BT = source.batch(index, micro, ctx.rank, geometry.micro_batch, seq_len)
                out.append((tokens_BT.to(device, non_blocking=True), targets_BT.to(device, non_blocking=True)))
            return out

        # 1. Explicit warmup: real steps (compiles forward, backward and optimizer paths) at lr 0.
        if decision.steps:
            engine.set_lr(0.0)
            for _ in range(decision.steps):
                measured_step(engine, lambda: batches(0, geometry.seq_len), tracker, watch, phase="warmup",
                              gate=gate)
            engine.set_lr(lane.budget.lr)
            engine.reset_optimizer_state()
            if inject.get("transition_sleep_s"):
                time.sleep(float(inject["transition_sleep_s"]))  # a slow transition (NVML on a busy node)

        # 2. The token budget. The last family_sample_steps steps carry the family hooks.
        # Energy: on CUDA one window around the budget (a sync at each end, phase boundaries only, since device
        # work lags the host); on CPU the sum over this arm's own steps (in an interleaved block the partner's
        # turns fall between them).
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            meter.begin()
        if decision.steps and not gate.paired:
            # The transition above is the warmup's one-time cost (StepTracker.extend_last). In an interleaved
            # block it already falls outside the cadence: it runs after this arm's turn, as the partner's wait.
            tracker.extend_last()
        num_steps = lane.budget.steps
        first_sampled = num_steps - min(lane.budget.family_sample_steps, max(0, num_steps - 1))
        seq_len = geometry.seq_len
        for step in range(num_steps):
            if inject.get("raise_at_step") == step:
                raise RuntimeError(f"injected failure at budget step {step}")
            if inject.get("oom_at_step") == step:
                raise torch.OutOfMemoryError(f"injected out-of-memory at budget step {step}")
            if inject.get("kill_at_step") == step and ctx.rank == 0 and ctx.attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if inject.get("geometry_change_at_step") == step:
                seq_len = max(lane.model.ssm_chunk, geometry.seq_len // 2)
            if inject.get("recompile_at_step") == step:
                torch._dynamo.reset()
            st.last, record = measured_step(engine, lambda: batches(step, seq_len), tracker, watch, phase="budget",
                                            sampler=sampler if step >= first_sampled else None, monitor=monitor,
                                            step=step, world_size=ctx.world_size, gate=gate,
                                            meter=None if device.type == "cuda" else meter)
            result.tokens_per_step_observed.append(record.tokens)
            if monitor.nonfinite_step is not None:
                break
        monitor.flush()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            meter.end()
        result.energy = _energy(meter, sum(result.tokens_per_step_observed), ctx.world_size)
        if monitor.nonfinite_step is not None:
            result.error = {"type": "NonFiniteLoss", "category": "nonfinite", "step": monitor.nonfinite_step,
                            "message": f"loss is not finite at budget step {monitor.nonfinite_step}; stopped"}
    except Exception as exc:  # noqa: BLE001 - every failure must still leave a receipt
        gate.close()  # a failed arm must not hold its partner's turns
        category = ("oom" if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) else
                    "graph_break" if is_graph_break_error(exc) else "exception")
        result.error = {"type": type(exc).__name__, "category": category, "step": step if step >= 0 else None,
                        "message": redact_text(f"{exc}\n{traceback.format_exc(limit=8)}")[-4000:]}
        if ctx.world_size > 1:
            _collect(result, st)
            _write_partial(ctx, result)
            raise
    gate.close()
    _collect(result, st)
    if finalize is not None:
        finalize(result)
    return result


@dataclass
class _ArmState:
    """What the arm reached before it ended or failed; ``_collect`` reads whatever is set."""

    tracker: Optional[StepTracker] = None
    probe: Optional[HostLoadProbe] = None
    watch: Optional[CompileWatch] = None
    decision: Optional[WarmupDecision] = None
    sampler: Optional[FamilySampler] = None
    monitor: Optional[LossMonitor] = None
    meter: Optional[EnergyMeter] = None
    dispatcher: Any = None
    engine: Optional[Engine] = None
    last: Optional[StepOutput] = None
    letters: str = ""
    posture: str = ""


def _collect(result: WorkerResult, st: _ArmState) -> None:
    """Fill the measured fields from whatever was reached (a failed arm keeps its partial measurements)."""
    if st.tracker is not None and st.decision is not None:
        summary = st.tracker.finish(st.decision.resolved)
        result.done = time.time()
        if st.probe is not None:
            result.host_load = st.probe.stop(paired_wait_s=summary.paired_wait_s)
        result.loop = summary.to_dict()
        result.first_step_end = st.tracker.first_step_end
        if st.watch is not None:
            steady_events = sum(s.compile_events for s in summary.steps if s.label == "recompile")
            result.compile = st.watch.record(st.posture, st.decision, steady_events)
    else:
        result.done = time.time()
    if st.watch is not None:
        st.watch.close()
    if st.meter is not None:
        try:
            st.meter.close()
        except Exception:  # noqa: BLE001 - NVML going away at the end must not cost the receipt
            pass
    if st.monitor is not None:
        try:
            st.monitor.flush()
        except Exception as exc:  # noqa: BLE001 - a sticky CUDA error raises here too; the receipt must survive
            st.monitor.drop()
            note = f"the last {LOSS_LAG_STEPS} losses could not be read: {type(exc).__name__}: {exc}"
            if result.error is None:
                result.error = {"type": type(exc).__name__, "category": "exception", "step": None,
                                "message": redact_text(note)[-4000:]}
            else:
                result.error["message"] = (result.error.get("message", "") + "\n" + redact_text(note))[-4000:]
        result.losses = st.monitor.values
    if st.last is not None:
        finite = [v for v in result.losses if math.isfinite(v)]
        k = min(4, len(finite))
        result.quality = {"loss_final": result.losses[-1] if result.losses and math.isfinite(result.losses[-1])
                          else None,
                          "loss_mean_last_k": sum(finite[-k:]) / k if k else None,
                          "lm_loss_final": _finite(st.last.lm_loss), "aux_loss_final": _finite(st.last.aux_loss),
                          "stp_loss_final": _finite(st.last.stp_loss)}
    if st.sampler is not None:
        result.family_share = st.sampler.shares(st.letters)
        result.family_method = st.sampler.method
    if st.dispatcher is not None:
        result.backends = st.dispatcher.table()
    if st.engine is not None:
        # Read at the end: some settings (DDP's rebuilt bucket layout) are only known after steps ran.
        result.engine = dict(st.engine.details)
    if result.device is not None:
        result.memory = _memory(torch.device(result.device))
        if result.rank == 0:
            index = torch.cuda.current_device() if result.device == "cuda" else None
            result.hardware = observe_hardware(result.device, index)


def _energy(meter: EnergyMeter, tokens: int, world_size: int) -> dict[str, Any]:
    """The arm's energy over its budget steps, every rank's meter combined (a collective: success path only)."""
    mine = meter.record(tokens)
    if world_size == 1:
        return mine
    records: list[Any] = [None] * world_size
    dist.all_gather_object(records, mine)
    return combine_energy(records)


def _finite(value: Optional[torch.Tensor]) -> Optional[float]:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None
