"""Helpers for trainer tests: a tiny lane (seconds per arm on 2 CPUs) and an ArmSpec factory."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Optional

from ablate.config.load import load_lane
from ablate.config.schema import LaneConfig
from trainers.spec import ArmSpec

CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus"

TINY: dict[str, Any] = {
    "model": {"pattern": "AEMR", "d_model": 32, "n_heads": 2, "d_expert": 32, "ssm_chunk": 16, "q_lora_rank": 16,
              "kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8},
    "batch": {"micro_batch": 2, "seq_len": 32},
    "compile": {"warmup_steps": 1},
    "budget": {"steps": 6, "family_sample_steps": 1, "min_steady_steps": 2},
    "hardware": {"threads": 1},
}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def tiny_lane(**sections: dict[str, Any]) -> LaneConfig:
    """The tiny lane with some sections overridden, e.g. ``tiny_lane(engine={"workers": 2})``."""
    return load_lane(_merge(TINY, sections))


def make_spec(lane: LaneConfig, receipt_dir: Path, *, feature: Optional[str] = None,
              inject: Optional[dict[str, Any]] = None, scheduled_at: Optional[float] = None,
              block_id: str = "block-0") -> ArmSpec:
    return ArmSpec(lane=lane, sweep_id="test-sweep", campaign="test", block_id=block_id, arm="baseline",
                   arm_index=0, order=0, feature=feature, feature_value=None, baseline_value=None, kind="speed",
                   lane_key="lane-test", receipt_dir=str(receipt_dir),
                   scheduled_at=time.time() if scheduled_at is None else scheduled_at, inject=dict(inject or {}))
