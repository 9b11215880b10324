"""What running every CPU's block at once costs a measurement on a small node: the smoke lane with as many blocks at
once as the CPUs fit (``resources.max_concurrent_blocks: 0``) against one block at a time (``1``), alternating.

How to run me: ``python benchmarks/bench_concurrency_noise.py`` (``--repeats 2``, ``--blocks 2``, ``--aa-blocks 12``).
Appends one record to ``benchmarks/results/concurrency_noise.json`` (every run kept) and prints it.

Why: with a block on every CPU, the orchestrator (driver, Tune, Ray's daemons, MLflow's writer, each trial's
launch) and the other blocks' start-ups run on the CPUs the arms measure on. Their time lands inside measured
steps, unevenly between the two arms of a block, and the A/A blocks' scatter (which sets the A/A bias bound, and so
δ) carries it. One block at a time leaves them a CPU.

Per run: the command's wall time; each A/A block's log ratio (recurring step time of the arm that went first over
the other's: the quantity the A/A bias bound is taken on, up to the horizon's one-time part) and their standard
deviation; the arms' run-delay share over their own turns (``host_load.run_delay_share``: median and max) and how
many were HOST_CONTENDED; the arms' summed goodput. Criterion: the median over repeats of the A/A standard
deviation, and of the wall time, per setting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_smoke_throughput import _campaign, _commit  # noqa: E402
from records import append, compile_tree, host, timed_sweep  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "concurrency_noise.json"
SETTINGS = {"every_cpu": 0, "one_at_a_time": 1}


def _aa_log_ratios(receipts: list[dict[str, Any]]) -> list[float]:
    blocks: dict[tuple[str, int], dict[int, float]] = {}
    for receipt in receipts:
        ident, projection = receipt["identity"], receipt.get("projection") or {}
        if ident["kind"] == "aa" and projection.get("recurring_step_s"):
            blocks.setdefault((ident["block_id"], ident["attempt"]), {})[ident["order"]] = \
                projection["recurring_step_s"]
    return [math.log(arms[0] / arms[1]) for arms in blocks.values() if len(arms) == 2]


def _run(label: str, concurrent: int, blocks: int, aa_blocks: int, parent: Path) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=parent))
    campaign = _campaign(REPO, run_dir, blocks, aa_blocks)
    yaml = YAML()
    data = yaml.load(campaign)
    data["resources"]["max_concurrent_blocks"] = concurrent
    with campaign.open("w") as handle:
        yaml.dump(data, handle)
    ran = timed_sweep(REPO, campaign, run_dir)
    receipts = ran["receipts"]
    ratios = _aa_log_ratios(receipts)
    shares = sorted(r["host_load"]["run_delay_share"] for r in receipts
                    if r["host_load"].get("run_delay_share") is not None)
    return {"setting": label, "max_concurrent_blocks": concurrent, "exit": ran["exit"],
            "wall_s": round(ran["wall_s"], 2),
            "arms": len(receipts), "goodput_s": round(sum(r["time"]["goodput_s"] for r in receipts), 2),
            "aa_blocks": len(ratios), "aa_log_ratios": [round(x, 5) for x in ratios],
            "aa_sd": round(statistics.stdev(ratios), 5) if len(ratios) > 1 else None,
            "run_delay_share_median": round(statistics.median(shares), 4) if shares else None,
            "run_delay_share_max": round(shares[-1], 4) if shares else None,
            "contended_arms": sum(bool(r["host_load"].get("contended")) for r in receipts),
            "load_before": ran["load_before"], "dir": str(run_dir)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2, help="blocks per feature")
    parser.add_argument("--aa-blocks", type=int, default=12)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    parent = Path(tempfile.mkdtemp(prefix="ablate-bench-concurrency-"))
    bytecode = compile_tree(REPO)
    load = os.getloadavg()
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        order = list(SETTINGS) if repeat % 2 == 0 else list(reversed(SETTINGS))
        for label in order:
            row = {"repeat": repeat, **_run(label, SETTINGS[label], args.blocks, args.aa_blocks, parent)}
            runs.append(row)
            print(f"repeat {repeat} {label:14s} {row['arms']} arms in {row['wall_s']:.1f}s; A/A sd {row['aa_sd']} "
                  f"over {row['aa_blocks']} blocks; run delay median {row['run_delay_share_median']}, "
                  f"{row['contended_arms']} contended; goodput {row['goodput_s']}s; exit {row['exit']}", flush=True)

    def median_of(label: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["setting"] == label and r["exit"] == 0 and r[key] is not None]
        return round(statistics.median(values), 5) if values else None

    record = {"benchmark": "concurrency_noise", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": _commit(REPO), "host": host(load), "note": args.note,
              "campaign": f"smoke.yaml lane and budget; blocks={args.blocks}, aa_blocks={args.aa_blocks}; no bundle, "
                          "no horizon_steps, no recurrent_scan",
              "criterion": f"median over {args.repeats} runs per setting of the A/A blocks' standard deviation "
                           "(log ratio of recurring step times) and of the wall time",
              "aa_sd_median": {label: median_of(label, "aa_sd") for label in SETTINGS},
              "wall_s_median": {label: median_of(label, "wall_s") for label in SETTINGS},
              "run_delay_share_median": {label: median_of(label, "run_delay_share_median") for label in SETTINGS},
              "bytecode": bytecode, "runs": runs}
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=1))
    append(RESULTS, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
