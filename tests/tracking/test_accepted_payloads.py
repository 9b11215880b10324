"""Receipt payloads accepted once are not checked again (``ablate.receipts.accepted``), on a real SQLite store:
the second read returns exactly what the full checks return, a changed payload or a payload on the wrong run is
checked in full and refused, other checking code never hits, and a damaged or unwritable cache only costs time."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from sweeps_common import fresh_mlflow_uri, log_campaign

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))

from promote_sim import Sim, moe, simulate  # noqa: E402

from ablate import parallel  # noqa: E402
from ablate.receipts import accepted  # noqa: E402
from ablate.receipts.store import seal  # noqa: E402
from ablate.tracking import bulk_read, payload  # noqa: E402
from ablate.tracking.mlflow_store import load_receipts_from_mlflow  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any], dict[str, str]]:
    """A real SQLite store with 12 logged receipts; (uri, receipts, receipt id -> run id)."""
    receipts = [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=3, blocks_per_host=2, rounds=1),
                                          seed=11)][:12]
    uri = fresh_mlflow_uri(tmp_path_factory.mktemp("accepted"))
    client, _ = log_campaign(uri, receipts)
    return uri, receipts, {rid: run.info.run_id for rid, run in client.arm_runs().items()}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Receipt ids given the full checks, in this process (no forking), with an empty cache of its own."""
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    monkeypatch.setenv(accepted.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(bulk_read, "CACHE_MIN_RUNS", 1)  # these stores are small
    calls: list[str] = []
    real = bulk_read.parse_receipt

    def recording(data: bytes) -> Any:
        calls.append(json.loads(data)["identity"]["receipt_id"])
        return real(data)

    monkeypatch.setattr(bulk_read, "parse_receipt", recording)
    return calls


def _dumps(read: tuple[list[Any], list, dict]) -> list[str]:
    return sorted(r.model_dump_json() for r in read[0])


def test_a_second_read_checks_nothing_again_and_returns_the_same_receipts(store, counted) -> None:
    uri, receipts, _ = store
    first = load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == sorted(r.identity.receipt_id for r in receipts)
    counted.clear()
    second = load_receipts_from_mlflow(uri, "ablate")
    assert counted == []
    assert _dumps(second) == _dumps(first) == sorted(r.model_dump_json() for r in receipts)
    assert second[1] == first[1] == [] and second[2] == first[2]


def test_a_changed_payload_and_a_payload_on_another_run_are_checked_in_full(store, counted, tmp_path) -> None:
    uri, receipts, runs = store
    load_receipts_from_mlflow(uri, "ablate")  # every payload accepted and remembered
    counted.clear()
    target, donor, edited_one = receipts[0], receipts[1], receipts[2]
    from ablate.tracking.mlflow_store import TrackingClient

    client = TrackingClient(uri, "ablate").client
    original = {rid: client.get_run(runs[rid]).data.tags for rid in (target.identity.receipt_id,
                                                                      edited_one.identity.receipt_id)}
    try:
        # The donor's accepted bytes on the target's run: a cache hit by content, refused by the run's own tags.
        for key, value in payload.payload_tags(donor).items():
            client.set_tag(runs[target.identity.receipt_id], key, value)
        edited = json.loads(edited_one.model_dump_json())
        edited["quality"]["loss_final"] = 0.001  # digest kept: new bytes, never accepted
        for key, value in payload.encode_json(json.dumps(edited).encode()).items():
            client.set_tag(runs[edited_one.identity.receipt_id], key, value)
        read, rejected, _ = load_receipts_from_mlflow(uri, "ablate")
    finally:
        for rid, tags in original.items():
            for key, value in tags.items():
                if key.startswith(payload.PAYLOAD_TAG):
                    client.set_tag(runs[rid], key, value)
    # Checked in full: the donor's bytes (on the target's run) and the edited bytes; nothing else.
    assert sorted(counted) == sorted([donor.identity.receipt_id, edited_one.identity.receipt_id])
    reasons = " | ".join(why for _, why in rejected)
    assert len(rejected) == 2 and "does not match the run's ablate.receipt_id" in reasons
    assert "content does not match its digest" in reasons
    assert {r.identity.receipt_id for r in read} == \
        {r.identity.receipt_id for r in receipts} - {target.identity.receipt_id, edited_one.identity.receipt_id}


def test_other_checking_code_damage_and_off_all_check_in_full(store, counted, monkeypatch, tmp_path) -> None:
    uri, receipts, _ = store
    every = sorted(r.identity.receipt_id for r in receipts)
    load_receipts_from_mlflow(uri, "ablate")
    files = list((tmp_path / "cache").glob("accepted-*.bin"))
    assert len(files) == 1 and files[0].stat().st_mode & 0o077 == 0
    counted.clear()

    with monkeypatch.context() as other:
        other.setattr(bulk_read, "CHECKING_FINGERPRINT", "other-code")
        load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == every, "a change to the checking code never hits an entry made by other code"

    counted.clear()
    files[0].write_bytes(files[0].read_bytes()[:-7])  # an interrupted append: the torn last entry is left out
    read = load_receipts_from_mlflow(uri, "ablate")
    assert len(counted) == 1 and len(read[0]) == len(receipts)
    counted.clear()
    load_receipts_from_mlflow(uri, "ablate")  # the misaligned file was written anew, whole
    assert counted == []

    counted.clear()
    files[0].write_bytes(b"not a cache file" + files[0].read_bytes())
    load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == every

    counted.clear()
    files[0].chmod(0o666)  # anyone could have added keys: not trusted
    load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == every

    counted.clear()
    files[0].parent.chmod(0o777)  # anyone could swap the file: neither read nor written
    os.utime(files[0], ns=(10**18, 10**18))  # a rewrite or an append would stamp it now
    load_receipts_from_mlflow(uri, "ablate")
    load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == sorted(every * 2) and files[0].stat().st_mtime_ns == 10**18
    files[0].parent.chmod(0o700)

    counted.clear()
    monkeypatch.setenv(accepted.CACHE_ENV, accepted.OFF)
    load_receipts_from_mlflow(uri, "ablate")
    load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == sorted(every * 2)

    counted.clear()
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv(accepted.CACHE_ENV, str(blocked))
    read = load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == every and len(read[0]) == len(receipts) and read[1] == []

    counted.clear()
    monkeypatch.delenv(accepted.CACHE_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    read = load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == every and len(read[0]) == len(receipts)


def test_a_remembered_payload_is_held_to_this_machines_clock(tmp_path, counted, monkeypatch) -> None:
    """The future-time check depends on the clock that reads: a payload accepted where the clock (or the slack) let
    it pass is refused on a hit where the full checks would refuse it (a cache shared by machines, a clock set
    back)."""
    import datetime as dt

    from ablate.receipts import schema

    soon = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=30)).isoformat(timespec="seconds")
    receipts = [seal(r.model_copy(update={"identity": r.identity.model_copy(update={"created_at": soon})}))
                for r in simulate(Sim(features=[moe(1.05)], hosts=3, blocks_per_host=1, rounds=1), seed=3)][:4]
    uri = fresh_mlflow_uri(tmp_path / "clock")
    log_campaign(uri, receipts)
    first = load_receipts_from_mlflow(uri, "ablate")
    assert len(first[0]) == 4 and first[1] == []
    counted.clear()
    monkeypatch.setattr(schema, "FUTURE_SLACK", dt.timedelta(0))  # this reader's clock: 30 min is the future
    read, rejected, _ = load_receipts_from_mlflow(uri, "ablate")
    assert read == [] and len(rejected) == 4 and all("in the future" in why for _, why in rejected)
    assert len(counted) == 4, "every remembered payload went back to the full checks, which gave the reason"


