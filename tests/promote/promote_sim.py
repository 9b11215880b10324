"""Simulated campaigns with known truth, as real validated ``Receipt`` objects.

Model (promotion-rule.md §7, with the arm's time split of ``ablate.receipts.derive``): an arm's recurring step
time = lane base x host effect (shared by both arms of a block) x round effect x drift for the arm that runs
second x independent noise, divided by the true steady ratio for a candidate; its executor start-up jitters
independently (no feature touches it); a candidate may carry an extra one-time cost. Every per-step record,
time part and projection is computed with the same functions the validator re-runs, so every receipt passes
``validate_receipt``.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

import numpy as np

from ablate.config.load import flatten, lane_to_dict
from ablate.config.schema import LaneConfig
from ablate.receipts import derive
from ablate.receipts.schema import BADPUT_CATEGORIES, SCHEMA_VERSION, Receipt, validate_receipt

_BASE_LANE = flatten(lane_to_dict(LaneConfig()))
FEATURE_PATHS = {"moe_dispatch": "features.moe_dispatch", "mamba_scan": "features.mamba_scan",
                 "fused_residual": "features.fused_residual", "stp": "features.stp",
                 "mla_ingress": "features.mla_ingress", "recurrent_scan": "features.recurrent_scan",
                 "compile": "compile.posture"}
BACKEND_OPS = {"moe_dispatch": "moe", "mamba_scan": "ssd", "fused_residual": "add_rmsnorm",
               "mla_ingress": "mla_ingress", "recurrent_scan": "recurrent_scan"}
KINDS = {"stp": "tax"}
T0 = datetime(2026, 3, 2, 9, 0, tzinfo=timezone.utc)


def base_lane(**changes: Any) -> dict[str, Any]:
    lane = dict(_BASE_LANE)
    lane.update(changes)
    return lane


def lane_key_of(lane: dict[str, Any]) -> str:
    skip = {"seed", "data.seed"}
    text = json.dumps({k: v for k, v in lane.items() if k not in skip}, sort_keys=True, default=str)
    return "lane-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def _observed(lane: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """Backends and model facts as a real arm of this lane would observe them (no fallback)."""
    backends = [{"op": op, "requested": str(lane.get(FEATURE_PATHS[name])), "observed": str(lane.get(FEATURE_PATHS[name])),
                 "reason": "simulated"} for name, op in sorted(BACKEND_OPS.items())]
    model = {"stp_head": lane.get("features.stp") == "on", "compile_posture": lane.get("compile.posture")}
    return backends, model


def make_receipt(*, receipt_id: str, sweep_id: str, block_id: str, arm: str, arm_index: int, order: int,
                 feature: Optional[str], feature_value: Any, baseline_value: Any, lane: dict[str, Any], host: str,
                 tps: Optional[float], loss: Optional[float], created_at: datetime, campaign: str = "sim",
                 lane_key: Optional[str] = None, software_fingerprint: str = "sw-1", status: str = "valid",
                 disqualifiers: tuple[dict[str, Any], ...] = (), attempt: int = 0, tokens_per_step: int = 1024,
                 data_fingerprint: str = "data-1", layer_counts: Optional[dict[str, int]] = None,
                 family_share: Optional[dict[str, Optional[float]]] = None, git_sha: str = "abc1234",
                 graph_breaks: int = 0, peak_rss: int = 1_000_000_000, startup_s: float = 2.0,
                 setup_s: float = 0.05, one_time_extra_s: float = 0.0, steps: int = 8, step_jitter: float = 0.0,
                 seed: int = 0, backends: Optional[list[dict[str, str]]] = None,
                 engine: Optional[dict[str, Any]] = None, model: Optional[dict[str, Any]] = None,
                 contended: bool = False, device: str = "cpu", warmup: str = "explicit") -> Receipt:
    """One fully valid receipt: ``tps`` is the arm's steady tokens/s (its recurring step = tokens_per_step / tps);
    ``startup_s`` is executor start-up (never compared), ``one_time_extra_s`` extra feature setup cost."""
    rng = np.random.default_rng(seed)
    lane = dict(lane)
    lane.setdefault("budget.horizon_steps", 10_000)
    failed = status == "failed"
    recurring = tokens_per_step / tps if tps else 0.01
    # ``warmup: skip``: no warmup phase; the first budget step compiles (a warm budget step of the projection).
    phases = ["budget" if warmup == "skip" else "warmup"] + ["budget"] * (0 if failed and tps is None else steps)
    cadence = [recurring * 3.0] + [recurring * math.exp(rng.normal(0, step_jitter)) if step_jitter else recurring
                                   for _ in phases[1:]]
    # Real step timings never repeat across arms; identical series are refused as a replayed measurement. A few
    # ulps on the warmup step, per receipt id, keep simulated arms with equal tps distinct measurements while
    # changing no figure beyond 1e-11 (relative).
    cadence[0] *= 1.0 + (zlib.crc32(receipt_id.encode()) % 65_536 + 1) * 2.0 ** -52
    sampled = [False] * len(phases)
    if len(phases) > 3:
        sampled[-1] = True
    events = [1] + [0] * (len(phases) - 1)
    labels = derive.classify(phases, events, sampled, warmup)
    step_s = [c * 0.95 for c in cadence]
    data_s = [c * 0.01 for c in cadence]
    tokens = [0 if ph == "warmup" else tokens_per_step for ph in phases]  # a skipped warmup's step trains
    steps_v = [derive.Step(phase=ph, label=lb, step_s=st, data_s=d, cadence_s=c, tokens=t)
               for ph, lb, st, d, c, t in zip(phases, labels, step_s, data_s, cadence, tokens)]
    parts = derive.loop_parts(steps_v, data_is_badput=True)
    setup = setup_s + one_time_extra_s
    proj = derive.project(setup, steps_v, int(lane["budget.horizon_steps"]), tokens_per_step)
    badput = {c: 0.0 for c in BADPUT_CATEGORIES}
    badput.update(queue_wait=0.01, startup=startup_s, setup=setup, compile_warmup=parts.compile_warmup_s,
                  recompile=parts.recompile_s, data_wait=parts.data_wait_s, idle=parts.idle_s,
                  sampling=parts.sampling_s, teardown=0.02, unattributed=0.001)
    wall = parts.goodput_s + sum(badput.values())
    kind = KINDS.get(feature or "", "speed")
    lane_key = lane_key or lane_key_of(base_lane_of(lane, feature, baseline_value))
    sim_backends, sim_model = _observed(lane)
    budget = [s for s in steps_v if s.phase == "budget"]
    steady = [s for s in steps_v if s.label == "steady"]
    steady_time = sum(s.step_s for s in steady)
    stats = derive.step_statistics([s.step_s for s in steady])
    data = {
        "schema_version": SCHEMA_VERSION,
        "identity": {
            "receipt_id": receipt_id, "sweep_id": sweep_id, "campaign": campaign, "block_id": block_id,
            "arm": arm, "arm_index": arm_index, "order": order, "feature": feature, "feature_value": feature_value,
            "baseline_value": baseline_value, "kind": kind, "lane_key": lane_key,
            "config_hash": hashlib.sha256(json.dumps(lane, sort_keys=True, default=str).encode()).hexdigest()[:12],
            "software_fingerprint": software_fingerprint, "code_fingerprint": "code-1",
            "hardware_fingerprint": f"hw-{device}", "attempt": attempt, "status": status, "host": host,
            "executor": "subprocess", "git_sha": git_sha, "git_dirty": False,
            "created_at": created_at.isoformat(), "software": {"torch": "2.13.0", "python": "3.11"},
        },
        "requested": {
            "lane": lane, "pattern": str(lane.get("model.pattern", "AEMR")),
            "layer_counts": layer_counts or {"A": 1, "E": 1, "M": 1, "R": 1}, "params_total": 1000,
            "params_active": 800, "tokens_per_step": tokens_per_step, "data_fingerprint": data_fingerprint,
            "world_size": 1, "device": device,
        },
        "observed": {
            "hardware": {"kind": device, "cpu_model": "sim"}, "backends": backends if backends is not None else
            sim_backends,
            "compile": {"posture_requested": "eager", "posture_observed": str(lane.get("compile.posture", "eager")),
                        "warmup_requested": "auto", "warmup_resolved": warmup, "warmup_reason": "cpu",
                        "graph_breaks": graph_breaks, "recompiles_in_steady_state": 0},
            "tokens_per_step": tokens_per_step, "engine": engine or {"name": "ddp"},
            "model": model if model is not None else sim_model,
        },
        "time": {"wall_s": wall, "goodput_s": parts.goodput_s, "badput_s": badput,
                 "goodput_fraction": parts.goodput_s / wall},
        "steps": {"total": len(steps_v), "warmup": sum(1 for s in steps_v if s.label == "compile_warmup"),
                  "steady": len(steady), **stats, "phases": phases, "compile_events": events, "sampled": sampled,
                  "labels": labels, "step_s": step_s, "data_s": data_s, "cadence_s": cadence,
                  "phase_s": [0.0] * len(phases), "tokens": tokens, "data_is_badput": True},
        "projection": proj.to_dict() if proj.projected_s is not None else None,
        "host_load": {"niceness": 0, "contended": contended},
        "throughput": {"tokens": sum(s.tokens for s in budget),
                       "wall_tokens_per_s": sum(s.tokens for s in budget) / wall if budget else None,
                       "steady_tokens_per_s": sum(s.tokens for s in steady) / steady_time if steady_time else None},
        "memory": {"kind": "cpu", "peak_rss_bytes": peak_rss},
        "family_share": family_share or {"A": 0.3, "E": 0.4, "M": 0.2, "R": 0.1},
        "quality": {"loss_final": loss, "lm_loss_final": loss},
        "disqualifiers": list(disqualifiers),
    }
    if failed:
        data["error"] = {"type": "RuntimeError", "message": "simulated crash"}
    return validate_receipt(data)


def base_lane_of(lane: dict[str, Any], feature: Optional[str], baseline_value: Any) -> dict[str, Any]:
    if feature is None:
        return lane
    out = dict(lane)
    out[FEATURE_PATHS[feature]] = baseline_value
    return out


@dataclass
class FeatureTruth:
    feature: str
    value: Any
    baseline: Any
    ratio: float = 1.0
    """True steady speed-up: baseline recurring step time / candidate's."""
    loss_effect: float = 0.0
    one_time_s: float = 0.0
    """Extra one-time cost of the candidate (setup, compile warmup), seconds."""
    baseline_one_time_s: float = 0.0
    """Extra one-time cost of the baseline: a candidate cheaper to start."""


