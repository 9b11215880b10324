"""Receipts read back in bulk from their runs' payload tags, against the artifact path, on a real SQLite store
and a real loopback ``mlflow server``.

Receipts are simulated campaigns (tests/promote/promote_sim.py), real validated ``Receipt`` objects.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from sweeps_common import fresh_mlflow_uri, log_campaign, start_mlflow_server, stop_mlflow_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))

from promote_sim import Sim, make_receipt, moe, simulate  # noqa: E402

from ablate.receipts.schema import Receipt  # noqa: E402
from ablate.tracking.receipt_bundle import withdraw_bundle  # noqa: E402
from ablate.receipts.store import seal  # noqa: E402
from ablate.tracking import bulk_read, payload  # noqa: E402
from ablate.tracking.mlflow_store import TrackingClient, load_receipts_from_mlflow  # noqa: E402

@pytest.fixture(scope="module")
def campaign() -> list[Receipt]:
    """60 receipts: one feature, 3 hosts x 4 blocks + 3 A/A blocks, 2 rounds (two sweeps)."""
    return [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=3, blocks_per_host=4, rounds=2), seed=3)]


@pytest.fixture
def artifact_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run ids whose receipt.json the reader downloaded."""
    seen: list[str] = []
    real = bulk_read._from_artifact

    def counting(run: Any, tracking_uri: str, tmp: Path) -> bulk_read.Outcome:
        seen.append(run.info.run_id)
        return real(run, tracking_uri, tmp)

    monkeypatch.setattr(bulk_read, "_from_artifact", counting)
    return seen


def _log(uri: str, receipts: list[Receipt]) -> TrackingClient:
    return log_campaign(uri, receipts)[0]


def _strip_payload(client: TrackingClient, run_id: str) -> None:
    """A run as logged before payloads existed."""
    for key in [k for k in client.client.get_run(run_id).data.tags if k.startswith(payload.PAYLOAD_TAG)]:
        client.client.delete_tag(run_id, key)


def _set_payload(client: TrackingClient, run_id: str, data: bytes) -> None:
    _strip_payload(client, run_id)
    for key, value in payload.encode_json(data).items():
        client.client.set_tag(run_id, key, value)


def _dumps(receipts: list[Receipt]) -> list[str]:
    return sorted(r.model_dump_json() for r in receipts)


def _check_bulk_equals_artifacts(uri: str, receipts: list[Receipt], artifact_reads: list[str],
                                 old_run: str) -> None:
    bulk, bulk_rejected, bulk_links = load_receipts_from_mlflow(uri, "ablate")
    assert bulk_rejected == [] and _dumps(bulk) == _dumps(receipts)
    assert artifact_reads == [old_run], "only the run without a payload is read from its receipt.json"
    artifact_reads.clear()
    slow, slow_rejected, slow_links = load_receipts_from_mlflow(uri, "ablate", use_payload=False)
    assert slow_rejected == [] and _dumps(slow) == _dumps(bulk) and slow_links == bulk_links
    assert len(artifact_reads) == len(receipts)


def test_sqlite_bulk_path_returns_the_artifact_paths_receipts(campaign: list[Receipt], tmp_path: Path,
                                                              artifact_reads: list[str]) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    client = _log(uri, campaign)
    old = client.arm_runs()[campaign[7].identity.receipt_id].info.run_id
    _strip_payload(client, old)
    _check_bulk_equals_artifacts(uri, campaign, artifact_reads, old)


