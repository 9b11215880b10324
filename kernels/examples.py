"""Lane-like example inputs for every registered op, so a node check can run each backend against its twin.

How to use::

    ex = example("moe", "lane", torch.device("cuda"), torch.bfloat16)
    outs = ex.run(backend_fn)          # forward: the differentiable outputs, as a tuple
    ex.inputs                          # the leaves a backward differentiates (requires_grad)
    ex.ctx                             # what ``Dispatcher.resolve`` needs (dims, conv_channels)

Shapes: ``small`` (a few ms on CPU, enough to catch a wrong kernel) and ``lane`` (the smoke/cpu_demo lane's sizes,
where speed ratios mean something). Values are drawn from a fixed seed on CPU in fp32 and then cast, so every
dtype and device sees the same numbers. ``REL_TOL`` is the max-norm relative error the kernel tests allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.mla import MLADims, rope_tables
from kernels.moe import route

SIZES = ("small", "lane")
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2}
"""max |backend - reference| / max |reference| over outputs and input gradients, the reference in fp32 on the same
drawn values. fp32 sits above the unit tests' 1e-5 because the sequential recurrences at lane length accumulate
~1e-5 of their own rounding; bf16 (eps 7.8e-3) covers a bf16 recurrence carrying its state in bf16 (the sequential
SSD reference: 4.2e-2 at the small shape on CPU), while a wrong kernel is off by O(1)."""


@dataclass
class Example:
    op: str
    size: str
    shape: str
    inputs: list[Tensor]
    """Differentiable leaves, on the device, in the example's dtype."""
    forward: Callable[[Callable[..., Any]], tuple[Tensor, ...]]
    ctx: dict[str, Any] = field(default_factory=dict)

    def run(self, fn: Callable[..., Any]) -> tuple[Tensor, ...]:
        return self.forward(fn)


def _draw(gen: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(*shape, generator=gen)


def _leaves(tensors: list[Tensor], device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    return [t.to(device=device, dtype=dtype).requires_grad_(True) for t in tensors]


def _moe(size: str, device: torch.device, dtype: torch.dtype, timing: bool = False) -> Example:
    tokens, experts, top_k, d_model, d_expert = (64, 4, 2, 32, 64) if size == "small" else (512, 8, 2, 128, 512)
    gen = torch.Generator().manual_seed(11)
    topv, topi, _ = route(_draw(gen, tokens, experts), top_k)
    x, w13, w2 = _leaves([_draw(gen, tokens, d_model), _draw(gen, experts, d_model, 2 * d_expert, scale=0.05),
                          _draw(gen, experts, d_expert, d_model, scale=0.05)], device, dtype)
    (topv_leaf,) = _leaves([topv], device, dtype)
    topi = topi.to(device)
    # Parity: capacity factor = experts, so no routed row is dropped and padded computes the dropless reference's
    # function. Timing: the smoke lane's 2.0, as a campaign would run padded (a dropless capacity is E x the work).
    capacity_factor = 2.0 if timing else float(experts)
    return Example("moe", size, f"T={tokens} E={experts} k={top_k} D={d_model} F={d_expert} cf={capacity_factor:g}",
                   [x, topv_leaf, w13, w2], lambda fn: (fn(x, topi, topv_leaf, w13, w2, capacity_factor)[0],),
                   {"dims": (d_model, d_expert, 2 * d_expert), "precision": "bf16"})


def _ssd(size: str, device: torch.device, dtype: torch.dtype, timing: bool = False) -> Example:
    batch, seq_len, heads, head_dim, state, chunk = (1, 32, 2, 8, 8, 8) if size == "small" else (2, 128, 4, 32, 32, 32)
    gen = torch.Generator().manual_seed(12)
    dt = F.softplus(_draw(gen, batch, seq_len, heads) - 1.0)
    a = -torch.exp(torch.rand(heads, generator=gen) * 2.0)
    x, dt, a, b, c = _leaves([_draw(gen, batch, seq_len, heads, head_dim), dt, a, _draw(gen, batch, seq_len, state),
                              _draw(gen, batch, seq_len, state)], device, dtype)
    return Example("ssd", size, f"B={batch} L={seq_len} H={heads} P={head_dim} N={state} Q={chunk}", [x, dt, a, b, c],
                   lambda fn: (fn(x, dt, a, b, c, chunk),), {"conv_channels": 2 * heads * head_dim + 2 * state})


def _scan(size: str, device: torch.device, dtype: torch.dtype, timing: bool = False) -> Example:
    batch, seq_len, width = (1, 32, 16) if size == "small" else (2, 128, 128)
    gen = torch.Generator().manual_seed(13)
    gate, cand = _leaves([_draw(gen, batch, seq_len, width), _draw(gen, batch, seq_len, width)], device, dtype)
    return Example("recurrent_scan", size, f"B={batch} L={seq_len} D={width}", [gate, cand],
                   lambda fn: (fn(gate, cand),))


def _norm(size: str, device: torch.device, dtype: torch.dtype, timing: bool = False) -> Example:
    rows, width = (16, 32) if size == "small" else (256, 128)
    gen = torch.Generator().manual_seed(14)
    x, r, w = _leaves([_draw(gen, rows, width), _draw(gen, rows, width), 1 + _draw(gen, width, scale=0.1)],
                      device, dtype)
    return Example("add_rmsnorm", size, f"T={rows} D={width}", [x, r, w], lambda fn: tuple(fn(x, r, w, 1e-5)))


def _mla(size: str, device: torch.device, dtype: torch.dtype, timing: bool = False) -> Example:
    batch, seq_len, d_model, heads, rank = (1, 8, 32, 2, 16) if size == "small" else (2, 128, 128, 4, 64)
    dims = MLADims(n_heads=heads, q_lora_rank=rank, kv_lora_rank=rank, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, eps=1e-6)
    gen = torch.Generator().manual_seed(15)
    qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    inputs = _leaves([_draw(gen, batch, seq_len, d_model),
                      _draw(gen, dims.q_lora_rank + dims.kv_lora_rank + dims.qk_rope_head_dim, d_model, scale=0.05),
                      torch.ones(dims.q_lora_rank), _draw(gen, heads * qk, dims.q_lora_rank, scale=0.05),
                      torch.ones(dims.kv_lora_rank),
                      _draw(gen, heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, scale=0.05)],
                     device, dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dims.qk_rope_head_dim, 2).float() / dims.qk_rope_head_dim))
    cos, sin = (t.to(device) for t in rope_tables(inv_freq, seq_len))
    return Example("mla_ingress", size, f"B={batch} T={seq_len} D={d_model} H={heads} L={rank}", inputs,
                   lambda fn: tuple(fn(*inputs, cos, sin, dims)))


EXAMPLES: dict[str, Callable[[str, torch.device, torch.dtype, bool], Example]] = {
    "moe": _moe, "ssd": _ssd, "recurrent_scan": _scan, "add_rmsnorm": _norm, "mla_ingress": _mla,
}


def example(op: str, size: str, device: torch.device, dtype: torch.dtype, timing: bool = False) -> Example:
    """``timing=True``: the inputs a lane would time (for MoE, a lane capacity factor instead of a dropless one)."""
    if op not in EXAMPLES:
        raise ValueError(f"op {op!r}: no example inputs; ops with examples: {sorted(EXAMPLES)}")
    if size not in SIZES:
        raise ValueError(f"example size {size!r}; allowed: {', '.join(SIZES)}")
    return EXAMPLES[op](size, torch.device(device), dtype, timing)
