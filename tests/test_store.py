"""Receipts on disk as promotion and sync read them: every file that is not a usable receipt is listed with its
reason (never dropped, never a traceback), known non-receipts are left alone, and differing copies of one receipt
id are a conflict.

The receipts are real, validated ``Receipt`` objects (tests/promote/promote_sim.py) written to real files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from promote.promote_sim import T0, base_lane, make_receipt

from ablate.receipts.schema import Receipt
from ablate.receipts.outline import outline
from ablate.receipts.store import SPOOL_FILE, append_spool, load_receipts, scan_receipts, write_receipt

REPO = Path(__file__).resolve().parents[1]


def _receipt(receipt_id: str = "r-0001", tps: float = 5000.0) -> Receipt:
    return make_receipt(receipt_id=receipt_id, sweep_id="s1", block_id="b000", arm="baseline", arm_index=0, order=0,
                        feature="moe_dispatch", feature_value="padded", baseline_value="padded", lane=base_lane(),
                        host="node-1", tps=tps, loss=2.5, created_at=T0, campaign="c")


def _campaign(tmp_path: Path) -> tuple[Path, Receipt]:
    """``<storage>/c`` as the sweep driver leaves it, with one valid receipt."""
    campaign = tmp_path / "storage" / "c"
    receipt = _receipt()
    write_receipt(receipt, campaign / "receipts")
    return campaign, receipt


# (relative path, bytes, what the reason must say). Each was dropped silently or crashed before the fix.
BAD_FILES = {
    "object_without_identity": ("receipts/params.json", b'{"lr": 0.1}', "not a receipt"),
    "bare_number": ("receipts/5.json", b"5", "must be a JSON object, got int"),
    "non_utf8": ("receipts/latin1.json", b'{"host": "n\xe9ud"}', "not UTF-8"),
    "empty_json": ("receipts/empty.json", b"", "empty file"),
    "hidden_json": ("receipts/.copy.json", b"{}", "not a receipt"),
    "unfinished_write": ("receipts/.receipt-k2j3h4.tmp", b'{"identity": {', "unfinished receipt write"),
    "stray_file": ("receipts/r-0001.json.bak", b"{}", "receipts/ holds only"),
    "empty_spool": (SPOOL_FILE, b"", "empty spool"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_file_that_is_not_a_valid_receipt_is_listed_with_its_reason(tmp_path: Path, case: str) -> None:
    campaign, good = _campaign(tmp_path)
    relative, data, reason = BAD_FILES[case]
    (campaign / relative).write_bytes(data)
    for source in (campaign, campaign / relative.split("/")[0] if "/" in relative else campaign / relative):
        receipts, rejected = load_receipts(source)
        origins = {origin: why for origin, why in rejected}
        assert str(campaign / relative) in origins, f"{relative} was dropped silently (source {source})"
        assert reason in origins[str(campaign / relative)]
    receipts, rejected = load_receipts(campaign)
    assert [r.identity.receipt_id for r in receipts] == [good.identity.receipt_id] and len(rejected) == 1


def test_bad_spool_lines_are_listed_by_line(tmp_path: Path) -> None:
    campaign, good = _campaign(tmp_path)
    append_spool(_receipt("r-0002"), campaign)
    with (campaign / SPOOL_FILE).open("ab") as handle:
        handle.write(b"7\n\n[1, 2]\n\xff\n{\"identity\": \n")  # a crash mid-append leaves the last line cut
    receipts, rejected = load_receipts(campaign / SPOOL_FILE)
    assert [r.identity.receipt_id for r in receipts] == ["r-0002"]
    spool = campaign / SPOOL_FILE
    assert [(origin, why.split(":")[0]) for origin, why in rejected] == [
        (f"{spool}:2", "a receipt must be a JSON object, got int"),
        (f"{spool}:4", "a receipt must be a JSON object, got list"),
        (f"{spool}:5", "not UTF-8 text (byte b'\\xff' at offset 0)"),
        (f"{spool}:6", "not valid JSON")]


def test_a_storage_root_reads_receipts_and_refused_ones_but_not_ray_or_sweep_metadata(tmp_path: Path) -> None:
    campaign, good = _campaign(tmp_path)
    append_spool(good, campaign)  # the same receipt spooled while MLflow was down: an identical copy, fine
    (campaign / "receipts" / "list.json").write_text("[1, 2]")
    (campaign / "sweeps").mkdir()
    (campaign / "sweeps" / "s1.json").write_text('{"sweep_id": "s1", "experiment": "ablate"}')
    (campaign / "LATEST").write_text("s1\n")
    (campaign / "rejected").mkdir()
    refused = campaign / "rejected" / "b000-1-attempt0.json.txt"
    refused.write_text('{"schema_version": "1.0.0"')
    trial = tmp_path / "storage" / "_tune" / "c" / "s1" / "b000_00000"
    trial.mkdir(parents=True)
    (trial / "result.json").write_text('{"event": "arm", "receipt": "..."}\n{"done": true}\n')
    (trial / "params.json").write_text('{"block_id": "b000"}')
    (tmp_path / "storage" / "_train" / "c").mkdir(parents=True)
    (tmp_path / "storage" / "_train" / "c" / "state.json").write_text("{}")

    receipts, rejected = load_receipts(tmp_path / "storage")
    assert [r.identity.receipt_id for r in receipts] == [good.identity.receipt_id]
    reasons = dict(rejected)
    assert set(reasons) == {str(campaign / "receipts" / "list.json"), str(refused)}, rejected
    assert reasons[str(refused)].startswith("refused by the sweep driver") and "not valid JSON" in reasons[str(refused)]


def test_an_arm_scratch_dir_without_its_receipt_is_listed_once(tmp_path: Path) -> None:
    """trainers.run keeps an arm's scratch in receipts/.work/<receipt_id>/ (spec.json, logs) and removes it after
    the receipt; one left by a SIGINT names an arm that never wrote its receipt. Before the fix its spec.json,
    a JSON object without identity, was skipped without a word."""
    campaign, good = _campaign(tmp_path)
    for receipt_id in ("r-lost", good.identity.receipt_id):  # r-0001's scratch is a leftover of the clean-up only
        work = campaign / "receipts" / ".work" / receipt_id
        work.mkdir(parents=True)
        (work / "spec.json").write_text('{"block_id": "b000", "arm_index": 1}')
        (work / "worker-0.log").write_text("step 1\n")
    receipts, rejected = load_receipts(campaign)
    assert [r.identity.receipt_id for r in receipts] == [good.identity.receipt_id]
    assert [origin for origin, _ in rejected] == [str(campaign / "receipts" / ".work" / "r-lost")]
    assert "has no receipt" in rejected[0][1]


def test_differing_copies_of_a_receipt_id_are_a_conflict_and_neither_is_used(tmp_path: Path) -> None:
    campaign, good = _campaign(tmp_path)
    other = _receipt("r-0002")
    write_receipt(other, campaign / "receipts")
    append_spool(other, campaign)  # identical copy: fine
    append_spool(_receipt(good.identity.receipt_id, tps=6100.0), campaign)  # same id, other numbers
    receipts, rejected = load_receipts(campaign)
    assert [r.identity.receipt_id for r in receipts] == ["r-0002"], "first-wins would have kept one silently"
    on_disk, spooled = str(campaign / "receipts" / "r-0001.json"), f"{campaign / SPOOL_FILE}:2"
    reasons = dict(rejected)
    assert set(reasons) == {on_disk, spooled}
    for origin, other_origin in ((on_disk, spooled), (spooled, on_disk)):
        assert "conflicting copies of receipt r-0001" in reasons[origin] and other_origin in reasons[origin]
        assert "(differs in " in reasons[origin], "the reason says which fields disagree"


def test_scanning_keeps_and_rejects_exactly_what_loading_does_holding_only_what_it_keeps(tmp_path: Path) -> None:
    """A sweep's close reads its receipts with ``scan_receipts`` (outlines, not receipts: 2,000 receipts held whole
    were ~130 MB of the driver at the end). Its verdict on every file must be ``load_receipts``' own: unique,
    identical and conflicting copies (in files and spool lines), an invalid file, an orphan scratch dir."""
    campaign, good = _campaign(tmp_path)
    twin, clash = _receipt("r-0002"), _receipt("r-0003")
    write_receipt(twin, campaign / "receipts")
    append_spool(twin, campaign)  # an identical copy: counted once
    write_receipt(clash, campaign / "receipts")
    append_spool(_receipt("r-0003", tps=6100.0), campaign)  # same id, other numbers: a conflict
    append_spool(_receipt("r-0004"), campaign)  # only in the spool
    (campaign / "receipts" / "params.json").write_text('{"lr": 0.1}')
    (campaign / "receipts" / ".work" / "r-lost").mkdir(parents=True)
    receipts, rejected = load_receipts(campaign)
    handed: list[str] = []

    def keep(receipt: Receipt) -> tuple[str, float | None]:
        handed.append(receipt.identity.receipt_id)
        return outline(receipt).receipt_id, outline(receipt).tokens_per_s

    kept, scan_rejected = scan_receipts([campaign], keep)
    assert list(kept) == [r.identity.receipt_id for r in receipts]  # the same ids, in the same (first-read) order
    assert sorted(kept) == ["r-0001", "r-0002", "r-0004"]
    assert kept["r-0002"] == ("r-0002", twin.projection.tokens_per_s if twin.projection else None)
    assert sorted(scan_rejected) == sorted(rejected) and len(rejected) == 4  # 2 clash copies, params, scratch
    assert sorted(handed) == ["r-0001", "r-0002", "r-0003", "r-0004"], "keep sees each id once, its first copy"


def test_receipts_list_prints_every_unusable_file_and_no_traceback(tmp_path: Path) -> None:
    campaign, good = _campaign(tmp_path)
    for name, data in (("5.json", b"5"), ("latin1.json", b"\xe9"), ("params.json", b'{"lr": 0.1}')):
        (campaign / "receipts" / name).write_bytes(data)
    out = subprocess.run([sys.executable, "-m", "ablate", "receipts", "list", "--source", str(campaign)], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert good.identity.receipt_id[:8] in out.stdout
    for name, reason in (("5.json", "got int"), ("latin1.json", "not UTF-8"), ("params.json", "not a receipt")):
        line = next((l for l in out.stderr.splitlines() if l.startswith(f"rejected {campaign / 'receipts' / name}")),
                    None)
        assert line is not None and reason in line, out.stderr


# --- digest ---

SMOKE_RECEIPTS = REPO / "tests" / "promote" / "assets" / "smoke_run" / "receipts"


def test_a_receipt_is_written_with_its_digest_and_a_copy_edited_since_is_refused(tmp_path: Path) -> None:
    import json

    from ablate.receipts.store import content_digest, receipt_digest

    campaign, good = _campaign(tmp_path)
    path = campaign / "receipts" / "r-0001.json"
    data = json.loads(path.read_text())
    assert data["digest"] == content_digest(data) == receipt_digest(good), "sealed when written"
    # Canonical JSON: the same content re-indented with other key order is the same receipt.
    path.write_text(json.dumps(dict(reversed(list(data.items())))))
    assert [r.identity.receipt_id for r in load_receipts(campaign)[0]] == ["r-0001"]
    data["identity"]["host"] = "node-9"  # edited after it was written; the numbers still validate
    path.write_text(json.dumps(data))
    receipts, rejected = load_receipts(campaign)
    assert receipts == [] and len(rejected) == 1
    assert "content does not match its digest" in rejected[0][1]
    assert data["digest"][:16] in rejected[0][1] and content_digest(data)[:16] in rejected[0][1]


def test_a_receipt_of_schema_2_1_or_later_without_its_digest_is_refused(tmp_path: Path) -> None:
    """Every writer seals a 2.1+ receipt: one without a digest had it removed, with an edit the check would
    otherwise have caught (here its host, to fake another machine). Its sealed copy still counts, once."""
    import json

    campaign, good = _campaign(tmp_path)
    forged = json.loads(good.model_dump_json())
    forged.update(digest=None)
    forged["identity"]["host"] = "node-9"
    (campaign / SPOOL_FILE).write_text(json.dumps(forged) + "\n")
    receipts, rejected = load_receipts(campaign)
    assert [r.identity.receipt_id for r in receipts] == ["r-0001"] and receipts[0].identity.host != "node-9"
    assert len(rejected) == 1 and "no digest, though schema" in rejected[0][1]
    (campaign / "receipts" / "r-0001.json").unlink()
    receipts, rejected = load_receipts(campaign)
    assert receipts == [] and "no digest" in rejected[0][1], "alone, the unsealed copy is no evidence"
    # Re-labelled as a 2.0 receipt (which had no digest): the fields a 2.1+ writer always dumps give it away.
    forged["schema_version"] = "2.0.0"
    (campaign / SPOOL_FILE).write_text(json.dumps(forged) + "\n")
    receipts, rejected = load_receipts(campaign)
    assert receipts == [] and "written from schema 2.1 on" in rejected[0][1], rejected


def test_receipts_of_schema_2_0_without_a_digest_still_load() -> None:
    receipts, rejected = load_receipts(SMOKE_RECEIPTS)
    assert rejected == [] and len(receipts) == len(list(SMOKE_RECEIPTS.glob("*.json"))) > 0
    assert {r.schema_version for r in receipts} == {"2.0.0"} and all(r.digest is None for r in receipts)


# --- a receipt its directory refuses goes to a fallback, never nowhere ---


def test_a_resumed_sweep_counts_the_receipts_a_full_disk_sent_to_a_fallback(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.receipts.store import FALLBACK_ENV, with_fallbacks

    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    campaign, good = _campaign(tmp_path)
    elsewhere = _receipt("r-0002")
    write_receipt(elsewhere, tmp_path / "fallback" / "c" / "receipts")
    write_receipt(good, tmp_path / "fallback" / "c" / "receipts")  # a copy of one the campaign dir holds too
    found = with_fallbacks(campaign, "c")
    assert sorted(r.identity.receipt_id for r in found) == ["r-0001", "r-0002"], "each id once, both places read"
    assert with_fallbacks(tmp_path / "storage" / "other", "other") == []


@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_a_receipt_its_directory_refuses_goes_to_the_fallback_named_in_one_line(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Before the fix a full disk left a 0-byte .receipt-*.tmp and raised out of the driver's callback (the sweep
    aborted with a cascade of tracebacks); a read-only receipts/ dropped every later receipt."""
    from fsfaults import fault_dir

    from ablate.receipts.store import FALLBACK_ENV, write_receipt_or_fallback

    fallback = tmp_path / "fallback"
    monkeypatch.setenv(FALLBACK_ENV, str(fallback))
    receipt = _receipt("r-0042")
    with fault_dir(kind, tmp_path, monkeypatch) as (campaign, how):
        with caplog.at_level("ERROR", logger="ablate.receipts.store"):
            where, why = write_receipt_or_fallback(receipt, campaign / "receipts")
            spooled = append_spool(receipt, campaign)
        left = sorted(p.name for p in (campaign / "receipts").iterdir())
        assert left == [], f"{how}: nothing, not even a temporary file, is left in the refused directory"
        assert not (campaign / SPOOL_FILE).exists() or (campaign / SPOOL_FILE).stat().st_size == 0
    assert where == fallback / "c" / "receipts" / "r-0042.json" and spooled == fallback / "c" / SPOOL_FILE
    assert why in ("No space left on device", "Read-only file system", "Permission denied"), why
    found, rejected = load_receipts(fallback / "c")
    assert rejected == [] and [r.identity.receipt_id for r in found] == ["r-0042"], "a valid, sealed receipt"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2, errors  # one line per receipt written elsewhere, no traceback
    assert str(campaign / "receipts") in errors[0] and str(where) in errors[0] and why in errors[0]
    assert f"ablate receipts sync {fallback / 'c'}" in errors[0]
    assert all(record.exc_info is None for record in caplog.records)


