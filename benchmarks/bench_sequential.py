"""Simulation: the sequential rule (SPRT) against the fixed design, with known truth (issue 15).

How to run me: ``python benchmarks/bench_sequential.py [--campaigns 1000] [--e2e 100]`` from the repository root
(``--smoke-test``: 50 campaigns, 10 end to end). Prints the table and APPENDS a run record (date, git state,
threads, host load, parameters, table) to ``benchmarks/results/sequential_sims.json``.

Model: tests/promote/promote_sim.py's, at the level of block log ratios. A block's log ratio = log(true
speed-up) + the host's candidate effect (host x arm, sd ``host_arm_sd``, fixed per host for the campaign:
correlated noise) + drift for whichever arm runs second (random order) + the two arms' independent noise; the
host and round effects are shared by both arms of a block and cancel. A/A blocks (two per host per round) get
the same noise and drift. Each round runs every host ``blocks_per_host`` times, hosts interleaved.

Designs, on the same simulated data (paired):
- fixed N: the fixed rule's core after N rounds (host-clustered bootstrap lower bound of the HL above 1 + delta,
  80% block wins, every host and round median a win, leave-one-host-out; REJECT when the upper bound widened by
  the A/A bias bound is below 1 + min_effect, calibrated lane, >= min_blocks).
- sequential: a searcher that looks after every block and stops when ``sequential_state`` (the function the
  rule calls) decides; PROMOTE needs the upper crossing plus the same consistency checks on the blocks run.
Blocks counted are feature blocks (A/A blocks are extra, one round's worth per round, in both designs).

``--e2e N`` also runs N campaigns per case as real receipts through ``promote`` with the sequential rule on
(blocks to the cap; the rule looks at them in time order), to show the block-level model agrees with the rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "promote")]

from ablate.promote import PROMOTE, REJECT, load_policy, promote, with_overrides  # noqa: E402
from ablate.promote.policy import Policy  # noqa: E402
from ablate.promote.sequential import LOWER, UPPER, SprtBounds, sequential_state  # noqa: E402
from ablate.promote.stats import bootstrap_hl, hodges_lehmann, quantile  # noqa: E402
from trainers.provenance import git_state  # noqa: E402

POLICY = REPO / "search_spaces" / "policies" / "default.yaml"
DEFAULTS = REPO / "search_spaces" / "defaults.yaml"
RESULTS = REPO / "benchmarks" / "results" / "sequential_sims.json"
RESAMPLES = 2000
LOHO_RESAMPLES = 500


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ratio: float
    host_arm_sd: float = 0.01
    drift_second: float = 0.0
    noise: float = 0.01
    """Per-arm log-throughput noise (promote_sim's default)."""


CASES = [Case("A/A null", 1.0), Case("true 5% win", 1.05), Case("true 2% (close call)", 1.02),
         Case("null, drift 2%", 1.0, drift_second=0.02), Case("true 5%, drift 2%", 1.05, drift_second=0.02)]


@dataclasses.dataclass
class Campaign:
    d: np.ndarray
    hosts: np.ndarray
    rounds: np.ndarray
    aa: np.ndarray
    aa_hosts: np.ndarray
    aa_rounds: np.ndarray


AA_PER_HOST = 2
"""A/A blocks per host per round (the rule's tests use 2: a lane is calibrated, >= 4 A/A blocks, in round 1)."""


def simulate(case: Case, seed: int, num_hosts: int, blocks_per_host: int, num_rounds: int,
             aa_per_host: int = AA_PER_HOST) -> Campaign:
    rng = np.random.default_rng(seed)
    host_arm = rng.normal(0.0, case.host_arm_sd, num_hosts)
    d, hosts, rounds, aa, aa_hosts, aa_rounds = [], [], [], [], [], []
    for r in range(num_rounds):
        for _ in range(blocks_per_host):
            for h in range(num_hosts):
                sign = 1.0 if rng.integers(0, 2) else -1.0  # +: the candidate ran second
                d.append(math.log(case.ratio) + host_arm[h] + sign * case.drift_second
                         + rng.normal(0, case.noise) - rng.normal(0, case.noise))
                hosts.append(f"h{h}")
                rounds.append(f"r{r}")
        for _ in range(aa_per_host):
            for h in range(num_hosts):
                sign = 1.0 if rng.integers(0, 2) else -1.0
                aa.append(sign * case.drift_second + rng.normal(0, case.noise) - rng.normal(0, case.noise))
                aa_hosts.append(f"h{h}")
                aa_rounds.append(f"r{r}")
    obj = lambda x: np.asarray(x, dtype=object)  # noqa: E731
    return Campaign(np.asarray(d), obj(hosts), obj(rounds), np.asarray(aa), obj(aa_hosts), obj(aa_rounds))


def calibrate(c: Campaign, rounds_seen: set[str], policy: Policy, rng: np.random.Generator
              ) -> tuple[Optional[float], Optional[float], int]:
    """(bias bound log, A/A variance, A/A blocks) from the A/A blocks of the rounds seen, as ``evidence`` does."""
    keep = np.isin(c.aa_rounds, list(rounds_seen))
    ratios, hosts = c.aa[keep], c.aa_hosts[keep]
    if ratios.size < 2:
        return None, None, int(ratios.size)
    theta = bootstrap_hl(ratios, hosts, RESAMPLES, rng)
    tail = (1.0 - policy.threshold.bias_confidence) / 2.0
    bound = max(abs(quantile(theta, tail)), abs(quantile(theta, 1.0 - tail)))
    return bound, float(np.var(ratios, ddof=1)), int(ratios.size)


def consistent(d: np.ndarray, hosts: np.ndarray, rounds: np.ndarray, policy: Policy,
               rng: np.random.Generator) -> bool:
    """The fixed rule's consistency clauses (win fraction, host medians, round HLs, leave-one-host-out)."""
    if np.mean(d > 0) < policy.consistency.min_win_fraction:
        return False
    if any(np.median(d[hosts == h]) <= 0 for h in set(hosts.tolist())):
        return False
    if any(hodges_lehmann(d[rounds == r]) <= 0 for r in set(rounds.tolist())):
        return False
    for h in sorted(set(hosts.tolist())):
        keep = hosts != h
        theta = bootstrap_hl(d[keep], hosts[keep], LOHO_RESAMPLES, rng)
        if quantile(theta, policy.family_alpha) <= 0:
            return False
    return True


def fixed_verdict(c: Campaign, num_rounds: int, policy: Policy, rng: np.random.Generator) -> tuple[str, int]:
    names = {f"r{r}" for r in range(num_rounds)}
    keep = np.isin(c.rounds, list(names))
    d, hosts, rounds = c.d[keep], c.hosts[keep], c.rounds[keep]
    bias, _, num_aa = calibrate(c, names, policy, rng)
    calibrated = num_aa >= policy.threshold.min_aa_blocks
    log_delta = math.log1p(policy.threshold.min_effect) + (bias or 0.0)
    theta = bootstrap_hl(d, hosts, RESAMPLES, rng)
    upper = quantile(theta, 0.975) + (bias or 0.0)
    if calibrated and d.size >= policy.evidence.min_blocks and upper < math.log1p(policy.threshold.min_effect):
        return REJECT, int(d.size)
    if (calibrated and d.size >= policy.evidence.min_blocks and quantile(theta, policy.family_alpha) > log_delta
            and consistent(d, hosts, rounds, policy, rng)):
        return PROMOTE, int(d.size)
    return "HOLD", int(d.size)


def sequential_verdict(c: Campaign, policy: Policy, rng: np.random.Generator) -> tuple[str, int]:
    """A searcher looking after every block: stop as soon as the rule's sequential state is decided."""
    seq = policy.sequential
    round_names = list(dict.fromkeys(c.rounds.tolist()))
    state = None
    for r_index in range(min(seq.max_rounds, len(round_names))):
        seen = set(round_names[:r_index + 1])
        keep = np.isin(c.rounds, list(seen))
        bias, aa_var, num_aa = calibrate(c, seen, policy, rng)
        state = sequential_state(c.d[keep], c.hosts[keep], c.rounds[keep].tolist(),
                                 bounds=SprtBounds.of(policy, bias), policy=policy, var_floor=aa_var or 0.0)
        if state.decision in (UPPER, LOWER) or state.blocks >= seq.max_blocks:
            n = state.blocks
            d, hosts, rounds = c.d[keep][:n], c.hosts[keep][:n], c.rounds[keep][:n]
            calibrated = num_aa >= policy.threshold.min_aa_blocks
            # As the rule's sprt_lower clause: the estimate raised by the A/A bias bound the crossing used.
            small = (state.variance.get("mean", 0.0) + (state.variance.get("bias") or 0.0)
                     + state.variance.get("mean_sd", 0.0) <= math.log1p(policy.threshold.min_effect))
            if state.decision == LOWER and calibrated and small:
                return REJECT, n
            if state.decision == UPPER and calibrated and consistent(d, hosts, rounds, policy, rng):
                return PROMOTE, n
            return "HOLD", n
    assert state is not None
    return "HOLD", state.blocks


def summarise(verdicts: list[tuple[str, int]], case: Case) -> dict[str, Any]:
    blocks = np.asarray([n for _, n in verdicts], dtype=float)
    kinds = [v for v, _ in verdicts]
    promoted, rejected = kinds.count(PROMOTE) / len(kinds), kinds.count(REJECT) / len(kinds)
    # The error: promoting a null, or failing to promote a clear (>= 5%) win; a 2% close call has none (both
    # outcomes are acceptable between delta0 and delta1).
    error = promoted if case.ratio <= 1.0 else (1.0 - promoted if case.ratio >= 1.05 else None)
    return {"promoted": promoted, "rejected": rejected, "held": 1.0 - promoted - rejected, "error": error,
            "mean_blocks": float(blocks.mean()), "p90_blocks": float(np.quantile(blocks, 0.9))}


def e2e(case: Case, policy: Policy, campaigns: int, num_hosts: int, blocks_per_host: int) -> dict[str, Any]:
    from promote_sim import Sim, moe
    from promote_sim import simulate as simulate_receipts

    verdicts = []
    for seed in range(campaigns):
        sim = Sim(features=[moe(case.ratio)], hosts=num_hosts, blocks_per_host=blocks_per_host,
                  rounds=policy.sequential.max_rounds, noise=case.noise, host_arm_sd=case.host_arm_sd,
                  drift_second=case.drift_second, aa_per_host=AA_PER_HOST)
        result = promote(simulate_receipts(sim, 50_000 + seed), policy_path=policy, defaults_path=DEFAULTS)
        v = next(x for x in result.verdicts if x.feature == "moe_dispatch")
        verdicts.append((v.verdict, v.sequential["blocks"] if v.sequential else v.n_blocks))
    return summarise(verdicts, case)


def _code_digest() -> str:
    """sha256 of the modules that decide (the git commit alone says nothing while the tree is dirty)."""
    import hashlib

    digest = hashlib.sha256()
    for name in ("sequential.py", "rule.py", "analysis.py", "evidence.py", "stats.py"):
        digest.update((REPO / "ablate" / "promote" / name).read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def _git() -> dict[str, Any]:
    sha, dirty = git_state(REPO)
    return {"commit": sha, "dirty": dirty}


def _fmt(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaigns", type=int, default=1000)
    parser.add_argument("--e2e", type=int, default=0, help="campaigns per case through the real rule")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--blocks-per-host", type=int, default=2, help="per round")
    parser.add_argument("--fixed-rounds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="policy override (dotted key, YAML value), e.g. sequential.min_blocks=8")
    parser.add_argument("--smoke-test", action="store_true")
    parser.add_argument("--no-record", action="store_true", help="print only (tuning runs)")
    args = parser.parse_args()
    if args.smoke_test:
        args.campaigns, args.e2e = 50, min(args.e2e, 10)
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    policy = with_overrides(load_policy(POLICY), {"bootstrap.resamples": RESAMPLES,
                                                  "bootstrap.loss_resamples": LOHO_RESAMPLES,
                                                  "sequential.enabled": True, **overrides})
    max_rounds = max(policy.sequential.max_rounds, *args.fixed_rounds)
    start = time.perf_counter()
    rows = []
    for case in CASES:
        rng = np.random.default_rng(7)
        data = [simulate(case, seed, args.hosts, args.blocks_per_host, max_rounds) for seed in range(args.campaigns)]
        for n in args.fixed_rounds:
            out = summarise([fixed_verdict(c, n, policy, rng) for c in data], case)
            rows.append({"case": case.name, "design": f"fixed {n} rounds", **out})
        seq = summarise([sequential_verdict(c, policy, rng) for c in data], case)
        rows.append({"case": case.name, "design": "sequential", **seq})
        if args.e2e and case.drift_second == 0.0 and case.ratio in (1.0, 1.05):
            rows.append({"case": case.name, "design": f"sequential, real rule (n={args.e2e})",
                         **e2e(case, policy, args.e2e, args.hosts, args.blocks_per_host)})
    elapsed = time.perf_counter() - start
    header = (f"{'case':<22} {'design':<30} {'promoted':>9} {'rejected':>9} {'held':>6} {'error':>7} {'mean blk':>9} "
              f"{'p90 blk':>8} {'vs fixed':>9}")
    lines = [header, "-" * len(header)]
    reference = {r["case"]: r["mean_blocks"] for r in rows if r["design"] == f"fixed {args.fixed_rounds[0]} rounds"}
    for r in rows:
        r["mean_vs_fixed"] = r["mean_blocks"] / reference[r["case"]]
        lines.append(f"{r['case']:<22} {r['design']:<30} {_fmt(r['promoted']):>9} {_fmt(r['rejected']):>9} "
                     f"{_fmt(r['held']):>6} {_fmt(r.get('error')):>7} {r['mean_blocks']:>9.1f} {r['p90_blocks']:>8.0f} "
                     f"{r['mean_vs_fixed']:>9.0%}")
    threads = os.cpu_count()
    load = os.getloadavg()
    lines.append(f"error: a null promoted, or a >= 5% win not promoted; vs fixed: mean blocks / fixed "
                 f"{args.fixed_rounds[0]} rounds' blocks; overrides {overrides or 'none'}")
    lines.append(f"{args.campaigns} campaigns per case, {args.hosts} hosts x {args.blocks_per_host} blocks per round; "
                 f"{elapsed:.0f} s; cpu_count {threads}, load {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}")
    print("\n".join(lines))
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": _git(),
              "code_sha256": _code_digest(),
              "design": "SPRT upper/lower tests with the A/A bias bound moved against/for the candidate; "
                        "variance of the mean = max(iid with A/A floor, host-clustered CR1); no crossing before the "
                        "blocks span evidence.min_hosts hosts; REJECT needs the lower crossing and mean + A/A bias "
                        "bound + 1 SE <= log(1 + min_effect) (since 2026-11-24g; before: without the bias bound)",
              "python": platform.python_version(), "cpu_count": threads,
              "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
              "load_avg": load, "elapsed_s": round(elapsed, 1),
              "parameters": {"campaigns": args.campaigns, "e2e": args.e2e, "hosts": args.hosts,
                             "blocks_per_host": args.blocks_per_host, "fixed_rounds": args.fixed_rounds,
                             "overrides": overrides, "policy": policy.ref,
                             "sequential": dataclasses.asdict(policy.sequential),
                             "cases": [dataclasses.asdict(c) for c in CASES], "bootstrap_resamples": RESAMPLES},
              "table": rows, "printed": lines}
    if args.no_record:
        return
    history = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    history.append(record)
    RESULTS.write_text(json.dumps(history, indent=1) + "\n")


if __name__ == "__main__":
    main()
