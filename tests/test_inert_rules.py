"""Static inert rules (ablate/config/features.py): each fires where the two arms provably run the same code, and
stays silent in the close cases where the code differs or depends on the node.

Where a rule leans on a fact about the code that runs (the warmup rule, the dispatcher's fallbacks, where the
fused residual norm is called under compile), a test here checks that fact against the real code too.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import pytest

from ablate.config.features import FEATURES
from ablate.config.load import load_lane
from ablate.config.schema import LaneConfig


def lane(**sections: Any) -> LaneConfig:
    return load_lane(sections)


def with_warmup(sections: dict[str, Any], policy: str) -> LaneConfig:
    return lane(**{**sections, "compile": {**sections.get("compile", {}), "warmup": policy}})


def inert(name: str, candidate: LaneConfig, baseline: Any = None) -> Optional[str]:
    return FEATURES[name].inert_reason(candidate, baseline)


# --- warmup -------------------------------------------------------------------------------------------------

def test_the_registry_applies_the_trainers_warmup_rule_itself() -> None:
    """One rule, not a copy kept equal: the registry calls the trainer's torch-free ``resolve_warmup``."""
    from ablate.config.features import warmup_decision
    from ablate.config.warmup import resolve_warmup
    from trainers import loop

    assert loop.resolve_warmup is resolve_warmup
    for policy, device, posture, letters, steps in itertools.product(
            ("explicit", "skip", "auto"), ("cpu", "cuda"), ("eager", "regional", "whole"), ("AEMR", "AMR"), (0, 2)):
        decision = resolve_warmup(policy, device, posture, letters, steps)
        assert warmup_decision(policy, device, posture, letters, steps) == (decision.resolved, decision.steps)
        skipped = steps == 0 or policy == "skip" or (policy == "auto" and device == "cuda" and posture == "regional"
                                                      and "E" in letters)
        assert decision.resolved == ("skip" if skipped else "explicit") and decision.steps == (0 if skipped else 2)


@pytest.mark.parametrize(("sections", "candidate", "baseline", "fragment"), [
    # eager: auto resolves to explicit on every device, like the explicit baseline.
    ({"compile": {"posture": "eager"}}, "auto", "explicit", "on cpu: explicit warmup (2 steps); on cuda"),
    # a CPU lane: auto cannot meet its CUDA condition.
    ({"compile": {"posture": "regional"}, "hardware": {"device": "cpu"}}, "auto", "explicit", "on cpu"),
    # no E blocks: auto warms up explicitly even on CUDA + regional.
    ({"compile": {"posture": "regional"}, "model": {"pattern": "AMR"}}, "auto", "explicit", "E blocks: no"),
    # a CUDA lane without fallback, regional, E blocks: auto skips, like the skip baseline.
    ({"compile": {"posture": "regional"}, "hardware": {"device": "cuda"}}, "auto", "skip", "on cuda: no explicit"),
    # no warmup steps: every policy skips.
    ({"compile": {"posture": "eager", "warmup_steps": 0}}, "skip", "explicit", "no explicit warmup"),
])
def test_warmup_is_inert_where_both_policies_decide_the_same(sections: dict[str, Any], candidate: str,
                                                             baseline: str, fragment: str) -> None:
    reason = inert("warmup", with_warmup(sections, candidate), baseline)
    assert reason is not None and fragment in reason, reason


@pytest.mark.parametrize(("sections", "candidate", "baseline"), [
    # device auto + regional + E blocks: auto skips on a CUDA node and warms up on a CPU node.
    ({"compile": {"posture": "regional"}}, "auto", "explicit"),
    # eager still runs explicit warmup steps (at lr 0, billed as warmup); skip runs none.
    ({"compile": {"posture": "eager"}}, "skip", "explicit"),
    ({"compile": {"posture": "eager"}}, "skip", "auto"),
    # a CUDA lane that may fall back to CPU: there auto warms up and skip does not.
    ({"compile": {"posture": "regional"}, "hardware": {"device": "cuda", "cpu_fallback": True}}, "auto", "skip"),
    # whole compile is not regional: auto warms up explicitly even on CUDA, skip does not.
    ({"compile": {"posture": "whole"}, "hardware": {"device": "cuda"}}, "auto", "skip"),
])
def test_warmup_is_not_inert_where_a_device_decides_differently(sections: dict[str, Any], candidate: str,
                                                                baseline: str) -> None:
    assert inert("warmup", with_warmup(sections, candidate), baseline) is None


