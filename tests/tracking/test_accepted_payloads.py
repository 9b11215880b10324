"""Receipt payloads accepted once are not checked again (``ablate.receipts.accepted``), on a real SQLite store:
the second read returns exactly what the full checks return, a changed payload or a payload on the wrong run is
checked in full and refused, other checking code never hits, and a damaged or unwritable cache only costs time."""

from __future__ import annotations

import json
import os
import sys
import time
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
    real = bulk_read._parsed  # what the full checks of a payload call (parse_receipt too)

    def recording(data: bytes) -> Any:
        calls.append(json.loads(data)["identity"]["receipt_id"])
        return real(data)

    monkeypatch.setattr(bulk_read, "_parsed", recording)
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
    from_children: list[tuple[str, bool]] = []
    real, check = bulk_read._rebuilt, bulk_read._check_result

    def recording(item, result):  # what a child sent back, taken in here
        # sent back as its payload alone: re-parsed here
        from_children.append((item[0].data.tags["ablate.receipt_id"], result[0] is None and result[2]))
        return real(item, result)

    met = tmp_path / "met"
    met.mkdir()

    def paced(item):  # each process's first check waits for the other's: the child takes some of the chunks
        mine = met / str(os.getpid())
        if not mine.exists():
            mine.touch()
            deadline = time.monotonic() + 30
            while len(list(met.iterdir())) < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
        return check(item)

    monkeypatch.setattr(bulk_read, "_rebuilt", recording)
    monkeypatch.setattr(bulk_read, "_check_result", paced)
    with parallel.forking():
        forked = load_receipts_from_mlflow(uri, "ablate")
    assert 0 < len(from_children) < len(receipts), "the child checked some of the runs, the parent the others"
    assert all(light for _, light in from_children), "the child sent its accepted receipts back as nothing"
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


def test_two_writers_that_find_no_file_both_keep_their_keys(tmp_path, monkeypatch) -> None:
    """Two sweeps closing at once (or a sweep and a promotion) both find no file: the one that writes second appends
    to the file the other made, where replacing it lost the other's keys."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    path = directory / "accepted-current.bin"
    first, second = accepted.AcceptedPayloads(path), accepted.AcceptedPayloads(path)
    first.add([accepted.payload_key(b"first")])
    second.add([accepted.payload_key(b"second")])
    real = accepted._write_new

    def other_writer_first(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(accepted, "_write_new", real)
        second.save()  # between the first writer finding no file and writing one
        return real(*args, **kwargs)

    monkeypatch.setattr(accepted, "_write_new", other_writer_first)
    first.save()
    both = accepted.AcceptedPayloads(path)
    assert accepted.payload_key(b"first") in both and accepted.payload_key(b"second") in both
    assert accepted._read(path) == ({accepted.payload_key(b"first"), accepted.payload_key(b"second")}, True)
    assert [p.name for p in directory.iterdir()] == [path.name], "no temporary file is left behind"


def test_a_read_of_a_few_runs_leaves_the_cache_alone(store, counted, monkeypatch, tmp_path) -> None:
    """The sweep driver reads one or two runs per answered block: opening (all of) the cache would cost more than
    checking them, so such reads neither consult nor feed it."""
    uri, receipts, _ = store
    monkeypatch.setattr(bulk_read, "CACHE_MIN_RUNS", len(receipts) + 1)
    load_receipts_from_mlflow(uri, "ablate")
    load_receipts_from_mlflow(uri, "ablate")
    assert sorted(counted) == sorted(2 * [r.identity.receipt_id for r in receipts])
    assert not (tmp_path / "cache").exists()


def test_the_writer_remembers_what_it_logged_so_the_first_read_checks_nothing(tmp_path, counted, monkeypatch) -> None:
    """The sweep driver (and ``receipts sync``) checks each payload it logs as a reader would and saves the accepted
    ones with the sweep's summary: the first promotion after a sweep reads as a later one does. A payload the
    reader's checks refuse (here: stamped beyond this clock) is not remembered, and still reads as refused."""
    import datetime as dt

    from ablate.tracking.mlflow_store import TrackingClient

    receipts = [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=2, blocks_per_host=2, rounds=1),
                                          seed=5)][:6]
    later = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=2)).isoformat(timespec="seconds")
    future = seal(receipts[-1].model_copy(update={"identity": receipts[-1].identity.model_copy(
        update={"created_at": later, "receipt_id": receipts[-1].identity.receipt_id + "-later"})}))
    uri = fresh_mlflow_uri(tmp_path / "writer")
    client, parents = log_campaign(uri, receipts[:-1] + [future])
    cache = tmp_path / "cache"
    assert not cache.exists(), "nothing is written before the sweep's summary"
    (sweep,) = parents
    client.log_summary(parents[sweep], sweep, receipts[:-1] + [future])
    (path,) = cache.glob("accepted-*.bin")
    assert len(accepted._read(path)[0]) == len(receipts) - 1
    assert sorted(counted) == sorted(r.identity.receipt_id for r in receipts[:-1] + [future]), \
        "the writer gave each payload the reader's full checks"
    counted.clear()
    first, rejected, _ = load_receipts_from_mlflow(uri, "ablate")
    assert counted == [future.identity.receipt_id], "only the refused payload took the full checks"
    assert _dumps((first, [], {})) == sorted(r.model_dump_json() for r in receipts[:-1])
    assert len(rejected) == 1 and "in the future" in rejected[0][1]


