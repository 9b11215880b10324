"""Multi-worker arms under a real local Ray: Ray Train TorchTrainer with 2 gloo workers, DDP and DeepSpeed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest

from ablate.receipts.schema import Receipt, Status, validate_receipt
from trainer_helpers import CORPUS, make_spec, tiny_lane
from trainers import run_arm
from trainers.run import TRAIN_ENV_DEFAULTS

REPO = Path(__file__).resolve().parents[2]
LANE = {"batch": {"micro_batch": 2, "seq_len": 32, "grad_accum": 2},
        "budget": {"steps": 4, "family_sample_steps": 1, "min_steady_steps": 2},
        "data": {"source": "text", "path": str(CORPUS)}}


@pytest.fixture(scope="module")
def ray_arms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Receipt], str, Path]]:
    ray = pytest.importorskip("ray")
    extensions = tmp_path_factory.mktemp("torch_extensions")
    receipts = tmp_path_factory.mktemp("ray") / "receipts"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TORCH_EXTENSIONS_DIR": str(extensions)}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        # 0.05 MiB splits the tiny model's ~180 kB of gradients into several buckets, so the cap acts.
        ddp = tiny_lane(**LANE, engine={"name": "ddp", "workers": 2, "bucket_cap_mb": 0.05})
        deepspeed = tiny_lane(**LANE, engine={"name": "deepspeed", "workers": 2, "zero_stage": 2,
                                              "overlap_comm": True, "reduce_bucket_size": 20000,
                                              "allgather_bucket_size": 20000})
        arms = {"ddp": run_arm(make_spec(ddp, receipts)), "deepspeed": run_arm(make_spec(deepspeed, receipts))}
        yield arms, node, extensions
    finally:
        ray.shutdown()


@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_two_worker_arm_runs_under_ray_train_and_validates(ray_arms: tuple[dict[str, Receipt], str, Path],
                                                          engine: str) -> None:
    arms, node, _ = ray_arms
    receipt = arms[engine]
    assert receipt.identity.status is Status.valid, (receipt.error, receipt.disqualifiers)
    validate_receipt(json.loads(receipt.model_dump_json()))
    assert receipt.identity.executor == "ray_train" and receipt.identity.attempt == 0
    assert receipt.identity.node_id == node                 # pinned to the caller's node
    assert receipt.requested.world_size == 2 and receipt.requested.tokens_per_step == 2 * 32 * 2 * 2
    assert receipt.observed.tokens_per_step == receipt.requested.tokens_per_step
    assert receipt.throughput.tokens == 4 * receipt.requested.tokens_per_step
    assert receipt.time.badput_s["checkpoint"] > 0          # the final report carrying the result
    total = receipt.time.goodput_s + sum(receipt.time.badput_s.values())
    assert abs(total - receipt.time.wall_s) <= 0.01 * receipt.time.wall_s
    assert receipt.observed.engine["backend"] == "gloo" and receipt.observed.engine["world_size"] == 2
    # The Train settings the arm ran with (trainers.run.TRAIN_ENV_DEFAULTS) are in its receipt.
    assert {name: receipt.env.get(name) for name in TRAIN_ENV_DEFAULTS} == TRAIN_ENV_DEFAULTS


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
