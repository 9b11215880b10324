"""Where and with what an arm ran: environment (allowlisted and redacted), software, git, host and hardware.

How to use: ``software_versions()`` + ``software_fingerprint()``;
``git_state(repo_root)``; ``observe_hardware(device)`` for ``observed.hardware``. Nothing here raises on a
missing package, driver or repository: the field is written as ``None`` (JSON null), never invented.

Secrets: the environment passes an allowlist first (only names that describe the runtime: CUDA_*, NCCL_*,
OMP_NUM_THREADS, TORCH_*, ...), and then a redaction step, so a secret that slips through the allowlist
(``TORCH_HUB_TOKEN``, a ``MLFLOW_TRACKING_URI`` with ``user:password@``) is still replaced.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any, Mapping, Optional


SOFTWARE_DISTRIBUTIONS: tuple[str, ...] = (
    "torch", "ray", "deepspeed", "numpy", "pydantic", "omegaconf", "mlflow", "nvidia-ml-py", "triton",
    "mamba-ssm", "causal-conv1d", "flash-attn", "psutil",
)


def software_versions() -> dict[str, Optional[str]]:
    """Versions of the packages that decide speed; importlib.metadata so nothing heavy is imported."""
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for dist in SOFTWARE_DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        import torch

        versions["torch.cuda"] = torch.version.cuda
        versions["torch.git"] = getattr(torch.version, "git_version", None)
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        versions["cudnn"] = str(cudnn) if cudnn else None
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        versions["nccl"] = ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else (
            str(nccl) if nccl else None)
    except Exception:  # noqa: BLE001 - a broken CUDA install must not cost the receipt
        versions.setdefault("torch.cuda", None)
    return versions


def software_fingerprint(versions: Mapping[str, Optional[str]]) -> str:
    return hashlib.sha256(json.dumps(dict(versions), sort_keys=True).encode()).hexdigest()[:16]


def git_state(repo_root: Optional[Path] = None) -> tuple[Optional[str], Optional[bool]]:
    """(HEAD sha, dirty) of the repository holding this code; (None, None) outside a repository."""
    root = repo_root or Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    head = sha.stdout.strip() if sha.returncode == 0 and sha.stdout.strip() else None
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return head, dirty


def host_name() -> str:
    return socket.gethostname()


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpu_facts() -> dict[str, Any]:
    import torch

    try:
        affinity: Optional[int] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"kind": "cpu", "cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(), "cpus_in_affinity": affinity,
            "torch_threads": torch.get_num_threads(), "machine": platform.machine()}


_THROTTLE_BITS = {0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x8: "HwSlowdown",
                  0x10: "SyncBoost", 0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown",
                  0x80: "HwPowerBrakeSlowdown", 0x100: "DisplayClockSetting"}


def _nvml_call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - NVML raises NVMLError_NotSupported etc. per call; null that field only
        return None


def _nvml_facts(uuids: Optional[list[str]] = None) -> Optional[dict[str, Any]]:
    """nvidia-ml-py facts for the given GPUs (all when None), or None when NVML is absent (no driver, CPU machine).

    GPUs are matched by UUID: NVML numbers physical devices and ignores CUDA_VISIBLE_DEVICES, which Ray sets, so
    torch's cuda:0 need not be NVML's index 0.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, driver not loaded
        return None
    try:
        count = _nvml_call(pynvml.nvmlDeviceGetCount) or 0
        try:
            handles = ([pynvml.nvmlDeviceGetHandleByUUID(uuid) for uuid in uuids] if uuids is not None else
                       [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)])
        except Exception:  # noqa: BLE001 - an unknown UUID (MIG slice, odd driver): let the caller fall back
            return None
        gpus = []
        for handle in handles:
            index = _nvml_call(pynvml.nvmlDeviceGetIndex, handle)
            memory = _nvml_call(pynvml.nvmlDeviceGetMemoryInfo, handle)
            reasons = _nvml_call(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
            power = _nvml_call(pynvml.nvmlDeviceGetPowerUsage, handle)
            limit = _nvml_call(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            gpus.append({
                "index": index,
                "name": _nvml_call(pynvml.nvmlDeviceGetName, handle),
                "uuid": _nvml_call(pynvml.nvmlDeviceGetUUID, handle),
                "memory_total_bytes": getattr(memory, "total", None),
                "memory_used_bytes": getattr(memory, "used", None),
                "sm_clock_mhz": _nvml_call(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
                "max_sm_clock_mhz": _nvml_call(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
                "mem_clock_mhz": _nvml_call(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM),
                "power_w": power / 1000.0 if power is not None else None,
                "power_limit_w": limit / 1000.0 if limit is not None else None,
                "temperature_c": _nvml_call(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
                "throttle_reasons_mask": reasons,
                "throttle_reasons": ([name for bit, name in _THROTTLE_BITS.items() if reasons & bit]
                                     if reasons is not None else None),
            })
        return {"kind": "cuda", "source": "nvml", "count": count, "gpus": gpus,
                "driver": _nvml_call(pynvml.nvmlSystemGetDriverVersion),
                "cuda_driver": _nvml_call(pynvml.nvmlSystemGetCudaDriverVersion)}
    finally:
        _nvml_call(pynvml.nvmlShutdown)


def observe_hardware(device_type: str, local_device_index: Optional[int] = None) -> dict[str, Any]:
    """GPU facts from NVML when the arm ran on CUDA; otherwise the CPU model and threads it actually used."""
    if device_type == "cuda":
        import torch

        index = local_device_index or 0
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        facts = None
        if uuid is not None:
            facts = _nvml_facts([f"GPU-{uuid}"])
        if facts is None:
            facts = _nvml_facts()
            if facts is not None:
                facts["matched"] = "all devices listed: no torch UUID to match the worker's GPU"
        if facts is not None:
            facts["visible_count"] = torch.cuda.device_count()
            facts["cpu"] = _cpu_facts()
            return facts
        # NVML missing but CUDA present (some containers): torch still knows the name and memory.
        return {"kind": "cuda", "source": "torch", "count": None, "visible_count": torch.cuda.device_count(),
                "gpus": [{"index": index, "name": props.name, "memory_total_bytes": props.total_memory}],
                "driver": None, "cpu": _cpu_facts()}
    facts = _cpu_facts()
    facts["source"] = "procfs"
    return facts
