"""Plain data that crosses process boundaries between the worker, the executors and the receipt builder.

Torch-free on purpose: ``trainers.run`` and ``trainers.receipt`` import it in the orchestrator's process (a Ray
Tune trial), which should not pay for importing torch when the arm itself runs in a fresh process.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from trainers.goodput import LoopSummary


@dataclass(frozen=True)
class Geometry:
    micro_batch: int
    seq_len: int
    grad_accum: int
    world_size: int

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step over all ranks: the unit of the arm's fixed token budget."""
        return self.micro_batch * self.seq_len * self.grad_accum * self.world_size


@dataclass
class WorkerContext:
    """Where this worker sits in the arm: rank, world, attempt and which executor launched it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    attempt: int = 0
    executor: str = "subprocess"
    work_dir: Optional[str] = None
    """Per-arm scratch directory (partial results of failed attempts)."""
    cuda_index: Optional[int] = None
    """CUDA device index this worker owns (Ray Train sets CUDA_VISIBLE_DEVICES); None -> 0."""
    node_id: Optional[str] = None


@dataclass
class WorkerResult:
    """Everything one worker measured (rank 0's is the arm's); JSON between the worker and ``run_arm``.

    Times named ``fn_start`` / ``ready`` / ``done`` / ``first_step_end`` are ``time.time()`` stamps, so the
    orchestrator can place them on its own wall clock; durations inside ``loop`` are ``perf_counter`` seconds.
    """

    rank: int
    world_size: int
    attempt: int
    executor: str
    pid: int
    host: str
    node_id: Optional[str]
    fn_start: float
    features_at: Optional[float] = None
    """When the lane's features were first read (model construction began): executor start-up ends here."""
    setup_wait_s: float = 0.0
    """Interleaved blocks: time waited for the setup turn (the partner's setup ran meanwhile)."""
    paired: bool = False
    """Whether the arm really ran interleaved with its partner (a coordinator granted its turns)."""
    ready: Optional[float] = None
    """Model, kernels, compile wrapping and engine built: feature-dependent setup ends here."""
    done: Optional[float] = None
    """The measured loop ended (what follows is collection and teardown)."""
    first_step_end: Optional[float] = None
    device: Optional[str] = None
    warmup: Optional[dict[str, Any]] = None
    compile: Optional[dict[str, Any]] = None
    loop: Optional[dict[str, Any]] = None
    losses: list[float] = field(default_factory=list)
    quality: dict[str, Optional[float]] = field(default_factory=dict)
    backends: list[dict[str, str]] = field(default_factory=list)
    layer_counts: dict[str, int] = field(default_factory=dict)
    params: dict[str, Optional[int]] = field(default_factory=dict)
    flops: dict[str, Any] = field(default_factory=dict)
    tokens_per_step_observed: list[int] = field(default_factory=list)
    hardware: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    family_share: dict[str, Optional[float]] = field(default_factory=dict)
    family_method: Optional[str] = None
    engine: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    host_load: dict[str, Any] = field(default_factory=dict)
    energy: dict[str, Any] = field(default_factory=dict)
    node_check: dict[str, Any] = field(default_factory=dict)
    """Summary of this node's ``ablate doctor --deep`` document (``ablate.sweep.node_check.read_document``)."""
    """``trainers.energy`` record over the budget steps, every rank combined (rank 0's result carries it)."""
    software: dict[str, Optional[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    error: Optional[dict[str, Any]] = None
    """{type, message, category (exception | oom | nonfinite | graph_break), step}."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerResult":
        return cls(**json.loads(text))

    @property
    def loop_summary(self) -> Optional[LoopSummary]:
        return LoopSummary.from_dict(self.loop) if self.loop else None


