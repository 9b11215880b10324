"""FLOPs per token of the hybrid model, per block family, with the counting convention written down.

How to use::

    from trainers.model.flops import flops_per_token
    fm = flops_per_token(lane.model, lane.features, seq_len=lane.batch.seq_len)
    fm.total, fm.per_family["E"], fm.convention, fm.coverage_missing

Convention (also returned in ``FlopsModel.convention`` so receipts carry it):
- Training FLOPs per token = 3 x forward (backward = 2 x forward: grads w.r.t. activations and weights).
- A multiply-add is 2 FLOPs. Counted: every GEMM / projection, attention score and value products, the Mamba2
  state recurrence and depthwise conv, the minGRU recurrence. Not counted: norms, activations, softmax, RoPE,
  residual adds, routing softmax/top-k, embedding lookup (standard MFU practice: they are small and memory-bound).
- Model FLOPs, not hardware FLOPs: independent of the backend a toggle selects, so both arms of a block share one
  number. Padded MoE's wasted capacity, dropped tokens, chunked SSD's extra intra-chunk work and recomputation are
  not counted.
- A (MLA, causal): projections q_a, q_b, kv_a, kv_b, o, plus attention 2*H*(dqk + dv) * (T + 1) / 2, the mean
  number of unmasked keys per query under a causal mask.
- E (MoE): router 2*D*E, top_k routed SwiGLU experts 6*D*F each, shared expert 6*D*F when present.
- M (Mamba2): in_proj, depthwise conv 2*k*(I + 2N), state update a*h + x*B (3 per state element) and readout C.h
  (2 per state element) = 5*I*N, D skip 2*I, out_proj.
- R (minGRU): projections 2*D*2D + 2*D*D, recurrence (1-z)*h + z*g = 3*D.
- embed: the output logits 2*D*V. stp (when on): its D x D head plus a second logits pass, 2*D*D + 2*D*V.
A family in the pattern without an entry in ``FAMILY_FLOPS`` is listed in ``coverage_missing`` and contributes
nothing; a caller must treat such a total as a lower bound, never as the model's FLOPs.

Symbols: D d_model, H heads, T sequence length, V vocab, E experts, F expert hidden, k top_k, I Mamba2 inner width,
N state size, P SSM head dim.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Union

from ablate.config.schema import FeatureConfig, ModelConfig, OnOff
from ablate.config.pattern import FAMILIES, parse_pattern

TRAINING_FACTOR = 3.0


def _attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    d, h = cfg.d_model, cfg.n_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    proj = 2 * d * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    proj += 2 * cfg.q_lora_rank * h * qk
    proj += 2 * cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    proj += 2 * h * cfg.v_head_dim * d
    mean_context = (seq_len + 1) / 2
    return proj + 2 * h * (qk + cfg.v_head_dim) * mean_context


def _moe_flops(cfg: ModelConfig, seq_len: int) -> float:
    expert = 6 * cfg.d_model * cfg.d_expert
    return 2 * cfg.d_model * cfg.n_experts + cfg.top_k * expert + (expert if cfg.shared_expert else 0)


def _mamba_flops(cfg: ModelConfig, seq_len: int) -> float:
    d, n = cfg.d_model, cfg.ssm_d_state
    inner = cfg.ssm_expand * d
    heads = inner // cfg.ssm_head_dim
    in_proj = 2 * d * (2 * inner + 2 * n + heads)
    conv = 2 * cfg.conv_kernel * (inner + 2 * n)
    return in_proj + conv + 5 * inner * n + 2 * inner + 2 * inner * d


def _recurrent_flops(cfg: ModelConfig, seq_len: int) -> float:
    d = cfg.d_model
    return 2 * d * 2 * d + 2 * d * d + 3 * d


FAMILY_FLOPS: dict[str, Callable[[ModelConfig, int], float]] = {
    "A": _attention_flops,
    "E": _moe_flops,
    "M": _mamba_flops,
    "R": _recurrent_flops,
}
"""Forward FLOPs per token of one layer of each family."""


@dataclass
class FlopsModel:
    per_family: dict[str, float]
    """Training FLOPs per token summed over each present family's layers, plus 'embed' and (stp on) 'stp'."""
    total: float
    convention: dict[str, Union[str, float]] = field(default_factory=dict)
    coverage_missing: list[str] = field(default_factory=list)
    """Families present in the pattern that have no FLOPs model (their cost is missing from total)."""


CONVENTION: dict[str, Union[str, float]] = {
    "unit": "training FLOPs per token",
    "training_factor": TRAINING_FACTOR,
    "multiply_add": 2.0,
    "counted": "GEMMs/projections, attention QK and AV, SSM state recurrence and conv, minGRU recurrence, logits",
    "not_counted": "norms, activations, softmax, RoPE, residual adds, routing softmax/top-k, embedding lookup",
    "causal_attention": "mean unmasked context (T + 1) / 2 per query",
    "moe": "router + top_k routed experts + shared expert; capacity padding and drops not counted",
    "backend_independent": "model FLOPs: the same for every value of every speed toggle",
}


def flops_per_token(model_cfg: ModelConfig, features: FeatureConfig, seq_len: int) -> FlopsModel:
    letters = parse_pattern(model_cfg.pattern)
    layers = Counter(letters)
    per_family: dict[str, float] = {}
    missing: list[str] = []
    for family in FAMILIES:
        if not layers.get(family):
            continue
        model = FAMILY_FLOPS.get(family)
        if model is None:
            missing.append(family)
            continue
        per_family[family] = TRAINING_FACTOR * layers[family] * model(model_cfg, seq_len)
    d, vocab = model_cfg.d_model, model_cfg.vocab_size
    per_family["embed"] = TRAINING_FACTOR * 2 * d * vocab
    if features.stp is OnOff.on:
        per_family["stp"] = TRAINING_FACTOR * (2 * d * d + 2 * d * vocab)
    return FlopsModel(per_family=per_family, total=sum(per_family.values()), convention=dict(CONVENTION),
                      coverage_missing=missing)
