"""Prestarted Ray processes for two-worker arms (``trainers.ray_pool``): every arm still trains in processes that
ran nothing before it, and says how they were prepared."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from ablate.receipts.schema import Status
from trainer_helpers import CORPUS, make_spec, tiny_lane
from trainers import ray_pool
from trainers import run as run_module

REPO = Path(__file__).resolve().parents[2]
LANE = {"batch": {"micro_batch": 2, "seq_len": 32, "grad_accum": 1},
        "budget": {"steps": 2, "family_sample_steps": 1, "min_steady_steps": 1},
        "data": {"source": "text", "path": str(CORPUS)}, "engine": {"name": "ddp", "workers": 2}}
NUM_ARMS = 3
POOL_WAIT_S = 12.0
"""Idle time before each later arm, as between blocks: the pool the previous arm asked for starts in it."""


def test_merged_env_matches_how_ray_serializes_an_actors_runtime_env() -> None:
    parent = '{"env_vars": {"A": "1"}, "worker_process_setup_hook": "m.f"}'  # a job's env: Python's json.dumps
    assert ray_pool.merged_env(parent, {}) == parent                       # nothing to add: inherited verbatim
    # The core worker's merge (measured on Ray 2.60): keys sorted, no spaces, the child's values win.
    assert (ray_pool.merged_env(parent, {"B": "2", "A": "3"})
            == '{"env_vars":{"A":"3","B":"2"},"worker_process_setup_hook":"m.f"}')
    controller, worker = ray_pool.expected_envs(parent, {"C": "0"}, {"W": "1"})
    assert controller == '{"env_vars":{"A":"1","C":"0"},"worker_process_setup_hook":"m.f"}'
    assert worker == '{"env_vars":{"A":"1","C":"0","W":"1"},"worker_process_setup_hook":"m.f"}'


def test_process_evidence_is_decided_from_the_process_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_pool, "_CLAIMED_BY", None)
    monkeypatch.setattr(ray_pool, "_HOOK_RECORD", None)
    started = ray_pool._process_start_time(os.getpid())
    assert started is not None and started <= time.time()
    fresh = ray_pool.process_evidence(created_after=started - 10)  # the arm began before this process existed
    assert fresh["how"] == "ray_train_worker" and fresh["reused"] is False and fresh["pid"] == os.getpid()
    again = ray_pool.process_evidence(created_after=started + 10)  # a second arm in the same process: never normal
    assert again["how"] == "ray_prestarted_worker" and again["reused"] is True


@pytest.fixture(scope="module")
def pooled_arms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[Any, Any]]]:
    """Three two-worker arms, one after another, on one local Ray runtime (as a sweep's blocks run)."""
    ray = pytest.importorskip("ray")
    receipts = tmp_path_factory.mktemp("pool") / "receipts"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    arms = []
    try:
        node = ray.get_runtime_context().get_node_id()
        for index in range(NUM_ARMS):
            if index:
                time.sleep(POOL_WAIT_S)
            spec, work, launch = run_module._prepare(make_spec(tiny_lane(**LANE), receipts, block_id=f"b{index}"),
                                                     "ray_train", time.time())
            launch.process = {"how": "ray_train_worker"}
            result = run_module._run_ray_train(run_module._with_absolute_paths(spec), work, 0, launch, node,
                                               None, None, None)
            evidence = launch.process_evidence
            launch.end = time.time()
            arms.append((run_module._finish(spec, work, launch, result), evidence))
        yield arms
    finally:
        ray.shutdown()


def test_every_arm_trains_in_processes_no_earlier_arm_touched(pooled_arms: list[tuple[Any, Any]]) -> None:
    seen: set[int] = set()
    for receipt, evidence in pooled_arms:
        assert receipt.identity.status is Status.valid, (receipt.error, receipt.disqualifiers)
        assert len(evidence) == 2
        pids = {e["pid"] for e in evidence}
        assert len(pids) == 2 and not pids & seen          # two processes per arm, never seen before
        assert receipt.identity.pid in pids
        seen |= pids
        # The module-level mark an arm leaves in its process (ray_pool._CLAIMED_BY) was never visible to another.
        assert not any(e["reused"] for e in evidence)


def test_later_arms_get_prestarted_processes_that_only_imported(pooled_arms: list[tuple[Any, Any]]) -> None:
    for receipt, evidence in pooled_arms[1:]:
        for e in evidence:
            # Started before the arm's fit(), and the setup hook imported torch and the arm code before that.
            assert e["how"] == "ray_prestarted_worker", e
            assert e["process_started_at"] < e["hook"]["hook_end"] < e["arm_created_after"], e
            assert "error" not in e["hook"]
        # The receipt says so, rank by rank, from the processes' own evidence.
        process = receipt.identity.process
        assert process is not None and process.how == "ray_prestarted_worker"
        assert [(r.rank, r.pid, r.how) for r in process.ranks] == \
            sorted((int(rank), e["pid"], e["how"]) for rank, e in enumerate(evidence))
        assert all(r.started_before_arm_s > 0 and r.hook_s is not None and r.hook_error is None for r in process.ranks)
    first, _ = pooled_arms[0]
    assert first.identity.process.how in ("ray_train_worker", "ray_prestarted_worker")


def test_arms_compile_into_their_own_caches(pooled_arms: list[tuple[Any, Any]]) -> None:
    dirs = [receipt.env.get("TORCHINDUCTOR_CACHE_DIR") for receipt, _ in pooled_arms]
    # Set by the train loop (not the runtime env, which is the same for every arm): one private directory each.
    assert all(dirs) and len(set(dirs)) == len(dirs), dirs
    assert all(receipt.identity.receipt_id in d for (receipt, _), d in zip(pooled_arms, dirs))
