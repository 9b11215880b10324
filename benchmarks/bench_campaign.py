"""A campaign's real decisions from a fresh start, exactly as a user runs it: two rounds, then promote.

How to run me: ``python benchmarks/bench_campaign.py smoke`` (what `bash scripts/smoke.sh` does) or
``python benchmarks/bench_campaign.py cpu_demo`` (the compile-posture demo). ``--keep DIR`` also copies the run's
receipts and sweep metadata there (e.g. the test asset ``tests/promote/assets/smoke_run``). Each run appends one
record to ``benchmarks/results/<campaign>_verdicts.json`` (every run kept, none overwritten) and prints it; the
Markdown report, its JSON and its plots are kept under ``benchmarks/results/<campaign>_reports/``.

One run = a fresh directory with a copy of ``search_spaces/``, two rounds of ``ablate sweep
search_spaces/<campaign>.yaml`` (local Ray, MLflow in that directory's sqlite store), then ``ablate promote
--sweep <campaign> --policy search_spaces/policies/single_node.yaml`` reading the receipts back from MLflow.
Recorded: wall time of each step and in total (smoke target: <= 6 minutes after set-up), the verdicts with their
intervals and trade-off (steady speed-up, one-time cost, break-even), the lane's delta and its parts (A/A bias
bound and interval; smoke target delta <= 3%), the A/A single-block spread, host load (load average before and
after) and the CPU it ran on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ABLATE = [sys.executable, "-m", "ablate"]


def _run(cmd: list[str], cwd: Path, log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - start


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def one_run(campaign: str, keep: Path | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ablate-bench-{campaign}-"))
    shutil.copytree(REPO / "search_spaces", work / "search_spaces")
    load_before = os.getloadavg()
    rounds = [_run([*ABLATE, "sweep", f"search_spaces/{campaign}.yaml", "--no-progress"], work,
                   work / f"round{i}.log") for i in (1, 2)]
    promote_s = _run([*ABLATE, "promote", "--sweep", campaign, "--policy", "search_spaces/policies/single_node.yaml",
                      "--out", str(work / "reports")], work, work / "promote.log")
    load_after = os.getloadavg()
    report = json.loads(next((work / "reports").glob("promote-*.json")).read_text())
    lane = report["lanes"][0]
    cal = lane["calibration"]
    verdicts = {f"{v['feature']}={v['value']}": {
        "verdict": v["verdict"], "speedup": v["speedup"], "ci95": v["ci95"], "lower_holm": v["lower_adj"],
        "steady_speedup": v["steady_speedup"], "one_time_delta_s": v["one_time_delta_s"],
        "break_even": v["break_even"].get("text"), "blocks": v["n_blocks"], "reason": v["reason"],
        "within_budget": v.get("within_budget")} for v in report["verdicts"] + report["taxes"]}
    kept = RESULTS / f"{campaign}_reports"
    shutil.copytree(work / "reports", kept, dirs_exist_ok=True)
    record = {
        "campaign": campaign,
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(), "threads_per_arm": lane["threads"],
                 "loadavg_before": [round(x, 2) for x in load_before],
                 "loadavg_after": [round(x, 2) for x in load_after]},
        "wall_s": {"round1": round(rounds[0], 1), "round2": round(rounds[1], 1), "promote": round(promote_s, 1),
                   "total": round(sum(rounds) + promote_s, 1)},
        "target_total_s": 360 if campaign == "smoke" else 1200,
        "delta": cal["delta"] if "delta" in cal else None,
        "aa": {"blocks": cal["num_blocks"], "bias_bound": cal["bias_bound"],
               "interval": cal["aa_interval"], "single_block_spread": cal["noise_floor"]},
        "delta_target": 0.03 if campaign == "smoke" else None,
        "startup_share": lane["startup_share"],
        "verdicts": verdicts,
        "not_run": report["not_run"],
        "report_id": report["report_id"],
        "report": str((kept / f"{report['report_id']}.md").relative_to(REPO)),
    }
    if keep is not None:
        if keep.exists():
            shutil.rmtree(keep)
        shutil.copytree(work / "ablate_runs" / campaign / "receipts", keep / "receipts",
                        ignore=shutil.ignore_patterns(".*"))
        shutil.copytree(work / "ablate_runs" / campaign / "sweeps", keep / "sweeps")
    shutil.rmtree(work, ignore_errors=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("campaign", choices=["smoke", "cpu_demo"])
    parser.add_argument("--keep", type=Path, default=None, help="copy the run's receipts and sweep metadata here")
    args = parser.parse_args()
    record = one_run(args.campaign, args.keep)
    results = RESULTS / f"{args.campaign}_verdicts.json"
    runs = json.loads(results.read_text()) if results.exists() else []
    runs.append(record)
    results.write_text(json.dumps(runs, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
