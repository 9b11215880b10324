"""The block bootstrap of the Hodges-Lehmann estimate: the cumulative sum over every Walsh average against the
bisection over the distinct ones (``stats._Ladder``), and what ``bootstrap_hl`` picks between them.

How to run me: ``python benchmarks/bench_bootstrap.py`` (``--repeats 5``, ``--blocks 40,72,81,120,160,250``,
``--resamples 400,2000,10000``). Resample counts: 10,000 is the policy's speed interval, 2,000 its loss and
one-time bounds, 400 a curve point. For each size the three variants (cumulative sum, ladder built afresh, the
automatic choice) run in turn in one process, after one warm-up round; every variant gets the same count matrix,
and the script refuses to record a size whose variants disagree by a single bit. Criterion: the median over the
repeats of each variant, and their ratio. APPENDS a record (date, git state, host load, threads) to
``benchmarks/results/bootstrap.json``; every run is kept. Nothing here is a pass/fail target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ablate.promote.stats import _CUMSUM_CHUNK_ELEMENTS, _hl_by_cumsum, _hl_by_ladder, _hl_chunks, _SortedPairs  # noqa: E402,E501
from trainers.provenance import git_state  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import records  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bootstrap.json"


def _cumsum(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    pairs = _SortedPairs(x, np.arange(x.size))
    chunk = max(1, _CUMSUM_CHUNK_ELEMENTS // pairs.size)
    return np.concatenate([_hl_by_cumsum(pairs, counts[s:s + chunk]) for s in range(0, counts.shape[0], chunk)])


def _ladder(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return _hl_by_ladder(_SortedPairs(x, np.arange(x.size)), counts)


def _auto(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return _hl_chunks(_SortedPairs(x, np.arange(x.size)), counts)


VARIANTS = {"cumsum": _cumsum, "ladder": _ladder, "auto": _auto}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", default="40,72,81,120,160,250")
    parser.add_argument("--resamples", default="400,2000,10000")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rng = np.random.default_rng(11)
    rows = []
    for n in [int(b) for b in args.blocks.split(",")]:
        # Log-ratios of a 3% win with noise, rounded as a timer would: ties between averages occur.
        x = np.round(rng.normal(0.03, 0.02, n), 5)
        for resamples in [int(b) for b in args.resamples.split(",")]:
            counts = rng.multinomial(n, np.full(n, 1 / n), size=resamples)
            outputs = {name: fn(x, counts) for name, fn in VARIANTS.items()}  # warm-up, and the identity check
            if not all(np.array_equal(outputs["cumsum"], out) for out in outputs.values()):
                raise SystemExit(f"n={n} B={resamples}: the variants disagree; nothing recorded")
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for _ in range(args.repeats):
                for name, fn in VARIANTS.items():
                    started = time.perf_counter()
                    fn(x, counts)
                    times[name].append(time.perf_counter() - started)
            row = {"blocks": n, "resamples": resamples, "pairs": n * (n + 1) // 2,
                   **{f"{name}_s": [round(t, 5) for t in ts] for name, ts in times.items()},
                   **{f"{name}_median_s": round(statistics.median(ts), 5) for name, ts in times.items()}}
            row["cumsum_over_auto"] = round(row["cumsum_median_s"] / row["auto_median_s"], 2)
            rows.append(row)
            print(f"n={n:4d} B={resamples:6d}: cumsum {row['cumsum_median_s'] * 1e3:8.1f} ms, ladder "
                  f"{row['ladder_median_s'] * 1e3:8.1f} ms, auto {row['auto_median_s'] * 1e3:8.1f} ms "
                  f"(cumsum / auto {row['cumsum_over_auto']:.2f}x)", flush=True)
    record = {"benchmark": "bootstrap", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "git": git_state(REPO), "note": args.note,
              "host": records.host(load_before),
              "criterion": f"median of {args.repeats} interleaved runs per variant (one warm-up not kept); "
                           f"variants bit-identical", "sizes": rows}
    records.append(RESULTS, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