def test_warmup_without_a_baseline_is_inert_only_when_no_policy_can_warm_up() -> None:
    # The old rule called every policy inert under eager; explicit warmup steps run under eager too.
    assert inert("warmup", lane(compile={"posture": "eager", "warmup": "skip"})) is None
    reason = inert("warmup", lane(compile={"posture": "eager", "warmup": "skip", "warmup_steps": 0}))
    assert reason is not None and "warmup_steps is 0" in reason


def test_the_baseline_may_be_a_lane_an_enum_or_the_lane_itself() -> None:
    from ablate.config.schema import WarmupPolicy

    candidate = lane(compile={"posture": "eager", "warmup": "auto"})
    baseline_lane = lane(compile={"posture": "eager", "warmup": "explicit"})
    assert inert("warmup", candidate, baseline_lane) == inert("warmup", candidate, WarmupPolicy.explicit) \
        == inert("warmup", candidate, "explicit") is not None
    # The baseline arm passing its own value learns nothing about the pair: only all-baseline rules apply.
    assert inert("warmup", candidate, "auto") is None


# --- DeepSpeed ZeRO buckets and overlap ---------------------------------------------------------------------

def ds(stage: int, device: str = "cpu", **engine: Any) -> LaneConfig:
    return lane(engine={"name": "deepspeed", "workers": 2, "zero_stage": stage, **engine},
                hardware={"device": device})


def test_stage0_reads_no_bucket_and_no_overlap() -> None:
    for name, value in (("reduce_bucket_size", 20_000), ("allgather_bucket_size", 20_000), ("overlap_comm", True)):
        reason = inert(name, ds(0, device="auto", **{name: value}))
        assert reason is not None and "stage 0" in reason, name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_reduce_bucket_acts_at_stages_1_to_3(stage: int) -> None:
    assert inert("reduce_bucket_size", ds(stage, reduce_bucket_size=20_000), 500_000_000) is None


def test_the_allgather_bucket_is_inert_at_stage3_and_at_stages_1_2_when_both_values_are_even() -> None:
    assert "prefetch" in (inert("allgather_bucket_size", ds(3, allgather_bucket_size=20_000)) or "")
    for stage in (1, 2):
        reason = inert("allgather_bucket_size", ds(stage, allgather_bucket_size=20_000), 500_000_000)
        assert reason is not None and "all_gather_into_tensor" in reason
        # An odd value fails DeepSpeed's alignment assert: that arm does not run the same code.
        assert inert("allgather_bucket_size", ds(stage, allgather_bucket_size=20_001), 500_000_000) is None
        assert inert("allgather_bucket_size", ds(stage, allgather_bucket_size=20_000), 500_000_001) is None
        # Without the baseline its parity is unknown.
        assert inert("allgather_bucket_size", ds(stage, allgather_bucket_size=20_000)) is None


def test_overlap_is_inert_at_stage3_only_on_a_cpu_lane() -> None:
    reason = inert("overlap_comm", ds(3, overlap_comm=True), False)
    assert reason is not None and "synchronized device" in reason
    assert inert("overlap_comm", ds(3, device="auto", overlap_comm=True), False) is None
    assert inert("overlap_comm", ds(3, device="cuda", overlap_comm=True), False) is None
    # Stages 1 and 2 branch on overlap_comm on CPU too (reduce in hooks, double buffers).
    for stage in (1, 2):
        assert inert("overlap_comm", ds(stage, overlap_comm=True), False) is None


def test_the_one_worker_and_other_engine_rules_still_come_first() -> None:
    one = lane(engine={"name": "deepspeed", "workers": 1, "zero_stage": 2, "reduce_bucket_size": 1000})
    assert "one worker" in (inert("reduce_bucket_size", one, 500_000_000) or "")
    ddp = lane(engine={"name": "ddp", "workers": 2, "overlap_comm": True})
    assert "lane runs ddp" in (inert("overlap_comm", ddp, False) or "")


