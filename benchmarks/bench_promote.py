"""Benchmark: ``promote`` over 10,000 receipts must finish in <= 10 s on a 2-core machine.

How to run me: ``python benchmarks/bench_promote.py [--receipts 10000] [--repeat 3]`` from the repository root.
Prints the figure and appends one record to ``benchmarks/results/promote.json`` (a list; earlier runs are kept, a
file holding one record from before is turned into a list of it). The campaign is simulated with known truth
(tests/promote/promote_sim.py): 8 lanes x (7 speed tests + 1 tax + A/A blocks) over 4 hosts and 2 rounds, so
the timing covers matching, the host-clustered bootstrap (policy default: 10,000 resamples), leave-one-host-out,
Holm, the clauses, and rendering the Markdown and JSON reports. Building the receipts is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "promote")]

from promote_sim import FeatureTruth, Sim, base_lane, simulate  # noqa: E402

from ablate.promote import promote  # noqa: E402
from ablate.receipts.schema import Receipt  # noqa: E402

POLICY = REPO / "search_spaces" / "policies" / "default.yaml"
DEFAULTS = REPO / "search_spaces" / "defaults.yaml"
LANES = 8
HOSTS = 4
ROUNDS = 2


def _features() -> list[FeatureTruth]:
    return [FeatureTruth("moe_dispatch", "jagged", "padded", 1.05), FeatureTruth("moe_dispatch", "grouped_mm",
                                                                                 "padded", 1.02),
            FeatureTruth("mamba_scan", "chunked", "sequential", 1.08),
            FeatureTruth("mamba_scan", "mamba_ssm", "sequential", 1.0),
            FeatureTruth("fused_residual", "on", "off", 1.01), FeatureTruth("mla_ingress", "fused", "unfused", 0.98),
            FeatureTruth("recurrent_scan", "parallel", "sequential", 1.03), FeatureTruth("stp", "on", "off", 0.96)]


def build(num_receipts: int) -> list[Receipt]:
    features = _features()
    groups_per_lane = len(features) + 1  # + A/A
    per_host_round = max(1, round(num_receipts / (2 * LANES * groups_per_lane * HOSTS * ROUNDS)))
    receipts: list[Receipt] = []
    for lane in range(LANES):
        sim = Sim(features=features, hosts=HOSTS, rounds=ROUNDS, blocks_per_host=per_host_round,
                  aa_per_host=per_host_round, noise=0.007, lane=base_lane(**{"batch.seq_len": 64 * (lane + 1)}),
                  block_prefix=f"L{lane}-", campaign="bench")
        receipts += simulate(sim, seed=lane)
    return receipts


def _git_commit() -> str:
    done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=REPO, capture_output=True,
                          text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receipts", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "promote.json")
    parser.add_argument("--note", default="", help="kept with the record (e.g. what else loaded the host)")
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    receipts = build(args.receipts)
    build_s = time.perf_counter() - start
    timings = []
    result = None
    for _ in range(args.repeat):
        start = time.perf_counter()
        result = promote(receipts, policy_path=POLICY, defaults_path=DEFAULTS)
        markdown, payload = result.markdown, result.to_json()
        timings.append(time.perf_counter() - start)
    assert result is not None
    verdicts = {}
    for v in result.verdicts:
        verdicts[v.verdict] = verdicts.get(v.verdict, 0) + 1
    best = min(timings)
    record = {
        "benchmark": "promote", "receipts": len(receipts), "lanes": LANES, "hosts": HOSTS, "rounds": ROUNDS,
        "tests": len(result.verdicts), "holm_family": result.holm_family,
        "bootstrap_resamples": result.policy.bootstrap.resamples, "seconds_best": round(best, 3),
        "seconds_all": [round(t, 3) for t in timings], "budget_s": 10.0, "within_budget": best <= 10.0,
        "build_receipts_s": round(build_s, 2), "verdicts": verdicts, "markdown_chars": len(markdown),
        "json_chars": len(payload), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": _git_commit(), "threads": threading.active_count(), "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "criterion": f"best of {args.repeat}",
        "note": args.note,
    }
    previous = json.loads(args.out.read_text()) if args.out.exists() else []
    history = previous if isinstance(previous, list) else [previous]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(history + [record], indent=2) + "\n")
    print(f"promote over {len(receipts)} receipts ({len(result.verdicts)} tests, B={record['bootstrap_resamples']}): "
          f"{best:.2f} s best of {args.repeat} (budget 10 s, load {load_start} -> {record['loadavg_end']}) "
          f"-> appended to {args.out.relative_to(REPO)}")
    print(f"verdicts: {verdicts}")


if __name__ == "__main__":
    main()
