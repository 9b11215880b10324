"""Where an arm's wall time went: goodput (steady-state steps) and named badput, plus step statistics.

How to use (inside the worker loop)::

    tracker = StepTracker(cuda=device.type == "cuda")
    tracker.start()
    for step in ...:
        tracker.begin(phase="budget", sampled=False)      # host time since the previous step -> idle
        batch = next_batch(); tracker.data_done()         # data fetch -> data_wait
        out = engine.step(batch)
        tracker.end(tokens=..., compile_events=..., compile_s=...)
    with tracker.phase("checkpoint"): ...
    summary = tracker.finish(warmup_resolved="explicit")  # one sync on CUDA, here and at start() only

and on the orchestrator side ``account_time(...)`` closes the sum against the wall clock that starts at the
orchestrator's ``scheduled_at`` stamp: goodput + every badput category + ``other`` = wall, ``other >= 0``.

Steady state (seeds/003, receipt-schema §8.3): labelled from compile events, not from a step index. Explicit
warmup steps are compile warmup. With warmup skipped, the first budget step and every leading budget step in
which a compile event fired are compile warmup. After that, a step with a compile event is a recompile (badput,
and a disqualifier); steps sampled for family time share are billed at the ideal step time and their excess is
reported as sampling overhead inside ``other``, so hooks never inflate goodput or the step statistics.

On CUDA, step times come from CUDA events recorded on the stream and resolved in ``finish()``; the host never
waits inside the loop. Host-side data time then overlaps device work, so it is informational there and the
device's idle time lands in ``idle``.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional, Sequence

from ablate.receipts.schema import BADPUT_CATEGORIES, TIME_TOLERANCE, TIME_TOLERANCE_FLOOR_S


@dataclass
class StepRecord:
    index: int
    """0-based over every executed step, warmup included."""
    phase: str
    """warmup (explicit warmup step) or budget (counts toward the token budget)."""
    step_s: float
    """Compute time: forward, backward and optimizer step (CUDA: between events on the stream)."""
    data_s: float
    """Host time to build the batch and move it to the device."""
    sampled: bool
    tokens: int = 0
    compile_events: int = 0
    compile_s: float = 0.0
    loss: Optional[float] = None
    label: str = ""
    """Set by ``classify``: compile_warmup, steady, recompile or sampled."""


@dataclass
class LoopSummary:
    """The in-worker share of the accounting, from the end of setup to the end of the last phase."""

    loop_s: float
    goodput_s: float
    compile_warmup_s: float
    recompile_s: float
    data_wait_s: float
    checkpoint_s: float
    eval_s: float
    idle_s: float
    sampling_overhead_s: float
    steps: list[StepRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LoopSummary":
        data = dict(data)
        data["steps"] = [StepRecord(**s) for s in data.get("steps", [])]
        return cls(**data)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def step_statistics(steady_s: Sequence[float]) -> dict[str, Any]:
    """p50/p90/mean, the ideal step (mean of steps <= median + 3 MAD, no 1 s floor) and anomalous steps.

    Google's ml-goodput-measurement drops steps under 1 s before this, which leaves nothing on sub-second steps;
    here every steady step counts. Anomalous = above median + 3 MAD; their extra time is measured against ideal.
    """
    if not steady_s:
        return {"p50_s": None, "p90_s": None, "mean_s": None, "ideal_s": None, "anomalous": 0,
                "anomalous_extra_s": 0.0}
    median = percentile(steady_s, 50)
    assert median is not None
    mad = percentile([abs(s - median) for s in steady_s], 50) or 0.0
    threshold = median + 3.0 * mad
    normal = [s for s in steady_s if s <= threshold]
    ideal = sum(normal) / len(normal)
    anomalous = [s for s in steady_s if s > threshold]
    return {"p50_s": median, "p90_s": percentile(steady_s, 90), "mean_s": sum(steady_s) / len(steady_s),
            "ideal_s": ideal, "anomalous": len(anomalous), "anomalous_extra_s": sum(s - ideal for s in anomalous)}


def classify(steps: list[StepRecord], warmup_resolved: str) -> None:
    """Label each step compile_warmup / steady / recompile / sampled, in place (rules in the module docstring)."""
    settling = warmup_resolved == "skip"
    first_budget = True
    for step in steps:
        if step.phase == "warmup":
            step.label = "compile_warmup"
            continue
        if settling and (first_budget or step.compile_events > 0):
            step.label = "compile_warmup"
        elif step.compile_events > 0:
            settling = False
            step.label = "recompile"
        else:
            settling = False
            step.label = "sampled" if step.sampled else "steady"
        first_budget = False


def summarize(steps: list[StepRecord], loop_s: float, checkpoint_s: float, eval_s: float,
              data_is_badput: bool) -> LoopSummary:
    """Turn classified steps into the loop's share of the accounting; idle is the loop's remainder."""
    steady = [s.step_s for s in steps if s.label == "steady"]
    ideal = step_statistics(steady)["ideal_s"]
    goodput = sum(steady)
    sampling_overhead = 0.0
    for step in steps:
        if step.label == "sampled":
            # A sampled step did real training, but hooks slowed it: bill it at the ideal step time.
            productive = step.step_s if ideal is None else min(step.step_s, ideal)
            goodput += productive
            sampling_overhead += step.step_s - productive
    compile_warmup = sum(s.step_s for s in steps if s.label == "compile_warmup")
    recompile = sum(s.step_s for s in steps if s.label == "recompile")
    data_wait = sum(s.data_s for s in steps) if data_is_badput else 0.0
    covered = goodput + sampling_overhead + compile_warmup + recompile + data_wait + checkpoint_s + eval_s
    return LoopSummary(loop_s=loop_s, goodput_s=goodput, compile_warmup_s=compile_warmup, recompile_s=recompile,
                       data_wait_s=data_wait, checkpoint_s=checkpoint_s, eval_s=eval_s,
                       idle_s=max(0.0, loop_s - covered), sampling_overhead_s=sampling_overhead, steps=steps)


class StepTracker:
    """Online recording of steps and phases in the worker. Costs two clock reads and one append per step."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.steps: list[StepRecord] = []
        self._phase_s: dict[str, float] = {"checkpoint": 0.0, "eval": 0.0}
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0
        self._t_begin = 0.0
        self._t_data = 0.0
        self._pending: Optional[tuple[str, bool]] = None
        self.first_step_end: Optional[float] = None
        """time.time() when the first executed step ended (time to first step, from the orchestrator's stamp)."""

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def begin(self, phase: str, sampled: bool = False) -> None:
        self._t_begin = time.perf_counter()
        self._pending = (phase, sampled)

    def data_done(self) -> None:
        self._t_data = time.perf_counter()
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))

    def end(self, tokens: int, compile_events: int = 0, compile_s: float = 0.0,
            loss: Optional[float] = None) -> StepRecord:
        assert self._pending is not None, "end() without begin()"
        now = time.perf_counter()
        if self.cuda:
            import torch

            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._events[-1] = (self._events[-1][0], stop)
        phase, sampled = self._pending
        record = StepRecord(index=len(self.steps), phase=phase, step_s=now - self._t_data,
                            data_s=self._t_data - self._t_begin, sampled=sampled, tokens=tokens,
                            compile_events=compile_events, compile_s=compile_s, loss=loss)
        self.steps.append(record)
        self._pending = None
        if self.first_step_end is None:
            # Once per arm: a sync here makes time-to-first-step true on CUDA without touching steady steps.
            self._sync()
            self.first_step_end = time.time()
        return record

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a named badput phase (checkpoint, eval). Synchronises at both ends: phase boundaries only."""
        assert name in self._phase_s, f"unknown phase {name!r}; known: {sorted(self._phase_s)}"
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._phase_s[name] += time.perf_counter() - start

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def finish(self, warmup_resolved: str) -> LoopSummary:
        self._sync()
        loop_s = time.perf_counter() - self._t0
        if self.cuda:
            for record, (start, stop) in zip(self.steps, self._events):
                if start is not None and stop is not None:
                    record.step_s = start.elapsed_time(stop) / 1000.0
        classify(self.steps, warmup_resolved)
        return summarize(self.steps, loop_s, self._phase_s["checkpoint"], self._phase_s["eval"],
                         data_is_badput=not self.cuda)


@dataclass
class Accounting:
    """The receipt's ``time`` block plus the informational split of ``other`` and any violation found."""

    wall_s: float
    goodput_s: float
    badput_s: dict[str, float]
    goodput_fraction: float
    detail: dict[str, float]
    violation: Optional[str]


