"""A real CPU campaign under ``ablate sweep --until-decided`` (issue 15's evidence): which tests stop, when, why.

How to run me: ``python benchmarks/bench_until_decided.py`` from the repository root (``--campaign``, ``--policy``
to change them; ``--workdir`` keeps the MLflow store and receipts, default /tmp/ablate-until-decided). It runs
search_spaces/smoke_until_decided.yaml under benchmarks/policies/until_decided_demo.yaml on a local Ray and an
embedded MLflow store, then prints per round the blocks each test got and where its SPRT stands, and APPENDS a run
record (date, git state, host load, threads, rounds, blocks per test per round, final states, the fixed design's
block count at the same cap) to ``benchmarks/results/until_decided.json``. Nothing here is a pass/fail target:
the record says what the rule decided on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ablate.config.load import load_sweep  # noqa: E402
from ablate.receipts.store import load_receipts  # noqa: E402
from ablate.sweep.until_decided import (judge_states, run_until_decided, sequential_policy,  # noqa: E402
                                        states_json)
from trainers.provenance import git_state  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "until_decided.json"


def _blocks_per_test(receipts: list, sweep_id: str) -> dict[str, int]:
    blocks = {(r.identity.block_id, r.identity.feature or "A/A", str(r.identity.feature_value or ""))
              for r in receipts if r.identity.sweep_id == sweep_id and r.identity.arm != "baseline"}
    return dict(Counter(f"{f}={v}" if f != "A/A" else f for _, f, v in blocks))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaign", default=str(REPO / "search_spaces" / "smoke_until_decided.yaml"))
    parser.add_argument("--policy", default=str(REPO / "benchmarks" / "policies" / "until_decided_demo.yaml"))
    parser.add_argument("--workdir", default="/tmp/ablate-until-decided")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    policy = sequential_policy(args.policy)
    sweep, _ = load_sweep(args.campaign)
    load_before = os.getloadavg()
    started = time.monotonic()
    summary = run_until_decided(args.campaign, policy_path=args.policy, tracking_uri=f"sqlite:///{work}/mlflow.db",
                                storage=str(work / "runs"), progress=False, echo=print)
    wall = time.monotonic() - started
    receipts = load_receipts(work / "runs" / sweep.name / "receipts")[0]
    rounds = []
    for index, record in enumerate(summary.rounds):
        so_far = [r for r in receipts if r.identity.sweep_id in {x.sweep_id for x in summary.rounds[:index + 1]}]
        states = judge_states(so_far, policy, Path(args.campaign).parent / sweep.defaults)
        rounds.append({"sweep_id": record.sweep_id, "elapsed_s": round(record.elapsed_s, 1),
                       "blocks": _blocks_per_test(receipts, record.sweep_id), "left_out": record.blocks_skipped,
                       "judge_s": round(record.judge_s, 2),
                       "states_after": states_json(states.values())})
    fixed = policy.sequential.max_rounds * sweep.blocks
    record = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_state(REPO),
        "host": {"platform": platform.platform(), "logical_cpus": os.cpu_count(), "threads_per_arm": 1,
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "campaign": str(Path(args.campaign).relative_to(REPO)) if Path(args.campaign).is_relative_to(REPO)
        else args.campaign, "policy": policy.ref, "wall_s": round(wall, 1), "stop_reason": summary.stop_reason,
        "rounds": rounds, "final": states_json(summary.states),
        "fixed_design_blocks_per_test": fixed,
        "blocks_per_test": {s.feature + "=" + s.value: s.blocks for s in summary.states},
    }
    print(f"\n{len(rounds)} round(s) in {wall:.0f}s; stop: {summary.stop_reason}")
    for r in rounds:
        print(f"  {r['sweep_id']}: {r['blocks']}")
    for s in summary.states:
        print(f"  {s.line()}")
    print(f"  the fixed design at this cap: {fixed} blocks per test")
    out = Path(args.out)
    history = json.loads(out.read_text()) if out.exists() else {"runs": []}
    history["runs"].append(record)
    out.write_text(json.dumps(history, indent=1, default=str) + "\n")
    print(f"appended to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
