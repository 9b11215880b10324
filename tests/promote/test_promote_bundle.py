"""Bundle check (issue 15): two wins in one lane are written together only if they win together."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from promote_sim import FeatureTruth, Sim, moe, simulate, simulate_bundle
from ruamel.yaml import YAML

from ablate.promote import PROMOTE, Policy, PromotionResult, promote, with_overrides, write_defaults
from ablate.receipts.schema import Receipt

NEW = {"moe_dispatch": "jagged", "mamba_scan": "chunked"}
OLD = {"moe_dispatch": "padded", "mamba_scan": "sequential"}


@pytest.fixture(scope="module")
def singles() -> list[Receipt]:
    # moe 5% and mamba 6% on their own, each against the old defaults; clearly promoted.
    features = [moe(1.05), FeatureTruth("mamba_scan", "chunked", "sequential", 1.06)]
    return simulate(Sim(features=features, noise=0.003, aa_per_host=2), 0)


def run(receipts: list[Receipt], policy: Policy, defaults_file: Path) -> PromotionResult:
    return promote(receipts, policy_path=policy, defaults_path=defaults_file)


def test_without_bundle_blocks_the_set_is_held_from_write(singles: list[Receipt], policy: Policy,
                                                         defaults_file: Path) -> None:
    result = run(singles, policy, defaults_file)
    assert sorted(v.verdict for v in result.verdicts) == [PROMOTE, PROMOTE]  # each wins on its own evidence
    [check] = result.bundles
    assert check.status == "not_measured" and check.values == NEW and check.old == OLD
    assert "bundle not measured" in check.reason and "mamba_scan=chunked, moe_dispatch=jagged together" in check.reason
    assert result.changes == []  # nothing is written silently
    before = defaults_file.read_text()
    assert write_defaults(result, defaults_file) == [] and defaults_file.read_text() == before
    assert "### Bundle check" in result.markdown and "held from --write" in result.markdown


def test_wins_that_do_not_add_up_are_caught(singles: list[Receipt], policy: Policy, defaults_file: Path) -> None:
    # Together the two only reach 2%: less than either alone.
    result = run(singles + simulate_bundle(NEW, OLD, 1.02, 3), policy, defaults_file)
    [check] = result.bundles
    assert check.status == "failed" and check.num_blocks == 12 and result.changes == []
    assert check.bundle_speedup == pytest.approx(1.02, abs=0.01)
    expected = math.log(check.bundle_speedup) - sum(math.log(s) for s in check.singles.values())
    assert check.interaction == pytest.approx(expected) and check.interaction < -0.07
    assert "falls short of the best single (mamba_scan" in check.reason and "interaction estimate" in check.reason
    row = next(x for x in result.markdown.splitlines() if x.startswith("| ") and "failed" in x)
    assert f"{check.interaction:+.4f}" in row
    assert json.loads(result.to_json())["bundles"][0]["interaction"] == pytest.approx(check.interaction)


def test_wins_that_add_up_are_written_together(singles: list[Receipt], policy: Policy, defaults_file: Path) -> None:
    result = run(singles + simulate_bundle(NEW, OLD, 1.05 * 1.06, 4), policy, defaults_file)
    [check] = result.bundles
    assert check.status == "passed" and abs(check.interaction) < 0.02
    assert sorted((c.feature, c.new) for c in result.changes) == sorted(NEW.items())
    write_defaults(result, defaults_file)
    data = YAML(typ="safe").load(defaults_file.read_text())
    assert {f: data["features"][f]["value"] for f in NEW} == NEW


def test_a_combination_that_falls_back_fails_the_set(singles: list[Receipt], policy: Policy,
                                                     defaults_file: Path) -> None:
    # Hole: bundle blocks whose candidate fell back were dropped from the rows without a word, and the other 8
    # passed the set: both values were written although a third of the combined runs never ran them.
    from ablate.receipts.schema import Code, Disqualifier, Status

    bundle = simulate_bundle(NEW, OLD, 1.05 * 1.06, 4)
    candidates = [r for r in bundle if r.identity.arm.value == "candidate"]
    for arm in candidates[::3]:
        arm.disqualifiers.append(Disqualifier(code=Code.BACKEND_FALLBACK, detail="combined: grouped GEMM fell back"))
        arm.identity.status = Status.disqualified
    result = run(singles + bundle, policy, defaults_file)
    [check] = result.bundles
    assert check.status == "failed" and "BACKEND_FALLBACK x4" in check.reason and result.changes == []


def _failed(arm: Receipt) -> None:
    from ablate.receipts.schema import Code, Disqualifier, Status

    arm.identity.status = Status.failed
    arm.projection = None
    arm.disqualifiers.append(Disqualifier(code=Code.ARM_FAILED))


def test_a_combination_that_crashes_fails_the_set_even_when_its_retries_ran(singles: list[Receipt], policy: Policy,
                                                                             defaults_file: Path) -> None:
    # Hole: the check had no failure clause. Every bundle block crashed once and passed on its retry: the set
    # passed and both values were written, the interaction the check exists to catch.
    import copy

    from ablate.receipts.schema import StepStats

    bundle = simulate_bundle(NEW, OLD, 1.05 * 1.06, 4)
    crashed = []
    for arm in bundle:
        arm.identity.attempt = 1
        if arm.identity.arm.value == "candidate":
            first = copy.deepcopy(arm)
            first.identity.attempt, first.identity.receipt_id = 0, arm.identity.receipt_id + "-attempt0"
            first.steps = StepStats(total=0, warmup=0, steady=0)
            _failed(first)
            crashed.append(first)
    result = run(singles + bundle + crashed, policy, defaults_file)
    [check] = result.bundles
    assert check.status == "failed" and "candidate failed 12/24, baseline 0/12" in check.reason, check.reason
    assert result.changes == []
    # The control: the same blocks without their crashed first attempts pass.
    assert run(singles + bundle, policy, defaults_file).bundles[0].status == "passed"


def test_a_refused_bundle_block_whose_candidate_fell_back_fails_the_set(singles: list[Receipt], policy: Policy,
                                                                        defaults_file: Path) -> None:
    from ablate.receipts.schema import Code, Disqualifier, Status

    bundle = simulate_bundle(NEW, OLD, 1.05 * 1.06, 4)
    victim = next(r for r in bundle if r.identity.arm.value == "candidate")
    victim.disqualifiers.append(Disqualifier(code=Code.BACKEND_FALLBACK, detail="combined: grouped GEMM fell back"))
    victim.identity.status = Status.disqualified
    partner = next(r for r in bundle if r.identity.block_id == victim.identity.block_id and r is not victim
                   and r.identity.sweep_id == victim.identity.sweep_id)
    result = run(singles + [r for r in bundle if r is not partner], policy, defaults_file)
    [check] = result.bundles
    assert check.status == "failed" and "BACKEND_FALLBACK x1" in check.reason and result.changes == []


def test_a_bundle_below_the_best_single_but_within_delta_passes(singles: list[Receipt], policy: Policy,
                                                               defaults_file: Path) -> None:
    # Overlapping wins (the bundle is no better than mamba alone) are still worth writing: nothing is lost.
    result = run(singles + simulate_bundle(NEW, OLD, 1.06, 5), policy, defaults_file)
    [check] = result.bundles
    assert check.status == "passed" and check.interaction < -0.03 and len(result.changes) == 2


def test_bundle_not_required_reports_but_writes(singles: list[Receipt], policy: Policy, defaults_file: Path) -> None:
    result = run(singles, with_overrides(policy, {"bundle.required": False}), defaults_file)
    assert result.bundles[0].status == "not_measured" and len(result.changes) == 2
    # A measured bundle that loses is held whatever the requirement says.
    lost = run(singles + simulate_bundle(NEW, OLD, 1.0, 6), with_overrides(policy, {"bundle.required": False}),
               defaults_file)
    assert lost.bundles[0].status == "failed" and lost.changes == []


def test_a_bundle_block_that_is_not_old_vs_all_new_is_refused(policy: Policy, defaults_file: Path) -> None:
    # Its candidate leaves mamba_scan at the old value while claiming the new one.
    receipts = simulate_bundle(NEW, OLD, 1.05, 7, blocks_per_host=1)
    bad = [r.model_dump(mode="json") for r in receipts]
    for data in bad:
        if data["identity"]["arm"] == "candidate":
            data["requested"]["lane"]["features.mamba_scan"] = "sequential"
    result = promote(bad, policy_path=policy, defaults_path=defaults_file)
    assert result.refusals and all("bundle arm values at features.mamba_scan" in r.reason for r in result.refusals)
    single = simulate_bundle({"moe_dispatch": "jagged"}, {"moe_dispatch": "padded"}, 1.05, 8, blocks_per_host=1)
    refused = promote(single, policy_path=policy, defaults_path=defaults_file).refusals
    assert refused and "two or more features" in refused[0].reason


def test_bundle_evidence_must_be_current_repeated_and_loss_safe(singles: list[Receipt], policy: Policy,
                                                                defaults_file: Path) -> None:
    """A bundle passes the gates a promotion passes, not only its size: blocks under older software do not
    count, one round or one host is not measured, and a loss that is worse together holds the set."""
    good = 1.05 * 1.06
    stale = run(singles + simulate_bundle(NEW, OLD, good, 9, software_fingerprint="sw-0"), policy, defaults_file)
    [check] = stale.bundles
    assert check.status == "not_measured" and "12 more under older software" in check.reason
    assert stale.changes == []

    one_round = run(singles + simulate_bundle(NEW, OLD, good, 10, rounds=1, blocks_per_host=3), policy,
                    defaults_file)
    assert one_round.bundles[0].status == "not_measured" and "1 counted round(s), need 2" in one_round.bundles[0].reason
    one_host = run(singles + simulate_bundle(NEW, OLD, good, 11, hosts=1, blocks_per_host=4), policy, defaults_file)
    assert one_host.bundles[0].status == "not_measured" and "1 host(s), need" in one_host.bundles[0].reason
    assert one_round.changes == one_host.changes == []

    worse = run(singles + simulate_bundle(NEW, OLD, good, 12, loss_effect=0.05), policy, defaults_file)
    [check] = worse.bundles
    assert check.status == "failed" and "the loss is worse together" in check.reason and worse.changes == []


def test_a_held_lane_is_not_written_through_its_shapes_override() -> None:
    from ablate.promote.analysis import FeatureVerdict
    from ablate.promote.defaults_writer import _shape_overrides

    def verdict(lane: str) -> FeatureVerdict:
        return FeatureVerdict(feature="moe_dispatch", value="jagged", baseline_value="padded", kind="speed",
                              lane_key=lane, software_fingerprint="sw-1", lane_shape="shape-aaaaaaaaaaaa",
                              verdict=PROMOTE)

    tests = [verdict("lane-context"), verdict("lane-bundled")]
    overrides, conflicts = _shape_overrides(tests, tests[:1], held=set())
    assert overrides == {"shape-aaaaaaaaaaaa": "jagged"}
    overrides, conflicts = _shape_overrides(tests, tests[:1], held={tests[1].test_key})
    assert overrides == {} and "bundle check held it" in conflicts[0]



def test_wins_from_different_lanes_that_would_run_together_are_held_until_measured_together(
        policy: Policy, defaults_file: Path) -> None:
    from promote_sim import base_lane

    from ablate.config.load import load_defaults

    anywhere = with_overrides(policy, {"scope.global_device_classes": []})  # simulated arms are CPU arms
    quiet = {"noise": 0.007, "aa_per_host": 2}
    lane_b = base_lane(**{"batch.seq_len": 128})
    # moe wins on lane A, mamba on lane B: no lane promoted both, so no bundle check runs; flipped globally,
    # both would run together on every lane, a combination nobody measured.
    receipts = (simulate(Sim(features=[moe(1.05)], lane=base_lane(), block_prefix="A-", **quiet), 0)
                + simulate(Sim(features=[FeatureTruth("mamba_scan", "chunked", "sequential", 1.05)], lane=lane_b,
                               block_prefix="B-", **quiet), 1))
    result = promote(receipts, policy_path=anywhere, defaults_path=defaults_file)
    assert sorted(v.verdict for v in result.verdicts) == [PROMOTE, PROMOTE] and result.bundles == []
    assert [(c.feature, c.new, c.overrides, c.evidence) for c in result.changes] == [
        ("mamba_scan", None, {}, []), ("moe_dispatch", None, {}, [])]
    assert all(c.held.startswith("bundle not measured: mamba_scan=chunked, moe_dispatch=jagged would run "
                                 "together on every lane") for c in result.changes)
    before = defaults_file.read_text()
    assert write_defaults(result, defaults_file) == [] and defaults_file.read_text() == before
    diff = result.markdown.split("### Defaults diff")[1].split("\n### ")[0]
    assert diff.count("| no change (held): bundle not measured:") == 2 and "Rollback" not in diff
    # The control: lane A tests both and its bundle blocks show them winning together; lane B promotes mamba
    # alone. Every lane then runs the measured set: both are written.
    both = [moe(1.05), FeatureTruth("mamba_scan", "chunked", "sequential", 1.05)]
    measured = (simulate(Sim(features=both, lane=base_lane(), block_prefix="A-", **quiet), 0)
                + simulate_bundle(NEW, OLD, 1.05 * 1.05, 4, lane=base_lane())
                + simulate(Sim(features=both[1:], lane=lane_b, block_prefix="B-", **quiet), 1))
    bundled = promote(measured, policy_path=anywhere, defaults_path=defaults_file)
    assert [b.status for b in bundled.bundles] == ["passed"]
    assert sorted((c.feature, c.new, c.held) for c in bundled.changes) == [
        ("mamba_scan", "chunked", ""), ("moe_dispatch", "jagged", "")]
    write_defaults(bundled, defaults_file)
    assert {f: load_defaults(defaults_file).values[f] for f in NEW} == NEW


def test_a_global_flip_onto_a_lane_override_an_earlier_write_made_is_held_until_measured_there(
        policy: Policy, defaults_file: Path) -> None:
    # One --write: a CPU lane's mamba_scan win becomes an override on its shape (CPU evidence never flips a global
    # value). The next: a CUDA lane's moe_dispatch win flips globally, and lanes of that shape would run both, a
    # pair nothing measured (the same two verdicts in one run were held already). Found by review helper 9.
    from promote_sim import base_lane

    from ablate.config.lane_shape import lane_shape
    from ablate.config.load import load_defaults

    quiet = {"noise": 0.007, "aa_per_host": 2}
    cpu_lane = base_lane(**{"batch.seq_len": 128})
    mamba = FeatureTruth("mamba_scan", "chunked", "sequential", 1.05)
    first = promote(simulate(Sim(features=[mamba], lane=cpu_lane, device="cpu", block_prefix="B-", **quiet), 0),
                    policy_path=policy, defaults_path=defaults_file)
    write_defaults(first, defaults_file)
    shape = lane_shape(cpu_lane, "cpu")  # the lane says device auto; its arms ran on CPU
    assert load_defaults(defaults_file).for_shape(shape)["mamba_scan"] == "chunked"
    assert load_defaults(defaults_file).values["mamba_scan"] == "sequential"

    second = promote(simulate(Sim(features=[moe(1.05)], lane=base_lane(), block_prefix="A-", **quiet), 1),
                     policy_path=policy, defaults_path=defaults_file)
    (change,) = second.changes
    assert second.verdicts[0].verdict == PROMOTE and (change.feature, change.new, change.evidence) == (
        "moe_dispatch", None, [])
    assert change.held.startswith(f"bundle not measured: the global flip moe_dispatch=jagged would run on lanes of "
                                  f"{shape} together with their lane override mamba_scan=chunked (report "
                                  f"{first.report_id})"), change.held
    before = defaults_file.read_text()
    assert write_defaults(second, defaults_file) == [] and defaults_file.read_text() == before
    # The control: the same win, measured on a lane of that shape too (its baseline runs the override), flips.
    cpu_lane_now = {**cpu_lane, "features.mamba_scan": "chunked"}
    measured = (simulate(Sim(features=[moe(1.05)], lane=base_lane(), block_prefix="A-", **quiet), 1)
                + simulate(Sim(features=[moe(1.05)], lane=cpu_lane_now, device="cpu", block_prefix="B2-", **quiet),
                           2))
    third = promote(measured, policy_path=policy, defaults_path=defaults_file)
    assert sorted(v.verdict for v in third.verdicts) == [PROMOTE, PROMOTE]
    assert [(c.feature, c.new, c.held) for c in third.changes] == [("moe_dispatch", "jagged", "")]


def test_bundle_sweeps_that_ran_at_the_same_time_are_one_round(singles: list[Receipt], policy: Policy,
                                                                defaults_file: Path) -> None:
    """A sweep's span in time is over all of its blocks, as for the single tests: the second bundle sweep started
    while the first still ran (its later A/A blocks), so the set has one counted round and is held. Found in
    review: windows over the bundle blocks alone made the two sweeps two rounds, and the set was written."""
    from datetime import datetime, timedelta

    from promote_sim import T0, base_lane, lane_key_of, make_receipt

    bundle = simulate_bundle(NEW, OLD, 1.05 * 1.06, 4)  # sim-bundle-r0 on day 2, sim-bundle-r1 on day 3
    apart = run(singles + bundle, policy, defaults_file)
    assert apart.bundles[0].status == "passed" and len(apart.changes) == 2  # the control: two rounds, written
    for receipt in bundle:  # r1 started 100 minutes into day 2 instead
        if receipt.identity.sweep_id == "sim-bundle-r1":
            started = datetime.fromisoformat(receipt.identity.created_at)
            receipt.identity.created_at = (started - timedelta(days=1) + timedelta(minutes=100)).isoformat()
    lane = base_lane() | {"features.moe_dispatch": "padded", "features.mamba_scan": "sequential"}
    still_running = [make_receipt(receipt_id=f"tail-{m}-{i}", sweep_id="sim-bundle-r0", block_id=f"tail-{m}", arm="aa",
                                  arm_index=i, order=i, feature=None, feature_value=None, baseline_value=None,
                                  lane=lane, host="node-0", tps=5000.0 * (1 + 0.001 * i), loss=5.0,
                                  created_at=T0 + timedelta(days=2, minutes=m + i), lane_key=lane_key_of(lane),
                                  device="cuda", seed=m + i)
                     for m in (200, 300) for i in (0, 1)]
    result = run(singles + bundle + still_running, policy, defaults_file)
    [check] = result.bundles
    assert check.status == "not_measured" and "1 counted round(s), need 2" in check.reason, check.reason
    assert result.changes == []


def test_crashes_of_refused_bundle_blocks_fail_the_set(singles: list[Receipt], policy: Policy,
                                                       defaults_file: Path) -> None:
    """Candidate-first bundle blocks whose combination crashed on every attempt leave no baseline and are refused;
    their crashes still fail the set, as a matched bundle block's do (found in review: the set was written)."""
    from datetime import timedelta

    from promote_sim import T0, make_receipt

    bundle = simulate_bundle(NEW, OLD, 1.05 * 1.06, 4)
    cand = next(r for r in bundle if r.identity.arm.value == "candidate")
    crashes = [make_receipt(receipt_id=f"bx{n}-a1-t{t}", sweep_id="sim-bundle-r1", block_id=f"bx{n}", arm="candidate",
                            arm_index=1, order=0, attempt=t, feature="bundle", feature_value=dict(NEW),
                            baseline_value=dict(OLD), lane=cand.requested.lane, host=f"node-{n}", tps=None, loss=None,
                            status="failed", created_at=T0 + timedelta(days=3, minutes=500 + 5 * n + t),
                            lane_key=cand.identity.lane_key, device="cuda", seed=n * 10 + t)
               for n in range(3) for t in range(2)]
    assert run(singles + bundle, policy, defaults_file).bundles[0].status == "passed"  # the control
    result = run(singles + bundle + crashes, policy, defaults_file)
    [check] = result.bundles
    assert check.status == "failed" and result.changes == []
    assert "with 3 refused bundle block(s): candidate 6/18 (6 of the candidate's failures there)" in check.reason


