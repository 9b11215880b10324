"""Multi-worker arms under a real local Ray: Ray Train TorchTrainer with 2 gloo workers, DDP and DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from ablate.receipts.schema import Receipt, Status, validate_receipt
from trainer_helpers import CORPUS, make_spec, tiny_lane
from trainers import run_arm
from trainers.run import TRAIN_ENV_DEFAULTS

LANE = {"batch": {"micro_batch": 2, "seq_len": 32, "grad_accum": 2},
        "budget": {"steps": 4, "family_sample_steps": 1, "min_steady_steps": 2},
        "data": {"source": "text", "path": str(CORPUS)}}


@pytest.fixture(scope="module")
def ray_arms(train_ray: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[dict[str, Receipt], str, Path]]:
    import ray

    receipts = tmp_path_factory.mktemp("ray") / "receipts"
    node = ray.get_runtime_context().get_node_id()
    # 0.05 MiB splits the tiny model's ~180 kB of gradients into several buckets, so the cap acts.
    ddp = tiny_lane(**LANE, engine={"name": "ddp", "workers": 2, "bucket_cap_mb": 0.05})
    deepspeed = tiny_lane(**LANE, engine={"name": "deepspeed", "workers": 2, "zero_stage": 2,
                                          "overlap_comm": True, "reduce_bucket_size": 20000,
                                          "allgather_bucket_size": 20000})
    # The DDP arm's rank 0 process is SIGKILLed at step 2 of its first attempt and Train restarts the whole group
    # once (one more group start, not one more arm): its receipt is the surviving attempt's.
    # The DeepSpeed arm is not pinned to a node (node_id=None): on this one-node runtime its group cannot span
    # nodes, so its ranks are still forked (test_each_rank_trains_in_a_forked_process_of_its_own).
    arms = {"ddp": run_arm(make_spec(ddp, receipts, inject={"kill_at_step": 2}), max_failures=1),
            "deepspeed": run_arm(make_spec(deepspeed, receipts), node_id=None)}
    # The GPU path's CPU twin: the arm trained inside the Train workers, on Ray's torch set-up there.
    import trainers.run as run_module
    from trainers.train_backend import ArmTorchConfig

    saved = run_module._backend_config
    run_module._backend_config = lambda use_gpu, one_node=True: ArmTorchConfig(backend="gloo", arm_process=False)
    try:
        arms["ddp_in_worker"] = run_arm(make_spec(ddp, receipts))
    finally:
        run_module._backend_config = saved
    yield arms, node, train_ray


def test_an_arm_trained_in_its_train_workers_matches_the_forked_one(ray_arms: tuple[dict[str, Receipt], str, Path]
                                                                   ) -> None:
    arms, _, _ = ray_arms
    in_worker, forked = arms["ddp_in_worker"], arms["ddp"]
    assert in_worker.identity.status is Status.valid, (in_worker.error, in_worker.disqualifiers)
    assert in_worker.identity.process is not None and in_worker.identity.process.how == "ray_train_worker"
    assert in_worker.observed.engine["backend"] == "gloo" and in_worker.observed.engine["world_size"] == 2
    assert in_worker.time.badput_s["checkpoint"] > 0 and in_worker.identity.attempt == 0
    # Same lane, seed and data: the same model on the same tokens, whichever process trained it.
    assert in_worker.steps.loss_series[0] == pytest.approx(forked.steps.loss_series[0], abs=1e-5)
    assert in_worker.steps.loss_series[-1] == pytest.approx(forked.steps.loss_series[-1], abs=1e-3)


@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_two_worker_arm_runs_under_ray_train_and_validates(ray_arms: tuple[dict[str, Receipt], str, Path],
                                                          engine: str) -> None:
    arms, node, _ = ray_arms
    receipt = arms[engine]
    assert receipt.identity.status is Status.valid, (receipt.error, receipt.disqualifiers)
    validate_receipt(json.loads(receipt.model_dump_json()))
    assert receipt.identity.executor == "ray_train" and receipt.identity.attempt == (1 if engine == "ddp" else 0)
    assert receipt.identity.node_id == node                 # the caller's node (pinned, or the only one)
    assert receipt.requested.world_size == 2 and receipt.requested.tokens_per_step == 2 * 32 * 2 * 2
    assert receipt.observed.tokens_per_step == receipt.requested.tokens_per_step
    assert receipt.throughput.tokens == 4 * receipt.requested.tokens_per_step
    assert receipt.time.badput_s["checkpoint"] > 0          # the final report carrying the result
    total = receipt.time.goodput_s + sum(receipt.time.badput_s.values())
    assert abs(total - receipt.time.wall_s) <= 0.01 * receipt.time.wall_s
    assert receipt.observed.engine["backend"] == "gloo" and receipt.observed.engine["world_size"] == 2
    # The Train settings the arm ran with (trainers.run.TRAIN_ENV_DEFAULTS) are in its receipt.
    assert {name: receipt.env.get(name) for name in TRAIN_ENV_DEFAULTS} == TRAIN_ENV_DEFAULTS


def test_each_rank_trains_in_a_forked_process_of_its_own(ray_arms: tuple[dict[str, Receipt], str, Path]) -> None:
    """CPU arms: every rank's arm runs in a process forked from the node's fork server (torch and the arm code
    imported, nothing run), not in its Ray Train worker; the restarted DDP group's rank 0 got a new one."""
    import os

    arms, _, _ = ray_arms
    arms = {engine: arms[engine] for engine in ("ddp", "deepspeed")}
    processes = {engine: receipt.identity.process for engine, receipt in arms.items()}
    assert all(p is not None and p.how == "fork_server" for p in processes.values()), processes
    pids = {engine: receipt.identity.pid for engine, receipt in arms.items()}
    servers = {p.server_pid for p in processes.values()}
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values() and servers.isdisjoint(pids.values())
    # One server for every rank of both arms (the ranks' own variables stay out of its key): the restarted DDP
    # group's rank 0 came after the first group's two ranks, DeepSpeed's after DDP's four.
    assert len(servers) == 1
    assert processes["ddp"].forks_before >= 2 and processes["deepspeed"].forks_before >= 4


