"""Receipts into MLflow: one run per sweep, a nested run per block, and under it one run per arm, idempotent by
receipt id (block runs: ``ablate.tracking.blocks``).

How to run me: ``python -m ablate.tracking.mlflow_store <sweep dir>`` replays a sweep's receipts (what
``ablate receipts sync`` does); ``... pngs <tracking uri> <experiment> <run id>...`` adds the matplotlib PNGs of
those arm, block and sweep runs (``log_pngs``).

The receipt files are the source of truth; MLflow is a view of them. Everything here runs on the Tune *driver*
(a ``Callback``), so a SQLite store has a single writer. Before creating a child run the store looks the receipt
id up (tag ``ablate.receipt_id``); a run is marked complete (tag ``ablate.logged``) only after its params,
metrics and artifacts are in, and an incomplete one left by a crash is deleted and written again. If the store
cannot be reached, receipts are appended to ``<sweep dir>/spool.jsonl`` and ``sync`` replays them later.

What one arm costs the driver's writer thread (``benchmarks/bench_orchestration.py``): the receipt is sealed once
(payload tags and ``receipt.json`` share it), the arm run is created with its tags, its two artifacts are written
straight into a local artifact store (one ``log_artifacts`` call for any other), then params, metrics and the
``ablate.logged`` tag in as few ``log_batch`` calls as MLflow's limits allow (one for a usual lane), then its end.
Lookups the sweep already made are not repeated: ``MlflowStore.open_sweep`` reads the sweep's arm and block runs
once, and the client remembers the block runs it made (``ablate.tracking.blocks``). Closing a sweep that started
empty reads none of its runs back: the receipt bundle comes from what the writer logged (``receipt_bundle.Ledger``),
and the final block settle is skipped when every block run the client knows is answered.

An embedded SQLite store on a local disk is switched to WAL journal mode when a sweep opens it (``prefer_wal``;
the mode is kept in the file): each commit then costs one fsync instead of the several of the default rollback
journal, which halved the writer's time per arm on the 2-core host (0.31 -> 0.15 s; durability is unchanged,
and readers such as ``mlflow ui`` no longer block the writer). Closing the sweep checkpoints the log back into
``mlflow.db``, so the file alone holds everything once the sweep is over. Stores on network file systems (where
SQLite's WAL is unsafe) and other backends are left as they are.

The experiment is tagged a machine-learning experiment (``mlflow.experimentKind``), so the UI opens on its runs.

Arm run (what the UI's Compare view lines up for the two arms of a block):
- name ``r3f2a·b003·candidate·moe_dispatch=jagged`` (round first); tag ``mlflow.parentRunId`` = its block's run;
- params: the flattened lane with its dotted names (``features.moe_dispatch``, ``model.d_model``, ...);
- tags ``ablate.*``: lane key, feature, arm, block id, order, host, node, executor, requested/observed backends,
  status, disqualifiers, receipt id;
- metrics: goodput fraction, wall/steady tokens/s, step p50/p90, MFU (when known), peak memory, loss, badput per
  phase, plus per-step series ``loss``, ``step_time_s`` and ``tokens_per_s`` logged with ``step=``;
- artifacts: ``receipt.json`` (the authoritative copy) and ``goodput.svg``, the arm's goodput breakdown (written
  as SVG text: ``ablate.tracking.plots``; its numbers are also the metrics ``goodput_s`` and ``badput_<phase>_s``).
  The matplotlib ``goodput.png`` of the same picture is rendered on demand only (``log_pngs``,
  ``python -m ablate.tracking.mlflow_store pngs``): at 0.35 s per arm it paced the whole campaign;
- tags ``ablate.payload.*``: the sealed receipt again, compressed, so readers (``promote``, ``receipts list``) get
  every receipt from the run search itself instead of one artifact download per run (``ablate.tracking.payload``,
  ``ablate.tracking.bulk_read``); ``receipts sync`` adds them to runs logged before they existed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from ablate.receipts.accepted import AcceptedPayloads
from ablate.receipts.outline import ReceiptLike, outline
from ablate.receipts.rejection import from_run_tags
from ablate.receipts.schema import Receipt, Status
from ablate.receipts.store import (SPOOL_FILE, append_spool_or_fallback, load_receipts,
                                   receipt_digest, seal, short)
from ablate.redact import redact_uri
from ablate.tracking import receipt_bundle
from ablate.tracking.bulk_read import CHECKING_FINGERPRINT, collector_paused, logged_payload_key, read_arm_runs
from ablate.tracking.blocks import (block_key, block_runs, open_block_run, preload_blocks, settle_blocks,
                                    try_answer_block)
from ablate.tracking.mapping import (
    EXPERIMENT_KIND_TAG,
    MACHINE_LEARNING,
    NOTE_TAG,
    ROLE_ARM,
    ROLE_BLOCK,
    ROLE_SWEEP,
    TAG,
    UI_TRAINING_VIEW,
    block_run_name,
    epoch_ms,
    receipt_metrics,
    receipt_params,
    receipt_series,
    receipt_tags,
    run_name,
    sweep_note,
    sweep_run_name,
)
from ablate.tracking.payload import COUNT_TAG, encode_json, payload_json, payload_tags
from ablate.tracking.plots import block_png, goodput_png, goodput_svg, summary_png, summary_svg
from ablate.tracking.uri import TrackingStoreError, check_sqlite_store, resolve_tracking_uri, sqlite_path, ui_base

log = logging.getLogger(__name__)

SWEEPS_DIR = "sweeps"
"""``<sweep dir>/sweeps/<sweep_id>.json``: metadata written by the runner (experiment name, plan, storage)."""
SKIPPED_TAG = TAG + "skipped"
"""Parent-run tag: JSON [[what, why], ...] the plan refused before any arm ran (inert or already default)."""
MAX_TAG_CHARS = 5000
_PARAMS_PER_BATCH, _METRICS_PER_BATCH, _TAGS_PER_BATCH = 100, 1000, 100
_ENTITIES_PER_BATCH = 1000
ABSENT: Any = object()
"""``TrackingClient.log_receipt(existing=ABSENT)``: the caller already searched, there is no run for the receipt."""
_PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
_STORE_FAULTS = ("disk is full", "No space left", "Read-only", "readonly", "not a database", "malformed",
                 "unable to open")


_LOCAL_FILE_SYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs", "overlay", "jfs", "reiserfs"}


def _file_system(path: Path) -> Optional[str]:
    """The type of the file system holding ``path`` (Linux ``/proc/mounts``; None elsewhere or when unknown)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    target = str(path.resolve())
    best = max((m for m in mounts if len(m) == 2 and (target == m[0] or target.startswith(m[0].rstrip("/") + "/"))),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


def prefer_wal(uri: str) -> Optional[str]:
    """Put an existing embedded SQLite store on a local disk in WAL journal mode (see the module docstring);
    returns the journal mode it has afterwards (None: not a local SQLite file, left alone). Never raises."""
    import sqlite3

    db = sqlite_path(uri)
    if db is None or not db.is_file() or _file_system(db.parent) not in _LOCAL_FILE_SYSTEMS:
        return None
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=5)) as connection:
            return str(connection.execute("PRAGMA journal_mode=WAL").fetchone()[0])
    except sqlite3.Error as exc:  # busy, read-only: the store works as it is, only slower
        log.info("MLflow store %s stays in its journal mode (%s)", db, exc)
        return None


