"""`ablate doctor`: what this machine can run, before a campaign wastes a cluster allocation on it.

Checks: package versions, the hardware nvidia-ml-py sees (or the CPU), Ray (a running cluster, or a local one
a sweep would start), and the MLflow tracking store. Each check is a row: name, ok, detail.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from typing import Callable, Optional

from ablate.redact import redact_uri

PACKAGES = ("ablate-runner", "torch", "ray", "deepspeed", "mlflow", "omegaconf", "nvidia-ml-py", "triton",
            "pydantic")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def versions() -> dict[str, Optional[str]]:
    found: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def nvml_devices() -> tuple[list[dict[str, object]], Optional[str]]:
    """GPUs as nvidia-ml-py reports them, or ([], why not)."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML unavailable ({exc}): no NVIDIA driver on this machine"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append({"index": index, "name": pynvml.nvmlDeviceGetName(handle),
                            "memory_total_bytes": int(memory.total), "driver": driver})
        return devices, None
    finally:
        pynvml.nvmlShutdown()


def check_hardware() -> Check:
    devices, why = nvml_devices()
    if devices:
        names = ", ".join(f"{d['index']}: {d['name']} ({int(d['memory_total_bytes']) >> 30} GiB)" for d in devices)
        return Check("hardware", True, f"{len(devices)} GPU(s), driver {devices[0]['driver']}: {names}")
    cpu = platform.processor() or platform.machine()
    return Check("hardware", True, f"no GPU ({why}); CPU {cpu}, {os.cpu_count()} logical CPUs: arms run on CPU")


def check_torch() -> Check:
    import torch

    cuda = torch.cuda.is_available()
    detail = f"torch {torch.__version__}, CUDA {'available: ' + torch.version.cuda if cuda else 'not available'}"
    return Check("torch", True, detail)


def check_ray(address: Optional[str]) -> Check:
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if not target:
        return Check("ray", True, f"ray {ray.__version__}; no RAY_ADDRESS: `ablate sweep` starts a local Ray runtime")
    try:
        ray.init(address=target, logging_level="ERROR", log_to_driver=False)
        resources = ray.cluster_resources()
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        return Check("ray", True, f"cluster at {target}: {nodes} node(s), resources {dict(resources)}")
    except Exception as exc:  # noqa: BLE001 - any failure to attach is the finding itself
        return Check("ray", False, f"cannot attach to {target}: {type(exc).__name__}: {exc}")
    finally:
        if ray.is_initialized():
            ray.shutdown()


def check_mlflow(tracking_uri: str) -> Check:
    from mlflow.tracking import MlflowClient

    shown = redact_uri(tracking_uri)
    try:
        MlflowClient(tracking_uri=tracking_uri).search_experiments(max_results=1)
        return Check("mlflow", True, f"tracking store {shown} reachable")
    except Exception as exc:  # noqa: BLE001
        return Check("mlflow", False, f"tracking store {shown} unreachable: {type(exc).__name__}: "
                                      f"{redact_uri(str(exc).splitlines()[0] if str(exc) else '')}")


def run_checks(tracking_uri: str, ray_address: Optional[str]) -> list[Check]:
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("hardware", check_hardware), ("torch", check_torch),
        ("ray", lambda: check_ray(ray_address)), ("mlflow", lambda: check_mlflow(tracking_uri)),
    ]
    results = []
    for name, step in steps:
        try:
            results.append(step())
        except Exception as exc:  # noqa: BLE001 - doctor reports, it never crashes
            results.append(Check(name, False, f"{type(exc).__name__}: {exc}"))
    return results
