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
   (or the spool); ``SweepProgress`` draws the progress line. Both hang off one picklable relay callback, because
   Tune pickles its callbacks into the experiment and ``Tuner.restore`` would otherwise bring back stale ones.
5. ``--resume``: ``Tuner.restore`` of the sweep named in ``LATEST``. Finished blocks are not rerun, including
   blocks whose receipts exist although the killed driver never saved Tune's state after them; unfinished and
   errored blocks continue as a new attempt.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional

from ray.tune import Callback

from ablate.config.load import flatten, lane_to_dict, load_sweep
from ablate.config.schema import ConfigError, SweepConfig
from ablate.receipts.schema import InvalidReceipt, Receipt, Status, validate_receipt
from ablate.receipts.store import SPOOL_FILE, write_receipt
from ablate.sweep.layout import LATEST, Layout
from ablate.sweep.plan import SweepPlan, plan_sweep
from ablate.sweep.resources import Capacity, block_need, check_cluster, gpu_resources, local_ray_init_kwargs
from ablate.sweep.trial import (block_progress, clear_interrupted_scratch, run_block, start_clock, trial_dirname,
                                trial_name)
from ablate.tracking.mlflow_store import MAX_TAG_CHARS, SKIPPED_TAG, SWEEPS_DIR, MlflowStore, gather
from ablate.tracking.uri import resolve_tracking_uri, shown

log = logging.getLogger(__name__)

_LIVE: dict[str, list[Any]] = {}
"""sweep id -> the live driver callbacks of the current session (see ``_Relay``)."""


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

    def on_trial_complete(self, **info: Any) -> None:
        self._each("on_trial_complete", **info)

    def on_trial_error(self, **info: Any) -> None:
        self._each("on_trial_error", **info)

    def on_trial_recover(self, **info: Any) -> None:
        self._each("on_trial_recover", **info)

    def on_experiment_end(self, **info: Any) -> None:
        self._each("on_experiment_end", **info)


class _Recorder(Callback):
    """Driver-side sink: receipt -> campaign dir (+ mirror) -> MLflow or spool; keeps the block timeline.
    Lives only in ``_LIVE`` (never pickled); the other Tune hooks keep Callback's no-op defaults."""

    def __init__(self, layout: Layout, store: Any, clock: Any = None) -> None:
        self.layout, self.store, self.clock = layout, store, clock
        self.receipts: list[Receipt] = []
        self.rejected: list[tuple[str, str]] = []
        self.timeline: dict[str, dict[str, Any]] = {}
        # One writer thread: MLflow calls (0.5-1 s per arm on 2 cores) stay off Tune's event loop, and SQLite
        # still sees a single writer. The receipt file is written synchronously before anything is queued.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ablate-mlflow")

    def _track(self, receipt: Receipt) -> None:
        try:
            if self.store.log_receipt(receipt) is None:
                self.layout.publish(self.layout.local_dir / SPOOL_FILE)
        except Exception:  # noqa: BLE001 - a worker-thread error would vanish silently; the receipt file exists
            log.exception("receipt %s: tracking failed; it is on disk, `ablate receipts sync` replays it",
                          receipt.identity.receipt_id)

    def flush(self) -> None:
        """Wait until every queued receipt is in MLflow or the spool."""
        self._writer.shutdown(wait=True)

    def on_trial_start(self, trial: Any, **info: Any) -> None:
        now = time.time()
        entry = self.timeline.setdefault(trial.config["block_id"], {"arms": []})
        entry.setdefault("trial_started_at", now)
        if self.clock is not None:
            # The block's first arm is billed queue wait from here (the driver handing the block to Ray).
            self.clock.stamp.remote(trial.config["block_id"], now)

    def on_trial_result(self, trial: Any, result: dict[str, Any], **info: Any) -> None:
        entry = self.timeline.setdefault(result.get("block_id", trial.config["block_id"]), {"arms": []})
        if result.get("event") == "block_started":
            entry.update(started_at=result["at"], node_id=result["node_id"], host=result["host"],
                         attempt=result["attempt"])
            return
        if result.get("event") != "arm":
            return
        try:
            receipt = validate_receipt(json.loads(result["receipt"]))
        except (InvalidReceipt, json.JSONDecodeError) as exc:
            where = f"{trial.config['block_id']}-{result.get('arm_index')}-attempt{result.get('attempt')}"
            self.rejected.append((where, str(exc)))
            log.error("block %s: arm %s sent an invalid receipt (kept in rejected/): %s", trial.config["block_id"],
                      result.get("arm"), exc)
            # Kept verbatim for forensics; never a receipt (promotion and sync read receipts/ only).
            self.layout.write(f"rejected/{where}.json.txt", result["receipt"])
            return
        self.receipts.append(receipt)
        entry["arms"].append({k: result[k] for k in ("arm", "order", "attempt", "status", "scheduled_at",
                                                      "ended_at", "node_id", "host")}
                             | {"receipt_id": receipt.identity.receipt_id,
                                "time_to_first_step_s": receipt.steps.time_to_first_step_s,
                                "wall_s": receipt.time.wall_s})
        self.layout.publish(write_receipt(receipt, self.layout.receipts_dir))
        self._writer.submit(self._track, receipt)

    def on_trial_complete(self, trial: Any, **info: Any) -> None:
        self.timeline.setdefault(trial.config["block_id"], {"arms": []})["trial_ended_at"] = time.time()

    def on_trial_error(self, trial: Any, **info: Any) -> None:
        self.timeline.setdefault(trial.config["block_id"], {"arms": []})["trial_errored_at"] = time.time()


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

    @property
    def exit_code(self) -> int:
        return 1 if self.blocks_errored or self.blocks_done < self.blocks_total else 0

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
        if self.spooled:
            lines.append(f"spooled:  {self.spooled} receipt(s) in {self.sweep_dir}/{SPOOL_FILE} "
                         f"({self.offline_reason}); replay with: ablate receipts sync {self.sweep_dir}")
        lines += [f"error:    block {block}: {message}" for block, message in sorted(self.errors.items())]
        return "\n".join(lines)


