"""What runs inside a trial: one arm of a block, measured into a goodput receipt.

How to use::

    from trainers import run_arm, resolve_warmup
    receipt = run_arm(spec, max_failures=1)      # spec: trainers.spec.ArmSpec; receipt also on disk

Public names are imported lazily so ``import trainers`` (e.g. by the sweep's driver or for ``ArmSpec``) does not
pay for torch, Ray Train or DeepSpeed until an arm actually runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ablate.config.warmup import WarmupDecision, resolve_warmup
    from trainers.receipt import build_receipt
    from trainers.run import run_arm
    from trainers.spec import ArmSpec

__all__ = ["ArmSpec", "WarmupDecision", "build_receipt", "resolve_warmup", "run_arm"]

_LAZY = {"run_arm": "trainers.run", "ArmSpec": "trainers.spec", "resolve_warmup": "ablate.config.warmup",
         "WarmupDecision": "ablate.config.warmup", "build_receipt": "trainers.receipt"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainers' has no attribute {name!r}")
