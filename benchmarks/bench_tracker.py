"""What the goodput tracker and family sampling cost: steady step time with instruments on vs off.

How to run me (from the repository root)::

    python benchmarks/bench_tracker.py                 # smoke lane, 40 repeats, writes benchmarks/results/tracker.json
    python benchmarks/bench_tracker.py --threads 0     # the lane's own thread count (noisy on a shared machine)
    python benchmarks/bench_tracker.py --repeats 3 --out /tmp/tracker.json

One process, one model, one engine. Each repeat walks the lane's ``budget.steps`` positions and runs every
position twice, back to back: "off" (a bare ``engine.step`` plus reading the loss, which any trainer does) and
"on" (``trainers.loop.measured_step``: StepTracker, compile-event counting, the loss monitor, and family hooks on
the last ``family_sample_steps`` positions, exactly as an arm runs them), alternating which goes first (ABBA), so
load drifting on a shared machine cancels within a pair. Reported (medians of the per-pair on/off ratios, - 1):

* ``steady_overhead``: steps that count as steady (not sampled) - the cost the tracker adds to the numbers a
  receipt reports as goodput and step statistics;
* ``sampled_step_overhead``: steps carrying the family hooks (excluded from steady statistics by design);
* ``budget_overhead``: both, weighted by how many steps of the budget are of each kind - the cost to wall
  tokens/s.

Each figure is given twice: wall clock (what a receipt measures) and process CPU time (much less sensitive to
other tenants of a shared machine, which can swamp a 1% effect in wall time).

Plus ``bookkeeping_us_per_step``: the tracker + monitor calls alone, timed around a no-op step (low noise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ablate.config.load import load_sweep  # noqa: E402
from ablate.config.schema import LaneConfig  # noqa: E402
from kernels.dispatch import Dispatcher  # noqa: E402
from trainers.compile import CompileWatch  # noqa: E402
from trainers.data import build_source  # noqa: E402
from trainers.engines import build_engine  # noqa: E402
from trainers.family import FamilySampler  # noqa: E402
from trainers.goodput import StepTracker  # noqa: E402
from trainers.loop import LossMonitor, _threads, measured_step  # noqa: E402
from trainers.model import HybridLM  # noqa: E402
from trainers.provenance import git_state  # noqa: E402

Batches = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]


def _setup(lane: LaneConfig) -> tuple[Any, Any, Batches]:
    torch.set_num_threads(_threads(lane.hardware, 1))
    torch.manual_seed(lane.seed)
    device = torch.device("cpu")
    model = HybridLM(lane.model, lane.features, Dispatcher(device))
    regions = list(model.blocks())
    engine = build_engine(lane, model, device, world_size=1)
    source = build_source(lane.data, lane.model.vocab_size)

    def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [source.batch(step, m, 0, lane.batch.micro_batch, lane.batch.seq_len)
                for m in range(lane.batch.grad_accum)]

    return engine, regions, batches


class Instruments:
    """The per-arm instruments, created once per repeat as an arm creates them once."""

    def __init__(self, regions: Any, deferred: bool) -> None:
        self.tracker, self.watch = StepTracker(cuda=False), CompileWatch()
        self.sampler = FamilySampler(regions, cuda=False, whole_compiled=False)
        self.monitor = LossMonitor(1, torch.device("cpu"), deferred=deferred)
        self.tracker.start()

    def close(self) -> None:
        self.tracker.finish("explicit")
        self.watch.close()


def _step_off(engine: Any, batches: Batches, step: int) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.step(batches(step))
    float(out.loss)
    return time.perf_counter() - start, time.process_time() - cpu


def _step_on(engine: Any, batches: Batches, step: int, instruments: Instruments,
             sampled: bool) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    measured_step(engine, lambda: batches(step), instruments.tracker, instruments.watch, phase="budget",
                  sampler=instruments.sampler if sampled else None, monitor=instruments.monitor, step=step)
    return time.perf_counter() - start, time.process_time() - cpu


def _bookkeeping_us(deferred: bool, iterations: int = 20000) -> float:
    tracker, watch = StepTracker(cuda=False), CompileWatch()
    monitor = LossMonitor(1, torch.device("cpu"), deferred=deferred)
    loss = torch.tensor(1.0)
    tracker.start()
    start = time.perf_counter()
    for step in range(iterations):
        tracker.begin("budget")
        tracker.data_done()
        events, seconds = watch.events, watch.seconds
        monitor.push(step, loss)
        tracker.end(tokens=1, compile_events=watch.events - events, compile_s=watch.seconds - seconds)
    monitor.flush()
    elapsed = time.perf_counter() - start
    baseline_start = time.perf_counter()
    for _ in range(iterations):
        float(loss)                    # the bare loop reads the loss too
    baseline = time.perf_counter() - baseline_start
    watch.close()
    return (elapsed - baseline) / iterations * 1e6


def _overheads(rows: list[dict[str, list[Any]]], clock: int, steps: int, sampled: int) -> dict[str, float]:
    """Median per-pair on/off ratios - 1 for one clock (0 = wall, 1 = process CPU time)."""
    pairs = [(on[clock] / off[clock], s) for row in rows
             for on, off, s in zip(row["on"], row["off"], row["sampled"])]
    steady = statistics.median(r for r, s in pairs if not s)
    hooked = statistics.median(r for r, s in pairs if s) if sampled else 1.0
    return {"steady_overhead": steady - 1.0, "sampled_step_overhead": hooked - 1.0,
            "budget_overhead": (steady * (steps - sampled) + hooked * sampled) / steps - 1.0}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaign", default=str(REPO / "search_spaces" / "smoke.yaml"))
    parser.add_argument("--repeats", type=int, default=40)
    # One intra-op thread by default: on a shared 2-core machine two spinning OpenMP threads make step time swing
    # by +-50% and swamp a 1% effect; the tracker does the same work whatever the thread count.
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: the lane's own setting)")
    parser.add_argument("--monitor", choices=("immediate", "deferred"), default="immediate",
                        help="the loss monitor as a one-rank CPU arm runs it (immediate), or its deferred ring, the "
                             "CPU twin of the CUDA path (read LOSS_LAG_STEPS steps late)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tracker.json"),
                        help="a JSON file the run is appended to (earlier runs are kept)")
    args = parser.parse_args(argv)

    lane = load_sweep(args.campaign)[0].lane
    if args.threads:
        lane.hardware.threads = args.threads
    steps, sampled = lane.budget.steps, min(lane.budget.family_sample_steps, lane.budget.steps - 1)
    engine, regions, batches = _setup(lane)
    for step in range(2):                                       # allocator and optimizer-state warmup
        _step_off(engine, batches, step)
    load_before = os.getloadavg()
    rows = []
    for repeat in range(args.repeats):
        instruments = Instruments(regions, deferred=args.monitor == "deferred")
        row: dict[str, list[Any]] = {"off": [], "on": [], "sampled": []}
        for step in range(steps):
            is_sampled = step >= steps - sampled
            # Each budget position runs both ways back to back, alternating which goes first (ABBA), so machine
            # load drifting over seconds cancels within a pair instead of landing on one variant.
            for variant in (("off", "on") if (repeat + step) % 2 == 0 else ("on", "off")):
                if variant == "off":
                    row["off"].append(_step_off(engine, batches, step))
                else:
                    row["on"].append(_step_on(engine, batches, step, instruments, is_sampled))
            row["sampled"].append(is_sampled)
        instruments.close()
        rows.append(row)
        print(f"repeat {repeat}: " + ", ".join(
            f"{name} {_overheads([row], clock, steps, sampled)['steady_overhead'] * 100:+.2f}%"
            for name, clock in (("steady wall", 0), ("steady cpu", 1))), flush=True)
    bookkeeping = _bookkeeping_us(args.monitor == "deferred")
    off_median = statistics.median(t[0] for row in rows for t in row["off"])
    wall, cpu = _overheads(rows, 0, steps, sampled), _overheads(rows, 1, steps, sampled)
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "monitor": args.monitor,
        "criterion": "median of per-pair on/off ratios (ABBA-paired steps), minus 1",
        "lane": {"campaign": os.path.relpath(args.campaign, REPO), "pattern": lane.model.pattern,
                 "steps": steps, "family_sample_steps": sampled, "micro_batch": lane.batch.micro_batch,
                 "seq_len": lane.batch.seq_len, "threads": torch.get_num_threads()},
        "repeats": args.repeats,
        "wall": wall,
        "cpu_time": cpu,
        "bookkeeping_us_per_step": bookkeeping,
        "bookkeeping_fraction_of_median_step": bookkeeping * 1e-6 / off_median,
        "median_step_off_s": off_median,
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "torch": torch.__version__},
        "rows": [{"off": [[round(t, 6) for t in pair] for pair in row["off"]],
                  "on": [[round(t, 6) for t in pair] for pair in row["on"]], "sampled": row["sampled"]}
                 for row in rows],
        "rows_format": "per budget position: [wall_s, cpu_s] for off and on; sampled = carried family hooks",
    }
    for name, figures in (("wall clock", wall), ("process CPU time", cpu)):
        print(f"tracker overhead, {name} ({args.repeats} repeats x {steps} paired steps on "
              f"{summary['lane']['campaign']}): steady steps {figures['steady_overhead'] * 100:+.2f}%, sampled "
              f"steps {figures['sampled_step_overhead'] * 100:+.2f}%, whole budget "
              f"{figures['budget_overhead'] * 100:+.2f}%")
    print(f"bookkeeping {bookkeeping:.1f} us/step = {summary['bookkeeping_fraction_of_median_step'] * 100:.4f}% "
          f"of a {off_median * 1000:.0f} ms step; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    history = json.loads(out.read_text()) if out.exists() else {"runs": []}
    if "runs" not in history:  # the first runs overwrote one document: keep it as the first run
        history = {"runs": [history]}
    history["runs"].append(summary)
    out.write_text(json.dumps(history, indent=2))
    print(f"appended run {len(history['runs'])} to {out}")
    return 0



def _commit() -> str:
    sha, dirty = git_state(REPO)
    return (sha or "unknown")[:12] + ("+dirty" if dirty else "")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
