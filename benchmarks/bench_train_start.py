"""Where a two-worker (Ray Train) arm's start-up goes, stage by stage, and an interleaved A/B of the Train settings.

How to run me: ``python benchmarks/bench_train_start.py --reps 3`` (``--variants before,after``; ``--note`` for what
else loaded the host). Appends the run to ``benchmarks/results/train_start.json`` and prints per-variant medians.

One local Ray runtime (``ablate.sweep.resources.local_ray_init_kwargs``, as a sweep starts it), smoke lane with
``engine.workers: 2`` and 4 steps; arms go through ``trainers.run._run_ray_train`` one after another, the variants
interleaved (before, after, before, after, ...) so host load drifts over both alike. Variants:
- ``before``: Ray's ``TorchTrainer`` as Train builds it, no ``trainers.run.TRAIN_ENV_DEFAULTS`` (the job runtime
  env still sets the controller poll to 0.5 s and worker niceness 0, as in every sweep);
- ``torch_config``: the defaults plus the trainer without the unused Ray Data callback, with Ray's ``TorchConfig``
  (what ``run_arm`` did before ``trainers.train_backend``: the controller unpickles it and imports torch);
- ``after``: what ``run_arm`` does now (``torch_config`` with ``trainers.train_backend.ArmTorchConfig``; on this
  dashboard-less runtime, without Train's placement-group cleaner; each rank's arm in a process forked from the
  node's fork server);
- ``with_cleaner``: ``after`` with the placement-group cleaner put back (what it did before it was left out where no
  State API answers);
- ``arm_in_worker``: ``after`` with each rank's arm trained inside its Train worker, which imports torch and sets
  up the gloo group (what every multi-worker arm did before CPU arms ran in processes forked from the node's fork
  server, ``ArmTorchConfig.arm_process``).

Stages per arm (seconds; ``time.time()`` on one host): ``to_fit`` scheduled -> ``fit()`` called; ``controller``
fit() -> the controller's first log line (actor process start, imports); ``workers_created`` controller -> Train's
"Started training worker group" line (placement group, two fresh worker processes, RayTrainWorker imports, torch
and gloo set-up); ``to_train_fn`` -> rank 0's train function starts (the controller's log is not always flushed
when fit() returns: those three stages are then None, and ``fit_to_train_fn`` is their sum, always measured); ``fn_to_features`` (project imports, dynamo,
data); ``setup`` (model, engine); ``first_step``; ``train_rest``; ``fit_return`` rank 0 done -> fit() returns
(report, poll, worker-group shutdown). ``to_first_step_s`` = scheduled -> first step starts, as in bench_runner.
The criterion of issue 14 is the median of ``to_first_step_s`` over the arms of a variant (target <= 8 s).
Other engineers share the host: each run records load averages before and after, threads, the git commit.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_runner import _git, _load, append_run  # noqa: E402

from ablate.config.load import load_sweep  # noqa: E402
from ablate.sweep.resources import local_ray_init_kwargs  # noqa: E402
from trainers import run as run_module  # noqa: E402
from trainers.spec import ArmSpec  # noqa: E402

TARGET_S = 8.0
_ARM_TRAINER = run_module._trainer_class
"""``run_arm``'s trainer class as this tree builds it (``one_arm`` swaps the module's attribute per variant)."""


def _controller_lines(run_name: str) -> list[tuple[float, str]]:
    """(time, message) of the Train controller's structured log for one run, from this Ray session's logs."""
    lines: list[tuple[float, str]] = []
    for path in glob.glob("/tmp/ray/session_latest/logs/train/ray-train-app-controller-*.log"):
        with open(path) as handle:
            for raw in handle:
                try:
                    entry = json.loads(raw)
                except ValueError:
                    continue
                if entry.get("run_name") == run_name:
                    lines.append((entry["timestamp_ns"] / 1e9, entry["message"]))
    return sorted(lines)


def _ray_torch_config(use_gpu: bool, one_node: bool = True) -> Any:
    from ray.train.torch import TorchConfig

    return TorchConfig(backend="nccl" if use_gpu else "gloo")


def _variant(name: str) -> tuple[dict[str, str], Callable[[], type], Callable[[bool], Any]]:
    from ray.train.torch import TorchTrainer

    if name == "before":
        return {}, lambda: TorchTrainer, _ray_torch_config
    if name == "torch_config":
        return dict(run_module.TRAIN_ENV_DEFAULTS), run_module._trainer_class, _ray_torch_config
    if name == "after":
        return dict(run_module.TRAIN_ENV_DEFAULTS), run_module._trainer_class, run_module._backend_config
    if name == "with_cleaner":
        return dict(run_module.TRAIN_ENV_DEFAULTS), _with_cleaner, run_module._backend_config
    if name == "arm_in_worker":
        return dict(run_module.TRAIN_ENV_DEFAULTS), run_module._trainer_class, _arm_in_worker
    raise ValueError(f"unknown variant {name!r}; valid: before, torch_config, after, with_cleaner, arm_in_worker")


def _arm_in_worker(use_gpu: bool, one_node: bool = True) -> Any:
    """``after``'s backend with the arm trained inside the Train worker (Ray's torch set-up there), as every
    multi-worker arm did before CPU arms moved into processes forked from the node's fork server."""
    from trainers.train_backend import ArmTorchConfig

    return ArmTorchConfig(backend="nccl" if use_gpu else "gloo", arm_process=False)


