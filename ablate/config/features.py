"""The feature registry: every toggle a campaign may test is one typed lane field plus one entry here.

An entry says where the toggle lives in the lane (dotted path), whether it is a ``speed`` feature (may be
promoted) or a ``tax`` (a deliberate cost, reported and never promoted), which block family it touches (for the
Amdahl bound), and when it is inert in a lane (it cannot act there, so an arm testing it is never evidence).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ablate.config.pattern import parse_pattern
from ablate.config.schema import ConfigError, LaneConfig


def _layer_letters(lane: LaneConfig) -> str:
    return parse_pattern(lane.model.pattern)


def _inert_without(letter: str, family: str) -> Callable[[LaneConfig], Optional[str]]:
    def check(lane: LaneConfig) -> Optional[str]:
        if letter not in _layer_letters(lane):
            return f"pattern {lane.model.pattern!r} has no {letter} ({family}) blocks"
        return None

    return check


def _inert_single_worker(engine: Optional[str]) -> Callable[[LaneConfig], Optional[str]]:
    def check(lane: LaneConfig) -> Optional[str]:
        if lane.engine.workers < 2:
            return "communication buckets cannot act with one worker (no gradient all-reduce)"
        if engine is not None and lane.engine.name.value != engine:
            return f"this bucket belongs to the {engine} engine but the lane runs {lane.engine.name.value}"
        return None

    return check


def _inert_under_eager(lane: LaneConfig) -> Optional[str]:
    if lane.compile.posture.value == "eager":
        return "a compile-warmup policy cannot act when the compile posture is eager"
    return None


def _inert_zero_stage(lane: LaneConfig) -> Optional[str]:
    if lane.engine.name.value != "deepspeed":
        return f"ZeRO stage applies to the deepspeed engine but the lane runs {lane.engine.name.value}"
    return None


def _never_inert(lane: LaneConfig) -> Optional[str]:
    return None


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    path: str
    """Dotted path inside the lane, e.g. ``features.moe_dispatch``."""
    kind: str
    """speed (may be promoted) or tax (reported with its cost, never promoted)."""
    family: Optional[str]
    """Block family the toggle acts on (A, E, M, R), or None when it touches the whole step."""
    inert_when: Callable[[LaneConfig], Optional[str]]
    description: str

    def get(self, lane: LaneConfig) -> Any:
        node: Any = lane
        for part in self.path.split("."):
            node = getattr(node, part)
        return node.value if isinstance(node, enum.Enum) else node

    def inert_reason(self, lane: LaneConfig) -> Optional[str]:
        return self.inert_when(lane)


FEATURES: dict[str, FeatureSpec] = {
    spec.name: spec
    for spec in (
        FeatureSpec("moe_dispatch", "features.moe_dispatch", "speed", "E", _inert_without("E", "MoE"),
                    "padded capacity dispatch vs jagged sort-by-expert grouped GEMM"),
        FeatureSpec("mla_ingress", "features.mla_ingress", "speed", "A", _inert_without("A", "MLA"),
                    "MLA q/kv down-projection as one GEMM with split + norm + RoPE fused"),
        FeatureSpec("fused_residual", "features.fused_residual", "speed", None, _never_inert,
                    "fused residual add + RMSNorm"),
        FeatureSpec("mamba_scan", "features.mamba_scan", "speed", "M", _inert_without("M", "Mamba"),
                    "sequential SSD recurrence vs chunked SSD"),
        FeatureSpec("recurrent_scan", "features.recurrent_scan", "speed", "R", _inert_without("R", "recurrent"),
                    "sequential gated linear recurrence vs parallel log-space scan"),
        FeatureSpec("stp", "features.stp", "tax", None, _never_inert,
                    "skip-token-prediction auxiliary head (t+2): a quality tax"),
        FeatureSpec("compile", "compile.posture", "speed", None, _never_inert,
                    "torch.compile posture: eager, regional (per block) or whole model"),
        FeatureSpec("warmup", "compile.warmup", "speed", None, _inert_under_eager,
                    "compile warmup policy: explicit, skip, or auto (skip on CUDA + regional + E blocks)"),
        FeatureSpec("bucket_cap_mb", "engine.bucket_cap_mb", "speed", None, _inert_single_worker("ddp"),
                    "DDP gradient bucket size (MiB)"),
        FeatureSpec("reduce_bucket_size", "engine.reduce_bucket_size", "speed", None,
                    _inert_single_worker("deepspeed"), "DeepSpeed ZeRO reduce bucket (elements)"),
        FeatureSpec("allgather_bucket_size", "engine.allgather_bucket_size", "speed", None,
                    _inert_single_worker("deepspeed"), "DeepSpeed ZeRO all-gather bucket (elements)"),
        FeatureSpec("overlap_comm", "engine.overlap_comm", "speed", None, _inert_single_worker("deepspeed"),
                    "DeepSpeed overlap of gradient communication with backward"),
        FeatureSpec("engine", "engine.name", "speed", None, _never_inert, "DDP vs DeepSpeed engine"),
        FeatureSpec("zero_stage", "engine.zero_stage", "speed", None, _inert_zero_stage, "DeepSpeed ZeRO stage"),
    )
}


def feature(name: str, key: str = "features") -> FeatureSpec:
    """Look a feature up by name; unknown names raise a ConfigError listing the valid ones."""
    try:
        return FEATURES[name]
    except KeyError:
        raise ConfigError(f"{key}.{name}" if key else name, name,
                          f"one of {', '.join(sorted(FEATURES))}") from None