def test_with_the_cache_off_the_writer_checks_and_writes_nothing(tmp_path, counted, monkeypatch) -> None:
    from ablate.tracking.mlflow_store import TrackingClient  # noqa: F401 - the writer under test, via log_campaign

    monkeypatch.setenv(accepted.CACHE_ENV, accepted.OFF)
    checked: list[bytes] = []
    real = bulk_read.logged_payload_key
    monkeypatch.setattr("ablate.tracking.mlflow_store.logged_payload_key",
                        lambda data, tags: checked.append(data) or real(data, tags))
    receipts = [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=2, blocks_per_host=1, rounds=1),
                                          seed=6)][:2]
    uri = fresh_mlflow_uri(tmp_path / "off")
    client, parents = log_campaign(uri, receipts)
    (sweep,) = parents
    client.log_summary(parents[sweep], sweep, receipts)
    assert checked == [] and counted == []
    assert not (tmp_path / "cache").exists()


def test_a_cache_directory_this_user_cannot_reach_costs_time_never_a_save(tmp_path, monkeypatch) -> None:
    """Another user's home (a container run with --user and HOME=/root): looking at the directory raises
    PermissionError. A save then keeps nothing, and raises nothing."""
    def unreachable(item: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(item))

    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    cache = accepted.AcceptedPayloads(directory / "accepted-current.bin")
    cache.add([accepted.payload_key(b"{}")])
    monkeypatch.setattr(accepted, "_private", unreachable)
    cache.save()
    assert list(directory.iterdir()) == []


def test_a_cache_that_cannot_be_saved_never_fails_a_sync_or_a_sweeps_close(tmp_path, monkeypatch) -> None:
    """The writer's cache only saves time: a save that raises leaves the sync whole (every arm logged, the sweep run
    FINISHED), and a sweep's close whose MLflow went away still saves what was checked before."""
    from ablate.receipts.store import write_receipt
    from ablate.tracking.mlflow_store import MlflowStore, TrackingClient, sync

    monkeypatch.setenv(accepted.CACHE_ENV, str(tmp_path / "cache"))
    receipts = [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=1, blocks_per_host=1, rounds=1),
                                          seed=7)][:2]
    sweep_dir = tmp_path / "sweep"
    for receipt in receipts:
        write_receipt(receipt, sweep_dir / "receipts")
    real = accepted.AcceptedPayloads.save

    def refused(self: accepted.AcceptedPayloads) -> None:
        raise PermissionError(13, "Permission denied", str(self.path))

    monkeypatch.setattr(accepted.AcceptedPayloads, "save", refused)
    uri = fresh_mlflow_uri(tmp_path / "sync")
    result = sync(sweep_dir, uri, experiment="ablate")
    assert sorted(result.logged) == sorted(r.identity.receipt_id for r in receipts)
    (sweep,) = result.parents.values()
    assert TrackingClient(uri, "ablate").client.get_run(sweep).info.status == "FINISHED"

    monkeypatch.setattr(accepted.AcceptedPayloads, "save", real)
    store = MlflowStore(fresh_mlflow_uri(tmp_path / "sweep-store"), "ablate", tmp_path / "driver")
    sweep_id = receipts[0].identity.sweep_id
    store.open_sweep(sweep_id, "sim", {}, {}, system_metrics=False)
    assert all(store.log_receipt(r) for r in receipts)
    store._go_offline(ConnectionError("the tracking server went away"))
    store.close_sweep(sweep_id, receipts, failed=False)
    (path,) = (tmp_path / "cache").glob("accepted-*.bin")
    assert accepted._read(path)[0] == {accepted.payload_key(r.model_dump_json().encode()) for r in receipts}


def test_the_writer_appends_without_reading_what_the_cache_holds(tmp_path, counted, monkeypatch) -> None:
    """A sweep's driver holds none of the cache's keys (a user's cache grows with every sweep): it only appends."""
    from ablate.tracking.mlflow_store import TrackingClient  # noqa: F401 - the writer under test, via log_campaign

    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    path = directory / f"accepted-{bulk_read.CHECKING_FINGERPRINT}.bin"
    older = [accepted.payload_key(str(i).encode()) for i in range(3)]
    path.write_bytes(accepted._MAGIC + b"".join(older))
    path.chmod(0o600)
    reads: list[Path] = []
    real_read = accepted._read
    monkeypatch.setattr(accepted, "_read", lambda p: reads.append(p) or real_read(p))
    receipts = [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=1, blocks_per_host=1, rounds=1),
                                          seed=8)][:2]
    client, parents = log_campaign(fresh_mlflow_uri(tmp_path / "store"), receipts)
    (sweep,) = parents
    client.log_summary(parents[sweep], sweep, receipts)
    assert reads == [], "the writer never read the file's keys"
    assert real_read(path) == (set(older) | {accepted.payload_key(r.model_dump_json().encode()) for r in receipts},
                               True)
