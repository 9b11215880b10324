"""A sweep's first arms: how long from the driver's scheduling stamp to their first step, this tree against another
commit (by default 4c672d7, before the fork-server head start, ``ablate.sweep.head_start``), same campaign, same
machine, alternating which goes first.

How to run me: ``python benchmarks/bench_first_arms.py`` (``--repeats 3``, ``--against 4c672d7``,
``--max-concurrent 1``). Appends one record to ``benchmarks/results/first_arms.json`` (every run kept) and prints it.

The campaign is ``search_spaces/smoke.yaml``'s lane and budget with one block of ``mamba_scan`` and one A/A block;
``--max-concurrent 1`` runs one block at a time, so a CPU is free while the first trial starts (as on any node with
more cores than its arms use); ``--max-concurrent 2`` keeps both CPUs of a 2-core machine busy. Each run is
``python -m ablate sweep <campaign> --no-progress`` in a fresh directory (local Ray, MLflow in its own sqlite
store) with the tree's code on ``PYTHONPATH``; the other tree is a ``git archive`` of the commit. Figures per run,
from the receipts of the block that started first: its arms' ``time_to_first_step_s`` (the driver's stamp to the
end of the first step; the arms whose clock is the driver's: both arms of an interleaved block, the first of a
sequential one) and start-up badput (process start to features resolved: the fork server's start, when the
arm had to wait for it), and the command's wall time. Criterion: median over the repeats of the first block's mean
time to first step, this tree / the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime
from io import BytesIO
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from records import append, compile_tree, host, timed_sweep

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "first_arms.json"


def _archive(commit: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _campaign(tree: Path, run_dir: Path, max_concurrent: int) -> Path:
    yaml = YAML()
    data = yaml.load(REPO / "search_spaces" / "smoke.yaml")
    data["features"] = {"mamba_scan": ["chunked"]}
    data["blocks"], data["aa_blocks"], data["bundle_blocks"] = 1, 1, 0
    data["resources"]["max_concurrent_blocks"] = max_concurrent
    data["defaults"] = str(tree / "search_spaces" / "defaults.yaml")
    path = run_dir / "first_arms.yaml"
    with path.open("w") as handle:
        yaml.dump(data, handle)
    return path


def _run(tree: Path, label: str, parent: Path, max_concurrent: int) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=parent))
    ran = timed_sweep(tree, _campaign(tree, run_dir, max_concurrent), run_dir)
    receipts = ran["receipts"]
    row: dict[str, Any] = {"tree": label, "exit": ran["exit"], "wall_s": round(ran["wall_s"], 2),
                           "arms": len(receipts), "load_before": ran["load_before"], "dir": str(run_dir),
                           "fork_servers_stopped_before": ran["fork_servers_stopped_before"]}
    if ran["exit"] != 0 or not receipts:
        print(f"{label}: exit {ran['exit']}; log {run_dir / 'sweep.log'}")
        return row
    first = min(receipts, key=_scheduled)["identity"]["block_id"]
    # Both arms of an interleaved block start at the driver's stamp; a sequential block's second arm at the trial's.
    arms = [r for r in receipts if r["identity"]["block_id"] == first and r["time"]["clock"] == "driver"]
    ttfs = [float(r["steps"]["time_to_first_step_s"]) for r in arms]
    row.update(first_block=first, first_block_ttfs_s=[round(t, 3) for t in ttfs],
               first_block_ttfs_mean_s=round(statistics.fmean(ttfs), 3),
               first_block_startup_s=[round(float(r["time"]["badput_s"]["startup"]), 3) for r in arms],
               first_block_request_s=[(r["identity"].get("process") or {}).get("request_s") for r in arms])
    return row


def _scheduled(receipt: dict[str, Any]) -> float:
    """The driver's scheduling stamp: the receipt's creation less its wall time, which starts there."""
    return datetime.fromisoformat(receipt["identity"]["created_at"]).timestamp() - float(receipt["time"]["wall_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", default="4c672d7")
    parser.add_argument("--max-concurrent", type=int, default=1)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    load = os.getloadavg()
    parent = Path(tempfile.mkdtemp(prefix="ablate-bench-first-arms-"))
    trees = {"this_tree": REPO, args.against: _archive(args.against, parent / "other")}
    bytecode = {label: compile_tree(tree) for label, tree in trees.items()}
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for label in (list(trees) if repeat % 2 == 0 else list(reversed(trees))):
            row = {"repeat": repeat, **_run(trees[label], label, parent, args.max_concurrent)}
            runs.append(row)
            print(f"repeat {repeat} {label:10s} first block {row.get('first_block')}: time to first step "
                  f"{row.get('first_block_ttfs_s')} (start-up {row.get('first_block_startup_s')}), wall "
                  f"{row['wall_s']}s, exit {row['exit']}, load {row['load_before'][0]:.2f}", flush=True)

    def median(label: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["tree"] == label and r["exit"] == 0 and key in r]
        return round(statistics.median(values), 3) if values else None

    ttfs = {label: median(label, "first_block_ttfs_mean_s") for label in trees}
    walls = {label: median(label, "wall_s") for label in trees}
    record = {"benchmark": "first_arms", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True).stdout.strip(),
              "git_dirty": bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                               text=True).stdout.strip()), "against": args.against,
              "campaign": "smoke.yaml lane and budget; mamba_scan, 1 block + 1 A/A block",
              "max_concurrent_blocks": args.max_concurrent, "note": args.note, "host": host(load),
              "criterion": f"median over {args.repeats} runs of the first block's mean time to first step, this tree "
                           f"/ {args.against}",
              "first_block_ttfs_median_s": ttfs, "wall_median_s": walls, "bytecode": bytecode,
              "fork_servers": "every fork server stopped before each run: each run starts its own, cold (before "
                              "stop 51 a run within 180 s of the same tree's last found its server still listening)",
              "ratio": round(ttfs["this_tree"] / ttfs[args.against], 3) if ttfs["this_tree"] and ttfs[args.against]
              else None, "runs": runs}
    print(json.dumps({k: record[k] for k in ("criterion", "first_block_ttfs_median_s", "wall_median_s", "ratio")},
                     indent=1))
    append(RESULTS, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
