"""Typed configuration for ablate: the lane one arm runs, and the sweep that compares lanes.

How to use: never build these by hand from YAML; call ``ablate.config.load.load_sweep(path)`` or
``load_lane(mapping)``, which merge onto ``OmegaConf.structured`` and return these dataclasses. Below that
boundary nothing reads raw dicts. This module is a leaf: it imports neither torch nor Ray, so trainers and
kernels can depend on it without cycles.

Cross-field rules live in ``__post_init__`` and raise ``ConfigError`` naming the full key path, the value and
what is allowed. Per-field choices use ``Enum`` so OmegaConf itself rejects unknown values with the allowed set.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A user-facing configuration error; the message names key path, value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}: got {value!r}; allowed: {allowed}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle by the constructor's arguments: Ray ships exceptions between processes.
        return (type(self), (self.key, self.value, self.allowed))


# YAML has .nan and .inf, and every comparison with NaN is False: range checks must refuse non-finite values
# explicitly, or `lr: .nan` passes `value <= 0` unnoticed and reaches the trainer.

def _positive(key: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(key, value, "a finite positive number (> 0)")


def _non_negative(key: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(key, value, "a finite number >= 0")


def _at_most(key: str, value: int, limit: int, why: str) -> None:
    if value > limit:
        raise ConfigError(key, value, f"at most {limit:,} ({why})")


MAX_BLOCKS = 1000
"""Upper bound of ``blocks`` and ``aa_blocks``: a block is two training runs, and evidence needs tens of blocks
per round, not thousands; a bound keeps a typo (``blocks: 5000``) from planning and queueing ten thousand arms."""
CAMPAIGN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
"""A campaign name is one path component (``ablate_runs/<name>/``, the Ray experiment, MLflow tags): ASCII
letters, digits, ``_``, ``.`` and ``-``, starting with a letter or digit, at most 100 characters, no ``..``."""


# --- feature toggles: one Enum per toggle; the registry in ablate.config.features maps names to fields ---


class MoEDispatch(str, enum.Enum):
    padded = "padded"
    jagged = "jagged"
    grouped_mm = "grouped_mm"


class MLAIngress(str, enum.Enum):
    unfused = "unfused"
    fused = "fused"


class OnOff(str, enum.Enum):
    off = "off"
    on = "on"


class MambaScan(str, enum.Enum):
    sequential = "sequential"
    chunked = "chunked"
    mamba_ssm = "mamba_ssm"


class RecurrentScan(str, enum.Enum):
    sequential = "sequential"
    parallel = "parallel"


class CompilePosture(str, enum.Enum):
    eager = "eager"
    regional = "regional"
    whole = "whole"


class WarmupPolicy(str, enum.Enum):
    explicit = "explicit"
    skip = "skip"
    auto = "auto"


class EngineName(str, enum.Enum):
    ddp = "ddp"
    deepspeed = "deepspeed"


class Precision(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class DataSource(str, enum.Enum):
    synthetic = "synthetic"
    text = "text"


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Design(str, enum.Enum):
    one_at_a_time = "one_at_a_time"
    grid = "grid"


class HostAllocator(str, enum.Enum):
    retain = "retain"
    """Each arm's process keeps the host memory it frees for its next step, as a caching allocator does on a GPU
    (``trainers.host_malloc``)."""
    system = "system"
    """The C library's defaults: a fresh process hands freed blocks back to the kernel and faults them in again."""


class BlockMode(str, enum.Enum):
    interleaved = "interleaved"
    """Both arms side by side in their own processes, taking turns step by step (CPU one-worker arms)."""
    sequential = "sequential"
    """The arms back to back, in the block's order (multi-worker and GPU arms always run this way)."""


# --- the lane ---