def _run_arm_options(sweep: SweepConfig, layout: Layout, sweep_id: str) -> dict[str, Any]:
    """``trainers.run_arm`` keyword arguments: Train workers take exactly the campaign's per-worker resources
    (what resources.py accounted for), are pinned to the trial's node (the default), restart as often as the
    campaign allows, and keep their Train state on the sweep's (shared) storage."""
    cpus, gpus = sweep.resources.cpus_per_worker, sweep.resources.gpus_per_worker
    return {"max_failures": sweep.max_failures, "use_gpu": gpus > 0,
            "resources_per_worker": {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})},
            "storage_path": f"{layout.storage}/_train/{layout.campaign}/{sweep_id}"}


def _file_hashes(campaign_file: Path, sweep: SweepConfig) -> dict[str, Optional[str]]:
    """Content hashes of the campaign and defaults files as this sweep used them (receipts record both)."""
    from trainers.provenance import file_sha256

    defaults = Path(sweep.defaults)
    if not defaults.is_absolute():
        defaults = campaign_file.parent / defaults
    # load_sweep has just read both files, so a missing one here is a race worth a traceback.
    return {"campaign": file_sha256(campaign_file), "defaults": file_sha256(defaults)}


def _new_sweep_id(campaign: str) -> str:
    return f"{campaign}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def ensure_ray() -> bool:
    """Attach to the cluster named by ``RAY_ADDRESS`` (``ray job submit`` sets it; ``auto`` finds one started with
    ``ray start`` on this machine) or start a local runtime with the driver resources. True when this call started
    Ray (and the caller should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        # "local": never attach by accident to some other `ray start` cluster found in /tmp/ray. PYTHONPATH: trial
        # processes import ablate and trainers from this checkout even when it is not pip-installed and the
        # driver runs from another directory.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        init = local_ray_init_kwargs()
        init["runtime_env"]["env_vars"]["PYTHONPATH"] = path
        ray.init(address="local", include_dashboard=False, **init)
    return True


def _parent_params(sweep: SweepConfig, plan: SweepPlan, capacity: Capacity, campaign_file: Path) -> dict[str, Any]:
    params: dict[str, Any] = {"campaign_file": str(campaign_file), "design": plan.design, "blocks": sweep.blocks,
                              "aa_blocks": sweep.aa_blocks, "seed": sweep.seed, "max_failures": sweep.max_failures,
                              "num_blocks": len(plan.blocks), "max_concurrent_blocks": capacity.max_concurrent,
                              "executor": capacity.need.executor}
    params.update({f"resources.{k}": v for k, v in asdict(sweep.resources).items()})
    params.update({f"features.{k}": json.dumps(v) for k, v in sweep.features.items()})
    params.update({f"lane.{k}": v for k, v in flatten(lane_to_dict(sweep.lane)).items()})
    return params


def _sweep_identity(path: Path, resume: bool, storage: Optional[str]
                    ) -> tuple[SweepConfig, Layout, SweepPlan, dict[str, Any]]:
    """The campaign, where it lives, its plan and (resume) the metadata of the sweep being continued."""
    sweep, defaults = load_sweep(path)
    layout = Layout.for_campaign(sweep.name, storage or sweep.tracking.storage)
    meta: dict[str, Any] = {}
    if resume:
        layout.pull()
        latest = (layout.read(LATEST) or "").strip()
        meta = json.loads(layout.read(f"{SWEEPS_DIR}/{latest}.json") or "{}") if latest else {}
        if not meta:
            raise ConfigError("--resume", str(path), f"a campaign with an earlier sweep under {layout.local_dir} "
                                                     f"(none found: start it without --resume)")
    plan = plan_sweep(sweep, meta.get("sweep_id") or _new_sweep_id(layout.campaign), defaults)
    if resume and meta.get("plan_fingerprint") != plan.fingerprint():
        raise ConfigError("--resume", str(path), f"the campaign as it was when sweep {plan.sweep_id} started (its "
                                                 f"blocks changed since; start a new sweep without --resume)")
    return sweep, layout, plan, meta


def _tuner(trainable: Any, sweep: SweepConfig, layout: Layout, plan: SweepPlan, capacity: Capacity,
           resume: bool) -> Any:
    from ray import tune

    tune_path = layout.tune_path(plan.sweep_id)
    if resume and tune.Tuner.can_restore(tune_path):
        return tune.Tuner.restore(tune_path, trainable, resume_unfinished=True, resume_errored=True)
    return tune.Tuner(
        trainable,
        param_space={"block_id": tune.grid_search([b.block_id for b in plan.blocks])},
        tune_config=tune.TuneConfig(max_concurrent_trials=capacity.max_concurrent, reuse_actors=True,
                                    trial_name_creator=trial_name, trial_dirname_creator=trial_dirname),
        run_config=tune.RunConfig(
            name=plan.sweep_id, storage_path=layout.tune_root, verbose=0,
            failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
            callbacks=[_Relay(plan.sweep_id)]))


def run_sweep(path: str | Path, *, resume: bool = False, tracking_uri: Optional[str] = None,
              storage: Optional[str] = None, progress: bool = True,
              inject: Optional[Mapping[str, dict[str, Any]]] = None) -> SweepSummary:
    """Run (or, with ``resume``, continue) the campaign in ``path``; see the module docstring.

    ``inject`` is for tests only: block id -> fault injection for the first arm of that block's first attempt.
    """
    import ray
    from ray import tune

    from ablate.sweep.progress import SweepProgress

    started = time.monotonic()
    path = Path(path)
    sweep, layout, plan, meta = _sweep_identity(path, resume, storage)
    sweep_id = plan.sweep_id
    started_ray = ensure_ray()
    store: Optional[MlflowStore] = None
    try:
        sweep.resources = gpu_resources(sweep.lane, sweep.resources, ray.cluster_resources().get("GPU", 0.0))
        need = block_need(plan.blocks, sweep.resources)
        capacity = check_cluster(need, campaign=sweep.name, max_concurrent_blocks=sweep.resources.max_concurrent_blocks,
                                 num_blocks=len(plan.blocks))
        uri = resolve_tracking_uri(tracking_uri or sweep.tracking.uri)
        params = _parent_params(sweep, plan, capacity, path)
        if not resume:
            meta = {"sweep_id": sweep_id, "campaign": sweep.name, "campaign_file": str(path.resolve()),
                    "experiment": sweep.tracking.experiment, "tracking_uri": shown(uri),
                    "tune_path": layout.tune_path(sweep_id), "plan_fingerprint": plan.fingerprint(),
                    "blocks": [b.label() for b in plan.blocks], "skipped": plan.skipped,
                    "created_at": datetime.now(timezone.utc).isoformat(), "params": params}
            layout.write(f"{SWEEPS_DIR}/{sweep_id}.json", json.dumps(meta, indent=2, default=str))
            layout.write(LATEST, sweep_id + "\n")
        store = MlflowStore(uri, sweep.tracking.experiment, layout.local_dir)
        for what, why in plan.skipped:
            log.warning("not run: %s: %s", what, why)
        store.open_sweep(sweep_id, sweep.name, params,
                         tags={"ablate.lane_keys": ",".join(plan.lane_keys()), "ablate.design": plan.design,
                               "ablate.storage": shown(layout.storage),
                               # What the plan refused before any arm ran: promotion reports list it.
                               SKIPPED_TAG: json.dumps([[w, r] for w, r in plan.skipped])[:MAX_TAG_CHARS]})
        earlier = [r for r in gather(layout.local_dir)[0] if r.identity.sweep_id == sweep_id] if resume else []
        for receipt in earlier:
            # Receipts a killed driver wrote (or spooled) but never logged: MLflow catches up before new work.
            store.log_receipt(receipt)
        completed, next_attempt = block_progress(earlier, sweep_id)
        if resume:
            attempts = max(next_attempt.values(), default=0) + sweep.max_failures + 2
            for rid in clear_interrupted_scratch(layout.receipts_dir, sweep_id, [b.block_id for b in plan.blocks],
                                                 attempts):
                log.info("removed the scratch of arm %s: the killed driver's attempt never wrote its receipt", rid)
        recorder = _Recorder(layout, store, start_clock(sweep_id))
        display = SweepProgress(len(plan.blocks), title=sweep_id, live=None if progress else False)
        _LIVE[sweep_id] = [recorder] + ([display] if progress else [])
        context = {"sweep_id": sweep_id, "campaign": sweep.name, "receipt_dir": layout.trial_receipt_dir(),
                   "blocks": {b.block_id: b.to_dict() for b in plan.blocks}, "inject": dict(inject or {}),
                   "completed": completed, "next_attempt": next_attempt, "hashes": _file_hashes(path, sweep),
                   "block_mode": sweep.block_mode.value,
                   "run_arm": _run_arm_options(sweep, layout, sweep_id)}
        trainable = tune.with_resources(tune.with_parameters(run_block, context=context), need.trial_resources())
        try:
            grid = _tuner(trainable, sweep, layout, plan, capacity, resume).fit()
        finally:
            _LIVE.pop(sweep_id, None)
            display.close()
            recorder.flush()
        errors = {(r.config or {}).get("block_id", Path(r.path).name): str(r.error).splitlines()[0]
                  for r in grid if r.error}
        mine = recorder.receipts
        on_disk = [r for r in gather(layout.local_dir)[0] if r.identity.sweep_id == sweep_id]
        # After SIGINT, Tune ends the trials it stopped TERMINATED without an error, like finished ones (and never
        # calls on_trial_complete for them). A block is done only when its receipts show a complete attempt (both
        # arms, none failed) and its trial, if it ran in this session, completed (as SweepProgress counts).
        stopped = {block for block, entry in recorder.timeline.items() if "trial_started_at" in entry
                   and "trial_ended_at" not in entry and "trial_errored_at" not in entry}
        finished = set(block_progress(on_disk, sweep_id)[0]) - stopped
        store.close_sweep(sweep_id, on_disk, failed=bool(errors))
        return SweepSummary(
            sweep_id=sweep_id, campaign=sweep.name, sweep_dir=str(layout.local_dir),
            tune_path=layout.tune_path(sweep_id), tracking_uri=shown(uri), experiment=sweep.tracking.experiment,
            parent_run_id=store.parent_run_id, resumed=resume, executor=need.executor,
            max_concurrent=capacity.max_concurrent, blocks_total=len(plan.blocks),
            blocks_done=sum(1 for r in grid if r.error is None and (r.config or {}).get("block_id") in finished),
            blocks_errored=len(errors), arms_logged=len(mine),
            arms_failed=sum(r.identity.status is Status.failed for r in mine),
            arms_disqualified=sum(r.identity.status is Status.disqualified for r in mine),
            spooled=store.spooled, offline_reason=store.offline_reason, elapsed_s=time.monotonic() - started,
            receipt_ids=[r.identity.receipt_id for r in mine], timeline=recorder.timeline, errors=errors)
    finally:
        if store is not None:
            store.stop_monitor()  # interrupted or not: the parent run stays resumable, the sampler thread ends
        if started_ray:
            ray.shutdown()
