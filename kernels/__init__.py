"""Ops with pure-torch reference twins, plus one dispatcher that resolves each op's backend once and records why.

How to use: ``from kernels.dispatch import Dispatcher``; see ``kernels/dispatch.py``. Importing this package
registers every op (moe, mla_ingress, add_rmsnorm, ssd, recurrent_scan) and imports neither Triton nor mamba_ssm:
GPU-only backends load lazily when the dispatcher picks them. No config dependency: callers pass backend names.
"""

from kernels import mla, moe, norm, scan, ssd  # noqa: F401  (registration side effects)
from kernels.capability import Capability, probe
from kernels.dispatch import BackendMismatchError, BackendRecord, Dispatcher, OpSpec, registered_ops

__all__ = ["BackendMismatchError", "BackendRecord", "Capability", "Dispatcher", "OpSpec", "probe", "registered_ops"]