def test_damaged_payloads_are_refused_like_a_damaged_receipt_json(campaign: list[Receipt], tmp_path: Path) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    first, second, third, fourth, fifth = campaign[:5]
    client = _log(uri, [first, second, third, fourth, fifth])
    runs = {rid: run.info.run_id for rid, run in client.arm_runs().items()}

    # The same edit (loss changed, digest kept) in the payload of one run and in the receipt.json of another.
    edited = json.loads(first.model_dump_json())
    edited["quality"]["loss_final"] = 0.001
    _set_payload(client, runs[first.identity.receipt_id], json.dumps(edited).encode())
    artifact = next(p for p in (tmp_path / "mlartifacts").rglob("receipt.json")
                    if runs[second.identity.receipt_id] in str(p))
    damaged = json.loads(artifact.read_text())
    damaged["quality"]["loss_final"] = 0.001
    artifact.write_text(json.dumps(damaged))
    _strip_payload(client, runs[second.identity.receipt_id])  # so its receipt.json is what is read
    # A valid, sealed receipt in the wrong run: its own digest matches, the run's tags do not.
    _set_payload(client, runs[third.identity.receipt_id], fourth.model_dump_json().encode())
    client.client.set_tag(runs[fourth.identity.receipt_id], payload.PAYLOAD_TAG + "0", "not base64 !")
    _set_payload(client, runs[fifth.identity.receipt_id], b'{"schema_version": ["2"], "identity": 7}')

    found, rejected, _ = load_receipts_from_mlflow(uri, "ablate")
    assert found == [], "no damaged copy is used, and none is silently replaced by the artifact"
    reasons = dict(rejected)
    assert set(reasons) == {f"run {run_id}" for run_id in runs.values()}
    by_payload, by_artifact = reasons[f"run {runs[first.identity.receipt_id]}"], \
        reasons[f"run {runs[second.identity.receipt_id]}"]
    assert "content does not match its digest" in by_artifact
    assert by_payload.startswith(by_artifact.split(" (stored")[0]) and "ablate.payload" in by_payload
    assert f"does not match the run's ablate.receipt_id {third.identity.receipt_id}" in \
        reasons[f"run {runs[third.identity.receipt_id]}"]
    assert "not base64 zlib data" in reasons[f"run {runs[fourth.identity.receipt_id]}"]
    assert "ablate.payload" in reasons[f"run {runs[fifth.identity.receipt_id]}"]


def test_large_receipts_are_chunked_and_too_large_ones_fall_back_to_receipt_json(
        tmp_path: Path, artifact_reads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from promote_sim import T0, base_lane

    long_arm = seal(make_receipt(receipt_id="long-a0", sweep_id="long", block_id="b1", arm="aa", arm_index=0,
                                 order=0, feature=None, feature_value=None, baseline_value=None, lane=base_lane(),
                                 host="node-0", tps=5000.0, loss=5.0, created_at=T0, steps=1500, step_jitter=0.05))
    tags = payload.payload_tags(long_arm)
    assert int(tags[payload.COUNT_TAG]) >= 3 and all(len(v) <= payload.CHUNK_CHARS for v in tags.values())
    uri = fresh_mlflow_uri(tmp_path)
    client = _log(uri, [long_arm])
    assert load_receipts_from_mlflow(uri, "ablate")[:2] == ([long_arm], []) and artifact_reads == []

    other = seal(long_arm.model_copy(update={"identity": long_arm.identity.model_copy(
        update={"receipt_id": "long-a1", "arm_index": 1, "order": 1})}))
    with monkeypatch.context() as patch:  # a writer whose limit this receipt exceeds
        patch.setattr(payload, "MAX_CHUNKS", int(tags[payload.COUNT_TAG]) - 1)
        run_id = client.log_receipt(other, client.parent_run("long", "sim")[0])[0]
    assert not any(k.startswith(payload.PAYLOAD_TAG) for k in client.client.get_run(run_id).data.tags)
    found, rejected, _ = load_receipts_from_mlflow(uri, "ablate")
    assert rejected == [] and _dumps(found) == _dumps([long_arm, other]) and artifact_reads == [run_id]


def test_a_zip_bomb_payload_is_refused_without_inflating_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "MAX_JSON_BYTES", 1 << 20)
    bomb = payload.encode_json(b" " * (4 << 20))
    with pytest.raises(payload.PayloadError, match="larger than"):
        payload.payload_json(bomb)
    with pytest.raises(payload.PayloadError, match="is missing"):
        payload.payload_json({**bomb, payload.COUNT_TAG: str(int(bomb[payload.COUNT_TAG]) + 1)})
    assert payload.payload_json({"ablate.receipt_id": "x"}) is None
    assert sum(map(len, bomb.values())) < 20_000, "a few KB of tags that would inflate to 4 MB"