@dataclass
class ModelConfig:
    """Pattern and dimensions of the hybrid model. Shape names follow DeepSeek-V3 / Mamba2."""

    pattern: str = "AEMR"
    """Layer letters A (MLA), E (MoE FFN), M (Mamba2 SSD), R (recurrent); ``XY*4+Z`` repeats; or a preset (nam56r)."""
    vocab_size: int = 256
    """Byte-level tokens by default, so the real-text path needs no tokenizer download."""
    d_model: int = 64
    n_heads: int = 4
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 128
    """Hidden width of each routed expert's SwiGLU FFN."""
    shared_expert: bool = True
    capacity_factor: float = 1.25
    """Used only by ``moe_dispatch: padded``: expert capacity = ceil(cf * tokens * top_k / n_experts)."""
    aux_loss_weight: float = 0.01
    ssm_d_state: int = 16
    ssm_head_dim: int = 16
    ssm_expand: int = 2
    ssm_chunk: int = 16
    """SSD chunk length Q; the sequence length must be a multiple of it."""
    conv_kernel: int = 4
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        # Imported here: pattern.py raises this module's ConfigError, so a top-level import would be circular.
        from ablate.config.pattern import parse_pattern

        parse_pattern(self.pattern)
        for name in ("vocab_size", "d_model", "n_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "q_lora_rank", "kv_lora_rank", "n_experts", "top_k", "d_expert", "ssm_d_state",
                     "ssm_head_dim", "ssm_expand", "ssm_chunk", "conv_kernel"):
            _positive(f"lane.model.{name}", getattr(self, name))
        _positive("lane.model.capacity_factor", self.capacity_factor)
        _non_negative("lane.model.aux_loss_weight", self.aux_loss_weight)
        _positive("lane.model.norm_eps", self.norm_eps)
        _positive("lane.model.rope_theta", self.rope_theta)
        if self.top_k > self.n_experts:
            raise ConfigError("lane.model.top_k", self.top_k,
                              f"an integer between 1 and lane.model.n_experts ({self.n_experts})")
        if self.qk_rope_head_dim % 2:
            raise ConfigError("lane.model.qk_rope_head_dim", self.qk_rope_head_dim, "an even number (RoPE pairs)")
        if (self.d_model * self.ssm_expand) % self.ssm_head_dim:
            raise ConfigError("lane.model.ssm_head_dim", self.ssm_head_dim,
                              f"a divisor of d_model * ssm_expand ({self.d_model * self.ssm_expand})")


@dataclass
class FeatureConfig:
    """Every feature toggle of the lane. Each field has one entry in ``ablate.config.features.FEATURES``."""

    moe_dispatch: MoEDispatch = MoEDispatch.padded
    mla_ingress: MLAIngress = MLAIngress.unfused
    fused_residual: OnOff = OnOff.off
    mamba_scan: MambaScan = MambaScan.sequential
    recurrent_scan: RecurrentScan = RecurrentScan.sequential
    stp: OnOff = OnOff.off
    """Skip-token prediction: an auxiliary head predicting token t+2. A tax, never a speed feature."""
    stp_weight: float = 0.1

    def __post_init__(self) -> None:
        _non_negative("lane.features.stp_weight", self.stp_weight)


@dataclass
class BatchConfig:
    micro_batch: int = 2
    seq_len: int = 64
    grad_accum: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "grad_accum"):
            _positive(f"lane.batch.{name}", getattr(self, name))


@dataclass
class CompileConfig:
    posture: CompilePosture = CompilePosture.eager
    warmup: WarmupPolicy = WarmupPolicy.auto
    """auto: skip explicit warmup on CUDA + regional compile + E blocks; otherwise warm up explicitly."""
    warmup_steps: int = 2
    """Explicit warmup steps run (and billed as compile warmup) before the measured budget."""

    def __post_init__(self) -> None:
        _non_negative("lane.compile.warmup_steps", self.warmup_steps)


