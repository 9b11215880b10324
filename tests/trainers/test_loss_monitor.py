"""The loss monitor reads losses a fixed number of steps late (CUDA's path, run here through its CPU twin)."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.loop import LOSS_LAG_STEPS, LossMonitor

LOSSES = [2.5, 2.25, 2.0, float("nan"), 1.75, 1.5, 1.25]


def _feed(monitor: LossMonitor, losses: list[float], stop_on_nonfinite: bool) -> int:
    """Push like the arm's budget loop does; return how many steps ran."""
    ran = 0
    for step, value in enumerate(losses):
        monitor.push(step, torch.tensor(value))
        ran += 1
        if stop_on_nonfinite and monitor.nonfinite_step is not None:
            break
    monitor.flush()
    return ran


@pytest.mark.parametrize("lag", [1, 2, LOSS_LAG_STEPS])
def test_the_deferred_ring_records_what_the_immediate_path_records(lag: int) -> None:
    now, deferred = LossMonitor(1, torch.device("cpu")), LossMonitor(1, torch.device("cpu"), lag=lag, deferred=True)
    _feed(now, LOSSES, stop_on_nonfinite=False)
    _feed(deferred, LOSSES, stop_on_nonfinite=False)
    assert [v if math.isfinite(v) else "nan" for v in deferred.values] == \
        [v if math.isfinite(v) else "nan" for v in now.values]
    assert deferred.nonfinite_step == now.nonfinite_step == 3


@pytest.mark.parametrize("lag", [1, 3])
def test_a_nonfinite_loss_stops_exactly_lag_steps_late(lag: int) -> None:
    monitor = LossMonitor(1, torch.device("cpu"), lag=lag, deferred=True)
    ran = _feed(monitor, LOSSES, stop_on_nonfinite=True)
    # Step 3 is non-finite: it is read when step 3 + lag is pushed, the same step on every rank.
    assert monitor.nonfinite_step == 3 and ran == 3 + lag + 1
    assert len(monitor.values) == ran and math.isnan(monitor.values[3])


def test_only_the_flush_waits_and_nothing_is_read_before_the_lag() -> None:
    monitor = LossMonitor(1, torch.device("cpu"), lag=4, deferred=True)
    for step in range(3):
        monitor.push(step, torch.tensor(1.0 + step))
    assert monitor.values == [] and monitor.waits == 0, "nothing read while the host is within the lag"
    for step in range(3, 10):
        monitor.push(step, torch.tensor(1.0 + step))
    assert monitor.values == [1.0 + s for s in range(6)] and monitor.waits == 0
    monitor.flush()
    assert monitor.values == [1.0 + s for s in range(10)] and monitor.waits == 4


def _rank(rank: int, port: int, out: str) -> None:
    import json
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        monitor = LossMonitor(2, torch.device("cpu"), lag=2, deferred=True)
        # Only rank 1 sees the non-finite loss; the flag rides on the all-reduce, so both must stop together.
        losses = [1.0, 1.0, 1.0, float("nan") if rank == 1 else 1.0, 1.0, 1.0, 1.0, 1.0]
        ran = _feed(monitor, losses, stop_on_nonfinite=True)
        with open(f"{out}.{rank}", "w") as handle:
            json.dump({"ran": ran, "nonfinite_step": monitor.nonfinite_step, "first": monitor.values[0]}, handle)
    finally:
        dist.destroy_process_group()


def test_every_rank_stops_at_the_same_step(tmp_path) -> None:
    import json

    import torch.multiprocessing as mp

    from ablate.comm_check import _free_port

    mp.spawn(_rank, args=(_free_port(), str(tmp_path / "rank")), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(2)]
    assert results[0] == results[1] == {"ran": 6, "nonfinite_step": 3, "first": 1.0}


def test_a_fence_that_raises_at_the_end_costs_the_losses_not_the_result() -> None:
    # After a sticky CUDA error every later synchronize raises: the arm must still return a result (its receipt).
    from trainers.loop import _ArmState, _collect
    from trainers.result import WorkerResult

    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monitor = LossMonitor(1, torch.device("cpu"), lag=4, deferred=True)
    monitor.push(0, torch.tensor(2.0))
    monitor._pending.append((1, torch.tensor([1.0, 0.0]), Broken()))
    result = WorkerResult(rank=0, world_size=1, attempt=0, executor="test", pid=0, host="h", node_id=None,
                          fn_start=0.0)
    _collect(result, _ArmState(monitor=monitor))
    assert result.error is not None and "illegal memory access" in result.error["message"]
    assert monitor._pending == type(monitor._pending)() and result.losses == monitor.values
