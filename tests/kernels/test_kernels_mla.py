"""Fused MLA ingress == unfused reference (same weights), fp32 within 1e-5 and bf16 close, forward and backward."""

from __future__ import annotations

import pytest
import torch

from kernels.mla import MLADims, mla_ingress_fused, mla_ingress_ref, rope_tables

DIMS = [MLADims(4, 32, 32, 16, 8, 16, 1e-5), MLADims(2, 16, 24, 8, 4, 12, 1e-6)]


def _inputs(dims: MLADims, batch: int = 2, seq_len: int = 12, d_model: int = 40, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(dims.n_heads)
    qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_(True)

    tensors = [rnd(batch, seq_len, d_model, scale=1.0),
               rnd(dims.q_lora_rank + dims.kv_lora_rank + dims.qk_rope_head_dim, d_model),
               (1 + rnd(dims.q_lora_rank)).detach().requires_grad_(True),
               rnd(dims.n_heads * qk, dims.q_lora_rank),
               (1 + rnd(dims.kv_lora_rank)).detach().requires_grad_(True),
               rnd(dims.n_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank)]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dims.qk_rope_head_dim, 2).float() / dims.qk_rope_head_dim))
    cos, sin = rope_tables(inv_freq, seq_len)
    return tensors, cos, sin


def _run(fn, tensors, cos, sin, dims):
    q, k, v = fn(*tensors, cos, sin, dims)
    gen = torch.Generator().manual_seed(11)
    loss = sum((t * torch.randn(t.shape, generator=gen).to(t.dtype)).sum() for t in (q, k, v))
    return (q, k, v) + torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("dims", DIMS)
def test_fused_ingress_matches_reference_fp32(dims: MLADims) -> None:
    tensors, cos, sin = _inputs(dims)
    ref = _run(mla_ingress_ref, tensors, cos, sin, dims)
    got = _run(mla_ingress_fused, tensors, cos, sin, dims)
    batch, seq_len = tensors[0].shape[:2]
    assert got[0].shape == (batch, dims.n_heads, seq_len, dims.qk_nope_head_dim + dims.qk_rope_head_dim)
    assert got[2].shape == (batch, dims.n_heads, seq_len, dims.v_head_dim)
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() <= 1e-5


def test_fused_ingress_bf16_close_to_fp32_reference() -> None:
    dims = DIMS[0]
    ref = _run(mla_ingress_ref, *_inputs(dims), dims)
    got = _run(mla_ingress_fused, *_inputs(dims, dtype=torch.bfloat16), dims)
    for a, b in zip(got, ref):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b).abs().max().item() <= 3e-2 * b.abs().max().item()


def test_rope_slice_rotates_pairs_and_keeps_norms() -> None:
    # Independent check of the RoPE math: position 0 is unrotated, and every rotated pair keeps its length.
    dims = DIMS[0]
    tensors, cos, sin = _inputs(dims)
    no_rope = torch.zeros_like(sin)
    q_rot, k_rot, _ = mla_ingress_fused(*tensors, cos, sin, dims)
    q_id, k_id, _ = mla_ingress_fused(*tensors, torch.ones_like(cos), no_rope, dims)
    nope = dims.qk_nope_head_dim
    torch.testing.assert_close(q_rot[:, :, 0], q_id[:, :, 0])
    pair_norm = lambda t: t[..., nope:].reshape(*t.shape[:-1], -1, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(k_rot), pair_norm(k_id), rtol=1e-5, atol=1e-6)
    assert (q_rot[:, :, 1:, nope:] - q_id[:, :, 1:, nope:]).abs().max() > 1e-3
    # k_pe is shared by all heads.
    torch.testing.assert_close(k_rot[:, 0, :, nope:], k_rot[:, -1, :, nope:])
