"""Run a campaign on Ray Tune: one trial per block, both arms back to back in fresh processes, receipts to MLflow.

How to run me: ``ablate sweep search_spaces/smoke.yaml`` (or ``python -m ablate sweep ...``); on a cluster,
``ray job submit --working-dir . -- python -m ablate sweep search_spaces/<file>.yaml``. ``ray.init()`` attaches
to the cluster a job runs on (``RAY_ADDRESS``); otherwise a local runtime starts with the driver resources of
``ablate.sweep.resources``.

The pieces:
1. ``load_sweep`` + ``plan_sweep``: blocks with recorded arm orders (a resumed sweep must replan identically).
2. ``check_cluster``: what a block needs vs. what each node has -> ``max_concurrent_trials``, or a
   ``ResourceError`` before anything is submitted or tracked.
3. The trial, ``ablate.sweep.trial.run_block``: both arms through ``trainers.run_arm``, receipts via
   ``tune.report``; a crashed arm fails the trial and ``tune.FailureConfig`` reruns the block as a new attempt.
4. On the driver, ``_Recorder`` writes every receipt to the campaign dir and hands it to one MLflow writer thread
   (or the spool), waiting for that thread when ``MAX_TRACKING_BACKLOG`` receipts are queued (bounded memory).
   That thread also opens the sweep in MLflow, as its first job, while Tune starts the first trials: a store's
   start-up (MLflow's imports, a new database's migrations: 3-5 s on 2 CPUs) is off the first block's path;
   ``SweepProgress`` draws the progress line. Both hang off one picklable relay callback, because Tune pickles
   its callbacks into the experiment and ``Tuner.restore`` would otherwise bring back stale ones.
5. ``--resume``: ``Tuner.restore`` of the sweep named in ``LATEST``. Finished blocks are not rerun, including
   blocks whose receipts exist although the killed driver never saved Tune's state after them; unfinished and
   errored blocks continue as a new attempt.

Faults that must not lose a receipt:
- one driver per campaign directory (``SweepLock``): a second sweep of the campaign is refused, naming the
  holder, or waits for it (``lock_wait_s``); a lock left by a dead driver is taken over with a warning;
- a damaged embedded MLflow store is refused before anything runs (``check_sqlite_store``);
- a receipt the campaign directory refuses (full disk, read-only) goes to a fallback directory
  (``ablate.receipts.store``), and so does a spool line; the summary names where and what to run next;
- Ctrl+C: Tune saves its state and stops the trials; the driver then (after stopping a Ray it started, so no
  trial writes later) logs or spools every receipt of the sweep on disk that it had not taken yet (an arm that
  finished while the driver stopped listening), and the summary says ``ablate sweep <campaign> --resume``
  instead of Tune's ``Tuner.restore`` hint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from ray.tune import Callback

from ablate.config.auto_device import cluster_device, planned_device
from ablate.config.features import differing_features
from ablate.config.lane_shape import AUTO, DEVICE_CLASSES
from ablate.config.load import Defaults, apply_defaults, flatten, lane_to_dict, load_sweep, read_yaml
from ablate.config.schema import ConfigError, HostAllocator, SweepConfig
from ablate.receipts.outline import ArmOutline, outline
from ablate.receipts.schema import SIMULATED_EXECUTOR, InvalidReceipt, Receipt, Status, validate_receipt
from ablate.receipts.store import (RECEIPTS_DIR, SPOOL_FILE, ReceiptNotSaved, digest_problem, fallback_dirs,
                                   load_receipts, scan_receipts, settle_unfinished_writes, with_fallbacks,
                                   write_receipt_or_fallback)
from ablate.sweep.head_start import log_fork_servers, start_fork_servers, start_local_fork_server
from ablate.sweep.layout import LATEST, Layout, SweepLock
from ablate.sweep.node_check import NODE_CHECK_TAG, check_plan
from ablate.sweep.node_wait import prompt_node_wait
from ablate.sweep.placement import TrialResources, aa_targets, coverage_warnings, dispatch_order
from ablate.sweep.plan import ORDERS_IN_PAIRS, ORDERS_SHUFFLED, SweepPlan, plan_sweep
from ablate.redact import process_env_only, redact_text, redact_uri
from ablate.sweep.resources import (Capacity, block_need, check_cluster, gpu_resources, local_ray_init_kwargs,
                                    tune_env_filter, tune_signal_handlers_restored)
from ablate.sweep.trial import (block_progress, clear_interrupted_scratch, run_block, start_clock, trial_dirname,
                                trial_name)
from ablate.sweep.worker_output import drop_teardown_tracebacks, flush_held
from ablate.tracking.mlflow_store import MAX_TAG_CHARS, SKIPPED_TAG, SWEEPS_DIR, MlflowStore
from ablate.tracking.uri import check_sqlite_store, resolve_tracking_uri, shown

log = logging.getLogger(__name__)

_LIVE: dict[str, list[Any]] = {}
"""sweep id -> the live driver callbacks of the current session (see ``_Relay``)."""


TAKEN = "receipt_taken"
"""Set by the recorder on an arm's Tune result once the campaign directory holds its receipt (the receipt id), or
rejected/ its refused text (that file's path). ``_Relay`` then drops the receipt JSON from the result, after every
live callback has read it: Tune keeps each trial's last result for the whole sweep (in memory and in every
experiment-state snapshot), and its JSON result logger, which runs after ``_Relay``, would write the receipt once
more per arm. A receipt that only a fallback directory took (or none) stays in the result: Tune's copy, synced to the
sweep's storage, is then one more. Tune lets callbacks edit a result in place; the scheduler's and searcher's
``on_trial_result`` got a flattened copy before."""


class _Relay(Callback):
    """Picklable stand-in Tune stores with the experiment (by reference: a module-level class holding only the
    sweep id); it forwards every hook to this session's live callbacks registered in ``_LIVE``."""

    def __init__(self, sweep_id: str) -> None:
        self.sweep_id = sweep_id

    def _each(self, hook: str, **info: Any) -> None:
        for target in _LIVE.get(self.sweep_id, []):
            getattr(target, hook)(**info)

    def setup(self, **info: Any) -> None:
        self._each("setup", **info)

    def on_step_end(self, **info: Any) -> None:
        self._each("on_step_end", **info)

    def on_trial_start(self, **info: Any) -> None:
        self._each("on_trial_start", **info)

    def on_trial_result(self, **info: Any) -> None:
        self._each("on_trial_result", **info)
        result = info.get("result")
        if isinstance(result, dict) and TAKEN in result:
            result.pop("receipt", None)

    def on_trial_complete(self, **info: Any) -> None:
        self._each("on_trial_complete", **info)

    def on_trial_error(self, **info: Any) -> None:
        self._each("on_trial_error", **info)

    def on_trial_recover(self, **info: Any) -> None:
        self._each("on_trial_recover", **info)

    def on_experiment_end(self, **info: Any) -> None:
        self._each("on_experiment_end", **info)


MAX_TRACKING_BACKLOG = 32
"""Receipts waiting for the MLflow writer thread at most. When arms finish faster than MLflow takes their receipts
(0.15-0.3 s per arm on a loaded 2-core host, about 0.06 s of it CPU; simulated arms in
``benchmarks/bench_orchestration.py``), the driver waits for the writer instead of queueing a whole campaign's
receipts in memory and writing them for minutes after Tune ended."""


