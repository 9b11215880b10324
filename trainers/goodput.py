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

and on the orchestrator side ``account_time(...)`` splits the wall clock that starts at the orchestrator's
``scheduled_at`` stamp into goodput and named badput, each measured on its own; what nothing measured is
``unattributed``, which must stay small (a check, not a plug that closes the sum by construction).

Steady state (seeds/003, receipt-schema §8.3): labelled from compile events, not from a step index. Explicit
warmup steps are compile warmup. With warmup skipped, the first budget step and every leading budget step in
which a compile event fired are compile warmup. After that, a step with a compile event is a recompile (badput,
and a disqualifier); steps sampled for family time share are billed at the ideal step time and their excess is
reported as ``sampling`` badput, so hooks never inflate goodput or the step statistics. The labelling and the
arithmetic live in ``ablate.receipts.derive``, which the receipt validator re-runs on the stored steps.

On CUDA, step times come from CUDA events recorded on the stream and resolved in ``finish()``; the host never
waits inside the loop. Host-side data time then overlaps device work, so it is informational there and the
device's idle time between steps (from consecutive step-end events) lands in ``idle``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

from ablate.receipts.derive import Step, classify as classify_labels, loop_parts, percentile, step_statistics
from ablate.receipts.schema import BADPUT_CATEGORIES, TIME_TOLERANCE, TIME_TOLERANCE_FLOOR_S

__all__ = ["StepRecord", "LoopSummary", "StepTracker", "Accounting", "account_time", "classify", "summarize",
           "percentile", "step_statistics"]


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
    cadence_s: float = 0.0
    """End of the previous step (or the loop start) to the end of this one, on the step clock."""
    phase_s: float = 0.0
    """Checkpoint/eval phases that ran in the gap before this step."""
    wait_s: float = 0.0
    """Interleaved blocks: time waited for this step's turn (excluded from the cadence)."""
    label: str = ""
    """Set by ``classify``: compile_warmup, steady, recompile or sampled."""

    def view(self) -> Step:
        return Step(phase=self.phase, label=self.label, step_s=self.step_s, data_s=self.data_s,
                    cadence_s=self.cadence_s, tokens=self.tokens, phase_s=self.phase_s, wait_s=self.wait_s)


@dataclass
class LoopSummary:
    """The in-worker share of the accounting, from the end of setup to the end of the last step."""

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
    data_is_badput: bool = True
    paired_wait_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LoopSummary":
        data = dict(data)
        data["steps"] = [StepRecord(**s) for s in data.get("steps", [])]
        return cls(**data)

    def views(self) -> list[Step]:
        return [s.view() for s in self.steps]


def classify(steps: list[StepRecord], warmup_resolved: str) -> None:
    """Label each step compile_warmup / steady / recompile / sampled, in place (``ablate.receipts.derive``)."""
    labels = classify_labels([s.phase for s in steps], [s.compile_events for s in steps],
                             [s.sampled for s in steps], warmup_resolved)
    for step, label in zip(steps, labels):
        step.label = label


def summarize(steps: list[StepRecord], loop_s: float, checkpoint_s: float, eval_s: float,
              data_is_badput: bool) -> LoopSummary:
    """Classified steps -> the loop's share of the accounting; every part is measured, none is a remainder."""
    parts = loop_parts([s.view() for s in steps], data_is_badput)
    return LoopSummary(loop_s=loop_s, goodput_s=parts.goodput_s, compile_warmup_s=parts.compile_warmup_s,
                       recompile_s=parts.recompile_s, data_wait_s=parts.data_wait_s, checkpoint_s=checkpoint_s,
                       eval_s=eval_s, idle_s=parts.idle_s, sampling_overhead_s=parts.sampling_s, steps=steps,
                       data_is_badput=data_is_badput, paired_wait_s=parts.paired_wait_s)


