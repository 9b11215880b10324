"""What this process can run, probed once per device: the facts every backend eligibility check reads.

How to use: ``probe(torch.device("cuda"))`` returns a frozen ``Capability``; it is cached, so every op resolution
in a trial sees the same answer. ``Capability.as_dict()`` is JSON-able for receipts.

Nothing here imports Triton or mamba_ssm: "importable" is ``importlib.util.find_spec``, so CPU CI never pays for
(or breaks on) GPU-only packages.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Capability:
    device_type: str
    torch_version: str
    cuda_available: bool
    cuda_capability: Optional[tuple[int, int]]
    """(major, minor) of the probed CUDA device; None on CPU."""
    triton_importable: bool
    mamba_ssm_importable: bool
    grouped_mm_available: bool
    """``torch._grouped_mm`` exists in this torch build (any device; CPU runs aten's per-group loop)."""
    grouped_mm_fast_path: bool
    """CUTLASS grouped GEMM: CUDA SM90 or SM100 only (GroupedBlas.cpp); bf16 operands are checked per call."""
    cpp_compiler: bool
    """Inductor's CPU backend needs a C++ compiler to generate kernels."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cuda_capability"] = list(self.cuda_capability) if self.cuda_capability else None
        return out


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _has_cpp_compiler() -> bool:
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return True
    return any(shutil.which(name) for name in ("g++", "clang++", "c++"))


@functools.lru_cache(maxsize=None)
def probe(device: torch.device) -> Capability:
    """Probe once per device; the cache keeps every resolution in a process consistent."""
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    cap: Optional[tuple[int, int]] = torch.cuda.get_device_capability(device) if cuda else None
    has_grouped_mm = hasattr(torch, "_grouped_mm")
    # GroupedBlas.cpp::_grouped_mm_cuda takes CUTLASS only under _scaled_mm_allowed_device(sm90_only, sm100_only).
    fast = bool(cuda and has_grouped_mm and cap is not None and (cap == (9, 0) or cap[0] == 10))
    return Capability(
        device_type=device.type,
        torch_version=torch.__version__,
        cuda_available=cuda,
        cuda_capability=cap,
        triton_importable=_has_module("triton"),
        mamba_ssm_importable=_has_module("mamba_ssm"),
        grouped_mm_available=has_grouped_mm,
        grouped_mm_fast_path=fast,
        cpp_compiler=_has_cpp_compiler(),
    )
