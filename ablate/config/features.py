"""The feature registry: every toggle a campaign may test is one typed lane field plus one entry here.

An entry says where the toggle lives in the lane (dotted path), whether it is a ``speed`` feature (may be
promoted) or a ``tax`` (a deliberate cost, reported and never promoted), which block family it touches (for the
Amdahl bound), and when it is inert in a lane (it cannot act there, so an arm testing it is never evidence).

How to use::

    spec = FEATURES["warmup"]
    spec.inert_reason(candidate_lane, baseline_value)   # why the two arms run the same code, or None
    spec.inert_reason(candidate_lane)                   # only what holds against every baseline value

Inertness is decided statically, from the lane alone, and only where it is exact: a rule fires only when the
candidate arm provably runs the same code as the baseline arm on every device the lane may run on. What depends
on the node (CUDA or not under ``device: auto``, a C++ compiler, the model's gradient bytes against a DDP cap) is
left to the observed check: the engines record requested settings that did not act (``observed.engine``), the
dispatcher records backends that fell back (``observed.backends``). This module stays torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ablate.config.pattern import parse_pattern
from ablate.config.schema import ConfigError, LaneConfig
from ablate.config.warmup import resolve_warmup

InertRule = Callable[[LaneConfig, Any], Optional[str]]
"""(candidate lane, baseline value or None when unknown) -> why the toggle cannot change the executed code."""


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _layer_letters(lane: LaneConfig) -> str:
    return parse_pattern(lane.model.pattern)


def _devices(lane: LaneConfig) -> tuple[str, ...]:
    """Device types the lane may run on (trainers.loop.resolve_device): auto is either; cuda falls back to CPU
    only with cpu_fallback."""
    requested = lane.hardware.device.value
    if requested == "cpu":
        return ("cpu",)
    if requested == "cuda":
        return ("cuda", "cpu") if lane.hardware.cpu_fallback else ("cuda",)
    return ("cpu", "cuda")


def _first(*rules: InertRule) -> InertRule:
    def check(lane: LaneConfig, baseline: Any) -> Optional[str]:
        for rule in rules:
            reason = rule(lane, baseline)
            if reason:
                return reason
        return None

    return check


def _inert_without(letter: str, family: str) -> InertRule:
    def check(lane: LaneConfig, baseline: Any) -> Optional[str]:
        if letter not in _layer_letters(lane):
            return f"pattern {lane.model.pattern!r} has no {letter} ({family}) blocks"
        return None

    return check


def _inert_single_worker(engine: Optional[str]) -> InertRule:
    def check(lane: LaneConfig, baseline: Any) -> Optional[str]:
        if lane.engine.workers < 2:
            return "communication buckets cannot act with one worker (no gradient all-reduce)"
        if engine is not None and lane.engine.name.value != engine:
            return f"this bucket belongs to the {engine} engine but the lane runs {lane.engine.name.value}"
        return None

    return check


def _inert_zero_stage(lane: LaneConfig, baseline: Any) -> Optional[str]:
    if lane.engine.name.value != "deepspeed":
        return f"ZeRO stage applies to the deepspeed engine but the lane runs {lane.engine.name.value}"
    return None


def _never_inert(lane: LaneConfig, baseline: Any) -> Optional[str]:
    return None


# --- warmup: the seeds' rule (ablate.config.warmup, which the trainer applies) ---

def warmup_decision(policy: str, device_type: str, posture: str, letters: str, warmup_steps: int) -> tuple[str, int]:
    """(resolved, explicit steps) of ``resolve_warmup``: the reason text changes no code."""
    decision = resolve_warmup(policy, device_type, posture, letters, warmup_steps)
    return decision.resolved, decision.steps


def _describe(decision: tuple[str, int]) -> str:
    return f"explicit warmup ({decision[1]} steps)" if decision[0] == "explicit" else "no explicit warmup"


def _inert_warmup(lane: LaneConfig, baseline: Any) -> Optional[str]:
    # The policy acts only through its decision (warmup steps at lr 0, or none), under every posture: eager too
    # runs explicit warmup steps. Inert when candidate and baseline decide the same on every device the lane may
    # run on; without a baseline, only when every policy decides the same (warmup_steps 0).
    devices, posture = _devices(lane), lane.compile.posture.value
    letters, steps = _layer_letters(lane), lane.compile.warmup_steps
    candidate = lane.compile.warmup.value
    others = [baseline] if baseline is not None else ["explicit", "skip", "auto"]
    decided = {device: warmup_decision(candidate, device, posture, letters, steps) for device in devices}
    for other in others:
        if any(warmup_decision(other, device, posture, letters, steps) != decided[device] for device in devices):
            return None
    if baseline is None:
        return "lane.compile.warmup_steps is 0: every warmup policy runs no explicit warmup"
    where = "; ".join(f"on {device}: {_describe(decided[device])}" for device in devices)
    return (f"warmup {candidate!r} and the baseline {baseline!r} resolve the same on every device this lane may run "
            f"on ({where}; posture {posture}, E blocks: {'yes' if 'E' in letters else 'no'})")


# --- DeepSpeed ZeRO: which requests the built engine reads, per stage (deepspeed 0.19.8 source) ---
# engine.py::_configure_optimizer: stage 0 wraps nothing (the client optimizer runs as is) and allreduce_gradients
#   -> buffered_allreduce_fallback(elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE); reduce_bucket_size,
#   allgather_bucket_size and overlap_comm are read only in _configure_zero_optimizer (stages 1-3).
# engine.py::_configure_zero_optimizer: stage 3 gets reduce_bucket_size, prefetch_bucket_size and overlap_comm,
#   never allgather_bucket_size.
# zero/stage_1_and_2.py::step -> runtime/utils.py::all_gather_dp_groups returns all_gather_into_tensor_dp_groups
#   (one call per partition, no bucket) whenever deepspeed.comm.has_all_gather_into_tensor(), which is true for
#   every torch the project allows (torch.distributed.all_gather_into_tensor, comm/torch.py). What remains is the
#   constructor's assert that the bucket is even (nccl_start_alignment_factor 2): an odd value fails the arm.
# zero/stage3.py and zero/parameter_offload.py: overlap_comm only picks the reduce and all-gather streams, and
#   both are None on a synchronized device (accelerator/cpu_accelerator.py::is_synchronized_device is True).
# trainers/engines.py records the same facts from the running engine (observed.engine["inactive"]).

def _deepspeed_stage(setting: str) -> InertRule:
    def check(lane: LaneConfig, baseline: Any) -> Optional[str]:
        stage = lane.engine.zero_stage
        if stage == 0:
            return (f"ZeRO stage 0 never reads {setting}: DeepSpeed builds no ZeRO optimizer and all-reduces "
                    "gradients with its fixed MEMORY_OPT_ALLREDUCE_SIZE buffer")
        if setting == "allgather_bucket_size":
            if stage == 3:
                return "ZeRO-3 gathers parameters by stage3_prefetch_bucket_size; allgather_bucket_size is not used"
            candidate = lane.engine.allgather_bucket_size
            if isinstance(baseline, int) and candidate % 2 == 0 and baseline % 2 == 0:
                return (f"ZeRO-{stage} all-gathers each partition in one all_gather_into_tensor call (torch has it): "
                        "the bucket size only has to be even, and both values are")
        if setting == "overlap_comm" and stage == 3 and _devices(lane) == ("cpu",):
            return ("ZeRO-3 on CPU: a synchronized device gets no side streams, and overlap_comm only chooses "
                    "streams at stage 3")
        return None

    return check


# --- kernels: where the dispatcher's fallback chain makes two values run one backend ---
# kernels/moe.py: grouped_mm is eligible only on the CUTLASS fast path (CUDA SM90/SM100, kernels/capability.py:
#   never on a cpu device), in a bf16 lane (its GEMMs take bf16 operands), with d_model, d_expert and 2 * d_expert
#   multiples of 8; otherwise it falls back to
#   jagged, so it runs exactly what jagged runs (jagged itself may fall on to jagged_loop: the same for both).
# kernels/ssd.py: mamba_ssm is eligible only on CUDA with conv channels (ssm_expand * d_model + 2 * ssm_d_state) a
#   multiple of 8; otherwise it falls back to chunked, which always runs.
# Whether a CUDA node has SM90 or mamba_ssm installed is the node's business: left to the observed backends.

def _falls_back(name: str, value: Any, lane: LaneConfig) -> Optional[tuple[str, str]]:
    """(backend that runs instead, why) when ``value`` can never run its own backend in this lane."""
    cpu_only = _devices(lane) == ("cpu",)
    cfg = lane.model
    if name == "moe_dispatch" and value == "grouped_mm":
        dims = (cfg.d_model, cfg.d_expert, 2 * cfg.d_expert)
        if cpu_only:
            return "jagged", "grouped_mm has no CPU fast path"
        if lane.precision.value != "bf16":
            return "jagged", f"grouped_mm computes in bf16, this lane in {lane.precision.value}"
        if any(d % 8 for d in dims):
            return "jagged", f"grouped GEMM needs dims {dims} to be multiples of 8"
    if name == "mamba_scan" and value == "mamba_ssm":
        channels = cfg.ssm_expand * cfg.d_model + 2 * cfg.ssm_d_state
        if cpu_only:
            return "chunked", "mamba_ssm runs on CUDA only"
        if channels % 8:
            return "chunked", f"mamba_ssm needs conv channels ({channels}) to be a multiple of 8"
    return None


def _inert_fallback(name: str) -> InertRule:
    def check(lane: LaneConfig, baseline: Any) -> Optional[str]:
        if baseline is None:
            return None
        candidate = FEATURES[name].get(lane)
        runs = {value: _falls_back(name, value, lane) for value in (candidate, baseline)}
        backend = {value: (fallback[0] if fallback else value) for value, fallback in runs.items()}
        if backend[candidate] != backend[baseline]:
            return None
        why = "; ".join(fallback[1] for fallback in runs.values() if fallback)
        return (f"{name} {candidate!r} and the baseline {baseline!r} both run the {backend[candidate]!r} backend "
                f"here ({why}: the dispatcher falls back)")

    return check


def _inert_fused_residual(lane: LaneConfig, baseline: Any) -> Optional[str]:
    # On CPU, fused_residual on requests the ``compiled`` add + RMSNorm (Inductor, kernels/norm.py), whose code is
    # the reference itself while Dynamo traces it: the enclosing graph fuses add + RMSNorm anyway. A dispatcher
    # built with a regional or whole compile posture (trainers/loop.py) therefore records it as ``eager`` and hands
    # every call site the reference (Impl.traced_as), the final norm outside the block regions included: on and
    # off run the same function. Under eager the Inductor kernel really runs; on CUDA the Triton custom op really
    # runs under compile, so device auto is not decidable here and is left to the observed backends.
    posture = lane.compile.posture.value
    if posture in ("regional", "whole") and _devices(lane) == ("cpu",):
        return (f"{posture} compile on CPU: the dispatcher hands fused and unfused add + RMSNorm the same reference "
                "(the compiled graph fuses it either way), so on and off run the same code")
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
    inert_when: InertRule
    """(candidate lane, baseline value or None) -> reason; call it through ``inert_reason``."""
    description: str

    def get(self, lane: LaneConfig) -> Any:
        node: Any = lane
        for part in self.path.split("."):
            node = getattr(node, part)
        return node.value if isinstance(node, enum.Enum) else node

    def inert_reason(self, lane: LaneConfig, baseline: Any = None) -> Optional[str]:
        """Why the toggle cannot change the executed code in ``lane``, or None when it may act.

        ``lane`` is the candidate arm's lane; ``baseline`` the value the other arm runs (a raw value, an enum
        member, or the baseline lane itself). Rules are symmetric, so the baseline arm may pass the candidate's
        value. Without a baseline, or with one equal to the lane's own value (that arm *is* the baseline), only
        rules that hold against every baseline value fire.
        """
        if isinstance(baseline, LaneConfig):
            baseline = self.get(baseline)
        baseline = _plain(baseline)
        if baseline is not None and baseline == self.get(lane):
            baseline = None
        return self.inert_when(lane, baseline)


BUNDLE = "bundle"
"""``feature`` of a bundle block (planned with ``bundle_blocks``): the candidate arm runs every tested speed
feature's candidate value together against the defaults; ``ablate.promote.bundle`` judges the set with it."""

