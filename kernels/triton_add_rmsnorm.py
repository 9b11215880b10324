"""Triton fused residual add + RMSNorm, forward and backward, as ``torch.library`` custom ops.

How to run me: imported lazily by ``kernels.norm`` when the dispatcher resolves ``add_rmsnorm`` to ``triton`` (CUDA).
On CPU it runs only under ``TRITON_INTERPRET=1`` (set before this module is imported), which is how the parity
tests exercise it. The ops are opaque to Dynamo but carry fake (meta) implementations, so a block using them still
compiles with ``fullgraph=True``; autograd is registered with a second Triton kernel for the backward.

Math, per row of width D (matches ``kernels.norm.add_rmsnorm_ref``; y and s in x and r's promoted dtype):
  s = round(x + r);  rstd = 1 / sqrt(mean(s^2) + eps);  n = s * rstd;  y = n * w
  backward: dn = dy * w;  ds = rstd * (dn - n * mean(dn * n)) + ds_out;  dx = dr = ds;  dw = sum_rows(dy * n)
The weight gradient is reduced in two stages (per-program partial sums, then one torch sum) so it is deterministic,
no atomics.

Shape suffix legend: M rows (leading dims flattened), D normalised width, P programs in the backward launch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _add_rmsnorm_fwd_kernel(X, R, W, Y, S, RSTD, stride, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride + cols, mask=mask, other=0.0)
    r = tl.load(R + row * stride + cols, mask=mask, other=0.0)
    # Round the sum to the storage dtype first: the reference normalises the stored residual, not a wider one.
    s = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
    tl.store(S + row * stride + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / D + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride + cols, (sf * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_bwd_kernel(DY, DS_OUT, S, RSTD, W, DX, DW_PART, stride, M, D, ROWS_PER_PROG,
                            BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row_start = pid * ROWS_PER_PROG
    for i in range(0, ROWS_PER_PROG):
        row = row_start + i
        if row < M:
            s = tl.load(S + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            ds_out = tl.load(DS_OUT + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            n = s * rstd
            dn = dy * w
            c = tl.sum(dn * n, axis=0) / D
            ds = rstd * (dn - n * c) + ds_out
            tl.store(DX + row * stride + cols, ds.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * n
    tl.store(DW_PART + pid * D + cols, dw_acc, mask=mask)


def _as_rows(t: Tensor) -> Tensor:
    return t.contiguous().view(-1, t.shape[-1])


@torch.library.custom_op("ablate_kernels::add_rmsnorm_fwd", mutates_args=())
def add_rmsnorm_fwd(x: Tensor, r: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    x_MD, r_MD = _as_rows(x), _as_rows(r)
    num_rows, width = x_MD.shape
    # The sum in the promoted dtype, as the reference's ``x + r``: under bf16 autocast a bf16 block output meets the
    # fp32 residual stream, and storing the sum in x's dtype would round the stream to bf16 (a speed-up bought with
    # precision, not fusion).
    out = torch.promote_types(x.dtype, r.dtype)
    y_MD, s_MD = torch.empty_like(x_MD, dtype=out), torch.empty_like(x_MD, dtype=out)
    rstd_M = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    _add_rmsnorm_fwd_kernel[(num_rows,)](x_MD, r_MD, w.contiguous(), y_MD, s_MD, rstd_M, x_MD.stride(0), width, eps,
                                         BLOCK_D=triton.next_power_of_2(width))
    return y_MD.view(x.shape), s_MD.view(x.shape), rstd_M.view(x.shape[:-1])


@add_rmsnorm_fwd.register_fake
def _(x: Tensor, r: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    out = torch.promote_types(x.dtype, r.dtype)
    return (torch.empty_like(x, dtype=out), torch.empty_like(x, dtype=out),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("ablate_kernels::add_rmsnorm_bwd", mutates_args=())
def add_rmsnorm_bwd(dy: Tensor, ds_out: Tensor, s: Tensor, rstd: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    dy_MD, ds_MD, s_MD = _as_rows(dy), _as_rows(ds_out), _as_rows(s)
    num_rows, width = s_MD.shape
    # Enough programs to fill a GPU, few enough that the partial dw buffer stays small.
    num_progs = max(1, min(num_rows, 256))
    rows_per_prog = triton.cdiv(num_rows, num_progs)
    dx_MD = torch.empty_like(s_MD)
    dw_part_PD = torch.empty(num_progs, width, dtype=torch.float32, device=s.device)
    _add_rmsnorm_bwd_kernel[(num_progs,)](dy_MD, ds_MD, s_MD, rstd.contiguous().view(-1), w.contiguous(), dx_MD,
                                          dw_part_PD, s_MD.stride(0), num_rows, width, rows_per_prog,
                                          BLOCK_D=triton.next_power_of_2(width))
    return dx_MD.view(s.shape), dw_part_PD.sum(0).to(w.dtype)


@add_rmsnorm_bwd.register_fake
def _(dy: Tensor, ds_out: Tensor, s: Tensor, rstd: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(s), torch.empty_like(w)


def _setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor, float], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, r, w, _ = inputs
    _, s, rstd = output
    ctx.input_dtypes = (x.dtype, r.dtype)
    ctx.save_for_backward(s, rstd, w)


def _backward(ctx: Any, dy: Optional[Tensor], ds_out: Optional[Tensor],
              drstd: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, None]:
    s, rstd, w = ctx.saved_tensors
    # An output nobody used arrives as None; the kernel wants a real tensor for it.
    dy = torch.zeros_like(s) if dy is None else dy
    ds_out = torch.zeros_like(s) if ds_out is None else ds_out
    dx, dw = add_rmsnorm_bwd(dy, ds_out, s, rstd, w)
    x_dtype, r_dtype = ctx.input_dtypes
    return dx.to(x_dtype), dx.to(r_dtype), dw, None


add_rmsnorm_fwd.register_autograd(_backward, setup_context=_setup)


def add_rmsnorm_triton(x_TD: Tensor, residual_TD: Tensor, weight_D: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Same contract as ``kernels.norm.add_rmsnorm_ref``: returns (rmsnorm(x + r) * w, x + r)."""
    y, s, _ = add_rmsnorm_fwd(x_TD, residual_TD, weight_D, eps)
    return y, s
