"""Simulated campaigns with known truth, as real validated ``Receipt`` objects.

Model (promotion-rule.md §7): log wall tokens/s of an arm = lane base + host effect (shared by both arms of a
block) + round effect + arm x (log true ratio + host x arm effect) + drift for the arm that runs second +
independent noise. Loss = base + arm x loss effect + noise. Every receipt passes ``validate_receipt``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

import numpy as np

from ablate.config.load import flatten, lane_to_dict
from ablate.config.schema import LaneConfig
from ablate.receipts.schema import BADPUT_CATEGORIES, Receipt

_BASE_LANE = flatten(lane_to_dict(LaneConfig()))
FEATURE_PATHS = {"moe_dispatch": "features.moe_dispatch", "mamba_scan": "features.mamba_scan",
                 "fused_residual": "features.fused_residual", "stp": "features.stp",
                 "mla_ingress": "features.mla_ingress", "recurrent_scan": "features.recurrent_scan"}
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


def make_receipt(*, receipt_id: str, sweep_id: str, block_id: str, arm: str, arm_index: int, order: int,
                 feature: Optional[str], feature_value: Any, baseline_value: Any, lane: dict[str, Any], host: str,
                 tps: Optional[float], loss: Optional[float], created_at: datetime, campaign: str = "sim",
                 lane_key: Optional[str] = None, software_fingerprint: str = "sw-1", status: str = "valid",
                 disqualifiers: tuple[dict[str, Any], ...] = (), attempt: int = 0, tokens_per_step: int = 1024,
                 data_fingerprint: str = "data-1", layer_counts: Optional[dict[str, int]] = None,
                 family_share: Optional[dict[str, Optional[float]]] = None, git_sha: str = "abc1234",
                 graph_breaks: int = 0, peak_rss: int = 1_000_000_000) -> Receipt:
    """One fully valid receipt (every required field filled, time accounting adding up)."""
    tokens = tokens_per_step * 8
    wall = tokens / tps if tps else 3.0
    goodput = 0.8 * wall
    badput = {c: 0.0 for c in BADPUT_CATEGORIES}
    badput["startup"] = 0.15 * wall
    badput["compile_warmup"] = 0.05 * wall
    badput["other"] = 0.0
    kind = KINDS.get(feature or "", "speed")
    lane_key = lane_key or lane_key_of(base_lane_of(lane, feature, baseline_value))
    data = {
        "identity": {
            "receipt_id": receipt_id, "sweep_id": sweep_id, "campaign": campaign, "block_id": block_id,
            "arm": arm, "arm_index": arm_index, "order": order, "feature": feature, "feature_value": feature_value,
            "baseline_value": baseline_value, "kind": kind, "lane_key": lane_key,
            "config_hash": hashlib.sha256(json.dumps(lane, sort_keys=True, default=str).encode()).hexdigest()[:12],
            "software_fingerprint": software_fingerprint, "attempt": attempt, "status": status, "host": host,
            "executor": "subprocess", "git_sha": git_sha, "git_dirty": False,
            "created_at": created_at.isoformat(), "software": {"torch": "2.13.0", "python": "3.11"},
        },
        "requested": {
            "lane": lane, "pattern": str(lane.get("model.pattern", "AEMR")),
            "layer_counts": layer_counts or {"A": 1, "E": 1, "M": 1, "R": 1}, "params_total": 1000,
            "params_active": 800, "tokens_per_step": tokens_per_step, "data_fingerprint": data_fingerprint,
            "world_size": 1, "device": "cpu",
        },
        "observed": {
            "hardware": {"cpu": "sim"}, "backends": [],
            "compile": {"posture_requested": "eager", "posture_observed": "eager", "warmup_requested": "auto",
                        "warmup_resolved": "explicit", "warmup_reason": "cpu", "graph_breaks": graph_breaks,
                        "recompiles_in_steady_state": 0},
            "tokens_per_step": tokens_per_step,
        },
        "time": {"wall_s": wall, "goodput_s": goodput, "badput_s": badput, "goodput_fraction": 0.8},
        "steps": {"total": 10, "warmup": 2, "steady": 8},
        "throughput": {"tokens": tokens, "wall_tokens_per_s": tps, "steady_tokens_per_s": tps and tps * 1.25},
        "memory": {"kind": "cpu", "peak_rss_bytes": peak_rss},
        "family_share": family_share or {"A": 0.3, "E": 0.4, "M": 0.2, "R": 0.1},
        "quality": {"loss_final": loss},
        "disqualifiers": list(disqualifiers),
    }
    if status == "failed":
        data["error"] = {"type": "RuntimeError", "message": "simulated crash"}
    return Receipt.model_validate(data)


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
    """True throughput ratio candidate / baseline."""
    loss_effect: float = 0.0


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
                if truth is None:
                    role, feature, value, baseline = "aa", None, None, None
                else:
                    role = "candidate" if is_cand else "baseline"
                    feature, baseline = truth.feature, truth.baseline
                    value = truth.value if is_cand else truth.baseline  # each arm records its own value
                    lane[FEATURE_PATHS[feature]] = value
                    if is_cand:
                        log_tps += math.log(truth.ratio) + host_arm[(feature, truth.value)][h]
                        loss += truth.loss_effect
                receipts.append(make_receipt(
                    receipt_id=f"{block_id}-a{arm_index}", sweep_id=sweep_id, block_id=block_id, arm=role,
                    arm_index=arm_index, order=order, feature=feature, feature_value=value,
                    baseline_value=baseline, lane=lane, host=host_names[h], tps=math.exp(log_tps), loss=loss,
                    created_at=clock + timedelta(minutes=counter * 3 + order), campaign=sim.campaign,
                    software_fingerprint=fingerprint, layer_counts=sim.layer_counts))
    return receipts


def moe(ratio: float = 1.0, loss_effect: float = 0.0) -> FeatureTruth:
    return FeatureTruth("moe_dispatch", "jagged", "padded", ratio, loss_effect)
