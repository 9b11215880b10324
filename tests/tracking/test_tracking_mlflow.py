"""Receipts in MLflow: the child-run mapping, idempotence, the spool when the store is down, and reading back.

The receipts are real: one smoke block's two arms run through ``trainers.run_arm`` (fresh processes, no Ray).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest
from sweeps_common import closed_port, fresh_mlflow_uri, tiny_smoke

from ablate.config.load import load_sweep
from ablate.receipts.schema import BADPUT_CATEGORIES, Receipt
from ablate.receipts.store import SPOOL_FILE, append_spool, load_receipts, write_receipt
from ablate.sweep.plan import plan_sweep
from ablate.sweep.trial import make_arm_spec
from ablate.tracking.mapping import round_short_id
from ablate.tracking.mlflow_store import (
    ROLE_ARM,
    ROLE_BLOCK,
    TAG,
    MlflowStore,
    TrackingClient,
    load_receipts_from_mlflow,
    log_pngs,
    run_name,
    sync,
)
from ablate.tracking.plots import block_ratios, phases
from ablate.tracking.uri import default_tracking_uri, resolve_tracking_uri


@pytest.fixture(scope="module")
def receipts(tmp_path_factory: pytest.TempPathFactory) -> list[Receipt]:
    from trainers import run_arm

    directory = tmp_path_factory.mktemp("arms")
    sweep, _ = load_sweep(tiny_smoke(directory))
    block = next(b for b in plan_sweep(sweep, "track-1").blocks if b.feature == "moe_dispatch")
    return [run_arm(make_arm_spec(block, position, arm, sweep_id="track-1", campaign=sweep.name,
                                  receipt_dir=str(directory / "receipts")))
            for position, arm in block.run_order()]


def test_child_runs_carry_params_tags_metrics_series_and_artifacts(receipts: list[Receipt], tmp_path: Path) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    client = TrackingClient(uri, "exp")
    parent, created = client.parent_run("track-1", "smoke")
    assert created and client.parent_run("track-1", "smoke") == (parent, False)
    run_ids = [client.log_receipt(r, parent)[0] for r in receipts]
    mlflow = client.client
    runs = [mlflow.get_run(run_id) for run_id in run_ids]
    by_arm = {run.data.tags[TAG + "arm"]: run for run in runs}
    assert set(by_arm) == {"baseline", "candidate"}
    cand, base = by_arm["candidate"], by_arm["baseline"]
    round_id = round_short_id("track-1")
    assert cand.info.run_name == f"{round_id}·b000·candidate·moe_dispatch=jagged"
    assert base.info.run_name == f"{round_id}·b000·baseline·moe_dispatch=padded"
    block = mlflow.get_run(runs[0].data.tags["mlflow.parentRunId"])
    assert block.data.tags[TAG + "role"] == ROLE_BLOCK and block.data.tags["mlflow.parentRunId"] == parent
    for run, receipt in zip(runs, receipts):
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == block.info.run_id and tags[TAG + "role"] == ROLE_ARM
        assert tags[TAG + "receipt_id"] == receipt.identity.receipt_id
        assert tags[TAG + "lane_key"] == receipt.identity.lane_key and tags[TAG + "block_id"] == "b000"
        assert tags[TAG + "order"] == str(receipt.identity.order)
        assert tags[TAG + "status"] == receipt.identity.status.value
        assert tags[TAG + "host"] == receipt.identity.host
        for backend in receipt.observed.backends:
            assert tags[f"{TAG}backend.{backend.op}.observed"] == backend.observed
        metrics = run.data.metrics
        assert metrics["goodput_fraction"] == pytest.approx(receipt.time.goodput_fraction)
        assert metrics["wall_tokens_per_s"] == pytest.approx(receipt.throughput.wall_tokens_per_s)
        assert {"steady_tokens_per_s", "step_p50_s", "step_p90_s", "peak_memory_bytes", "loss_final"} <= set(metrics)
        assert ("mfu" in metrics) == (receipt.throughput.mfu is not None), "null MFU is skipped, never logged as 0"
        history = mlflow.get_metric_history(run.info.run_id, "loss")
        finite = [i for i, v in enumerate(receipt.steps.loss_series) if v is not None]
        assert sorted(m.step for m in history) == finite and finite
        assert len(mlflow.get_metric_history(run.info.run_id, "tokens_per_s")) == len(receipt.steps.series) > 0
        artifacts = {a.path for a in mlflow.list_artifacts(run.info.run_id)}
        # The goodput picture is SVG text (MLflow's artifact view shows it like a PNG); its numbers are metrics too.
        assert artifacts == {"receipt.json", "goodput.svg"}
        path = mlflow.download_artifacts(run.info.run_id, "receipt.json", str(tmp_path / run.info.run_id))
        assert json.loads(Path(path).read_text())["identity"]["receipt_id"] == receipt.identity.receipt_id
        svg = Path(mlflow.download_artifacts(run.info.run_id, "goodput.svg", str(tmp_path / run.info.run_id)))
        picture = ElementTree.fromstring(svg.read_text())  # well-formed XML
        assert picture.tag == "{http://www.w3.org/2000/svg}svg" and run.info.run_name in svg.read_text()
        assert all(f">{name}<" in svg.read_text() for name, _ in phases(receipt))
        assert metrics["goodput_s"] == pytest.approx(receipt.time.goodput_s)
        assert {f"badput_{name}_s" for name in receipt.time.badput_s} <= set(metrics)
    # Compare view: the two arms' params differ exactly in the toggle under test.
    differing = {k for k in base.data.params if base.data.params[k] != cand.data.params.get(k)}
    assert differing == {"features.moe_dispatch"}
    # Idempotent: logging again returns the same runs and creates none.
    assert [client.log_receipt(r, parent) for r in receipts] == [(run_id, False) for run_id in run_ids]
    assert len(client.arm_runs("track-1")) == 2
    # The matplotlib PNGs only on demand (a report's cited runs): arm runs get goodput.png, block runs block.png,
    # the sweep's parent run summary.png.
    cited = [*run_ids, block.info.run_id, parent]
    assert log_pngs(uri, "exp", cited) == {**{i: "goodput.png" for i in run_ids}, block.info.run_id: "block.png",
                                           parent: "summary.png"}
    for run_id, name in [(run_ids[0], "goodput.png"), (block.info.run_id, "block.png")]:
        png = mlflow.download_artifacts(run_id, name, str(tmp_path / "png" / run_id))
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_store_spools_and_sync_replays_exactly_once(receipts: list[Receipt], tmp_path: Path) -> None:
    down = f"http://ablate:s3cretpw@127.0.0.1:{closed_port()}"
    sweep_dir = tmp_path / "smoke"
    store = MlflowStore(down, "exp", sweep_dir)
    started = time.monotonic()
    assert store.open_sweep("track-1", "smoke", {"design": "x"}, {}, system_metrics=False) is None
    assert [store.log_receipt(r) for r in receipts] == [None, None]
    assert time.monotonic() - started < 30, "an unreachable store must fail fast (retries are set low)"
    assert not store.online and "s3cretpw" not in (store.offline_reason or "")
    spool = sweep_dir / SPOOL_FILE
    spooled, rejected = load_receipts(spool)
    assert rejected == [] and {r.identity.receipt_id for r in spooled} == {r.identity.receipt_id for r in receipts}

    uri = fresh_mlflow_uri(tmp_path)
    first = sync(sweep_dir, uri, experiment="exp")
    assert sorted(first.logged) == sorted(r.identity.receipt_id for r in receipts) and first.already == []
    again = sync(sweep_dir, uri, experiment="exp")
    assert again.logged == [] and sorted(again.already) == sorted(first.logged)
    client = TrackingClient(uri, "exp")
    assert len(client.arm_runs()) == len(receipts), "no duplicates after two syncs"
    parent = client.client.get_run(first.parents["track-1"])
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.client.list_artifacts(parent.info.run_id)} >= {"summary.svg", "summary.json"}
    svg = Path(client.client.download_artifacts(parent.info.run_id, "summary.svg", str(tmp_path / "svg")))
    picture = ElementTree.fromstring(svg.read_text())  # well-formed XML
    tips = [t.text or "" for t in picture.iter("{http://www.w3.org/2000/svg}title")]
    rows = block_ratios([r for r in receipts if r.identity.sweep_id == "track-1"])
    assert len(tips) == len(rows) >= 1, "one bar per block, each naming its block and ratio on hover"
    assert all(tip.startswith(f"{block_id} {label}: ") for tip, (block_id, label, _, _) in zip(tips, rows))
    assert log_pngs(uri, "exp", [parent.info.run_id]) == {parent.info.run_id: "summary.png"}  # matplotlib on demand
    assert "summary.png" in {a.path for a in client.client.list_artifacts(parent.info.run_id)}


def test_the_driver_opens_the_sweep_on_its_writer_thread_and_logs_receipts_after_it(
        receipts: list[Receipt], tmp_path: Path) -> None:
    """The sweep's MLflow start-up is the writer's first job, so Tune starts trials meanwhile: the driver hands the
    opening over without waiting, receipts queued behind it land under its parent run, and a store that turns out
    unreachable spools them, as before."""
    from ablate.sweep.layout import Layout
    from ablate.sweep.run import _Recorder

    uri = fresh_mlflow_uri(tmp_path)
    layout = Layout.for_campaign("smoke", str(tmp_path / "runs"))
    store = MlflowStore(uri, "exp", layout.local_dir)
    recorder = _Recorder(layout, store)
    gate, opened_on = threading.Event(), []

    def opening() -> None:  # the real opening, held until the receipts are queued
        gate.wait(60)
        opened_on.append(threading.current_thread())
        store.open_sweep("track-1", "smoke", {"design": "x"}, {}, system_metrics=False)

    recorder.open_tracking(opening)
    for receipt in receipts:
        recorder.track_later(receipt)
    assert store.parent_run_id is None and not opened_on, "the caller did not wait for the store"
    gate.set()
    recorder.flush()
    assert opened_on and opened_on[0] is not threading.current_thread() and store.online
    client = TrackingClient(uri, "exp")
    arms = client.arm_runs("track-1")
    assert set(arms) == {r.identity.receipt_id for r in receipts} and store.spooled == 0
    blocks = {run.data.tags["mlflow.parentRunId"] for run in arms.values()}
    assert [client.client.get_run(b).data.tags["mlflow.parentRunId"] for b in blocks] == [store.parent_run_id]

    down = MlflowStore(f"http://127.0.0.1:{closed_port()}", "exp", tmp_path / "down")
    late = _Recorder(Layout.for_campaign("smoke", str(tmp_path / "down-runs")), down)
    late.open_tracking(lambda: down.open_sweep("track-1", "smoke", {}, {}, system_metrics=False))
    for receipt in receipts:
        late.track_later(receipt)
    late.flush()
    assert not down.online and down.spooled == len(receipts)
    spooled, rejected = load_receipts(tmp_path / "down" / SPOOL_FILE)
    assert rejected == [] and {r.identity.receipt_id for r in spooled} == {r.identity.receipt_id for r in receipts}


class _Trial:
    """What the driver's hooks read of a Tune trial."""
    config = {"block_id": "b000"}