def _told(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line for a log or the summary: credentials and secret values redacted before it is cut
    (a cut inside ``user:password@`` would leave the pattern nothing to match)."""
    return redact_text(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")[:limit]


class _Recorder(Callback):
    """Driver-side sink: receipt -> campaign dir (+ mirror) -> MLflow or spool; keeps the block timeline.
    Lives only in ``_LIVE`` (never pickled); the other Tune hooks keep Callback's no-op defaults."""

    def __init__(self, layout: Layout, store: Any, clock: Any = None) -> None:
        self.layout, self.store, self.clock = layout, store, clock
        self.received: list[tuple[str, Status]] = []
        """(receipt id, status) of every arm receipt taken, in order. The receipts themselves are on disk, so a
        long campaign does not keep them all in the driver's memory."""
        self.off_campaign: list[Receipt] = []
        """Receipts the campaign directory does not hold (a fallback directory took them, or none did)."""
        self.rejected: list[tuple[str, str]] = []
        self.fallbacks: list[tuple[str, str, str]] = []
        """(receipt id, where it is, why not in receipts/): receipts the campaign directory refused."""
        self.unsaved: list[tuple[str, str]] = []
        """(receipt id, why): receipts no directory took (still sent to MLflow or the spool)."""
        self.unmirrored: dict[str, tuple[Path, str]] = {}
        """Receipt id -> (its file in the campaign dir, why): receipts remote storage did not take. They stay in Tune's
        results (synced to that storage) and ``mirror_again`` retries them once Tune has ended."""
        self.timeline: dict[str, dict[str, Any]] = {}
        # One writer thread: MLflow calls (0.15-0.3 s per arm on 2 busy cores) stay off Tune's event loop, and SQLite
        # still sees a single writer. The receipt file is written synchronously before anything is queued.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ablate-mlflow")
        self._backlog = threading.BoundedSemaphore(MAX_TRACKING_BACKLOG)
        self.backlog_wait_s = 0.0
        """Driver seconds spent waiting for the MLflow writer (the backlog was full)."""
        self.waited_at = -math.inf
        """time.monotonic() when the last such wait ended (``_BacklogWaitLines``)."""
        self._opening: Any = None
        self._dropped = False
        """Ctrl+C while ``flush`` waited: what was still queued is dropped (its receipts are on disk)."""

    def open_tracking(self, opening: Callable[[], Any]) -> None:
        """``opening`` (``_open_tracking``) as the writer's first job, before any receipt is queued: every receipt
        is logged after it, in the order taken."""
        self._opening = self._writer.submit(opening)

    def track_later(self, receipt: Receipt) -> None:
        """``receipt`` (already on disk) to MLflow or the spool on the writer thread, behind what is queued."""
        if not self._backlog.acquire(blocking=False):  # MAX_TRACKING_BACKLOG receipts wait for MLflow already
            waiting = time.monotonic()
            self._backlog.acquire()
            self.waited_at = time.monotonic()
            self.backlog_wait_s += self.waited_at - waiting
        self._writer.submit(self._track, receipt)

    def catch_up(self, receipts: list[Receipt]) -> None:
        """Receipts of this sweep a killed driver wrote but never logged, as one writer job behind the opening:
        they are in memory already, so they take no place in the backlog and the caller does not wait."""
        if receipts:
            self._writer.submit(lambda: [self._track(receipt, counted=False) for receipt in receipts])

    def _track(self, receipt: Receipt, counted: bool = True) -> None:
        try:
            if self.store.log_receipt(receipt) is None and (self.layout.local_dir / SPOOL_FILE).is_file():
                self.layout.publish(self.layout.local_dir / SPOOL_FILE)
        except Exception as exc:  # noqa: BLE001 - a worker-thread error would vanish silently; the file exists
            log.error("receipt %s: tracking failed (%s); it is on disk, `ablate receipts sync %s` replays it",
                      receipt.identity.receipt_id, _told(exc), self.layout.local_dir)
        finally:
            if counted:
                self._backlog.release()

    def flush(self) -> None:
        """Wait until the sweep is open in MLflow (or found unreachable) and every queued receipt is in MLflow or
        the spool. Ctrl+C meanwhile drops what is still queued, whose receipts are on disk (``--resume`` or
        ``ablate receipts sync`` logs them), and is raised again."""
        if self._dropped:
            return
        if self._opening is not None and not self._opening.done():
            log.warning("waiting for MLflow at %s to open the sweep (Ctrl+C leaves the receipts on disk for "
                        "`ablate receipts sync %s`)", redact_uri(self.store.tracking_uri), self.layout.local_dir)
        try:
            self._writer.shutdown(wait=True)
        except KeyboardInterrupt:
            self._dropped = True  # the driver's clean-up calls flush again: it must not wait a second time
            self._writer.shutdown(wait=False, cancel_futures=True)
            raise

    def on_trial_start(self, trial: Any, **info: Any) -> None:
        now = time.time()
        entry = self.timeline.setdefault(trial.config["block_id"], {"arms": []})
        entry.setdefault("trial_started_at", now)
        if self.clock is not None:
            # The block's first arm is billed queue wait from here (the driver handing the block to Ray).
            try:
                self.clock.stamp(trial.config["block_id"], now)
            except Exception as exc:  # noqa: BLE001 - the trial then starts the arm's clock itself, and says so
                log.warning("block %s: scheduling stamp not stored (%s)", trial.config["block_id"], exc)

    def on_trial_result(self, trial: Any, result: dict[str, Any], **info: Any) -> None:
        entry = self.timeline.setdefault(result.get("block_id", trial.config["block_id"]), {"arms": []})
        if result.get("event") == "block_started":
            entry.update(started_at=result["at"], node_id=result["node_id"], host=result["host"],
                         attempt=result["attempt"])
            return
        if result.get("event") != "arm":
            return
        try:
            raw = json.loads(result["receipt"])
            receipt = validate_receipt(raw)
            if digest_problem(raw):
                raise InvalidReceipt(f"as received from the trial: {digest_problem(raw)}")
        except (InvalidReceipt, json.JSONDecodeError) as exc:
            where = f"{trial.config['block_id']}-{result.get('arm_index')}-attempt{result.get('attempt')}"
            self.rejected.append((where, str(exc)))
            log.error("block %s: arm %s sent an invalid receipt (kept in rejected/): %s", trial.config["block_id"],
                      result.get("arm"), exc)
            # Kept verbatim for forensics; never a receipt (promotion and sync read receipts/ only).
            try:
                self.layout.write(f"rejected/{where}.json.txt", result["receipt"])
            except Exception as exc:  # noqa: BLE001 - a local OSError, or remote storage refusing its mirror
                log.error("block %s: the refused receipt could not be kept in rejected/ (%s); Ray Tune's result keeps "
                          "it", trial.config["block_id"], _told(exc))
                return
            result[TAKEN] = f"rejected/{where}.json.txt"
            return
        self.received.append((receipt.identity.receipt_id, receipt.identity.status))
        entry["arms"].append({k: result[k] for k in ("arm", "order", "attempt", "status", "scheduled_at",
                                                      "ended_at", "node_id", "host")}
                             | {"receipt_id": receipt.identity.receipt_id,
                                "time_to_first_step_s": receipt.steps.time_to_first_step_s,
                                "wall_s": receipt.time.wall_s})
        if self._write(receipt):
            result[TAKEN] = receipt.identity.receipt_id
        self.track_later(receipt)

    def _write(self, receipt: Receipt) -> bool:
        """The receipt into the campaign dir, or a fallback dir (then named in the summary); a refused write never
        raises. True when the campaign dir took it."""
        rid = receipt.identity.receipt_id
        try:
            where, why = write_receipt_or_fallback(receipt, self.layout.receipts_dir)
        except ReceiptNotSaved as exc:
            self.unsaved.append((rid, str(exc)))
            self.off_campaign.append(receipt)
            log.error("%s", exc)
            return False
        if why is None:
            return self._mirror(rid, where)
        self.fallbacks.append((rid, str(where), why))
        self.off_campaign.append(receipt)
        # The sweep's metadata beside it, so `ablate receipts sync <fallback dir>` finds the experiment name.
        meta = f"{SWEEPS_DIR}/{receipt.identity.sweep_id}.json"
        target = where.parent.parent / meta
        try:
            text = self.layout.read(meta)
            if text is not None and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
        except OSError:
            pass  # the receipt itself is safe; sync then uses the default experiment
        return False

    def _mirror(self, rid: str, path: Path, tell: bool = True) -> bool:
        """``path`` (a receipt in the campaign dir) into remote storage; True once it is there (or storage is local).
        A storage fault costs the mirror, never the sweep: raised here, it would stop Tune and every later block."""
        try:
            self.layout.publish(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError, ArrowException or others, by filesystem
            why = _told(exc)
            self.unmirrored[rid] = (path, why)
            if tell:
                log.error("receipt %s is in %s but not in storage %s (%s); Ray Tune's result keeps it, and the "
                          "sweep's end tries again", rid, path.parent, redact_uri(self.layout.storage), why)
            return False
        self.unmirrored.pop(rid, None)
        return True

    def mirror_again(self) -> list[tuple[str, str, str]]:
        """Retry the receipts remote storage refused, up to the first it still refuses (storage that is down would
        cost its timeout once per receipt); (receipt id, local file, why) of those left (the summary names them)."""
        for rid, (path, _) in list(self.unmirrored.items()):
            if not self._mirror(rid, path, tell=False):
                break
        return [(rid, str(path), why) for rid, (path, why) in self.unmirrored.items()]

    def mirror_missing(self, receipts: list[Receipt]) -> None:
        """On resume: the campaign dir's receipts of this sweep that remote storage lacks (an earlier session's
        mirror failed, or its driver died before retrying) are mirrored now, or left for ``mirror_again``."""
        if not self.layout.remote or not receipts:
            return
        try:
            there, why = self.layout.mirrored(RECEIPTS_DIR), "not in storage when the sweep resumed"
        except Exception as exc:  # noqa: BLE001 - storage unreadable: each one is tried (and bounded) below
            there, why = set(), _told(exc)
        for receipt in receipts:
            path = self.layout.receipts_dir / f"{receipt.identity.receipt_id}.json"
            if path.name not in there and path.is_file():
                self.unmirrored[receipt.identity.receipt_id] = (path, why)
        self.mirror_again()

    def on_trial_complete(self, trial: Any, **info: Any) -> None:
        self.timeline.setdefault(trial.config["block_id"], {"arms": []})["trial_ended_at"] = time.time()
        _lighten(trial)

    def on_trial_error(self, trial: Any, **info: Any) -> None:
        self.timeline.setdefault(trial.config["block_id"], {"arms": []})["trial_errored_at"] = time.time()
        _lighten(trial)


def _lighten(trial: Any) -> None:
    """Drop an ended trial's running metric statistics. Tune keeps every trial for the whole experiment, and each
    kept a min/max/mean and two moving-average windows (``deque``) per number it ever reported, plus their JSON in
    its cached state: ~30 KB of the ~55 KB a block's trial holds (measured on 240 simulated blocks). Nothing reads
    them here (no scheduler, no best-trial query); the last result, its status and its checkpoint stay. A Tune
    without these attributes is left as it is."""
    metadata = getattr(trial, "run_metadata", None)
    if metadata is not None and hasattr(metadata, "metric_n_steps") and hasattr(metadata, "metric_analysis"):
        metadata.metric_n_steps = {}  # assignment invalidates the cached JSON state: the next snapshot is smaller
        metadata.metric_analysis = {}


@dataclass
class SweepSummary:
    sweep_id: str
    campaign: str
    sweep_dir: str
    tune_path: str
    tracking_uri: str
    """Redacted: safe to print."""
    experiment: str
    parent_run_id: Optional[str]
    resumed: bool
    executor: str
    max_concurrent: int
    blocks_total: int
    blocks_done: int
    blocks_errored: int
    arms_logged: int
    """Arm receipts received in this session."""
    arms_failed: int
    arms_disqualified: int
    spooled: int
    offline_reason: Optional[str]
    elapsed_s: float
    receipt_ids: list[str] = field(default_factory=list)
    timeline: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    resume_command: str = ""
    campaign_file: str = "<campaign file>"
    interrupted: bool = False
    """Ctrl+C (SIGINT): Tune stopped the running trials; ``--resume`` continues."""
    caught_up: int = 0
    """Receipts on disk the driver had not taken (an arm that finished as it stopped), logged or spooled at the end."""
    fallbacks: list[tuple[str, str, str]] = field(default_factory=list)
    """(receipt id, where it is, why) for receipts the campaign directory refused."""
    unsaved: list[tuple[str, str]] = field(default_factory=list)
    unmirrored: list[tuple[str, str, str]] = field(default_factory=list)
    """(receipt id, file in the campaign dir, why) for receipts remote storage refused, retried at the sweep's end."""
    storage: str = ""
    """Where the campaign's files are kept (redacted): the campaign dir, or the remote storage it is mirrored to."""
    spools: dict[str, Optional[str]] = field(default_factory=dict)
    """Spool file -> why it is a fallback spool (None: the campaign's own)."""
    fatal: Optional[str] = None
    """Ray Tune itself stopped with an error (e.g. it could not save its state on a full disk)."""
    left_out: dict[str, str] = field(default_factory=dict)
    """--until-decided: planned block id -> why it did not run in this round (its test was decided)."""
    schedule: str = "fixed"
    """fixed (every planned block) or until_decided (a round of ``ablate.sweep.until_decided``, which prints the
    campaign's next commands itself)."""
    judge_s: float = 0.0
    """--until-decided: driver seconds spent judging between blocks."""

    @property
    def exit_code(self) -> int:
        return 1 if (self.blocks_errored or self.blocks_done < self.blocks_total or self.fallbacks or self.unsaved
                     or self.unmirrored or self.fatal) else 0

    def __rich__(self) -> str:
        return self.render()

    def render(self) -> str:
        lines = [
            f"sweep {self.sweep_id} ({'resumed' if self.resumed else 'new'}): {self.blocks_done}/{self.blocks_total} "
            f"blocks done, {self.blocks_errored} errored; {self.arms_logged} arm receipt(s) this session "
            f"({self.arms_failed} failed, {self.arms_disqualified} disqualified) in {self.elapsed_s:.1f}s; "
            f"{self.max_concurrent} block(s) at once ({self.executor})",
            f"receipts: {self.sweep_dir}/receipts",
            f"MLflow:   {self.tracking_uri} experiment {self.experiment!r}, parent run {self.parent_run_id}",
        ]
        spools = self.spools or ({f"{self.sweep_dir}/{SPOOL_FILE}": None} if self.spooled else {})
        # A fallback spool has no sweep metadata beside it: the replay command names the experiment itself.
        into = f" --experiment {self.experiment}" if self.experiment != "ablate" else ""
        for spool, why in sorted(spools.items()):
            where = str(Path(spool).parent)
            lines.append(f"spooled:  {self.spooled} receipt(s) in {spool} ({self.offline_reason}"
                         f"{f'; not in {self.sweep_dir}: {why}' if why else ''}); replay with: "
                         f"ablate receipts sync {where}{into}")
        if self.fallbacks:
            homes = sorted({str(Path(where).parent) for _, where, _ in self.fallbacks})
            reasons = sorted({why for _, _, why in self.fallbacks})
            lines.append(f"error:    {len(self.fallbacks)} receipt(s) could not be written to {self.sweep_dir}/receipts "
                         f"({'; '.join(reasons)}); they are in {', '.join(homes)}")
            for home in homes:
                lines.append(f"next:     ablate receipts sync {Path(home).parent}{into}   (MLflow), and once "
                             f"{self.sweep_dir}/receipts takes writes again: mv {home}/*.json {self.sweep_dir}/receipts/")
        lines += [f"error:    receipt {rid} was not saved anywhere: {why}" for rid, why in self.unsaved]
        if self.unmirrored:
            # The local copy and MLflow hold them; a --resume from another machine pulls the storage, which lacks them.
            reasons = sorted({why for _, _, why in self.unmirrored})
            names = sorted(Path(path).name for _, path, _ in self.unmirrored)
            more = f" and {len(names) - 10} more" if len(names) > 10 else ""
            lines.append(f"error:    {len(names)} receipt(s) are in {self.sweep_dir}/receipts but not in storage "
                         f"{self.storage} ({'; '.join(reasons)}); copy them to {self.storage}/"
                         f"{Path(self.sweep_dir).name}/receipts/ before resuming this sweep on another machine: "
                         f"{' '.join(names[:10])}{more}")
        if self.caught_up:
            lines.append(f"note:     {self.caught_up} receipt(s) on disk the driver had not received (arms that "
                         f"finished as it stopped) were {'spooled' if self.spooled else 'logged to MLflow'} at the end")
        if self.fatal:
            lines.append(f"error:    {self.fatal}")
        if self.interrupted:
            left = self.blocks_total - self.blocks_done
            lines.append(f"interrupted: {left} block(s) not finished; every receipt written so far is in MLflow or "
                         f"the spool. Continue with: {self.resume_command or 'ablate sweep <campaign> --resume'}")
            lines.append(f"          (an arm still running elsewhere writes its receipt to {self.sweep_dir}/receipts: "
                         f"--resume, or ablate receipts sync {self.sweep_dir}{into}, logs it)")
        lines += [f"error:    block {block}: {message}" for block, message in sorted(self.errors.items())]
        if self.left_out:
            lines.append(f"left out: {len(self.left_out)} planned block(s) whose test was decided "
                         f"({self.judge_s:.1f}s of judging between blocks)")
        if not self.interrupted and not self.fatal and self.blocks_done and self.schedule == "fixed":
            lines += self._next_commands()
        return "\n".join(lines)

    def _next_commands(self) -> list[str]:
        experiment = f" --experiment {self.experiment}" if self.experiment != "ablate" else ""
        lines = [f"next:     ablate promote --tracking-uri {self.tracking_uri}{experiment} --sweep {self.campaign}   "
                 f"(verdicts; one machine: add --policy search_spaces/policies/single_node.yaml)",
                 f"          ablate sweep {self.campaign_file} again later for the next round (a promotion "
                 f"needs rounds that are separate in time)"]
        if self.tracking_uri.startswith("sqlite:"):
            lines.append(f"          mlflow ui --backend-store-uri {self.tracking_uri}   (then open "
                         f"http://127.0.0.1:5000 to compare the arms)")
        elif self.tracking_uri.startswith(("http://", "https://")):
            lines.append(f"          open {self.tracking_uri} to compare the arms in MLflow")
        return lines


def _run_arm_options(sweep: SweepConfig, layout: Layout, sweep_id: str) -> dict[str, Any]:
    """``trainers.run_arm`` keyword arguments: Train workers take exactly the campaign's per-worker resources
    (what resources.py accounted for), are pinned to the trial's node (the default), and keep their Train state on
    the sweep's (shared) storage. An arm is never relaunched inside its block (``max_failures`` 0): a relaunch
    numbers its receipt one attempt past its partner's, so the block would not pair and the crash would count
    nowhere; a dead arm keeps its failed receipt and Tune retries the whole block as the next attempt."""
    cpus, gpus = sweep.resources.cpus_per_worker, sweep.resources.gpus_per_worker
    return {"max_failures": 0, "use_gpu": gpus > 0,
            "resources_per_worker": {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})},
            "storage_path": f"{layout.storage}/_train/{layout.campaign}/{sweep_id}"}


