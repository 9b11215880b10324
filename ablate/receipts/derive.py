"""Every derived figure of a receipt, computed from its raw per-step fields: one definition for the trainer
that writes a receipt and for the validator that checks it.

How to use::

    steps = [Step(phase, label, step_s, data_s, cadence_s, tokens), ...]   # every executed step, in order
    parts = loop_parts(steps, data_is_badput=True)     # goodput, compile warmup, recompile, data wait, idle, ...
    proj = project(setup_s, steps, horizon_steps=10_000, tokens_per_step=256)
    proj.projected_s, proj.tokens_per_s                # the promotion metric

The arm's time splits three ways (issue "right verdicts"):

- executor start-up (process spawn, imports, worker-group formation: everything before the lane's features are
  first read) is badput ``startup`` and never compared: no feature can change it;
- one-time feature-dependent cost: ``setup`` (model construction, kernel resolution, compile wrapping, engine)
  plus the full cadence of every step labelled compile warmup or recompile (explicit warmup steps included);
- recurring time per step: the mean cadence (end of one step to the end of the next, so data wait and host gaps
  are in it) over the steady budget steps. Steps sampled for family time share carry hooks and are left out.

An arm's projected time to the lane's horizon is ``one_time + (horizon - warm budget steps) x recurring``, and
its promotion metric is ``horizon x tokens_per_step / projected``. The mean (not the median) cadence is used
because a production run pays every step, slow ones included; blocks under foreign load are flagged instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pydantic import BaseModel, ConfigDict

WARM_LABELS = ("compile_warmup", "recompile")
LABELS = ("compile_warmup", "steady", "recompile", "sampled")
PHASES = ("warmup", "budget")


@dataclass(frozen=True)
class Step:
    phase: str
    """warmup (explicit warmup step, lr 0) or budget (counts toward the token budget)."""
    label: str
    """compile_warmup, steady, recompile or sampled (see ``classify``)."""
    step_s: float
    """Compute: forward, backward and optimizer step (CUDA: device time between events)."""
    data_s: float
    """Host time to build the batch (badput on CPU; overlapped with device work on CUDA)."""
    cadence_s: float
    """From the end of the previous step (or the loop start) to the end of this one, on the step clock."""
    tokens: int
    phase_s: float = 0.0
    """Checkpoint/eval time spent in the gap before this step (badput of its own, so not idle)."""
    wait_s: float = 0.0
    """Interleaved blocks: time this arm waited while its partner took its turn (never inside ``cadence_s``)."""


def classify(phases: Sequence[str], compile_events: Sequence[int], sampled: Sequence[bool],
             warmup_resolved: str) -> list[str]:
    """Labels from compile events, not from a step index (seeds/003, receipt-schema §8.3).

    Explicit warmup steps are compile warmup. With warmup skipped, the first budget step and every leading budget
    step in which a compile event fired are compile warmup. After that a step with a compile event is a recompile;
    steps carrying family hooks are ``sampled``.
    """
    labels = []
    settling = warmup_resolved == "skip"
    first_budget = True
    for phase, events, is_sampled in zip(phases, compile_events, sampled):
        if phase == "warmup":
            labels.append("compile_warmup")
            continue
        if settling and (first_budget or events > 0):
            labels.append("compile_warmup")
        elif events > 0:
            settling = False
            labels.append("recompile")
        else:
            settling = False
            labels.append("sampled" if is_sampled else "steady")
        first_budget = False
    return labels


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


@dataclass(frozen=True)
class LoopParts:
    """The loop's share of the time accounting, each part measured (none is a remainder)."""

    goodput_s: float
    compile_warmup_s: float
    recompile_s: float
    data_wait_s: float
    idle_s: float
    """Gaps between steps on the step clock: host gaps on CPU, device idle between steps on CUDA."""
    sampling_s: float
    """Extra time of steps carrying family hooks, above the ideal step (their productive part is goodput)."""
    productive_steps: int
    paired_wait_s: float = 0.0
    """Interleaved blocks: time spent waiting for the partner arm's turns between steps."""