@dataclass
class Sim:
    """Knobs of one simulated campaign (defaults: 3 hosts x 2 blocks x 2 rounds per feature, 1 A/A per host)."""

    features: list[FeatureTruth]
    hosts: int = 3
    blocks_per_host: int = 2
    rounds: int = 2
    aa_per_host: int = 1
    noise: float = 0.01
    host_sd: float = 0.02
    host_arm_sd: float = 0.0
    drift_second: float = 0.0
    """Log-throughput gain of whichever arm runs second (a machine warming up)."""
    drift_in_aa: bool = True
    """False: the A/A blocks were calibrated in a quiet window, so drift does not inflate the noise floor."""
    order: str = "random"
    """random, baseline_first or alternate."""
    loss_noise: float = 0.002
    lane: dict[str, Any] = field(default_factory=base_lane)
    layer_counts: Optional[dict[str, int]] = None
    fingerprints: Optional[list[str]] = None
    """Software fingerprint per round (default: one for all)."""
    campaign: str = "sim"
    base_tps: float = 5000.0
    startup_s: float = 2.0
    startup_jitter: float = 0.0
    """Log-normal sd of each arm's executor start-up (0.2 = the ±20% jitter measured on 2-core CPU lanes)."""
    horizon: int = 10_000
    steps: int = 8
    device: str = "cuda"
    """Observed device class of every arm (a CPU-only campaign never flips a global default)."""
    slot_bias: float = 0.0
    """Log speed advantage of arm_index 1 in every block, A/A included: a systematic bias pairing cannot cancel."""
    host_arm_effects: Optional[list[float]] = None
    """Fixed per-host log effect added to every candidate (host-correlated noise with known values)."""
    family_share: Optional[dict[str, Optional[float]]] = None
    """Sampled family time share every receipt carries (default: A 30%, E 40%, M 20%, R 10%)."""
    block_prefix: str = ""
    """Prepended to block and receipt ids so several simulated lanes can share one campaign."""