def _file_hashes(campaign_file: Path, sweep: SweepConfig) -> dict[str, Optional[str]]:
    """Content hashes of the campaign and defaults files as this sweep used them (receipts record both)."""
    from trainers.provenance import file_sha256

    defaults = Path(sweep.defaults)
    if not defaults.is_absolute():
        defaults = campaign_file.parent / defaults
    # Taken right after load_sweep read both files, so a missing one here is a race worth a traceback.
    return {"campaign": file_sha256(campaign_file), "defaults": file_sha256(defaults)}


def _new_sweep_id(campaign: str) -> str:
    return f"{campaign}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def ensure_ray() -> bool:
    """Attach to the cluster named by ``RAY_ADDRESS`` (``ray job submit`` sets it; ``auto`` finds one started with
    ``ray start`` on this machine) or start a local runtime with the driver resources. True when this call started
    Ray (and the caller should shut it down)."""
    import ray

    if ray.is_initialized():
        drop_teardown_tracebacks()  # a caller's own ray.init (a notebook, a test) forwards worker output too
        return False
    # Ray's own INFO lines ("Started a local Ray instance") are not the user's business during a sweep; warnings
    # and errors still reach the console, and the full logs stay in the Ray session directory.
    quiet = {"logging_level": logging.WARNING}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**quiet)
    else:
        # "local": never attach by accident to some other `ray start` cluster found in /tmp/ray. PYTHONPATH: trial
        # processes import ablate and trainers from this checkout even when it is not pip-installed and the
        # driver runs from another directory.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        init = local_ray_init_kwargs()
        init["runtime_env"]["env_vars"]["PYTHONPATH"] = path
        # Ray's processes inherit the environment: only allowlisted variables, no secrets.
        with process_env_only(), prompt_node_wait() as wait:
            ray.init(address="local", include_dashboard=False, **init, **quiet)
        log.debug("%s", wait.line())
    drop_teardown_tracebacks()
    return True