@dataclass
class EngineConfig:
    name: EngineName = EngineName.ddp
    workers: int = 1
    """Data-parallel workers per arm (Ray Train workers, or one fresh process when 1)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    zero_stage: int = 0
    reduce_bucket_size: int = 500_000_000
    """DeepSpeed ZeRO reduce bucket, in elements (not bytes)."""
    allgather_bucket_size: int = 500_000_000
    """DeepSpeed ZeRO all-gather bucket, in elements (not bytes)."""
    overlap_comm: bool = False

    def __post_init__(self) -> None:
        _positive("lane.engine.workers", self.workers)
        _positive("lane.engine.bucket_cap_mb", self.bucket_cap_mb)
        _positive("lane.engine.reduce_bucket_size", self.reduce_bucket_size)
        _positive("lane.engine.allgather_bucket_size", self.allgather_bucket_size)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("lane.engine.zero_stage", self.zero_stage, "one of 0, 1, 2, 3")


@dataclass
class DataConfig:
    source: DataSource = DataSource.synthetic
    path: Optional[str] = None
    """Text files for ``source: text``: a file, a directory (all *.txt, *.md, *.py under it) or a glob."""
    seed: int = 1234


@dataclass
class BudgetConfig:
    steps: int = 8
    """Measured optimizer steps per arm; tokens = steps * micro_batch * seq_len * grad_accum * workers."""
    lr: float = 3e-4
    family_sample_steps: int = 2
    """Steady steps on which per-family time share is sampled (hooks cost a little, so only a few)."""
    min_steady_steps: int = 3
    horizon_steps: int = 10_000
    """Length, in optimizer steps, of the production run this lane stands for. Promotion compares arms by their
    projected time to this horizon: one-time feature costs (setup, compile warmup) + horizon x recurring step
    time. 10,000 steps is a short pretraining or a long fine-tuning run; set the lane's real length."""

    def __post_init__(self) -> None:
        _positive("lane.budget.steps", self.steps)
        _positive("lane.budget.horizon_steps", self.horizon_steps)
        _positive("lane.budget.lr", self.lr)
        _non_negative("lane.budget.family_sample_steps", self.family_sample_steps)
        _non_negative("lane.budget.min_steady_steps", self.min_steady_steps)


@dataclass
class HardwareConfig:
    device: Device = Device.auto
    """auto: CUDA when present, else CPU. cuda on a machine without one is refused unless cpu_fallback is true."""
    cpu_fallback: bool = False
    """Run on CPU when CUDA was asked for but is absent; the receipt then carries HARDWARE_MISMATCH."""
    threads: int = 0
    """torch intra-op threads per worker; 0 = the CPUs Ray allotted (``OMP_NUM_THREADS``), else the node's divided
    among the arm's workers, and for a one-worker arm never more than ``resources.cpus_per_worker``."""

    def __post_init__(self) -> None:
        _non_negative("lane.hardware.threads", self.threads)


