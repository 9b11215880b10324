"""Runner overhead on the smoke lane: seconds from "arm scheduled" to its first training step, per-block overhead,
and whether N free CPUs keep N arms busy at once.

How to run me: ``python benchmarks/bench_runner.py`` (``--quick`` for a 4-step budget, ``--skip-two-worker`` to
measure only one-worker arms, ``--skip-one-worker --two-worker-blocks 3`` for the two-worker target alone). Prints
the figures and appends this run to ``benchmarks/results/runner.json`` (``{"runs": [...]}``; a file holding one
older run keeps it as the first entry), so every measured run stays on record.

Two real sweeps on a fresh local Ray runtime (the machine's CPUs), MLflow in a temporary SQLite store:
1. one-worker arms (fresh process per arm): the smoke campaign as it is (3 blocks, 6 arms);
2. two-worker arms (Ray Train worker group pinned to the trial's node): the smoke lane with
   ``lane.engine.workers: 2``, ``--two-worker-blocks`` blocks (default 1).

Figures, per arm, from its receipt (the trainer's clocks start at the orchestrator's ``scheduled_at``):
- ``to_first_step_s``: scheduled -> first training step starts (queue wait + process/worker-group start-up + model
  build): the runner overhead the targets are about (<= 5 s one-worker, <= 15 s two-worker on 2 cores);
- ``time_to_first_step_s``: scheduled -> first step *ends* (adds that step, which includes compile warmup).
Per block, from the driver: ``block_overhead_s`` = block wall time (Tune trial start -> end) minus the arms' own
time after their first step starts, i.e. trial dispatch + both arms' start-up + reporting.
Concurrency: the most arms running at the same instant, and the mean number busy over the sweep.

Other engineers share the machine: each run records the 1/5/15-minute load averages before and after, the torch
thread count, the git commit (and whether the tree was dirty) and the Ray Train settings the arms ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ablate.receipts.store import load_receipts  # noqa: E402
from ablate.sweep.resources import local_ray_init_kwargs  # noqa: E402
from ablate.sweep.run import SweepSummary, run_sweep  # noqa: E402

TARGETS = {"subprocess": 5.0, "ray_train": 8.0}
CRITERIA = {"subprocess": "max", "ray_train": "median"}
"""Which statistic of ``to_first_step_s`` over a run's arms each target bounds (issue 14: two-worker median <= 8 s)."""


def campaign(directory: Path, name: str, steps: Optional[int], workers: int, blocks: int = 1) -> Path:
    yaml = YAML()
    data = yaml.load((REPO / "search_spaces" / "smoke.yaml").read_text())
    data["name"] = name
    if steps is not None:
        data["lane"]["budget"]["steps"] = steps
        data["lane"]["budget"]["min_steady_steps"] = min(2, steps)
    if workers > 1:
        data["lane"].setdefault("engine", {})["workers"] = workers
        data["features"] = {"moe_dispatch": ["jagged"]}
        data["blocks"], data["aa_blocks"], data["bundle_blocks"] = blocks, 0, 0
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "defaults.yaml").write_text((REPO / "search_spaces" / "defaults.yaml").read_text())
    path = directory / f"{name}.yaml"
    with path.open("w") as handle:
        yaml.dump(data, handle)
    return path


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    running = best = 0
    for _, delta in events:
        running += delta
        best = max(best, running)
    return best


def figures(summary: SweepSummary) -> dict[str, Any]:
    receipts = {r.identity.receipt_id: r for r in load_receipts(Path(summary.sweep_dir) / "receipts")[0]}
    arms, blocks, spans = [], [], []
    for block_id, entry in sorted(summary.timeline.items()):
        busy = inside_arms = 0.0
        for arm in entry["arms"]:
            receipt = receipts[arm["receipt_id"]]
            ttfs, first = receipt.steps.time_to_first_step_s, receipt.steps.first_step_s
            to_first = ttfs - first if ttfs is not None and first is not None else None
            arms.append({"block": block_id, "arm": arm["arm"], "executor": receipt.identity.executor,
                         "status": receipt.identity.status.value, "to_first_step_s": to_first,
                         "time_to_first_step_s": ttfs, "queue_wait_s": receipt.time.badput_s.get("queue_wait"),
                         "startup_s": receipt.time.badput_s.get("startup"), "wall_s": receipt.time.wall_s})
            spans.append((arm["scheduled_at"], arm["ended_at"]))
            busy += receipt.time.wall_s - (to_first or 0.0)
            inside_arms += receipt.time.wall_s
        start, end = entry.get("trial_started_at"), entry.get("trial_ended_at")
        if start is not None and end is not None:
            # overhead: everything but the arms' work after their first step starts; dispatch: what the runner
            # adds outside the arms (trial start, attempt checkpoint, reporting, trial teardown).
            blocks.append({"block": block_id, "wall_s": end - start, "overhead_s": end - start - busy,
                           "dispatch_s": end - start - inside_arms})
    valid = [a["to_first_step_s"] for a in arms if a["to_first_step_s"] is not None]
    window = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    return {
        "sweep_id": summary.sweep_id, "executor": summary.executor, "blocks": len(blocks), "arms": arms,
        "per_block": blocks, "elapsed_s": summary.elapsed_s, "max_concurrent_blocks": summary.max_concurrent,
        "arm_to_first_step_s": {"median": statistics.median(valid) if valid else None,
                                "max": max(valid) if valid else None},
        "block_overhead_s": {"median": statistics.median([b["overhead_s"] for b in blocks]) if blocks else None},
        "block_dispatch_s": {"median": statistics.median([b["dispatch_s"] for b in blocks]) if blocks else None},
        "arms_at_once_max": _max_overlap(spans),
        "arms_busy_mean": sum(e - s for s, e in spans) / window if window else None,
    }


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _git() -> dict[str, Any]:
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": run("rev-parse", "HEAD") or None, "dirty": bool(run("status", "--porcelain"))}