def shutdown_ray() -> None:
    """``ray.shutdown()`` of what ``ensure_ray`` started or attached to, without Ray's one-second wait for the local
    runtime's autoscaler monitor: Ray stops it after the GCS, and on SIGTERM the monitor first reports its own
    death to the GCS that is gone, so Ray waits out its 1 s grace and SIGKILLs it (1.01 s of a 1.25 s shutdown,
    measured). Killed first, it reports nothing (a report would print "The autoscaler failed" on this driver). A
    driver attached to a cluster started no monitor: nothing is killed. Whatever Ray's internals look like, the
    shutdown itself still happens."""
    import ray

    try:
        from ray._private import ray_constants, worker

        node = worker._global_node
        for info in list((node.all_processes if node is not None else {}).get(ray_constants.PROCESS_TYPE_MONITOR,
                                                                               ())):
            info.process.kill()
            info.process.wait(timeout=5)
    except Exception as exc:  # noqa: BLE001 - another Ray layout: its own shutdown stops the monitor
        log.debug("autoscaler monitor not stopped ahead of ray.shutdown: %s", exc)
    ray.shutdown()


def _parent_params(sweep: SweepConfig, plan: SweepPlan, capacity: Capacity, campaign_file: Path) -> dict[str, Any]:
    params: dict[str, Any] = {"campaign_file": str(campaign_file), "design": plan.design, "blocks": sweep.blocks,
                              "aa_blocks": sweep.aa_blocks, "seed": sweep.seed, "max_failures": sweep.max_failures,
                              "num_blocks": len(plan.blocks), "max_concurrent_blocks": capacity.max_concurrent,
                              "executor": capacity.need.executor}
    params.update({f"resources.{k}": v.value if isinstance(v, Enum) else v
                   for k, v in asdict(sweep.resources).items()})
    params.update({f"features.{k}": json.dumps(v) for k, v in sweep.features.items()})
    params.update({f"lane.{k}": v for k, v in flatten(lane_to_dict(sweep.lane)).items()})
    return params


def _started_allocator(meta: Mapping[str, Any]) -> Optional[str]:
    """The host allocator policy a sweep's arms ran under, from its metadata: the params it started with, where
    a sweep from before ``resources.host_allocator`` existed ran the C library's defaults (``system``). None when
    the metadata has no params to tell."""
    params = meta.get("params")
    if not isinstance(params, Mapping):
        return None
    return str(params.get("resources.host_allocator", HostAllocator.system.value))


