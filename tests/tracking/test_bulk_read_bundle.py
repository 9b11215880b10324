"""Receipts read from per-sweep bundles (ablate.tracking.receipt_bundle) equal those read run by run, on a real
SQLite store and a loopback ``mlflow server``; a bundle that is stale, replaced or disagrees with the runs is
seen, never silently preferred.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from sweeps_common import fresh_mlflow_uri, log_campaign, start_mlflow_server, stop_mlflow_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))

from promote_sim import Sim, moe, simulate  # noqa: E402

from ablate.receipts.schema import Receipt  # noqa: E402
from ablate.receipts.store import seal  # noqa: E402
from ablate.tracking import mlflow_store, receipt_bundle  # noqa: E402
from ablate.tracking.mlflow_store import TrackingClient, load_receipts_from_mlflow  # noqa: E402
from ablate.tracking.receipt_bundle import BUNDLE_ARTIFACT, SHA_TAG, write_bundle  # noqa: E402

ORIGINAL_READ = mlflow_store._read_receipts


@pytest.fixture(scope="module")
def campaign() -> list[Receipt]:
    """Two sweeps (rounds) of one feature, 2 hosts x 2 blocks + A/A blocks."""
    return [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=2, blocks_per_host=2, rounds=2), seed=5)]


def _log(uri: str, receipts: list[Receipt], bundle: bool = True) -> tuple[TrackingClient, dict[str, str]]:
    client, parents = log_campaign(uri, receipts)
    for sweep, parent in parents.items():
        if bundle:
            assert write_bundle(client, parent, sweep) is not None
        client.client.set_terminated(parent, status="FINISHED")
    return client, parents


def _first_sweep_logged(campaign: list[Receipt], tmp_path: Path) -> tuple[str, list[Receipt], TrackingClient,
                                                                           str, str]:
    """The campaign's first sweep alone, logged with its bundle: (uri, its receipts, client, sweep, parent run)."""
    uri = fresh_mlflow_uri(tmp_path)
    first = [r for r in campaign if r.identity.sweep_id == campaign[0].identity.sweep_id]
    client, parents = _log(uri, first)
    (sweep, parent), = parents.items()
    return uri, first, client, sweep, parent


def _moved_into(sweep: str, receipts: list[Receipt]) -> list[Receipt]:
    """Arms logged into ``sweep`` after its bundle was written (re-sealed copies of other sweeps' arms)."""
    return [seal(r.model_copy(update={"identity": r.identity.model_copy(update={"sweep_id": sweep})}))
            for r in receipts]


