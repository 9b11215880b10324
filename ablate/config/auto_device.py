"""What ``hardware.device: auto`` resolves to, as far as the machine that plans a sweep can tell before Ray starts.

Why the planner needs it: a lane override in defaults.yaml is keyed by the lane's shape with ``auto`` resolved to
the device its evidence ran on (``ablate.config.lane_shape``), so the baseline an ``auto`` lane runs depends on
where it runs. The sweep plans on this machine's answer and, once Ray is up, plans again when the cluster resolves
``auto`` otherwise (or refuses to start, where a round cannot be planned again: ``ablate.sweep.run``): a value won
on CPU never becomes the baseline of GPU arms, nor the reverse.

The answer is this machine's: CUDA when NVML sees a GPU this process may use (``CUDA_VISIBLE_DEVICES`` empty or
``-1`` hides them all), which is what a local Ray runtime, the embedded default, gives its arms. NVML, not torch:
planning stays torch-free and takes milliseconds.
"""

from __future__ import annotations

import functools
import os

from ablate.config.lane_shape import AUTO
from ablate.config.schema import LaneConfig


@functools.lru_cache(maxsize=1)
def local_device_class() -> str:
    """``cuda`` when NVML counts at least one GPU visible to this process, else ``cpu`` (no driver, no NVML)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVIDIA driver or library: a CPU machine
        return "cpu"
    return "cuda" if count > 0 else "cpu"


def planned_device(lane: LaneConfig) -> str:
    """The device class a sweep of ``lane`` plans for: the lane's own, or this machine's for ``auto``."""
    device = lane.hardware.device.value
    return local_device_class() if device == AUTO else device


def cluster_device(lane: LaneConfig, cluster_gpus: float) -> str:
    """The device class the lane's arms run on in a Ray cluster with ``cluster_gpus`` GPUs: ``auto`` is CUDA when
    there are any (``ablate.sweep.resources.gpu_resources`` then gives each worker one), as the trainer resolves
    it (``trainers.loop.resolve_device``); ``cuda`` with ``cpu_fallback`` on a cluster without GPUs runs on CPU."""
    device = lane.hardware.device.value
    if device == AUTO or (device == "cuda" and lane.hardware.cpu_fallback):
        return "cuda" if cluster_gpus >= 1 else "cpu"
    return device

