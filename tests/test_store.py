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
from ablate.receipts.store import SPOOL_FILE, append_spool, load_receipts, write_receipt

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