def _with_cleaner() -> type:
    """``after``'s trainer, but always with Train's placement-group cleaner (one more actor process per arm), even
    where it cannot work: without a dashboard it has no State API to watch the controller with."""
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    base = _ARM_TRAINER()

    class WithCleaner(base):  # type: ignore[misc, valid-type]
        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            if not any(isinstance(c, PlacementGroupCleanerCallback) for c in callbacks):
                callbacks.append(PlacementGroupCleanerCallback())
            return callbacks

    return WithCleaner


def one_arm(lane: Any, receipts: Path, name: str, node_id: str) -> dict[str, Any]:
    defaults, trainer_class, backend_config = _variant(name)
    saved = (run_module.TRAIN_ENV_DEFAULTS, run_module._trainer_class, run_module._backend_config)
    (run_module.TRAIN_ENV_DEFAULTS, run_module._trainer_class,  # type: ignore[assignment]
     run_module._backend_config) = defaults, trainer_class, backend_config
    stamps: dict[str, Any] = {}
    fit_arm = run_module._fit_arm

    def timed_fit_arm(spec: ArmSpec, *args: Any, **kwargs: Any) -> Any:
        stamps["fit"] = time.time()
        stamps["env"] = {k: v for k, v in args[-2].items() if k.startswith("RAY_TRAIN_")}
        return fit_arm(spec, *args, **kwargs)

    run_module._fit_arm = timed_fit_arm  # type: ignore[assignment]
    load = os.getloadavg()[0]
    try:
        spec = ArmSpec(lane=lane, sweep_id="bench-train-start", campaign="bench", block_id="b", arm=name, arm_index=0,
                       order=0, feature=None, feature_value=None, baseline_value=None, kind="speed",
                       lane_key="bench", receipt_dir=str(receipts), scheduled_at=time.time(), inject={})
        spec, work, launch = run_module._prepare(spec, "ray_train", time.time())
        result = run_module._run_ray_train(run_module._with_absolute_paths(spec), work, 0, launch, node_id,
                                           None, None, None)
        ended = time.time()
    finally:
        (run_module.TRAIN_ENV_DEFAULTS, run_module._trainer_class,  # type: ignore[assignment]
         run_module._backend_config) = saved
        run_module._fit_arm = fit_arm  # type: ignore[assignment]
    row: dict[str, Any] = {"variant": name, "load_1min": round(load, 2), "failure": launch.failure,
                           "train_env": stamps.get("env"), "process": launch.process}
    if result is None or result.first_step_end is None:
        return row
    run_name = next((d.name for d in (work / "ray").glob("arm-*")), "")
    log = _controller_lines(run_name)
    first_log = log[0][0] if log else None
    started = next((t for t, m in log if m.startswith("Started training worker group")), None)
    summary = result.loop_summary
    first_step_s = summary.steps[0].step_s if summary is not None and summary.steps else 0.0
    first_start = result.first_step_end - first_step_s
    t0, fit = spec.scheduled_at, stamps["fit"]
    stages = {"to_fit": fit - t0,
              "controller": (first_log - fit) if first_log else None,
              "workers_created": (started - first_log) if started and first_log else None,
              "to_train_fn": (result.fn_start - started) if started else None,
              "fit_to_train_fn": result.fn_start - fit,  # always there: the three stages above together
              "fn_to_features": result.features_at - result.fn_start,
              "setup": (result.ready or result.features_at) - result.features_at,
              "first_step": first_step_s,
              "train_rest": result.done - result.first_step_end,
              "fit_return": ended - result.done}
    row.update({"to_first_step_s": first_start - t0, "wall_s": ended - t0, "pid_rank0": result.pid,
                "stages": {k: (round(v, 3) if v is not None else None) for k, v in stages.items()}})
    return row


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--variants", default="torch_config,after")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "train_start.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    import ray
    import torch

    sweep, _ = load_sweep(REPO / "search_spaces" / "smoke.yaml")
    lane = sweep.lane
    lane.engine.workers, lane.budget.steps, lane.budget.min_steady_steps = 2, 4, 2
    names = args.variants.split(",")
    load_before = _load()
    init = local_ray_init_kwargs()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **init)
    node = ray.get_runtime_context().get_node_id()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-train-start-") as tmp:
            for rep in range(args.reps):
                for name in names:
                    row = one_arm(lane, Path(tmp) / "receipts", name, node)
                    row["rep"] = rep
                    rows.append(row)
                    print(json.dumps({k: row.get(k) for k in ("variant", "rep", "load_1min", "to_first_step_s",
                                                               "wall_s", "stages")}, default=str), flush=True)
    finally:
        ray.shutdown()
    summary = {}
    for name in names:
        values = [r["to_first_step_s"] for r in rows if r["variant"] == name and "to_first_step_s" in r]
        walls = [r["wall_s"] for r in rows if r["variant"] == name and "wall_s" in r]
        stage_names = next((list(r["stages"]) for r in rows if r["variant"] == name and "stages" in r), [])
        stage_medians = {s: statistics.median([r["stages"][s] for r in rows if r["variant"] == name and "stages" in r
                                               and r["stages"][s] is not None] or [float("nan")])
                         for s in stage_names}
        median = statistics.median(values) if values else None
        summary[name] = {"arms": len(values), "to_first_step_s_median": median,
                         "to_first_step_s": values, "wall_s_median": statistics.median(walls) if walls else None,
                         "stage_medians": stage_medians,
                         "target": {"criterion": f"median of to_first_step_s over {len(values)} arms",
                                    "target_s": TARGET_S, "met": median is not None and median <= TARGET_S}}
        print(f"{name}: to first step median {median}, stages {json.dumps(stage_medians)}")
    result = {"finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": _git(), "note": args.note,
              "machine": {"cpus": int(init["num_cpus"]), "torch_threads": torch.get_num_threads(),
                          "load_avg_before": load_before, "load_avg_after": _load(),
                          "shared_host": "other engineers' jobs load the same CPUs: compare runs with their load"},
              "job_runtime_env": init["runtime_env"]["env_vars"], "reps": args.reps, "summary": summary,
              "arms": rows}
    kept = append_run(args.out, result)
    print(f"appended: {args.out} (run {kept})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
