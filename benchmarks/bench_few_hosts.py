"""How often the multi-host rule promotes on three hosts, with and without ``consistency.hosts_agree``.

How to run me: ``python benchmarks/bench_few_hosts.py`` (``--campaigns 150``, ``--resamples 2000``). Appends one
record to ``benchmarks/results/few_hosts.json`` (every run kept) and prints a table.

Simulated campaigns with known truth (``tests/promote/promote_sim.py``: real, validated receipts through the real
``promote``), 3 hosts x 2 blocks x 2 rounds per feature plus 2 A/A blocks per host and round, arm noise 1%, under
``search_spaces/policies/default.yaml`` with ``bootstrap.resamples`` lowered for speed (the bootstrap's p-value
of a campaign whose every host passes delta is 1/(B + 1) at any B, which is the case this measures). Scenarios:
- ``null`` features with a host x candidate effect drawn per host, sd 2% and 3% (no effect on the mean host: the
  review's case, where three hosts that happen to favour the feature pass every other clause);
- real wins of 5% and 3% with a host x candidate sd of 1% (the power the clause costs).
Each campaign is promoted twice from the same receipts, with the clause on (default@4) and off (default@3's rule).
Reported: the share of campaigns whose single speed test is PROMOTE, per scenario and variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "promote"))
sys.path.insert(0, str(REPO / "benchmarks"))

from promote_sim import Sim, moe, simulate  # noqa: E402
from records import append, host  # noqa: E402

from ablate.promote import PROMOTE, load_policy, promote, with_overrides  # noqa: E402
from trainers.provenance import git_state  # noqa: E402

SCENARIOS = {"null, host sd 2%": (1.0, 0.02), "null, host sd 3%": (1.0, 0.03),
             "win 5%, host sd 1%": (1.05, 0.01), "win 3%, host sd 1%": (1.03, 0.01)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaigns", type=int, default=150)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "few_hosts.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    load = os.getloadavg()
    base = load_policy(REPO / "search_spaces" / "policies" / "default.yaml",
                       overrides={"bootstrap.resamples": args.resamples, "bootstrap.loss_resamples": 500})
    variants = {"hosts_agree on": base, "hosts_agree off": with_overrides(base, {"consistency.hosts_agree": False})}
    defaults = REPO / "search_spaces" / "defaults.yaml"
    started = time.perf_counter()
    table: dict[str, dict[str, float]] = {}
    for name, (ratio, sd) in SCENARIOS.items():
        counts = dict.fromkeys(variants, 0)
        for seed in range(args.campaigns):
            receipts = simulate(Sim(features=[moe(ratio)], host_arm_sd=sd, aa_per_host=2), seed)
            for variant, policy in variants.items():
                (verdict,) = promote(receipts, policy_path=policy, defaults_path=defaults, curves=False).verdicts
                counts[variant] += verdict.verdict == PROMOTE
        table[name] = {variant: count / args.campaigns for variant, count in counts.items()}
        print(f"{name:22s} " + "  ".join(f"{v}: {share:6.1%}" for v, share in table[name].items()), flush=True)
    commit, dirty = git_state(REPO)
    append(args.out, {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": [commit, dirty],
                      "note": args.note, "machine": host(load),
                      "params": {"campaigns": args.campaigns, "resamples": args.resamples, "hosts": 3,
                                 "blocks_per_host_per_round": 2, "rounds": 2, "noise": 0.01,
                                 "policy": base.ref},
                      "promoted_share": table, "criterion": "share of campaigns whose one speed test is PROMOTE",
                      "seconds": round(time.perf_counter() - started, 1)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
