"""MoE expert dispatch: padded (capacity, counted drops), jagged (sort by expert + grouped GEMM), and references.

How to use: route with ``route(logits_TE, top_k)``, then call any backend with the same arguments::

    y_TD, dropped = moe_jagged(x_TD, topi_TK, topv_TK, w13_EDG, w2_EFD, capacity_factor)

Backends (registered as op ``moe``; the feature ``moe_dispatch`` requests one):
- ``padded``: route -> permute -> pad every expert to capacity C = ceil(cf*T*K/E) -> batched GEMM -> unpad ->
  unpermute. Routed rows past capacity are dropped and counted.
- ``jagged``: stable sort by expert -> grouped GEMM over contiguous slices -> fp32 score multiply -> ``index_add``.
  Dropless. On CUDA the grouped GEMM is ``torch._grouped_mm``; fp32 goes through an opaque custom op because the
  2.13 meta kernel of ``_grouped_mm`` only accepts bf16, which would otherwise break ``torch.compile`` of the E block.
  On CPU it is ``expert_mlp``: expert-major, each expert's up GEMM, SwiGLU and down GEMM back to back (cache-resident)
  with a hand-written backward.
- ``grouped_mm``: jagged with bf16 operands, for the CUTLASS fast path (CUDA SM90/SM100).
- ``jagged_loop``: per-expert ``mm`` loop over ``counts.tolist()``; the recorded fallback when grouped GEMM is
  unavailable or misaligned (host sync, graph break under compile).
- ``moe_dropless_padded_ref``: padded with C = max(count) (one ``.item()``: compile-unfriendly). The parity oracle:
  jagged equals it to fp32 rounding, because both add each token's expert outputs in the same (expert) order; not
  bit for bit, since a padded bmm and per-expert mm are different GEMM call shapes that BLAS may block differently.

All token counts use static shapes (``scatter_add`` of ones, never ``bincount`` / ``.tolist()`` in the compiled paths).

Shape suffix legend: T tokens (batch*seq flattened), D d_model, F expert hidden width, G = 2F (gate|up fused),
E experts, K top_k, R routed rows (T*K), C capacity per expert, S padded slots (E*C).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.capability import Capability
from kernels.dispatch import Impl, OpSpec, always, register


def route(logits_TE: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax top-k routing in fp32. Returns (topv_TK renormalised to sum 1, topi_TK, probs_TE)."""
    probs_TE = logits_TE.float().softmax(-1)
    topv_TK, topi_TK = probs_TE.topk(top_k, dim=-1)
    topv_TK = topv_TK / topv_TK.sum(-1, keepdim=True)
    return topv_TK, topi_TK, probs_TE


def expert_counts(topi_TK: Tensor, n_experts: int) -> Tensor:
    """Routed rows per expert, shape (E,), int64; static shape so compile sees no data-dependent op."""
    flat_R = topi_TK.reshape(-1)
    counts_E = torch.zeros(n_experts, dtype=torch.long, device=flat_R.device)
    return counts_E.scatter_add_(0, flat_R, torch.ones_like(flat_R))


def expert_capacity(num_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / n_experts))


def load_balance_loss(probs_TE: Tensor, counts_E: Tensor) -> Tensor:
    """Switch/GShard aux loss E * sum_e f_e * P_e; f from the static routed counts (no grad), P = mean probability.

    Equals 1.0 under perfectly uniform routing, grows as routing concentrates.
    """
    n_experts = probs_TE.shape[-1]
    f_E = counts_E.float() / counts_E.sum().clamp_min(1).float()
    return n_experts * (f_E * probs_TE.mean(0)).sum()


