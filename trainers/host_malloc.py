"""The host allocator policy of an arm's process (``resources.host_allocator``), applied once before it trains.

How to use (``trainers.worker`` and the Ray Train worker do)::

    apply(spec.host_allocator)   # first thing in the arm's own process
    in_effect()                  # what its receipt records (observed CPU facts, hardware fingerprint)

Why: an arm trains in a process that has run nothing before it, and glibc's malloc hands a fresh process's freed
memory back to the kernel: blocks of 128 KiB and more are mmap'd and unmapped one by one until its dynamic
threshold has grown, and a heap whose free top passes the trim threshold is shrunk. PyTorch's CPU tensors come
from malloc, so every step of a fresh arm unmapped and faulted its activations in again, page by page. On the smoke
campaign (2 CPUs, 36 arms; each arm's rusage, one instrumented run each way) the arms spent 12.6 of their 96.7 CPU-s
in the kernel; retaining freed memory cut that to 2.5 of 85.3 and the run from 65.0 to 56.2 s. One smoke arm on
its own: 200-250k minor faults against ~39k. The campaign's record: benchmarks/results/smoke_throughput.json.
A GPU arm's tensors already come from a caching allocator; ``retain`` gives a CPU arm's the same steady state.

``retain`` sets the thresholds with ``mallopt`` (a fixed mmap threshold also stops glibc's dynamic one), so the
arm's process reuses what it freed; its memory still ends with its process, and no state passes between arms.
The environment wins over the policy: a process started with an allocator preloaded (``LD_PRELOAD``) or glibc's
malloc variables set (``MALLOC_*_``, ``GLIBC_TUNABLES``) keeps what they say, and records ``environment``.
Where ``mallopt`` is missing or refuses (not glibc), the arm runs the C library's defaults and records ``system``.
This module imports nothing heavy (the schema's enum only): it runs before the arm's imports.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

from ablate.config.schema import ConfigError, HostAllocator

POLICIES = tuple(policy.value for policy in HostAllocator)

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap and are reused, not unmapped on free: glibc's largest mmap threshold on a
64-bit build (``DEFAULT_MMAP_THRESHOLD_MAX``); larger ones (a big weight, a long sequence's activations) are
still mapped and unmapped one by one."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the heap's top is returned to the kernel only beyond this."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h> parameter numbers
_ENV_NAMES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_in_effect: Optional[str] = None


def _environment_decides(environ: dict[str, str]) -> bool:
    tunables = environ.get("GLIBC_TUNABLES", "")
    return (bool(environ.get("LD_PRELOAD", "").strip()) or any(environ.get(name) for name in _ENV_NAMES)
            or "glibc.malloc." in tunables)


def apply(policy: str, environ: Optional[dict[str, str]] = None) -> str:
    """Apply ``policy`` to this process's malloc and return what is now in effect: ``retain``, ``system`` or
    ``environment``. Call it once, before the arm allocates; a second call returns the first one's outcome."""
    global _in_effect
    if policy not in POLICIES:
        raise ConfigError("resources.host_allocator", policy, ", ".join(POLICIES))
    if _in_effect is not None:
        return _in_effect
    if _environment_decides(dict(os.environ if environ is None else environ)):
        _in_effect = "environment"
    elif policy == "retain" and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) \
            and _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES):
        _in_effect = "retain"
    else:
        _in_effect = "system"
    return _in_effect


def in_effect() -> str:
    """The policy this process runs: ``system`` until ``apply`` set another (a test's in-process arm, say)."""
    return _in_effect or "system"


def _mallopt(param: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None).mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
    except (AttributeError, OSError):  # no mallopt in this C library
        return False
