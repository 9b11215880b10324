"""Verdicts at the lane's horizon: start-up never counts, one-time costs amortise, thresholds mean what they say.

The simulated arms split their time exactly as real receipts do (``ablate.receipts.derive``): executor start-up
(recorded, excluded), one-time feature cost, and a recurring step time; every receipt passes the validator.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from conftest import DEFAULTS
from promote_sim import FeatureTruth, Sim, T0, base_lane, make_receipt, moe, simulate

from ablate.promote import HOLD, PROMOTE, REJECT, Policy, PromotionResult, promote
from ablate.promote.analysis import FeatureVerdict, break_even
from ablate.promote.match import match_blocks
from ablate.receipts.schema import Receipt

QUIET = {"noise": 0.007, "aa_per_host": 2}


def run(receipts: list[Receipt], policy: Policy, **kwargs: Any) -> PromotionResult:
    return promote(receipts, policy_path=policy, defaults_path=DEFAULTS, **kwargs)


def verdict_of(result: PromotionResult, feature: str = "moe_dispatch") -> FeatureVerdict:
    matches = [v for v in result.verdicts if v.feature == feature]
    assert len(matches) == 1
    return matches[0]


def _pair(policy: Policy, base_startup: float, cand_startup: float, cand_tps: float = 5000.0) -> float:
    lane = base_lane(**{"features.moe_dispatch": "padded"})
    common: dict[str, Any] = dict(sweep_id="s1", block_id="b1", feature="moe_dispatch", baseline_value="padded",
                                  host="node-0", loss=5.0, created_at=T0)
    base = make_receipt(receipt_id="a0", arm="baseline", arm_index=0, order=0, feature_value="padded", lane=lane,
                        tps=5000.0, startup_s=base_startup, **common)
    cand = make_receipt(receipt_id="a1", arm="candidate", arm_index=1, order=1, feature_value="jagged",
                        lane={**lane, "features.moe_dispatch": "jagged"}, tps=cand_tps, startup_s=cand_startup,
                        **common)
    blocks, refusals = match_blocks([base, cand], policy)
    assert not refusals and len(blocks) == 1
    ratio = blocks[0].log_ratio(policy.failures.failed_log_ratio)
    assert ratio is not None
    return ratio


def test_a_feature_independent_startup_difference_is_no_win_and_no_loss(policy: Policy) -> None:
    # The candidate's process took 3x longer to start (imports, a busy disk): the block says exactly 1.0x.
    assert _pair(policy, base_startup=2.0, cand_startup=6.0) == pytest.approx(0.0, abs=1e-12)
    assert _pair(policy, base_startup=6.0, cand_startup=2.0) == pytest.approx(0.0, abs=1e-12)
    # ... while a real 5% faster step still shows, whatever the start-up did.
    assert math.exp(_pair(policy, 2.0, 6.0, cand_tps=5250.0)) == pytest.approx(1.05, rel=2e-3)


@pytest.mark.parametrize("seed", range(3))
def test_startup_jitter_alone_never_promotes_or_rejects_a_null_feature(policy: Policy, seed: int) -> None:
    sim = Sim(features=[moe(1.0)], startup_jitter=0.5, **QUIET)
    v = verdict_of(run(simulate(sim, 40 + seed), policy))
    assert v.verdict != PROMOTE
    assert v.speedup == pytest.approx(1.0, abs=0.015)  # the estimate does not see the start-up at all


def test_a_one_time_cost_counts_at_a_short_horizon_and_amortises_at_a_long_one(policy: Policy) -> None:
    # 5% faster per step for 40 s extra one-time cost (a compile): the 0.2 s step saves ~9.5 ms, so the
    # feature pays for itself after ~4,200 steps. At 500 steps it is a loss; at 200,000 a win.
    truth = FeatureTruth("moe_dispatch", "jagged", "padded", ratio=1.05, one_time_s=40.0)
    short = verdict_of(run(simulate(Sim(features=[truth], horizon=500, **QUIET), 2), policy))
    long = verdict_of(run(simulate(Sim(features=[truth], horizon=200_000, **QUIET), 2), policy))
    assert short.speedup < 0.9 and short.verdict == REJECT, short.reason
    assert long.verdict == PROMOTE and long.speedup == pytest.approx(1.05, abs=0.01)
    for v in (short, long):  # the steady speed-up and the one-time delta do not depend on the horizon
        assert v.steady_speedup == pytest.approx(1.05, abs=0.01)
        assert v.one_time_delta_s == pytest.approx(40.0, abs=0.5)
        assert v.break_even["kind"] == "after" and 3_500 < v.break_even["steps"] < 5_000
        curve = {round(p["horizon"]): p["speedup"] for p in v.curve}
        assert min(curve.items())[1] < 1.0 < max(curve.items())[1]  # the plotted curve crosses 1


def _fixed_campaign(base_tps: float, cand_tps: float, extra_one_time_s: float) -> list[Receipt]:
    """Two rounds of 4 blocks and 2 A/A blocks, every arm exactly as specified (no noise at all)."""
    from datetime import timedelta

    receipts = []
    for r in range(2):
        for b in range(6):
            aa = b >= 4
            block = f"r{r}b{b}"
            lane = base_lane(**{"features.moe_dispatch": "padded"})
            for index in (0, 1):
                cand = index == 1 and not aa
                receipts.append(make_receipt(
                    receipt_id=f"{block}-{index}", sweep_id=f"round-{r}", block_id=block,
                    arm="aa" if aa else ("candidate" if cand else "baseline"), arm_index=index,
                    order=(index + b) % 2, feature=None if aa else "moe_dispatch",
                    feature_value=None if aa else ("jagged" if cand else "padded"),
                    baseline_value=None if aa else "padded",
                    lane={**lane, "features.moe_dispatch": "jagged"} if cand else lane, host="node-0",
                    tps=cand_tps if cand else base_tps, loss=5.0, one_time_extra_s=extra_one_time_s if cand else 0.0,
                    created_at=T0 + timedelta(days=r, minutes=b), device="cuda"))
    return receipts


def test_break_even_equals_the_hand_calculation(single_node_policy: Policy) -> None:
    receipts = _fixed_campaign(base_tps=5000.0, cand_tps=5500.0, extra_one_time_s=12.0)
    v = verdict_of(run(receipts, single_node_policy))
    # By hand: the step is tokens / tps; one-time = setup + the explicit warmup step (simulated at 3 steps'
    # cadence) + the candidate's extra 12 s; it pays for itself when 12 s + 3 (c - b) = H (b - c).
    b, c = 1024 / 5000.0, 1024 / 5500.0
    assert v.one_time_delta_s == pytest.approx(12.0 + 3 * (c - b), rel=1e-9)
    assert v.steady_speedup == pytest.approx(1.1, rel=1e-9)
    assert v.break_even["kind"] == "after"
    assert v.break_even["steps"] == pytest.approx((12.0 + 3 * (c - b)) / (b - c), rel=1e-9)
    # The verdict's speed-up at the lane's 10,000-step horizon, by hand.
    expected = (0.05 + 3 * b + 10_000 * b) / (0.05 + 12.0 + 3 * c + 10_000 * c)
    assert v.speedup == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("one_time", "saving", "kind"), [(5.0, 0.01, "after"), (-1.0, 0.01, "immediately"),
                                                          (0.0, 0.01, "immediately"), (-3.0, -0.01, "until"),
                                                          (2.0, -0.01, "never"), (2.0, 0.0, "never")])
def test_break_even_cases(one_time: float, saving: float, kind: str) -> None:
    found = break_even(one_time, saving)
    assert found["kind"] == kind
    if kind in ("after", "until"):
        assert found["steps"] == pytest.approx(one_time / saving)


def test_a_true_13_percent_win_under_measured_noise_is_never_rejected_and_is_promoted_with_16_blocks(
        single_node_policy: Policy) -> None:
    # One node (the single-node profile), two rounds of 8 blocks plus 4 A/A blocks each, ±20% start-up jitter
    # per arm and 3% per-arm noise on the step time (4.2% per block): the known-truth CPU campaign of the issue,
    # where the old wall-clock metric with a single-block A/A threshold rejected a real 1.25x win.
    sim = Sim(features=[moe(1.13)], hosts=1, blocks_per_host=8, aa_per_host=4, noise=0.03, host_sd=0.0,
              startup_jitter=0.2)
    verdicts = [verdict_of(run(simulate(sim, 500 + seed), single_node_policy)) for seed in range(40)]
    assert all(v.n_blocks == 16 for v in verdicts)
    assert not [v.reason for v in verdicts if v.verdict == REJECT]
    promoted = sum(v.verdict == PROMOTE for v in verdicts)
    assert promoted >= 38, [v.reason for v in verdicts if v.verdict != PROMOTE]


def test_no_reject_on_a_threshold_from_too_few_aa_blocks(policy: Policy) -> None:
    # A clear null, but one A/A block per round on one host: the lane is uncalibrated, so the verdict is HOLD.
    sim = Sim(features=[moe(1.0)], noise=0.002, aa_per_host=0, hosts=3)
    v = verdict_of(run(simulate(sim, 3), policy))
    assert v.aa_blocks == 0 and v.verdict == HOLD
    assert "win_possible" not in [c.name for c in v.clauses if not c.passed]
    calibrated = verdict_of(run(simulate(Sim(features=[moe(1.0)], noise=0.002, aa_per_host=2), 3), policy))
    assert calibrated.verdict == REJECT and "no meaningful win" in calibrated.reason


def test_delta_is_the_minimum_effect_plus_the_aa_bias_bound(policy: Policy) -> None:
    quiet = verdict_of(run(simulate(Sim(features=[moe(1.05)], noise=0.002, aa_per_host=2), 1), policy))
    assert quiet.delta == pytest.approx(math.expm1(math.log1p(0.01) + math.log1p(quiet.bias_bound)), rel=1e-9)
    assert quiet.delta < 0.02  # a quiet lane with no bias costs little above the 1% floor
    biased = verdict_of(run(simulate(Sim(features=[moe(1.05)], noise=0.002, aa_per_host=2, slot_bias=0.03), 1),
                            policy))
    assert biased.delta > 0.035 and biased.aa_interval[0] > 1.0  # the A/A interval excludes 1: bias found


def test_more_blocks_tighten_the_interval_instead_of_raising_the_bar(policy: Policy) -> None:
    small = verdict_of(run(simulate(Sim(features=[moe(1.03)], noise=0.02, aa_per_host=2), 4), policy))
    large = verdict_of(run(simulate(Sim(features=[moe(1.03)], noise=0.02, aa_per_host=2, blocks_per_host=8), 4),
                           policy))
    width = lambda v: math.log(v.ci95[1] / v.ci95[0])  # noqa: E731
    assert width(large) < 0.7 * width(small)
    assert large.delta < small.delta + 0.005  # the bar is the effect floor plus bias, not single-block spread


def test_blocks_with_an_odd_startup_or_under_foreign_load_are_flagged_not_counted_differently(
        single_node_policy: Policy) -> None:
    receipts = _fixed_campaign(base_tps=5000.0, cand_tps=5500.0, extra_one_time_s=0.0)
    odd = next(r for r in receipts if r.identity.block_id == "r0b1" and r.identity.arm.value == "candidate")
    odd.time.badput_s["startup"] = 3 * odd.time.badput_s["startup"]  # the lane's other blocks start alike
    busy = next(r for r in receipts if r.identity.block_id == "r1b2" and r.identity.arm.value == "baseline")
    busy.host_load.contended = True
    v = verdict_of(run(receipts, single_node_policy))
    assert [f.split(":")[0] for f in v.startup_flags] == ["round-0/r0b1"]
    assert v.contended_blocks == ["round-1/r1b2"]
    assert v.steady_speedup == pytest.approx(1.1, rel=1e-9)  # start-up never enters the comparison
    detail = run(receipts, single_node_policy).markdown
    assert "start-up differ beyond the lane's usual spread" in detail and "HOST_CONTENDED" in detail


def test_energy_per_token_is_reported_beside_the_speed_up_and_never_decides(policy: Policy) -> None:
    from ablate.promote.report import render_markdown
    from ablate.receipts.schema import Energy

    receipts = simulate(Sim(features=[moe(1.10)], **QUIET), 5)
    plain = verdict_of(run(receipts, policy))

    def with_energy(r: Receipt) -> Receipt:
        # The candidate draws 20% less per token; the A/A twins alike. One source: ratios across sources are refused.
        jpt = 0.8e-3 if r.identity.arm.value == "candidate" else 1.0e-3
        tokens = r.throughput.tokens
        energy = Energy(source="rapl", scope="CPU package-0 (host-wide)", joules=jpt * tokens, seconds=1.0,
                        tokens=tokens, joules_per_token=jpt, mean_watts=jpt * tokens)
        return r.model_copy(update={"energy": energy})

    result = run([with_energy(r) for r in receipts], policy)
    v = verdict_of(result)
    assert v.energy["ratio"] == pytest.approx(0.8) and v.energy["blocks"] == v.n_blocks and v.energy["host_wide"]
    assert (v.verdict, v.speedup) == (plain.verdict, plain.speedup), "energy never changes a verdict"
    assert "0.800× (" in render_markdown(result) and "energy/token" in render_markdown(result)
    assert plain.energy["ratio"] is None and "no arm measured energy" in plain.energy["why"]


def test_break_even_is_where_the_projected_times_cross_when_an_arm_skips_warmup(single_node_policy: Policy) -> None:
    """A candidate that skips warmup projects its compiling first budget step inside its one-time cost, and its
    horizon counts that step (``project_time``: one + (H - w) r). The break-even read off the one-time costs
    alone was off by those steps (measurement review); it is where the two projections cross."""
    from ablate.receipts.derive import project_time

    receipts = []
    for block in range(8):
        for cand in (False, True):
            lane = base_lane(**{"features.moe_dispatch": "jagged" if cand else "padded"})
            receipts.append(make_receipt(
                receipt_id=f"r-{block}-{int(cand)}", sweep_id="s1", block_id=f"b{block}",
                arm="candidate" if cand else "baseline", arm_index=int(cand), order=int(cand) ^ (block % 2),
                feature="moe_dispatch", feature_value="jagged" if cand else "padded", baseline_value="padded",
                lane=lane, host=f"node-{block % 3}", tps=5500.0 if cand else 5000.0, loss=5.0,
                one_time_extra_s=12.0 if cand else 0,
                created_at=T0 + timedelta(minutes=block), device="cuda", warmup="skip" if cand else "explicit"))
    v = verdict_of(run(receipts, single_node_policy))
    steps = v.break_even["steps"]
    assert v.break_even["kind"] == "after"
    base, cand = (next(r for r in receipts if r.identity.arm_index == i).projection for i in (0, 1))
    assert cand.warm_budget_steps == 1 and base.warm_budget_steps == 0
    cross = (project_time(cand.one_time_s, cand.recurring_step_s, 1, math.ceil(steps)),
             project_time(base.one_time_s, base.recurring_step_s, 0, math.ceil(steps)))
    before = (project_time(cand.one_time_s, cand.recurring_step_s, 1, math.floor(steps) - 1),
              project_time(base.one_time_s, base.recurring_step_s, 0, math.floor(steps) - 1))
    assert cross[0] <= cross[1] and before[0] > before[1], (steps, cross, before)