def _arm_result(receipt: Receipt, attempt: int = 0) -> dict:
    """The Tune result a trial reports for one arm (``ablate.sweep.trial.run_block``)."""
    return {"event": "arm", "block_id": "b000", "arm": receipt.identity.arm.value, "arm_index": 0, "order": 0,
            "attempt": attempt, "status": receipt.identity.status.value, "scheduled_at": 0.0, "ended_at": 0.0,
            "node_id": "n", "host": "h", "receipt": receipt.model_dump_json()}


def test_each_receipt_leaves_its_tune_result_once_a_file_holds_it_and_every_driver_callback_read_it(
        receipts: list[Receipt], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tune keeps every trial's last result for the whole sweep and logs each result to JSON after the driver's
    callbacks: the receipt JSON leaves the result once the campaign directory (or rejected/, for a refused one) holds
    it and every live callback (the recorder, then the progress display) has had it; its place names it. When only a
    fallback directory, or none, takes it, it stays."""
    import tempfile

    from fsfaults import inject_errno

    from ablate.receipts.store import FALLBACK_ENV
    from ablate.sweep.layout import Layout
    from ablate.sweep.run import _LIVE, TAKEN, _Recorder, _Relay

    class Reader:  # a live callback after the recorder, as the progress display is
        def __init__(self) -> None:
            self.read: list[str] = []

        def on_trial_result(self, result: dict, **info: object) -> None:
            self.read.append(json.loads(result["receipt"])["identity"]["receipt_id"])

    def relayed(recorder: _Recorder, *results: dict) -> Reader:
        reader = Reader()
        _LIVE["take-1"] = [recorder, reader]
        try:
            for one in results:
                _Relay("take-1").on_trial_result(trial=_Trial(), result=one)
        finally:
            _LIVE.pop("take-1")
        return reader

    layout = Layout.for_campaign("smoke", str(tmp_path / "runs"))
    recorder = _Recorder(layout, MlflowStore(fresh_mlflow_uri(tmp_path), "exp", layout.local_dir))
    good, tampered = _arm_result(receipts[0]), _arm_result(receipts[1])
    raw = json.loads(tampered["receipt"])
    raw["time"]["wall_s"] += 1.0  # its digest no longer matches
    tampered["receipt"] = original = json.dumps(raw)
    reader = relayed(recorder, good, tampered)
    assert reader.read == [receipts[0].identity.receipt_id, receipts[1].identity.receipt_id]
    assert "receipt" not in good and good[TAKEN] == receipts[0].identity.receipt_id
    assert (layout.receipts_dir / f"{receipts[0].identity.receipt_id}.json").is_file()
    assert "receipt" not in tampered and tampered[TAKEN].startswith("rejected/")
    assert (layout.local_dir / tampered[TAKEN]).read_text() == original

    # A full disk under the campaign's directory: a fallback takes the receipt, and the result keeps it too.
    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    spill = Layout.for_campaign("smoke", str(tmp_path / "spill" / "runs"))
    with monkeypatch.context() as patch:
        inject_errno(patch, tmp_path / "spill")
        spilled = _Recorder(spill, MlflowStore(fresh_mlflow_uri(tmp_path), "exp", spill.local_dir))
        kept = _arm_result(receipts[0])
        relayed(spilled, kept)
    assert TAKEN not in kept and kept["receipt"] == receipts[0].model_dump_json()
    assert [rid for rid, _, _ in spilled.fallbacks] == [receipts[0].identity.receipt_id]
    assert str(tmp_path / "fallback") in spilled.fallbacks[0][1]

    # No directory takes it (the campaign's and every fallback on a full disk): the result keeps the receipt.
    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "full" / "fallback"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "full" / "state"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "full" / "tmp"))
    full = Layout.for_campaign("smoke", str(tmp_path / "full" / "runs"))
    inject_errno(monkeypatch, tmp_path / "full")
    stuck = _Recorder(full, MlflowStore(fresh_mlflow_uri(tmp_path), "exp", full.local_dir))
    kept = _arm_result(receipts[0])
    relayed(stuck, kept)
    assert TAKEN not in kept and kept["receipt"] == receipts[0].model_dump_json()
    assert [rid for rid, _ in stuck.unsaved] == [receipts[0].identity.receipt_id]
    for one in (recorder, spilled, stuck):
        one.flush()


def test_a_receipt_remote_storage_refuses_stays_in_its_tune_result_and_is_mirrored_once_storage_takes_it(
        receipts: list[Receipt], tmp_path: Path) -> None:
    """Remote storage (here ``file://``) that refuses the mirror: the receipt is in the campaign dir, the driver's
    hook does not raise (raised there, it would stop Tune and every later block), Tune's result keeps the receipt
    (Tune syncs it to that storage), and the sweep's end mirrors it once storage takes writes again."""
    from ablate.sweep.layout import Layout
    from ablate.sweep.run import _LIVE, TAKEN, _Recorder, _Relay

    layout = Layout.for_campaign("smoke", f"file://{tmp_path / 'bucket'}/ablate", cwd=tmp_path / "job")
    mirror = tmp_path / "bucket" / "ablate" / "smoke"
    mirror.mkdir(parents=True)
    for blocked in ("receipts", "rejected"):  # a file where each mirror directory goes: the filesystem refuses it
        (mirror / blocked).write_text("not a directory\n")
    recorder = _Recorder(layout, MlflowStore(fresh_mlflow_uri(tmp_path), "exp", layout.local_dir))
    good, tampered = _arm_result(receipts[0]), _arm_result(receipts[1])
    raw = json.loads(tampered["receipt"])
    raw["time"]["wall_s"] += 1.0
    tampered["receipt"] = json.dumps(raw)
    _LIVE["mirror-1"] = [recorder]
    try:
        for one in (good, tampered):
            _Relay("mirror-1").on_trial_result(trial=_Trial(), result=one)
    finally:
        _LIVE.pop("mirror-1")
    rid = receipts[0].identity.receipt_id
    local = layout.receipts_dir / f"{rid}.json"
    assert local.is_file() and recorder.received == [(rid, receipts[0].identity.status)]
    assert TAKEN not in good and good["receipt"] == receipts[0].model_dump_json()
    assert TAKEN not in tampered and tampered["receipt"] == json.dumps(raw), "rejected/'s mirror refused it too"
    assert list(recorder.unmirrored) == [rid] and "receipts" in recorder.unmirrored[rid][1]
    assert recorder.mirror_again() == [(rid, str(local), recorder.unmirrored[rid][1])]  # still refused

    (mirror / "receipts").unlink()
    assert recorder.mirror_again() == [] and recorder.unmirrored == {}
    assert (mirror / "receipts" / f"{rid}.json").read_bytes() == local.read_bytes()
    recorder.flush()


def test_a_resumed_sweep_mirrors_what_storage_lacks_and_no_storage_error_leaks_a_secret(
        receipts: list[Receipt], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A resumed sweep finds receipts of an earlier session in the campaign dir that remote storage lacks (its
    mirror failed, or its driver died first): they are mirrored before new work. A storage error of any kind (not
    only OSError) never stops the driver, and what it logs or keeps is redacted (a bucket URI with a key in it)."""
    import logging

    import pyarrow

    from ablate.sweep.layout import Layout
    from ablate.sweep.run import _LIVE, TAKEN, _Recorder, _Relay

    remote = f"file://{tmp_path / 'bucket'}/ablate"
    layout = Layout.for_campaign("smoke", remote, cwd=tmp_path / "job")
    for receipt in receipts:
        write_receipt(receipt, layout.receipts_dir)
    layout.publish(layout.receipts_dir / f"{receipts[0].identity.receipt_id}.json")  # the one mirrored in time
    assert layout.mirrored("receipts") == {f"{receipts[0].identity.receipt_id}.json"}
    recorder = _Recorder(layout, MlflowStore(fresh_mlflow_uri(tmp_path), "exp", layout.local_dir))
    recorder.mirror_missing(receipts)
    assert recorder.unmirrored == {}
    mirror = tmp_path / "bucket" / "ablate" / "smoke" / "receipts"
    assert {p.name: p.read_bytes() for p in mirror.iterdir()} == \
        {p.name: p.read_bytes() for p in layout.receipts_dir.iterdir()}

    # Storage that fails with a non-OSError whose text quotes the bucket URI with its key.
    secret = "sup3r-s3cret-key"

    def refuse(self: Layout, local_file: Path) -> None:
        raise pyarrow.lib.ArrowInvalid(f"cannot open s3://AKIA1234:{secret}@bucket/ablate/{local_file.name}")

    monkeypatch.setattr(Layout, "publish", refuse)
    again = _Recorder(layout, MlflowStore(fresh_mlflow_uri(tmp_path), "exp", layout.local_dir))
    good = _arm_result(receipts[1], attempt=1)
    bad = dict(good, receipt=good["receipt"].replace('"wall_s":', '"wall_s": 1e-3 +', 1))  # not JSON: rejected/

    _LIVE["mirror-2"] = [again]
    try:
        with caplog.at_level(logging.INFO):
            for one in (good, bad):
                _Relay("mirror-2").on_trial_result(trial=_Trial(), result=one)
            again.mirror_missing(receipts)
            left = again.mirror_again()
    finally:
        _LIVE.pop("mirror-2")
    assert TAKEN not in good and "receipt" in good and TAKEN not in bad and "receipt" in bad
    assert [rid for rid, _, _ in left] == [receipts[1].identity.receipt_id]  # the rest were in storage already
    assert all(why.startswith("ArrowInvalid: ") and "bucket" in why and secret not in why for _, _, why in left)
    assert "ArrowInvalid" in caplog.text and secret not in caplog.text
    again.flush()
    recorder.flush()


def test_ctrl_c_while_the_driver_waits_for_an_opening_drops_the_queue_and_never_waits_again(
        receipts: list[Receipt], tmp_path: Path) -> None:
    """A store slow to open (an unreachable server retries for minutes): Ctrl+C during the driver's wait for its
    writer drops the receipts still queued (they are on disk for ``ablate receipts sync``) and the driver's clean-up,
    which flushes again, does not wait a second time."""
    import signal

    from ablate.sweep.layout import Layout
    from ablate.sweep.run import _Recorder

    store = MlflowStore(fresh_mlflow_uri(tmp_path), "exp", tmp_path / "sweep")
    recorder = _Recorder(Layout.for_campaign("smoke", str(tmp_path / "runs")), store)
    release = threading.Event()
    recorder.open_tracking(lambda: release.wait(60))  # an opening that does not end on its own
    for receipt in receipts:
        recorder.track_later(receipt)
    # A real SIGINT to the main thread, as Ctrl+C sends: it interrupts the wait for the writer thread. Python's own
    # handler, as the CLI has it (an earlier test's Ray Tune may have left its stop-the-experiment handler).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident
    threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            recorder.flush()
        # (Python 3.11's interrupted Thread.join already marks the writer stopped; the recorder does not rely on it.)
        started = time.monotonic()
        recorder.flush()
        assert time.monotonic() - started < 1.0, "the second flush waited for the opening again"
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    time.sleep(0.2)
    assert store.logged == {} and store.spooled == 0, "the queued receipts were dropped, not written"


def test_a_sweep_stopped_while_it_was_being_opened_starts_no_metrics_sampler(tmp_path: Path) -> None:
    """The driver stops the system-metrics sampler when a sweep ends, possibly before its writer thread has finished
    opening it (Ctrl+C during the opening): that opening must not start one afterwards."""
    def samplers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor" and t.is_alive()]

    uri = fresh_mlflow_uri(tmp_path)
    running = MlflowStore(uri, "exp", tmp_path / "running")
    assert running.open_sweep("track-1", "smoke", {}, {}) is not None and len(samplers()) == 1
    running.stop_monitor()
    assert samplers() == []
    stopped = MlflowStore(uri, "exp", tmp_path / "stopped")
    stopped.stop_monitor()
    assert stopped.open_sweep("track-2", "smoke", {}, {}) is not None and stopped.online
    assert samplers() == []


def test_a_sweep_shorter_than_the_sampling_interval_still_leaves_its_system_metrics(tmp_path: Path) -> None:
    """MLflow's sampler logs a window once its interval (5 s) has passed and dropped the one a stop cut short: the
    smoke test's sweep, 5 s on a faster machine, left its parent run without a single system metric."""
    uri = fresh_mlflow_uri(tmp_path)
    store = MlflowStore(uri, "exp", tmp_path / "short")
    parent = store.open_sweep("track-1", "smoke", {}, {})
    assert parent is not None
    deadline = time.monotonic() + 4  # the sampler's first sample, well inside its first window
    while not any(m.metrics for m in store._monitor.monitors) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    store.stop_monitor()
    assert time.monotonic() - started < 4, "stopping does not wait for the window to end"
    metrics = TrackingClient(uri, "exp").client.get_run(parent).data.metrics
    assert any(key.startswith("system/cpu_utilization") for key in metrics), sorted(metrics)


def test_sync_reports_every_file_it_could_not_read(receipts: list[Receipt], tmp_path: Path) -> None:
    """Before the fix a bare JSON number crashed sync with a TypeError, and a JSON object without ``identity``
    or a half-written temp file in receipts/ vanished without a word; sweep metadata it could not read too."""
    sweep_dir = tmp_path / "smoke"
    write_receipt(receipts[0], sweep_dir / "receipts")
    append_spool(receipts[1], sweep_dir)
    bad = {sweep_dir / "receipts" / "7.json": (b"7", "got int"),
           sweep_dir / "receipts" / "params.json": (b'{"lr": 0.1}', "not a receipt"),
           sweep_dir / "receipts" / ".receipt-x1.tmp": (b'{"iden', "unfinished receipt write"),
           sweep_dir / "sweeps" / "broken.json": (b"{", "sweep metadata unreadable")}
    for path, (data, _) in bad.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    with (sweep_dir / SPOOL_FILE).open("ab") as handle:
        handle.write(b"\xff\xfe\n")
    origins = {str(path): why for path, (_, why) in bad.items()} | {f"{sweep_dir / SPOOL_FILE}:2": "not UTF-8"}

    uri = fresh_mlflow_uri(tmp_path)
    result = sync(sweep_dir, uri, experiment="exp")
    assert sorted(result.logged) == sorted(r.identity.receipt_id for r in receipts), "valid receipts still sync"
    reasons = dict(result.rejected)
    assert set(reasons) == set(origins), result.rejected
    for origin, why in origins.items():
        assert why in reasons[origin]
        assert f"rejected {origin}: " in str(result)

    out = subprocess.run([sys.executable, "-m", "ablate", "receipts", "sync", str(sweep_dir), "--tracking-uri", uri],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=240,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                              "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert f"{len(origins)} rejected" in out.stdout
    for origin, why in origins.items():
        line = next((l for l in out.stderr.splitlines() if l.startswith(f"rejected {origin}: ")), "")
        assert why in line, out.stderr


def test_a_run_interrupted_mid_write_is_replaced_not_duplicated(receipts: list[Receipt], tmp_path: Path) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    client = TrackingClient(uri, "exp")
    parent, _ = client.parent_run("track-1", "smoke")
    receipt = receipts[0]
    half = client.client.create_run(client.experiment_id, tags={TAG + "role": ROLE_ARM,
                                                                 TAG + "sweep_id": "track-1",
                                                                 TAG + "receipt_id": receipt.identity.receipt_id})
    run_id, created = client.log_receipt(receipt, parent)
    assert created and run_id != half.info.run_id
    assert client.client.get_run(half.info.run_id).info.lifecycle_stage == "deleted"
    assert list(client.arm_runs("track-1")) == [receipt.identity.receipt_id]


def test_receipts_read_back_from_mlflow_with_links(receipts: list[Receipt], tmp_path: Path) -> None:
    uri = fresh_mlflow_uri(tmp_path)
    client = TrackingClient(uri, "exp")
    parent, _ = client.parent_run("track-1", "smoke")
    for receipt in receipts:
        client.log_receipt(receipt, parent)
    labels: dict[str, dict[str, str]] = {}
    found, rejected, links = load_receipts_from_mlflow(uri, "exp", sweep_id="track-1", run_labels=labels)
    assert rejected == []
    assert sorted(r.model_dump_json() for r in found) == sorted(r.model_dump_json() for r in receipts)
    assert set(links) == set(labels) == {r.identity.receipt_id for r in receipts}
    # A SQLite store has no UI of its own: links point where `mlflow ui` serves it, each at its arm's run page.
    arms = client.arm_runs("track-1")
    # The query opens MLflow 3.17's UI in its training view (without it: the GenAI overview).
    page = "http://127.0.0.1:5000/#/experiments/{}/runs/{}?workflowType=machine_learning"
    assert links == {rid: page.format(client.experiment_id, run.info.run_id) for rid, run in arms.items()}
    block_urls = {label["block_url"] for label in labels.values()}
    assert block_urls == {page.format(client.experiment_id,
                                      next(iter(arms.values())).data.tags["mlflow.parentRunId"])}
    assert {label["arm"] for label in labels.values()} == {run.info.run_name for run in arms.values()}
    served = load_receipts_from_mlflow(uri, "exp", sweep_id="track-1", ui_url="https://mlflow.example/ui/")[2]
    assert all(link.startswith("https://mlflow.example/ui/#/experiments/") for link in served.values())
    assert load_receipts_from_mlflow(uri, "exp", sweep_id="other")[0] == []
    assert load_receipts_from_mlflow(uri, "missing")[1][0][1] == "no such experiment"


def test_goodput_plot_has_one_bar_per_phase_summing_to_wall(receipts: list[Receipt]) -> None:
    for receipt in receipts:
        rows = phases(receipt)
        assert [name for name, _ in rows] == ["goodput", *BADPUT_CATEGORIES]  # unattributed last, shown as is
        assert sum(v for _, v in rows) == pytest.approx(receipt.time.wall_s, rel=0.011, abs=0.06)
        assert run_name(receipt).startswith(f"{round_short_id('track-1')}·b000·")


def test_tracking_uri_default_override_and_absolute_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(cwd=tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db" == \
        default_tracking_uri(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert resolve_tracking_uri(cwd=tmp_path) == "http://tracker:5000"
    assert resolve_tracking_uri("sqlite:///rel/m.db", cwd=tmp_path) == f"sqlite:///{tmp_path.resolve()}/rel/m.db"


# --- the receipt digest in MLflow, and stores that are damaged or gone ---


def test_sync_reports_a_receipt_edited_after_it_was_logged_instead_of_already_there(
        receipts: list[Receipt], tmp_path: Path) -> None:
    """Before the fix a receipt edited on disk after it was logged synced as "already there", and the two copies
    disagreed silently."""
    from typer.testing import CliRunner

    from ablate.cli import app
    from ablate.receipts.store import receipt_digest

    sweep_dir = tmp_path / "smoke"  # no sweep metadata: sync (and the CLI) use the experiment "ablate"
    for receipt in receipts:
        write_receipt(receipt, sweep_dir / "receipts")
    uri = fresh_mlflow_uri(tmp_path)
    assert len(sync(sweep_dir, uri, experiment="ablate").logged) == 2
    runs = TrackingClient(uri, "ablate").arm_runs("track-1")
    assert {rid: run.data.tags[TAG + "digest"] for rid, run in runs.items()} == \
        {r.identity.receipt_id: receipt_digest(r) for r in receipts}, "the digest is an MLflow tag"

    first, second = receipts
    edited = first.model_copy(update={"identity": first.identity.model_copy(update={"host": "elsewhere"})})
    write_receipt(edited, sweep_dir / "receipts")  # edited and re-sealed: its own digest matches its content
    again = sync(sweep_dir, uri, experiment="ablate")
    assert again.already == [second.identity.receipt_id] and again.logged == []
    assert [(rid, logged, mine) for rid, _, logged, mine in again.differs] == \
        [(first.identity.receipt_id, receipt_digest(first), receipt_digest(edited))]
    line = f"differs from the logged copy: digest {receipt_digest(first)[:16]} vs {receipt_digest(edited)[:16]}"
    assert line in str(again) and "0 receipt(s) logged, 1 already there, 1 differ" in str(again)
    logged = TrackingClient(uri, "ablate").arm_runs("track-1")[first.identity.receipt_id]
    assert logged.data.tags[TAG + "host"] == first.identity.host, "the logged copy is kept, not overwritten"
    out = CliRunner().invoke(app, ["receipts", "sync", str(sweep_dir), "--tracking-uri", uri])
    assert out.exit_code == 1 and line in " ".join(out.stderr.split()), out.output

    # Edited without re-sealing: the file itself is refused on read, with both digests.
    path = sweep_dir / "receipts" / f"{second.identity.receipt_id}.json"
    path.write_text(path.read_text().replace(second.identity.host, "forged-host"))
    third = sync(sweep_dir, uri, experiment="ablate")
    assert [origin for origin, _ in third.rejected] == [str(path)]
    assert "content does not match its digest" in third.rejected[0][1]

    # The copy in MLflow is checked on read too: receipt.json when it is what is read (runs without the payload
    # tags, or use_payload=False) ...
    artifact = next((tmp_path / "mlartifacts").rglob("receipt.json"))
    data = json.loads(artifact.read_text())
    data["quality"]["loss_final"] = 0.001
    artifact.write_text(json.dumps(data))
    found, rejected, _ = load_receipts_from_mlflow(uri, "ablate", sweep_id="track-1", use_payload=False)
    assert len(found) == 1 and len(rejected) == 1 and "does not match its digest" in rejected[0][1]
    # ... and the payload tags otherwise (tests/tracking/test_bulk_read.py covers them in depth).
    from ablate.tracking.payload import encode_json

    run_id = artifact.parent.parent.name
    client = TrackingClient(uri, "ablate")
    for key, value in encode_json(json.dumps(data).encode()).items():
        client.client.set_tag(run_id, key, value)
    # A finished sweep is read from its receipt bundle, written when the sweep was logged: a payload edited in
    # place afterwards is not what is read (the bundle's sealed copy is, and it passes its digest check) ...
    found, rejected, _ = load_receipts_from_mlflow(uri, "ablate", sweep_id="track-1")
    assert sorted(r.identity.receipt_id for r in found) == sorted(r.identity.receipt_id for r in receipts)
    assert rejected == [] and all(r.quality.loss_final != 0.001 for r in found)
    # ... and once the bundle is withdrawn (a resumed or re-synced sweep), the runs are read and the edit refused.
    from ablate.tracking.receipt_bundle import withdraw_bundle

    withdraw_bundle(client, client.parent_run("track-1", "smoke")[0])
    found, rejected, _ = load_receipts_from_mlflow(uri, "ablate", sweep_id="track-1")
    assert len(found) == 1 and [r[0] for r in rejected] == [f"run {run_id}"]
    assert "does not match its digest" in rejected[0][1]


def _damage_tags_root_page(db: Path) -> None:
    """Zeros over the root page of MLflow's ``tags`` table (page type 0 is no b-tree page: always damage), the header
    and the file's size left as they were: only a read that reaches the run tags (every run search does) or a check
    of every page finds it."""
    import sqlite3

    with sqlite3.connect(db) as connection:
        root = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tags'").fetchone()[0]
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
    connection.close()
    assert root > 1
    with open(db, "r+b") as handle:
        handle.seek((root - 1) * page_size)
        handle.write(bytes(page_size))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "interior"])
def test_a_damaged_mlflow_db_is_one_error_line_naming_it(damage: str, tmp_path: Path) -> None:
    """Before the fix `receipts list` and `promote` on a damaged mlflow.db ended in a sqlalchemy traceback. A
    reader checks the header only (``check_sqlite_store(every_page=False)``): a truncated file is found there, a
    damaged page inside when the read reaches it; a sweep and a sync check every page before they write."""
    import os

    from typer.testing import CliRunner

    from ablate.cli import app

    uri = fresh_mlflow_uri(tmp_path)
    db = tmp_path / "mlflow.db"
    data = db.read_bytes()
    if damage == "interior":  # a store with runs, so a reader searches them (an empty one has nothing to read)
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        client.create_run(client.create_experiment("ablate"), tags={"ablate.role": "sweep"})
        _damage_tags_root_page(db)
    else:
        db.write_bytes(os.urandom(len(data)) if damage == "garbage" else data[: len(data) // 3])
    campaign = tiny_smoke(tmp_path / "campaign", name="damaged")
    (tmp_path / "runs" / "damaged").mkdir(parents=True)
    runner = CliRunner()
    for args in (["receipts", "list"], ["promote", "--out", str(tmp_path / "reports")],
                 ["receipts", "sync", str(tmp_path / "runs" / "damaged")],
                 ["sweep", str(campaign), "--storage", str(tmp_path / "runs"), "--no-progress"]):
        out = runner.invoke(app, [*args, "--tracking-uri", uri])
        stderr = " ".join(out.stderr.split())
        assert out.exit_code in (1, 2) and stderr.startswith("error: the MLflow store"), (args, out.output)
        assert str(db) in stderr and "receipts sync" in stderr, stderr
        assert "Traceback" not in out.output and "sqlalchemy" not in out.output.lower()
    assert not (tmp_path / "runs" / "damaged" / "sweeps").exists(), "the sweep was refused before it started"
    if damage == "interior":  # promote reads the sweeps' refusals after the receipts: one line there too
        from ablate.tracking.mlflow_store import not_run_from_mlflow
        from ablate.tracking.uri import TrackingStoreError

        with pytest.raises(TrackingStoreError, match=f"the MLflow store {db} is damaged"):
            not_run_from_mlflow(uri, "ablate")


def test_a_reader_checks_the_store_header_and_a_writer_every_page(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading every page of a 10,000-receipt store (460 MB) cost a promotion 2 s with a cold page cache: a reader
    checks the header (SQLite does, on the first read), a writer every page."""
    import sqlite3

    from ablate.tracking import uri as uri_module
    from ablate.tracking.uri import TrackingStoreError, check_sqlite_store

    uri = fresh_mlflow_uri(tmp_path)
    db = tmp_path / "mlflow.db"
    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        connection = connect(*args, **kwargs)
        connection.set_trace_callback(statements.append)
        return connection

    monkeypatch.setattr(sqlite3, "connect", traced)
    check_sqlite_store(uri, must_exist=True, every_page=False)
    assert statements and not any("quick_check" in s for s in statements), statements
    check_sqlite_store(uri)
    assert any("quick_check" in s for s in statements), "a writer checks every page"
    monkeypatch.setattr(uri_module, "_QUICK_CHECK_MAX_BYTES", 1)  # a store above the bound: header only
    statements.clear()
    check_sqlite_store(uri)
    assert not any("quick_check" in s for s in statements), statements

    # A file shorter than the page count its header states: SQLite refuses it on the first read, no page read.
    with sqlite3.connect(db) as connection:
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal", "a store no sweep has opened"
    connection.close()
    db.write_bytes(db.read_bytes()[:-page_size])
    statements.clear()
    with pytest.raises(TrackingStoreError, match="is damaged"):
        check_sqlite_store(uri, must_exist=True, every_page=False)
    assert not any("quick_check" in s for s in statements), statements


def test_promote_from_a_missing_sqlite_store_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    """Before the fix `promote` silently created an empty mlflow.db and reported "no valid receipts"."""
    from typer.testing import CliRunner

    from ablate.cli import app

    db = tmp_path / "gone" / "mlflow.db"
    db.parent.mkdir()
    for args in (["promote", "--out", str(tmp_path / "reports")], ["receipts", "list"]):
        out = CliRunner().invoke(app, [*args, "--tracking-uri", f"sqlite:///{db}"])
        assert out.exit_code == 2 and f"no MLflow store at {db}" in " ".join(out.stderr.split()), out.output
    assert not db.exists() and list(db.parent.iterdir()) == []


def test_run_links_open_the_ui_never_with_a_password() -> None:
    from ablate.tracking.mlflow_store import run_link
    from ablate.tracking.uri import ui_base

    # A tracking server is its own UI; its password never reaches a link.
    assert ui_base("https://ablate:s3cretpw@mlflow.example:5000/") == ("https://mlflow.example:5000", None)
    assert "s3cretpw" not in run_link(ui_base("https://ablate:s3cretpw@mlflow.example:5000/")[0], "3", "abc")
    # --ui-url wins (a proxy in front of the server), redacted too.
    assert ui_base("http://10.0.0.5:5000", "https://u:pw@proxy.example/mlflow/") == ("https://proxy.example/mlflow",
                                                                                      None)
    # A SQLite file has no UI: the default `mlflow ui` address, and the command that serves it (path quoted).
    base, command = ui_base("sqlite:////tmp/my runs/mlflow.db")
    assert base == "http://127.0.0.1:5000"
    assert command == "mlflow ui --backend-store-uri 'sqlite:////tmp/my runs/mlflow.db'"
    assert run_link(base, "1", "abc") == "http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning"


def test_a_spool_without_sweep_metadata_syncs_into_the_experiment_the_summary_names(receipts: list[Receipt],
                                                                                   tmp_path: Path) -> None:
    # Hole: a fallback spool has no sweeps/*.json beside it, so its sync went to experiment 'ablate' while the
    # campaign's was another; promote read that one and the spooled arms were missing without a line.
    from ablate.sweep.run import SweepSummary

    spool_dir = tmp_path / "fallback" / "smoke"
    for receipt in receipts:
        append_spool(receipt, spool_dir)
    summary = SweepSummary(sweep_id="track-1", campaign="smoke", sweep_dir=str(tmp_path / "smoke"), tune_path="",
                           tracking_uri="sqlite:///x.db", experiment="exp", parent_run_id=None, resumed=False,
                           executor="subprocess", max_concurrent=1, blocks_total=1, blocks_done=1, blocks_errored=0,
                           arms_logged=2, arms_failed=0, arms_disqualified=0, spooled=2, offline_reason="offline",
                           elapsed_s=1.0, spools={str(spool_dir / SPOOL_FILE): "disk full"})
    command = next(line for line in summary.render().splitlines() if line.startswith("spooled:")).split(
        "replay with: ")[1]
    assert command == f"ablate receipts sync {spool_dir} --experiment exp"

    uri = fresh_mlflow_uri(tmp_path)
    out = subprocess.run([sys.executable, "-m", "ablate", *command.split()[1:], "--tracking-uri", uri],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                              "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr
    assert len(TrackingClient(uri, "exp").arm_runs()) == len(receipts)
