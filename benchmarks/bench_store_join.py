"""How long after rank 0's TCPStore is up a later rank has joined it: torch's own retry against
``trainers.worker.wait_for_store`` first.

How to run me: ``python benchmarks/bench_store_join.py`` (``--repeats 7``, ``--delays 0.05,0.2,0.5``). Each trial
forks two processes: a "rank 0" that opens a real ``torch.distributed.TCPStore`` as master after ``delay`` seconds
(the time rank 0 of a forked multi-worker arm may take to get there after rank 1), and a "rank 1" that starts
at once and opens the client store (``plain``: as ``init_process_group(init_method="env://")`` does; ``wait``:
after ``wait_for_store``), then reads a key rank 0 set. Figure: seconds from the master store's creation to the
client's read. Both variants run in turn for every delay and repeat (interleaved, ``plain`` first on even
repeats). Criterion: the median per variant over every delay and repeat, and their difference. APPENDS a record
(date, git state, host load, threads) to ``benchmarks/results/store_join.json``; every run is kept.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainers.provenance import git_state  # noqa: E402
from trainers.worker import wait_for_store  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import records  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "store_join.json"


def _master(port: int, delay: float, out: Any) -> None:
    import torch.distributed as dist

    time.sleep(delay)
    up = time.time()
    store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    store.set("ready", "1")
    out.put(("up", up))
    time.sleep(2.0)  # the client reads before the store goes away


def _client(port: int, wait: bool, out: Any) -> None:
    import torch.distributed as dist

    if wait:
        wait_for_store("127.0.0.1", port, 30.0)
    store = dist.TCPStore("127.0.0.1", port, 2, False)
    store.get("ready")
    out.put(("joined", time.time()))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def one(delay: float, wait: bool) -> float:
    ctx = mp.get_context("fork")  # as the fork server's children: torch already imported
    out = ctx.Queue()
    port = _free_port()
    master = ctx.Process(target=_master, args=(port, delay, out))
    client = ctx.Process(target=_client, args=(port, wait, out))
    master.start()
    client.start()
    got = dict([out.get(timeout=60), out.get(timeout=60)])
    client.join()
    master.join()
    return got["joined"] - got["up"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--delays", default="0.05,0.2,0.5")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    import torch  # noqa: F401 - imported once here, inherited by every forked rank

    delays = [float(d) for d in args.delays.split(",")]
    load = os.getloadavg()
    rows: dict[str, list[float]] = {"plain": [], "wait": []}
    for repeat in range(args.repeats):
        order = ("plain", "wait") if repeat % 2 == 0 else ("wait", "plain")
        for delay in delays:
            for variant in order:
                rows[variant].append(round(one(delay, variant == "wait"), 4))
    medians = {k: statistics.median(v) for k, v in rows.items()}
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_state(REPO),
              "host": records.host(load), "note": args.note, "delays_s": delays, "repeats": args.repeats,
              "criterion": "median over every delay and repeat of store up -> client joined, per variant",
              "joined_after_up_s": rows, "median_s": medians,
              "saved_median_s": round(medians["plain"] - medians["wait"], 4)}
    print(f"median joined-after-up: plain {medians['plain']:.3f} s, wait_for_store {medians['wait']:.3f} s")
    records.append(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