def _sweep_identity(path: Path, resume: bool, storage: Optional[str], device: Optional[str] = None,
                    sweep_id: Optional[str] = None
                    ) -> tuple[SweepConfig, Defaults, Layout, SweepPlan, dict[str, Any], str]:
    """The campaign, its defaults, where it lives, its plan, (resume) the metadata of the sweep being continued,
    and the device class the plan is for: ``device``, else the one a resumed sweep ran its lane on, else this
    machine's (``planned_device``; an ``auto`` lane's baselines depend on it)."""
    sweep, defaults = load_sweep(path, device=device)
    layout = Layout.for_campaign(sweep.name, storage or sweep.tracking.storage)
    meta: dict[str, Any] = {}
    if resume:
        layout.pull()
        latest = (layout.read(LATEST) or "").strip()
        meta = json.loads(layout.read(f"{SWEEPS_DIR}/{latest}.json") or "{}") if latest else {}
        if not meta:
            raise ConfigError("--resume", str(path), f"a campaign with an earlier sweep under {layout.local_dir} "
                                                     f"(none found: start it without --resume)")
        ran_on = meta.get("device")
        if device is not None and ran_on in DEVICE_CLASSES and ran_on != device:
            raise ConfigError("--resume", str(path), f"a cluster that runs the lane on {ran_on}, as sweep "
                                                     f"{meta.get('sweep_id')} did when it started (this one runs it "
                                                     f"on {device}): one round measures one device")
        if device is None and ran_on in DEVICE_CLASSES and ran_on != planned_device(sweep.lane):
            device = ran_on  # planned as it ran: on another machine than this one, perhaps
            sweep, defaults = load_sweep(path, device=device)
        started_under = _started_allocator(meta)
        if started_under is not None and started_under != sweep.resources.host_allocator.value:
            raise ConfigError("resources.host_allocator", sweep.resources.host_allocator.value,
                              f"{started_under!r}, the policy sweep {meta.get('sweep_id')} started its arms under: "
                              f"the allocator changes what a step costs, and one sweep measures under one policy "
                              f"(set it back to resume, or start a new sweep without --resume)")
    plan = plan_sweep(sweep, meta.get("sweep_id") or sweep_id or _new_sweep_id(layout.campaign), defaults,
                      orders_scheme=meta.get("orders", ORDERS_SHUFFLED) if resume else ORDERS_IN_PAIRS, device=device)
    if resume and meta.get("plan_fingerprint") != plan.fingerprint():
        if device is not None and meta.get("device") is None:
            raise ConfigError("--resume", str(path), f"a sweep that recorded the device it ran on: sweep "
                                                     f"{plan.sweep_id} did not (it started before sweeps recorded "
                                                     f"it), and planned for {device} its blocks differ; start a new "
                                                     f"sweep without --resume")
        raise ConfigError("--resume", str(path), f"the campaign as it was when sweep {plan.sweep_id} started (its "
                                                 f"blocks changed since; start a new sweep without --resume)")
    return sweep, defaults, layout, plan, meta, device or planned_device(sweep.lane)


def _check_auto_device(path: Path, sweep: SweepConfig, defaults: Defaults, cluster_gpus: float,
                       planned: Optional[str] = None) -> None:
    """Refuse a lane with ``hardware.device: auto`` that was planned for another device (``planned``, by default
    this machine's) than the cluster runs its arms on, when defaults.yaml gives that device other baselines (a lane
    override is won on one device class: ``ablate.config.lane_shape``). Before anything is written or run. A new
    sweep is planned again instead (``_planned_for_cluster``), and an ``--until-decided`` round is planned for the
    cluster's device from the start (``until_decided.arms_device``); this holds a round that cannot be: the resume
    of a sweep that did not record its device, and an ``--until-decided`` round run by another caller than
    ``run_until_decided``."""
    planned, resolved = planned or planned_device(sweep.lane), cluster_device(sweep.lane, cluster_gpus)
    if planned == resolved:
        return
    explicit = (read_yaml(path) or {}).get("lane") or {}
    there = apply_defaults(sweep.lane, defaults, explicit, device=resolved)
    moved = [f"{name}: {planned_value!r} planned, {value!r} on {resolved}"
             for name, planned_value, value in differing_features(sweep.lane, there)]
    if moved:
        raise ConfigError("lane.hardware.device", AUTO,
                          f"cpu or cuda written out: this machine plans the lane for {planned}, but the cluster "
                          f"runs its arms on {resolved}, where {defaults.path or 'defaults.yaml'} gives other "
                          f"baselines ({'; '.join(moved)}); a lane override holds on the device it was won on")


def _planned_for_cluster(path: Path, storage: Optional[str], sweep: SweepConfig, defaults: Defaults,
                         plan: SweepPlan, planned: str, ran_on: str, hashes: dict[str, Optional[str]]
                         ) -> tuple[SweepConfig, Defaults, SweepPlan]:
    """A new sweep of an ``auto`` lane planned for this machine's device, planned again for the one the cluster runs
    its arms on (a head node without a GPU in front of GPU workers): a lane override holds on the device it was won
    on (``ablate.config.lane_shape``), so the arms get that device's baselines. Same sweep id; before anything is
    written or run. Says so when a baseline changes. The files are read again: refused when they changed since
    the first read (``hashes``; the sweep may have waited for another one's lock), as one sweep reads one campaign."""
    if sweep.lane.hardware.device.value != AUTO or planned == ran_on:
        return sweep, defaults, plan
    again, defaults, _, replanned, _, _ = _sweep_identity(path, False, storage, device=ran_on, sweep_id=plan.sweep_id)
    if _file_hashes(path, again) != hashes:
        raise ConfigError(str(path), "changed since this sweep read it",
                          "the campaign and its defaults file as they were when the sweep started (it read them "
                          "again to plan for the cluster's device, after Ray started); run the sweep again")
    moved = [f"{name}: {before!r} -> {after!r}" for name, before, after in differing_features(sweep.lane, again.lane)]
    if moved:
        log.warning("this machine planned the lane (hardware.device: auto) for %s, but the cluster runs its arms on "
                    "%s: planned again with the baselines %s gives %s (%s)", planned, ran_on,
                    defaults.path or "defaults.yaml", ran_on, "; ".join(moved))
    return again, defaults, replanned


def _targets_record(placement: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {block: {"host": target.host, "node_id": target.node_id, "first": target.first}
            for block, target in placement.items()}


def _aa_turn(layout: Layout, sweep_id: str, meta: Mapping[str, Any]) -> int:
    """How far this sweep moves every lane's A/A deal on (``ablate.sweep.placement.aa_targets``): one node per
    earlier sweep of the campaign, so its rounds' first A/A blocks visit every node; a resumed sweep keeps its own."""
    if "aa_turn" in meta:
        return int(meta["aa_turn"])
    directory = layout.local_dir / SWEEPS_DIR
    return sum(1 for path in directory.glob("*.json") if path.stem != sweep_id) if directory.is_dir() else 0


def _tune_can_restore(tune_path: str) -> bool:
    from ray import tune

    return bool(tune.Tuner.can_restore(tune_path))


def _tuner(trainable: Any, sweep: SweepConfig, layout: Layout, plan: SweepPlan, capacity: Capacity,
           restore: bool, searcher: Any = None) -> Any:
    """``restore``: a resume whose Tune state can be restored (checked once, by the caller, which also decides
    whether a fresh searcher is needed)."""
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    tune_path = layout.tune_path(plan.sweep_id)
    if restore:
        # A searcher comes back from the experiment state with the blocks it had handed out.
        return tune.Tuner.restore(tune_path, trainable, resume_unfinished=True, resume_errored=True)
    # Fixed campaign: every planned block, as a grid. --until-decided: the searcher picks them one by one (at
    # most all of them), leaving out blocks whose test is decided.
    space = {} if searcher is not None else {"block_id": tune.grid_search([b.block_id for b in plan.blocks])}
    return tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(max_concurrent_trials=capacity.max_concurrent, reuse_actors=True,
                                    search_alg=searcher, num_samples=len(plan.blocks) if searcher is not None else 1,
                                    trial_name_creator=trial_name, trial_dirname_creator=trial_dirname),
        run_config=tune.RunConfig(
            name=plan.sweep_id, storage_path=layout.tune_root, verbose=0,
            failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
            # No num_to_keep: with it, every trial checkpoint (one per block attempt, the attempt marker) forces an
            # experiment-state snapshot, which warns "snapshotting has been triggered multiple times" on every
            # block and costs the driver a sync per block. Retries restore from the trial's own latest checkpoint
            # and --resume reads the receipts, so the periodic snapshot is all a sweep needs.
            checkpoint_config=tune.CheckpointConfig(),
            # Tune's JSON and CSV result logs, without its TensorBoard one (``_TUNE_ENV`` stops Tune adding it):
            # ablate's results are read in MLflow, and tensorboardX imports torch into the driver (~2 s of every
            # sweep's start on a 2-core host) to write event files nobody opens.
            callbacks=[_Relay(plan.sweep_id), JsonLoggerCallback(), CSVLoggerCallback()]))


class _BacklogWaitLines(logging.Filter):
    """On ``ray.tune.utils.util``'s logger while ``fit()`` runs: drops Tune's "operation took 0.7 s, which may be a
    performance bottleneck" lines about the result hook that has just waited for the MLflow writer on purpose
    (``MAX_TRACKING_BACKLOG``); any other slow operation is still reported."""

    _LINES = ("`callbacks.on_trial_result` operation", "`process_trial_result` operation",
              "Processing trial results took")

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def filter(self, record: logging.LogRecord) -> bool:
        just_waited = time.monotonic() - self.recorder.waited_at < 0.25
        return not (just_waited and any(line in record.getMessage() for line in self._LINES))