def checkpoint_wal(uri: str) -> None:
    """Move a WAL store's log into ``mlflow.db`` (and empty the ``-wal`` file): copying the file alone then copies
    every run. Never raises: a reader holding the log open only delays it to the next checkpoint."""
    import sqlite3

    db = sqlite_path(uri)
    if db is None or not Path(f"{db}-wal").exists():
        return
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=5)) as connection:
            connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    except sqlite3.Error as exc:
        log.info("MLflow store %s: WAL checkpoint deferred (%s)", db, exc)


def _q(key: str) -> str:
    return f"tags.`{key}`"


def run_link(ui: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI at ``ui`` (``ablate.tracking.uri.ui_base``): a link a browser opens,
    never a ``runs:/`` URI that only MLflow's own client understands."""
    return f"{redact_uri(ui).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{UI_TRAINING_VIEW}"


class TrackingClient:
    """An ``MlflowClient`` bound to one experiment, with the idempotent writes ablate needs."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        from mlflow import MlflowClient

        from ablate.tracking.store_template import seed_sqlite_store

        seed_sqlite_store(tracking_uri)  # a missing embedded store: copied from MLflow's empty one, not migrated
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment_id = self._experiment(experiment)
        self.block_ids: dict[Any, str] = {}
        """Block key -> block run id, for block runs this client found or made (``ablate.tracking.blocks``)."""
        self.block_artifacts: dict[str, str] = {}
        """Block run id -> artifact URI, for unanswered block runs this client made (emptied as they are answered)."""
        self.blocks_known: set[str] = set()
        """Sweep ids whose block runs are all in ``block_ids`` (read once by ``preload_blocks``)."""
        self.answered: set[str] = set()
        """Block run ids known answered (tag ``ablate.logged``)."""
        self.unpaired: dict[Any, Receipt] = {}
        """Block key -> the one arm logged so far into a block run this client made: the second arm's answer
        needs no read back. Emptied as blocks are answered."""
        self.ledger: Optional[receipt_bundle.Ledger] = None
        """The runs this client makes for a sweep it opened empty (``MlflowStore.open_sweep``): its bundle is
        written from them, without a search."""
        self.accepted: Optional[AcceptedPayloads] = None
        """This user's cache of payloads already checked (``ablate.receipts.accepted``), opened at the first arm run
        logged; saved with each sweep's summary (``log_summary``)."""
        self._accepted_lock = threading.Lock()

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if EXPERIMENT_KIND_TAG not in found.tags:  # made before ablate set it; a type a user chose stays
                try:
                    self.client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MACHINE_LEARNING)
                except Exception as exc:  # noqa: BLE001 - readers (promote, receipts list) may hold read-only rights
                    log.info("could not mark experiment %r as a training experiment: %s", name, exc)
            return found.experiment_id
        db = sqlite_path(self.tracking_uri)
        # Keep artifacts next to the embedded database instead of wherever the driver's cwd happens to be.
        location = (db.parent / "mlartifacts" / name).as_uri() if db else None
        # A training experiment: MLflow 3.4+ opens an untyped one on the GenAI overview, not on its runs.
        tags = {EXPERIMENT_KIND_TAG: MACHINE_LEARNING,
                NOTE_TAG: "ablate sweeps: one run per sweep (round), one per block, one per arm; see each run's "
                          "description."}
        return self.client.create_experiment(name, artifact_location=location, tags=tags)

    def search(self, filters: Iterable[str]) -> list[Any]:
        query = " and ".join(filters)
        runs, token = [], None
        with collector_paused():
            while True:
                page = self.client.search_runs([self.experiment_id], filter_string=query, max_results=1000,
                                               page_token=token)
                runs.extend(page)
                token = page.token
                if not token:
                    return runs

    def arm_runs(self, sweep_id: Optional[str] = None) -> dict[str, Any]:
        """receipt id -> run, for arm runs (of one sweep)."""
        filters = [f"{_q(TAG + 'role')} = '{ROLE_ARM}'"]
        if sweep_id:
            filters.append(f"{_q(TAG + 'sweep_id')} = '{sweep_id}'")
        return {run.data.tags[TAG + "receipt_id"]: run for run in self.search(filters)}

    def parent_run(self, sweep_id: str, campaign: str, params: Optional[dict[str, Any]] = None,
                   tags: Optional[dict[str, str]] = None, reopen: bool = False) -> tuple[str, bool]:
        """(run id, created) of the sweep's parent run, found by tag or created RUNNING; ``reopen`` marks a
        found one RUNNING again (a resumed sweep)."""
        found = self.search([f"{_q(TAG + 'role')} = '{ROLE_SWEEP}'", f"{_q(TAG + 'sweep_id')} = '{sweep_id}'"])
        if found:
            run_id = found[0].info.run_id
            # Arms are about to be added (a resumed sweep, a sync): its bundle no longer speaks for the sweep.
            receipt_bundle.withdraw_bundle(self, run_id)
            if reopen and found[0].info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
            return run_id, False
        all_tags = {TAG + "role": ROLE_SWEEP, TAG + "sweep_id": sweep_id, TAG + "campaign": campaign,
                    TAG + "driver_host": socket.gethostname(), NOTE_TAG: sweep_note(sweep_id, campaign),
                    **(tags or {})}
        run = self.client.create_run(self.experiment_id, run_name=sweep_run_name(sweep_id), tags=all_tags)
        self._log_batch(run.info.run_id, params={k: redact_uri(str(v)) for k, v in (params or {}).items()})
        return run.info.run_id, True

    def _log_batch(self, run_id: str, params: Optional[dict[str, str]] = None,
                   metrics: Optional[list[Any]] = None, tags: Optional[dict[str, str]] = None) -> None:
        """Params, metrics, then tags, in as few ``log_batch`` calls as MLflow's per-call limits allow (one for a
        usual arm). Tags go only into the last call(s), after every param and metric: the ``ablate.logged`` tag
        that marks a run complete must not land before the rest."""
        from mlflow.entities import Param, RunTag

        param_items = [Param(k, v) for k, v in (params or {}).items()]
        rows = list(metrics or [])
        tag_items = [RunTag(k, v) for k, v in (tags or {}).items()]
        while param_items or rows or tag_items:
            batch_params, param_items = param_items[:_PARAMS_PER_BATCH], param_items[_PARAMS_PER_BATCH:]
            room = min(_METRICS_PER_BATCH, _ENTITIES_PER_BATCH - len(batch_params))
            batch_rows, rows = rows[:room], rows[room:]
            batch_tags: list[Any] = []
            if not param_items and not rows:
                room = min(_TAGS_PER_BATCH, _ENTITIES_PER_BATCH - len(batch_params) - len(batch_rows))
                batch_tags, tag_items = tag_items[:room], tag_items[room:]
            try:
                self.client.log_batch(run_id, metrics=batch_rows, params=batch_params, tags=batch_tags)
            except Exception:
                if self.ledger is not None:  # part of the batch may be in: only a search knows the run's tags now
                    self.ledger.complete = False
                raise
            if self.ledger is not None and batch_tags:
                self.ledger.tags_logged(run_id, {tag.key: tag.value for tag in batch_tags})

    def log_files(self, artifact_uri: str, directory: str) -> None:
        """Every file in ``directory`` into the run whose ``artifact_uri`` the caller holds (from ``create_run``):
        ``MlflowClient.log_artifacts`` would read the run back first only to learn that URI."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        get_artifact_repository(artifact_uri, tracking_uri=self.tracking_uri).log_artifacts(directory)

    def log_receipt(self, receipt: Receipt, parent_run_id: str, existing: Optional[Any] = None) -> tuple[str, bool]:
        """(run id, created) of the arm run, nested under its block run (``ablate.tracking.blocks``), which is
        made under the sweep run ``parent_run_id`` when missing and answered once both arms are in. Idempotent:
        a complete run for this receipt id is returned as is. ``existing``: the run already found for this receipt
        id, or ``ABSENT`` when the caller's own search found none (None: search here)."""
        from mlflow.entities import Metric

        if existing is None:
            hits = self.search([f"{_q(TAG + 'receipt_id')} = '{receipt.identity.receipt_id}'"])
            existing = hits[0] if hits else None
        elif existing is ABSENT:
            existing = None
        if existing is not None:
            if existing.data.tags.get(TAG + "logged") == "1":
                return existing.info.run_id, False
            self.client.delete_run(existing.info.run_id)  # a crash mid-write: write it again, whole
            if self.ledger is not None:
                self.ledger.deleted(existing.info.run_id)
        end_ms = epoch_ms(receipt.identity.created_at) or int(time.time() * 1000)
        start_ms = end_ms - int(receipt.time.wall_s * 1000)
        sealed, name = seal(receipt), run_name(receipt)  # sealed once: the payload tags and receipt.json share it
        tags = receipt_tags(receipt)
        payload = sealed.model_dump_json().encode("utf-8")
        tags.update(encode_json(payload))  # what the bulk reader uses; receipt.json stays the authoritative copy
        block_run_id, made = open_block_run(self, receipt, parent_run_id)
        tags["mlflow.parentRunId"] = block_run_id
        run = self.client.create_run(self.experiment_id, start_time=start_ms, tags=tags, run_name=name)
        run_id = run.info.run_id
        self._record(receipt, run, tags, block_run_id if made else None)
        self._log_arm_files(run.info.artifact_uri, sealed, name)
        metrics = [Metric(k, v, end_ms, 0) for k, v in receipt_metrics(receipt).items()]
        metrics += [Metric(k, v, start_ms + step, step) for k, v, step in receipt_series(receipt)]
        # Complete (tag ``logged``) in the same call as its params and metrics, once its artifacts are in.
        self._log_batch(run_id, params=receipt_params(receipt), metrics=metrics, tags={TAG + "logged": "1"})
        status = "FAILED" if receipt.identity.status is Status.failed else "FINISHED"
        self.client.set_terminated(run_id, status=status, end_time=end_ms)
        if COUNT_TAG in tags:
            self._remember_accepted(payload, tags)
        key = block_key(receipt)
        if made:  # the first arm into a block run made here: nothing to answer yet
            self.unpaired[key] = receipt
        else:
            try_answer_block(self, key, block_run_id, known=receipt)
        return run_id, True

    def _remember_accepted(self, payload: bytes, tags: dict[str, str]) -> None:
        """The payload just logged, checked as a reader checks it and remembered when accepted (kept until
        ``save_accepted``): the first ``ablate promote`` after this sweep, on this machine, reads it as a later one
        does. ~0.3 ms of CPU an arm (benchmarks/results/promote_store.json, ``writer_check_ms``)."""
        with self._accepted_lock:
            if self.accepted is None:
                self.accepted = AcceptedPayloads.open(CHECKING_FINGERPRINT, read=False)
            if self.accepted.path is None:  # the cache is off (or has nowhere to live): nothing to check it for
                return
            key = logged_payload_key(payload, tags)
            if key is not None:
                self.accepted.add([key])

    def save_accepted(self) -> None:
        """Never raises: the cache only saves time, and a sweep's close or a sync must not fail on it."""
        with self._accepted_lock:
            if self.accepted is None:
                return
            try:
                self.accepted.save()
            except Exception as exc:  # noqa: BLE001 - the next read checks these payloads in full instead
                log.info("the payloads this writer checked were not remembered (%s): the next read checks them", exc)

    def _record(self, receipt: Receipt, run: Any, tags: dict[str, str], block_made: Optional[str]) -> None:
        """The arm run just created (and the block run made for it) into the ledger of its sweep."""
        ledger = self.ledger
        if ledger is None or receipt.identity.sweep_id != ledger.sweep_id:
            return
        ledger.arm_created(run, tags)
        if block_made is not None:
            # The name ``open_block_run`` gives it; answering the block renames it (seen by ``_log_batch``).
            ledger.block_created(block_made, block_run_name(receipt))

    def _log_arm_files(self, artifact_uri: str, sealed: Receipt, title: str) -> None:
        """``receipt.json`` and ``goodput.svg`` into the arm run. A local artifact store gets them written in place,
        where ``log_artifacts`` would copy them from a temporary directory (the run is marked complete only later,
        so a write cut short is redone whole, as any other)."""
        local = _local_artifact_dir(artifact_uri)
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            _write_arm_files(local, sealed, title)
            return
        with tempfile.TemporaryDirectory(prefix="ablate-mlflow-") as tmp:
            _write_arm_files(Path(tmp), sealed, title)
            self.log_files(artifact_uri, tmp)

    def log_summary(self, parent_run_id: str, sweep_id: str, receipts: Iterable[ReceiptLike]) -> None:
        """Summary plot + per-sweep counts on the parent run (rewritten each time, so it stays current)."""
        mine = [arm for arm in map(outline, receipts) if arm.sweep_id == sweep_id]
        counts = {status.value: sum(arm.status is status for arm in mine) for status in Status}
        with tempfile.TemporaryDirectory(prefix="ablate-mlflow-") as tmp:
            plot = summary_svg(mine, Path(tmp) / "summary.svg", title=f"{sweep_id}: candidate / baseline per block")
            if plot is not None:
                self.client.log_artifact(parent_run_id, str(plot))
            summary = {"sweep_id": sweep_id, "arms": len(mine), "status": counts,
                       "receipts": sorted(arm.receipt_id for arm in mine)}
            (Path(tmp) / "summary.json").write_text(json.dumps(summary, indent=2))
            self.client.log_artifact(parent_run_id, str(Path(tmp) / "summary.json"))
        now = int(time.time() * 1000)
        from mlflow.entities import Metric

        rows = [Metric(f"arms_{k}", float(v), now, 0) for k, v in counts.items()]
        rows.append(Metric("arms", float(len(mine)), now, 0))
        self._log_batch(parent_run_id, metrics=rows)
        # Last: readers of a finished sweep take its arm runs from this one artifact instead of searching them.
        ledger = self.ledger if self.ledger is not None and self.ledger.sweep_id == sweep_id else None
        receipt_bundle.write_bundle(self, parent_run_id, sweep_id, known=ledger.runs() if ledger else None)
        if ledger is not None:
            ledger.close()
        self.save_accepted()


