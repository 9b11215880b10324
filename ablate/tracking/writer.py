"""A sweep's MLflow writes in a process of their own, behind ``MlflowStore``'s interface.

Why: logging one arm costs ~60 ms of CPU in MLflow and SQLAlchemy (create the run, log its params, metrics and
payload, end it, answer its block). On the driver that CPU shared one interpreter lock with Tune's event loop:
over 1,000 simulated blocks the writer thread spent 114 s of CPU and 178 s of wall time in MLflow, and the loop
waited for it (``benchmarks/results/orchestration.json``). In a process of its own it runs beside the loop.

How to use: ``StoreProcess(uri, experiment, sweep_dir)`` where a sweep used ``MlflowStore``; call ``shutdown()``
when the sweep is done with it. Each call goes to a spawned child holding the real ``MlflowStore`` (spawned, not
forked: the driver runs Ray's and gRPC's threads) and returns what it returned there, with the state the sweep's
summary reads (``parent_run_id``, ``logged``, ``spooled``, ``spooled_ids``, ``spool_paths``, ``offline_reason``).

Nothing is lost when the child goes away (killed, out of memory, crashed): the call it did not answer, and every
later one, is handled as an unreachable store is (the receipt goes to the spool, the summary names it, ``ablate
receipts sync`` replays it). A receipt is in its campaign directory before it is handed to the store, so a run
the child left half-written is found incomplete and written again by the replay. The child ignores Ctrl+C (the
driver decides when the sweep ends) and exits when the driver closes its end or dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import threading
from pathlib import Path
from typing import Any, Optional

from ablate.receipts.schema import Receipt
from ablate.receipts.store import SPOOL_FILE, append_spool_or_fallback
from ablate.tracking.uri import resolve_tracking_uri

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0
"""How long ``shutdown`` waits for the child to finish what it was sent before stopping it."""
_QUIET = ("mlflow", "alembic")
"""Loggers whose INFO lines (tables created, migrations) stay out of the sweep's console, as on the driver."""
_NOISY = ("mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor", "mlflow.tracking")
"""Loggers that write a traceback per failed SQLite insert on a full disk: one line each instead."""


class StoreProcess:
    """``MlflowStore`` run in a child process; see the module docstring."""

    def __init__(self, tracking_uri: str, experiment: str, sweep_dir: Path) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.experiment = experiment
        self.sweep_dir = Path(sweep_dir)
        self.parent_run_id: Optional[str] = None
        self.offline_reason: Optional[str] = None
        self.spooled = 0
        self.spooled_ids: set[str] = set()
        self.spool_paths: dict[str, Optional[str]] = {}
        self.logged: dict[str, str] = {}
        self.sweep_id: Optional[str] = None
        self._lock = threading.Lock()
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(theirs, tracking_uri, experiment, str(sweep_dir)),
                                        name="ablate-mlflow", daemon=True)
        self._process.start()
        theirs.close()

    @property
    def online(self) -> bool:
        return self.offline_reason is None

    def open_sweep(self, sweep_id: str, campaign: str, params: dict[str, Any], tags: dict[str, str],
                   system_metrics: bool = True) -> Optional[str]:
        self.sweep_id = sweep_id
        answered, run_id = self._call("open_sweep", sweep_id, campaign, params, tags, system_metrics=system_metrics)
        return run_id if answered else None

    def log_receipt(self, receipt: Receipt) -> Optional[str]:
        """The child run id, or None when the receipt went to the spool instead."""
        rid = receipt.identity.receipt_id
        if rid in self.logged:
            return self.logged[rid]
        if rid in self.spooled_ids:
            return None
        answered, run_id = self._call("log_receipt", receipt)
        if answered:
            return run_id
        path, fallback_reason = append_spool_or_fallback(receipt, self.sweep_dir)
        self.spool_paths.setdefault(str(path), fallback_reason)
        self.spooled_ids.add(rid)
        self.spooled += 1
        return None

    def stop_monitor(self) -> None:
        self._call("stop_monitor")

    def close_sweep(self, sweep_id: str, receipts: list[Receipt], failed: bool) -> None:
        self._call("close_sweep", sweep_id, receipts, failed)

    def shutdown(self) -> None:
        """Let the child finish what it was sent and exit (stopped after ``SHUTDOWN_TIMEOUT_S``)."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
                self._conn.close()
                self._conn = None
        self._process.join(SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """(answered, result) of the store's method in the child; (False, None) once the child is gone. An exception
        the method raised there is raised here."""
        with self._lock:
            if self._conn is None:
                return False, None
            try:
                self._conn.send((method, args, kwargs))
                result, error, state = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._lost(exc)
                return False, None
        self._merge(state)
        if error is not None:
            raise error
        return True, result

    def _merge(self, state: dict[str, Any]) -> None:
        self.parent_run_id = state["parent_run_id"]
        self.offline_reason = state["offline_reason"]
        self.spooled = state["spooled"]
        self.spool_paths = state["spool_paths"]
        self.logged.update(state["logged"])
        self.spooled_ids.update(state["spooled_ids"])

    def _lost(self, exc: BaseException) -> None:
        self._conn.close()
        self._conn = None
        self._process.join(5)
        code = self._process.exitcode
        self.offline_reason = (f"the MLflow writer process ended (exit code {code}; {type(exc).__name__}); "
                               f"receipts are spooled")
        log.warning("the MLflow writer process of this sweep ended (exit code %s); receipts are spooled to %s; "
                    "replay them with `ablate receipts sync %s`", code, self.sweep_dir / SPOOL_FILE,
                    self.sweep_dir)


def _serve(conn: Any, tracking_uri: str, experiment: str, sweep_dir: str) -> None:
    """The child: one ``MlflowStore``, one call at a time, until the driver closes its end (or is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import mlflow  # noqa: F401  (its import sets the "mlflow" logger to INFO: import first, then quieten)

    from ablate.logfaults import DiskFaultLines
    from ablate.tracking.mlflow_store import MlflowStore

    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _NOISY:
        logging.getLogger(name).addFilter(DiskFaultLines())
    store = MlflowStore(tracking_uri, experiment, Path(sweep_dir))
    sent_logged: set[str] = set()
    sent_spooled: set[str] = set()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        method, args, kwargs = message
        result, error = None, None
        try:
            result = getattr(store, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - raised again in the driver, where the caller handles it
            error = exc
        # Only what changed goes back: a campaign's thousands of run ids are not sent again on every call.
        logged = {rid: run_id for rid, run_id in store.logged.items() if rid not in sent_logged}
        sent_logged.update(logged)
        spooled = store.spooled_ids - sent_spooled
        sent_spooled |= spooled
        state = {"parent_run_id": store.parent_run_id, "offline_reason": store.offline_reason,
                 "spooled": store.spooled, "spool_paths": dict(store.spool_paths), "logged": logged,
                 "spooled_ids": spooled}
        try:
            try:
                conn.send((result, error, state))
            except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
                conn.send((None, RuntimeError(f"{type(error).__name__}: {error}"), state))
        except (OSError, ValueError):
            break
    store.stop_monitor()
