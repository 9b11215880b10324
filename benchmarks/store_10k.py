"""A 10,000-receipt MLflow store for bench_promote_store.py, written through the product's write path.

How to run me: ``python benchmarks/store_10k.py [--receipts 10368] [--workers 2] [--render-every-png]``; prints
where the store is. Cached under ``/tmp/ablate-bench-10k/<key>/`` (key: receipt schema version, payload format,
receipt count), reused when its ``populated.json`` marker is there.

Receipts: the simulated campaign of bench_promote.py (8 lanes, 4 hosts, 2 rounds = 2 sweeps), real validated
``Receipt`` objects. Each sweep is logged by its own process through ``TrackingClient.parent_run``,
``log_receipt`` (params, tags with the receipt payload, metrics and per-step series, ``receipt.json``,
``goodput.png``) and ``log_summary``, as ``ablate receipts sync`` does. The writers remember what they logged in
``<store>/writer-cache`` (a sweep's driver does so in the user's cache), never in the user's own cache.

One shortcut, off with ``--render-every-png``: ``goodput.png`` is rendered for real once per (lane, arm role) and
its bytes reused for the other receipts of that pair. Rendering is ~0.3 s of the ~0.4 s a receipt costs to log
on this 2-core machine and no reader opens the PNG (promote reads ``receipt.json`` or the payload), so the store
has the same runs, tags, params, metrics and artifacts per run, only fewer distinct PNG images.

The loopback server gets a copy of the SQLite database whose artifact URIs point at ``mlflow-artifacts:/``
(served by ``mlflow server --artifacts-destination <this store's mlartifacts>``): the same runs as a store written
through that server, without logging 10,000 receipts a second time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "promote"), str(REPO / "benchmarks")]

from ablate.receipts.schema import SCHEMA_VERSION  # noqa: E402

CACHE_ROOT = Path("/tmp/ablate-bench-10k")
EXPERIMENT = "ablate"
PAYLOAD_FORMAT = "p1"
MARKER = "populated.json"
WRITER_CACHE = "writer-cache"
"""Where the populating writers remember the payloads they logged (``ablate.receipts.accepted``), as a sweep's
driver does in the user's cache: bench_promote_store.py's ``sweep`` runs start from a copy of it."""


def store_dir(num_receipts: int, render_every_png: bool) -> Path:
    return CACHE_ROOT / f"schema{SCHEMA_VERSION}-{PAYLOAD_FORMAT}-n{num_receipts}{'-png' if render_every_png else ''}"


def sqlite_uri(directory: Path) -> str:
    return f"sqlite:///{directory / 'mlflow.db'}"


def _cached_png(real: Any) -> Any:
    cache: dict[tuple[str, str], bytes] = {}

    def goodput_png(receipt: Any, path: Path, title: str = "") -> Path:
        key = (receipt.identity.lane_key, receipt.identity.arm.value)
        if key not in cache:
            cache[key] = Path(real(receipt, path, title=title)).read_bytes()
        Path(path).write_bytes(cache[key])
        return Path(path)

    return goodput_png


def _log_sweep(args: tuple[str, str, list[Any], bool, str]) -> dict[str, Any]:
    uri, sweep_id, receipts, render_every_png, writer_cache = args
    import os

    from ablate.receipts.accepted import CACHE_ENV

    os.environ[CACHE_ENV] = writer_cache
    from ablate.tracking import mlflow_store
    from ablate.tracking.mlflow_store import TrackingClient

    if not render_every_png:
        mlflow_store.goodput_png = _cached_png(mlflow_store.goodput_png)
    start = time.perf_counter()
    client = TrackingClient(uri, EXPERIMENT)
    parent, _ = client.parent_run(sweep_id, receipts[0].identity.campaign)
    retries = 0
    for receipt in receipts:
        for attempt in range(6):
            try:
                client.log_receipt(receipt, parent)  # idempotent by receipt id: a retry after "locked" is safe
                break
            except Exception:  # noqa: BLE001 - two SQLite writers: "database is locked" now and then
                retries += 1
                if attempt == 5:
                    raise
                time.sleep(0.5 * (attempt + 1))
    client.log_summary(parent, sweep_id, receipts)
    client.client.set_terminated(parent, status="FINISHED")
    return {"sweep_id": sweep_id, "receipts": len(receipts), "seconds": round(time.perf_counter() - start, 1),
            "retries": retries}


def populate(num_receipts: int = 10_368, workers: int = 2, render_every_png: bool = False) -> Path:
    """The cached store's directory, populated first when needed (prints the population time)."""
    from bench_promote import build

    from ablate.tracking.mlflow_store import TrackingClient

    directory = store_dir(num_receipts, render_every_png)
    if (directory / MARKER).exists():
        return directory
    if directory.exists():
        shutil.rmtree(directory)  # a population that died half-way: start over
    directory.mkdir(parents=True)
    start = time.perf_counter()
    receipts = build(num_receipts)
    build_s = time.perf_counter() - start
    TrackingClient(sqlite_uri(directory), EXPERIMENT)  # schema migrations and the experiment, once
    by_sweep: dict[str, list[Any]] = {}
    for receipt in receipts:
        by_sweep.setdefault(receipt.identity.sweep_id, []).append(receipt)
    writer_cache = directory / WRITER_CACHE
    writer_cache.mkdir(mode=0o700)
    jobs = [(sqlite_uri(directory), sweep, mine, render_every_png, str(writer_cache))
            for sweep, mine in sorted(by_sweep.items())]
    with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        sweeps = pool.map(_log_sweep, jobs)
    record = {"receipts": len(receipts), "sweeps": sweeps, "workers": workers, "build_receipts_s": round(build_s, 1),
              "populate_s": round(time.perf_counter() - start, 1), "render_every_png": render_every_png,
              "schema_version": SCHEMA_VERSION, "payload_format": PAYLOAD_FORMAT,
              "writer_cache": sorted(p.name for p in writer_cache.glob("accepted-*.bin")),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (directory / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    print(f"populated {directory} in {record['populate_s']} s: {json.dumps(sweeps)}", flush=True)
    return directory


def server_backend(directory: Path) -> Path:
    """A copy of the store's database for ``mlflow server``: artifact URIs ``file://<dir>/mlartifacts/...`` become
    ``mlflow-artifacts:/...``, which the server resolves under ``--artifacts-destination <dir>/mlartifacts``."""
    target = directory / "server.db"
    if target.exists():
        return target
    tmp = directory / "server.db.tmp"
    shutil.copyfile(directory / "mlflow.db", tmp)
    local = (directory / "mlartifacts").as_uri()
    with sqlite3.connect(tmp) as db:
        db.execute("UPDATE experiments SET artifact_location = replace(artifact_location, ?, 'mlflow-artifacts:')",
                   (local,))
        db.execute("UPDATE runs SET artifact_uri = replace(artifact_uri, ?, 'mlflow-artifacts:')", (local,))
        left = db.execute("SELECT count(*) FROM runs WHERE artifact_uri NOT LIKE 'mlflow-artifacts:/%'").fetchone()[0]
    if left:
        raise RuntimeError(f"{left} runs keep a local artifact URI in {tmp}")
    tmp.rename(target)
    return target


def add_bundles(directory: Path) -> dict[str, Any]:
    """Give a store populated before receipt bundles existed one bundle per sweep (``write_bundle``, as a sweep's
    close would), and copy the parent runs' bundle tags into the server's database (same artifacts directory).
    Idempotent: a store whose sweeps all carry a bundle tag is left as it is."""
    from ablate.tracking.mapping import ROLE_SWEEP, TAG
    from ablate.tracking.mlflow_store import TrackingClient
    from ablate.tracking.receipt_bundle import RUNS_TAG, SHA_TAG, write_bundle

    marker = directory / "bundles.json"
    if marker.exists():
        return json.loads(marker.read_text())
    client = TrackingClient(sqlite_uri(directory), EXPERIMENT)
    done: dict[str, Any] = {}
    for parent in client.search([f"tags.`{TAG}role` = '{ROLE_SWEEP}'"]):
        sweep = parent.data.tags[TAG + "sweep_id"]
        start = time.perf_counter()
        done[sweep] = {"sha256": write_bundle(client, parent.info.run_id, sweep),
                       "seconds": round(time.perf_counter() - start, 1)}
    server_db = server_backend(directory)
    with sqlite3.connect(directory / "mlflow.db") as source, sqlite3.connect(server_db) as target:
        rows = source.execute("SELECT key, value, run_uuid FROM tags WHERE key IN (?, ?)",
                              (SHA_TAG, RUNS_TAG)).fetchall()
        target.executemany("INSERT OR REPLACE INTO tags (key, value, run_uuid) VALUES (?, ?, ?)", rows)
    record = {"sweeps": done, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    marker.write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receipts", type=int, default=10_368)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--render-every-png", action="store_true")
    args = parser.parse_args()
    directory = populate(args.receipts, args.workers, args.render_every_png)
    server_backend(directory)
    print(json.dumps(add_bundles(directory)))
    print(directory)


if __name__ == "__main__":
    main()