def _still_sampling(monitor: Any) -> bool:
    thread = getattr(monitor, "_process", None)
    return thread is not None and thread.is_alive()


def _log_last_window(monitor: Any) -> None:
    """Log the samples MLflow's sampler took in the window a stop cut short (its thread has ended). It logs a window
    only once its interval (5 s) has passed, so a sweep shorter than that had no system metrics at all (found when
    the smoke test's 5 s sweep, on a faster machine, left none). Its first CPU figure is psutil's first reading in
    that thread (0.0), as the first point of every MLflow run's system metrics is."""
    metrics = monitor.aggregate_metrics()
    if metrics:
        monitor.publish_metrics(metrics)
        monitor.mlflow_logger.flush()


class MlflowStore:
    """The sweep's tracking session on the Tune driver: parent run, child runs, spool when unreachable."""

    def __init__(self, tracking_uri: str, experiment: str, sweep_dir: Path) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.experiment = experiment
        self.sweep_dir = Path(sweep_dir)
        self.client: Optional[TrackingClient] = None
        self.parent_run_id: Optional[str] = None
        self.offline_reason: Optional[str] = None
        self.spooled = 0
        self.spooled_ids: set[str] = set()
        self.spool_paths: dict[str, Optional[str]] = {}
        """Spool file -> why it is not ``<sweep dir>/spool.jsonl`` (None when it is): a full or read-only disk."""
        self.logged: dict[str, str] = {}
        self.present: dict[str, Any] = {}
        """Receipt id -> arm run of this sweep as ``open_sweep`` found it (complete or not): ``log_receipt`` does not
        search again for each arm."""
        self.sweep_id: Optional[str] = None
        self._monitor: Any = None
        self._first_step: Optional[int] = None
        self._monitor_lock = threading.Lock()
        self._monitor_closed = False
        """Set by ``stop_monitor``: an opening still running on the sweep's writer thread starts none after it."""

    @property
    def online(self) -> bool:
        return self.offline_reason is None

    def _go_offline(self, exc: BaseException) -> None:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # SQLAlchemy puts its own advice first; the line naming the fault (a full disk, a damaged file) says more.
        telling = next((line for line in lines if any(word in line for word in _STORE_FAULTS)), None)
        self.offline_reason = redact_uri(f"{type(exc).__name__}: {(telling or (lines or [''])[0])[:300]}")
        log.warning("MLflow at %s unreachable (%s); receipts are spooled to %s; replay them with "
                    "`ablate receipts sync %s`", redact_uri(self.tracking_uri), self.offline_reason,
                    self.sweep_dir / SPOOL_FILE, self.sweep_dir)

    def open_sweep(self, sweep_id: str, campaign: str, params: dict[str, Any], tags: dict[str, str],
                   system_metrics: bool = True) -> Optional[str]:
        try:
            self.client = TrackingClient(self.tracking_uri, self.experiment)  # creates a missing store
            prefer_wal(self.tracking_uri)
            self.parent_run_id, _ = self.client.parent_run(sweep_id, campaign, params, tags, reopen=True)
            self.present = self.client.arm_runs(sweep_id)
            self.logged = {rid: run.info.run_id for rid, run in self.present.items()
                           if run.data.tags.get(TAG + "logged") == "1"}
            self.sweep_id = sweep_id
            preload_blocks(self.client, sweep_id)
            # Nothing of this sweep in MLflow yet: every run it gets is this writer's, so its bundle needs no search.
            empty = not self.present and not any(key[0] == sweep_id for key in self.client.block_ids)
            self.client.ledger = receipt_bundle.Ledger(sweep_id) if empty else None
            # A driver killed between a block's second arm and its answer: the resumed sweep answers it now.
            settle_blocks(self.client, sweep_id)
        except Exception as exc:  # noqa: BLE001 - any store failure means: spool, never lose a receipt
            self._go_offline(exc)
            return None
        if system_metrics:
            self._start_system_metrics()
        return self.parent_run_id

    def _start_system_metrics(self) -> None:
        """Driver-node CPU/memory/disk/network (and GPU via nvidia-ml-py) on the parent run, when available."""
        with self._monitor_lock:
            if self._monitor_closed:
                return
            try:
                import psutil  # noqa: F401 - MLflow's monitor needs it
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self._monitor = SystemMetricsMonitor(self.parent_run_id, sampling_interval=5,
                                                     tracking_uri=self.tracking_uri)
                self._first_step = getattr(self._monitor, "_logging_step", None)
                self._monitor.start()
            except Exception as exc:  # noqa: BLE001 - optional telemetry
                log.info("MLflow system metrics unavailable: %s", exc)
                self._monitor = None

    def has(self, receipt_id: str) -> bool:
        """Logged or spooled by this session: ``log_receipt`` would write nothing for it."""
        return receipt_id in self.logged or receipt_id in self.spooled_ids

    def log_receipt(self, receipt: Receipt) -> Optional[str]:
        """The child run id, or None when the receipt went to the spool instead."""
        rid = receipt.identity.receipt_id
        if rid in self.logged:
            return self.logged[rid]
        if rid in self.spooled_ids:
            return None
        if self.online and self.client is not None and self.parent_run_id is not None:
            try:
                # This sweep's arm runs were all read by open_sweep (one driver per campaign: no one else adds any).
                known = self.present.get(rid, ABSENT) if receipt.identity.sweep_id == self.sweep_id else None
                run_id, _ = self.client.log_receipt(receipt, self.parent_run_id, existing=known)
                self.logged[rid] = run_id
                return run_id
            except Exception as exc:  # noqa: BLE001
                self._go_offline(exc)
        path, fallback_reason = append_spool_or_fallback(receipt, self.sweep_dir)
        self.spool_paths.setdefault(str(path), fallback_reason)
        self.spooled_ids.add(rid)
        self.spooled += 1
        return None

    def stop_monitor(self) -> None:
        """Stop the sampler for good: a sweep that is still being opened starts none afterwards."""
        with self._monitor_lock:
            self._monitor_closed = True
            monitor, self._monitor = self._monitor, None
        if monitor is not None:
            try:
                # Only a sampler that has logged nothing yet, still samples (it ends on its own when the store
                # fails) and has nothing queued (a failed write MLflow's stop retries): else the window is
                # MLflow's, and logging it here could log one step twice or retry a store that is down.
                short = self.online and _still_sampling(monitor) and not monitor.mlflow_logger.data and \
                    getattr(monitor, "_logging_step", None) == self._first_step
                monitor.finish()
                if short:
                    _log_last_window(monitor)
            except Exception as exc:  # noqa: BLE001 - optional telemetry; a full disk must not end the sweep here
                log.info("MLflow system metrics did not stop cleanly: %s", exc)

    def close_sweep(self, sweep_id: str, receipts: Iterable[ReceiptLike], failed: bool) -> None:
        """Summary plot on the parent run, which is then marked FINISHED (or FAILED when blocks errored)."""
        self.stop_monitor()
        try:
            if not self.online or self.client is None or self.parent_run_id is None:
                return
            try:
                if not self._blocks_settled(sweep_id):
                    settle_blocks(self.client, sweep_id, final=True)
                self.client.log_summary(self.parent_run_id, sweep_id, receipts)
                self.client.client.set_terminated(self.parent_run_id, status="FAILED" if failed else "FINISHED")
            except Exception as exc:  # noqa: BLE001
                self._go_offline(exc)
            checkpoint_wal(self.tracking_uri)
        finally:
            if self.client is not None:  # also when MLflow went away: the arms logged before that were checked
                self.client.save_accepted()

    def _blocks_settled(self, sweep_id: str) -> bool:
        """Every block run of the sweep is known to this client (read when the sweep opened, or made since) and
        answered: the final ``settle_blocks`` would search them all (~0.5 s for 1,000) to do nothing."""
        client = self.client
        return client is not None and sweep_id in client.blocks_known and all(
            run_id in client.answered for key, run_id in client.block_ids.items() if key[0] == sweep_id)


