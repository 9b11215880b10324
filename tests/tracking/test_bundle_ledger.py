"""A sweep's receipt bundle written from what its driver logged (``receipt_bundle.Ledger``) is byte for byte the
bundle a search of its runs gives, on a real SQLite store; a resumed sweep, whose earlier runs this driver did not
log, gets its bundle from the search and still lists every arm."""

from __future__ import annotations

import hashlib
import io
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


class _Run:
    """What ``create_run`` returns, as far as the ledger and the bundle read it."""

    def __init__(self, run_id: str, name: str, tags: dict[str, str]) -> None:
        self.info = type("Info", (), {"run_id": run_id, "run_name": name, "artifact_uri": f"file:///a/{run_id}"})()
        self.data = type("Data", (), {"tags": tags})()


def _payload_tags(number: int) -> dict[str, str]:
    # An arm's kept tags: the ablate.* ones, a payload of ~8 KB among them.
    return {TAG + "receipt_id": f"r{number:05d}", TAG + "payload.0": f"{number:05d}" * 1600,
            "mlflow.parentRunId": f"block-{number // 2}", "mlflow.user": "not kept"}


def test_the_streamed_bundle_is_the_json_of_the_whole_body() -> None:
    # Readers parse the bundle as one JSON document: the streamed text must be exactly what json.dumps(body,
    # sort_keys=True) gives (unicode, quotes, empty lists, nested tags sorted).
    import gzip
    import json

    runs = [_Run(f"run{n}", f"arm \"{n}\" é", _payload_tags(n) | {TAG + "z": "ü", TAG + "a": ""}) for n in (3, 1, 2)]
    blocks = [_Run("b2", "block ✓", {}), _Run("b1", None, {})]  # type: ignore[arg-type]
    for arms, deleted in ((runs, ["d2", "d1"]), ([], [])):
        body = {"format": "ablate.receipt-bundle/1", "sweep_id": "sw-ü",
                "runs": [{"run_id": r.info.run_id, "run_name": r.info.run_name, "artifact_uri": r.info.artifact_uri,
                          "tags": {k: v for k, v in r.data.tags.items() if k.startswith(TAG) or k == "mlflow.parentRunId"}}
                         for r in sorted(arms, key=lambda r: r.info.run_id)],
                "blocks": {"b2": "block ✓", "b1": None}, "deleted": sorted(deleted)}
        streamed = gzip.decompress(bundle_bytes("sw-ü", arms, blocks, deleted))
        assert streamed == json.dumps(body, sort_keys=True).encode("utf-8")
        assert bundle_bytes("sw-ü", arms, blocks, deleted) == bundle_bytes("sw-ü", list(reversed(arms)), blocks,
                                                                           deleted)  # same runs, same bytes


def test_the_ledger_keeps_its_entries_on_disk_not_in_the_driver() -> None:
    import gzip
    import json
    import tracemalloc

    from ablate.tracking.receipt_bundle import Ledger, _write_bundle_file

    ledger = Ledger("sw")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for number in range(400):
        ledger.arm_created(_Run(f"run{number:05d}", f"arm{number}", {}), _payload_tags(number))
        ledger.tags_logged(f"run{number:05d}", {TAG + "logged": "1", "mlflow.runName": f"arm{number}·done"})
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # 400 entries of ~8 KB are ~3.2 MB; the driver holds their offsets only (~150 bytes an arm).
    assert held < 400 * 1024, held
    entries, blocks = ledger.runs()  # type: ignore[misc]
    assert len(entries) == 400 and blocks == {}
    import io

    out = io.BytesIO()
    _write_bundle_file(out, "sw", entries, blocks, [])
    body = json.loads(gzip.decompress(out.getvalue()))
    assert [e["run_id"] for e in body["runs"]] == sorted(f"run{n:05d}" for n in range(400))
    last = body["runs"][-1]
    assert last["run_name"] == "arm399·done" and last["tags"][TAG + "logged"] == "1"
    assert last["tags"][TAG + "payload.0"] == "00399" * 1600 and "mlflow.user" not in last["tags"]
    ledger.close()
    assert ledger.runs() is None  # closed: a later bundle of the sweep is searched


def test_a_ledger_file_that_cannot_be_written_sends_the_bundle_to_the_search(
        sweep_arms: list[Receipt], tmp_path: Path, searches: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    uri = fresh_mlflow_uri(tmp_path)
    sweep = sweep_arms[0].identity.sweep_id
    store = _open(uri, tmp_path, sweep)

    def full(*_: Any, **__: Any) -> Any:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(tempfile, "TemporaryFile", full)
        for receipt in sweep_arms:
            assert store.log_receipt(receipt) is not None  # the receipts are logged all the same
    client = store.client
    assert client is not None and client.ledger is not None and client.ledger.runs() is None
    del searches[:]
    store.close_sweep(sweep, sweep_arms, failed=False)
    assert _sweep_arm_search(sweep) in searches
    assert _logged_bundle(store) == _searched_bundle(uri, sweep)
    assert _read_ids(uri, sweep) == sorted(r.identity.receipt_id for r in sweep_arms)


class _QuotaFile(io.FileIO):
    """A real file whose writes fail as a full disk's do (ENOSPC) once ``quota`` bytes are in."""

    def __init__(self, path: str, quota: int) -> None:
        super().__init__(path, "w+")
        self.quota, self.used = quota, 0

    def write(self, data: Any) -> int:
        if self.used + len(data) > self.quota:
            raise OSError(28, "No space left on device")
        self.used += len(data)
        return super().write(data)


@pytest.mark.parametrize("quota", [20_000, 10 ** 9], ids=["fills-mid-sweep", "never-fills"])
def test_a_temporary_disk_that_fills_up_under_the_ledger_costs_only_a_search(
        sweep_arms: list[Receipt], tmp_path: Path, searches: list[str], monkeypatch: pytest.MonkeyPatch,
        quota: int) -> None:
    # Found in review: the buffered file refused a later flush, the ledger's own clean-up raised it again, and the
    # store went offline for the rest of the sweep (every later arm spooled) while MLflow itself was healthy.
    import tempfile

    uri = fresh_mlflow_uri(tmp_path)
    sweep = sweep_arms[0].identity.sweep_id
    store = _open(uri, tmp_path, sweep)
    with monkeypatch.context() as patched:
        patched.setattr(tempfile, "TemporaryFile", lambda **_: io.BufferedRandom(
            _QuotaFile(str(tmp_path / "ledger.bin"), quota)))
        for receipt in sweep_arms:
            assert store.log_receipt(receipt) is not None
        assert store.online and store.spooled == 0
        del searches[:]
        store.close_sweep(sweep, sweep_arms, failed=False)
    assert store.online
    assert (_sweep_arm_search(sweep) in searches) == (quota == 20_000)  # the full disk sent the bundle to a search
    assert _logged_bundle(store) == _searched_bundle(uri, sweep)
    assert _read_ids(uri, sweep) == sorted(r.identity.receipt_id for r in sweep_arms)