def account_time(wall_s: float, queue_wait_s: float, startup_s: float, loop: Optional[LoopSummary],
                 restart_s: float = 0.0, teardown_s: float = 0.0, extra_checkpoint_s: float = 0.0) -> Accounting:
    """Close the sum: goodput + named badput + other = wall, with other >= 0.

    ``restart_s`` (attempts lost to failures) and ``teardown_s`` (after the loop: process exit, worker-group
    shutdown) have no category of their own; they are part of ``other`` and itemised in ``detail``.
    A negative remainder beyond the tolerance (e.g. a clock skew between the orchestrator and the worker's node)
    is a violation: ``other`` is then clamped to 0 and the receipt will not add up, which the validator rejects.
    """
    loop = loop or LoopSummary(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    badput = {
        "queue_wait": queue_wait_s,
        "startup": startup_s,
        "compile_warmup": loop.compile_warmup_s,
        "recompile": loop.recompile_s,
        "data_wait": loop.data_wait_s,
        "checkpoint": loop.checkpoint_s + extra_checkpoint_s,
        "eval": loop.eval_s,
        "idle": loop.idle_s,
    }
    assert set(badput) == set(BADPUT_CATEGORIES), "badput categories drifted from the receipt schema"
    tolerance = max(TIME_TOLERANCE * wall_s, TIME_TOLERANCE_FLOOR_S)
    negative = {k: round(v, 6) for k, v in badput.items() if v < -tolerance}
    badput = {k: max(0.0, v) for k, v in badput.items()}
    named = loop.goodput_s + sum(badput.values())
    remainder = wall_s - named
    detail = {"family_sampling": loop.sampling_overhead_s, "restart": restart_s, "teardown": teardown_s}
    detail["unattributed"] = remainder - sum(detail.values())
    violation = None
    if negative:
        violation = f"negative badput {negative}: the orchestrator's and the worker's clocks disagree"
    elif remainder < -tolerance:
        violation = (f"goodput + named badput = {named:.3f}s exceeds wall = {wall_s:.3f}s by {-remainder:.3f}s "
                     f"(tolerance {tolerance:.3f}s)")
    badput["other"] = max(0.0, remainder)
    fraction = loop.goodput_s / wall_s if wall_s > 0 else 0.0
    return Accounting(wall_s=wall_s, goodput_s=loop.goodput_s, badput_s=badput, goodput_fraction=fraction,
                      detail=detail, violation=violation)
