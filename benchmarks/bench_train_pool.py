"""Two-worker (Ray Train) arm start-up with and without prestarted Ray processes (``trainers.ray_pool``).

How to run me: ``python benchmarks/bench_train_pool.py --order fresh,pool,fresh,pool,fresh,pool,pool,pool``
(``--note`` for what else loaded the host). Appends the run to ``benchmarks/results/train_pool.json``.

One local Ray runtime (``ablate.sweep.resources.local_ray_init_kwargs``), smoke lane with ``engine.workers: 2`` and
4 steps, arms through ``trainers.run._run_ray_train`` one after another in the given order. Variants:
- ``pool``: what ``run_arm`` does now: Train workers carry the setup hook, the first arm asks the raylet for a
  pool and every arm asks for the next one's processes after its ``fit()``;
- ``fresh``: the previous behaviour, kept apart from the pool: no prestart, no hook, and a runtime env of its own
  (one more propagated Train variable, one more worker variable) so no pooled process can match its actors.
``pool:N`` asks for N arms' processes after the arm (``run_arm(prestart_next=N)``; default 1): ``pool:0,pool:2``
pairs ask only after a block's second arm, for both arms of the next block. A ``pool`` arm right after a ``fresh`` one finds processes prestarted one arm earlier; consecutive ``pool`` arms
show the back-to-back case (the pool has only the gap between arms to start). ``--gap-s`` idles before every arm
(both variants alike), so the pool's start-up never overlaps a measured arm.
Per arm: ``to_first_step_s`` (scheduled -> first step, the issue-14 criterion), stages as in
``bench_train_start.py``, each rank's pid and how its process was prepared, and whether any pid was seen before or
a module-level mark of an earlier arm was visible (both must stay false).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_runner import _git, _load, append_run  # noqa: E402
from bench_train_start import TARGET_S, _controller_lines  # noqa: E402

from ablate.config.load import load_sweep  # noqa: E402
from ablate.sweep.resources import local_ray_init_kwargs  # noqa: E402
from trainers import run as run_module  # noqa: E402
from trainers.spec import ArmSpec  # noqa: E402


@contextlib.contextmanager
def _variant(name: str) -> Iterator[None]:
    if name == "pool":
        yield
        return
    if name != "fresh":
        raise ValueError(f"unknown variant {name!r}; valid: fresh, pool")
    saved = (run_module._pool_envs, run_module.ray_pool.hook_env_vars)
    run_module._pool_envs = lambda env_vars: None  # type: ignore[assignment]
    run_module.ray_pool.hook_env_vars = lambda: {"ABLATE_BENCH_FRESH": "1"}  # type: ignore[assignment]
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "60.5"  # the controller's env differs too
    try:
        yield
    finally:
        run_module._pool_envs, run_module.ray_pool.hook_env_vars = saved  # type: ignore[assignment]
        os.environ.pop("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", None)


def _controller_head_start(run_name: str, fit: float) -> Optional[float]:
    """fit() -> the controller process's start (negative: started after fit, i.e. not pooled), from the pid in
    the controller's structured log and the first line of that process's core-worker log."""
    import datetime
    import glob

    for path in glob.glob("/tmp/ray/session_latest/logs/train/ray-train-app-controller-*.log"):
        with open(path) as handle:
            entries = [json.loads(line) for line in handle if line.startswith("{")]
        if any(e.get("run_name") == run_name for e in entries):
            pid = entries[0].get("process")
            for core in glob.glob(f"/tmp/ray/session_latest/logs/python-core-worker-*_{pid}.log"):
                with open(core) as handle:
                    stamp = handle.readline()[1:24]  # [2026-11-23 06:14:55,950 ...
                try:
                    started = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    return None
                return round(fit - started, 2)
    return None


def one_arm(lane: Any, receipts: Path, token: str, node_id: str, seen: set[int]) -> dict[str, Any]:
    name, _, after = token.partition(":")
    prestart_next = int(after) if after else 1
    stamps: dict[str, float] = {}
    fit_arm = run_module._fit_arm

    def timed_fit_arm(spec: ArmSpec, *args: Any) -> Any:
        stamps["fit"] = time.time()
        return fit_arm(spec, *args)

    run_module._fit_arm = timed_fit_arm  # type: ignore[assignment]
    load = os.getloadavg()
    try:
        with _variant(name):
            spec = ArmSpec(lane=lane, sweep_id="bench-train-pool", campaign="bench", block_id="b", arm=name,
                           arm_index=0, order=0, feature=None, feature_value=None, baseline_value=None,
                           kind="speed", lane_key="bench", receipt_dir=str(receipts), scheduled_at=time.time(),
                           inject={})
            spec, work, launch = run_module._prepare(spec, "ray_train", time.time())
            result = run_module._run_ray_train(run_module._with_absolute_paths(spec), work, 0, launch, node_id,
                                               None, None, None, prestart_next)
            ended = time.time()
    finally:
        run_module._fit_arm = fit_arm  # type: ignore[assignment]
    evidence = launch.process_evidence or []
    pids = [e["pid"] for e in evidence]
    row: dict[str, Any] = {"variant": name, "prestart_next": prestart_next, "load_avg": [round(x, 2) for x in load], "failure": launch.failure,
                           "process": launch.process, "pids": pids,
                           "how": [e["how"] for e in evidence],
                           "started_before_fit_s": [round(stamps["fit"] - e["process_started_at"], 2)
                                                    if e.get("process_started_at") else None for e in evidence],
                           "hook_s": [round(e["hook"]["hook_end"] - e["hook"]["hook_start"], 2) if e.get("hook")
                                      else None for e in evidence],
                           "pid_seen_before": any(p in seen for p in pids),
                           "mark_of_earlier_arm_seen": any(e.get("reused") for e in evidence)}
    seen.update(pids)
    if result is None or result.first_step_end is None:
        return row
    run_name = next((d.name for d in (work / "ray").glob("arm-*")), "")
    log = _controller_lines(run_name)
    first_log = log[0][0] if log else None
    row["controller_started_before_fit_s"] = _controller_head_start(run_name, stamps["fit"])
    started = next((t for t, m in log if m.startswith("Started training worker group")), None)
    summary = result.loop_summary
    first_step_s = summary.steps[0].step_s if summary is not None and summary.steps else 0.0
    fit = stamps["fit"]
    stages = {"to_fit": fit - spec.scheduled_at, "controller": (first_log - fit) if first_log else None,
              "workers_created": (started - first_log) if started and first_log else None,
              "fit_to_train_fn": result.fn_start - fit, "fn_to_features": result.features_at - result.fn_start,
              "setup": (result.ready or result.features_at) - result.features_at, "first_step": first_step_s,
              "fit_return": ended - result.done}
    row.update({"to_first_step_s": result.first_step_end - first_step_s - spec.scheduled_at,
                "wall_s": ended - spec.scheduled_at,
                "stages": {k: (round(v, 3) if v is not None else None) for k, v in stages.items()}})
    return row


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", default="fresh,pool,fresh,pool,fresh,pool,pool,pool")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "train_pool.json")
    parser.add_argument("--gap-s", type=float, default=0.0,
                        help="idle seconds before each arm (the pool starts in them, never during a measured arm)")
    parser.add_argument("--gap-every", type=int, default=1,
                        help="idle only before every n-th arm: 2 runs arms in back-to-back pairs, as a block's")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    import ray

    sweep, _ = load_sweep(REPO / "search_spaces" / "smoke.yaml")
    lane = sweep.lane
    lane.engine.workers, lane.budget.steps, lane.budget.min_steady_steps = 2, 4, 2
    tokens = args.order.split(",")
    order = [token.partition(":")[0] for token in tokens]
    load_before = _load()
    init = local_ray_init_kwargs()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **init)
    node = ray.get_runtime_context().get_node_id()
    rows: list[dict[str, Any]] = []
    seen: set[int] = set()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-train-pool-") as tmp:
            for index, name in enumerate(tokens):
                if index % args.gap_every == 0:
                    time.sleep(args.gap_s)
                row = one_arm(lane, Path(tmp) / "receipts", name, node, seen)
                row["index"] = index
                rows.append(row)
                shown = ("index", "variant", "load_avg", "to_first_step_s", "how", "pids", "started_before_fit_s",
                         "hook_s", "pid_seen_before", "mark_of_earlier_arm_seen", "controller_started_before_fit_s",
                         "stages", "failure")
                print(json.dumps({k: row.get(k) for k in shown}, default=str), flush=True)
    finally:
        ray.shutdown()
    summary = {}
    for name in dict.fromkeys(order):
        values = [r["to_first_step_s"] for r in rows if r["variant"] == name and "to_first_step_s" in r]
        median = statistics.median(values) if values else None
        summary[name] = {"arms": len(values), "to_first_step_s_median": median, "to_first_step_s": values,
                         "target": {"target_s": TARGET_S, "met": median is not None and median <= TARGET_S}}
        print(f"{name}: to first step median {median} over {len(values)} arms: {values}")
    result = {"finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": _git(), "note": args.note,
              "order": tokens, "gap_s": args.gap_s, "gap_every": args.gap_every,
              "machine": {"cpus": int(init["num_cpus"]), "load_avg_before": load_before, "load_avg_after": _load()},
              "summary": summary, "isolation": {"pid_seen_before": any(r["pid_seen_before"] for r in rows),
                                                "mark_of_earlier_arm_seen": any(r["mark_of_earlier_arm_seen"]
                                                                                for r in rows)},
              "arms": rows}
    kept = append_run(args.out, result)
    print(f"appended: {args.out} (run {kept})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