def test_the_fingerprint_follows_every_checking_module(tmp_path) -> None:
    root = tmp_path / "tree"
    for name in accepted._CHECKING_CODE:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes((accepted._ROOT / name).read_bytes())
    seen = {accepted.checking_fingerprint(root)}
    assert seen == {accepted.checking_fingerprint()}
    for name in accepted._CHECKING_CODE:
        with open(root / name, "a") as handle:
            handle.write("\n# edited\n")
        seen.add(accepted.checking_fingerprint(root))
    assert len(seen) == 1 + len(accepted._CHECKING_CODE)


def test_payloads_checked_in_forked_children_are_remembered_too(store, monkeypatch, tmp_path) -> None:
    uri, receipts, _ = store
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    monkeypatch.setattr(bulk_read, "PARALLEL_MIN_SHARE", 1)
    monkeypatch.setattr(bulk_read, "CACHE_MIN_RUNS", 1)
    monkeypatch.setenv(accepted.CACHE_ENV, str(tmp_path / "cache"))
    from_children: list[str] = []
    real = bulk_read._rebuilt

    def recording(run, data, result):
        if result[0] is None and result[2]:  # sent back as nothing by a child: re-parsed here
            from_children.append(run.data.tags["ablate.receipt_id"])
        return real(run, data, result)

    monkeypatch.setattr(bulk_read, "_rebuilt", recording)
    with parallel.forking():
        forked = load_receipts_from_mlflow(uri, "ablate")
    assert len(from_children) == len(receipts) // 2, "the child checked half and sent those back as nothing"
    (path,) = (tmp_path / "cache").glob("accepted-*.bin")
    assert len(accepted._read(path)[0]) == len(receipts)
    assert _dumps(forked) == sorted(r.model_dump_json() for r in receipts)