@dataclass
class LaneConfig:
    """One concrete runtime shape. Two numbers are comparable only inside one lane."""

    model: ModelConfig = field(default_factory=ModelConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    precision: Precision = Precision.fp32
    compile: CompileConfig = field(default_factory=CompileConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch.seq_len % self.model.ssm_chunk:
            raise ConfigError("lane.batch.seq_len", self.batch.seq_len,
                              f"a multiple of lane.model.ssm_chunk ({self.model.ssm_chunk})")
        if self.data.source is DataSource.text and not self.data.path:
            raise ConfigError("lane.data.path", self.data.path, "a file, directory or glob when source is text")


# --- the sweep ---


@dataclass
class ResourcesConfig:
    cpus_per_worker: int = 1
    gpus_per_worker: int = 0
    max_concurrent_blocks: int = 0
    """0 = as many blocks at once as the cluster's CPUs/GPUs fit."""
    host_allocator: HostAllocator = HostAllocator.retain
    """How every arm's process treats the host memory it frees (both arms of a block alike). retain: kept for reuse,
    so a CPU arm's steady steps stop faulting their activations in again (13% of a smoke arm's CPU time went to
    the kernel before); system: glibc's defaults. An allocator the arm's environment sets (a preload that replaces
    malloc, glibc's threshold variables: ``trainers.host_malloc.environment_allocator``) wins over either.
    Receipts record what ran, in the hardware fingerprint."""

    def __post_init__(self) -> None:
        _positive("resources.cpus_per_worker", self.cpus_per_worker)
        _non_negative("resources.gpus_per_worker", self.gpus_per_worker)
        _non_negative("resources.max_concurrent_blocks", self.max_concurrent_blocks)


@dataclass
class TrackingConfig:
    uri: Optional[str] = None
    """MLflow tracking URI. Precedence: --tracking-uri, this key, $MLFLOW_TRACKING_URI, sqlite:///<cwd>/mlflow.db."""
    experiment: str = "ablate"
    storage: Optional[str] = None
    """Ray storage path (shared S3/GCS/NFS on multi-node); default: <cwd>/ablate_runs."""


KERNEL_FEATURES = ("fused_residual", "mla_ingress", "moe_dispatch", "mamba_scan", "recurrent_scan")
"""Features whose value picks a kernel backend: the ones a node check can find wrong or absent."""


@dataclass
class NodeCheckConfig:
    """How the sweep holds the lane against each node's ``ablate doctor --deep`` document before any block runs."""

    required: bool = False
    """true: a node without a current check document (for the lane's device) refuses the sweep; false: a warning."""
    allow_fallback: list[str] = field(default_factory=list)
    """Features whose requested backend may be absent on a node: its arms then record the fallback (and are
    disqualified for it) instead of the sweep being refused. A backend the check found wrong is never allowed."""
    path: str = "~/.ablate/node_check.json"
    """Where each node keeps its document (cluster.yaml writes it there); $ABLATE_NODE_CHECK overrides."""

    def __post_init__(self) -> None:
        for name in self.allow_fallback:
            if name not in KERNEL_FEATURES:
                raise ConfigError("node_check.allow_fallback", name, "features that pick a kernel backend: "
                                                                     + ", ".join(KERNEL_FEATURES))


@dataclass
class SweepConfig:
    """A campaign: a base lane, the features to test with candidate values, blocks and A/A blocks."""

    name: str = "sweep"
    defaults: str = "defaults.yaml"
    """Baseline values of every feature; relative paths resolve next to the sweep file."""
    lane: LaneConfig = field(default_factory=LaneConfig)
    features: dict[str, list[Any]] = field(default_factory=dict)
    """Feature name -> candidate values; each block compares defaults vs defaults + one change."""
    blocks: int = 2
    """Blocks per (feature, candidate value)."""
    aa_blocks: int = 1
    """Baseline-vs-baseline blocks per lane, for the noise floor."""
    bundle_blocks: int = 0
    """Blocks per round comparing the defaults with every tested speed feature's candidate value at once: the
    evidence ``promote --write`` needs before it changes two or more defaults of one lane (the bundle check)."""
    design: Design = Design.one_at_a_time
    block_mode: BlockMode = BlockMode.interleaved
    """How a block's two arms share the node: interleaved cancels the machine's speed drift between the arms
    (falls back to sequential where arms cannot take turns: multi-worker or CUDA arms; receipts say which ran)."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    node_check: NodeCheckConfig = field(default_factory=NodeCheckConfig)
    max_failures: int = 1
    """Tune-level retries of a block, each a new attempt of both arms (a failed arm keeps its receipt and counts
    against its role). Arms are not relaunched inside a block (``ablate.sweep.run._run_arm_options``)."""
    seed: int = 0
    """Seeds the per-block arm order."""

    def __post_init__(self) -> None:
        if not CAMPAIGN_NAME.match(self.name) or ".." in self.name:
            raise ConfigError("name", self.name, "a campaign name usable as one directory name: ASCII letters, "
                                                 "digits, '_', '.', '-', starting with a letter or digit, at most "
                                                 "100 characters, no '..'")
        _positive("blocks", self.blocks)
        _at_most("blocks", self.blocks, MAX_BLOCKS, "blocks per tested value")
        _non_negative("aa_blocks", self.aa_blocks)
        _non_negative("bundle_blocks", self.bundle_blocks)
        _at_most("bundle_blocks", self.bundle_blocks, MAX_BLOCKS, "bundle blocks per round")
        _at_most("aa_blocks", self.aa_blocks, MAX_BLOCKS, "A/A blocks per lane")
        _non_negative("max_failures", self.max_failures)
        budget = self.lane.budget
        if budget.min_steady_steps > budget.steps:
            # Checked for the campaign, not in BudgetConfig: every arm of it would be disqualified for too few
            # steady steps, so it is refused before any runs. A single arm built directly may still ask for it
            # (the receipt then carries INSUFFICIENT_STEADY_STEPS).
            raise ConfigError("lane.budget.min_steady_steps", budget.min_steady_steps,
                              f"at most lane.budget.steps ({budget.steps}): only measured steps can be steady")
        hardware = self.lane.hardware
        if hardware.device is Device.cuda and not hardware.cpu_fallback and self.resources.gpus_per_worker < 1:
            raise ConfigError("resources.gpus_per_worker", self.resources.gpus_per_worker,
                              "at least 1 when lane.hardware.device is cuda (or lane.hardware.device: auto)")