def _local_artifact_dir(artifact_uri: str) -> Optional[Path]:
    """The directory of a ``file:`` artifact URI (MLflow's local artifact store), None for any other store."""
    if not artifact_uri.startswith("file:"):
        return None
    from mlflow.utils.file_utils import local_file_uri_to_path

    return Path(local_file_uri_to_path(artifact_uri))


def _write_arm_files(directory: Path, sealed: Receipt, title: str) -> None:
    (directory / "receipt.json").write_text(sealed.model_dump_json(indent=2))
    goodput_svg(sealed, directory / "goodput.svg", title=title)


# --- replay and read back ---


@dataclass
class SyncResult:
    tracking_uri: str
    experiment: str
    logged: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    parents: dict[str, str] = field(default_factory=dict)
    differs: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(receipt id, MLflow run id, logged digest, digest on disk): receipts edited after they were logged."""
    payloads_added: list[str] = field(default_factory=list)
    """Receipts already there, logged before runs carried the receipt payload tags, that got them now."""

    def __rich__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        lines = [f"MLflow {redact_uri(self.tracking_uri)} experiment {self.experiment!r}: {len(self.logged)} "
                 f"receipt(s) logged, {len(self.already)} already there, {len(self.differs)} differ from the logged "
                 f"copy, {len(self.rejected)} rejected, {len(self.parents)} sweep(s)"
                 + (f"; receipt payload added to {len(self.payloads_added)} older run(s)" if self.payloads_added
                    else "")]
        lines += [f"  differs {rid}: the receipt on disk differs from the logged copy: digest {short(logged)} vs "
                  f"{short(mine)} (the logged copy in run {run_id} is kept; if the file is the true record, delete "
                  f"that run and sync again)" for rid, run_id, logged, mine in self.differs]
        lines += [f"  rejected {origin}: {why}" for origin, why in self.rejected]
        return "\n".join(lines)


def _sweep_meta(sweep_dir: Path) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """Sweep metadata by sweep id, and (file, reason) for metadata files that could not be read (their sweeps'
    receipts still sync, only without the experiment name and parent-run params recorded there)."""
    metas: dict[str, dict[str, Any]] = {}
    unreadable: list[tuple[str, str]] = []
    for path in sorted((sweep_dir / SWEEPS_DIR).glob("*.json")) if (sweep_dir / SWEEPS_DIR).is_dir() else []:
        try:
            meta = json.loads(path.read_bytes().decode("utf-8"))
            metas[str(meta["sweep_id"])] = meta
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            why = "no sweep_id" if isinstance(exc, (KeyError, TypeError)) else f"{type(exc).__name__}: {exc}"
            unreadable.append((str(path), f"sweep metadata unreadable ({why}); its sweep's receipts are synced "
                                          f"without the experiment name and params recorded there"))
    return metas, unreadable


def gather(source: Path) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """Receipts of a sweep dir (``receipts/``, ``spool.jsonl``; identical copies once, differing ones rejected
    as a conflict), or of any file/dir ``load_receipts`` reads, with (origin, reason) for everything unusable."""
    return load_receipts(source)


def sync(source: str | Path, tracking_uri: Optional[str] = None, experiment: Optional[str] = None) -> SyncResult:
    """Bring MLflow to exactly the receipts under ``source``: nothing logged twice, nothing left out.

    Raises when the store is unreachable (the spool stays as it is, so the next sync picks it up).
    """
    source = Path(source)
    uri = resolve_tracking_uri(tracking_uri)
    check_sqlite_store(uri)
    metas, unreadable_meta = _sweep_meta(source) if source.is_dir() else ({}, [])
    receipts, rejected = gather(source)
    rejected = rejected + unreadable_meta
    by_sweep: dict[str, list[Receipt]] = {}
    for receipt in receipts:
        by_sweep.setdefault(receipt.identity.sweep_id, []).append(receipt)
    default_experiment = experiment or next((m.get("experiment") for m in metas.values() if m.get("experiment")),
                                            "ablate")
    result = SyncResult(tracking_uri=uri, experiment=default_experiment, rejected=rejected)
    clients: dict[str, TrackingClient] = {}
    for sweep_id, mine in sorted(by_sweep.items()):
        name = experiment or metas.get(sweep_id, {}).get("experiment") or default_experiment
        client = clients.setdefault(name, TrackingClient(uri, name))
        parent_id, created = client.parent_run(sweep_id, mine[0].identity.campaign,
                                               params=metas.get(sweep_id, {}).get("params"))
        result.parents[sweep_id] = parent_id
        present = client.arm_runs(sweep_id)
        for receipt in sorted(mine, key=lambda r: (r.identity.block_id, r.identity.attempt, r.identity.order)):
            rid = receipt.identity.receipt_id
            existing = present.get(rid)
            logged_digest = existing.data.tags.get(TAG + "digest") if existing is not None and \
                existing.data.tags.get(TAG + "logged") == "1" else None
            # Runs logged before digests existed carry no tag: nothing to compare, they count as already there.
            if logged_digest and logged_digest != receipt_digest(receipt):
                result.differs.append((rid, existing.info.run_id, logged_digest, receipt_digest(receipt)))
                continue
            _, new = client.log_receipt(receipt, parent_id, existing=existing)
            (result.logged if new else result.already).append(rid)
            if not new and logged_digest and COUNT_TAG not in existing.data.tags:
                # Logged before payloads existed, and the file is the logged copy (same digest): give it one, so
                # readers stop downloading its receipt.json.
                added = payload_tags(receipt)
                client._log_batch(existing.info.run_id, tags=added)
                result.payloads_added.append(rid)
                if COUNT_TAG in added:
                    client._remember_accepted(payload_json(added), {**existing.data.tags, **added})
        settle_blocks(client, sweep_id)
        client.log_summary(parent_id, sweep_id, mine)
        if created:
            client.client.set_terminated(parent_id, status="FINISHED")
    return result


def load_receipts_from_mlflow(tracking_uri: Optional[str], experiment: str, sweep_id: Optional[str] = None,
                              use_payload: bool = True, ui_url: Optional[str] = None,
                              run_labels: Optional[dict[str, dict[str, str]]] = None
                              ) -> tuple[list[Receipt], list[tuple[str, str]], dict[str, str]]:
    """(receipts, (run, reason) rejects, receipt id -> arm run link) of the experiment's arm runs (one sweep),
    read from the runs' payload tags (``ablate.tracking.payload``) and, for runs without one or with
    ``use_payload=False``, from their ``receipt.json`` artifacts. Links are pages of the UI at ``ui_url``
    (default: see ``ui_base``). ``run_labels``, when given, is filled with receipt id -> {"arm": arm run name,
    "block": block run name, "block_url": block run link} (block keys only for arms nested in a block run)."""
    uri = resolve_tracking_uri(tracking_uri)
    # A missing SQLite file would be created empty by MLflow: a reader must say "no store here" instead. A reader
    # checks the header only; a damaged page it reaches is one line too (store_failure, below).
    check_sqlite_store(uri, must_exist=True, every_page=False)
    from mlflow import MlflowClient

    receipts: dict[str, Receipt] = {}
    rejected: list[tuple[str, str]] = []
    links: dict[str, str] = {}
    quiet = os.environ.get(_PROGRESS_BAR_ENV)
    os.environ[_PROGRESS_BAR_ENV] = "false"  # one tqdm bar per run would bury the CLI's table
    try:
        if MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment) is None:
            return [], [(f"{redact_uri(uri)} experiment {experiment!r}", "no such experiment")], {}
        client = TrackingClient(uri, experiment)
        with collector_paused():  # 10,000 validated receipts are millions of objects, none of them garbage
            receipt_bundle.read_receipts(client, sweep_id, uri, receipts, rejected, links, use_payload, ui_url,
                                         run_labels)
    except TrackingStoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged or unreachable store: one line, never a sqlalchemy traceback
        raise TrackingStoreError(store_failure(uri, exc)) from exc
    finally:
        if quiet is None:
            os.environ.pop(_PROGRESS_BAR_ENV, None)
        else:
            os.environ[_PROGRESS_BAR_ENV] = quiet
    return list(receipts.values()), rejected, links


def _read_receipts(client: TrackingClient, sweep_id: Optional[str], uri: str, receipts: dict[str, Receipt],
                   rejected: list[tuple[str, str]], links: dict[str, str], use_payload: bool = True,
                   ui_url: Optional[str] = None, run_labels: Optional[dict[str, dict[str, str]]] = None) -> None:
    from mlflow.entities import ViewType

    runs = [run for _, run in sorted(client.arm_runs(sweep_id).items())]
    rejected.extend(receipt_bundle.deleted_notes(receipt_bundle.deleted_arm_runs(client, sweep_id,
                                                                                  ViewType.DELETED_ONLY), skip=set()))
    blocks = {run_id: run.info.run_name or run_id
              for run_id, run in (block_runs(client, sweep_id) if run_labels is not None else {}).items()}
    collect_outcomes(client, read_arm_runs(runs, uri, use_payload=use_payload), ui_base(uri, ui_url)[0], blocks,
                     receipts, rejected, links, run_labels)


def collect_outcomes(client: TrackingClient, outcomes: Iterable[Any], ui: str, blocks: dict[str, str],
                     receipts: dict[str, Receipt], rejected: list[tuple[str, str]], links: dict[str, str],
                     run_labels: Optional[dict[str, dict[str, str]]]) -> None:
    """Each read arm run into the reader's results: its receipt and link, or the reason it was rejected; with
    ``run_labels``, its arm run's name and its block run's (``blocks``: block run id -> name)."""
    for outcome in outcomes:
        run_id = outcome.run.info.run_id
        if outcome.receipt is None:
            rejected.append(from_run_tags(f"run {run_id}", outcome.reason or "unreadable", outcome.run.data.tags, TAG))
            continue
        rid = outcome.receipt.identity.receipt_id
        receipts.setdefault(rid, outcome.receipt)
        links[rid] = run_link(ui, client.experiment_id, run_id)
        if run_labels is not None:
            run_labels[rid] = {"arm": outcome.run.info.run_name or run_id}
            block_id = outcome.run.data.tags.get("mlflow.parentRunId", "")
            if block_id in blocks:
                run_labels[rid].update(block=blocks[block_id] or block_id,
                                       block_url=run_link(ui, client.experiment_id, block_id))


def store_failure(uri: str, exc: BaseException) -> str:
    """One line for a store that failed: which store, what failed, what to do (never the URI's password)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    db = sqlite_path(uri)
    if db is not None and any(word in first for word in ("not a database", "malformed", "disk image")):
        from ablate.tracking.uri import corrupt_store_message

        return corrupt_store_message(db, first.split(") ", 1)[-1])
    return redact_uri(f"MLflow at {uri} failed ({type(exc).__name__}: {first[:300]})")


def not_run_from_mlflow(tracking_uri: str, experiment: str) -> list[dict[str, str]]:
    """What every sweep's plan refused before any arm ran, from the parent runs' tag. A store that fails (a damaged
    page, a server gone since the receipts were read) is a ``TrackingStoreError`` naming it."""
    try:
        client = TrackingClient(tracking_uri, experiment)
        parents = client.search([f"{_q(TAG + 'role')} = '{ROLE_SWEEP}'"])
    except Exception as exc:  # noqa: BLE001 - one line naming the store, never a sqlalchemy traceback
        raise TrackingStoreError(store_failure(tracking_uri, exc)) from exc
    out = []
    for run in parents:
        tags = run.data.tags
        try:
            rows = json.loads(tags.get(SKIPPED_TAG) or "[]")
        except ValueError:
            rows = [["(unreadable)", f"tag {SKIPPED_TAG} is not JSON (cut at {MAX_TAG_CHARS} characters?)"]]
        out += [{"sweep_id": tags.get(TAG + "sweep_id", ""), "campaign": tags.get(TAG + "campaign", ""),
                 "what": str(w), "why": str(r)} for w, r in rows]
    return out


def not_run_from_dir(source: Path) -> list[dict[str, str]]:
    """The same from the sweep metadata files under (or next to) a receipts directory."""
    roots = [source, *([source.parent] if source.name == "receipts" else [])]
    out = []
    for path in sorted({p for root in roots if root.is_dir() for p in root.rglob(f"{SWEEPS_DIR}/*.json")}):
        try:
            meta = json.loads(path.read_bytes().decode("utf-8"))
            rows = meta.get("skipped") or []
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue  # the receipt loader lists unreadable metadata already
        out += [{"sweep_id": str(meta.get("sweep_id", "")), "campaign": str(meta.get("campaign", "")),
                 "what": str(w), "why": str(r)} for w, r in rows]
    return out


def log_promotion_plots(tracking_uri: str, experiment: str, sweep_ids: Iterable[str], report_id: str,
                        plots: dict[str, Path]) -> dict[str, str]:
    """Log each lane's speed-up-against-horizon plot on the parent run of every sweep that measured it, under
    ``promotion/<report id>/``; returns lane key -> where it went. A store that is away costs the links only."""
    try:
        client = TrackingClient(tracking_uri, experiment)
        parents = [client.search([f"{_q(TAG + 'role')} = '{ROLE_SWEEP}'", f"{_q(TAG + 'sweep_id')} = '{sweep}'"])
                   for sweep in sorted(set(sweep_ids))]
        runs = [found[0] for found in parents if found]
        placed: dict[str, str] = {}
        for run in runs:
            for lane_key, path in plots.items():
                client.client.log_artifact(run.info.run_id, str(path), artifact_path=f"promotion/{report_id}")
                link = run_link(ui_base(tracking_uri)[0], client.experiment_id, run.info.run_id)
                placed[lane_key] = f"{link} artifact promotion/{report_id}/{path.name}"
        return placed
    except Exception as exc:  # noqa: BLE001 - the report and its local plots still stand without MLflow
        log.warning("could not log the promotion plots to %s: %s", redact_uri(tracking_uri), exc)
        return {}


def log_pngs(tracking_uri: str, experiment: str, run_ids: Iterable[str]) -> dict[str, str]:
    """The matplotlib pictures, on demand, for the runs a reader cites (a report's blocks and arms): ``goodput.png``
    on each arm run, ``block.png`` on each block run, ``summary.png`` on a sweep's parent run, beside the SVGs the
    sweep logged. Receipts come from the runs' payload tags. Returns run id -> the file logged (runs of another
    role, or unreadable, are left out)."""
    client = TrackingClient(tracking_uri, experiment)
    done: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ablate-mlflow-") as tmp:
        for run_id in dict.fromkeys(run_ids):
            run = client.client.get_run(run_id)
            role, out = run.data.tags.get(TAG + "role"), Path(tmp) / run_id
            if role == ROLE_ARM:
                arms = [run]
            elif role == ROLE_BLOCK and run.data.tags.get(TAG + "receipts"):
                ids = run.data.tags[TAG + "receipts"].split(",")  # baseline, candidate
                arms = [hit for rid in ids for hit in client.search([f"{_q(TAG + 'receipt_id')} = '{rid}'"])[:1]]
            elif role == ROLE_SWEEP and run.data.tags.get(TAG + "sweep_id"):
                sweep_id = run.data.tags[TAG + "sweep_id"]
                mine = load_receipts_from_mlflow(tracking_uri, experiment, sweep_id=sweep_id)[0]
                plot = summary_png(mine, out / "summary.png", title=f"{sweep_id}: candidate / baseline per block")
                if plot is not None:
                    client.client.log_artifact(run_id, str(plot))
                    done[run_id] = plot.name
                continue
            else:
                continue
            receipts = [o.receipt for o in read_arm_runs(arms, tracking_uri) if o.receipt is not None]
            if role == ROLE_ARM and len(receipts) == 1:
                plot = goodput_png(receipts[0], out / "goodput.png", title=run_name(receipts[0]))
            elif role == ROLE_BLOCK and len(receipts) == 2:
                plot = block_png(receipts[0], receipts[1], out / "block.png", title=run.info.run_name or run_id)
            else:
                continue
            client.client.log_artifact(run_id, str(plot))
            done[run_id] = plot.name
    return done


_USAGE = ("usage: python -m ablate.tracking.mlflow_store <sweep dir> [tracking uri]   (replay receipts)\n"
          "       python -m ablate.tracking.mlflow_store pngs <tracking uri> <experiment> <run id>...   (render the "
          "matplotlib goodput.png / block.png / summary.png of those arm / block / sweep runs)")


def _main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "pngs":
        for run_id, name in log_pngs(argv[1], argv[2], argv[3:]).items():
            print(f"{run_id}: {name}")
        return 0
    if len(argv) not in (1, 2):
        print(_USAGE, file=sys.stderr)
        return 2
    print(sync(argv[0], argv[1] if len(argv) == 2 else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