def _sort_by_expert(topi_TK: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(order_R, tok_R, expert_R, counts_E): routed rows sorted by expert, stable so ties keep token order."""
    flat_R = topi_TK.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)
    return order_R, order_R // topi_TK.shape[1], flat_R[order_R], expert_counts(topi_TK, n_experts)


def _combine(x_TD: Tensor, tok_R: Tensor, y_RD: Tensor, w_R: Tensor, num_rows: Optional[int] = None) -> Tensor:
    # Score multiply in fp32 (torchtitan), then one index_add: each token's contributions arrive in expert order.
    y_RD = (y_RD.float() * w_R[:, None]).to(x_TD.dtype)
    rows = x_TD.shape[0] if num_rows is None else num_rows
    return x_TD.new_zeros(rows, x_TD.shape[1]).index_add_(0, tok_R, y_RD)


def _swiglu(h_xG: Tensor) -> Tensor:
    # chunk, not two slices: SplitBackward concatenates, SliceBackward zero-fills a full-width tensor per half.
    gate, up = h_xG.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_bmm(x_ECD: Tensor, w13_EDG: Tensor, w2_EFD: Tensor) -> Tensor:
    return torch.bmm(_swiglu(torch.bmm(x_ECD, w13_EDG.to(x_ECD.dtype))), w2_EFD.to(x_ECD.dtype))


def _padded(x_TD: Tensor, topi_TK: Tensor, topv_TK: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
            capacity: int) -> tuple[Tensor, Tensor]:
    num_tokens, d_model = x_TD.shape
    n_experts = w13_EDG.shape[0]
    num_slots = n_experts * capacity
    order_R, tok_R, expert_R, counts_E = _sort_by_expert(topi_TK, n_experts)
    # Position of each routed row inside its expert's run; rows at or past capacity are dropped.
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    pos_R = torch.arange(order_R.shape[0], device=x_TD.device) - starts_E[expert_R]
    keep_R = pos_R < capacity
    # Dropped rows all write to one extra trash slot, so every shape stays static.
    dest_R = torch.where(keep_R, expert_R * capacity + pos_R, num_slots)
    # Integer scatter first (cheap), then a single D-wide gather: empty slots read the zero row T.
    slot_tok_S = torch.full((num_slots + 1,), num_tokens, dtype=torch.long, device=x_TD.device)
    slot_tok_S = slot_tok_S.index_copy(0, dest_R, tok_R)[:num_slots]
    slot_w_S = torch.zeros(num_slots + 1, dtype=torch.float32, device=x_TD.device)
    slot_w_S = slot_w_S.index_copy(0, dest_R, topv_TK.reshape(-1)[order_R].float())[:num_slots]
    x_pad_TD = torch.cat([x_TD, x_TD.new_zeros(1, d_model)])
    x_ECD = x_pad_TD.index_select(0, slot_tok_S).view(n_experts, capacity, d_model)
    y_SD = _swiglu_bmm(x_ECD, w13_EDG, w2_EFD).reshape(num_slots, d_model)
    out_TD = _combine(x_TD, slot_tok_S, y_SD, slot_w_S, num_rows=num_tokens + 1)[:num_tokens]
    return out_TD, (~keep_R).sum()


def moe_padded(x_TD: Tensor, topi_TK: Tensor, topv_TK: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
               capacity_factor: float) -> tuple[Tensor, Tensor]:
    """Capacity-padded dispatch; returns (y_TD, number of dropped routed rows)."""
    capacity = expert_capacity(x_TD.shape[0], topi_TK.shape[1], w13_EDG.shape[0], capacity_factor)
    return _padded(x_TD, topi_TK, topv_TK, w13_EDG, w2_EFD, capacity)


def moe_dropless_padded_ref(x_TD: Tensor, topi_TK: Tensor, topv_TK: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
                            capacity_factor: float = 0.0) -> tuple[Tensor, Tensor]:
    """Reference: padded with capacity = busiest expert's load. ``.item()``: compile-unfriendly by design."""
    capacity = int(expert_counts(topi_TK, w13_EDG.shape[0]).max().item())
    return _padded(x_TD, topi_TK, topv_TK, w13_EDG, w2_EFD, max(capacity, 1))


@torch.library.custom_op("ablate_kernels::grouped_mm", mutates_args=())
def _grouped_mm_op(a_RK: Tensor, b_EKN: Tensor, offs_E: Tensor) -> Tensor:
    return torch._grouped_mm(a_RK, b_EKN, offs=offs_E)


@_grouped_mm_op.register_fake
def _(a_RK: Tensor, b_EKN: Tensor, offs_E: Tensor) -> Tensor:
    return a_RK.new_empty(a_RK.shape[0], b_EKN.shape[-1])


@torch.library.custom_op("ablate_kernels::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(a_RK: Tensor, g_RN: Tensor, offs_E: Tensor) -> Tensor:
    # 2D x 2D with offs groups the contraction (row) dim: out[e] = a[rows_e].T @ g[rows_e]; empty groups give 0.
    return torch._grouped_mm(a_RK.t(), g_RN, offs=offs_E)


@_grouped_mm_wgrad_op.register_fake
def _(a_RK: Tensor, g_RN: Tensor, offs_E: Tensor) -> Tensor:
    return a_RK.new_empty(offs_E.shape[0], a_RK.shape[1], g_RN.shape[1])


def _grouped_mm_setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, g_RN: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None]:
    a_RK, b_EKN, offs_E = ctx.saved_tensors
    g_RN = g_RN.contiguous()  # an expanded (stride-0) grad fails _grouped_mm's stride check
    grad_a = _grouped_mm_op(g_RN, b_EKN.transpose(-2, -1), offs_E) if ctx.needs_input_grad[0] else None
    grad_b = _grouped_mm_wgrad_op(a_RK, g_RN, offs_E) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(a_RK: Tensor, b_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """Jagged (R, K) @ (E, K, N) over row groups ending at ``offs_E`` (int32)."""
    if a_RK.dtype == torch.bfloat16:
        return torch._grouped_mm(a_RK, b_EKN, offs=offs_E)  # traceable and CUTLASS-eligible as is
    return _grouped_mm_op(a_RK, b_EKN, offs_E)


@torch.library.custom_op("ablate_kernels::expert_mlp", mutates_args=())
def expert_mlp(xs_RD: Tensor, w13_EDG: Tensor, w2_EFD: Tensor, offs_E: Tensor) -> tuple[Tensor, Tensor]:
    """SwiGLU expert MLP over contiguous row groups ending at ``offs_E``, one expert at a time: (y_RD, h_RG).

    Expert-major: each expert's up GEMM, SwiGLU and down GEMM run back to back while its ~R/E rows are in cache,
    instead of three passes over all R rows (a (R, 2F) fp32 pre-activation is 32 MB at the benchmark shape). Same
    per-row GEMMs and SwiGLU ops as the stage-by-stage path, so equal to rounding. CPU has no grouped GEMM
    kernel (``torch._grouped_mm`` there is this same per-group loop without the fusion). Opaque to compile, so the
    host read of ``offs_E`` is no graph break. ``h_RG`` is an internal output kept for the backward: a gradient
    flowing into it is ignored, so callers must not use it.
    """
    d_ff = w2_EFD.shape[1]
    h_RG = xs_RD.new_empty(xs_RD.shape[0], 2 * d_ff)
    y_RD = xs_RD.new_empty(xs_RD.shape[0], w2_EFD.shape[2])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            h_xG = torch.mm(xs_RD[start:end], w13_EDG[e], out=h_RG[start:end])
            torch.mm(_swiglu(h_xG), w2_EFD[e], out=y_RD[start:end])
        start = end
    return y_RD, h_RG


@expert_mlp.register_fake
def _(xs_RD: Tensor, w13_EDG: Tensor, w2_EFD: Tensor, offs_E: Tensor) -> tuple[Tensor, Tensor]:
    return xs_RD.new_empty(xs_RD.shape[0], w2_EFD.shape[2]), xs_RD.new_empty(xs_RD.shape[0], w13_EDG.shape[2])


@torch.library.custom_op("ablate_kernels::expert_mlp_backward", mutates_args=())
def expert_mlp_backward(gy_RD: Tensor, xs_RD: Tensor, h_RG: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
                        offs_E: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(g_xs, g_w13, g_w2), expert by expert; the SwiGLU output is recomputed from ``h`` while it is in cache.

    The gate and up gradients are written into one (rows, 2F) buffer: autograd's SplitBackward would concatenate
    them in an extra full pass. Empty experts get zero weight gradients.
    """
    d_ff = w2_EFD.shape[1]
    g_xs_RD = torch.empty_like(xs_RD)
    g_w13_EDG, g_w2_EFD = torch.zeros_like(w13_EDG), torch.zeros_like(w2_EFD)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            gate_xF, up_xF = h_RG[start:end].chunk(2, dim=-1)
            gy_xD = gy_RD[start:end]
            silu_xF = F.silu(gate_xF)
            torch.mm((silu_xF * up_xF).t(), gy_xD, out=g_w2_EFD[e])
            g_act_xF = gy_xD @ w2_EFD[e].t()
            g_h_xG = torch.empty_like(h_RG[start:end])
            torch.mul(g_act_xF, silu_xF, out=g_h_xG[:, d_ff:])
            torch.ops.aten.silu_backward.grad_input(g_act_xF.mul_(up_xF), gate_xF, grad_input=g_h_xG[:, :d_ff])
            torch.mm(xs_RD[start:end].t(), g_h_xG, out=g_w13_EDG[e])
            torch.mm(g_h_xG, w13_EDG[e].t(), out=g_xs_RD[start:end])
        start = end
    return g_xs_RD, g_w13_EDG, g_w2_EFD


@expert_mlp_backward.register_fake
def _(gy_RD: Tensor, xs_RD: Tensor, h_RG: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
      offs_E: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(xs_RD), torch.empty_like(w13_EDG), torch.empty_like(w2_EFD)


def _expert_mlp_setup(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, Tensor]) -> None:
    xs_RD, w13_EDG, w2_EFD, offs_E = inputs
    ctx.set_materialize_grads(False)  # h_RG is an internal output: do not fill a (R, 2F) zero gradient for it
    ctx.save_for_backward(xs_RD, output[1], w13_EDG, w2_EFD, offs_E)


def _expert_mlp_grad(ctx: Any, g_y_RD: Optional[Tensor], _g_h: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    xs_RD, h_RG, w13_EDG, w2_EFD, offs_E = ctx.saved_tensors
    if g_y_RD is None:
        return None, None, None, None
    return (*expert_mlp_backward(g_y_RD.contiguous(), xs_RD, h_RG, w13_EDG, w2_EFD, offs_E), None)


expert_mlp.register_autograd(_expert_mlp_grad, setup_context=_expert_mlp_setup)


def experts_grouped_gemm(xs_RD: Tensor, w13_EDG: Tensor, w2_EFD: Tensor, counts_E: Tensor) -> Tensor:
    """Stage by stage over all rows: grouped GEMM, SwiGLU, grouped GEMM (the CUDA path; CPU runs it as a loop)."""
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    return grouped_mm(_swiglu(grouped_mm(xs_RD, w13_EDG, offs_E)), w2_EFD, offs_E)


def experts_expert_major(xs_RD: Tensor, w13_EDG: Tensor, w2_EFD: Tensor, counts_E: Tensor) -> Tensor:
    """One expert at a time (the CPU path): equal to ``experts_grouped_gemm`` to rounding (same per-row math)."""
    return expert_mlp(xs_RD, w13_EDG, w2_EFD, torch.cumsum(counts_E, 0))[0]


def _jagged(x_TD: Tensor, topi_TK: Tensor, topv_TK: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
            compute_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    order_R, tok_R, _, counts_E = _sort_by_expert(topi_TK, w13_EDG.shape[0])
    xs_RD = x_TD.index_select(0, tok_R).to(compute_dtype)
    experts = experts_expert_major if x_TD.device.type == "cpu" else experts_grouped_gemm
    y_RD = experts(xs_RD, w13_EDG.to(compute_dtype), w2_EFD.to(compute_dtype), counts_E)
    out_TD = _combine(x_TD, tok_R, y_RD, topv_TK.reshape(-1)[order_R].float())
    return out_TD, torch.zeros((), dtype=torch.long, device=x_TD.device)


def _activation_dtype(x: Tensor) -> torch.dtype:
    # Under autocast the padded path's bmm runs in the autocast dtype; grouped GEMM is not on autocast's op lists, so
    # pick the same dtype by hand (else a bf16 lane would run fp32 grouped GEMM, the loop path on CUDA).
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def moe_jagged(x_TD: Tensor, topi_TK: Tensor, topv_TK: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
               capacity_factor: float = 0.0) -> tuple[Tensor, Tensor]:
    """Dropless sort-by-expert + grouped GEMM in the activation dtype; ``capacity_factor`` is ignored."""
    return _jagged(x_TD, topi_TK, topv_TK, w13_EDG, w2_EFD, _activation_dtype(x_TD))


def moe_grouped_mm(x_TD: Tensor, topi_TK: Tensor, topv_TK: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
                   capacity_factor: float = 0.0) -> tuple[Tensor, Tensor]:
    """Jagged with bf16 GEMM operands (torchtitan GroupedExperts): the CUTLASS fast path needs bf16."""
    return _jagged(x_TD, topi_TK, topv_TK, w13_EDG, w2_EFD, torch.bfloat16)


def moe_jagged_loop(x_TD: Tensor, topi_TK: Tensor, topv_TK: Tensor, w13_EDG: Tensor, w2_EFD: Tensor,
                    capacity_factor: float = 0.0) -> tuple[Tensor, Tensor]:
    """Per-expert ``mm`` loop; host sync on ``counts.tolist()`` (graph break). Fallback when grouped GEMM can't run."""
    order_R, tok_R, _, counts_E = _sort_by_expert(topi_TK, w13_EDG.shape[0])
    xs_RD = x_TD.index_select(0, tok_R)
    outs = [_swiglu(xe @ w13_EDG[e]) @ w2_EFD[e] for e, xe in enumerate(torch.split(xs_RD, counts_E.tolist()))]
    return _combine(x_TD, tok_R, torch.cat(outs), topv_TK.reshape(-1)[order_R].float()), \
        torch.zeros((), dtype=torch.long, device=x_TD.device)


def _aligned(ctx: Mapping[str, Any]) -> tuple[bool, str]:
    # GroupedMMUtils.h: leading strides 16-byte aligned -> K and N multiples of 8 in bf16 (4 in fp32). Check the bf16
    # rule so autocast to bf16 cannot break a resolution made in fp32.
    dims = tuple(ctx.get("dims", ()))
    bad = [d for d in dims if d % 8]
    return (not bad), (f"dims {dims} must be multiples of 8 for grouped GEMM" if bad else "")


def _eligible_grouped_mm(cap: Capability, ctx: Mapping[str, Any]) -> tuple[bool, str]:
    if not cap.grouped_mm_fast_path:
        where = f"cuda sm{cap.cuda_capability[0]}{cap.cuda_capability[1]}" if cap.cuda_capability else cap.device_type
        return False, (f"CUTLASS grouped_mm fast path needs CUDA SM90/SM100 with bf16, have {where}; elsewhere "
                       "torch._grouped_mm is a per-group mm loop")
    if ctx.get("precision") != "bf16":
        # Its GEMMs always take bf16 operands: in an fp32 lane the candidate would buy its speed with precision the
        # baseline keeps (a wrong win), so it runs jagged in the lane's own dtype instead, and says so.
        return False, (f"grouped_mm casts expert GEMM operands to bf16; this lane's precision is "
                       f"{ctx.get('precision', 'fp32')}: bf16 lanes only")
    ok, why = _aligned(ctx)
    return (ok, why) if not ok else (True, "CUTLASS bf16 grouped GEMM (SM90/SM100) in a bf16 lane")


def _eligible_jagged(cap: Capability, ctx: Mapping[str, Any]) -> tuple[bool, str]:
    if cap.device_type == "cpu":
        return True, "expert-major loop on CPU: per-expert mm + SwiGLU + mm while the expert's rows are in cache"
    if not cap.grouped_mm_available:
        return False, f"torch._grouped_mm missing in torch {cap.torch_version}"
    ok, why = _aligned(ctx)
    if not ok:
        return False, why
    if cap.grouped_mm_fast_path:
        return True, "torch._grouped_mm: CUTLASS when activations are bf16, else per-group loop with a D2H sync"
    return True, f"torch._grouped_mm on {cap.device_type}: aten per-group mm loop (no CUTLASS here)"


register(OpSpec(
    name="moe",
    ref=moe_dropless_padded_ref,
    impls={
        "padded": Impl(moe_padded, always("capacity-padded batched GEMM (pure torch)")),
        "jagged": Impl(moe_jagged, _eligible_jagged, fallback="jagged_loop"),
        "grouped_mm": Impl(moe_grouped_mm, _eligible_grouped_mm, fallback="jagged"),
        "jagged_loop": Impl(moe_jagged_loop, always("per-expert mm loop over counts.tolist() (host sync)")),
    },
))
