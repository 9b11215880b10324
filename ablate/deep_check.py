"""`ablate doctor --deep`: on this node's own device, does every backend run, equal its reference twin, and pay?

How to use::

    report = run_deep(torch.device("cpu"))            # or "cuda"; ops=/sizes=/dtypes= narrow it
    report.ok                                          # False when a backend this node would run is wrong
    json.dumps(report.as_dict())                       # the document a receipt or cluster set-up can point to

Per registered op and per backend, the dispatcher resolves the backend here (requested -> observed + reason). A
backend that cannot run here is ``unavailable`` with the dispatcher's reason (it is what an arm would record as a
fallback). One that runs is checked forward and backward against the op's pure-torch reference at two shapes and
in fp32 and bf16 (the reference always in fp32 on the same drawn values), with the kernel tests' max-norm
tolerance, and timed against the reference at the lane shape: interleaved, forward + backward, median of repeats
(CUDA events on GPU, ``perf_counter`` on CPU). Under ``TRITON_INTERPRET=1`` a CPU node also runs the Triton kernels
in the interpreter (parity only: interpreter speed means nothing).

Then one block of each family (A, E, M, R, with the fast backends) is compiled with ``fullgraph=True`` and run
forward and backward against eager: graph breaks and extra graphs (recompiles) are counted. On CUDA, NVML adds the
device facts and an energy sample while the family blocks step. Last, the all-reduce bus bandwidth of the node's
collective backend (NCCL across its GPUs, gloo across two CPU processes; ``ablate.comm_check``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from kernels.dispatch import Dispatcher, get_op, registered_ops
from kernels.examples import EXAMPLES, REL_TOL, SIZES, Example, example

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIMING = {"cuda": "CUDA events, interleaved, median of repeats",
          "cpu": "process CPU time with one intra-op thread, interleaved, median of repeats"}
FAMILY_BACKENDS = {"A": ("mla_ingress", "fused"), "E": ("moe_dispatch", "jagged"), "M": ("mamba_scan", "chunked"),
                   "R": ("recurrent_scan", "parallel")}
"""The fast backend of each block family: the one a campaign would promote, so the one whose graph must hold."""


@dataclass
class ParityRow:
    size: str
    dtype: str
    shape: str
    rel_error: Optional[float]
    tolerance: float
    ok: bool
    error: str = ""


@dataclass
class BackendRow:
    op: str
    backend: str
    observed: str
    status: str
    """ok | wrong (fails its twin) | unavailable (cannot run here) | interpreted (Triton interpreter, parity only)"""
    reason: str
    parity: list[ParityRow] = field(default_factory=list)
    ref_ms: Optional[float] = None
    backend_ms: Optional[float] = None
    speedup: Optional[float] = None
    """median(reference) / median(backend), forward + backward at the lane shape in fp32: CUDA-event time on a GPU,
    one-thread process CPU time on a CPU (see ``TIMING``)."""


@dataclass
class FamilyRow:
    family: str
    features: str
    graph_breaks: Optional[int]
    graphs: Optional[int]
    rel_error: Optional[float]
    ok: bool
    detail: str = ""


@dataclass
class DeepReport:
    device: str
    device_name: str
    torch_version: str
    threads: int
    timing: str
    backends: list[BackendRow]
    families: list[FamilyRow]
    nvml: dict[str, Any]
    comm: dict[str, Any] = field(default_factory=dict)
    """All-reduce bus bandwidth (``ablate.comm_check``): NCCL across the node's GPUs, gloo across two CPU ranks."""

    @property
    def comm_ok(self) -> bool:
        # Not run, measured, or a one-GPU node (no peer): fine. A collective that fails to run is not.
        return not self.comm or bool(self.comm.get("rows")) or self.comm.get("ranks", 0) < 2

    @property
    def ok(self) -> bool:
        return (all(r.status != "wrong" for r in self.backends) and all(f.ok for f in self.families)
                and self.comm_ok)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _upstream(outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype) for o in outs]


