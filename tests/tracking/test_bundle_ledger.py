"""A sweep's receipt bundle written from what its driver logged (``receipt_bundle.Ledger``) is byte for byte the
bundle a search of its runs gives, on a real SQLite store; a resumed sweep, whose earlier runs this driver did not
log, gets its bundle from the search and still lists every arm."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import pytest
from mlflow.exceptions import MlflowException
from sweeps_common import by_block, fresh_mlflow_uri

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))

from promote_sim import Sim, moe, simulate  # noqa: E402

from ablate.receipts.schema import Receipt  # noqa: E402
from ablate.receipts.store import seal  # noqa: E402
from ablate.tracking.blocks import block_runs  # noqa: E402
from ablate.tracking.mapping import TAG  # noqa: E402
from ablate.tracking.mlflow_store import MlflowStore, TrackingClient, load_receipts_from_mlflow  # noqa: E402
from ablate.tracking.receipt_bundle import BUNDLE_ARTIFACT, RUNS_TAG, SHA_TAG, bundle_bytes  # noqa: E402


@pytest.fixture(scope="module")
def sweep_arms() -> list[Receipt]:
    """One sweep's arms (2 hosts x 3 blocks + A/A blocks), in the order they ran."""
    receipts = [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=2, blocks_per_host=3, rounds=1), seed=7)]
    return sorted(receipts, key=lambda r: (r.identity.block_id, r.identity.order))


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The filter of every run search the tracking client makes (the searches still run against the store)."""
    seen: list[str] = []
    real = TrackingClient.search

    def recording(self: TrackingClient, filters: Any) -> list[Any]:
        filters = list(filters)
        seen.append(" and ".join(filters))
        return real(self, filters)

    monkeypatch.setattr(TrackingClient, "search", recording)
    return seen


def _sweep_arm_search(sweep: str) -> str:
    return f"tags.`{TAG}role` = 'arm' and tags.`{TAG}sweep_id` = '{sweep}'"


def _open(uri: str, tmp_path: Path, sweep: str) -> MlflowStore:
    store = MlflowStore(uri, "ablate", tmp_path / "sweep")
    assert store.open_sweep(sweep, "sim", {}, {}, system_metrics=False) is not None
    return store


def _logged_bundle(store: MlflowStore) -> bytes:
    client = store.client
    assert client is not None and store.parent_run_id is not None
    parent = client.client.get_run(store.parent_run_id)
    data = Path(client.client.download_artifacts(parent.info.run_id, BUNDLE_ARTIFACT, str(Path(store.sweep_dir))))
    raw = data.read_bytes()
    assert parent.data.tags[SHA_TAG] == hashlib.sha256(raw).hexdigest()
    assert parent.data.tags[RUNS_TAG] == str(len(client.arm_runs(store.sweep_id)))
    return raw


def _searched_bundle(uri: str, sweep: str) -> bytes:
    """What ``write_bundle`` writes from a search of the sweep's runs (a resumed sweep, a sync)."""
    client = TrackingClient(uri, "ablate")
    return bundle_bytes(sweep, list(client.arm_runs(sweep).values()), list(block_runs(client, sweep).values()))


def _read_ids(uri: str, sweep: str) -> list[str]:
    receipts, rejected, _ = load_receipts_from_mlflow(uri, "ablate", sweep_id=sweep)
    assert rejected == []
    return sorted(r.identity.receipt_id for r in receipts)


def test_a_sweep_logged_by_one_driver_gets_the_searched_bundle_without_a_search(
        sweep_arms: list[Receipt], tmp_path: Path, searches: list[str]) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    sweep = sweep_arms[0].identity.sweep_id
    # One block stops at its first arm (a failed first arm ends the attempt): its run is never answered or renamed.
    cut = next(iter(by_block(sweep_arms).values()))[1]
    logged = [r for r in sweep_arms if r is not cut]
    store = _open(uri, tmp_path, sweep)
    for receipt in logged:
        assert store.log_receipt(receipt) is not None
    del searches[:]
    store.close_sweep(sweep, logged, failed=False)
    assert store.online
    # The sweep's arm runs were not read back to close it (the one-arm block's settle reads its own two).
    assert _sweep_arm_search(sweep) not in searches, searches
    assert _logged_bundle(store) == _searched_bundle(uri, sweep)
    assert _read_ids(uri, sweep) == sorted(r.identity.receipt_id for r in logged)
    # The one-arm attempt was still ended as FAILED, with the reason, by the final settle the ledger did not skip.
    client = store.client
    assert client is not None
    unanswered = [run for run in block_runs(client, sweep).values() if run.data.tags.get(TAG + "logged") != "1"]
    assert [run.info.status for run in unanswered] == ["FAILED"]
    assert unanswered[0].data.tags[TAG + "no_answer"] == "the attempt ended with one arm logged"


def test_a_resumed_sweep_bundles_the_earlier_drivers_runs_too(
        sweep_arms: list[Receipt], tmp_path: Path, searches: list[str]) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    sweep = sweep_arms[0].identity.sweep_id
    half = len(sweep_arms) // 2
    first = _open(uri, tmp_path, sweep)
    for receipt in sweep_arms[:half]:
        first.log_receipt(receipt)
    first.close_sweep(sweep, sweep_arms[:half], failed=True)  # stopped early; resumed below
    # The resumed driver did not log the first half: its bundle comes from a search, and lists both halves.
    second = _open(uri, tmp_path, sweep)
    assert second.client is not None and second.client.ledger is None
    for receipt in sweep_arms:
        second.log_receipt(receipt)  # the first half is found logged, as on a resume
    del searches[:]
    second.close_sweep(sweep, sweep_arms, failed=False)
    assert _sweep_arm_search(sweep) in searches
    bundle = _logged_bundle(second)
    assert bundle == _searched_bundle(uri, sweep)
    assert _read_ids(uri, sweep) == sorted(r.identity.receipt_id for r in sweep_arms)


def test_a_write_that_failed_half_way_sends_the_bundle_back_to_the_search(
        sweep_arms: list[Receipt], tmp_path: Path, searches: list[str]) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    sweep = sweep_arms[0].identity.sweep_id
    store = _open(uri, tmp_path, sweep)
    for receipt in sweep_arms[:4]:
        store.log_receipt(receipt)
    client = store.client
    assert client is not None and client.ledger is not None and client.ledger.runs() is not None
    arm_run = next(iter(client.arm_runs(sweep).values()))
    key, value = next(iter(arm_run.data.params.items()))
    # MLflow refuses a param whose value changes: the call fails, and the ledger can no longer vouch for the run.
    with pytest.raises(MlflowException, match="Changing param values is not allowed"):
        client._log_batch(arm_run.info.run_id, params={key: value + "-changed"}, tags={TAG + "status": "edited"})
    assert client.ledger.runs() is None
    del searches[:]
    store.close_sweep(sweep, sweep_arms[:4], failed=False)
    assert _sweep_arm_search(sweep) in searches
    assert _logged_bundle(store) == _searched_bundle(uri, sweep)