def loop_parts(steps: Sequence[Step], data_is_badput: bool) -> LoopParts:
    steady = [s.step_s for s in steps if s.label == "steady"]
    ideal = step_statistics(steady)["ideal_s"]
    goodput = sum(steady)
    sampling = 0.0
    for step in steps:
        if step.label == "sampled":
            # A sampled step did real training, but its hooks slowed it: bill it at the ideal step time.
            productive = step.step_s if ideal is None else min(step.step_s, ideal)
            goodput += productive
            sampling += step.step_s - productive
    data = sum(s.data_s for s in steps) if data_is_badput else 0.0
    idle = sum(max(0.0, s.cadence_s - s.step_s - s.phase_s - (s.data_s if data_is_badput else 0.0))
               for s in steps)
    return LoopParts(goodput_s=goodput,
                     compile_warmup_s=sum(s.step_s for s in steps if s.label == "compile_warmup"),
                     recompile_s=sum(s.step_s for s in steps if s.label == "recompile"),
                     data_wait_s=data, idle_s=idle, sampling_s=sampling,
                     productive_steps=sum(1 for s in steps if s.label in ("steady", "sampled")),
                     paired_wait_s=sum(s.wait_s for s in steps))


class Projection(BaseModel):
    """One arm's projected cost of the production run its lane stands for: the promotion metric, stored in the
    receipt as ``projection`` and recomputed from the per-step records by the validator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    horizon_steps: int
    setup_s: float
    warm_s: float
    """Full cadence of every compile-warmup and recompile step (explicit warmup steps included)."""
    warm_budget_steps: int
    """Budget steps inside ``warm_s``: they produced tokens, so the horizon needs that many fewer steps."""
    one_time_s: float
    recurring_step_s: Optional[float]
    recurring_steps: int
    projected_s: Optional[float]
    tokens_per_s: Optional[float]
    """horizon_steps x tokens per step / projected_s: what the block ratios compare."""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def recurring_step(steps: Sequence[Step]) -> tuple[Optional[float], int]:
    cadences = [s.cadence_s for s in steps if s.label == "steady" and s.phase == "budget"]
    return (sum(cadences) / len(cadences) if cadences else None), len(cadences)


def project_time(one_time_s: float, recurring_step_s: float, warm_budget_steps: int, horizon_steps: int) -> float:
    """Projected seconds to ``horizon_steps`` optimizer steps (the arithmetic every caller shares)."""
    return one_time_s + max(0, horizon_steps - warm_budget_steps) * recurring_step_s


def project(setup_s: float, steps: Sequence[Step], horizon_steps: int, tokens_per_step: int) -> Projection:
    warm = [s for s in steps if s.label in WARM_LABELS]
    warm_s = sum(s.cadence_s for s in warm)
    warm_budget = sum(1 for s in warm if s.phase == "budget")
    one_time = setup_s + warm_s
    recurring, count = recurring_step(steps)
    projected = tokens_per_s = None
    if recurring is not None and recurring > 0:
        projected = project_time(one_time, recurring, warm_budget, horizon_steps)
        tokens_per_s = horizon_steps * tokens_per_step / projected
    return Projection(horizon_steps=horizon_steps, setup_s=setup_s, warm_s=warm_s, warm_budget_steps=warm_budget,
                      one_time_s=one_time, recurring_step_s=recurring, recurring_steps=count,
                      projected_s=projected, tokens_per_s=tokens_per_s)


def close_enough(stored: Optional[float], derived: Optional[float], rel: float = 1e-6, abs_: float = 1e-9) -> bool:
    """Stored vs recomputed figure: equal up to float formatting (both None counts as equal)."""
    if stored is None or derived is None:
        return stored is None and derived is None
    if not (math.isfinite(stored) and math.isfinite(derived)):
        return False
    return abs(stored - derived) <= max(abs_, rel * max(abs(stored), abs(derived)))