def simulate(sim: Sim, seed: int) -> list[Receipt]:
    rng = np.random.default_rng(seed)
    host_names = [f"node-{h}" for h in range(sim.hosts)]
    host_effect = rng.normal(0, sim.host_sd, sim.hosts)
    host_arm = {(f.feature, f.value): rng.normal(0, sim.host_arm_sd, sim.hosts) for f in sim.features}
    receipts: list[Receipt] = []
    clock = T0
    counter = 0
    arms: list[tuple[Optional[FeatureTruth], int]] = []
    for r in range(sim.rounds):
        sweep_id = f"{sim.campaign}-r{r + 1}"
        fingerprint = (sim.fingerprints or ["sw-1"] * sim.rounds)[r]
        clock = T0 + timedelta(days=r)
        round_effect = rng.normal(0, 0.01)
        arms = [(f, h) for f in sim.features for h in range(sim.hosts) for _ in range(sim.blocks_per_host)]
        arms += [(None, h) for h in range(sim.hosts) for _ in range(sim.aa_per_host)]
        for truth, h in arms:
            counter += 1
            block_id = f"{sim.block_prefix}{sweep_id}-b{counter}"
            if sim.order == "baseline_first":
                cand_order = 1
            elif sim.order == "alternate":
                cand_order = counter % 2
            else:
                cand_order = int(rng.integers(0, 2))
            base = math.log(sim.base_tps) + host_effect[h] + round_effect
            for arm_index, is_cand in ((0, False), (1, True)):
                order = cand_order if is_cand else 1 - cand_order
                drift = sim.drift_second * order if (truth is not None or sim.drift_in_aa) else 0.0
                log_tps = base + drift + rng.normal(0, sim.noise)
                loss = 5.0 + rng.normal(0, sim.loss_noise)
                lane = dict(sim.lane)
                lane["budget.horizon_steps"] = sim.horizon
                extra = 0.0
                log_tps += sim.slot_bias * arm_index
                if truth is None:
                    role, feature, value, baseline = "aa", None, None, None
                else:
                    role = "candidate" if is_cand else "baseline"
                    feature, baseline = truth.feature, truth.baseline
                    value = truth.value if is_cand else truth.baseline  # each arm records its own value
                    lane[FEATURE_PATHS[feature]] = value
                    extra = truth.baseline_one_time_s
                    if is_cand:
                        log_tps += math.log(truth.ratio) + host_arm[(feature, truth.value)][h]
                        if sim.host_arm_effects is not None:
                            log_tps += sim.host_arm_effects[h]
                        loss += truth.loss_effect
                        extra = truth.one_time_s
                startup = sim.startup_s * math.exp(rng.normal(0, sim.startup_jitter)) if sim.startup_jitter else \
                    sim.startup_s
                receipts.append(make_receipt(
                    receipt_id=f"{block_id}-a{arm_index}", sweep_id=sweep_id, block_id=block_id, arm=role,
                    arm_index=arm_index, order=order, feature=feature, feature_value=value,
                    baseline_value=baseline, lane=lane, host=host_names[h], tps=math.exp(log_tps), loss=loss,
                    created_at=clock + timedelta(minutes=counter * 3 + order), campaign=sim.campaign,
                    software_fingerprint=fingerprint, layer_counts=sim.layer_counts, startup_s=startup,
                    one_time_extra_s=extra, steps=sim.steps, device=sim.device, family_share=sim.family_share))
    return receipts