def test_a_spool_append_that_fails_part_way_leaves_no_half_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    import errno
    import os

    from ablate.receipts.store import FALLBACK_ENV

    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    campaign, _ = _campaign(tmp_path)
    append_spool(_receipt("r-0002"), campaign)
    before = (campaign / SPOOL_FILE).read_bytes()
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(campaign / SPOOL_FILE) and len(data) > 100:
            real_write(fd, bytes(data[:100]))  # the disk fills up in the middle of the line
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    where = append_spool(_receipt("r-0003"), campaign)
    monkeypatch.undo()
    assert (campaign / SPOOL_FILE).read_bytes() == before, "the half-written line was cut off again"
    assert where == tmp_path / "fallback" / "c" / SPOOL_FILE
    assert [r.identity.receipt_id for r in load_receipts(where)[0]] == ["r-0003"]


def test_when_no_directory_takes_a_receipt_the_error_names_every_place_tried(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from fsfaults import inject_errno

    from ablate.receipts.store import FALLBACK_ENV, ReceiptNotSaved, fallback_roots, write_receipt_or_fallback

    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    inject_errno(monkeypatch, tmp_path)  # everything under tmp_path is "full"
    with pytest.raises(ReceiptNotSaved) as info:
        write_receipt_or_fallback(_receipt("r-0007"), tmp_path / "c" / "receipts")
    message = str(info.value)
    assert "r-0007" in message and "No space left on device" in message and FALLBACK_ENV in message
    assert all(str(root) in message for root in fallback_roots())
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "no temporary file anywhere"


def test_an_arm_scratch_dir_moves_to_tmp_when_receipts_is_read_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fsfaults import fault_dir

    from ablate.receipts.store import arm_scratch

    with fault_dir("read-only", tmp_path, monkeypatch) as (campaign, _):
        work = arm_scratch(campaign / "receipts", "r-0005")
        assert work.is_dir() and not str(work).startswith(str(campaign)) and work.name == "r-0005"
    work.rmdir()


def test_unfinished_writes_of_a_killed_process_are_completed_or_removed_on_resume(tmp_path: Path) -> None:
    """A driver killed with SIGKILL during a receipt write leaves a .receipt-*.tmp (the write now ends with an
    fsync, so the window is real); a resumed sweep renames a whole one into place and removes partial ones."""
    from ablate.receipts.store import settle_unfinished_writes

    campaign, good = _campaign(tmp_path)
    receipts_dir = campaign / "receipts"
    whole = _receipt("r-0009")
    write_receipt(whole, tmp_path / "elsewhere")
    (receipts_dir / ".receipt-aaa.tmp").write_bytes((tmp_path / "elsewhere" / "r-0009.json").read_bytes())
    (receipts_dir / ".receipt-bbb.tmp").write_bytes((receipts_dir / "r-0001.json").read_bytes()[:200])
    (receipts_dir / ".receipt-ccc.tmp").write_bytes((receipts_dir / "r-0001.json").read_bytes())
    actions = {tmp.name: what for tmp, what in settle_unfinished_writes(receipts_dir)}
    assert actions == {".receipt-aaa.tmp": "completed: renamed to r-0009.json",
                       ".receipt-bbb.tmp": "removed: a partial write",
                       ".receipt-ccc.tmp": "removed: r-0001.json is already whole"}
    receipts, rejected = load_receipts(campaign)
    assert rejected == [] and sorted(r.identity.receipt_id for r in receipts) == ["r-0001", "r-0009"]


def test_the_sweep_end_catches_up_no_receipt_whose_copies_conflict(tmp_path: Path) -> None:
    """The sweep's end logs to MLflow the receipts of the sweep the store has not logged: never the first copy of a
    receipt id whose copies differ, which ``scan_receipts`` refuses after that copy was read (found in review: it
    was logged, and promotion from MLflow would have read it)."""
    from ablate.sweep.run import sweep_arms

    campaign, good = _campaign(tmp_path)
    append_spool(_receipt(good.identity.receipt_id, tps=6100.0), campaign)  # same id, other numbers
    write_receipt(_receipt("r-0002"), campaign / "receipts")
    arms, unlogged = sweep_arms(campaign, "s1", known=lambda rid: False)
    assert [a.receipt_id for a in arms] == ["r-0002"]
    assert [r.identity.receipt_id for r in unlogged] == ["r-0002"]
    assert sweep_arms(campaign, "s1", known=lambda rid: rid == "r-0002")[1] == []
    assert sweep_arms(campaign, "another sweep", known=lambda rid: False) == ([], [])