class _TuneInterrupted(logging.Filter):
    """On ``ray.tune.tune``'s logger while ``fit()`` runs: notes that Tune was interrupted (SIGINT) and drops its
    "Resume experiment with: Tuner.restore(...)" hint, which is not how an ablate sweep resumes (the summary
    names ``ablate sweep ... --resume``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "has been interrupted" in message or "Tuner.restore" in message:
            self.seen = True
            return False
        return True


_CHATTY_LOGGERS = ("ray.tune", "ray.train", "mlflow")
_TUNE_ENV = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1"}
"""Read by Tune in the driver while ``fit()`` runs: its legacy console (which honours ``verbose=0``), and no result
loggers beyond the ones ``_tuner`` names."""


def _open_tracking(store: MlflowStore, *args: Any, **kwargs: Any) -> None:
    """``store.open_sweep`` on the writer thread, MLflow's import included (1-2 s on 2 CPUs, whose first import
    sets the "mlflow" logger to INFO: it is quietened again here, as ``_quiet_libraries`` does)."""
    try:
        import mlflow  # noqa: F401
    except Exception:  # noqa: BLE001 - open_sweep's own import fails the same way: it names why and spools
        pass
    finally:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    store.open_sweep(*args, **kwargs)


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """One progress display and one summary: Ray Tune's own console (the experiment box, result paths, a
    TensorBoard hint, INFO lines) and MLflow's INFO lines stay out of it. The legacy reporter honours
    ``verbose=0`` (the new one still prints its box), so it is selected for this call (``_TUNE_ENV``); warnings still
    print. MLflow is imported later, by the writer thread that opens the sweep (``_open_tracking``): off the
    first block's path."""
    saved_env = {name: os.environ.get(name) for name in _TUNE_ENV}
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    os.environ.update(_TUNE_ENV)
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_DISK_FAULTS = ("No space left on device", "database or disk is full", "Read-only file system", "Disk quota exceeded")
_NOISY_LOGGERS = ("ray.tune.execution.tune_controller", "ray.tune.execution.experiment_state", "ray.train",
                  "mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor", "mlflow.tracking")


class _DiskFaultLines(logging.Filter):
    """A full or read-only disk makes Ray Tune and MLflow log a traceback per failed write (trial checkpoints,
    Tune's state, every SQLite insert): a cascade that buries the one thing to act on. While a sweep runs, such a
    record becomes one line, its first, plus the fault; the summary then says where the receipts are."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += "\n" + str(record.exc_info[1])
        fault = next((f for f in _DISK_FAULTS if f in text), None)
        if fault is not None:
            first = text.strip().splitlines()[0] if text.strip() else ""
            record.msg, record.args = f"{first[:300]} ({fault})", None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class _ArmFailureLines(logging.Filter):
    """Tune logs a block whose arm failed (``ArmFailed``, raised by the trial after both arms ran) with the
    traceback of that raise: Ray's and Tune's frames around one line of ours. During a sweep such a record becomes
    one line: each failed arm's first and last line (``ArmFailed.brief``); the whole failure, worker tracebacks
    included, is in the arm's receipt and log, and the summary names the block."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            from ablate.sweep.trial import ArmFailed

            exc = record.exc_info[1] if record.exc_info else None
            if not isinstance(exc, ArmFailed):
                return True
            raised = getattr(exc, "cause", exc)  # Ray's RayTaskError(ArmFailed) keeps the raised one there
            record.msg, record.args = f"{record.getMessage()}: {raised.brief}", None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        except Exception:  # noqa: BLE001 - a filter that raises would end Tune's failure handling: keep the record
            pass
        return True


@contextlib.contextmanager
def _faults_in_one_line() -> Iterator[None]:
    quiet, arms = _DiskFaultLines(), _ArmFailureLines()
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
        logger.addFilter(arms)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
            logger.removeFilter(arms)


def _found_in_fallback(campaign: str, sweep_id: str, known: set[str], recorder: _Recorder) -> list[Receipt]:
    """This sweep's receipts that arms wrote to a fallback directory and the driver never received (it stopped
    listening, or Tune could not hand them over): they join the summary's fallbacks and the catch-up."""
    found = []
    for home in fallback_dirs(campaign):
        for receipt in load_receipts(home / RECEIPTS_DIR)[0] if (home / RECEIPTS_DIR).is_dir() else []:
            rid = receipt.identity.receipt_id
            if receipt.identity.sweep_id == sweep_id and rid not in known:
                known.add(rid)
                found.append(receipt)
                recorder.fallbacks.append((rid, str(home / RECEIPTS_DIR / f"{rid}.json"),
                                           "written there by its arm; the driver never received it"))
    return found


def sweep_arms(campaign_dir: Path, sweep_id: str,
               known: Callable[[str], bool]) -> tuple[list[ArmOutline], list[Receipt]]:
    """(outlines of every receipt of the sweep on disk, the receipts among them ``known`` does not know): the files
    are the truth at a sweep's end, held as outlines (2,000 whole receipts were ~130 MB of the driver); only those
    the store neither logged nor spooled stay whole, for the catch-up that writes them. A receipt whose copies
    differ is refused by the scan after its first copy was seen: it is caught up nowhere (found in review: that
    copy was logged to MLflow, where promotion would read it)."""
    unlogged: list[Receipt] = []

    def keep(receipt: Receipt) -> ArmOutline:
        if receipt.identity.sweep_id == sweep_id and not known(receipt.identity.receipt_id):
            unlogged.append(receipt)
        return outline(receipt)

    kept = scan_receipts([campaign_dir], keep)[0]
    return ([arm for arm in kept.values() if arm.sweep_id == sweep_id],
            [r for r in unlogged if r.identity.receipt_id in kept])


def _catch_up(store: MlflowStore, on_disk: list[Receipt]) -> int:
    """Log (or spool) this sweep's receipts on disk that the store has neither logged nor spooled: arms that wrote
    their receipt while the driver was no longer listening (Ctrl+C). Returns how many."""
    missing = [r for r in on_disk if not store.has(r.identity.receipt_id)]
    for receipt in missing:
        store.log_receipt(receipt)
    return len(missing)