def append_run(path: Path, result: dict[str, Any]) -> int:
    """Append ``result`` to the runs kept in ``path``; a file from before this format becomes the first run."""
    runs: list[Any] = []
    if path.exists():
        old = json.loads(path.read_text())
        runs = old["runs"] if isinstance(old, dict) and isinstance(old.get("runs"), list) and "machine" not in old \
            else [old]
    runs.append(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": runs}, indent=2))
    os.replace(tmp, path)
    return len(runs)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4-step budget instead of the smoke lane's")
    parser.add_argument("--skip-two-worker", action="store_true")
    parser.add_argument("--skip-one-worker", action="store_true")
    parser.add_argument("--two-worker-blocks", type=int, default=1, help="blocks (2 arms each) of two-worker arms")
    parser.add_argument("--note", default="", help="free text kept with the run (e.g. what else loaded the host)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "runner.json")
    parser.add_argument("--keep", action="store_true", help="keep the temporary sweep dirs and MLflow store")
    args = parser.parse_args(argv)
    import ray
    import torch

    from trainers.run import TRAIN_ENV_DEFAULTS

    steps = 4 if args.quick else None
    work = Path(tempfile.mkdtemp(prefix="ablate-bench-"))
    init = local_ray_init_kwargs()
    load_before = _load()
    started = time.monotonic()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **init)
    ray_start_s = time.monotonic() - started
    uri = f"sqlite:///{work / 'mlflow.db'}"
    runs: dict[str, Any] = {}
    try:
        plans = ([] if args.skip_one_worker else [("one_worker", 1)]) + \
            ([] if args.skip_two_worker else [("two_worker", 2)])
        for label, workers in plans:
            path = campaign(work / label, f"bench-{label}", steps, workers, args.two_worker_blocks if workers > 1 else 1)
            summary = run_sweep(path, tracking_uri=uri, storage=str(work / "runs"), progress=False)
            runs[label] = figures(summary)
    finally:
        ray.shutdown()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    cpus = int(init["num_cpus"])
    verdicts = {}
    for label, run in runs.items():
        limit, criterion = TARGETS[run["executor"]], CRITERIA[run["executor"]]
        value = run["arm_to_first_step_s"][criterion]
        verdicts[label] = {"target_s": limit, "criterion": f"{criterion} of to_first_step_s over "
                                                            f"{len(run['arms'])} arm(s)",
                           "value_s": value, "met": value is not None and value <= limit}
    if "one_worker" in runs:
        verdicts["cpus_keep_arms_busy"] = {"cpus": cpus, "arms_at_once": runs["one_worker"]["arms_at_once_max"],
                                           "met": runs["one_worker"]["arms_at_once_max"] >= min(cpus, 6)}
    result = {"finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": _git(), "note": args.note,
              "machine": {"cpus": cpus, "gpus": int(init["num_gpus"]), "platform": platform.platform(),
                          "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
                          "load_avg_before": load_before, "load_avg_after": _load(),
                          "shared_host": "other engineers' jobs load the same CPUs: compare runs with their load"},
              # What the arms' Train runs got: the runtime env of this local Ray (inherited by trial processes)
              # wins over trainers.run's defaults, which fill in only what it leaves unset.
              "train_env": {**TRAIN_ENV_DEFAULTS, **{k: v for k, v in init["runtime_env"]["env_vars"].items()
                                                     if k.startswith("RAY_TRAIN_")}, "job_runtime_env":
                            dict(init["runtime_env"]["env_vars"])},
              "ray_start_s": ray_start_s, "steps": steps or "smoke lane", "runs": runs, "verdicts": verdicts}
    kept = append_run(args.out, result)
    print(f"Ray local start: {ray_start_s:.1f}s   CPUs: {cpus}   load avg before/after: {load_before} / {_load()}")
    for label, run in runs.items():
        print(f"\n{label} ({run['executor']}): {run['blocks']} block(s), {len(run['arms'])} arm(s), "
              f"sweep {run['elapsed_s']:.1f}s, {run['max_concurrent_blocks']} block(s) at once")
        print(f"  {'block':6s} {'arm':10s} {'to 1st step':>12s} {'to 1st step end':>16s} {'startup':>8s} {'wall':>7s}")
        for arm in run["arms"]:
            print(f"  {arm['block']:6s} {arm['arm']:10s} {_s(arm['to_first_step_s']):>12s} "
                  f"{_s(arm['time_to_first_step_s']):>16s} {_s(arm['startup_s']):>8s} {_s(arm['wall_s']):>7s}")
        print(f"  arm scheduled -> first step: median {_s(run['arm_to_first_step_s']['median'])}, "
              f"max {_s(run['arm_to_first_step_s']['max'])} (target: {CRITERIA[run['executor']]} "
              f"<= {TARGETS[run['executor']]:.0f}s: {'met' if verdicts[label]['met'] else 'NOT met'})")
        print(f"  per-block overhead: median {_s(run['block_overhead_s']['median'])} (of which outside the arms: "
              f"{_s(run['block_dispatch_s']['median'])}); arms at once: max "
              f"{run['arms_at_once_max']}, mean busy {run['arms_busy_mean'] or 0:.2f}")
    print(f"\nappended: {args.out} (run {kept})")
    return 0


def _s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}s"


if __name__ == "__main__":
    raise SystemExit(main())
