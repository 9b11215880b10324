"""Orchestration alone: a campaign of N blocks through the real ``run_sweep`` with simulated (no-op) arms.

How to run me: ``python benchmarks/bench_orchestration.py`` (1,000 blocks; ``--blocks 100`` for a short run,
``--profile`` to write a cProfile of the driver beside the result). Appends one record to
``benchmarks/results/orchestration.json`` (``{"runs": [...]}``: every run is kept) and prints the figures.

What runs for real: planning, a local Ray runtime, Ray Tune (one trial per block, ``reuse_actors``), each
trial's attempt checkpoint and reports, the driver's recorder (receipt validation, receipt files), the progress
display (plain lines, as under ``ray job logs``) and MLflow logging into a SQLite store in a temporary directory.
What does not: the arms. ``run_sweep(simulate_arms=True)`` hands each arm to ``trainers.simulate.simulate_arm``,
which builds and writes a real, validating receipt from no-op steps in milliseconds (``executor: simulated``;
promotion refuses such receipts). Target (issue 14): driver overhead <= 0.2 s per block over 1,000 blocks, flat
from the first blocks to the last, and the driver's peak RSS reported.

Figures:
- ``per_block_s``: sweep wall time (``run_sweep`` in, summary out) / blocks; ``interval_s``: the time between
  consecutive block completions, its mean over the first and the last 100 blocks (flatness);
- ``driver_cpu_per_block_s``: the driver process's own CPU time (user + system) / blocks: on a shared machine less
  sensitive to other load than wall time;
- ``planning_s`` (``load_sweep`` + ``plan_sweep``, outside the sweep), ``ray_start_s`` (local runtime, outside);
- ``mlflow_per_arm_s``: ``MlflowStore.log_receipt`` as the recorder's writer thread runs it (wall, and ``cpu_mean``:
  that thread's own CPU time, ``time.thread_time``; the difference is waiting for fsync, the GIL and the CPUs);
  ``flush_s``: the wait for that thread after Tune ended (receipts still queued);
- ``params.sqlite_journal_mode``: the store's journal mode after the sweep (``MlflowStore.open_sweep`` switches a
  local SQLite store to WAL); ``--memo-lanes`` (measurement only) memoizes the plan's lane serialization;
- ``hooks_s``: driver time inside the recorder's and the progress display's Tune hooks;
- ``timed.close_*``: parts of ``mlflow_close_sweep`` (``close_settle_blocks`` also counts the one in
  ``open_sweep``); ``timed.end_*``: the sweep's end outside it (every receipt on disk read back, the catch-up);
  each ``timed`` entry's ``rss_mb_around_last``: the driver's RSS before and after its latest call (the end's read
  of every receipt is one call: what it holds shows there);
- ``rss_mb``: the driver's resident memory sampled every second (peak, and at each tenth of the blocks done);
- ``threads``: the driver process's OS threads (psutil ``num_threads``: Python's, Ray's and gRPC's), sampled with
  the RSS (peak and last), and Python's ``threading.active_count()`` at the end;
- ``machine.load_avg_before/after``: ``os.getloadavg()`` around the run. The host is shared: other engineers' jobs
  load its 2 cores at the same time, so compare runs at similar load, and prefer ``driver_cpu_per_block_s``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ablate.config.load import load_sweep  # noqa: E402
from ablate.sweep import run as sweep_run  # noqa: E402
from ablate.sweep.plan import plan_sweep  # noqa: E402
from ablate.sweep.progress import SweepProgress  # noqa: E402
from ablate.tracking import mlflow_store, receipt_bundle  # noqa: E402
from ablate.tracking.mlflow_store import MlflowStore  # noqa: E402
from trainers.provenance import git_state  # noqa: E402

TARGET_PER_BLOCK_S = 0.2


def _write(directory: Path, data: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "defaults.yaml").write_text((REPO / "search_spaces" / "defaults.yaml").read_text())
    path = directory / f"{data['name']}.yaml"
    with path.open("w") as handle:
        YAML().dump(data, handle)
    return path


def campaign(directory: Path, num_blocks: int) -> Path:
    """The smoke campaign (its lane, features, bundle blocks) with ``blocks``/``aa_blocks`` set so that it plans
    exactly ``num_blocks`` blocks: as many rounds of ``blocks`` as fit, the rest (at least 4) A/A blocks."""
    data = YAML().load((REPO / "search_spaces" / "smoke.yaml").read_text())
    data["name"] = "bench-orchestration"
    counts = []
    for rounds in (1, 2):  # the plan may skip a feature inert on the lane: count what one round plans
        data["blocks"], data["aa_blocks"] = rounds, 0
        sweep, defaults = load_sweep(_write(directory, data))
        counts.append(len(plan_sweep(sweep, "count", defaults).blocks))
    per_round, fixed = counts[1] - counts[0], 2 * counts[0] - counts[1]
    if num_blocks < fixed + 4 + per_round:
        raise SystemExit(f"--blocks: at least {fixed + 4 + per_round}")
    data["blocks"] = (num_blocks - fixed - 4) // per_round
    data["aa_blocks"] = num_blocks - fixed - per_round * data["blocks"]
    return _write(directory, data)


_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2 ** 20 if hasattr(os, "sysconf") else 0.0


def _rss_mb() -> float:
    # Twice around every timed call (each arm's MLflow write, each Tune hook): one read of /proc/self/statm instead
    # of a psutil.Process (which parses /proc/self/stat to build itself), whose cost showed in the driver's profile.
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_MB
    except (OSError, IndexError, ValueError):
        import psutil

        return psutil.Process().memory_info().rss / 2 ** 20


class _Timed:
    """Wraps methods of a class to add up their calls' durations (thread-safe enough: one writer per method)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.cpu_seconds: dict[str, list[float]] = {}
        """The calling thread's own CPU time per call (``time.thread_time``): what the call cost, not its wait."""
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []
        self.rss_mb: dict[str, tuple[float, float]] = {}
        """The driver's RSS (MB) before and after the latest call: what the sweep's end holds (one call each)."""

    def wrap(self, cls: Any, name: str, label: str) -> None:
        original = getattr(cls, name)
        samples, cpu = self.seconds.setdefault(label, []), self.cpu_seconds.setdefault(label, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            rss = _rss_mb()  # read outside the timed span
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
                self.rss_mb[label] = (rss, _rss_mb())

        self._saved.append((cls, name, original))
        setattr(cls, name, timed)

    def restore(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)

    def summary(self) -> dict[str, dict[str, float]]:
        return {label: {"calls": len(s), "total_s": round(sum(s), 3),
                        "cpu_total_s": round(sum(self.cpu_seconds[label]), 3),
                        "rss_mb_around_last": [round(x, 1) for x in self.rss_mb.get(label, ())],
                        "mean_ms": round(1000 * statistics.fmean(s), 3) if s else 0.0,
                        "median_ms": round(1000 * statistics.median(s), 3) if s else 0.0,
                        "max_ms": round(1000 * max(s), 3) if s else 0.0}
                for label, s in self.seconds.items()}


_RECORDERS: list[Any] = []


class _RssSampler(threading.Thread):
    """The driver's RSS every ``period_s`` (psutil), with the time of each sample, and the MLflow writer's backlog
    (receipts queued for the recorder's writer thread)."""

    def __init__(self, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process()
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self.threads: list[int] = []
        self.backlog: list[tuple[float, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            now = time.time()
            self.samples.append((now, self.process.memory_info().rss))
            self.threads.append(self.process.num_threads())
            if _RECORDERS:
                self.backlog.append((now, _RECORDERS[-1]._writer._work_queue.qsize()))
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.samples.append((time.time(), self.process.memory_info().rss))


def _mean(values: list[float]) -> Optional[float]:
    return round(statistics.fmean(values), 4) if values else None


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def series(timeline: dict[str, dict[str, Any]], started_at: float, rss: list[tuple[float, int]]) -> dict[str, Any]:
    """Block completion times -> intervals (first/last 100), trial durations, and RSS at each tenth of the blocks."""
    ends = sorted(e["trial_ended_at"] for e in timeline.values() if "trial_ended_at" in e)
    intervals = [b - a for a, b in zip([started_at] + ends[:-1], ends)]
    durations = sorted(((e["trial_ended_at"], e["trial_ended_at"] - e["trial_started_at"]) for e in timeline.values()
                        if "trial_ended_at" in e and "trial_started_at" in e))
    span = [d for _, d in durations]
    window = min(100, max(1, len(intervals) // 2))
    rss_at: dict[str, float] = {}
    for tenth in range(1, 11):
        index = max(0, len(ends) * tenth // 10 - 1)
        if ends:
            moment = ends[index]
            before = [r for t, r in rss if t <= moment] or [rss[0][1]]
            rss_at[f"{tenth * 10}%"] = round(before[-1] / 2**20, 1)
    return {"blocks_ended": len(ends), "window": window,
            "interval_first_s": _mean(intervals[:window]), "interval_last_s": _mean(intervals[-window:]),
            "interval_median_s": round(statistics.median(intervals), 4) if intervals else None,
            "trial_span_first_s": _mean(span[:window]), "trial_span_last_s": _mean(span[-window:]),
            "rss_mb_at_blocks_done": rss_at,
            "interval_by_tenth_s": [_mean(intervals[len(intervals) * k // 10:len(intervals) * (k + 1) // 10])
                                    for k in range(10)]}


def _backlog_at(backlog: list[tuple[float, int]], timeline: dict[str, dict[str, Any]]) -> Optional[int]:
    """Receipts still queued for MLflow when the last block's trial ended."""
    ends = [e["trial_ended_at"] for e in timeline.values() if "trial_ended_at" in e]
    if not ends or not backlog:
        return None
    before = [q for t, q in backlog if t <= max(ends)]
    return before[-1] if before else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "orchestration.json")
    parser.add_argument("--no-progress", action="store_true", help="without the progress display")
    parser.add_argument("--profile", action="store_true", help="cProfile the driver's main thread; top 40 printed "
                                                               "and the stats written beside --out")
    parser.add_argument("--memo-lanes", action="store_true",
                        help="measurement only: ablate.sweep.plan's lane_to_dict (OmegaConf, ~40 ms a lane) memoized "
                             "by the lane's repr for this run, to show what serializing each block's lanes again "
                             "(plan.fingerprint, Block.to_dict: 4 per block on the driver) costs")
    parser.add_argument("--note", default="", help="free text kept in the record (what changed since the last run)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary campaign, receipts and MLflow store")
    args = parser.parse_args(argv)
    import ray

    work = Path(tempfile.mkdtemp(prefix="ablate-bench-orch-"))
    # The writer remembers every payload it logs (ablate.receipts.accepted), as in a user's sweep, but here into
    # this run's own cache: simulated receipts have no place in the user's.
    os.environ["ABLATE_CACHE_DIR"] = str(work / "accepted-cache")
    load_before = _load()
    path = campaign(work / "campaign", args.blocks)

    started = time.perf_counter()
    sweep, defaults = load_sweep(path)
    plan = plan_sweep(sweep, "bench-orchestration-plan", defaults)
    planning_s = time.perf_counter() - started
    assert len(plan.blocks) == args.blocks, (len(plan.blocks), args.blocks)

    started = time.perf_counter()
    sweep_run.ensure_ray()
    ray_start_s = time.perf_counter() - started
    cpus = int(ray.cluster_resources().get("CPU", 0))

    timed = _Timed()
    timed.wrap(MlflowStore, "log_receipt", "mlflow_log_receipt")
    timed.wrap(MlflowStore, "open_sweep", "mlflow_open_sweep")
    timed.wrap(MlflowStore, "close_sweep", "mlflow_close_sweep")
    timed.wrap(sweep_run._Recorder, "flush", "recorder_flush")
    # What the sweep's end costs besides close_sweep: every receipt on disk read back and validated (as outlines
    # since 2026-11-24g; ``gather``, whole receipts, before), the catch-up.
    timed.wrap(sweep_run, "scan_receipts" if hasattr(sweep_run, "scan_receipts") else "gather", "end_gather_receipts")
    timed.wrap(sweep_run, "_catch_up", "end_catch_up")
    # close_sweep's parts (module functions, looked up by name when called).
    timed.wrap(mlflow_store, "settle_blocks", "close_settle_blocks")
    timed.wrap(mlflow_store, "summary_png", "close_summary_png")
    timed.wrap(receipt_bundle, "write_bundle", "close_write_bundle")
    original_init = sweep_run._Recorder.__init__

    def init(self: Any, *a: Any, **k: Any) -> None:
        original_init(self, *a, **k)
        _RECORDERS.append(self)

    sweep_run._Recorder.__init__ = init  # type: ignore[method-assign]
    timed.wrap(sweep_run._Recorder, "on_trial_result", "hook_recorder_on_trial_result")
    timed.wrap(sweep_run._Recorder, "on_trial_start", "hook_recorder_on_trial_start")
    for hook in ("on_step_end", "on_trial_result", "on_trial_complete"):
        timed.wrap(SweepProgress, hook, f"hook_progress_{hook}")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    if args.memo_lanes:
        import copy

        import ablate.sweep.plan as sweep_plan

        real_lane_to_dict, lanes_seen = sweep_plan.lane_to_dict, {}

        def memo_lane_to_dict(lane: Any) -> dict[str, Any]:
            key = repr(lane)
            if key not in lanes_seen:
                lanes_seen[key] = real_lane_to_dict(lane)
            return copy.deepcopy(lanes_seen[key])

        sweep_plan.lane_to_dict = memo_lane_to_dict  # type: ignore[assignment]
    sampler = _RssSampler()
    sampler.start()
    profiler = cProfile.Profile() if args.profile else None
    cpu_before, wall_started, stamp_started = _cpu_s(), time.perf_counter(), time.time()
    try:
        if profiler is not None:
            profiler.enable()
        summary = sweep_run.run_sweep(path, tracking_uri=uri, storage=str(work / "runs"),
                                      progress=not args.no_progress, simulate_arms=True)
        if profiler is not None:
            profiler.disable()
        wall_s = time.perf_counter() - wall_started
        cpu_s = _cpu_s() - cpu_before
    finally:
        sampler.stop()
        timed.restore()
        sweep_run._Recorder.__init__ = original_init  # type: ignore[method-assign]
        ray.shutdown()
    import sqlite3

    with contextlib.closing(sqlite3.connect(work / "mlflow.db")) as db:  # the store's own choice (prefer_wal)
        journal_mode = db.execute("PRAGMA journal_mode").fetchone()[0]
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    hooks = timed.summary()
    per_arm = timed.seconds["mlflow_log_receipt"]
    flow = series(summary.timeline, stamp_started, sampler.samples)
    record: dict[str, Any] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_state(REPO),
        "note": args.note,
        "machine": {"cpus": cpus, "os_cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_avg_before": load_before,
                    "load_avg_after": _load(),
                    "shared": "other engineers' jobs load this host's CPUs concurrently: see load_avg_*"},
        "params": {"blocks": args.blocks, "lane": "smoke", "arms": "simulated", "progress": not args.no_progress,
                   "profile": args.profile, "sqlite_journal_mode": journal_mode, "memo_lanes": args.memo_lanes,
                   "max_concurrent_blocks": summary.max_concurrent,
                   # Since the SVG change: the writer logs goodput.svg / block.svg (no matplotlib). Runs before it
                   # logged matplotlib PNGs (``stub_arm_plot`` true: the arm PNG replaced by an empty file).
                   "arm_pictures": "svg"},
        "results": {
            "blocks_done": summary.blocks_done, "blocks_errored": summary.blocks_errored,
            "arms_logged": summary.arms_logged, "spooled": summary.spooled, "exit_code": summary.exit_code,
            "wall_s": round(wall_s, 2), "per_block_s": round(wall_s / args.blocks, 4),
            "target_per_block_s": TARGET_PER_BLOCK_S, "met": wall_s / args.blocks <= TARGET_PER_BLOCK_S,
            "criterion": f"issue 14: driver overhead (sweep wall / blocks) <= {TARGET_PER_BLOCK_S} s per block over "
                         f"1,000 simulated blocks, peak driver RSS reported" + ("" if args.blocks >= 1000 else
                                                                               f" (this run: {args.blocks} blocks)"),
            "threads_peak": max(sampler.threads, default=None), "threads_last": (sampler.threads or [None])[-1],
            "python_threads_at_end": threading.active_count(),
            "driver_cpu_s": round(cpu_s, 2), "driver_cpu_per_block_s": round(cpu_s / args.blocks, 4),
            "planning_s": round(planning_s, 3), "ray_start_s": round(ray_start_s, 2),
            "peak_rss_mb": round(peak_rss_mb, 1),
            "rss_mb_sampled_peak": round(max(r for _, r in sampler.samples) / 2**20, 1),
            "mlflow_per_arm_s": {"mean": _mean(per_arm), "median": round(statistics.median(per_arm), 4)
                                 if per_arm else None, "total": round(sum(per_arm), 2),
                                 "first_200_mean": _mean(per_arm[:200]), "last_200_mean": _mean(per_arm[-200:]),
                                 "cpu_mean": _mean(timed.cpu_seconds["mlflow_log_receipt"]),
                                 # CPU flat while wall grows: the writer waits (GIL, CPUs), its ORM work does not grow.
                                 "cpu_first_200_mean": _mean(timed.cpu_seconds["mlflow_log_receipt"][:200]),
                                 "cpu_last_200_mean": _mean(timed.cpu_seconds["mlflow_log_receipt"][-200:])},
            "mlflow_backlog_max": max((q for _, q in sampler.backlog), default=None),
            "driver_waited_for_mlflow_s": round(getattr(_RECORDERS[-1], "backlog_wait_s", 0.0), 2)
            if _RECORDERS else None,
            "mlflow_backlog_at_tune_end": _backlog_at(sampler.backlog, summary.timeline),
            "recorder_on_trial_result_ms": {
                "first_200_mean": _mean([1000 * x for x in timed.seconds["hook_recorder_on_trial_result"][:200]]),
                "last_200_mean": _mean([1000 * x for x in timed.seconds["hook_recorder_on_trial_result"][-200:]])},
            "flush_s": hooks.get("recorder_flush", {}).get("total_s"),
            "flow": flow, "timed": hooks,
        },
    }
    if profiler is not None:
        stats_path = args.out.with_name(f"orchestration_profile_{args.blocks}.txt")
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        stats_path.parent.mkdir(parents=True, exist_ok=True)
        stats_path.write_text(text.getvalue())
        # --out outside the checkout (a trial run kept in /tmp): its profile is named as --out was.
        record["profile"] = str(stats_path.resolve().relative_to(REPO) if stats_path.resolve().is_relative_to(REPO)
                                else stats_path)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    history = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    history["runs"].append(record)
    args.out.write_text(json.dumps(history, indent=2) + "\n")
    if args.keep:
        print(f"kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    r = record["results"]
    print(f"{args.blocks} simulated blocks on {cpus} CPUs ({summary.max_concurrent} at once), load "
          f"{load_before} -> {record['machine']['load_avg_after']}")
    print(f"  done {r['blocks_done']}, errored {r['blocks_errored']}, arms {r['arms_logged']}, spooled {r['spooled']}")
    print(f"  wall {r['wall_s']}s = {r['per_block_s']}s/block (target <= {TARGET_PER_BLOCK_S}s: "
          f"{'met' if r['met'] else 'NOT met'}); driver CPU {r['driver_cpu_per_block_s']}s/block")
    print(f"  interval between block ends: first {flow['window']} {flow['interval_first_s']}s, last "
          f"{flow['window']} {flow['interval_last_s']}s; by tenth {flow['interval_by_tenth_s']}")
    print(f"  driver threads: peak {r['threads_peak']}, last {r['threads_last']}")
    print(f"  planning {r['planning_s']}s, Ray start {r['ray_start_s']}s, peak RSS {r['peak_rss_mb']} MB "
          f"(sampled {r['rss_mb_sampled_peak']}; by blocks done {flow['rss_mb_at_blocks_done']})")
    print(f"  MLflow per arm: mean {r['mlflow_per_arm_s']['mean']}s (writer CPU {r['mlflow_per_arm_s']['cpu_mean']}s), "
          f"median {r['mlflow_per_arm_s']['median']}s, "
          f"first/last 200 {r['mlflow_per_arm_s']['first_200_mean']}/{r['mlflow_per_arm_s']['last_200_mean']}s "
          f"(CPU {r['mlflow_per_arm_s']['cpu_first_200_mean']}/{r['mlflow_per_arm_s']['cpu_last_200_mean']}s) "
          f"(writer thread; {r['mlflow_per_arm_s']['total']}s in all), flush after Tune {r['flush_s']}s; backlog "
          f"max {r['mlflow_backlog_max']}, at the last block's end {r['mlflow_backlog_at_tune_end']}; the driver "
          f"waited {r['driver_waited_for_mlflow_s']}s for it")
    for label, figures in hooks.items():
        print(f"  {label}: {figures}")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