def test_a_refused_bundle_block_never_clears_a_failure_of_the_set(singles: list[Receipt], policy: Policy,
                                                                  defaults_file: Path) -> None:
    """One bundle block's candidate crashed on its first attempt (retry fine): the set fails. A refused bundle
    block whose baseline crashed (OOM) must not clear that (found in review: the set passed and was written)."""
    from ablate.receipts.schema import Code, Disqualifier, Status

    bundle = simulate_bundle(NEW, OLD, 1.05 * 1.06, 4)
    block = sorted({r.identity.block_id for r in bundle})[0]
    arms = [r for r in bundle if r.identity.block_id == block]
    base = next(r for r in arms if r.identity.arm.value == "baseline")
    cand = next(r for r in arms if r.identity.arm.value == "candidate")
    for receipt in arms:
        receipt.identity.attempt = 1
    early = cand.model_copy(deep=True)
    early.identity.receipt_id, early.identity.attempt, early.identity.status = "early", 0, Status.failed
    early.throughput.wall_tokens_per_s = None
    early.steps.step_s = [s * 1.002 for s in early.steps.step_s]
    held = run(singles + bundle + [early], policy, defaults_file)
    assert held.bundles[0].status == "failed" and held.changes == []  # the matched crash fails the set
    oom_base, ran = base.model_copy(deep=True), cand.model_copy(deep=True)
    for receipt, rid in ((oom_base, "oom-b"), (ran, "oom-c")):
        receipt.identity.receipt_id, receipt.identity.block_id, receipt.identity.attempt = rid, f"{block}-x", 0
        receipt.steps.step_s = [s * 1.001 for s in receipt.steps.step_s]
    oom_base.identity.status = Status.failed
    oom_base.throughput.wall_tokens_per_s = None
    oom_base.disqualifiers.append(Disqualifier(code=Code.OOM, detail="baseline OOM"))
    result = run(singles + bundle + [early, oom_base, ran], policy, defaults_file)
    assert result.bundles[0].status == "failed" and result.changes == [], result.bundles[0].reason