def _fwd_bwd(ex: Example, fn: Callable[..., Any], grads: Optional[list[torch.Tensor]] = None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = list(ex.run(fn))
    grads = grads if grads is not None else _upstream(outs)
    inputs = list(ex.inputs)
    in_grads = torch.autograd.grad(outs, inputs, [g.to(o.dtype) for g, o in zip(grads, outs)], allow_unused=True)
    return [o.detach() for o in outs], [g if g is not None else torch.zeros_like(t) for g, t in zip(in_grads, inputs)]


def _rel_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(got, want):
        scale = b.float().abs().max().item()
        diff = (a.float() - b.float()).abs().max().item()
        if not math.isfinite(diff):
            return math.inf  # max() would drop a NaN and pass a backend that returns NaN
        worst = max(worst, diff / max(scale, 1e-12))
    return worst


def _parity(op: str, fn: Callable[..., Any], ref: Callable[..., Any], device: torch.device, size: str,
            dtype_name: str) -> ParityRow:
    dtype = DTYPES[dtype_name]
    tol = REL_TOL[dtype]
    ex = example(op, size, device, dtype)
    try:
        want_ex = example(op, size, device, torch.float32)
        want_out, want_grad = _fwd_bwd(want_ex, ref)
        got_out, got_grad = _fwd_bwd(ex, fn, [g.to(dtype) for g in _upstream(want_out)])
        err = _rel_error([*got_out, *got_grad], [*want_out, *want_grad])
    except Exception as exc:  # noqa: BLE001 - a backend that raises is a wrong backend, reported, not a crash
        return ParityRow(size, dtype_name, ex.shape, None, tol, False, f"{type(exc).__name__}: {exc}"[:300])
    if not math.isfinite(err):
        return ParityRow(size, dtype_name, ex.shape, None, tol, False, "NaN or inf in the outputs or gradients")
    return ParityRow(size, dtype_name, ex.shape, err, tol, err <= tol)


def _clock(device: torch.device) -> Callable[[Callable[[], None]], float]:
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_time

    def cpu_time(fn: Callable[[], None]) -> float:
        # Process CPU time of a one-thread run: a shared host that steals a core stretches wall time (and every
        # OpenMP barrier) by any factor, but not the CPU time the work itself takes (bench_kernels.py's ratio_cpu1).
        begin = time.process_time()
        fn()
        return time.process_time() - begin
    return cpu_time


def _speed(op: str, fn: Callable[..., Any], ref: Callable[..., Any], device: torch.device,
           repeats: int) -> tuple[float, float, float]:
    ex = example(op, "lane", device, torch.float32, timing=True)
    grads = _upstream(list(ex.run(ref)))
    run_ref = lambda: _fwd_bwd(ex, ref, grads)  # noqa: E731
    run_fn = lambda: _fwd_bwd(ex, fn, grads)  # noqa: E731
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        run_ref(), run_fn()
        _sync(device)
        clock = _clock(device)
        ref_s: list[float] = []
        fn_s: list[float] = []
        for i in range(repeats):
            # Alternate which goes first, so drift on a shared host hits both alike.
            pair = [(run_ref, ref_s), (run_fn, fn_s)]
            for call, times in (pair if i % 2 == 0 else pair[::-1]):
                times.append(clock(call))
    finally:
        torch.set_num_threads(threads)
    ref_ms, fn_ms = 1e3 * statistics.median(ref_s), 1e3 * statistics.median(fn_s)
    return ref_ms, fn_ms, ref_ms / fn_ms


def _interpretable(device: torch.device, backend: str, reason: str) -> bool:
    # The Triton kernels run on CPU tensors only in the interpreter, and only when the user asked for it.
    return (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and "triton" in backend
            and "triton is not importable" not in reason)


def check_backends(device: torch.device, ops: Optional[Sequence[str]] = None, sizes: Sequence[str] = SIZES,
                   dtypes: Sequence[str] = ("fp32", "bf16"), repeats: int = 5) -> list[BackendRow]:
    rows: list[BackendRow] = []
    for op in ops or [o for o in registered_ops() if o in EXAMPLES]:
        spec = get_op(op)
        for backend in spec.impls:
            dispatcher = Dispatcher(device)
            ctx = example(op, "lane", torch.device("cpu"), torch.float32).ctx
            try:
                resolved = dispatcher.resolve(op, backend, **ctx)
            except Exception as exc:  # noqa: BLE001 - no eligible backend at all is itself the finding
                rows.append(BackendRow(op, backend, "-", "wrong", f"resolution failed: {exc}"))
                continue
            record, status = resolved.record, "ok"
            if record.observed != backend:
                if not _interpretable(device, backend, record.reason):
                    rows.append(BackendRow(op, backend, record.observed, "unavailable", record.reason))
                    continue
                forced = Dispatcher(device)
                forced.force(op, backend)
                resolved = forced.resolve(op, backend, **ctx)
                record, status = resolved.record, "interpreted"
            row = BackendRow(op, backend, record.observed, status, record.reason)
            row.parity = [_parity(op, resolved.fn, spec.ref, device, size, dtype)
                          for size in sizes for dtype in dtypes]
            if not all(p.ok for p in row.parity):
                row.status = "wrong"
            elif status == "ok" and "lane" in sizes and resolved.fn is not spec.ref:
                row.ref_ms, row.backend_ms, row.speedup = _speed(op, resolved.fn, spec.ref, device, repeats)
            rows.append(row)
    return rows


def _family_model_cfg() -> Any:
    from ablate.config.schema import ModelConfig

    # Small but lane-shaped: every dim a multiple of 8 (grouped GEMM alignment), chunk divides the sequence.
    return ModelConfig(d_model=64, n_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32,
                       kv_lora_rank=32, n_experts=4, top_k=2, d_expert=64, ssm_d_state=16, ssm_head_dim=16,
                       ssm_chunk=8, vocab_size=128)


def block_fwd_bwd(block: torch.nn.Module, stream: torch.Tensor, delta: torch.Tensor) -> list[torch.Tensor]:
    """A block's outputs and its parameter gradients (the model test compares compiled and eager with it too)."""
    outs = block(stream, delta)
    loss = sum(o.float().sum() * (i + 1) for i, o in enumerate(outs[:2]))
    if len(outs) > 2:  # MoE: the aux loss is differentiable too
        loss = loss + outs[2]
    params = [p for p in block.parameters() if p.requires_grad]
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, params))