FEATURES: dict[str, FeatureSpec] = {
    spec.name: spec
    for spec in (
        FeatureSpec("moe_dispatch", "features.moe_dispatch", "speed", "E",
                    _first(_inert_without("E", "MoE"), _inert_fallback("moe_dispatch")),
                    "padded capacity dispatch vs jagged sort-by-expert grouped GEMM"),
        FeatureSpec("mla_ingress", "features.mla_ingress", "speed", "A", _inert_without("A", "MLA"),
                    "MLA q/kv down-projection as one GEMM with split + norm + RoPE fused"),
        FeatureSpec("fused_residual", "features.fused_residual", "speed", None, _inert_fused_residual,
                    "fused residual add + RMSNorm"),
        FeatureSpec("mamba_scan", "features.mamba_scan", "speed", "M",
                    _first(_inert_without("M", "Mamba"), _inert_fallback("mamba_scan")),
                    "sequential SSD recurrence vs chunked SSD"),
        FeatureSpec("recurrent_scan", "features.recurrent_scan", "speed", "R", _inert_without("R", "recurrent"),
                    "sequential gated linear recurrence vs parallel log-space scan"),
        FeatureSpec("stp", "features.stp", "tax", None, _never_inert,
                    "skip-token-prediction auxiliary head (t+2): a quality tax"),
        FeatureSpec("compile", "compile.posture", "speed", None, _never_inert,
                    "torch.compile posture: eager, regional (per block) or whole model"),
        FeatureSpec("warmup", "compile.warmup", "speed", None, _inert_warmup,
                    "compile warmup policy: explicit, skip, or auto (skip on CUDA + regional + E blocks)"),
        FeatureSpec("bucket_cap_mb", "engine.bucket_cap_mb", "speed", None, _inert_single_worker("ddp"),
                    "DDP gradient bucket size (MiB)"),
        FeatureSpec("reduce_bucket_size", "engine.reduce_bucket_size", "speed", None,
                    _first(_inert_single_worker("deepspeed"), _deepspeed_stage("reduce_bucket_size")),
                    "DeepSpeed ZeRO reduce bucket (elements)"),
        FeatureSpec("allgather_bucket_size", "engine.allgather_bucket_size", "speed", None,
                    _first(_inert_single_worker("deepspeed"), _deepspeed_stage("allgather_bucket_size")),
                    "DeepSpeed ZeRO all-gather bucket (elements)"),
        FeatureSpec("overlap_comm", "engine.overlap_comm", "speed", None,
                    _first(_inert_single_worker("deepspeed"), _deepspeed_stage("overlap_comm")),
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


def differing_features(before: LaneConfig, after: LaneConfig) -> list[tuple[str, Any, Any]]:
    """(feature, value in ``before``, value in ``after``) for every feature the two lanes run differently: what a
    lane's baselines become when it is planned on another device (``ablate.sweep.run``, ``ablate validate --plan``)."""
    return [(name, spec.get(before), spec.get(after)) for name, spec in sorted(FEATURES.items())
            if spec.get(after) != spec.get(before)]
