"""Where A/A blocks are sent (ablate.sweep.placement): spread over every host first, the first wave dispatched
before any other block, without touching the plan. The real Ray placement is in test_sweep_multinode."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest

from ablate.config.load import load_sweep
from ablate.sweep.placement import TrialResources, aa_targets, coverage_warnings, dispatch_order, spread_nodes
from ablate.sweep.plan import SweepPlan, plan_sweep
from ablate.sweep.resources import NodeFit

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, aa_blocks: int, grid: bool = False) -> SweepPlan:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "defaults.yaml").write_text((REPO / "search_spaces" / "defaults.yaml").read_text())
    path = tmp_path / "campaign.yaml"
    features = "{fused_residual: ['on'], mla_ingress: [fused]}" if grid else "{moe_dispatch: [jagged]}"
    path.write_text(f"defaults: defaults.yaml\n{'design: grid' if grid else ''}\nfeatures: {features}\n"
                    f"blocks: 3\naa_blocks: {aa_blocks}\n")
    sweep, _ = load_sweep(path)
    return plan_sweep(sweep, sweep_id="s1")


def _node(node_id: str, host: str, arms: int = 1) -> NodeFit:
    return NodeFit(node_id=node_id, host=host, resources={"CPU": float(arms)}, arms=arms,
                   why_not="" if arms else "0 CPU < 1")


def test_every_host_comes_before_any_second_node_of_a_host_and_nodes_that_fit_nothing_are_left_out() -> None:
    nodes = [_node("n4", "b"), _node("n1", "a"), _node("n2", "a"), _node("n3", "b"), _node("n5", "c", arms=0)]
    assert [n.node_id for n in spread_nodes(nodes)] == ["n1", "n3", "n2", "n4"]


def test_one_node_gets_no_targets_and_the_order_is_the_plan(tmp_path: Path) -> None:
    plan = _plan(tmp_path, aa_blocks=2)
    for nodes in ([_node("n1", "a", arms=4)], [_node("n1", "a"), _node("n2", "b", arms=0)]):
        targets = aa_targets(plan.blocks, nodes)
        assert targets == {}
        assert dispatch_order(plan.blocks, targets) == plan.blocks
        assert coverage_warnings(plan.blocks, nodes, targets) == []


def test_a_lanes_aa_blocks_cover_every_node_and_go_first_without_changing_the_plan(tmp_path: Path) -> None:
    plan = _plan(tmp_path, aa_blocks=3)
    fingerprint = plan.fingerprint()
    nodes = [_node("n1", "a"), _node("n2", "b"), _node("n3", "c")]
    targets = aa_targets(plan.blocks, nodes)
    aa = [b for b in plan.blocks if b.is_aa]
    assert sorted(targets) == sorted(b.block_id for b in aa)
    assert {t.node_id for t in targets.values()} == {"n1", "n2", "n3"}
    assert all(t.first for t in targets.values()), "three nodes hold three blocks at once: all three start first"
    order = dispatch_order(plan.blocks, targets)
    assert [b.block_id for b in order[:3]] == [b.block_id for b in aa], "the first wave, in plan order"
    assert [b.block_id for b in order[3:]] == [b.block_id for b in plan.blocks if not b.is_aa]
    assert sorted(b.block_id for b in order) == sorted(b.block_id for b in plan.blocks)
    assert plan.fingerprint() == fingerprint, "a resumed sweep must still find the plan it started"


def test_the_first_wave_is_what_the_nodes_hold_at_once_and_later_lanes_wait_in_plan_order(tmp_path: Path) -> None:
    plan = _plan(tmp_path, aa_blocks=2, grid=True)  # 3 lanes x 2 A/A blocks
    lanes = {b.lane_key for b in plan.blocks if b.is_aa}
    assert len(lanes) == 3
    nodes = [_node("n1", "a"), _node("n2", "b")]
    targets = aa_targets(plan.blocks, nodes)
    first = [block for block, target in targets.items() if target.first]
    assert len(first) == 2 and {targets[b].node_id for b in first} == {"n1", "n2"}, "one block per free slot"
    by_lane = defaultdict(set)
    for block in plan.blocks:
        if block.is_aa:
            by_lane[block.lane_key].add(targets[block.block_id].node_id)
    assert all(nodes_of_lane == {"n1", "n2"} for nodes_of_lane in by_lane.values()), "every lane asks for both"
    # A node that holds two blocks at once takes two of the first wave.
    wide = aa_targets(plan.blocks, [_node("n1", "a", arms=2), _node("n2", "b", arms=2)])
    assert Counter(t.node_id for t in wide.values() if t.first) == {"n1": 2, "n2": 2}


def test_each_sweep_moves_a_lanes_deal_on_by_one_node_so_rounds_visit_every_node(tmp_path: Path) -> None:
    plan = _plan(tmp_path, aa_blocks=1)
    nodes = [_node("n1", "a"), _node("n2", "b"), _node("n3", "c")]
    firsts = [next(iter(aa_targets(plan.blocks, nodes, turn).values())).node_id for turn in range(3)]
    assert sorted(firsts) == ["n1", "n2", "n3"], "three rounds, three nodes"
    assert next(iter(aa_targets(plan.blocks, nodes, 3).values())).node_id == firsts[0]


def test_a_grid_larger_than_the_first_wave_gets_every_lane_into_it_over_rounds(tmp_path: Path) -> None:
    """3 lanes, 2 one-slot nodes: each sweep's first wave holds 2 lanes; moving the lanes on with the turn, as the
    nodes are, lets the third lane start first in a later round (a fixed lane order left it out of every one)."""
    plan = _plan(tmp_path, aa_blocks=2, grid=True)
    nodes = [_node("n1", "a"), _node("n2", "b")]
    lane_of = {b.block_id: b.lane_key for b in plan.blocks if b.is_aa}
    waves = [{lane_of[block] for block, t in aa_targets(plan.blocks, nodes, turn).items() if t.first}
             for turn in range(3)]
    assert all(len(wave) == 2 for wave in waves)
    assert set().union(*waves) == set(lane_of.values())


def test_lanes_not_sure_to_reach_every_host_are_named_with_what_to_do(tmp_path: Path) -> None:
    nodes = [_node("n1", "a"), _node("n2", "b"), _node("n3", "c")]
    few = _plan(tmp_path / "few", aa_blocks=2)
    (line,) = coverage_warnings(few.blocks, nodes, aa_targets(few.blocks, nodes))
    assert "2 A/A block(s) for 3 hosts" in line and "aa_blocks >= 3" in line and "min_aa_blocks" in line
    # Two Ray nodes on one machine are one host to the rule.
    two_hosts = [_node("n1", "a"), _node("n2", "a"), _node("n3", "b")]
    assert coverage_warnings(few.blocks, two_hosts, aa_targets(few.blocks, two_hosts)) == []
    # A grid's 3 lanes x 3 hosts need 9 first-wave blocks; 3 nodes of one slot start 3: every lane reaches one host
    # for sure, and each is named with the hosts it may miss.
    grid = _plan(tmp_path / "grid", aa_blocks=3, grid=True)
    lines = coverage_warnings(grid.blocks, nodes, aa_targets(grid.blocks, nodes))
    assert len(lines) == 3 and all("sure to start on 1 of 3 hosts" in line for line in lines), lines
    wide = [_node("n1", "a", arms=3), _node("n2", "b", arms=3), _node("n3", "c", arms=3)]
    assert coverage_warnings(grid.blocks, wide, aa_targets(grid.blocks, wide)) == [], "9 slots: every lane, every host"


@pytest.mark.parametrize("request_", [{"CPU": 1.0}, {"CPU": 0.0, "ablate_driver_cpu": 2.0}])
def test_a_targeted_block_asks_for_its_node_with_the_same_bundle(request_: dict[str, float]) -> None:
    from ray.tune.execution.placement_groups import PlacementGroupFactory, resource_dict_to_pg_factory

    from ablate.sweep.placement import Target

    resources = TrialResources(request_, {"b001": Target("f" * 56, "a", first=True)})
    plain, targeted = resources({"block_id": "b000"}), resources({"block_id": "b001"})
    assert plain == resource_dict_to_pg_factory(request_)
    assert isinstance(targeted, PlacementGroupFactory)
    assert targeted.bundles == plain.bundles and targeted.strategy == "STRICT_PACK"
    assert targeted != plain, "the target is part of the request"