# --- fused residual under compile ---------------------------------------------------------------------------

@pytest.mark.parametrize("posture", ["regional", "whole"])
@pytest.mark.parametrize(("candidate", "baseline"), [("on", "off"), ("off", "on"), ("on", None)])
def test_fused_residual_is_inert_under_compile_on_cpu(posture: str, candidate: str, baseline: Optional[str]) -> None:
    reason = inert("fused_residual", lane(features={"fused_residual": candidate}, compile={"posture": posture},
                                          hardware={"device": "cpu"}), baseline)
    assert reason is not None and f"{posture} compile on CPU" in reason


@pytest.mark.parametrize("sections", [
    {"compile": {"posture": "regional"}, "hardware": {"device": "auto"}},  # on CUDA the Triton op runs
    {"compile": {"posture": "whole"}, "hardware": {"device": "auto"}},
    {"compile": {"posture": "whole"}, "hardware": {"device": "cuda"}},
    {"compile": {"posture": "regional"}, "hardware": {"device": "cuda", "cpu_fallback": True}},
    {"compile": {"posture": "eager"}, "hardware": {"device": "cpu"}},      # the Inductor kernel runs eagerly
])
def test_fused_residual_acts_or_is_undecidable_elsewhere(sections: dict[str, Any]) -> None:
    assert inert("fused_residual", lane(features={"fused_residual": "on"}, **sections), "off") is None


def _norm_functions(fused: str, posture: str) -> set[Any]:
    """The add + RMSNorm functions a CPU HybridLM's norms call, its dispatcher built as trainers/loop.py builds it."""
    import torch

    from kernels.dispatch import Dispatcher
    from trainers.model import HybridLM
    from trainers.model.blocks import ResidualNorm

    tiny = lane(features={"fused_residual": fused}, compile={"posture": posture})
    model = HybridLM(tiny.model, tiny.features,
                     Dispatcher(torch.device("cpu"), strict=False, compile_posture=posture))
    norms = [m for m in model.modules() if isinstance(m, ResidualNorm)]
    assert model.final_norm in norms and len(norms) > 1      # the final norm runs outside every block region
    return {norm.add_rmsnorm for norm in norms}


@pytest.mark.parametrize("posture", ["regional", "whole"])
def test_under_compile_on_cpu_every_norm_of_fused_on_calls_the_reference(posture: str) -> None:
    from kernels.norm import add_rmsnorm_ref

    assert _norm_functions("on", posture) == _norm_functions("off", posture) == {add_rmsnorm_ref}


def test_under_eager_on_cpu_fused_on_calls_the_inductor_path() -> None:
    import torch

    from kernels.capability import probe
    from kernels.norm import add_rmsnorm_compiled, add_rmsnorm_ref

    if not probe(torch.device("cpu")).cpp_compiler:
        pytest.skip("no C++ compiler: the compiled backend falls back to the reference here")

    assert _norm_functions("on", "eager") == {add_rmsnorm_compiled} != _norm_functions("off", "eager") == {
        add_rmsnorm_ref}


# --- dispatcher fallbacks on a CPU lane ---------------------------------------------------------------------

@pytest.mark.parametrize(("name", "candidate", "baseline", "runs"), [
    ("moe_dispatch", "grouped_mm", "jagged", "jagged"),
    ("moe_dispatch", "jagged", "grouped_mm", "jagged"),
    ("mamba_scan", "mamba_ssm", "chunked", "chunked"),
])
def test_a_value_that_falls_back_to_the_baseline_backend_on_cpu_is_inert(name: str, candidate: str,
                                                                         baseline: str, runs: str) -> None:
    import torch

    from kernels.dispatch import Dispatcher

    reason = inert(name, lane(features={name: candidate}, hardware={"device": "cpu"}), baseline)
    assert reason is not None and f"{runs!r} backend" in reason
    # The fact behind it: on a CPU device the dispatcher hands both values the same function.
    op = {"moe_dispatch": "moe", "mamba_scan": "ssd"}[name]
    ctx = {"dims": (64, 128, 256)} if op == "moe" else {"conv_channels": 160}
    dispatcher = Dispatcher(torch.device("cpu"), strict=False)
    assert dispatcher.resolve(op, candidate, **ctx).fn is dispatcher.resolve(op, baseline, **ctx).fn