def test_a_valid_payload_in_other_json_spelling_is_checked_in_full_every_time(store, counted) -> None:
    """Only a payload that is exactly its model's own JSON is remembered: pydantic's parser rebuilds such a payload
    into the very model that was checked; other spellings (spacing, key order, duplicate keys) take the checks."""
    uri, receipts, runs = store
    from ablate.tracking.mlflow_store import TrackingClient

    client = TrackingClient(uri, "ablate").client
    chosen = receipts[4]
    rid = chosen.identity.receipt_id
    original = client.get_run(runs[rid]).data.tags
    spelled = json.dumps(json.loads(chosen.model_dump_json()), indent=1).encode()  # other spacing, same content
    try:
        for key, value in payload.encode_json(spelled).items():
            client.set_tag(runs[rid], key, value)
        first = load_receipts_from_mlflow(uri, "ablate")
        second = load_receipts_from_mlflow(uri, "ablate")
    finally:
        for key, value in original.items():
            if key.startswith(payload.PAYLOAD_TAG):
                client.set_tag(runs[rid], key, value)
    assert sorted(counted) == sorted([r.identity.receipt_id for r in receipts] + [rid])
    assert first[1] == second[1] == []
    assert _dumps(first) == _dumps(second) == sorted(r.model_dump_json() for r in receipts)


def test_files_of_older_checking_code_are_pruned(tmp_path) -> None:
    import time

    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    now = time.time()
    for age in range(7):  # seven files of other code, the oldest last
        path = directory / f"accepted-old{age}.bin"
        path.write_bytes(b"")
        os.utime(path, (now - 3600 * (age + 1), now - 3600 * (age + 1)))
    cache = accepted.AcceptedPayloads(directory / "accepted-current.bin")
    cache.add([accepted.payload_key(b"{}")])
    cache.save()
    left = sorted(p.name for p in directory.iterdir())
    assert left == sorted(["accepted-current.bin"] + [f"accepted-old{age}.bin"
                                                     for age in range(accepted.KEEP_OTHER_FILES)])
    assert accepted.payload_key(b"{}") in accepted.AcceptedPayloads(directory / "accepted-current.bin")


def test_a_read_of_a_few_runs_leaves_the_cache_alone(store, counted, monkeypatch, tmp_path) -> None:
    """The sweep driver reads one or two runs per answered block: opening (all of) the cache would cost more than
    checking them, so such reads neither consult nor feed it."""
    uri, receipts, _ = store
    monkeypatch.setattr(bulk_read, "CACHE_MIN_RUNS", len(receipts) + 1)
    load_receipts_from_mlflow(uri, "ablate")
    load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == sorted(2 * [r.identity.receipt_id for r in receipts])
    assert not (tmp_path / "cache").exists()
