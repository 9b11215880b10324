"""The receipt's ``observed.engine`` is read back from the engine that was built, never copied from the lane.

Real engines over a real two-rank gloo process group (two spawned processes): DDP with its C++ reducer and
DeepSpeed ZeRO 0-3 with a client torch optimizer. Each rank builds every arm below on a fresh tiny HybridLM,
trains it a few steps and rank 0 writes the engines' records: one start (~1 min on 2 cores) serves every test.

The two properties under test: arms whose engines run the same code have equal records (a request that cannot
act is ``None`` and named in ``inactive``), and arms whose engines differ have different records.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ablate.config.features import FEATURES
from trainer_helpers import tiny_lane
from trainers.engines import build_engine

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 3
"""With grad_accum 2, DDP rebuilds its buckets at step 2 and its logger reports them from step 2's synced
micro-batch on; step 3 leaves a margin."""

DDP = {"name": "ddp", "workers": WORLD}
DS = {"name": "deepspeed", "workers": WORLD}
ARMS: dict[str, dict[str, Any]] = {
    # The tiny model's gradients are ~180 kB: 0.05 and 0.02 MiB split them differently, 1 and 25 MiB not at all.
    "ddp_0.05": {**DDP, "bucket_cap_mb": 0.05},
    "ddp_0.02": {**DDP, "bucket_cap_mb": 0.02},
    "ddp_1": {**DDP, "bucket_cap_mb": 1},
    "ddp_25": {**DDP, "bucket_cap_mb": 25},
    "ddp_1_whole": {**DDP, "bucket_cap_mb": 1},       # built with whole-model compile (see WHOLE)
    "ds0_small": {**DS, "zero_stage": 0, "reduce_bucket_size": 2000, "allgather_bucket_size": 4000,
                  "overlap_comm": True},
    "ds0_large": {**DS, "zero_stage": 0, "reduce_bucket_size": 20000, "allgather_bucket_size": 40000,
                  "overlap_comm": False},
    "ds2_2000": {**DS, "zero_stage": 2, "reduce_bucket_size": 2000, "allgather_bucket_size": 4000},
    "ds2_20000": {**DS, "zero_stage": 2, "reduce_bucket_size": 20000, "allgather_bucket_size": 4000},
    "ds2_20000_gather": {**DS, "zero_stage": 2, "reduce_bucket_size": 20000, "allgather_bucket_size": 40000},
    "ds2_20000_overlap": {**DS, "zero_stage": 2, "reduce_bucket_size": 20000, "allgather_bucket_size": 4000,
                          "overlap_comm": True},
    "ds3_overlap": {**DS, "zero_stage": 3, "reduce_bucket_size": 20000, "allgather_bucket_size": 4000,
                    "overlap_comm": True},
    "ds3_plain": {**DS, "zero_stage": 3, "reduce_bucket_size": 20000, "allgather_bucket_size": 40000,
                  "overlap_comm": False},
}

WHOLE = {"ddp_1_whole"}
"""Arms built with a whole-model torch.compile (``eager`` backend: Dynamo and its DDPOptimizer, no codegen)."""


def _lane(engine: dict[str, Any]) -> Any:
    # device cpu: what these engines run on, so the static rules can decide what the CPU engine does.
    return tiny_lane(engine=engine, batch={"grad_accum": 2}, hardware={"device": "cpu", "threads": 1})


def _model(lane: Any) -> torch.nn.Module:
    from kernels.dispatch import Dispatcher
    from trainers.model import HybridLM

    torch.manual_seed(0)
    return HybridLM(lane.model, lane.features, Dispatcher(torch.device("cpu"), strict=False))


def _train(engine: Any, lane: Any, rank: int) -> list[float]:
    generator = torch.Generator().manual_seed(100 + rank)
    shape = (lane.batch.micro_batch, lane.batch.seq_len)
    losses = []
    for _ in range(STEPS):
        micro = [(torch.randint(0, lane.model.vocab_size, shape, generator=generator),
                  torch.randint(0, lane.model.vocab_size, shape, generator=generator))
                 for _ in range(lane.batch.grad_accum)]
        losses.append(float(engine.step(micro).loss))
    return losses


def _rank(rank: int, port: int, out: str) -> None:
    # What Ray Train sets up for a worker: the env and a gloo group that exists before the engine is built.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    records: dict[str, Any] = {}
    for name, engine_section in ARMS.items():
        lane = _lane(engine_section)
        model = _model(lane)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        whole = (lambda module: torch.compile(module, backend="eager")) if name in WHOLE else None
        engine = build_engine(lane, model, torch.device("cpu"), WORLD, whole)
        losses = _train(engine, lane, rank)
        records[name] = {"details": copy.deepcopy(engine.details), "losses": losses, "param_bytes": param_bytes}
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(records))
    dist.destroy_process_group()
    # Ends as an arm forked from the fork server ends (``trainers.forkserver._become_arm``): without the interpreter's
    # teardown, where a native thread of the last (ZeRO-3, overlap_comm) engine once aborted a rank with "terminate
    # called without an active exception" after its records were written (CI, stop 50; once in ~30 runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("engines") / "records.json"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(port, str(out)), nprocs=WORLD, join=True)
    return json.loads(out.read_text())


def _details(observed: dict[str, Any], name: str) -> dict[str, Any]:
    record = observed[name]
    assert all(math.isfinite(loss) for loss in record["losses"]), (name, record["losses"])
    return record["details"]


def test_every_engine_reports_its_process_group(observed: dict[str, Any]) -> None:
    for name in ARMS:
        details = _details(observed, name)
        assert (details["backend"], details["world_size"]) == ("gloo", WORLD), name


def test_ddp_cap_is_the_reducers_whole_byte_cap_not_the_requested_mib(observed: dict[str, Any]) -> None:
    # The reducer holds int(0.05 MiB) = 52428 bytes; a copy of the lane would say 0.05.
    details = _details(observed, "ddp_0.05")
    assert details["wrapper"] == "DistributedDataParallel"
    assert details["bucket_cap_bytes"] == int(0.05 * 2 ** 20) == 52428
    assert details["bucket_cap_mb"] == 52428 / 2 ** 20 != 0.05
    assert details["gradient_as_bucket_view"] is False and details["find_unused_parameters"] is False
    # The rebuilt buckets are real: they hold every gradient byte, split by the cap.
    buckets = details["buckets_bytes"]
    assert buckets is not None and len(buckets) > 1
    assert sum(buckets) == observed["ddp_0.05"]["param_bytes"]
    assert details["inactive"] == {}


def test_ddp_caps_that_split_the_gradients_differently_give_different_records(observed: dict[str, Any]) -> None:
    coarse, fine = _details(observed, "ddp_0.05"), _details(observed, "ddp_0.02")
    assert len(fine["buckets_bytes"]) > len(coarse["buckets_bytes"])
    assert coarse != fine


def test_ddp_caps_that_split_nothing_give_equal_records(observed: dict[str, Any]) -> None:
    # 1 and 25 MiB both leave the ~180 kB of gradients in one bucket: the same reducer work, the same record.
    one, many = _details(observed, "ddp_1"), _details(observed, "ddp_25")
    assert one["buckets_bytes"] == [observed["ddp_1"]["param_bytes"]]
    assert one["bucket_cap_mb"] is None and "one bucket" in one["inactive"]["bucket_cap_mb"]
    assert one == many


def test_one_bucket_under_the_candidate_cap_is_inert_only_against_a_baseline_cap_that_holds_it_too(
        observed: dict[str, Any]) -> None:
    # Raising the cap from 0.05 MiB (three buckets here) to 1 MiB (one) changes the reducer's work: the candidate's
    # one bucket must not make the toggle inert against it (found in review: a real win REJECTed as inert). Against
    # 25 MiB, which holds the same bucket, it is.
    import dataclasses

    from ablate.receipts.schema import CompileRecord
    from trainer_helpers import make_spec
    from trainers.goodput import account_time
    from trainers.receipt import LaunchInfo, _disqualifiers
    from trainers.result import WorkerResult

    one = _details(observed, "ddp_1")
    assert len(_details(observed, "ddp_0.05")["buckets_bytes"]) > 1 and "bucket_cap_mb" in one["inactive"]
    lane = tiny_lane(engine={**DDP, "bucket_cap_mb": 1})

    def codes(baseline_mb: float) -> list[str]:
        spec = dataclasses.replace(make_spec(lane, Path("/nonexistent")), arm="candidate", feature="bucket_cap_mb",
                                   feature_value=1.0, baseline_value=baseline_mb)
        result = WorkerResult(rank=0, world_size=WORLD, attempt=0, executor="ray_train", pid=0, host="h",
                              node_id=None, fn_start=0.0, device="cpu", engine=one)
        record = CompileRecord(posture_requested="eager", posture_observed="eager", warmup_requested="auto",
                               warmup_resolved="explicit", warmup_reason="", graph_breaks=0,
                               recompiles_in_steady_state=0)
        found = _disqualifiers(spec, result, LaunchInfo("ray_train", 0.0, 2.0), account_time(2.0, 0.0, 1.0, 1.0, None),
                               record, steady=100, tokens_per_step=lane.batch.micro_batch * lane.batch.seq_len)
        return [d.code.value for d in found]

    assert "INERT_TOGGLE" not in codes(0.05)
    assert "INERT_TOGGLE" in codes(25.0)


def test_under_whole_compile_a_one_bucket_reducer_keeps_its_cap(observed: dict[str, Any]) -> None:
    # Dynamo's DDPOptimizer splits the compiled graph by the same cap, so one reducer bucket proves nothing there.
    whole = _details(observed, "ddp_1_whole")
    assert whole["buckets_bytes"] == [observed["ddp_1_whole"]["param_bytes"]]
    assert whole["bucket_cap_mb"] == 1.0 and whole["inactive"] == {}
    assert whole != _details(observed, "ddp_1")


def test_deepspeed_stage0_bucket_and_overlap_requests_are_inactive(observed: dict[str, Any]) -> None:
    small, large = _details(observed, "ds0_small"), _details(observed, "ds0_large")
    assert small["zero_stage"] == 0 and small["optimizer"] == "AdamW"
    assert (small["reduce_bucket_size"], small["allgather_bucket_size"], small["overlap_comm"]) == (None, None, None)
    assert set(small["inactive"]) == {"reduce_bucket_size", "allgather_bucket_size", "overlap_comm"}
    # What stage 0 really all-reduces with: DeepSpeed's fixed buffer, whatever the lane asked for.
    assert small["allreduce_bucket_elements"] == 500_000_000
    assert small == large, "different requests, same stage-0 engine: equal records"


def test_deepspeed_stage2_reduce_bucket_and_overlap_are_read_from_the_zero_optimizer(
        observed: dict[str, Any]) -> None:
    small, large = _details(observed, "ds2_2000"), _details(observed, "ds2_20000")
    assert small["optimizer"] == "DeepSpeedZeroOptimizer" and small["zero_stage"] == 2
    assert (small["reduce_bucket_size"], large["reduce_bucket_size"]) == (2000, 20000)
    assert small != large, "reduce buckets act at stage 2: different records"
    overlap = _details(observed, "ds2_20000_overlap")
    assert (large["overlap_comm"], overlap["overlap_comm"]) == (False, True) and overlap != large


def test_deepspeed_allgather_bucket_is_inactive_when_the_backend_gathers_into_one_tensor(
        observed: dict[str, Any]) -> None:
    # torch 2.13 has all_gather_into_tensor (gloo included), so ZeRO-1/2 never split the gather by this bucket.
    requested_4000, requested_40000 = _details(observed, "ds2_20000"), _details(observed, "ds2_20000_gather")
    assert requested_4000["allgather_bucket_size"] is None
    assert "all_gather_into_tensor" in requested_4000["inactive"]["allgather_bucket_size"]
    assert requested_4000 == requested_40000


def test_deepspeed_stage3_on_cpu_has_no_overlap_and_no_allgather_bucket(observed: dict[str, Any]) -> None:
    with_overlap, without = _details(observed, "ds3_overlap"), _details(observed, "ds3_plain")
    assert with_overlap["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" and with_overlap["zero_stage"] == 3
    assert with_overlap["reduce_bucket_size"] == 20000
    assert with_overlap["overlap_comm"] is None and "synchronized device" in with_overlap["inactive"]["overlap_comm"]
    assert with_overlap["allgather_bucket_size"] is None and "prefetch" in with_overlap["inactive"][
        "allgather_bucket_size"]
    assert with_overlap == without


def test_static_inert_rules_agree_with_the_running_deepspeed_engines(observed: dict[str, Any]) -> None:
    # ablate/config/features.py decides from the lane alone; each running engine says what it left idle.
    for name, engine_section in ARMS.items():
        if engine_section["name"] != "deepspeed":
            continue
        lane, details = _lane(engine_section), _details(observed, name)
        for setting in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
            value = getattr(lane.engine, setting)
            baseline = (not value) if isinstance(value, bool) else 2 * value
            static = FEATURES[setting].inert_reason(lane, baseline)
            assert (static is not None) == (setting in details["inactive"]), (name, setting, static)


def test_one_worker_ddp_has_no_wrapper_and_no_bucket() -> None:
    lane = tiny_lane(engine={"name": "ddp", "workers": 1, "bucket_cap_mb": 3})
    engine = build_engine(lane, _model(lane), torch.device("cpu"), 1)
    details = engine.details
    assert details["wrapper"] is None and details["bucket_cap_mb"] is None and details["backend"] is None
    assert "one worker" in details["inactive"]["bucket_cap_mb"]
    assert FEATURES["bucket_cap_mb"].inert_reason(lane, 25.0) is not None, "the static rule says so too"
    other = build_engine(tiny_lane(engine={"name": "ddp", "workers": 1, "bucket_cap_mb": 50}),
                         _model(lane), torch.device("cpu"), 1)
    assert other.details == details