class StepTracker:
    """Online recording of steps and phases in the worker. Costs three clock reads and one append per step."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.steps: list[StepRecord] = []
        self._phase_s: dict[str, float] = {"checkpoint": 0.0, "eval": 0.0}
        self._events: list[tuple[Any, Any]] = []
        self._origin: Any = None
        self._t0 = 0.0
        self._t_begin = 0.0
        self._t_data = 0.0
        self._t_prev_end = 0.0
        self._gap_phase_s = 0.0
        self._pending: Optional[tuple[str, bool]] = None
        self._extended: dict[int, Any] = {}
        """CUDA: step index -> the event its cadence runs to instead of its stop event (``extend_last``)."""
        self.first_step_end: Optional[float] = None
        """time.time() when the first executed step ended (time to first step, from the orchestrator's stamp)."""

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        if self.cuda:
            import torch

            # The first step's cadence is measured on the device clock from here.
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        self._t0 = self._t_prev_end = time.perf_counter()

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
            loss: Optional[float] = None, wait_s: float = 0.0) -> StepRecord:
        assert self._pending is not None, "end() without begin()"
        now = time.perf_counter()
        if self.cuda:
            import torch

            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._events[-1] = (self._events[-1][0], stop)
        phase, sampled = self._pending
        # Alone, a step's cadence runs from the previous step's end. In an interleaved block everything between
        # this arm's previous turn and this one belongs to the partner (``wait_s``): the cadence starts at the turn.
        since = self._t_prev_end if wait_s <= 0 else max(self._t_prev_end, self._t_begin)
        record = StepRecord(index=len(self.steps), phase=phase, step_s=now - self._t_data,
                            data_s=self._t_data - self._t_begin, sampled=sampled, tokens=tokens,
                            compile_events=compile_events, compile_s=compile_s, loss=loss,
                            cadence_s=now - since, phase_s=self._gap_phase_s, wait_s=wait_s)
        self._t_prev_end = now
        self._gap_phase_s = 0.0
        self.steps.append(record)
        self._pending = None
        if self.first_step_end is None:
            # Once per arm: a sync here makes time-to-first-step true on CUDA without touching steady steps.
            self._sync()
            self.first_step_end = time.time()
        return record

    def extend_last(self) -> None:
        """The last recorded step's cadence runs to now, and the next step's starts here.

        Why: what runs between an explicit warmup's last step and the first budget step (lr restored, optimizer
        state reset, the energy window opened behind a device sync) is a one-time cost of the warmup policy. Left
        in the gap, it landed in the first budget step's cadence, which is steady under explicit warmup: a
        recurring mean of ~6 steps carried it to the horizon, and the explicit arm looked slower (found in
        review). Extended, it is the last warmup step's, which is compile warmup (one-time, never recurring).
        """
        if not self.steps:
            return
        self._sync()
        now = time.perf_counter()
        if self.cuda:
            import torch

            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            self._extended[len(self.steps) - 1] = mark
        else:
            self.steps[-1].cadence_s += now - self._t_prev_end
        self._t_prev_end = now

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
            elapsed = time.perf_counter() - start
            self._phase_s[name] += elapsed
            self._gap_phase_s += elapsed

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def finish(self, warmup_resolved: str) -> LoopSummary:
        self._sync()
        loop_s = time.perf_counter() - self._t0
        if self.cuda:
            previous = self._origin
            for index, (record, (start, stop)) in enumerate(zip(self.steps, self._events)):
                if start is not None and stop is not None:
                    record.step_s = start.elapsed_time(stop) / 1000.0
                    end = self._extended.get(index, stop)
                    if previous is not None:
                        # Device cadence: a host-bound step shows up as device idle before its kernels start.
                        record.cadence_s = max(record.step_s, previous.elapsed_time(end) / 1000.0 - record.wait_s)
                    previous = end
        classify(self.steps, warmup_resolved)
        return summarize(self.steps, loop_s, self._phase_s["checkpoint"], self._phase_s["eval"],
                         data_is_badput=not self.cuda)


@dataclass
class Accounting:
    """The receipt's ``time`` block and any violation found while closing it."""

    wall_s: float
    goodput_s: float
    badput_s: dict[str, float]
    goodput_fraction: float
    violation: Optional[str]


def account_time(wall_s: float, queue_wait_s: float, startup_s: float, setup_s: float,
                 loop: Optional[LoopSummary], restart_s: float = 0.0, teardown_s: float = 0.0,
                 extra_checkpoint_s: float = 0.0, setup_wait_s: float = 0.0) -> Accounting:
    """Every part of the wall clock, each measured on its own; ``unattributed`` is what nothing measured.

    ``startup`` is executor start-up (spawn, imports, worker group: before the lane's features are first read),
    ``setup`` the feature-dependent model/kernel/compile/engine construction, ``restart`` attempts lost to
    failures, ``teardown`` the time after the loop (result hand-back, process exit, worker-group shutdown).
    A negative part (clock skew between the orchestrator and the worker's node) or an ``unattributed`` below
    minus the tolerance (parts over-counted) is a violation; so is a large positive ``unattributed`` on an arm
    that finished (checked by the receipt builder against ``UNATTRIBUTED_LIMIT``).
    """
    loop = loop or LoopSummary(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    badput = {
        "queue_wait": queue_wait_s,
        "startup": startup_s,
        "setup": setup_s,
        "compile_warmup": loop.compile_warmup_s,
        "recompile": loop.recompile_s,
        "data_wait": loop.data_wait_s,
        "checkpoint": loop.checkpoint_s + extra_checkpoint_s,
        "eval": loop.eval_s,
        "idle": loop.idle_s,
        "sampling": loop.sampling_overhead_s,
        "paired_wait": loop.paired_wait_s + setup_wait_s,
        "restart": restart_s,
        "teardown": teardown_s,
    }
    tolerance = max(TIME_TOLERANCE * wall_s, TIME_TOLERANCE_FLOOR_S)
    negative = {k: round(v, 6) for k, v in badput.items() if v < -tolerance}
    badput = {k: max(0.0, v) for k, v in badput.items()}
    badput["unattributed"] = wall_s - loop.goodput_s - sum(badput.values())
    assert set(badput) == set(BADPUT_CATEGORIES), "badput categories drifted from the receipt schema"
    violation = None
    if negative:
        violation = f"negative time {negative}: the orchestrator's and the worker's clocks disagree"
    elif badput["unattributed"] < -tolerance:
        violation = (f"measured parts exceed wall = {wall_s:.3f}s by {-badput['unattributed']:.3f}s "
                     f"(tolerance {tolerance:.3f}s): something was counted twice")
    fraction = loop.goodput_s / wall_s if wall_s > 0 else 0.0
    return Accounting(wall_s=wall_s, goodput_s=loop.goodput_s, badput_s=badput, goodput_fraction=fraction,
                      violation=violation)
