"""MLA ingress (DeepSeek-V3 multi-head latent attention, naive training path): from x to per-head q, k, v.

How to use::

    q_BHTK, k_BHTK, v_BHTV = mla_ingress_fused(x_BTD, w_a, q_norm_w, w_qb, kv_norm_w, w_kvb, cos_TR, sin_TR, dims)

Both backends take the same weights; ``w_a`` stacks the q down-projection (q_lora_rank rows) on top of the kv
down-projection (kv_lora_rank + qk_rope_head_dim rows), so toggling ``mla_ingress`` never changes the state dict.
- ``unfused`` (``mla_ingress_ref``): the DeepSeek-V3 / torchtitan order. Two down-projection GEMMs; q: norm ->
  up-projection -> split -> RoPE; kv: split latent | k_pe -> norm -> RoPE -> up-projection -> K assembly
  ``cat(k_nope, k_pe.expand(H))``. RoPE on adjacent pairs via reshape -> rotate -> stack -> reshape back.
- ``fused`` (``mla_ingress_fused``): one GEMM for both down-projections; one split into q latent | kv latent | k_pe;
  RoPE as ``x * cos2 + swap_pairs(x) * sin2`` with interleaved tables, so no reshape/apply/reshape round trip.
  Same math: each rotated element is the same two products and one add as in the reference.
The causal attention itself (SDPA) and the output projection stay in the block.

Shape suffix legend: B batch, T sequence, D d_model, H heads, K qk head dim (nope + rope), V v head dim,
R qk_rope_head_dim, R2 = R/2 rotation frequencies, Lq q_lora_rank, Lkv kv_lora_rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.dispatch import Impl, OpSpec, always, register
from kernels.norm import rmsnorm_ref


class MLADims(NamedTuple):
    """Plain ints (a NamedTuple, so compile guards on values and all A blocks share one graph)."""

    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    eps: float


def rope_tables(inv_freq_R2: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """(cos_TR2, sin_TR2) in fp32 for positions 0..T-1."""
    t_T = torch.arange(seq_len, device=inv_freq_R2.device, dtype=torch.float32)
    freqs_TR2 = torch.outer(t_T, inv_freq_R2.float())
    return freqs_TR2.cos(), freqs_TR2.sin()


def _rope_pairs_ref(x_BTHR: Tensor, cos_TR2: Tensor, sin_TR2: Tensor) -> Tensor:
    # The round trip the fused path removes: view as pairs, rotate each pair, stack, flatten back.
    pairs = x_BTHR.float().reshape(*x_BTHR.shape[:-1], -1, 2)
    x0, x1 = pairs.unbind(-1)
    cos, sin = cos_TR2[:, None, :], sin_TR2[:, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).to(x_BTHR.dtype)


def mla_ingress_ref(x_BTD: Tensor, w_a: Tensor, q_norm_w: Tensor, w_qb: Tensor, kv_norm_w: Tensor, w_kvb: Tensor,
                    cos_TR2: Tensor, sin_TR2: Tensor, dims: MLADims) -> tuple[Tensor, Tensor, Tensor]:
    batch, seq_len, _ = x_BTD.shape
    heads, nope, rope, vdim = dims.n_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
    w_qa, w_kva = w_a.split([dims.q_lora_rank, dims.kv_lora_rank + rope], dim=0)

    q_lat = rmsnorm_ref(F.linear(x_BTD, w_qa), q_norm_w, dims.eps)
    q_BTHK = F.linear(q_lat, w_qb).view(batch, seq_len, heads, nope + rope)
    q_nope, q_pe = q_BTHK.split([nope, rope], dim=-1)
    q_BTHK = torch.cat([q_nope, _rope_pairs_ref(q_pe, cos_TR2, sin_TR2)], dim=-1)

    kv_lat, k_pe = F.linear(x_BTD, w_kva).split([dims.kv_lora_rank, rope], dim=-1)
    kv_lat = rmsnorm_ref(kv_lat, kv_norm_w, dims.eps)
    k_pe_BT1R = _rope_pairs_ref(k_pe.unsqueeze(2), cos_TR2, sin_TR2)
    kv_BTHX = F.linear(kv_lat, w_kvb).view(batch, seq_len, heads, nope + vdim)
    k_nope, v_BTHV = kv_BTHX.split([nope, vdim], dim=-1)
    k_BTHK = torch.cat([k_nope, k_pe_BT1R.expand(batch, seq_len, heads, rope)], dim=-1)
    return q_BTHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHV.transpose(1, 2)


def _interleaved_tables(cos_TR2: Tensor, sin_TR2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # cos2[2i] = cos2[2i+1] = cos_i; sin2 carries the sign of the pair rotation: [-sin_i, +sin_i].
    cos2_TR = cos_TR2.repeat_interleave(2, dim=-1)
    sin2_TR = torch.stack((-sin_TR2, sin_TR2), dim=-1).flatten(-2)
    idx = torch.arange(cos2_TR.shape[-1], device=cos_TR2.device)
    swap_R = idx + 1 - 2 * (idx % 2)  # 1, 0, 3, 2, ...: partner of each element in its pair
    return cos2_TR, sin2_TR, swap_R


def _rope_interleaved(x_BTHR: Tensor, cos2_T1R: Tensor, sin2_T1R: Tensor, swap_R: Tensor) -> Tensor:
    xf = x_BTHR.float()
    return (xf * cos2_T1R + xf.index_select(-1, swap_R) * sin2_T1R).to(x_BTHR.dtype)


def mla_ingress_fused(x_BTD: Tensor, w_a: Tensor, q_norm_w: Tensor, w_qb: Tensor, kv_norm_w: Tensor, w_kvb: Tensor,
                      cos_TR2: Tensor, sin_TR2: Tensor, dims: MLADims) -> tuple[Tensor, Tensor, Tensor]:
    batch, seq_len, _ = x_BTD.shape
    heads, nope, rope, vdim = dims.n_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
    cos2_TR, sin2_TR, swap_R = _interleaved_tables(cos_TR2, sin_TR2)
    cos2_T1R, sin2_T1R = cos2_TR[:, None, :], sin2_TR[:, None, :]

    # One GEMM reads x once for both down-projections.
    q_lat, kv_lat, k_pe = F.linear(x_BTD, w_a).split([dims.q_lora_rank, dims.kv_lora_rank, rope], dim=-1)
    q_lat = rmsnorm_ref(q_lat, q_norm_w, dims.eps)
    kv_lat = rmsnorm_ref(kv_lat, kv_norm_w, dims.eps)

    q_BTHK = F.linear(q_lat, w_qb).view(batch, seq_len, heads, nope + rope)
    q_nope, q_pe = q_BTHK.split([nope, rope], dim=-1)
    q_BTHK = torch.cat([q_nope, _rope_interleaved(q_pe, cos2_T1R, sin2_T1R, swap_R)], dim=-1)

    k_pe_BT1R = _rope_interleaved(k_pe.unsqueeze(2), cos2_T1R, sin2_T1R, swap_R)
    kv_BTHX = F.linear(kv_lat, w_kvb).view(batch, seq_len, heads, nope + vdim)
    k_nope, v_BTHV = kv_BTHX.split([nope, vdim], dim=-1)
    k_BTHK = torch.cat([k_nope, k_pe_BT1R.expand(batch, seq_len, heads, rope)], dim=-1)
    return q_BTHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHV.transpose(1, 2)


register(OpSpec(
    name="mla_ingress",
    ref=mla_ingress_ref,
    impls={
        "unfused": Impl(mla_ingress_ref, always("two down-projection GEMMs, pairwise-reshape RoPE (reference)")),
        "fused": Impl(mla_ingress_fused, always("one down-projection GEMM, interleaved-table RoPE (pure torch)")),
    },
))
