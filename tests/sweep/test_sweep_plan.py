"""Plan expansion: blocks, A/A, recorded and balanced arm orders, lane keys, and the grid design."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ablate.config.load import flatten, lane_to_dict, load_sweep
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
    assert per_feature == {"moe_dispatch": sweep.blocks, "mamba_scan": sweep.blocks, None: sweep.aa_blocks}
    assert [b.block_id for b in plan.blocks] == [f"b{i:03d}" for i in range(len(plan.blocks))]
    for block in plan.blocks:
        if block.is_aa:
            assert [a.arm for a in block.arms] == ["aa", "aa"] and _diff(block) == set()
            assert block.kind == "aa" and block.baseline_value is None
        else:
            assert [a.arm for a in block.arms] == ["baseline", "candidate"]
            # Defaults vs defaults + exactly one change, and the baseline is the defaults.yaml value.
            assert _diff(block) == {f"features.{block.feature}"}
            assert block.arms[0].value == block.baseline_value != block.candidate_value == block.arms[1].value
            assert block.kind == "speed"
        assert block.lane_key == lane_key(block.arms[0].lane) == lane_key(sweep.lane)
    assert plan.lane_keys() == [lane_key(sweep.lane)]


def test_orders_are_recorded_balanced_and_reproducible(tmp_path: Path) -> None:
    path = _campaign(tmp_path, "features: {fused_residual: ['on']}\nblocks: 8\naa_blocks: 2\n")
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="round-1")
    orders = [b.order for b in plan.blocks if not b.is_aa]
    assert Counter(orders) == {(0, 1): 4, (1, 0): 4}, "counterbalanced: half baseline-first, half candidate-first"
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
    path = _campaign(tmp_path, "design: grid\nlane: {compile: {posture: regional}}\n"
                               "features: {compile: [eager], warmup: [skip]}\nblocks: 1\naa_blocks: 0\n")
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, sweep_id="g")
    warmup_contexts = [b.context for b in plan.blocks if b.feature == "warmup"]
    assert warmup_contexts == [{}], "warmup cannot act under eager: that context is skipped"
    assert len(plan.skipped) == 1 and "eager" in plan.skipped[0][1]


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
