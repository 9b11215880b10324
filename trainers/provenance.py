"""Where and with what an arm ran: environment (allowlisted and redacted), software, git, host and hardware.

How to use: ``software_versions()`` + ``software_fingerprint()``; ``git_state(repo_root)``;
``code_fingerprint(repo_root)`` for the project's own code that runs in an arm; ``file_sha256(path)`` for the
campaign and defaults files as used; ``observe_hardware(device)`` for ``observed.hardware`` and
``hardware_fingerprint(hardware, software)`` over what in it decides speed. Nothing here raises on a missing
package, driver or repository: the field is written as ``None`` (JSON null), never invented.

The three fingerprints split evidence that must not be pooled: two arms are comparable only when the same code
(``code_fingerprint``) ran with the same packages (``software_fingerprint``) on the same kind of machine
(``hardware_fingerprint``). Each is 16 hex digits of a SHA-256.

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
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional


SOFTWARE_DISTRIBUTIONS: tuple[str, ...] = (
    "torch", "ray", "deepspeed", "numpy", "pydantic", "omegaconf", "mlflow", "nvidia-ml-py", "triton",
    "mamba-ssm", "causal-conv1d", "flash-attn", "flash-linear-attention", "psutil", "kernels",
)
"""Always recorded (``None`` when absent). ``kernels`` is Hugging Face's package: installed, it can shadow this
repository's ``kernels/`` (DESIGN §10), so its presence alone changes what runs."""
SOFTWARE_PREFIXES: tuple[str, ...] = ("nvidia-",)
"""Every installed distribution with one of these prefixes is recorded too: the CUDA libraries pip installs next
to torch (``nvidia-cublas-cu12``, ``nvidia-cudnn-cu12``, ``nvidia-nccl-cu12``, cu13 variants, ...) can be
upgraded on their own and decide GEMM, attention and collective speed."""
ROOT = Path(__file__).resolve().parent.parent
CODE_PACKAGES: tuple[str, ...] = ("kernels", "trainers", "ablate/config", "ablate/receipts", "ablate/redact.py",
                                  "ablate/sweep/node_check.py")
"""The project's own code that runs inside an arm (``code_fingerprint``): besides ``kernels/`` and ``trainers/``,
what they import from ``ablate`` and what decides the arm's model, backends, environment or measured figures (preset
patterns, the backend each feature value asks for, the environment an arm inherits, how steps are classified and
projected). Left out, an edit there kept the fingerprint, so blocks run before and after it pooled as one lane."""
_TORCH_STACK = ("torch.cuda", "torch.git", "cudnn", "nccl")


def _prefixed_distributions() -> dict[str, Optional[str]]:
    """Every installed distribution whose name starts with one of ``SOFTWARE_PREFIXES``, by its name as its
    metadata gives it. Only candidates have their metadata parsed: a dist-info directory's own name says which
    (``_normalized_name``, read off the path), where parsing all ~150 of a Ray + torch install cost ~0.1 s of every
    arm's start. A distribution that cannot say its name that way is parsed, as every one was before."""
    wanted = tuple(re.sub(r"[-_.]+", "_", prefix).lower() for prefix in SOFTWARE_PREFIXES)
    found: dict[str, Optional[str]] = {}
    for dist in importlib.metadata.distributions():
        normalized = getattr(dist, "_normalized_name", None)
        if isinstance(normalized, str) and not normalized.lower().startswith(wanted):
            continue
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(SOFTWARE_PREFIXES):
            found[name] = dist.version
    return found


def installed_versions() -> dict[str, Optional[str]]:
    """``python`` and the installed distributions ``software_versions`` records, read from their metadata now."""
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for dist in SOFTWARE_DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    versions.update({name: version for name, version in _prefixed_distributions().items() if name not in versions})
    return versions


def packages_stamp(paths: Iterable[str]) -> list[tuple[str, str, int]]:
    """Every distribution's metadata directory (``*.dist-info``, ``*.egg-info``) in the directories of ``paths`` (an
    import path), with its modification time: an install, upgrade or removal there changes it. Other files in those
    directories (a campaign's ``mlflow.db`` journal in the repository root) do not. Empty entries (the current
    directory) are left out. 0.7-0.8 ms for the 152 distributions of this project's install."""
    stamp = []
    for directory in dict.fromkeys(entry for entry in paths if entry):
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.endswith((".dist-info", ".egg-info")):
                        stamp.append((directory, entry.name, entry.stat().st_mtime_ns))
        except OSError:  # not a directory (a zip on the path), gone, unreadable: holds no metadata we can stamp
            continue
    return sorted(stamp)