def moe(ratio: float = 1.0, loss_effect: float = 0.0) -> FeatureTruth:
    return FeatureTruth("moe_dispatch", "jagged", "padded", ratio, loss_effect)


def simulate_bundle(values: dict[str, Any], old: dict[str, Any], ratio: float, seed: int, *, hosts: int = 3,
                    blocks_per_host: int = 2, noise: float = 0.003, campaign: str = "sim",
                    lane: Optional[dict[str, Any]] = None, day: int = 2, rounds: int = 2,
                    software_fingerprint: str = "sw-1", loss_effect: float = 0.0) -> list[Receipt]:
    """Bundle blocks (``ablate.promote.match.BUNDLE``): the candidate runs every value of ``values`` together,
    the baseline the old defaults ``old``; ``ratio`` is the bundle's true steady speed-up. Each round is its own
    sweep, a day after the one before (rounds are separate runs in time); ``blocks_per_host`` is per round."""
    rng = np.random.default_rng(seed)
    base = dict(lane or base_lane())
    base["budget.horizon_steps"] = 10_000
    for name, value in old.items():
        base[FEATURE_PATHS[name]] = value
    cand = dict(base)
    for name, value in values.items():
        cand[FEATURE_PATHS[name]] = value
    key = lane_key_of(base)
    receipts = []
    counter = 0
    for r in range(rounds):
        sweep_id = f"{campaign}-bundle-r{r}"
        for h in range(hosts):
            for _ in range(blocks_per_host):
                counter += 1
                block_id = f"{sweep_id}-b{counter}"
                cand_order = int(rng.integers(0, 2))
                host_log = math.log(5000.0) + rng.normal(0, 0.02)
                for arm_index, is_cand in ((0, False), (1, True)):
                    order = cand_order if is_cand else 1 - cand_order
                    log_tps = host_log + rng.normal(0, noise) + (math.log(ratio) if is_cand else 0.0)
                    receipts.append(make_receipt(
                        receipt_id=f"{block_id}-a{arm_index}", sweep_id=sweep_id, block_id=block_id,
                        arm="candidate" if is_cand else "baseline", arm_index=arm_index, order=order, feature="bundle",
                        feature_value=dict(values) if is_cand else dict(old), baseline_value=dict(old),
                        lane=cand if is_cand else base, host=f"node-{h}", tps=math.exp(log_tps),
                        loss=5.0 + rng.normal(0, 0.002) + (loss_effect if is_cand else 0.0),
                        created_at=T0 + timedelta(days=day + r, minutes=counter * 3 + order),
                        campaign=campaign, lane_key=key, device="cuda", software_fingerprint=software_fingerprint))
    return receipts