def test_engines_resolve_their_buckets_and_train_the_same_model(ray_arms: tuple[dict[str, Receipt], str, Path]
                                                               ) -> None:
    arms, _, extensions = ray_arms
    ddp, ds = arms["ddp"].observed.engine, arms["deepspeed"].observed.engine
    # Read back from the engines: DDP's reducer keeps whole bytes (a copy of the lane would say 0.05) and its
    # rebuilt buckets; DeepSpeed's ZeRO-2 optimizer keeps the reduce bucket and overlap.
    assert ddp["engine"] == "ddp" and ddp["bucket_cap_bytes"] == int(0.05 * 2 ** 20)
    assert ddp["buckets_bytes"] is not None and len(ddp["buckets_bytes"]) > 1 and ddp["inactive"] == {}
    assert ds["engine"] == "deepspeed" and ds["zero_stage"] == 2 and ds["overlap_comm"] is True
    assert ds["reduce_bucket_size"] == 20000 and ds["optimizer"].startswith("DeepSpeedZeroOptimizer")
    # torch 2.13 gathers each ZeRO partition in one all_gather_into_tensor: the requested all-gather bucket is idle.
    assert ds["allgather_bucket_size"] is None and "allgather_bucket_size" in ds["inactive"]
    # Same seed, data and warmup policy: step 0 is the same model on the same tokens in both engines.
    ddp_losses, ds_losses = arms["ddp"].steps.loss_series, arms["deepspeed"].steps.loss_series
    assert ddp_losses[0] == pytest.approx(ds_losses[0], abs=1e-4)
    assert ddp_losses[-1] == pytest.approx(ds_losses[-1], abs=2e-2)
    assert ddp_losses[-1] < ddp_losses[0]
    # A client torch optimizer and no shared-memory allreduce: DeepSpeed built no C++ op on CPU.
    assert list(extensions.rglob("*.so")) == []


def test_a_restarted_worker_group_compiles_into_fresh_caches(ray_arms: tuple[dict[str, Receipt], str, Path]) -> None:
    arms, _, _ = ray_arms
    restarted, first_try = arms["ddp"], arms["deepspeed"]
    assert restarted.identity.attempt == 1 and first_try.identity.attempt == 0
    assert restarted.time.badput_s["restart"] > 0 and first_try.time.badput_s["restart"] == 0
    # The restarted group compiled into caches of its own: the dead attempt's kernels would have made its compile
    # warm and its one-time cost read low.
    assert restarted.env["TORCHINDUCTOR_CACHE_DIR"].endswith("/inductor-cache-restart1")
    assert restarted.env["TRITON_CACHE_DIR"].endswith("/triton-cache-restart1")
    assert first_try.env["TORCHINDUCTOR_CACHE_DIR"].endswith("/inductor-cache")
    assert first_try.env["TRITON_CACHE_DIR"].endswith("/triton-cache")
    assert len(restarted.steps.series) == 4
