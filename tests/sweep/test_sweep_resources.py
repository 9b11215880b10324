"""Resource accounting as arithmetic: what a block asks Ray for, what a node holds, how many blocks run at once."""

from __future__ import annotations

import dataclasses

import pytest

from ablate.sweep.resources import DRIVER_CPU, DRIVER_GPU, BlockNeed, ResourceError, fit_node, plan_capacity


def test_one_worker_arms_hold_their_cpus_in_the_trial_itself() -> None:
    need = BlockNeed(workers=1, cpus_per_worker=1, gpus_per_worker=0)
    assert need.executor == "subprocess"
    assert need.trial_resources() == {"CPU": 1.0}
    assert fit_node(need, "n1", "h", {"CPU": 2.0}).arms == 2
    gpu = BlockNeed(workers=1, cpus_per_worker=4, gpus_per_worker=1)
    assert gpu.trial_resources() == {"CPU": 4.0, "GPU": 1.0}
    assert fit_node(gpu, "n1", "h", {"CPU": 48.0, "GPU": 4.0}).arms == 4
    assert fit_node(gpu, "n1", "h", {"CPU": 48.0}).arms == 0


def test_multi_worker_trials_hold_no_cpu_only_the_nodes_arm_capacity() -> None:
    need = BlockNeed(workers=2, cpus_per_worker=1, gpus_per_worker=0)
    assert need.executor == "ray_train"
    # The §3a deadlock needs the trial to hold a CPU its workers want; this shape holds none.
    assert need.trial_resources() == {"CPU": 0.0, DRIVER_CPU: 2.0}
    node = fit_node(need, "n1", "h", {"CPU": 2.0, DRIVER_CPU: 2.0})
    assert node.arms == 1
    gpu = BlockNeed(workers=2, cpus_per_worker=4, gpus_per_worker=1)
    assert gpu.trial_resources() == {"CPU": 0.0, DRIVER_CPU: 8.0, DRIVER_GPU: 2.0}
    # GPU-bound: 48 CPUs would admit 6 trials, 4 GPUs only 2.
    assert fit_node(gpu, "n1", "h", {"CPU": 48.0, "GPU": 4.0, DRIVER_CPU: 48.0, DRIVER_GPU: 4.0}).arms == 2


def test_a_node_without_driver_resources_is_named_with_the_fix() -> None:
    need = BlockNeed(workers=2, cpus_per_worker=1, gpus_per_worker=0)
    node = fit_node(need, "abcdef123456", "box", {"CPU": 8.0})
    assert node.arms == 0
    assert DRIVER_CPU in node.why_not and "ray start --resources" in node.why_not


def test_a_campaign_that_fits_nowhere_raises_with_need_and_have() -> None:
    need = BlockNeed(workers=2, cpus_per_worker=2, gpus_per_worker=0)
    nodes = [fit_node(need, "node0001", "a", {"CPU": 2.0, DRIVER_CPU: 2.0}),
             fit_node(need, "node0002", "b", {"CPU": 3.0, DRIVER_CPU: 3.0})]
    with pytest.raises(ResourceError) as info:
        plan_capacity(need, nodes, campaign="big")
    message = str(info.value)
    assert "'big'" in message and "one node with 4 CPU" in message and "2 worker(s) x 2 CPU" in message
    assert "node node0001 (a): 2 CPU" in message and "node node0002 (b): 3 CPU" in message
    assert "lane.engine.workers" in message


def test_concurrency_sums_nodes_and_respects_caps() -> None:
    need = BlockNeed(workers=1, cpus_per_worker=1, gpus_per_worker=0)
    nodes = [fit_node(need, f"n{i}", "h", {"CPU": 2.0}) for i in range(3)]
    assert plan_capacity(need, nodes, campaign="c").max_concurrent == 6
    assert plan_capacity(need, nodes, campaign="c", num_blocks=4).max_concurrent == 4
    assert plan_capacity(need, nodes, campaign="c", max_concurrent_blocks=2).max_concurrent == 2
    # An explicit cap above today's nodes is honoured (pending trials hold nothing: the autoscaler's cue).
    above = plan_capacity(need, nodes, campaign="c", max_concurrent_blocks=10)
    assert above.max_concurrent == 10 and "autoscaler" in above.describe()


def test_an_auto_lane_on_a_gpu_cluster_reserves_a_gpu_for_every_worker() -> None:
    from pathlib import Path

    from ablate.config.load import load_sweep
    from ablate.config.schema import Device
    from ablate.sweep.resources import block_need, gpu_resources

    # smoke.yaml leaves device (auto) and gpus_per_worker (0) to their defaults: on a GPU node its arms run on CUDA,
    # so they must hold a GPU each, or every concurrent block lands on GPU 0 and times its neighbours' kernels.
    sweep, _ = load_sweep(Path(__file__).resolve().parents[2] / "search_spaces" / "smoke.yaml")
    assert sweep.lane.hardware.device.value == "auto" and sweep.resources.gpus_per_worker == 0
    on_gpus = gpu_resources(sweep.lane, sweep.resources, cluster_gpus=1.0)
    assert on_gpus.gpus_per_worker == 1
    assert block_need([], on_gpus).trial_resources().get("GPU") == 1.0
    # Without GPUs the lane runs on CPU and asks for none; an explicit count and a CPU lane are left as they are.
    assert gpu_resources(sweep.lane, sweep.resources, cluster_gpus=0.0).gpus_per_worker == 0
    two = dataclasses.replace(sweep.resources, gpus_per_worker=2)
    assert gpu_resources(sweep.lane, two, cluster_gpus=8.0).gpus_per_worker == 2
    cpu_lane = dataclasses.replace(sweep.lane, hardware=dataclasses.replace(sweep.lane.hardware, device=Device.cpu))
    assert gpu_resources(cpu_lane, sweep.resources, cluster_gpus=8.0).gpus_per_worker == 0


def test_each_local_ray_start_gets_its_own_system_config() -> None:
    # Ray writes the session's spill directory into the _system_config dict it is given: a dict shared between two
    # starts in one process (until-decided rounds) would send the second session's spills to the first's directory.
    from ablate.sweep.resources import LOCAL_RAY_SYSTEM_CONFIG, local_ray_init_kwargs

    first = local_ray_init_kwargs(num_cpus=2, num_gpus=0)["_system_config"]
    first["object_spilling_config"] = '{"params": {"directory_path": "/tmp/ray/session_a"}}'
    second = local_ray_init_kwargs(num_cpus=2, num_gpus=0)["_system_config"]
    assert second == LOCAL_RAY_SYSTEM_CONFIG == {"prestart_worker_first_driver": False}


def test_the_local_runtime_counts_gpus_as_ray_and_the_planner_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPUs a local runtime offers: never more than NVML sees (as Ray counts them), none when
    ``CUDA_VISIBLE_DEVICES`` hides them all ("", "-1", as ``local_device_class`` reads it), so an ``auto`` lane is
    never planned for CUDA on a machine whose arms cannot reach one (found in review: "-1" and "0" counted one GPU
    on a machine without any)."""
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    from ablate.sweep.resources import detect_local

    for nvml, visible, expected in ((0, "0", 0), (0, "-1", 0), (4, "-1", 0), (4, "", 0), (4, "0,1", 2),
                                    (4, None, 4), (2, "0,1,2,3", 2)):
        monkeypatch.setattr(NvidiaGPUAcceleratorManager, "get_current_node_num_accelerators",
                            staticmethod(lambda count=nvml: count))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert detect_local(num_cpus=2) == (2, expected), (nvml, visible)
