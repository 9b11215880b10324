"""HybridLM: every fast path gives the reference model's loss and grads, losses add up, counts are honest."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ablate.config.schema import FeatureConfig, MambaScan, MLAIngress, ModelConfig, MoEDispatch, OnOff, RecurrentScan
from kernels.dispatch import Dispatcher
from trainers.model import HybridLM
from trainers.model.blocks import MoEBlock

CPU = torch.device("cpu")
# Small but with every family twice; cf = E makes padded capacity cover every routed row (no drops).
CFG = ModelConfig(pattern="AEMR*2", d_model=32, n_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  q_lora_rank=16, kv_lora_rank=16, n_experts=4, top_k=2, d_expert=16, capacity_factor=4.0,
                  ssm_d_state=8, ssm_head_dim=8, ssm_chunk=8, vocab_size=64)
REFERENCE = FeatureConfig()
FAST = FeatureConfig(moe_dispatch=MoEDispatch.jagged, mla_ingress=MLAIngress.fused, fused_residual=OnOff.off,
                     mamba_scan=MambaScan.chunked, recurrent_scan=RecurrentScan.parallel)


def _batch(seed: int = 0, batch: int = 2, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _model(cfg: ModelConfig = CFG, features: FeatureConfig = REFERENCE, seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(cfg, features, Dispatcher(CPU))


def test_fast_paths_match_reference_model_loss_and_grads() -> None:
    ref, fast = _model(), _model(features=FAST)
    fast.load_state_dict(ref.state_dict())  # toggles never change the parameter set
    tokens, targets = _batch()
    out_ref, out_fast = ref(tokens, targets), fast(tokens, targets)
    out_ref.loss.backward()
    out_fast.loss.backward()
    assert torch.isfinite(out_ref.loss)
    assert abs(out_ref.loss.item() - out_fast.loss.item()) <= 1e-4
    # Integer routing counts: a flip needs a top-k near-tie, and this seed's smallest top-k probability margin (1e-4)
    # is ~1000x the fp32 drift the fast paths put on the router input (1e-7).
    assert torch.equal(out_ref.tokens_per_expert, out_fast.tokens_per_expert)
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters()):
        scale = p_ref.grad.abs().max().clamp_min(1e-6)
        assert ((p_fast.grad - p_ref.grad).abs().max() / scale).item() <= 2e-3, name
    assert {row["observed"] for row in fast.backend_table()} == {"jagged", "fused", "eager", "chunked", "parallel"}


def test_loss_is_lm_plus_aux_plus_weighted_stp() -> None:
    features = replace(FAST, stp=OnOff.on, stp_weight=0.1)
    model = _model(features=features)
    tokens, targets = _batch()
    out = model(tokens, targets)
    assert out.stp_loss is not None and out.aux_loss.item() > 0
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss + 0.1 * out.stp_loss)
    # STP target for position t is token t+2, i.e. targets[:, t+1]; recompute it from the model's own pieces.
    hidden: dict[str, torch.Tensor] = {}

    def keep_hidden(module: torch.nn.Module, args: tuple, output: tuple) -> None:
        hidden["h"] = output[0]

    model.final_norm.register_forward_hook(keep_hidden)
    model(tokens, targets)
    logits = model.lm_head(model.stp_head(hidden["h"][:, :-1]))
    expected = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets[:, 1:].reshape(-1))
    torch.testing.assert_close(out.stp_loss, expected)
    assert _model()(tokens, targets).stp_loss is None


def test_routing_stats_count_tokens_and_drops() -> None:
    tokens, targets = _batch()
    dropless = _model(features=FAST)(tokens, targets)
    assert dropless.tokens_per_expert.shape == (2, CFG.n_experts)
    assert dropless.tokens_per_expert.sum(1).tolist() == [tokens.numel() * CFG.top_k] * 2
    assert int(dropless.dropped_tokens) == 0 and dropless.routed_rows == tokens.numel() * CFG.top_k * 2
    tight = _model(cfg=replace(CFG, capacity_factor=0.5))(tokens, targets)
    capacity = -(-tokens.numel() * CFG.top_k // (2 * CFG.n_experts))  # ceil(0.5 * T * k / E)
    expected = sum(max(0, int(n) - capacity) for n in tight.tokens_per_expert.flatten())
    assert int(tight.dropped_tokens) == expected > 0


def test_param_counts_from_parameters() -> None:
    model = _model(features=replace(REFERENCE, stp=OnOff.on))
    counts = model.param_counts()
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if name.endswith((".w13", ".w2"))
                 and isinstance(model.get_submodule(name.rsplit(".", 1)[0]), MoEBlock))
    assert counts["routed_experts"] == routed > 0
    assert counts["active"] == counts["total"] - routed + routed * CFG.top_k // CFG.n_experts
    assert counts["embedding"] == 2 * CFG.vocab_size * CFG.d_model
    assert counts["total"] > _model().param_counts()["total"], "the STP head adds parameters"


def test_family_views_follow_the_pattern() -> None:
    model = _model(cfg=replace(CFG, pattern="AEME+R"))
    assert [letter for letter, _ in model.blocks()] == list("AEMER")
    families = model.family_modules()
    assert list(families) == ["A", "M", "E", "R"]
    assert [len(v) for v in families.values()] == [1, 1, 2, 1]
    assert all(isinstance(b, MoEBlock) for b in families["E"])
    assert model.layer_counts() == {"A": 1, "M": 1, "E": 2, "R": 1}
    no_moe = _model(cfg=replace(CFG, pattern="AM"), features=FAST)
    assert "E" not in no_moe.family_modules() and no_moe.layer_counts()["E"] == 0
    assert "moe" not in {row["op"] for row in no_moe.backend_table()}, "absent family: toggle not resolved"


def test_grouped_mm_request_on_cpu_is_recorded_as_fallback() -> None:
    model = _model(features=replace(FAST, moe_dispatch=MoEDispatch.grouped_mm))
    rows = {row["op"]: row for row in model.backend_table()}
    assert rows["moe"]["requested"] == "grouped_mm" and rows["moe"]["observed"] == "jagged"
    with pytest.raises(RuntimeError, match="grouped_mm"):
        HybridLM(CFG, replace(FAST, moe_dispatch=MoEDispatch.grouped_mm), Dispatcher(CPU, strict=True))


@pytest.mark.parametrize("posture", ["regional", "whole"])
def test_fused_residual_inside_compiled_blocks_is_recorded_as_the_baseline(posture: str) -> None:
    # Inside a compiled region the compiled add+RMSNorm is the reference: the arm runs the baseline's code, and the
    # receipt's table must say eager, not compiled.
    on = HybridLM(CFG, replace(FAST, fused_residual=OnOff.on), Dispatcher(CPU, compile_posture=posture))
    off = HybridLM(CFG, FAST, Dispatcher(CPU, compile_posture=posture))
    row = {r["op"]: r for r in on.backend_table()}["add_rmsnorm"]
    assert row["observed"] == "eager" and row["requested"] in ("compiled", "triton"), row
    assert on.final_norm.add_rmsnorm is off.final_norm.add_rmsnorm
