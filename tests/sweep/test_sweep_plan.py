"""Plan expansion: blocks, A/A, recorded and balanced arm orders, lane keys, and the grid design."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ablate.config.load import flatten, lane_to_dict, load_sweep
from ablate.config.schema import ConfigError
from ablate.sweep.plan import Block, lane_key, plan_sweep

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = (REPO / "search_spaces" / "defaults.yaml").read_text()


def _campaign(tmp_path: Path, body: str) -> Path:
    (tmp_path / "defaults.yaml").write_text(DEFAULTS)
    path = tmp_path / "campaign.yaml"
    path.write_text("defaults: defaults.yaml\n" + body)
    return path


def _diff(a: Block, b_index: int = 1) -> set[str]:
    base, other = (flatten(lane_to_dict(a.arms[i].lane)) for i in (0, b_index))
    return {key for key in base if base[key] != other[key]}


def test_smoke_campaign_expands_to_matched_blocks_and_aa() -> None:
    sweep, _ = load_sweep(REPO / "search_spaces" / "smoke.yaml")
    plan = plan_sweep(sweep, sweep_id="s1")
    per_feature = Counter(b.feature for b in plan.blocks)
    assert per_feature == {"moe_dispatch": sweep.blocks, "mamba_scan": sweep.blocks, "stp": sweep.blocks,
                           None: sweep.aa_blocks, "bundle": sweep.bundle_blocks}
    # The smoke lane has no R block: the recurrent toggle is refused before any arm runs, with the reason.
    assert [what for what, _ in plan.skipped] == ["recurrent_scan=parallel"]
    assert [b.block_id for b in plan.blocks] == [f"b{i:03d}" for i in range(len(plan.blocks))]
    for block in plan.blocks:
        if block.is_aa:
            assert [a.arm for a in block.arms] == ["aa", "aa"] and _diff(block) == set()
            assert block.kind == "aa" and block.baseline_value is None
        elif block.feature == "bundle":  # both speed features at once (the tax stays out)
            assert _diff(block) == {"features.moe_dispatch", "features.mamba_scan"}
            assert block.candidate_value == {"mamba_scan": "chunked", "moe_dispatch": "jagged"}
        else:
            assert [a.arm for a in block.arms] == ["baseline", "candidate"]
            # Defaults vs defaults + exactly one change, and the baseline is the defaults.yaml value.
            assert _diff(block) == {f"features.{block.feature}"}
            assert block.arms[0].value == block.baseline_value != block.candidate_value == block.arms[1].value
            assert block.kind == ("tax" if block.feature == "stp" else "speed")
        assert block.lane_key == lane_key(block.arms[0].lane) == lane_key(sweep.lane)
    assert plan.lane_keys() == [lane_key(sweep.lane)]


def test_orders_are_recorded_balanced_and_reproducible(tmp_path: Path) -> None:
    path = _campaign(tmp_path, "features: {fused_residual: ['on']}\nblocks: 8\naa_blocks: 2\n")
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="round-1")
    orders = [b.order for b in plan.blocks if not b.is_aa]
    assert Counter(orders) == {(0, 1): 4, (1, 0): 4}, "counterbalanced: half baseline-first, half candidate-first"
    # A sweep planned before the pairs scheme (its metadata records none) replans with the old shuffle on resume.
    from ablate.sweep.plan import ORDERS_SHUFFLED
    legacy = plan_sweep(sweep, sweep_id="round-1", orders_scheme=ORDERS_SHUFFLED)
    assert Counter(b.order for b in legacy.blocks if not b.is_aa) == {(0, 1): 4, (1, 0): 4}
    assert legacy.fingerprint() == plan_sweep(sweep, sweep_id="round-1", orders_scheme=ORDERS_SHUFFLED).fingerprint()
    # Every prefix too (a round stopped early runs only its first repeats): within one of even, in any round.
    for i in range(1, 30):
        drawn = [b.order for b in plan_sweep(sweep, sweep_id=f"round-{i}").blocks if not b.is_aa]
        assert all(abs(2 * drawn[:n].count((0, 1)) - n) <= 1 for n in range(1, len(drawn) + 1)), drawn
    assert [b.order for b in plan_sweep(sweep, sweep_id="round-1").blocks] == [b.order for b in plan.blocks]
    other_rounds = {tuple(b.order for b in plan_sweep(sweep, sweep_id=f"round-{i}").blocks) for i in range(2, 8)}
    assert len(other_rounds | {tuple(b.order for b in plan.blocks)}) > 1, "a new sweep id draws new orders"
    first = plan.blocks[0]
    assert [arm.arm_index for _, arm in first.run_order()] == list(first.order)
    assert [position for position, _ in first.run_order()] == [0, 1]
    # A/A blocks are spread through the sweep (round-robin), not all at the end.
    aa_positions = [i for i, b in enumerate(plan.blocks) if b.is_aa]
    assert aa_positions[0] < len(plan.blocks) - 2


def test_lane_key_is_stable_across_processes_and_yaml_key_order(tmp_path: Path) -> None:
    a = _campaign(tmp_path, "lane: {batch: {micro_batch: 2, seq_len: 32}, budget: {steps: 4}}\n"
                            "features: {fused_residual: ['on']}\n")
    sweep_a, _ = load_sweep(a)
    other = tmp_path / "other"
    other.mkdir()
    b = _campaign(other, "features: {fused_residual: ['on']}\n"
                         "lane: {budget: {steps: 4}, batch: {seq_len: 32, micro_batch: 2}}\n")
    sweep_b, _ = load_sweep(b)
    assert lane_key(sweep_a.lane) == lane_key(sweep_b.lane)
    code = ("import sys; from ablate.config.load import load_sweep; from ablate.sweep.plan import lane_key;"
            f"print(lane_key(load_sweep({str(a)!r})[0].lane))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == lane_key(sweep_a.lane)
    changed = _campaign(tmp_path / "other", "lane: {budget: {steps: 5}}\nfeatures: {fused_residual: ['on']}\n")
    assert lane_key(load_sweep(changed)[0].lane) != lane_key(sweep_b.lane)


def test_block_round_trips_through_json() -> None:
    sweep, _ = load_sweep(REPO / "search_spaces" / "smoke.yaml")
    for block in plan_sweep(sweep, sweep_id="s1").blocks:
        again = Block.from_dict(json.loads(json.dumps(block.to_dict())))
        assert again.to_dict() == block.to_dict()
        assert [lane_key(a.lane) for a in again.arms] == [lane_key(a.lane) for a in block.arms]


def test_grid_design_tests_each_toggle_in_every_context_lane(tmp_path: Path) -> None:
    path = _campaign(tmp_path, "design: grid\nfeatures: {fused_residual: ['on'], mla_ingress: [fused]}\n"
                               "blocks: 2\naa_blocks: 1\n")
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="g")
    real = [b for b in plan.blocks if not b.is_aa]
    # Each of the 2 toggles in 2 contexts (the other toggle at baseline or changed), 2 blocks each.
    assert len(real) == 8
    assert {(b.feature, tuple(b.context.items())) for b in real} == {
        ("fused_residual", ()), ("fused_residual", (("mla_ingress", "fused"),)),
        ("mla_ingress", ()), ("mla_ingress", (("fused_residual", "on"),))}
    for block in real:
        assert _diff(block) == {f"features.{block.feature}"}, "still one change per block"
        assert block.lane_key == lane_key(block.arms[0].lane)
    assert len({b.lane_key for b in real}) == 3, "base lane + one lane per changed context"
    # One A/A block per distinct baseline lane.
    assert sorted(b.lane_key for b in plan.blocks if b.is_aa) == sorted({b.lane_key for b in real})


def test_grid_skips_a_toggle_where_its_context_makes_it_inert(tmp_path: Path) -> None:
    # warmup: auto resolves to explicit (the baseline) under eager on any device, but to skip on CUDA under
    # regional compile: only the eager context makes it inert.
    path = _campaign(tmp_path, "design: grid\nlane: {compile: {posture: regional}}\n"
                               "features: {compile: [eager], warmup: [auto]}\nblocks: 1\naa_blocks: 0\n")
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="g")
    warmup_contexts = [b.context for b in plan.blocks if b.feature == "warmup"]
    assert warmup_contexts == [{}], "warmup cannot act under eager: that context is skipped"
    assert len(plan.skipped) == 1 and "eager" in plan.skipped[0][1] and "inert" in plan.skipped[0][1]


def test_an_inert_value_is_refused_before_any_arm_and_an_all_inert_campaign_fails(tmp_path: Path) -> None:
    path = _campaign(tmp_path, "lane: {model: {pattern: AM}}\n"
                               "features: {moe_dispatch: [jagged], mamba_scan: [chunked]}\nblocks: 2\n")
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="i")
    assert {b.feature for b in plan.blocks} == {"mamba_scan", None}
    assert plan.skipped == [("moe_dispatch=jagged",
                             "refused, inert in this lane: pattern 'AM' has no E (MoE) blocks")]
    nothing = _campaign(tmp_path, "lane: {model: {pattern: AM}}\nfeatures: {moe_dispatch: [jagged]}\n"
                                  "aa_blocks: 0\n")
    sweep, _ = load_sweep(nothing)
    with pytest.raises(ConfigError, match="nothing would run: moe_dispatch=jagged: refused, inert"):
        plan_sweep(sweep, sweep_id="n")


def test_fingerprint_changes_when_the_campaign_changes(tmp_path: Path) -> None:
    sweep, _ = load_sweep(_campaign(tmp_path, "features: {fused_residual: ['on']}\nblocks: 2\n"))
    more, _ = load_sweep(_campaign(tmp_path, "features: {fused_residual: ['on']}\nblocks: 3\n"))
    assert plan_sweep(sweep, "x").fingerprint() == plan_sweep(sweep, "x").fingerprint()
    assert plan_sweep(sweep, "x").fingerprint() != plan_sweep(more, "x").fingerprint()


CAMPAIGNS = sorted(p for p in (REPO / "search_spaces").glob("*.yaml") if p.name != "defaults.yaml")


@pytest.mark.parametrize("path", CAMPAIGNS, ids=lambda p: p.name)
def test_every_campaign_file_plans(path: Path) -> None:
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="validate")
    assert plan.blocks and all(len(b.arms) == 2 for b in plan.blocks)


# --- after a promotion: the repository's campaigns keep planning, and baselines follow the lane's default ---

POLICY = REPO / "search_spaces" / "policies" / "default.yaml"


def _promote(defaults_path: Path, feature: str, value: str, lanes: dict[str, dict], report: str) -> None:
    """Write a promotion of ``feature=value`` into ``defaults_path`` with the real writer (no receipts needed):
    ``lanes`` maps device class -> flattened lane of a lane that promoted it."""
    from types import SimpleNamespace

    from ablate.config.lane_shape import lane_shape
    from ablate.config.load import load_defaults
    from ablate.promote.analysis import PROMOTE, FeatureVerdict
    from ablate.promote.defaults_writer import plan_changes, render_defaults
    from ablate.promote.policy import load_policy

    defaults = load_defaults(defaults_path)
    verdicts = [FeatureVerdict(feature=feature, value=value, baseline_value=defaults.effective(lane, device)[feature],
                               kind="speed", lane_key=f"lane-{device}", software_fingerprint="sw-1",
                               lane_shape=lane_shape(lane, device), device_class=device, verdict=PROMOTE, speedup=1.1,
                               ci95=(1.05, 1.15), n_blocks=12, n_hosts=3)
                for device, lane in lanes.items()]
    changes = plan_changes(verdicts, defaults, load_policy(POLICY), report_id=report, campaign="test",
                           date="2026-03-09")
    result = SimpleNamespace(changes=changes, revalidations=[], report_id=report, date="2026-03-09")
    text, edits = render_defaults(defaults_path.read_text(), result)
    assert edits, "the writer changed nothing"
    defaults_path.write_text(text)


def _flat_lane(campaign: Path) -> dict:
    return flatten(lane_to_dict(load_sweep(campaign)[0].lane))


@pytest.fixture
def spaces(tmp_path: Path) -> Path:
    """A copy of search_spaces/ with mamba_scan promoted globally (a cpu and a cuda lane promoted chunked)."""
    copy = tmp_path / "search_spaces"
    shutil.copytree(REPO / "search_spaces", copy)
    lanes = {"cpu": _flat_lane(copy / "smoke.yaml"), "cuda": _flat_lane(copy / "nam56r_gpu.yaml")}
    _promote(copy / "defaults.yaml", "mamba_scan", "chunked", lanes, report="promote-test-1")
    return copy


@pytest.mark.parametrize("name", [p.name for p in CAMPAIGNS])
def test_every_campaign_still_plans_after_a_promotion_flips_one_of_its_values(spaces: Path, name: str) -> None:
    # The promotion branch must pass its own `ablate validate`: the promoted value is skipped with a notice.
    sweep, defaults = load_sweep(spaces / name)
    assert defaults.values["mamba_scan"] == "chunked" and sweep.lane.features.mamba_scan.value == "chunked"
    plan = plan_sweep(sweep, sweep_id="validate", defaults=defaults)
    if "mamba_scan" not in sweep.features:  # e.g. cpu_demo pins it in its lane and tests compile posture only
        assert plan.blocks and not any(s[0].startswith("mamba_scan") for s in plan.skipped)
        return
    assert plan.blocks and not any(b.feature == "mamba_scan" for b in plan.blocks)
    assert all(b.arms[0].lane.features.mamba_scan.value == "chunked" for b in plan.blocks)  # the new baseline
    [(what, why)] = [s for s in plan.skipped if s[0].startswith("mamba_scan")]
    assert what == "mamba_scan=chunked"
    assert why.startswith("already this lane's default (global default since report promote-test-1)")


def test_a_campaign_whose_every_value_was_promoted_still_runs_its_aa_blocks(spaces: Path) -> None:
    path = spaces / "only_mamba.yaml"
    path.write_text("defaults: defaults.yaml\nfeatures: {mamba_scan: [chunked]}\nblocks: 4\naa_blocks: 2\n")
    sweep, defaults = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="v", defaults=defaults)
    assert [b.is_aa for b in plan.blocks] == [True, True]
    assert plan.skipped[-1][0] == "every test of campaign 'sweep'"
    assert "only its 2 A/A block(s) per lane run" in plan.skipped[-1][1]


def test_grid_leaves_a_promoted_value_out_of_every_context(spaces: Path) -> None:
    path = spaces / "grid.yaml"
    path.write_text("defaults: defaults.yaml\ndesign: grid\nfeatures: {fused_residual: ['on'], mamba_scan: "
                    "[chunked]}\nblocks: 2\naa_blocks: 1\n")
    sweep, defaults = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="g", defaults=defaults)
    real = [b for b in plan.blocks if not b.is_aa]
    # As a context, the promoted value is the baseline: one context, not the same lane twice.
    assert [(b.feature, b.context) for b in real] == [("fused_residual", {}), ("fused_residual", {})]
    assert len([b for b in plan.blocks if b.is_aa]) == 1


def test_the_baseline_arm_runs_the_lanes_override(tmp_path: Path) -> None:
    # bf16: grouped_mm runs only in bf16 lanes (in an fp32 one it is jagged, refused against a jagged baseline).
    campaign = _campaign(tmp_path, "lane: {precision: bf16}\nfeatures: {mamba_scan: [chunked], "
                                   "moe_dispatch: [grouped_mm]}\n")
    # One CPU lane promoted jagged: not global (policy scope.global_device_classes), an override for its shape.
    _promote(tmp_path / "defaults.yaml", "moe_dispatch", "jagged", {"cpu": _flat_lane(campaign)}, report="r1")
    sweep, defaults = load_sweep(campaign)
    assert defaults.values["moe_dispatch"] == "padded"
    plan = plan_sweep(sweep, sweep_id="o", defaults=defaults)
    for block in plan.blocks:
        assert block.arms[0].lane.features.moe_dispatch.value == "jagged"
    moe = next(b for b in plan.blocks if b.feature == "moe_dispatch")
    assert (moe.baseline_value, moe.candidate_value) == ("jagged", "grouped_mm")
    other = tmp_path / "other.yaml"
    other.write_text("defaults: defaults.yaml\nlane: {batch: {seq_len: 128}}\nfeatures: {mamba_scan: [chunked]}\n")
    assert load_sweep(other)[0].lane.features.moe_dispatch.value == "padded"  # another lane shape


def test_bundle_blocks_run_every_tested_speed_value_together_and_promotion_reads_them(tmp_path: Path) -> None:
    """``bundle_blocks``: the defaults against all single-valued speed features at once; real arms of such a
    block are recognised by promotion as a bundle pair (no refusal), which is what ``--write`` needs. Its features
    all run eager: a fused_residual candidate compiles with Inductor (~10 s of a 2-core host), which this is not
    about."""
    from sweeps_common import tiny_smoke

    from ablate.config.features import BUNDLE
    from ablate.promote.match import match_blocks
    from ablate.promote.policy import load_policy
    from ablate.sweep.trial import make_arm_spec
    from trainers.run import run_arm

    campaign = tiny_smoke(tmp_path, steps=5, features={"moe_dispatch": ["jagged", "grouped_mm"],
                                                       "mamba_scan": ["chunked"], "recurrent_scan": ["parallel"],
                                                       "stp": ["on"], "mla_ingress": ["fused"]},
                          bundle_blocks=2, aa_blocks=0)
    sweep, defaults = load_sweep(campaign)
    plan = plan_sweep(sweep, "bundle-test", defaults)
    bundles = [b for b in plan.blocks if b.feature == BUNDLE]
    assert len(bundles) == 2 and all(b.kind == "speed" for b in bundles)
    # A tax (stp) never joins; a feature tested with several values is left out and the plan says why.
    new = {"mamba_scan": "chunked", "recurrent_scan": "parallel", "mla_ingress": "fused"}
    assert bundles[0].candidate_value == new
    assert bundles[0].baseline_value == {"mamba_scan": "sequential", "recurrent_scan": "sequential",
                                         "mla_ingress": "unfused"}
    assert any(what.startswith("bundle: moe_dispatch") for what, _ in plan.skipped)
    base, cand = (arm.lane for arm in bundles[0].arms)
    diff = {k for k, v in flatten(lane_to_dict(cand)).items() if flatten(lane_to_dict(base))[k] != v}
    assert diff == {"features.mla_ingress", "features.mamba_scan", "features.recurrent_scan"}

    receipts = [run_arm(make_arm_spec(bundles[0], position, arm, sweep_id="bundle-test", campaign=sweep.name,
                                      receipt_dir=str(tmp_path / "receipts")))
                for position, arm in bundles[0].run_order()]
    assert all(r.identity.feature == BUNDLE and r.identity.status.value != "failed" for r in receipts), \
        [r.error for r in receipts]
    blocks, refusals = match_blocks(receipts, load_policy(REPO / "search_spaces" / "policies" / "default.yaml"))
    assert refusals == [] and [b.feature for b in blocks] == [BUNDLE]


def test_bundle_blocks_need_two_single_valued_speed_features(tmp_path: Path) -> None:
    from sweeps_common import tiny_smoke

    campaign = tiny_smoke(tmp_path, features={"moe_dispatch": ["jagged"], "stp": ["on"]}, bundle_blocks=3)
    sweep, defaults = load_sweep(campaign)
    plan = plan_sweep(sweep, "x", defaults)
    assert not [b for b in plan.blocks if b.feature == "bundle"]
    assert any(what == "bundle_blocks: 3" and "two or more speed features" in why for what, why in plan.skipped)
