"""A sweep's local Ray start (``ablate.sweep.run.ensure_ray``) with the prompt node wait (``ablate.sweep.node_wait``)
against Ray's own one-second polls, alternating, each start in a fresh interpreter.

How to run me: ``python benchmarks/bench_ray_start.py`` (``--repeats 5``; ``--idle`` leaves out the competing
imports). Appends one record to ``benchmarks/results/ray_start.json`` (``{"runs": [...]}``: every run is kept) and
prints it.

What runs: ``ensure_ray()`` timed in a new ``python`` process, then ``shutdown_ray()``; ``rays_own`` swaps the
prompt wait for nothing, so Ray's ``services.get_node`` polls as shipped. By default a second process imports
torch and dynamo (what the fork server's head start does beside ``ray.init`` in a sweep) from the moment the
start begins, because that is when a campaign starts Ray, and the raylet's registration then takes longer than a
second. Criterion: median seconds of ``ensure_ray`` per mode over the repeats; the record also keeps how long the
prompt wait polled and how many times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from records import append, host  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "ray_start.json"
MODES = ("prompt", "rays_own")
_DRIVER = """
import contextlib, logging, sys, time
logging.basicConfig(level=logging.WARNING)
logging.getLogger("ablate.sweep.run").setLevel(logging.DEBUG)
import ray
import ablate.sweep.run as run
from ablate.sweep.node_wait import NodeWait
if sys.argv[1] == "rays_own":
    run.prompt_node_wait = lambda: contextlib.nullcontext(NodeWait(skipped="benchmark: Ray's own wait"))
started = time.perf_counter()
assert run.ensure_ray()
print("ensure_ray_s", time.perf_counter() - started, flush=True)
run.shutdown_ray()
"""
_LOAD = "import torch, torch._dynamo"


def _start(mode: str, contended: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    load = subprocess.Popen([sys.executable, "-c", _LOAD], env=env) if contended else None
    out = subprocess.run([sys.executable, "-c", _DRIVER, mode], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    if load is not None:
        load.wait(timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{mode}: exit {out.returncode}: {out.stderr[-2000:]}")
    seconds = float(re.search(r"ensure_ray_s (\S+)", out.stdout).group(1))
    polled = re.search(r"raylet registered (\S+) s after Ray looked for it \((\d+) polls\)", out.stderr)
    return {"mode": mode, "ensure_ray_s": round(seconds, 3),
            "polled_s": float(polled.group(1)) if polled else None, "polls": int(polled.group(2)) if polled else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle", action="store_true", help="no competing imports beside the start")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = []
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else MODES[::-1]
        for mode in order:
            run = {"repeat": repeat, **_start(mode, not args.idle), "load": os.getloadavg()[0]}
            runs.append(run)
            print(json.dumps(run), flush=True)
    medians = {mode: statistics.median(r["ensure_ray_s"] for r in runs if r["mode"] == mode) for mode in MODES}
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    record = {"benchmark": "ray_start", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": git, "note": args.note,
              "contention": "none" if args.idle else f"a second process runs `{_LOAD}` from the start",
              "criterion": f"median ensure_ray seconds over {args.repeats} starts per mode, alternating order",
              "median_s": medians, "saved_s": round(medians["rays_own"] - medians["prompt"], 3),
              "machine": host(load_before), "runs": runs}
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=1))
    append(RESULTS, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
