"""FLOPs per token: hand formula on a tiny config, GEMM parts cross-checked with torch's FlopCounterMode."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import trainers.model.flops as flops_mod
from ablate.config.schema import FeatureConfig, ModelConfig, OnOff
from kernels.dispatch import Dispatcher
from trainers.model import HybridLM
from trainers.model.flops import flops_per_token

CFG = ModelConfig(pattern="AEMR+E", d_model=16, n_heads=2, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                  q_lora_rank=8, kv_lora_rank=6, n_experts=4, top_k=2, d_expert=8, shared_expert=True,
                  ssm_d_state=4, ssm_head_dim=8, ssm_expand=2, ssm_chunk=4, conv_kernel=3, vocab_size=32)


def test_hand_formula_on_tiny_config() -> None:
    seq_len = 8
    fm = flops_per_token(CFG, FeatureConfig(), seq_len)
    # A: q_a 16x8, kv_a 16x(6+2), q_b 8x(2*6), kv_b 6x(2*(4+4)), o (2*4)x16, attention 2 heads x (6 + 4) x 4.5.
    attn = 2 * (16 * 8 + 16 * 8 + 8 * 12 + 6 * 16 + 8 * 16) + 2 * 2 * (6 + 4) * (seq_len + 1) / 2
    # E: router 16x4; two routed and one shared SwiGLU expert, three 16x8 matrices each.
    moe = 2 * 16 * 4 + 3 * (3 * 2 * 16 * 8)
    # M: inner 32, 4 heads, state 4; in_proj 16 -> 2*32+2*4+4, conv 3 taps x 40 channels, 5*32*4, skip, out_proj.
    mamba = 2 * 16 * 76 + 2 * 3 * 40 + 5 * 32 * 4 + 2 * 32 + 2 * 32 * 16
    # R: 16 -> 32 and 16 -> 16 projections, recurrence 3 per channel.
    rec = 2 * 16 * 32 + 2 * 16 * 16 + 3 * 16
    expected = {"A": 3 * attn, "M": 3 * mamba, "E": 3 * 2 * moe, "R": 3 * rec, "embed": 3 * 2 * 16 * 32}
    assert fm.per_family == pytest.approx(expected)
    assert fm.total == pytest.approx(sum(expected.values()))
    assert fm.coverage_missing == [] and fm.convention["training_factor"] == 3.0
    stp = flops_per_token(CFG, FeatureConfig(stp=OnOff.on), seq_len)
    assert stp.per_family["stp"] == pytest.approx(3 * (2 * 16 * 16 + 2 * 16 * 32))
    longer = flops_per_token(CFG, FeatureConfig(), 2 * seq_len + 1)
    assert longer.per_family["A"] - fm.per_family["A"] == pytest.approx(3 * 2 * 2 * 10 * (seq_len + 1) / 2)


def test_gemm_flops_agree_with_flop_counter() -> None:
    # FlopCounterMode counts mm/bmm exactly; compare the projection part of A and R plus the logits.
    cfg = replace(CFG, pattern="AR")
    torch.manual_seed(0)
    model = HybridLM(cfg, FeatureConfig(), Dispatcher(torch.device("cpu")))
    batch, seq_len = 2, 8
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens, tokens)
    counted = {str(op): v for op, v in counter.get_flop_counts()["Global"].items()}
    gemm = counted.pop("aten.mm")
    # What remains is attention, which FlopCounterMode counts over the full, unmasked T x T square (our model
    # counts the causal half): the same formula with T in place of (T + 1) / 2.
    assert sum(counted.values()) / (batch * seq_len) == 2 * cfg.n_heads * (6 + 4) * seq_len
    fm = flops_per_token(cfg, FeatureConfig(), seq_len)
    attention_term = 2 * cfg.n_heads * (6 + 4) * (seq_len + 1) / 2
    recurrence_term = 3 * cfg.d_model
    modelled_gemm = (fm.per_family["A"] + fm.per_family["R"] + fm.per_family["embed"]) / 3
    modelled_gemm -= attention_term + recurrence_term
    assert gemm / (batch * seq_len) == pytest.approx(modelled_gemm)


def test_family_without_model_is_reported_not_undercounted(monkeypatch: pytest.MonkeyPatch) -> None:
    full = flops_per_token(CFG, FeatureConfig(), 8)
    monkeypatch.delitem(flops_mod.FAMILY_FLOPS, "M")
    partial = flops_per_token(CFG, FeatureConfig(), 8)
    assert partial.coverage_missing == ["M"]
    assert "M" not in partial.per_family
    assert partial.total == pytest.approx(full.total - full.per_family["M"])
    absent = flops_per_token(replace(CFG, pattern="AER"), FeatureConfig(), 8)
    assert absent.coverage_missing == [], "a family absent from the pattern is not missing coverage"
