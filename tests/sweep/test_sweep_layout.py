"""Where a campaign's files go: local storage, and a URI (here ``file://``) mirrored with pyarrow so a sweep
submitted from a temporary job directory loses nothing and can be resumed from a fresh one."""

from __future__ import annotations

from pathlib import Path

from ablate.sweep.layout import LATEST, Layout, safe_name


def test_local_storage_keeps_everything_in_the_campaign_dir(tmp_path: Path) -> None:
    layout = Layout.for_campaign("my campaign/v2", "runs", cwd=tmp_path)
    assert layout.campaign == safe_name("my campaign/v2") == "my-campaign-v2"
    assert layout.local_dir == tmp_path / "runs" / "my-campaign-v2" and not layout.remote
    assert layout.tune_root == f"{tmp_path / 'runs'}/_tune/my-campaign-v2", "Tune's files stay out of receipts/"
    assert layout.trial_receipt_dir() == str(layout.receipts_dir)
    default = Layout.for_campaign("smoke", None, cwd=tmp_path)
    assert default.local_dir == tmp_path / "ablate_runs" / "smoke"


def test_uri_storage_mirrors_files_and_a_fresh_directory_pulls_them_back(tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'bucket'}/ablate"
    first = Layout.for_campaign("smoke", remote, cwd=tmp_path / "job1")
    assert first.remote and first.local_dir == tmp_path / "job1" / "ablate_runs" / "smoke"
    first.write(LATEST, "sweep-1\n")
    first.receipts_dir.mkdir(parents=True)
    receipt = first.receipts_dir / "r1.json"
    receipt.write_text('{"x": 1}')
    first.publish(receipt)
    mirrored = tmp_path / "bucket" / "ablate" / "smoke"
    assert (mirrored / LATEST).read_text() == "sweep-1\n" and (mirrored / "receipts" / "r1.json").exists()
    # A resumed job starts in another working directory: reads fall back to the mirror, pull copies it down.
    second = Layout.for_campaign("smoke", remote, cwd=tmp_path / "job2")
    assert second.read(LATEST) == "sweep-1\n" and second.read("missing.json") is None
    second.pull()
    assert (second.receipts_dir / "r1.json").read_text() == '{"x": 1}'
