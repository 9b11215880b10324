"""`ablate validate --plan`: the expanded plan a user checks before paying for it.

How to use::

    console.print(*render_plan(sweep, plan, path))      # rich renderables; no Ray, no MLflow, no torch

Per lane: device (as requested, and what this machine would give it; for ``auto``, the baselines a cluster that runs
the arms on the other device class would plan), precision, world size, pattern and its layer counts, tokens per
step, steps per arm and the horizon. Per tested value: baseline and candidate, kind, blocks per round. The A/A blocks, what was refused before any arm (inert toggles, values already the default), and the
resources one block holds against what this machine offers (Ray is not started: a cluster may offer more, and
``ablate sweep`` re-checks against the cluster it runs on).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from ablate.config.auto_device import planned_device
from ablate.config.features import differing_features
from ablate.config.lane_shape import AUTO
from ablate.config.load import load_sweep
from ablate.config.pattern import family_counts, parse_pattern
from ablate.config.schema import ConfigError, LaneConfig, SweepConfig
from ablate.sweep.plan import SweepPlan, plan_sweep
from ablate.sweep.resources import NodeFit, block_need, detect_local, fit_node


def _lane_line(key: str, lane: LaneConfig, local_gpus: int) -> str:
    counts = family_counts(parse_pattern(lane.model.pattern))
    layers = " ".join(f"{letter}{n}" for letter, n in counts.items() if n)
    requested = lane.hardware.device.value
    # auto: what the sweep plans for (NVML, which CUDA_VISIBLE_DEVICES=-1 hides from, unlike Ray's count)
    here = planned_device(lane) if requested == AUTO else "cuda" if requested == "cuda" and local_gpus else "cpu"
    batch = lane.batch
    tokens = batch.micro_batch * batch.seq_len * batch.grad_accum * lane.engine.workers
    return (f"lane {key[:12]}: device {requested} (here: {here}), precision {lane.precision.value}, world size "
            f"{lane.engine.workers} ({lane.engine.name.value}), pattern {lane.model.pattern} ({layers}), "
            f"{tokens:,} tokens/step, {lane.budget.steps} steps per arm, horizon {lane.budget.horizon_steps:,} "
            f"steps, compile {lane.compile.posture.value}")


def _elsewhere_line(sweep: SweepConfig, path: Path, plan_skipped: list[tuple[str, str]]) -> str:
    """What an ``auto`` lane's plan becomes on a cluster that runs its arms on the other device class: ``ablate
    sweep`` plans it again there, with the lane overrides won on that device (``ablate.sweep.run``)."""
    here = planned_device(sweep.lane)
    other = "cpu" if here == "cuda" else "cuda"
    lead = f"device auto: planned for {here} (this machine); on a cluster that runs the arms on {other}, `ablate " \
           f"sweep` plans it again"
    try:
        there, defaults = load_sweep(path, device=other)
        skipped = plan_sweep(there, "validate", defaults, device=other).skipped
    except ConfigError as exc:
        return f"{lead}, and refuses it there: {exc}"
    moved = [f"{name} {before!r} -> {after!r}" for name, before, after in differing_features(sweep.lane, there.lane)]
    line = (f"{lead} with other baselines: {'; '.join(moved)}" if moved
            else f"{lead}, with the same baselines")
    mine = set(plan_skipped)
    return line + "".join(f"; not run there: {what} ({why})" for what, why in skipped if (what, why) not in mine)


def render_plan(sweep: SweepConfig, plan: SweepPlan, path: Path) -> list[Any]:
    cpus, gpus = detect_local()
    out: list[Any] = [Text(f"plan of {path} (campaign {sweep.name}, design {plan.design}, "
                           f"{sweep.block_mode.value} blocks, seed {plan.seed})", style="bold")]
    lanes: dict[str, LaneConfig] = {}
    for block in plan.blocks:
        lanes.setdefault(block.lane_key, block.arms[0].lane)
    out += [Text(_lane_line(key, lane, gpus)) for key, lane in sorted(lanes.items())]
    if sweep.lane.hardware.device.value == AUTO:
        out.append(Text(_elsewhere_line(sweep, path, plan.skipped)))

    table = Table("lane", "feature", "baseline", "candidate", "kind", "blocks per round",
                  title="what each round measures")
    groups = Counter((b.lane_key, b.feature, str(b.baseline_value), str(b.candidate_value), b.kind)
                     for b in plan.blocks)
    for (key, feature, baseline, candidate, kind), count in sorted(groups.items(), key=lambda g: (g[0][0],
                                                                                                  g[0][1] or "")):
        if feature is None:
            table.add_row(key[:12], "A/A (noise floor)", "defaults", "defaults", "aa", str(count))
        else:
            table.add_row(key[:12], feature, baseline, candidate, kind, str(count))
    out.append(table)
    if plan.skipped:
        refused = Table("not run", "why", title="refused before any arm runs")
        for what, why in plan.skipped:
            refused.add_row(what, why)
        out.append(refused)

    need = block_need(plan.blocks, sweep.resources)
    fit: NodeFit = fit_node(need, "local", "this machine", {"CPU": float(cpus), "GPU": float(gpus),
                                                            "ablate_driver_cpu": float(cpus),
                                                            "ablate_driver_gpu": float(gpus)})
    arms = 2 * len(plan.blocks)
    at_once = min(fit.arms, sweep.resources.max_concurrent_blocks or fit.arms)
    out.append(Text(f"{len(plan.blocks)} blocks, {arms} arms per round. Each block needs {need.describe()}; this "
                    f"machine has {cpus} CPU, {gpus} GPU -> "
                    + (f"{at_once} block(s) at once" if fit.arms else f"no block fits here ({fit.why_not})")
                    + f". Host memory an arm frees: {sweep.resources.host_allocator.value} "
                      "(resources.host_allocator). `ablate sweep` checks again against the Ray cluster it runs on, "
                      "and each node's `ablate doctor --deep` document."))
    return out