_READ_BY_PARENT: Optional[tuple[list[tuple[str, str, int]], dict[str, Optional[str]]]] = None
"""(``packages_stamp(sys.path)``, ``installed_versions()``) as the fork server read them after its imports, before
it forked this process (``read_installed_versions_for_children``); None in any other process."""


def read_installed_versions_for_children() -> None:
    """In a fork server, after its imports: its children report these versions instead of reading ~20 metadata
    files each (~6 ms of every arm's start on 2 CPUs, ~3x that in a fresh fork), as long as nothing was installed
    on their import path since (``packages_stamp``). A server is keyed by that stamp too
    (``trainers.forkserver.server_key``), so an install retires it: otherwise its children would run the torch it
    had imported while a fresh read reported the one now on disk."""
    global _READ_BY_PARENT
    _READ_BY_PARENT = (packages_stamp(sys.path), installed_versions())


def software_versions() -> dict[str, Optional[str]]:
    """Versions of the packages that decide speed; importlib.metadata so nothing heavy is imported.

    Keys: ``python``, every name in ``SOFTWARE_DISTRIBUTIONS``, every installed ``nvidia-*`` distribution, and
    what torch was built with and loads: ``torch.cuda``, ``torch.git``, ``cudnn``, ``nccl`` (always present,
    ``None`` when unknown, so the key set never depends on which probe failed). In a process forked from a fork
    server, the distributions are those the server read (``read_installed_versions_for_children``) unless something
    was installed since; torch's build and what it loads are probed here, since a fork server never touches CUDA.
    """
    read = _READ_BY_PARENT
    versions = dict(read[1]) if read is not None and read[0] == packages_stamp(sys.path) else installed_versions()
    versions.update(dict.fromkeys(_TORCH_STACK))
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
        pass
    return versions


