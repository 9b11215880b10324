"""One look of the until-decided judge: ``promote(curves=False)`` (what ``judge_states`` runs before every block it
hands out) against the full ``promote`` (curves included), on simulated single-node campaigns of growing size.

How to run me: ``python benchmarks/bench_judge.py`` (``--repeats 5``, ``--blocks 10,40,80`` blocks per test and
round). Two rounds, three features (moe_dispatch 1.06x, mamba_scan 1.0x, fused_residual 1.03x) plus A/A blocks on
one host, under ``search_spaces/policies/single_node_sequential.yaml``; the two variants alternate in one process,
the first pair of each size is a warm-up and not kept. Criterion: the median over the repeats of each variant and
their ratio. APPENDS a record (date, git state, host load, threads) to ``benchmarks/results/judge.json``; every run
is kept. Nothing here is a pass/fail target: the judge's looks add to the driver's time per block.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "promote"))

from promote_sim import FeatureTruth, Sim, moe, simulate  # noqa: E402

from ablate.promote.engine import promote  # noqa: E402
from ablate.receipts.store import seal  # noqa: E402
from trainers.provenance import git_state  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import records  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "judge.json"
POLICY = REPO / "search_spaces" / "policies" / "single_node_sequential.yaml"
DEFAULTS = REPO / "search_spaces" / "defaults.yaml"


def _look(receipts: list, curves: bool) -> float:
    started = time.perf_counter()
    promote(receipts, policy_path=POLICY, defaults_path=DEFAULTS, curves=curves)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", default="10,40,80", help="blocks per test and round, comma-separated")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    load_before = os.getloadavg()
    sizes = []
    for blocks in [int(b) for b in args.blocks.split(",")]:
        sim = Sim(features=[moe(1.06), FeatureTruth("mamba_scan", "chunked", "sequential", 1.0),
                            FeatureTruth("fused_residual", True, False, 1.03)], hosts=1, blocks_per_host=blocks,
                  rounds=2)
        receipts = [seal(r) for r in simulate(sim, seed=5)]
        _look(receipts, True), _look(receipts, False)  # warm-up: imports, caches
        full, judge = [], []
        for _ in range(args.repeats):
            full.append(_look(receipts, True))
            judge.append(_look(receipts, False))
        row = {"blocks_per_test_and_round": blocks, "receipts": len(receipts),
               "full_s": [round(x, 4) for x in full], "judge_s": [round(x, 4) for x in judge],
               "full_median_s": round(statistics.median(full), 4), "judge_median_s": round(statistics.median(judge), 4)}
        row["judge_over_full"] = round(row["judge_median_s"] / row["full_median_s"], 3)
        sizes.append(row)
        print(f"{len(receipts):5d} receipts: full promote {row['full_median_s']:.3f} s, judge's look "
              f"{row['judge_median_s']:.3f} s ({row['judge_over_full']:.2f}x)", flush=True)
    record = {"benchmark": "judge", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "git": git_state(REPO), "note": args.note,
              "host": records.host(load_before),
              "criterion": f"median of {args.repeats} interleaved looks per variant (one warm-up pair not kept)",
              "policy": str(POLICY.relative_to(REPO)), "sizes": sizes}
    records.append(RESULTS, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
