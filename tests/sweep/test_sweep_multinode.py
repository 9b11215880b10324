"""Two Ray nodes (``ray.cluster_utils.Cluster``, 1 CPU each): blocks spread over nodes, both arms of a block
stay on one node."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from sweeps_common import fresh_mlflow_uri, tiny_smoke

from ablate.receipts.store import load_receipts
from ablate.sweep.resources import DRIVER_CPU
from ablate.sweep.run import run_sweep

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {DRIVER_CPU: 1}})
    cluster.add_node(num_cpus=1, resources={DRIVER_CPU: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_blocks_spread_over_nodes_and_arms_stay_together(two_nodes: Any, tmp_path: Path) -> None:
    import ray

    node_ids = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(node_ids) == 2
    # moe_dispatch: both arms run eager (a fused_residual candidate compiles with Inductor, ~10 s a block on 2
    # cores); spreading blocks is not about compiling.
    campaign = tiny_smoke(tmp_path / "campaign", name="spread", features={"moe_dispatch": ["jagged"]}, blocks=2,
                          aa_blocks=0)
    summary = run_sweep(campaign, tracking_uri=fresh_mlflow_uri(tmp_path), storage=str(tmp_path / "runs"),
                        progress=False)
    assert (summary.blocks_done, summary.exit_code, summary.max_concurrent) == (2, 0, 2)
    # Where each block's trial ran, and where each of its arms ran (the trial's node reports every arm).
    trial_node = {block: entry["node_id"] for block, entry in summary.timeline.items()}
    assert set(trial_node.values()) == node_ids, "one block per node: the two blocks ran on different nodes"
    for block, entry in summary.timeline.items():
        assert [arm["node_id"] for arm in entry["arms"]] == [trial_node[block]] * 2
    receipts, rejected = load_receipts(Path(summary.sweep_dir) / "receipts")
    assert rejected == [] and len(receipts) == 4
    nodes_per_block: dict[str, set[Optional[str]]] = defaultdict(set)
    for receipt in receipts:
        nodes_per_block[receipt.identity.block_id].add(receipt.identity.node_id)
    for block, nodes in nodes_per_block.items():
        assert len(nodes) == 1, f"block {block}: arms on {nodes}"
        assert nodes == {trial_node[block]}, "a receipt's node is its trial's node"


def test_aa_blocks_run_first_one_on_each_node_where_they_were_sent(two_nodes: Any, tmp_path: Path) -> None:
    """One block at a time: left to Ray, consecutive blocks may all land on one node (every node is free at each
    start), so the A/A blocks of a lane could calibrate one host only and every test elsewhere would HOLD. The
    feature runs eager in both arms (moe_dispatch): nothing here is about compiling."""
    import json

    import ray

    node_ids = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    campaign = tiny_smoke(tmp_path / "campaign", name="aa-spread", features={"moe_dispatch": ["jagged"]}, blocks=1,
                          aa_blocks=2, resources={"cpus_per_worker": 1, "max_concurrent_blocks": 1})
    summary = run_sweep(campaign, tracking_uri=fresh_mlflow_uri(tmp_path), storage=str(tmp_path / "runs"),
                        progress=False)
    assert (summary.blocks_done, summary.exit_code, summary.max_concurrent) == (3, 0, 1)
    meta = json.loads((Path(summary.sweep_dir) / "sweeps" / f"{summary.sweep_id}.json").read_text())
    targets = meta["aa_targets"]
    receipts, rejected = load_receipts(Path(summary.sweep_dir) / "receipts")
    assert rejected == [] and len(receipts) == 6
    aa_blocks = {r.identity.block_id for r in receipts if r.identity.kind == "aa"}
    assert sorted(targets) == sorted(aa_blocks) and all(t["first"] for t in targets.values())
    assert {t["node_id"] for t in targets.values()} == node_ids
    started = sorted(summary.timeline, key=lambda block: summary.timeline[block]["trial_started_at"])
    assert set(started[:2]) == aa_blocks, f"the A/A blocks start first: {started}"
    for receipt in receipts:
        if receipt.identity.block_id in aa_blocks:
            assert receipt.identity.node_id == targets[receipt.identity.block_id]["node_id"], "ran where it was sent"
