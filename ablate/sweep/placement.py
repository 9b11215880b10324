"""Where a sweep's A/A blocks run: one on every host of the cluster first, so each host a test runs on has A/A blocks
bounding its slot bias.

The promotion rule calibrates a test only on A/A blocks of the hosts the test ran on (``Calibration.uncovered``): a
+3% candidate-slot bias on three hosts, calibrated on a fourth, promoted a null feature in 23 of 30 seeds. Ray alone
places blocks wherever a slot is free, so with a few A/A blocks per lane over several hosts most hosts got none, and
every test on them held. Here each lane's A/A blocks are dealt over the nodes that fit a block (every host's first
node before any second one), and a first wave of them, as many as the nodes run at once, is dispatched before any
other block, each asking Ray for its node (``PlacementGroupFactory`` with a soft target: at the sweep's start every
node is free, so each lands where it was sent). The target is soft on purpose: a node that died or is full lets the
block run elsewhere, as before, instead of waiting for good. Later A/A blocks keep their planned places in time (and
their soft targets, which a busy cluster may not honour): only the first wave moves.

How to use (``ablate.sweep.run``)::

    targets = aa_targets(plan.blocks, capacity.nodes, turn)   # A/A block id -> node; {} on one node
    order = dispatch_order(plan.blocks, targets)            # the blocks in the order Tune gets them
    tune.with_resources(trainable, TrialResources(need.trial_resources(), targets))
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ablate.sweep.plan import Block
from ablate.sweep.resources import NodeFit


@dataclass(frozen=True)
class Target:
    node_id: str
    host: str
    first: bool
    """In the first wave: dispatched before every other block, when its node is sure to be free."""


def spread_nodes(nodes: Sequence[NodeFit]) -> list[NodeFit]:
    """The nodes that fit a block, each host's first node before any host's second: the rule's unit is the host,
    so with fewer A/A blocks than nodes every host still gets one. Two Ray nodes on one machine are both dealt to
    (their GPUs, say, need not share a bias), after every host had its turn."""
    by_host: dict[str, list[NodeFit]] = defaultdict(list)
    for node in sorted((n for n in nodes if n.arms > 0), key=lambda n: (n.host, n.node_id)):
        by_host[node.host].append(node)
    deepest = max((len(group) for group in by_host.values()), default=0)
    return [group[index] for index in range(deepest) for _, group in sorted(by_host.items()) if index < len(group)]


def aa_targets(blocks: Sequence[Block], nodes: Sequence[NodeFit], turn: int = 0) -> dict[str, Target]:
    """A/A block id -> the node it asks for. Each lane's A/A blocks, in plan order, are dealt round-robin over
    ``spread_nodes``, lane ``i`` starting at node ``i + turn``: ``turn`` (the campaign's earlier sweeps) moves every
    lane on by one node a sweep, so over rounds a lane's first block visits every node. Empty when fewer than two
    nodes fit a block: there is nothing to spread.

    The first wave (``Target.first``) is as many blocks as the nodes run at once, each node taking as many as it
    holds, the lanes in turn (from lane ``turn``: a grid with more lanes than the wave holds gets each lane into it
    over rounds): they all start together at the sweep's start, when every node is free, so every soft
    target is honoured. Lanes beyond it ask for their nodes too, but wait their turn in plan order, and a busy
    cluster puts a block on whichever node frees first (``coverage_warnings`` says which lanes may miss a host)."""
    spread = spread_nodes(nodes)
    if len(spread) < 2:
        return {}
    by_lane: dict[str, list[Block]] = defaultdict(list)
    for block in blocks:
        if block.is_aa:
            by_lane[block.lane_key].append(block)
    shift = turn % len(spread)
    dealt = {lane: [(block, spread[(lane_index + shift + rank) % len(spread)])
                    for rank, block in enumerate(by_lane[lane])]
             for lane_index, lane in enumerate(sorted(by_lane))}
    free = {node.node_id: node.arms for node in spread}
    first: set[str] = set()
    lanes = sorted(dealt)
    lanes = lanes[turn % len(lanes):] + lanes[:turn % len(lanes)] if lanes else lanes
    for rank in range(max((len(d) for d in dealt.values()), default=0)):
        for lane in lanes:
            if rank < len(dealt[lane]):
                block, node = dealt[lane][rank]
                if free[node.node_id] > 0:
                    free[node.node_id] -= 1
                    first.add(block.block_id)
    return {block.block_id: Target(node.node_id, node.host, first=block.block_id in first)
            for lane in dealt.values() for block, node in lane}


def dispatch_order(blocks: Sequence[Block], targets: Mapping[str, Target]) -> list[Block]:
    """The plan's blocks with the first wave of A/A blocks moved to the front (in plan order among themselves);
    the rest keep plan order."""
    front = [b for b in blocks if b.block_id in targets and targets[b.block_id].first]
    moved = {b.block_id for b in front}
    return front + [b for b in blocks if b.block_id not in moved]


def coverage_warnings(blocks: Sequence[Block], nodes: Sequence[NodeFit], targets: Mapping[str, Target]) -> list[str]:
    """One line per lane whose A/A blocks are not sure to reach every host: fewer blocks than hosts, or a first wave
    too small for every lane (a grid's lanes times the hosts, beyond what the nodes run at once). A test that runs on
    a host without an A/A block of its own sweep HOLDs there."""
    hosts = {node.host for node in nodes if node.arms > 0}
    lanes: dict[str, list[Block]] = defaultdict(list)
    for block in blocks:
        if block.is_aa:
            lanes[block.lane_key].append(block)
    lines = []
    for lane, aa in sorted(lanes.items()):
        sure = {targets[b.block_id].host for b in aa if b.block_id in targets and targets[b.block_id].first}
        if len(aa) < len(hosts):
            lines.append(f"lane {lane}: {len(aa)} A/A block(s) for {len(hosts)} hosts: a test that runs on a host "
                         f"without one holds (its slot bias is not bounded there); set aa_blocks >= {len(hosts)} "
                         f"(and at least the policy's threshold.min_aa_blocks)")
        elif targets and sure != hosts:
            lines.append(f"lane {lane}: its A/A blocks are sure to start on {len(sure)} of {len(hosts)} hosts (the "
                         f"nodes run {sum(n.arms for n in nodes)} block(s) at once, fewer than every lane's first "
                         f"A/A blocks); a test on {', '.join(sorted(hosts - sure))} may hold until a later round's "
                         f"deal (--until-decided moves it on by a node each round)")
    return lines


class TrialResources:
    """``tune.with_resources``'s callable: the block's request, and for a targeted A/A block the same bundle in a
    STRICT_PACK group that asks Ray for the target node first (the only strategy that takes a soft target)."""

    def __init__(self, request: Mapping[str, float], targets: Mapping[str, Target]) -> None:
        self.request = dict(request)
        self.node_of = {block_id: target.node_id for block_id, target in targets.items()}

    def __call__(self, config: Mapping[str, Any]) -> Any:
        from ray.tune.execution.placement_groups import PlacementGroupFactory, resource_dict_to_pg_factory

        plain = resource_dict_to_pg_factory(self.request)  # exactly what a resource dict would have asked for
        node_id = self.node_of.get(str(config.get("block_id")))
        if node_id is None:
            return plain
        return PlacementGroupFactory(plain.bundles, strategy="STRICT_PACK", _soft_target_node_id=node_id)