def run_sweep(path: str | Path, *, resume: bool = False, tracking_uri: Optional[str] = None,
              storage: Optional[str] = None, progress: bool = True,
              inject: Optional[Mapping[str, dict[str, Any]]] = None, lock_wait_s: float = 0.0,
              searcher_factory: Optional[Callable[[SweepPlan], Any]] = None,
              resume_flags: tuple[str, ...] = (), simulate_arms: bool = False,
              device: Optional[str] = None, device_why: str = "where the value it re-tests was won") -> SweepSummary:
    """Run (or, with ``resume``, continue) the campaign in ``path``; see the module docstring.

    ``searcher_factory``: plan -> a Tune ``Searcher`` that chooses which planned blocks run (``--until-decided``,
    ``ablate.sweep.until_decided``); None runs every planned block. ``resume_flags``: what the printed
    ``--resume`` command must repeat (``--until-decided --policy ...``). A sweep is resumed the way it started:
    an ``--until-decided`` round only with a searcher, whose receipts keep saying ``until_decided``.

    ``lock_wait_s``: how long to wait for another sweep of the campaign to end (``math.inf``: until it does)
    before refusing with ``SweepLocked``. ``inject`` is for tests only: block id -> fault injection for the first
    arm of that block's first attempt.

    ``simulate_arms`` is for tests and benchmarks only (no CLI flag, campaign key or environment variable sets
    it): every arm is a no-op (``trainers.simulate``) whose receipt says ``executor: simulated``, which promotion
    refuses, so the orchestration (Tune, recorder, disk, MLflow) can be measured alone.

    ``device`` (``cpu``, ``cuda``): the device class the arms must run on, and the plan is for; a cluster that runs
    the lane elsewhere is refused before anything is written, the refusal saying why the device is that one
    (``device_why``: a re-test measures the value on the device it was won on; every ``--until-decided`` round of
    one invocation on the device it planned for).
    """
    started = time.monotonic()
    path = Path(path)
    sweep, defaults, layout, plan, meta, planned = _sweep_identity(path, resume, storage, device)
    hashes = _file_hashes(path, sweep)  # before the lock: a wait for another sweep may last hours
    started_as = (meta.get("params") or {}).get("schedule", "fixed")
    if resume and started_as == "until_decided" and searcher_factory is None:
        # Tune would restore the round's searcher anyway; without the flag its receipts would claim a fixed
        # schedule, and the fixed rule would then judge sequentially stopped evidence.
        raise ConfigError("--resume", str(path), f"the flags sweep {plan.sweep_id} started with: it is an "
                                                 f"--until-decided round (ablate sweep {path} --until-decided "
                                                 f"--policy <its policy> --resume)")
    sweep_id = plan.sweep_id
    uri = resolve_tracking_uri(tracking_uri or sweep.tracking.uri)
    check_sqlite_store(uri)  # a damaged embedded store: refused before anything runs (TrackingStoreError)
    lock = SweepLock(layout.local_dir).acquire(sweep_id, wait_s=lock_wait_s, on_wait=log.warning)
    if lock.stale:
        log.warning("took over the lock of %s: that driver is gone (killed?); `ablate sweep %s --resume` continues "
                    "a sweep it left unfinished", SweepLock.describe(lock.stale), path)
    resume_command = " ".join(["ablate sweep", str(path), *resume_flags, "--resume"]
                              + (["--storage", storage] if storage else [])
                              + (["--tracking-uri", shown(uri)] if tracking_uri else []))
    try:
        with _faults_in_one_line(), _quiet_libraries():
            return _run_locked(path, sweep, layout, plan, meta, uri, defaults=defaults, device=device,
                               device_why=device_why, planned=planned,
                               hashes=hashes, storage=storage, resume=resume,
                               progress=progress, inject=inject, started=started, resume_command=resume_command,
                               searcher_factory=searcher_factory, simulate_arms=simulate_arms)
    finally:
        lock.release()