@pytest.mark.parametrize(("name", "candidate", "baseline", "device"), [
    ("moe_dispatch", "grouped_mm", "padded", "cpu"),     # falls back to jagged, which is not padded
    ("mamba_scan", "mamba_ssm", "sequential", "cpu"),
    ("mamba_scan", "mamba_ssm", "chunked", "cuda"),
    ("mamba_scan", "chunked", "sequential", "cpu"),
])
def test_a_value_that_runs_other_code_or_depends_on_the_node_is_not_inert(name: str, candidate: str,
                                                                          baseline: str, device: str) -> None:
    assert inert(name, lane(features={name: candidate}, hardware={"device": device}), baseline) is None


def test_grouped_mm_runs_only_in_bf16_lanes() -> None:
    from kernels.capability import Capability
    from kernels.dispatch import get_op

    # On CUDA SM90/100 in a bf16 lane grouped_mm really runs: whether the node has one is the node's business.
    assert inert("moe_dispatch", lane(precision="bf16", features={"moe_dispatch": "grouped_mm"},
                                      hardware={"device": "auto"}), "jagged") is None
    # In an fp32 lane its bf16 GEMMs would trade precision for speed: it falls back to jagged, so against jagged it
    # is refused before any arm runs.
    reason = inert("moe_dispatch", lane(features={"moe_dispatch": "grouped_mm"}, hardware={"device": "auto"}),
                   "jagged")
    assert reason is not None and "bf16" in reason and "'jagged' backend" in reason
    best = Capability(device_type="cuda", torch_version="2.13", cuda_available=True, cuda_capability=(9, 0),
                      triton_importable=True, mamba_ssm_importable=True, grouped_mm_available=True,
                      grouped_mm_fast_path=True, cpp_compiler=True)
    impl = get_op("moe").impls["grouped_mm"]
    assert impl.eligible(best, {"dims": (64, 128, 256), "precision": "bf16"})[0]
    for ctx in ({"dims": (64, 128, 256), "precision": "fp32"}, {"dims": (64, 128, 256)}):
        eligible, why = impl.eligible(best, ctx)
        assert not eligible and "bf16" in why and impl.fallback == "jagged"


@pytest.mark.parametrize(("name", "candidate", "baseline", "model", "ctx"), [
    # d_expert 36: grouped GEMM needs multiples of 8, so even an SM90 GPU falls back to jagged.
    ("moe_dispatch", "grouped_mm", "jagged", {"d_expert": 36}, {"dims": (64, 36, 72), "precision": "bf16"}),
    # conv channels 2 * 64 + 2 * 18 = 164: mamba_ssm needs a multiple of 8 even on CUDA.
    ("mamba_scan", "mamba_ssm", "chunked", {"ssm_d_state": 18}, {"conv_channels": 164}),
])
def test_a_value_whose_kernel_can_never_run_on_this_shape_is_inert_on_any_device(
        name: str, candidate: str, baseline: str, model: dict[str, Any], ctx: dict[str, Any]) -> None:
    from kernels.capability import Capability
    from kernels.dispatch import get_op

    reason = inert(name, lane(model=model, precision="bf16", features={name: candidate}, hardware={"device": "auto"}), baseline)
    assert reason is not None and "multiple" in reason
    # The fact behind it: on the best-equipped CUDA node the candidate's own backend is still not eligible.
    best = Capability(device_type="cuda", torch_version="2.13", cuda_available=True, cuda_capability=(9, 0),
                      triton_importable=True, mamba_ssm_importable=True, grouped_mm_available=True,
                      grouped_mm_fast_path=True, cpp_compiler=True)
    op = {"moe_dispatch": "moe", "mamba_scan": "ssd"}[name]
    eligible, _ = get_op(op).impls[candidate].eligible(best, ctx)
    assert not eligible and get_op(op).impls[candidate].fallback == baseline


def test_the_family_rule_needs_no_baseline() -> None:
    reason = inert("moe_dispatch", lane(model={"pattern": "AMR"}, features={"moe_dispatch": "jagged"}))
    assert reason is not None and "no E (MoE) blocks" in reason
