"""ArmSpec: everything one arm needs to run, produced by the sweep and consumed by the trainer.

It crosses process boundaries (Ray object store, a JSON file for the fresh-process executor), so it is a plain
dataclass of JSON-able values plus the typed ``LaneConfig``; ``to_json``/``from_json`` round-trip it through
the same typed boundary the CLI uses.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ablate.config.schema import LaneConfig


ALLOTTED_CPUS_ENV = "ABLATE_ARM_CPUS"
"""Set by ``trainers.run`` on a one-worker arm's process: the CPUs the campaign allots it
(``resources.cpus_per_worker``, an interleaved pair's slot size). The arm's automatic torch threads never exceed
it, whether or not its pair got a slot to be pinned to, so every block of a sweep runs, and fingerprints, the same
thread count (``trainers.loop._threads``)."""


@dataclass
class ArmSpec:
    lane: LaneConfig
    """Exactly what this arm runs (baseline lane, or baseline lane + the candidate value)."""
    sweep_id: str
    campaign: str
    block_id: str
    arm: str
    """baseline, candidate or aa."""
    arm_index: int
    order: int
    """0 = runs first in its block, 1 = second."""
    feature: Optional[str]
    feature_value: Optional[Any]
    baseline_value: Optional[Any]
    kind: str
    lane_key: str
    receipt_dir: str
    """Where the receipt JSON is written (atomically) before anything is reported."""
    scheduled_at: float
    """time.time() when the arm was scheduled: the start of its wall clock (queue wait is badput)."""
    clock: str = "caller"
    """Who stamped ``scheduled_at``: driver (the sweep driver, when it handed the block to Ray) or caller."""
    campaign_sha256: Optional[str] = None
    defaults_sha256: Optional[str] = None
    """Content hashes of the campaign and defaults files as used: the receipt can name exactly what it ran."""
    attempt: int = 0
    receipt_id: Optional[str] = None
    """Stable across retries of the same arm attempt so replays stay idempotent; generated when None."""
    schedule: str = "fixed"
    """fixed, or until_decided (the sequential searcher scheduled this block): recorded in the receipt."""
    node_check_path: str = "~/.ablate/node_check.json"
    """Where this node keeps its ``ablate doctor --deep`` document (the campaign's ``node_check.path``); the
    receipt names the document the arm ran under."""
    device: Optional[str] = None
    """The device class (cpu, cuda) the driver planned the arm for: what ``hardware.device: auto`` resolves to on its
    cluster, whose GPUs it reserved or not (``ablate.config.auto_device``); None: the trainer resolves it."""
    host_allocator: str = "retain"
    """The campaign's ``resources.host_allocator``: what the arm's process does with host memory it frees
    (``trainers.host_malloc``)."""
    inject: dict[str, Any] = field(default_factory=dict)
    """Fault injection for tests only (raise_at_step, nan_at_step, oom_at_step, kill_at_step, transition_sleep_s...)."""

    def __post_init__(self) -> None:
        from trainers.host_malloc import check_policy

        check_policy(self.host_allocator)

    def to_json(self) -> str:
        from ablate.config.load import lane_to_dict

        data = asdict(self)
        data["lane"] = lane_to_dict(self.lane)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "ArmSpec":
        from ablate.config.load import load_lane

        data = json.loads(text)
        data["lane"] = load_lane(data["lane"])
        return cls(**data)