def check_families(device: torch.device, families: str = "AEMR", backend: str = "inductor") -> list[FamilyRow]:
    """One block per family, ``torch.compile(fullgraph=True)`` against eager: breaks, graphs, parity."""
    from torch._dynamo.utils import counters

    import typing

    from ablate.config.schema import FeatureConfig
    from trainers.model import HybridLM

    rows = []
    for letter in families:
        name, value = FAMILY_BACKENDS[letter]
        assignment = f"{name}={value}"
        features = replace(FeatureConfig(), **{name: typing.get_type_hints(FeatureConfig)[name](value)})
        torch.manual_seed(0)
        model = HybridLM(replace(_family_model_cfg(), pattern=letter), features, Dispatcher(device)).to(device)
        (_, block), = list(model.blocks())
        gen = torch.Generator().manual_seed(1)
        stream, delta = (torch.randn(2, 16, 64, generator=gen).to(device) for _ in range(2))
        torch._dynamo.reset()
        counters.clear()
        try:
            with torch.compiler.set_stance("force_eager"):
                eager = block_fwd_bwd(block, stream, delta)
            compiled = torch.compile(block, fullgraph=True, backend=backend)
            got = block_fwd_bwd(compiled, stream, delta)
            got = block_fwd_bwd(compiled, stream, delta)  # a second call must reuse the graph (no recompile)
        except Exception as exc:  # noqa: BLE001 - fullgraph raises on a graph break: that is the finding
            rows.append(FamilyRow(letter, assignment, None, None, None, False, f"{type(exc).__name__}: {exc}"[:300]))
            continue
        breaks = sum(counters["graph_break"].values())
        graphs = int(counters["stats"]["unique_graphs"])
        err = _rel_error(got, eager)
        tol = REL_TOL[torch.float32]
        ok = breaks == 0 and graphs == 1 and err <= tol
        detail = "" if ok else f"graph breaks {breaks}, graphs {graphs}, error {err:.2e} (tolerance {tol:.0e})"
        rows.append(FamilyRow(letter, assignment, breaks, graphs, err if math.isfinite(err) else None, ok, detail))
    return rows


