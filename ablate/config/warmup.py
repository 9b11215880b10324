"""The warmup rule (the seeds'): whether an arm runs explicit warmup steps before its budget, decided from the lane
and the device that actually runs it. Torch-free: the trainer applies it (``trainers.loop``), and so do the feature
registry's inert check and a trial's pairing check (``trainers.run.can_interleave``), which run in processes whose
work needs no torch (a trial imports it only to record a failed arm's torch build).

How to use::

    decision = resolve_warmup(lane.compile.warmup, device_type="cuda", posture="regional", letters="AEMR",
                              warmup_steps=lane.compile.warmup_steps)
    decision.resolved, decision.steps, decision.reason   # "skip", 0, "auto: CUDA + regional compile + E blocks ..."
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WARMUP_SKIP_REASON = ("auto: CUDA + regional compile + E blocks; explicit warmup stalls this lane shape "
                      "(seeds/003), so caches fill lazily during the first steps")


@dataclass(frozen=True)
class WarmupDecision:
    requested: str
    resolved: str
    """explicit (run warmup steps before the budget) or skip (the budget's first steps settle the caches)."""
    reason: str
    steps: int
    """Explicit warmup steps that will run (0 when skipped)."""


def resolve_warmup(policy: Any, device_type: str, posture: Any, letters: str, warmup_steps: int) -> WarmupDecision:
    """The seeds' rule: ``auto`` skips explicit warmup on CUDA + regional compile + E blocks, else warms up.

    ``device_type`` is the device that actually runs (after any CPU fallback), not the one asked for.
    """
    requested = getattr(policy, "value", policy)
    posture = getattr(posture, "value", posture)
    if requested == "skip":
        return WarmupDecision(requested, "skip", "skip: requested", 0)
    if requested == "auto":
        if device_type == "cuda" and posture == "regional" and "E" in letters:
            return WarmupDecision(requested, "skip", WARMUP_SKIP_REASON, 0)
        unmet = [cond for cond, ok in (("device is not CUDA", device_type == "cuda"),
                                       (f"compile posture is {posture}, not regional", posture == "regional"),
                                       ("pattern has no E blocks", "E" in letters)) if not ok]
        reason = "auto: explicit warmup because " + "; ".join(unmet)
    elif requested == "explicit":
        reason = "explicit: requested"
    else:
        raise ValueError(f"lane.compile.warmup: got {requested!r}; allowed: explicit, skip, auto")
    if warmup_steps == 0:
        return WarmupDecision(requested, "skip", reason + "; but lane.compile.warmup_steps is 0", 0)
    return WarmupDecision(requested, "explicit", reason, warmup_steps)