def _fingerprint(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def software_fingerprint(versions: Mapping[str, Optional[str]]) -> str:
    """Hash of *every* entry of ``versions`` (``software_versions()``): nothing is dropped, since any of them
    (torch build, CUDA/cuDNN/NCCL, triton, the nvidia-* wheels, the kernel packages) can change speed. A package
    that is absent (``None``) hashes differently from one that is installed."""
    return _fingerprint(dict(versions))


def evidence_fingerprint(versions: Mapping[str, Optional[str]], code: Optional[str], hardware: Optional[str]) -> str:
    """What decides speed, in one key: packages, the project's own arm code and the hardware. Evidence pools only
    under one value; a change restarts a lane's round count and marks earlier promotions for revalidation."""
    return _fingerprint({"packages": dict(versions), "code": code, "hardware": hardware})


def file_sha256(path: str | Path) -> str:
    """Full SHA-256 hex digest of a file's bytes (the campaign or defaults file exactly as a sweep read it).
    Raises ``FileNotFoundError`` / ``OSError``: a file that was used must exist."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def git_state(repo_root: Optional[Path] = None) -> tuple[Optional[str], Optional[bool]]:
    """(HEAD sha, dirty) of the repository holding this code; (None, None) outside a repository.

    Dirty means anything ``git status`` shows: modified or staged tracked files *and* untracked files that
    .gitignore does not exclude (a campaign file not yet added is part of what ran, and HEAD cannot rebuild it).
    """
    root = repo_root or ROOT
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=normal"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    head = sha.stdout.strip() if sha.returncode == 0 and sha.stdout.strip() else None
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return head, dirty


def _git_paths(root: Path, packages: tuple[str, ...], *args: str) -> Optional[list[str]]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", *args, "--", *packages], cwd=root, capture_output=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def _code_paths(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Relative paths of the code under ``packages``: git's tracked files plus untracked, not ignored ``*.py``
    (importable although never committed); without git (a ``ray job submit`` working dir has no .git), every
    ``*.py`` outside ``__pycache__``, which is the same set while all tracked files there are Python."""
    tracked = _git_paths(root, packages, "--cached")
    untracked = _git_paths(root, packages, "--others", "--exclude-standard")
    if tracked is not None and untracked is not None and (tracked or untracked):
        return sorted(set(tracked) | {p for p in untracked if p.endswith(".py")})
    paths = []
    for package in packages:
        if (root / package).is_file():
            paths.append(Path(package).as_posix())
            continue
        for path in (root / package).rglob("*.py"):
            relative = path.relative_to(root)
            if "__pycache__" not in relative.parts:
                paths.append(relative.as_posix())
    return sorted(paths)


def code_fingerprint(repo_root: Optional[Path] = None, packages: tuple[str, ...] = CODE_PACKAGES) -> str:
    """Hash of the working-tree content of the project's code that runs in an arm (``CODE_PACKAGES``).

    Content, not HEAD: an uncommitted edit, or a new untracked module next to the others, changes it; a deleted
    tracked file is hashed as deleted. Cost: two ``git ls-files`` and reading ~30 files (~250 KB), a few ms.
    Raises ``ValueError`` when none of ``packages`` exists under ``repo_root`` (a wrong root, not a missing fact).
    """
    root = Path(repo_root or ROOT)
    if not any((root / package).exists() for package in packages):
        raise ValueError(f"code_fingerprint: none of {list(packages)} is a directory under {root}")
    digest = hashlib.sha256()
    for relative in _code_paths(root, packages):
        try:
            content = hashlib.sha256((root / relative).read_bytes()).hexdigest()
        except OSError:
            content = "<unreadable or deleted>"
        digest.update(f"{relative}\0{content}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


_GPU_SPEED_KEYS = ("name", "memory_total_bytes", "power_limit_w")
"""Per GPU: the model, its memory (SKU, MIG slice) and the enforced power cap (an admin setting that bounds
clocks). Clocks, temperature, power draw, memory used and throttle reasons are readings of the moment, left out;
index and UUID identify one physical card, not what it can do."""
_CPU_SPEED_KEYS = ("cpu_model", "machine", "logical_cpus", "cpus_in_affinity", "torch_threads",
                   "host_allocator")


def hardware_fingerprint(hardware: Optional[Mapping[str, Any]],
                         software: Optional[Mapping[str, Optional[str]]] = None) -> str:
    """Hash of what in ``observe_hardware()``'s record decides speed: device kind, GPU models and counts, driver
    and CUDA driver versions, the CUDA/cuDNN/NCCL versions torch uses (``torch.cuda``, ``cudnn``, ``nccl`` from
    ``software``), and the CPU (model, architecture, cores and threads) with the arm process's host allocator
    policy (``trainers.host_malloc``: whether its steps fault their memory in again).

    ``software`` defaults to this process's ``software_versions()``; pass the receipt's own ``software`` when
    fingerprinting a record observed elsewhere. Missing keys, ``None`` and malformed entries are tolerated (they
    hash as absent), so a CPU record, an NVML record and a torch-only record all work.
    """
    hw: Mapping[str, Any] = hardware if isinstance(hardware, Mapping) else {}
    if software is None:
        software = software_versions()
    gpus_raw = hw.get("gpus")
    gpus = [g for g in gpus_raw if isinstance(g, Mapping)] if isinstance(gpus_raw, list) else []
    cpu = hw.get("cpu") if isinstance(hw.get("cpu"), Mapping) else (hw if hw.get("kind") == "cpu" else {})
    payload = {
        "kind": hw.get("kind"),
        "gpus": sorted((json.dumps({k: g.get(k) for k in _GPU_SPEED_KEYS}, sort_keys=True, default=str)
                        for g in gpus)),
        "gpus_observed": len(gpus),
        "count": hw.get("count"),
        "visible_count": hw.get("visible_count"),
        "driver": hw.get("driver"),
        "cuda_driver": hw.get("cuda_driver"),
        "cpu": {k: cpu.get(k) for k in _CPU_SPEED_KEYS},
        "cuda_stack": {k: software.get(k) for k in ("torch.cuda", "cudnn", "nccl")},
    }
    return _fingerprint(payload)


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

    from trainers.host_malloc import in_effect as host_allocator_in_effect
    from trainers.pairing import inherited_cpus

    try:
        affinity: Optional[int] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    # The allotment the arm inherited, not its interleaved pair's slot: whether a block got a pinned slot depends on
    # what else held the node's CPUs then, and a fingerprint that saw it split one sweep's blocks into two
    # "hardware" fingerprints, superseding the older half (its failures with it).
    inherited = inherited_cpus()
    return {"kind": "cpu", "cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(),
            "cpus_in_affinity": inherited if inherited is not None else affinity,
            "pinned_cpus": affinity if inherited is not None else None,
            "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
            "host_allocator": host_allocator_in_effect()}


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