def _run_locked(path: Path, sweep: SweepConfig, layout: Layout, plan: SweepPlan, meta: dict[str, Any], uri: str, *,
                defaults: Defaults, device: Optional[str], device_why: str, planned: str,
                hashes: dict[str, Optional[str]],
                storage: Optional[str], resume: bool, progress: bool,
                inject: Optional[Mapping[str, dict[str, Any]]], started: float, resume_command: str,
                searcher_factory: Optional[Callable[[SweepPlan], Any]] = None,
                simulate_arms: bool = False) -> SweepSummary:
    import ray
    from ray import tune

    from ablate.sweep.progress import SweepProgress

    sweep_id = plan.sweep_id
    # A local runtime's arms fork from this machine's server: it starts now, its imports overlapping ray.init's waits.
    try:
        early = None if simulate_arms else start_local_fork_server(block_need(plan.blocks, sweep.resources))
    except ConfigError:  # refused below, with the reason
        early = None
    started_ray = ensure_ray()
    store: Optional[MlflowStore] = None
    recorder: Optional[_Recorder] = None
    try:
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        ran_on = cluster_device(sweep.lane, cluster_gpus)
        if device and ran_on != device:
            raise ConfigError("lane.hardware.device", sweep.lane.hardware.device.value,
                              f"a lane this cluster runs on {device}, {device_why} (this cluster runs it on "
                              f"{ran_on})")
        if resume and meta.get("device") not in (None, ran_on):
            raise ConfigError("--resume", str(path), f"a cluster that runs the lane on {meta['device']}, as sweep "
                                                     f"{sweep_id} did when it started (this one runs it on {ran_on}): "
                                                     f"one round measures one device")
        if resume or searcher_factory is not None:
            _check_auto_device(path, sweep, defaults, cluster_gpus, planned)
        else:
            sweep, defaults, plan = _planned_for_cluster(path, storage, sweep, defaults, plan, planned, ran_on, hashes)
        sweep.resources = gpu_resources(sweep.lane, sweep.resources, cluster_gpus)
        need = block_need(plan.blocks, sweep.resources)
        capacity = check_cluster(need, campaign=sweep.name, max_concurrent_blocks=sweep.resources.max_concurrent_blocks,
                                 num_blocks=len(plan.blocks))
        # Before any block and before anything is written: a backend a node found wrong or absent refuses here.
        node_checks = check_plan(plan, sweep.node_check)
        # The cluster and the nodes' checks are accepted: each node's fork server starts while the rest is set up
        # and Tune starts the trials (a sweep that fails after this point leaves it to idle out on its own). A local
        # runtime's started before Ray (``early``), before these checks: a refused sweep leaves that one idling too.
        head_starts = [] if simulate_arms or early is not None else start_fork_servers(capacity)
        params = _parent_params(sweep, plan, capacity, path)
        # A resumed sweep keeps the schedule it started with (Tune restores its grid or its searcher).
        started_as = (meta.get("params") or {}).get("schedule", "fixed")
        params["schedule"] = started_as if resume else ("until_decided" if searcher_factory is not None else "fixed")
        if simulate_arms:
            params["arms"] = "simulated"  # the parent run says so too; its receipts are refused by promotion
        # A resumed --until-decided round gets its searcher back from Tune's state; a round interrupted before
        # Tune saved any (Ctrl+C while Ray started or the sweep was set up) gets a fresh one: without it the resume
        # ran every planned block as a grid, decided tests included (found in review).
        restorable = resume and _tune_can_restore(layout.tune_path(sweep_id))
        # A/A blocks first, one on each host: the rule calibrates a test only on its own hosts' A/A blocks. Only
        # the order Tune gets and where those blocks ask to run change; the plan (and its fingerprint) does not.
        turn = _aa_turn(layout, sweep_id, meta if resume else {})
        aa_placement = aa_targets(plan.blocks, capacity.nodes, turn)
        dispatch = replace(plan, blocks=dispatch_order(plan.blocks, aa_placement))
        for line in coverage_warnings(plan.blocks, capacity.nodes, aa_placement):
            log.warning("%s", line)
        searcher = searcher_factory(dispatch) if searcher_factory is not None and not restorable else None
        if not resume:
            meta = {"sweep_id": sweep_id, "campaign": sweep.name, "campaign_file": str(path.resolve()),
                    "experiment": sweep.tracking.experiment, "tracking_uri": shown(uri),
                    "tune_path": layout.tune_path(sweep_id), "plan_fingerprint": plan.fingerprint(),
                    "orders": ORDERS_IN_PAIRS,
                    "blocks": [b.label() for b in plan.blocks], "skipped": plan.skipped,
                    "created_at": datetime.now(timezone.utc).isoformat(), "params": params,
                    "node_checks": node_checks, "device": ran_on,
                    "aa_turn": turn, "aa_targets": _targets_record(aa_placement)}
            layout.write(f"{SWEEPS_DIR}/{sweep_id}.json", json.dumps(meta, indent=2, default=str))
            layout.write(LATEST, sweep_id + "\n")
        else:
            # A resume deals the A/A blocks again over the nodes up now (one may have gone or come): the record
            # keeps what each run of the sweep asked for, the first one's under "aa_targets".
            meta = {**meta, "resumes": [*meta.get("resumes", []),
                                        {"at": datetime.now(timezone.utc).isoformat(),
                                         "aa_targets": _targets_record(aa_placement)}]}
            layout.write(f"{SWEEPS_DIR}/{sweep_id}.json", json.dumps(meta, indent=2, default=str))
        store = MlflowStore(uri, sweep.tracking.experiment, layout.local_dir)
        for what, why in plan.skipped:
            log.warning("not run: %s: %s", what, why)
        recorder = _Recorder(layout, store, start_clock(sweep_id))
        parent_tags = {"ablate.lane_keys": ",".join(plan.lane_keys()), "ablate.design": plan.design,
                       "ablate.storage": shown(layout.storage),
                       # What the plan refused before any arm ran: promotion reports list it.
                       SKIPPED_TAG: json.dumps([[w, r] for w, r in plan.skipped])[:MAX_TAG_CHARS],
                       NODE_CHECK_TAG: json.dumps(node_checks)[:MAX_TAG_CHARS]}
        # Off the main thread: Tune starts the first trials meanwhile. os.environ is whole again by now
        # (``ensure_ray`` scrubs it only inside ``ray.init``), so MLflow sees the driver's own settings.
        recorder.open_tracking(partial(_open_tracking, store, sweep_id, sweep.name, params, tags=parent_tags))
        if resume:  # under the lock: no other driver writes here
            for leftover, action in settle_unfinished_writes(layout.receipts_dir):
                log.info("%s: a receipt write a killed process never finished: %s", leftover.name, action)
        # What the killed driver's sweep already measured, including receipts a full disk sent to a fallback
        # directory: those blocks are complete (found in review: they reran, under the same receipt ids).
        earlier = ([r for r in with_fallbacks(layout.local_dir, sweep.name) if r.identity.sweep_id == sweep_id]
                   if resume else [])
        # Receipts a killed driver wrote (or spooled) but never logged: MLflow catches up before new work (the
        # writer logs in the order taken; one it finds logged already costs no write).
        recorder.catch_up(earlier)
        recorder.mirror_missing(earlier)
        completed, next_attempt = block_progress(earlier, sweep_id)
        if resume:
            attempts = max(next_attempt.values(), default=0) + sweep.max_failures + 2
            for rid in clear_interrupted_scratch(layout.receipts_dir, sweep_id, [b.block_id for b in plan.blocks],
                                                 attempts):
                log.info("removed the scratch of arm %s: the killed driver's attempt never wrote its receipt", rid)
        expected = searcher.expected_blocks() if searcher is not None else len(plan.blocks)
        display = SweepProgress(expected, title=sweep_id, live=None if progress else False)
        _LIVE[sweep_id] = [recorder] + ([display] if progress else [])
        context = {"sweep_id": sweep_id, "campaign": sweep.name, "receipt_dir": layout.trial_receipt_dir(),
                   "blocks": ray.put({b.block_id: b.to_dict() for b in plan.blocks}),  # read: trial.plan_blocks
                   "inject": dict(inject or {}),
                   "completed": completed, "next_attempt": next_attempt, "hashes": hashes,
                   "block_mode": sweep.block_mode.value, "node_check_path": sweep.node_check.path,
                   "schedule": params["schedule"], "device": ran_on,
                   "host_allocator": sweep.resources.host_allocator.value,
                   "run_arm": _run_arm_options(sweep, layout, sweep_id), "simulate_arms": simulate_arms is True}
        trainable = tune.with_resources(tune.with_parameters(run_block, context=context),
                                        TrialResources(need.trial_resources(), aa_placement) if aa_placement
                                        else need.trial_resources())
        interrupted = _TuneInterrupted()
        tune_log = logging.getLogger("ray.tune.tune")
        tune_log.addFilter(interrupted)
        slow_log, waited = logging.getLogger("ray.tune.utils.util"), _BacklogWaitLines(recorder)
        slow_log.addFilter(waited)
        grid: Any = None
        fatal: Optional[str] = None
        try:
            # Tune would copy AWS_* keys into every trial's logged runtime env, and leave its Ctrl+C handler behind.
            with tune_env_filter(), tune_signal_handlers_restored():
                grid = _tuner(trainable, sweep, layout, dispatch, capacity, restorable, searcher).fit()
        except KeyboardInterrupt:  # a second Ctrl+C: Tune skipped its last save; still account for every receipt
            interrupted.seen = True
        except Exception as exc:  # noqa: BLE001 - e.g. Tune cannot save its state on a full disk: a line, then the
            # receipts are accounted for as after any other end (the traceback is kept at debug level)
            fatal = f"Ray Tune stopped: {_told(exc, 500)}"
            log.debug("Ray Tune stopped", exc_info=True)
        finally:
            tune_log.removeFilter(interrupted)
            slow_log.removeFilter(waited)
            log_fork_servers(head_starts, early)
            _LIVE.pop(sweep_id, None)
            display.close()
            recorder.flush()
            if recorder.clock is not None:
                recorder.clock.close()
        # After SIGINT, Tune ends the trials it stopped TERMINATED without an error, like finished ones (and never
        # calls on_trial_complete for them). A block is done only when its receipts show a complete attempt (both
        # arms, none failed) and its trial, if it ran in this session, completed (as SweepProgress counts).
        stopped = {block for block, entry in recorder.timeline.items() if "trial_started_at" in entry
                   and "trial_ended_at" not in entry and "trial_errored_at" not in entry}
        if (interrupted.seen or stopped or fatal) and started_ray:
            # Stop the trials for good before looking at the disk: an arm of a Ray started here can then no longer
            # write a receipt after the catch-up below (on a cluster, --resume or `receipts sync` picks those up).
            flush_held()
            shutdown_ray()
        results = list(grid) if grid is not None else []
        unmirrored = recorder.mirror_again()
        errors = {(r.config or {}).get("block_id", Path(r.path).name): str(r.error).splitlines()[0]
                  for r in results if r.error}
        if grid is None:  # Tune stopped before handing back its results: the driver's own timeline says which erred
            errors = {block: "its trial errored (Ray Tune's results could not be read back)"
                      for block, entry in recorder.timeline.items() if "trial_errored_at" in entry}
        mine = recorder.received
        arms, unlogged = sweep_arms(layout.local_dir, sweep_id, store.has)
        seen = {arm.receipt_id for arm in arms}
        elsewhere = [r for r in recorder.off_campaign if r.identity.receipt_id not in seen]  # in a fallback dir
        seen |= {r.identity.receipt_id for r in elsewhere}
        elsewhere += _found_in_fallback(sweep.name, sweep_id, seen, recorder)
        arms += [outline(r) for r in elsewhere]
        caught_up = _catch_up(store, unlogged + elsewhere)
        finished = set(block_progress(arms, sweep_id)[0]) - stopped
        store.close_sweep(sweep_id, arms, failed=bool(errors) or fatal is not None)
        total, left_out = len(plan.blocks), {}
        if params["schedule"] == "until_decided":
            # The round's blocks are those the searcher handed out; the rest were left out as decided.
            ran = {(r.config or {}).get("block_id") for r in results} | set(recorder.timeline) | set(finished)
            total = len([b for b in plan.blocks if b.block_id in ran])
            reasons = searcher.skipped if searcher is not None else {}
            left_out = {b.block_id: reasons.get(b.block_id, "its test was decided") for b in plan.blocks
                        if b.block_id not in ran}
        return SweepSummary(
            sweep_id=sweep_id, campaign=sweep.name, sweep_dir=str(layout.local_dir),
            tune_path=layout.tune_path(sweep_id), tracking_uri=shown(uri), experiment=sweep.tracking.experiment,
            parent_run_id=store.parent_run_id, resumed=resume,
            executor=SIMULATED_EXECUTOR if simulate_arms else need.executor,
            max_concurrent=capacity.max_concurrent, blocks_total=total, left_out=left_out,
            schedule=params["schedule"], judge_s=getattr(searcher, "judge_s", 0.0),
            blocks_done=sum(1 for r in results if r.error is None and (r.config or {}).get("block_id") in finished),
            blocks_errored=len(errors), arms_logged=len(mine),
            arms_failed=sum(status is Status.failed for _, status in mine),
            arms_disqualified=sum(status is Status.disqualified for _, status in mine),
            spooled=store.spooled, offline_reason=store.offline_reason, elapsed_s=time.monotonic() - started,
            receipt_ids=[rid for rid, _ in mine], timeline=recorder.timeline, errors=errors,
            resume_command=resume_command, campaign_file=str(path), interrupted=interrupted.seen or bool(stopped), caught_up=caught_up,
            fallbacks=recorder.fallbacks, unsaved=recorder.unsaved, unmirrored=unmirrored,
            storage=redact_uri(layout.storage), spools=dict(store.spool_paths), fatal=fatal)
    finally:
        try:
            if recorder is not None:
                recorder.flush()  # the writer may still be opening the sweep, which starts the monitor stopped next
        finally:
            try:
                if store is not None:
                    store.stop_monitor()  # interrupted or not: the parent run stays resumable, the sampler thread ends
            finally:
                flush_held()
                if started_ray:
                    shutdown_ray()
