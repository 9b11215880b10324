"""``ablate.tracking.writer.StoreProcess``: a sweep's MLflow writes in a spawned child, on a real SQLite store.

What it logs is what the in-process store logs (every receipt, its bundle at close, read back whole); a child that
dies mid-sweep costs no receipt (the rest are spooled, the reason says so, a sync brings MLflow to exactly the
receipts on disk); an error raised in the child reaches the caller.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from sweeps_common import fresh_mlflow_uri

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))

from promote_sim import Sim, moe, simulate  # noqa: E402

from ablate.receipts.schema import Receipt  # noqa: E402
from ablate.receipts.store import RECEIPTS_DIR, SPOOL_FILE, seal, write_receipt_or_fallback  # noqa: E402
from ablate.tracking.mlflow_store import TrackingClient, load_receipts_from_mlflow, sync  # noqa: E402
from ablate.tracking.mapping import TAG  # noqa: E402
from ablate.tracking.receipt_bundle import SHA_TAG  # noqa: E402
from ablate.tracking.writer import StoreProcess  # noqa: E402


@pytest.fixture(scope="module")
def receipts() -> list[Receipt]:
    made = [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=1, blocks_per_host=3, rounds=1), seed=11)]
    return sorted(made, key=lambda r: (r.identity.block_id, r.identity.order))


def _on_disk(receipts: list[Receipt], sweep_dir: Path) -> None:
    # What the sweep's recorder does before it hands a receipt to the store.
    for receipt in receipts:
        write_receipt_or_fallback(receipt, sweep_dir / RECEIPTS_DIR)


def test_the_writer_process_logs_every_receipt_and_the_bundle(receipts: list[Receipt], tmp_path: Path) -> None:
    uri, sweep_dir = fresh_mlflow_uri(tmp_path), tmp_path / "sweep"
    sweep = receipts[0].identity.sweep_id
    _on_disk(receipts, sweep_dir)
    store = StoreProcess(uri, "ablate", sweep_dir)
    try:
        assert store._process.pid != os.getpid()
        parent = store.open_sweep(sweep, "sim", {"blocks": 3}, {"ablate.design": "blocks"}, system_metrics=False)
        assert parent is not None and store.parent_run_id == parent and store.online
        run_ids = [store.log_receipt(r) for r in receipts]
        assert None not in run_ids and len(set(run_ids)) == len(receipts)
        assert store.logged == {r.identity.receipt_id: run_id for r, run_id in zip(receipts, run_ids)}
        assert store.log_receipt(receipts[0]) == run_ids[0], "a receipt logged once is not sent again"
        store.close_sweep(sweep, receipts, failed=False)
    finally:
        store.shutdown()
    assert store._process.exitcode == 0
    assert store.spooled == 0 and not (sweep_dir / SPOOL_FILE).exists()
    client = TrackingClient(uri, "ablate")
    sweep_run = client.client.get_run(parent)
    assert sweep_run.info.status == "FINISHED" and SHA_TAG in sweep_run.data.tags, "closed, with its bundle"
    read, rejected, _ = load_receipts_from_mlflow(uri, "ablate", sweep_id=sweep)
    assert rejected == []
    assert sorted(r.identity.receipt_id for r in read) == sorted(r.identity.receipt_id for r in receipts)


def test_a_writer_process_that_dies_loses_no_receipt(receipts: list[Receipt], tmp_path: Path) -> None:
    uri, sweep_dir = fresh_mlflow_uri(tmp_path), tmp_path / "sweep"
    sweep = receipts[0].identity.sweep_id
    _on_disk(receipts, sweep_dir)
    half = len(receipts) // 2
    store = StoreProcess(uri, "ablate", sweep_dir)
    try:
        assert store.open_sweep(sweep, "sim", {}, {}, system_metrics=False) is not None
        assert None not in [store.log_receipt(r) for r in receipts[:half]]
        os.kill(store._process.pid, signal.SIGKILL)  # out of memory, a crash: no goodbye
        store._process.join(10)
        assert [store.log_receipt(r) for r in receipts[half:]] == [None] * (len(receipts) - half)
        assert not store.online and "writer process ended" in (store.offline_reason or "")
        assert store.spooled == len(receipts) - half and (sweep_dir / SPOOL_FILE).is_file()
        assert store.spooled_ids == {r.identity.receipt_id for r in receipts[half:]}
        store.close_sweep(sweep, receipts, failed=False)  # nothing to close it with: no error either
    finally:
        store.shutdown()
    for _ in range(2):  # what the summary says to run; a second sync changes nothing
        result = sync(sweep_dir, uri)
        assert result.rejected == []
    runs = TrackingClient(uri, "ablate").search([f"tags.`{TAG}role` = 'arm'"])
    assert sorted(run.data.tags[TAG + "receipt_id"] for run in runs) == sorted(r.identity.receipt_id
                                                                               for r in receipts)


def test_an_error_raised_in_the_writer_process_reaches_the_caller(tmp_path: Path) -> None:
    store = StoreProcess(fresh_mlflow_uri(tmp_path), "ablate", tmp_path / "sweep")
    try:
        with pytest.raises(AttributeError, match="no_such_call"):
            store._call("no_such_call")
        assert store.online, "the writer is still there for the next call"
        assert store.open_sweep("s-1", "sim", {}, {}, system_metrics=False) is not None
    finally:
        store.shutdown()
    assert store._process.exitcode == 0