def nvml_facts(device: torch.device, during: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Device facts and an energy sample (joules over ``during``) from NVML; on CPU, why there are none."""
    if device.type != "cuda":
        return {"available": False, "why": "CPU device: NVML describes NVIDIA GPUs only"}
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver / library: recorded, never guessed
        return {"available": False, "why": f"NVML unavailable: {exc}"}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        facts: dict[str, Any] = {"available": True, "name": pynvml.nvmlDeviceGetName(handle),
                                 "driver": pynvml.nvmlSystemGetDriverVersion(),
                                 "memory_total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)}
        for key, call in (("sm_clock_max_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                          ("mem_clock_max_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle,
                                                                                         pynvml.NVML_CLOCK_MEM)),
                          ("power_limit_w", lambda: pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1e3),
                          ("ecc_mode", lambda: pynvml.nvmlDeviceGetEccMode(handle)[0]),
                          ("temperature_c", lambda: pynvml.nvmlDeviceGetTemperature(handle,
                                                                                    pynvml.NVML_TEMPERATURE_GPU))):
            try:
                facts[key] = call()
            except pynvml.NVMLError as exc:
                facts[key] = None
                facts[f"{key}_why"] = str(exc)
        if during is not None:
            try:
                start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                begin = time.perf_counter()
                during()
                torch.cuda.synchronize(device)
                seconds = time.perf_counter() - begin
                joules = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - start_mj) / 1e3
                facts["energy_sample"] = {"joules": joules, "seconds": seconds, "mean_watts": joules / seconds}
            except pynvml.NVMLError as exc:
                facts["energy_sample"] = {"joules": None, "why": f"energy counter unsupported: {exc}"}
        return facts
    finally:
        pynvml.nvmlShutdown()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("doctor --device: got 'cuda' but torch sees no CUDA device here; allowed: cpu, auto")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"doctor --device: got {name!r}; allowed: cpu, cuda, auto")
    return torch.device(name)


def run_deep(device: torch.device, ops: Optional[Sequence[str]] = None, sizes: Sequence[str] = SIZES,
             dtypes: Sequence[str] = ("fp32", "bf16"), families: str = "AEMR", repeats: int = 5,
             compile_backend: str = "inductor", comm: bool = True) -> DeepReport:
    backends = check_backends(device, ops, sizes, dtypes, repeats)
    family_rows: list[FamilyRow] = []

    def run_families() -> None:
        family_rows.extend(check_families(device, families, compile_backend))

    # On CUDA the energy sample is taken while the family blocks compile and step, so they run once, not twice.
    nvml = nvml_facts(device, run_families if device.type == "cuda" else None)
    if not family_rows:  # CPU, or NVML could not sample (it never called run_families)
        run_families()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (os.uname().machine + " CPU")
    from ablate.comm_check import allreduce_bandwidth

    return DeepReport(str(device), name, torch.__version__, torch.get_num_threads(), TIMING[device.type], backends,
                      family_rows, nvml, allreduce_bandwidth(device) if comm else {})