def test_a_download_error_becomes_a_reason_without_the_tracking_uris_password(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow's error quotes the URI it called; the reason goes to stderr and into the report (PR body, JSON).
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    run = SimpleNamespace(info=SimpleNamespace(run_id="r1", artifact_uri="mlflow-artifacts:/1/r1/artifacts"),
                          data=SimpleNamespace(tags={"ablate.logged": "1"}))  # no payload: read receipt.json
    [outcome] = bulk_read.read_arm_runs([run], "http://alice:s3cr3tPW@127.0.0.1:9")
    assert outcome.receipt is None and outcome.reason is not None
    assert "http://<redacted>@127.0.0.1:9" in outcome.reason and "s3cr3tPW" not in outcome.reason


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("server")
    fresh_mlflow_uri(home)  # the migrated empty schema, copied: a server start does not run migrations again
    process, url = start_mlflow_server(home / "mlflow.db", home / "artifacts", home / "server.log")
    try:
        yield url
    finally:
        stop_mlflow_server(process)


def test_server_bulk_path_returns_the_artifact_paths_receipts_and_promote_uses_it(
        campaign: list[Receipt], server: str, artifact_reads: list[str], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ablate.cli import app

    receipts = campaign[:24]
    client = _log(server, receipts)
    old = client.arm_runs()[receipts[5].identity.receipt_id].info.run_id
    _strip_payload(client, old)
    _check_bulk_equals_artifacts(server, receipts, artifact_reads, old)

    artifact_reads.clear()
    shutil.copy(Path(__file__).resolve().parents[2] / "search_spaces" / "defaults.yaml", tmp_path / "defaults.yaml")
    out = CliRunner().invoke(app, ["promote", "--tracking-uri", server, "--out", str(tmp_path / "reports"),
                                   "--defaults", str(tmp_path / "defaults.yaml")])
    assert out.exit_code == 0 and "rejected" not in out.stderr, out.output
    assert artifact_reads == [old], "promote reads the payloads, and receipt.json only where there is none"
    report = json.loads(next((tmp_path / "reports").glob("*.json")).read_text())
    assert report["num_receipts"] == len(receipts) and report["rejected_receipts"] == []
    assert set(report["run_links"]) == {r.identity.receipt_id for r in receipts}


def test_sync_writes_the_payload_and_gives_one_to_runs_logged_before_it(
        campaign: list[Receipt], tmp_path: Path, artifact_reads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.receipts import accepted
    from ablate.receipts.store import write_receipt
    from ablate.tracking.bulk_read import CHECKING_FINGERPRINT
    from ablate.tracking.mlflow_store import sync

    monkeypatch.setenv(accepted.CACHE_ENV, str(tmp_path / "cache"))

    sweep_dir = tmp_path / "sweep"
    mine = [r for r in campaign if r.identity.sweep_id == campaign[0].identity.sweep_id][:4]
    for receipt in mine:
        write_receipt(receipt, sweep_dir / "receipts")
    uri = fresh_mlflow_uri(tmp_path)
    assert len(sync(sweep_dir, uri, experiment="ablate").logged) == 4
    client = TrackingClient(uri, "ablate")
    old = client.arm_runs()[mine[2].identity.receipt_id].info.run_id
    _strip_payload(client, old)
    # A store from before payloads had no receipt bundle either (ablate.tracking.receipt_bundle): its runs are
    # searched, and the run without a payload has its receipt.json read.
    withdraw_bundle(client, client.parent_run(mine[0].identity.sweep_id, "sim")[0])
    assert load_receipts_from_mlflow(uri, "ablate")[1] == [] and artifact_reads == [old]

    for remembered in (tmp_path / "cache").glob("accepted-*.bin"):
        remembered.unlink()  # what the first sync remembered: the payload given now is remembered anew
    again = sync(sweep_dir, uri, experiment="ablate")
    assert again.payloads_added == [mine[2].identity.receipt_id] and "payload added to 1 older run" in str(again)
    cache = accepted.AcceptedPayloads.open(CHECKING_FINGERPRINT)
    assert [accepted.payload_key(r.model_dump_json().encode()) in cache for r in mine] == [False, False, True, False]
    artifact_reads.clear()
    found, rejected, _ = load_receipts_from_mlflow(uri, "ablate")
    assert rejected == [] and _dumps(found) == _dumps(mine) and artifact_reads == []
