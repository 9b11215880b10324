"""The host allocator policy of an arm's process (``resources.host_allocator``), applied once before it trains.

How to use (``trainers.worker`` and the Ray Train worker do)::

    apply(spec.host_allocator)   # in the arm's own process, before it builds its model
    in_effect()                  # what its receipt records (observed CPU facts, hardware fingerprint)

Why: an arm trains in a process that has run nothing before it, and glibc's malloc hands a fresh process's freed
memory back to the kernel: blocks of 128 KiB and more are mmap'd and unmapped one by one until its dynamic
threshold has grown, and a heap whose free top passes the trim threshold is shrunk. PyTorch's CPU tensors come
from malloc, so every step of a fresh arm unmapped and faulted its activations in again, page by page. On the smoke
campaign (2 CPUs, 36 arms; each arm's rusage, one instrumented run each way) the arms spent 12.6 of their 96.7 CPU-s
in the kernel; retaining freed memory cut that to 2.5 of 85.3 and the run from 65.0 to 56.2 s. One smoke arm on
its own (41 steps, in one process): 168-226k minor faults against ~39.7k. The campaign's record:
benchmarks/results/smoke_throughput.json. A GPU arm's tensors already come from a caching allocator; ``retain``
gives a CPU arm's the same steady state.

``retain`` sets the thresholds with ``mallopt`` (a fixed mmap threshold also stops glibc's dynamic one), so the
arm's process reuses what it freed; its memory still ends with its process, and no state passes between arms.
The environment wins over the policy: a process with another allocator preloaded (``LD_PRELOAD`` that replaces
malloc) or glibc's threshold variables set (``ENV_NAMES``, ``GLIBC_TUNABLES``' malloc entries) keeps what they say,
and records them (``environment: ...``). Where ``mallopt`` is missing (not glibc), the arm runs the C library's
defaults and records ``system``.
It imports nothing heavy (the schema's enum only), so an arm may call it before or after its own imports.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Mapping, Optional

from ablate.config.schema import ConfigError, HostAllocator

POLICIES = tuple(policy.value for policy in HostAllocator)

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap and are reused, not unmapped on free: glibc's largest mmap threshold on a
64-bit build (``DEFAULT_MMAP_THRESHOLD_MAX``); larger ones (a big weight, a long sequence's activations) are
still mapped and unmapped one by one."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the heap's top is returned to the kernel only beyond this."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h> parameter numbers
ENV_NAMES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""glibc's variables that decide when freed memory goes back to the kernel (read when the process starts; a forked
arm has its fork server's, which is keyed by and started with them). ``MALLOC_ARENA_MAX`` and the checking and
perturbing ones do not decide it and leave the policy in force."""
ENVIRONMENT = "environment"
"""Prefix of what an arm records when its environment sets the allocator: ``environment: <the settings>``, so two
settings are two hardware fingerprints and their evidence never pools."""

_in_effect: Optional[str] = None
_asked: Optional[str] = None


def check_policy(policy: str) -> None:
    """``ConfigError`` naming the key, the value and the policies allowed, unless ``policy`` is one of them."""
    if policy not in POLICIES:
        raise ConfigError("resources.host_allocator", policy, ", ".join(POLICIES))


def environment_allocator(environ: Optional[Mapping[str, str]] = None,
                          interposed: Optional[bool] = None) -> Optional[str]:
    """``environment: ...`` naming what in ``environ`` (default: this process's) sets the allocator, or None: a
    preload that replaced malloc (``interposed``, default: looked up in this process), glibc's threshold variables
    (``ENV_NAMES``) and the malloc entries of ``GLIBC_TUNABLES`` (where it reaches the arm: the allowlist of
    ``ablate.redact`` keeps it from the processes ablate starts). A preload that leaves glibc's malloc in place
    (``libgomp``, say) decides nothing."""
    env = os.environ if environ is None else environ
    parts = []
    preload = env.get("LD_PRELOAD", "").replace(":", " ").split()
    if preload and (_malloc_interposed() if interposed is None else interposed):
        parts.append("LD_PRELOAD=" + ",".join(os.path.basename(path) for path in preload))
    parts += [f"{name}={env[name]}" for name in ENV_NAMES if env.get(name)]
    tunables = [entry for entry in env.get("GLIBC_TUNABLES", "").split(":") if entry.startswith("glibc.malloc.")]
    if tunables:
        parts.append("GLIBC_TUNABLES=" + ":".join(tunables))
    return f"{ENVIRONMENT}: {' '.join(parts)}" if parts else None


def apply(policy: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """Apply ``policy`` to this process's malloc and return what is now in effect: ``retain``, ``system``,
    ``partial`` (the mmap threshold fixed, the trim threshold refused: a C library that is not glibc's) or
    ``environment: ...``. Once per process, before the arm allocates what its steps free; asking again for the
    same policy returns the same outcome, asking for another is a bug and raises ``RuntimeError``."""
    global _in_effect, _asked
    check_policy(policy)
    if _in_effect is not None:
        if policy != _asked:
            raise RuntimeError(f"host allocator already {_in_effect!r} (asked {_asked!r}); asked again for {policy!r}")
        return _in_effect
    decided = environment_allocator(environ)
    if decided is not None:
        _in_effect = decided
    elif policy == "retain" and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        _in_effect = "retain" if _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) else "partial"
    else:
        _in_effect = "system"
    _asked = policy
    return _in_effect


def in_effect() -> str:
    """What this process runs: what ``apply`` set, else the environment's allocator, else ``system`` (a test's
    in-process arm, say)."""
    return _in_effect or environment_allocator() or "system"


def _malloc_interposed() -> bool:
    """Whether ``malloc`` in this process's global scope is not the C library's own (jemalloc or tcmalloc
    preloaded). A preload that exports only versioned, non-default ``malloc`` symbols (glibc's
    ``libc_malloc_debug``, which wraps glibc's allocator) is not seen: there the policy still applies to the
    allocator underneath."""
    try:
        libc = ctypes.util.find_library("c")
        if libc is None:
            return False
        found = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
        own = ctypes.cast(ctypes.CDLL(libc).malloc, ctypes.c_void_p).value
    except (AttributeError, OSError):
        return False
    return found != own


def _mallopt(param: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None).mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
    except (AttributeError, OSError):  # no mallopt in this C library
        return False