def _read(uri: str, bundled: bool, monkeypatch: pytest.MonkeyPatch, sweep: str | None = None) -> tuple[Any, ...]:
    """What ``ablate promote`` gets: through the bundle reader (what ``load_receipts_from_mlflow`` calls) or, with
    ``bundled=False``, run by run (the reader it falls back to)."""
    real = receipt_bundle.read_receipts
    if not bundled:
        monkeypatch.setattr(receipt_bundle, "read_receipts", ORIGINAL_READ)
    labels: dict[str, dict[str, str]] = {}
    receipts, rejected, links = load_receipts_from_mlflow(uri, "ablate", sweep_id=sweep, run_labels=labels)
    monkeypatch.setattr(receipt_bundle, "read_receipts", real)
    return [r.model_dump_json() for r in receipts], rejected, links, labels


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(filter, runs returned) of every TrackingClient.search."""
    seen: list[tuple[str, int]] = []
    real = TrackingClient.search

    def counting(self: TrackingClient, filters: Any) -> list[Any]:
        filters = list(filters)
        found = real(self, filters)
        seen.append((" and ".join(filters), len(found)))
        return found

    monkeypatch.setattr(TrackingClient, "search", counting)
    return seen


def _rewrite_bundle(tmp_path: Path, client: TrackingClient, parent: str, edit: Any) -> None:
    """Edit a bundle in place and re-sign it: a consistent forgery, caught only by the per-receipt checks."""
    path = next(p for p in tmp_path.rglob(BUNDLE_ARTIFACT) if parent in str(p))
    body = json.loads(gzip.decompress(path.read_bytes()))
    edit(body)
    data = gzip.compress(json.dumps(body).encode(), mtime=0)
    path.write_bytes(data)
    client.client.set_tag(parent, SHA_TAG, hashlib.sha256(data).hexdigest())


def test_bundles_give_what_the_runs_give_without_searching_arm_runs(
        campaign: list[Receipt], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        searches: list[tuple[str, int]]) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    _log(uri, campaign)
    slow = _read(uri, False, monkeypatch)
    searches.clear()
    fast = _read(uri, True, monkeypatch)
    assert fast == slow and len(fast[0]) == len(campaign) and fast[1] == []
    assert fast[3] and all("block" in label for label in fast[3].values())
    arm_searches = [count for query, count in searches if "'arm'" in query or "'block'" in query]
    assert arm_searches and sum(arm_searches) == 0, "every arm and block run comes from the two bundles"
    sweep = campaign[0].identity.sweep_id
    assert _read(uri, True, monkeypatch, sweep) == _read(uri, False, monkeypatch, sweep)


def test_running_sweep_missing_and_damaged_bundles_fall_back_to_the_runs(
        campaign: list[Receipt], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri, first, client, sweep, parent = _first_sweep_logged(campaign, tmp_path)
    # Resumed: RUNNING again, and a run logged after the bundle. The stale bundle must not hide it.
    client.client.update_run(parent, status="RUNNING")
    late = _moved_into(sweep, [r for r in campaign if r.identity.sweep_id != sweep][:2])
    for receipt in late:
        client.log_receipt(receipt, parent)
    slow = _read(uri, False, monkeypatch)
    assert len(slow[0]) == len(first) + 2
    assert _read(uri, True, monkeypatch) == slow
    # Finished but its bundle replaced by other bytes: seen (a note) and the runs are searched.
    client.client.set_terminated(parent, status="FINISHED")
    path = next(p for p in tmp_path.rglob(BUNDLE_ARTIFACT) if parent in str(p))
    path.write_bytes(gzip.compress(b'{"format": "ablate.receipt-bundle/1", "runs": []}'))
    receipts, rejected, links, labels = _read(uri, True, monkeypatch)
    assert (receipts, links, labels) == (slow[0], slow[2], slow[3])
    assert len(rejected) == 1 and "SHA-256 differs" in rejected[0][1]
    # Re-signed but malformed (an entry without its artifact URI): seen, never a crash, the runs are searched.
    write_bundle(client, parent, sweep)
    _rewrite_bundle(tmp_path, client, parent, lambda body: body["runs"][0].pop("artifact_uri"))
    receipts, rejected, links, labels = _read(uri, True, monkeypatch)
    assert (receipts, links, labels) == (slow[0], slow[2], slow[3])
    assert len(rejected) == 1 and "not a well-formed" in rejected[0][1]


def test_a_deleted_arm_run_of_a_searched_sweep_is_reported_not_dropped(campaign: list[Receipt], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Hole: a sweep without a usable bundle (still RUNNING, never bundled) is searched, the search leaves deleted
    # runs out, and a deleted gated candidate left the evidence without a line (REJECT became PROMOTE).
    uri = fresh_mlflow_uri(tmp_path)
    client, _ = _log(uri, campaign, bundle=False)
    runs = {rid: run.info.run_id for rid, run in client.arm_runs().items()}
    gone = next(r for r in campaign if r.identity.arm.value == "candidate").identity
    client.client.delete_run(runs[gone.receipt_id])
    for bundled in (True, False):
        receipts, rejected, _, _ = _read(uri, bundled, monkeypatch)
        assert len(receipts) == len(campaign) - 1
        assert [origin for origin, _ in rejected] == [f"run {runs[gone.receipt_id]}"], (bundled, rejected)
        assert "deleted in MLflow" in rejected[0][1] and gone.receipt_id in rejected[0][1]
        assert repr(gone.sweep_id) in rejected[0][1]


def test_a_run_restored_after_its_bundle_was_rewritten_is_read_again(campaign: list[Receipt], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Hole: a bundle rewritten while a run was deleted left it out, and once the run was restored the bundle (SHA
    # intact, sweep finished) still stood for the sweep: the restored receipt was never read, without a line.
    uri, first, client, sweep, parent = _first_sweep_logged(campaign, tmp_path)
    run_id = client.arm_runs(sweep)[first[0].identity.receipt_id].info.run_id
    client.client.delete_run(run_id)
    assert write_bundle(client, parent, sweep) is not None  # e.g. a `receipts sync` of the sweep
    # While deleted, the bundle (which left it out) is used, and the run is still named among the rejects.
    receipts, rejected, _, _ = _read(uri, True, monkeypatch)
    assert len(receipts) == len(first) - 1
    assert [origin for origin, _ in rejected] == [f"run {run_id}"] and "deleted in MLflow" in rejected[0][1]
    client.client.restore_run(run_id)
    receipts, rejected, _, _ = _read(uri, True, monkeypatch)
    assert len(receipts) == len(first) and first[0].model_dump_json() in receipts
    assert [origin for origin, _ in rejected] == [f"receipt bundle of sweep {sweep} (run {parent})"]
    assert "deleted no longer" in rejected[0][1] and run_id in rejected[0][1]


def test_deleted_runs_and_forged_entries_are_reported(campaign: list[Receipt], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    client, parents = _log(uri, campaign)
    runs = {rid: run.info.run_id for rid, run in client.arm_runs().items()}
    gone = campaign[0].identity.receipt_id
    client.client.delete_run(runs[gone])
    slow = _read(uri, False, monkeypatch)
    receipts, rejected, links, labels = _read(uri, True, monkeypatch)
    assert (receipts, links, labels) == (slow[0], slow[2], slow[3])
    assert rejected == [(f"run {runs[gone]}", rejected[0][1])] and "deleted after" in rejected[0][1]

    # An entry whose payload was swapped for another valid receipt, re-signed: the run-tag check refuses it.
    victim = campaign[1].identity.receipt_id
    donor = next(r for r in campaign if r.identity.sweep_id == campaign[1].identity.sweep_id
                 and r.identity.receipt_id not in (victim, gone))

    def swap(body: dict[str, Any]) -> None:
        entries = {e["tags"]["ablate.receipt_id"]: e for e in body["runs"]}
        payload = {k: v for k, v in entries[donor.identity.receipt_id]["tags"].items()
                   if k.startswith("ablate.payload.")}
        entries[victim]["tags"] = {**{k: v for k, v in entries[victim]["tags"].items()
                                      if not k.startswith("ablate.payload.")}, **payload}

    _rewrite_bundle(tmp_path, client, parents[campaign[1].identity.sweep_id], swap)
    receipts, rejected, _, _ = _read(uri, True, monkeypatch)
    assert len(receipts) == len(slow[0]) - 1
    reasons = dict(rejected)
    assert "does not match the run's ablate.receipt_id" in reasons[f"run {runs[victim]}"]


def test_a_failed_rewrite_or_a_reopened_sweep_leaves_no_stale_bundle(
        campaign: list[Receipt], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri, first, client, sweep, parent = _first_sweep_logged(campaign, tmp_path)
    assert SHA_TAG in client.client.get_run(parent).data.tags
    # Found again to take more arms (a resume, a sync): the bundle is withdrawn at once.
    assert client.parent_run(sweep, first[0].identity.campaign) == (parent, False)
    assert SHA_TAG not in client.client.get_run(parent).data.tags
    write_bundle(client, parent, sweep)
    # A rewrite that fails after arms were added: the old bundle is gone, so the new arms are still read.
    late = _moved_into(sweep, [r for r in campaign if r.identity.sweep_id != sweep][:2])
    for receipt in late:
        client.log_receipt(receipt, parent)

    def broken(*_: Any, **__: Any) -> bytes:
        raise OSError("disk full")

    real = receipt_bundle.bundle_bytes
    monkeypatch.setattr(receipt_bundle, "bundle_bytes", broken)
    assert write_bundle(client, parent, sweep) is None
    monkeypatch.setattr(receipt_bundle, "bundle_bytes", real)
    assert SHA_TAG not in client.client.get_run(parent).data.tags
    receipts, rejected, _, _ = _read(uri, True, monkeypatch)
    assert len(receipts) == len(first) + 2 and rejected == []


def test_past_the_exclusion_cap_the_other_sweeps_are_searched(
        campaign: list[Receipt], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A SQL store joins one subquery per excluded sweep (SQLite: at most 64 tables): only MAX_EXCLUDED bundles
    # are used, the rest of the sweeps are read by the search, with the same result.
    uri = fresh_mlflow_uri(tmp_path)
    _log(uri, campaign)
    slow = _read(uri, False, monkeypatch)
    monkeypatch.setattr(receipt_bundle, "MAX_EXCLUDED", 1)
    assert _read(uri, True, monkeypatch) == slow and len(slow[0]) == len(campaign)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    # The migrated empty schema, copied: the server then starts without running MLflow's migrations (2-3 s here).
    backend = Path(fresh_mlflow_uri(tmp_path / "server").removeprefix("sqlite:///"))
    proc, url = start_mlflow_server(backend, tmp_path / "artifacts", tmp_path / "server.log")
    try:
        yield url
    finally:
        stop_mlflow_server(proc)


def test_server_bundles_equal_the_runs(campaign: list[Receipt], server: str, monkeypatch: pytest.MonkeyPatch,
                                       searches: list[tuple[str, int]]) -> None:
    _log(server, campaign)
    slow = _read(server, False, monkeypatch)
    searches.clear()
    assert _read(server, True, monkeypatch) == slow and len(slow[0]) == len(campaign)
    assert sum(count for query, count in searches if "'arm'" in query or "'block'" in query) == 0


@pytest.mark.parametrize("tags, ok", [({}, True), ({"ablate.role": "arm", "mlflow.parentRunId": "p"}, True),
                                      ({"ablate.role": 1}, False), ({"ablate.role": None}, False),
                                      ({"ablate.role": ["arm"]}, False), ({"ablate.role": {"a": "b"}}, False),
                                      (["ablate.role", "arm"], False), (None, False)])
def test_a_bundle_entry_must_hold_its_tags_as_strings(tags: object, ok: bool) -> None:
    from ablate.tracking.receipt_bundle import _well_formed

    entry = {"run_id": "r1", "run_name": None, "artifact_uri": "file:///a", "tags": tags}
    good = {"run_id": "r0", "run_name": "arm", "artifact_uri": "file:///b", "tags": {"ablate.role": "arm"}}
    body = json.loads(json.dumps({"sweep_id": "s", "runs": [good, entry], "blocks": {}}))  # as a bundle is read
    assert _well_formed(body) is ok
