"""The four block families of the hybrid model, each a pre-norm residual layer around one mixer.

How to use: ``HybridLM`` builds these from a ``ModelConfig`` and the kernel functions its dispatcher resolved;
nothing here reads feature toggles or dicts. Every block has the same calling convention::

    stream_BTD, out_BTD, *extras = block(stream_BTD, delta_BTD)

``delta`` is the previous layer's mixer output not yet added to the residual stream. The block first does
``stream = stream + delta; h = rmsnorm(stream)`` (one fused op when ``fused_residual: on``), then returns its mixer
output as the next ``delta``. This is exactly ``x = x + mixer(norm(x))`` per layer, with the add deferred into the
next layer's norm so the two can be fused. MoE blocks also return (aux_loss, tokens_per_expert_E, dropped).

Blocks keep no per-layer Python state that ``forward`` branches on, so regional ``torch.compile`` builds one graph
per family, and every kernel call is static-shape (no graph breaks under ``fullgraph=True``).

Shape suffix legend: B batch, T sequence, D d_model, H heads, P SSM head dim, N SSM state, E experts, F expert
hidden width, I inner width (Mamba2 d_inner = expand * D).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ablate.config.schema import ModelConfig
from kernels.mla import MLADims, rope_tables
from kernels.moe import expert_counts, load_balance_loss, route
from kernels.norm import rmsnorm_ref

NormFn = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]


class ResidualNorm(nn.Module):
    """stream += delta, then RMSNorm; ``add_rmsnorm`` is the op the dispatcher resolved for ``fused_residual``."""

    def __init__(self, d_model: int, eps: float, add_rmsnorm: NormFn) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps
        self.add_rmsnorm = add_rmsnorm

    def forward(self, stream_BTD: Tensor, delta_BTD: Tensor) -> tuple[Tensor, Tensor]:
        h_BTD, stream_BTD = self.add_rmsnorm(delta_BTD, stream_BTD, self.weight, self.eps)
        return h_BTD, stream_BTD


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class MLABlock(nn.Module):
    """A: multi-head latent attention (naive training path), causal SDPA."""

    def __init__(self, cfg: ModelConfig, add_rmsnorm: NormFn, ingress: Callable[..., tuple[Tensor, Tensor, Tensor]]):
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        self.norm = ResidualNorm(d, cfg.norm_eps, add_rmsnorm)
        self.dims = MLADims(h, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.norm_eps)
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        # q and kv down-projections stacked in one weight: both ingress backends read the same parameters.
        self.w_a = nn.Parameter(torch.empty(cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, d))
        self.q_norm = nn.Parameter(torch.ones(cfg.q_lora_rank))
        self.w_qb = nn.Parameter(torch.empty(h * qk_dim, cfg.q_lora_rank))
        self.kv_norm = nn.Parameter(torch.ones(cfg.kv_lora_rank))
        self.w_kvb = nn.Parameter(torch.empty(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
        self.wo = nn.Linear(h * cfg.v_head_dim, d, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.qk_rope_head_dim, 2).float() / cfg.qk_rope_head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = qk_dim ** -0.5
        self.ingress = ingress
        for w in (self.w_a, self.w_qb, self.w_kvb):
            nn.init.normal_(w, std=0.02)

    def forward(self, stream_BTD: Tensor, delta_BTD: Tensor) -> tuple[Tensor, Tensor]:
        h_BTD, stream_BTD = self.norm(stream_BTD, delta_BTD)
        batch, seq_len, _ = h_BTD.shape
        cos_TR2, sin_TR2 = rope_tables(self.inv_freq, seq_len)
        q, k, v = self.ingress(h_BTD, self.w_a, self.q_norm, self.w_qb, self.kv_norm, self.w_kvb, cos_TR2, sin_TR2,
                               self.dims)
        o_BHTV = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return stream_BTD, self.wo(o_BHTV.transpose(1, 2).reshape(batch, seq_len, -1))


class MoEBlock(nn.Module):
    """E: top-k routed SwiGLU experts (+ optional shared expert), Switch load-balancing aux loss, routing stats."""

    def __init__(self, cfg: ModelConfig, add_rmsnorm: NormFn, dispatch: Callable[..., tuple[Tensor, Tensor]]):
        super().__init__()
        d, e, f = cfg.d_model, cfg.n_experts, cfg.d_expert
        self.norm = ResidualNorm(d, cfg.norm_eps, add_rmsnorm)
        self.router = nn.Linear(d, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, d, 2 * f))
        self.w2 = nn.Parameter(torch.empty(e, f, d))
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02)
        self.shared = SwiGLU(d, f) if cfg.shared_expert else None
        self.n_experts, self.top_k, self.capacity_factor = e, cfg.top_k, cfg.capacity_factor
        self.dispatch = dispatch

    def forward(self, stream_BTD: Tensor, delta_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        h_BTD, stream_BTD = self.norm(stream_BTD, delta_BTD)
        h_TD = h_BTD.reshape(-1, h_BTD.shape[-1])
        topv_TK, topi_TK, probs_TE = route(self.router(h_TD), self.top_k)
        counts_E = expert_counts(topi_TK, self.n_experts)
        y_TD, dropped = self.dispatch(h_TD, topi_TK, topv_TK, self.w13, self.w2, self.capacity_factor)
        if self.shared is not None:
            y_TD = y_TD + self.shared(h_TD)
        aux = load_balance_loss(probs_TE, counts_E)
        return stream_BTD, y_TD.view_as(h_BTD), aux, counts_E, dropped


class Mamba2Block(nn.Module):
    """M: Mamba2 mixer (in_proj -> causal depthwise conv -> SSD scan -> gated RMSNorm -> out_proj)."""

    def __init__(self, cfg: ModelConfig, add_rmsnorm: NormFn, ssd: Callable[..., Tensor]):
        super().__init__()
        d = cfg.d_model
        self.d_inner = cfg.ssm_expand * d
        self.n_heads = self.d_inner // cfg.ssm_head_dim
        self.head_dim, self.d_state = cfg.ssm_head_dim, cfg.ssm_d_state
        self.chunk, self.eps = cfg.ssm_chunk, cfg.norm_eps
        self.norm = ResidualNorm(d, cfg.norm_eps, add_rmsnorm)
        conv_channels = self.d_inner + 2 * self.d_state
        self.in_proj = nn.Linear(d, self.d_inner + conv_channels + self.n_heads, bias=False)
        self.conv = nn.Conv1d(conv_channels, conv_channels, cfg.conv_kernel, groups=conv_channels,
                              padding=cfg.conv_kernel - 1)
        # mamba_ssm Mamba2 init: A in [1, 16], dt in [1e-3, 1e-1] log-uniform, stored through inverse softplus.
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_heads).uniform_(1.0, 16.0)))
        dt = torch.exp(torch.empty(self.n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.D_skip = nn.Parameter(torch.ones(self.n_heads))
        self.out_norm = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)
        self.ssd = ssd

    def forward(self, stream_BTD: Tensor, delta_BTD: Tensor) -> tuple[Tensor, Tensor]:
        h_BTD, stream_BTD = self.norm(stream_BTD, delta_BTD)
        batch, seq_len, _ = h_BTD.shape
        z_BTI, xbc, dt_BTH = self.in_proj(h_BTD).split(
            [self.d_inner, self.d_inner + 2 * self.d_state, self.n_heads], dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :seq_len].transpose(1, 2))
        x_BTI, B_BTN, C_BTN = xbc.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        dt_BTH = F.softplus(dt_BTH + self.dt_bias)
        x_BTHP = x_BTI.reshape(batch, seq_len, self.n_heads, self.head_dim)
        y_BTHP = self.ssd(x_BTHP, dt_BTH, -torch.exp(self.A_log.float()), B_BTN, C_BTN, self.chunk)
        y_BTHP = y_BTHP + x_BTHP * self.D_skip[:, None]
        # Gated RMSNorm (mamba_ssm RMSNormGated, norm after gating).
        y_BTI = rmsnorm_ref(y_BTHP.reshape(batch, seq_len, self.d_inner) * F.silu(z_BTI), self.out_norm, self.eps)
        return stream_BTD, self.out_proj(y_BTI)


class RecurrentBlock(nn.Module):
    """R: minGRU (gate and candidate from one projection), then an output projection."""

    def __init__(self, cfg: ModelConfig, add_rmsnorm: NormFn, scan: Callable[[Tensor, Tensor], Tensor]):
        super().__init__()
        d = cfg.d_model
        self.norm = ResidualNorm(d, cfg.norm_eps, add_rmsnorm)
        self.to_gate_cand = nn.Linear(d, 2 * d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.scan = scan

    def forward(self, stream_BTD: Tensor, delta_BTD: Tensor) -> tuple[Tensor, Tensor]:
        h_BTD, stream_BTD = self.norm(stream_BTD, delta_BTD)
        gate_BTD, cand_BTD = self.to_gate_cand(h_BTD).chunk(2, dim=-1)
        return stream_BTD, self.out_proj(self.scan(gate_BTD, cand_BTD))
