"""Mamba2 SSD (state space duality) scan: sequential reference, chunked ``ssd_minimal`` port, optional mamba_ssm.

How to use::

    y_BLHP = ssd_chunked(x_BLHP, dt_BLH, A_H, B_BLN, C_BLN, chunk=32)   # == ssd_sequential_ref(...) within 1e-4

Math (Mamba2, one B/C group shared by all heads, as mamba_ssm's default ngroups=1): per head h,
  state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T        (P x N state per head)
  y_t     = state_t C_t
Backends (op ``ssd``; the feature ``mamba_scan`` requests one):
- ``sequential``: ``ssd_sequential_ref``, the literal recurrence, L dependent steps (the parity oracle).
- ``chunked``: ``ssd_chunked``, the four steps of Listing 1 of the Mamba-2 paper (``mamba_ssm/modules/ssd_minimal.py``,
  not imported: that module imports Triton at top level) as batched matmuls: quadratic attention-like form inside
  chunks of length Q, a linear recurrence over the L/Q chunk states. GEMM-shaped work instead of L tiny steps, with
  a hand-written backward. On the 2-core CPU Q=32 is fastest fwd+bwd (Q=16 and Q=64 1.1-1.5x slower at L=512).
- ``mamba_ssm``: ``mamba_chunk_scan_combined`` (Triton) when the package is installed on CUDA; lazy import.

Shape suffix legend: B batch, L sequence, H heads, P head dim, N state dim, Q chunk length, C number of chunks
(L/Q), S source position within a chunk, F = H*P, X = P*N, T any trailing length.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from kernels.capability import Capability
from kernels.dispatch import Impl, OpSpec, always, register


def ssd_sequential_ref(x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor,
                       chunk: int = 0) -> Tensor:
    """The recurrence one step at a time (``chunk`` is accepted for a common signature and ignored)."""
    batch, seq_len, n_heads, head_dim = x_BLHP.shape
    decay_BLH = torch.exp(dt_BLH * A_H)
    xdt_BLHP = x_BLHP * dt_BLH[..., None]
    state_BHPN = x_BLHP.new_zeros(batch, n_heads, head_dim, B_BLN.shape[-1])
    ys = []
    for t in range(seq_len):
        state_BHPN = state_BHPN * decay_BLH[:, t, :, None, None] \
            + xdt_BLHP[:, t, :, :, None] * B_BLN[:, t, None, None, :]
        ys.append((state_BHPN * C_BLN[:, t, None, None, :]).sum(-1))
    return torch.stack(ys, dim=1)


def _contiguous_result(op: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """``op(*args)`` (an elementwise op) as a fresh contiguous tensor, in one pass.

    Elementwise ops take the layout of their first operand, and a head-major operand would make the result need a
    second, copying pass; ``out=`` writes the contiguous layout directly. Under torch.compile the functional form:
    functionalization drops an ``out=`` tensor's layout (later views then fail), and Inductor fuses the copy anyway.
    """
    if torch.compiler.is_compiling():
        return op(*args).contiguous()
    out = torch.empty(torch.broadcast_shapes(*(a.shape for a in args)), dtype=args[0].dtype, device=args[0].device)
    return op(*args, out=out)


def _mul_sum(a: Tensor, b: Tensor, dim: int, scratch: Optional[Tensor]) -> Tensor:
    """(a * b).sum(dim) with the product written into ``scratch`` (eager): one workspace for every such reduction
    of the backward instead of a fresh full-size temporary each (fresh pages fault in; measured ~2000 minor faults per
    fwd+bwd at the benchmark shape)."""
    if scratch is None or torch.compiler.is_compiling():
        return (a * b).sum(dim)
    return torch.mul(a, b, out=scratch[:a.numel()].view(a.shape)).sum(dim)


def _head_major(t_BCQHP: Tensor, scratch: Tensor) -> Tensor:
    """A contiguous (B, C, H, Q, P) copy of ``t``, in ``scratch`` when eager."""
    t_BCHQP = t_BCQHP.transpose(2, 3)
    if torch.compiler.is_compiling():
        return t_BCHQP.contiguous()
    return scratch[:t_BCHQP.numel()].view(t_BCHQP.shape).copy_(t_BCHQP)


def causal_decay(cs_XT: Tensor, dtype: torch.dtype) -> Tensor:
    """exp(cs[i] - cs[j]) for j <= i (clamped to [e^-80, e^80]) and 0 above the diagonal, from a float64 cumsum.

    The difference is taken in float64 and rounded once: an fp32 cumsum difference loses digits when |cumsum| is large
    next to a short segment (measured 1.1e-4 vs the sequential recurrence at Q=64, 2.6e-5 for ssd_minimal's masked
    segsum, 1.1e-5 this way), and it avoids segsum's Q x Q cumsum.
    """
    length = cs_XT.shape[-1]
    cs_XT = cs_XT.contiguous()  # small; a strided operand makes the full-grid subtraction slower
    diff_XTT = (cs_XT[..., :, None] - cs_XT[..., None, :]).to(dtype)
    # exp of -inf or of anything that under/overflows takes the vector library's slow path (measured 13x slower on
    # half -inf input), so mask with a multiply instead of -inf, and clamp: a decay below e^-80 (1.8e-35) is far under
    # fp32 resolution next to the diagonal term, and the upper triangle only has to stay finite to be zeroed.
    causal = torch.tril(torch.ones(length, length, dtype=dtype, device=cs_XT.device))
    return diff_XTT.clamp_(-80.0, 80.0).exp_().mul_(causal)


def _flip_cumsum(x: Tensor, dim: int) -> Tensor:
    """Suffix sums along ``dim``: the adjoint of ``cumsum``."""
    return torch.flip(torch.cumsum(torch.flip(x, [dim]), dim), [dim])


def _chunk_scan(b_BCX: Tensor, decay_BCH: Tensor, reverse: bool = False) -> Tensor:
    """out[0] = 0, out[c] = decay[c-1] * out[c-1] + b[c-1]; reversed: out[C-1] = 0, out[c-1] = decay[c] * out[c] + b[c].

    Written slice by slice into one buffer (stacking a list costs a full extra pass). Eager writes with ``out=``;
    Dynamo rejects a non-contiguous ``out=``, so compiled code assigns the slice instead.
    """
    n_chunks = b_BCX.shape[1]
    out_BCX = torch.empty_like(b_BCX)
    out_BCX[:, n_chunks - 1 if reverse else 0] = 0
    eager = not torch.compiler.is_compiling()
    for c in (range(n_chunks - 1, 0, -1) if reverse else range(1, n_chunks)):
        dst, src = (c - 1, c) if reverse else (c, c - 1)
        if eager:
            torch.addcmul(b_BCX[:, src], out_BCX[:, src], decay_BCH[:, src, :, None], out=out_BCX[:, dst])
        else:
            out_BCX[:, dst] = torch.addcmul(b_BCX[:, src], out_BCX[:, src], decay_BCH[:, src, :, None])
    return out_BCX


class _ChunkedSSD(torch.autograd.Function):
    """The four steps of Listing 1 (ssd_minimal) with a hand-written backward.

    Autograd over the same steps records ~50 nodes whose backward adds layout copies, full-grid masked_fill and
    transpose passes and a fresh temporary per op; saving the few operands each GEMM needs, writing the adjoint
    directly and reusing one workspace measured 1.2-1.4x faster fwd+bwd than autograd over the same four steps on the
    2-core CPU, head to head. The inter-chunk recurrence runs as a scan over the L/Q chunk states (as mamba_ssm's
    state_passing kernel does) instead of ssd_minimal's (C+1)^2 decay GEMM.
    """

    @staticmethod
    def forward(ctx: Any, x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor,
                chunk: int) -> Tensor:
        batch, seq_len, n_heads, head_dim = x_BLHP.shape
        n_chunks, d_state, width = seq_len // chunk, B_BLN.shape[-1], n_heads * head_dim
        rows = batch * n_chunks * n_heads
        # Discretise as mamba_ssm's test does: ssd_minimal(x * dt, A * dt, B, C); u = x * dt is only ever needed
        # head-major (intra-chunk bmm) or decayed (chunk states), so it is written straight into those two layouts.
        x_BCQHP = x_BLHP.view(batch, n_chunks, chunk, n_heads, head_dim)
        dt_BCQH = dt_BLH.view(batch, n_chunks, chunk, n_heads)
        cs64_BCQH = torch.cumsum((dt_BLH * A_H).view(batch, n_chunks, chunk, n_heads).double(), dim=2)
        cs_BCQH = cs64_BCQH.to(x_BLHP.dtype)
        B_BCQN = B_BLN.reshape(batch, n_chunks, chunk, d_state)
        C_BCQN = C_BLN.reshape(batch, n_chunks, chunk, d_state)

        # 1. Intra-chunk: y_l = sum_{s<=l} (C_l . B_s) exp(cs_l - cs_s) u_s per head; heads are the bmm batch.
        G_BCQS = C_BCQN @ B_BCQN.transpose(-1, -2)
        L_BCHQS = causal_decay(cs64_BCQH.transpose(2, 3), x_BLHP.dtype)
        M_BCHQS = L_BCHQS * G_BCQS[:, :, None]
        uh_BCHQP = _contiguous_result(torch.mul, x_BCQHP.transpose(2, 3), dt_BCQH.transpose(2, 3)[..., None])
        y_diag_BCHQP = torch.bmm(M_BCHQS.view(rows, chunk, chunk), uh_BCHQP.reshape(rows, chunk, head_dim))

        # 2. Each chunk's own end state: S = sum_s exp(cs_last - cs_s) u_s B_s^T, heads folded into the GEMM width
        # (B and C are shared by all heads).
        w_BCQH = torch.exp((cs64_BCQH[:, :, -1:] - cs64_BCQH).to(x_BLHP.dtype))
        uw_BCQF = (x_BCQHP * (dt_BCQH * w_BCQH)[..., None]).view(batch, n_chunks, chunk, width)
        S_BCHX = (uw_BCQF.transpose(-1, -2) @ B_BCQN).view(batch, n_chunks, n_heads, head_dim * d_state)

        # 3. State entering chunk c: H[0] = 0, H[c] = exp(T[c-1]) H[c-1] + S[c-1], T = a chunk's total decay.
        eT_BCH = torch.exp(cs_BCQH[:, :, -1])
        H_BCHX = _chunk_scan(S_BCHX, eT_BCH)
        H_BCFN = H_BCHX.view(batch, n_chunks, width, d_state)

        # 4. Read the carried state out with C_l, decayed to position l; add the intra-chunk part.
        E_BCQH = torch.exp(cs_BCQH)
        z_BCQHP = (C_BCQN @ H_BCFN.transpose(-1, -2)).view(batch, n_chunks, chunk, n_heads, head_dim)
        y_diag_BCQHP = y_diag_BCHQP.view(batch, n_chunks, n_heads, chunk, head_dim).transpose(2, 3)
        y_BCQHP = _contiguous_result(torch.addcmul, y_diag_BCQHP, z_BCQHP, E_BCQH[..., None])
        ctx.save_for_backward(x_BLHP, dt_BLH, A_H, B_BCQN, C_BCQN, uh_BCHQP, G_BCQS, L_BCHQS, M_BCHQS,
                              w_BCQH, uw_BCQF, eT_BCH, H_BCFN, E_BCQH, z_BCQHP)
        return y_BCQHP.reshape(batch, seq_len, n_heads, head_dim)

    @staticmethod
    @once_differentiable  # the adjoint is written with out= and workspaces: no second derivative through it
    def backward(ctx: Any, gy_BLHP: Tensor) -> tuple[Optional[Tensor], ...]:
        # Autocast off as in the forward: a backward called inside an autocast region would otherwise run these
        # matmuls in bf16 (measured 5e-3 gradient error instead of 1e-7).
        with torch.autocast(gy_BLHP.device.type, enabled=False):
            return _ChunkedSSD._adjoint(ctx, gy_BLHP.contiguous())

    @staticmethod
    def _adjoint(ctx: Any, gy_BLHP: Tensor) -> tuple[Optional[Tensor], ...]:
        (x_BLHP, dt_BLH, A_H, B_BCQN, C_BCQN, uh_BCHQP, G_BCQS, L_BCHQS, M_BCHQS,
         w_BCQH, uw_BCQF, eT_BCH, H_BCFN, E_BCQH, z_BCQHP) = ctx.saved_tensors
        batch, n_chunks, n_heads, chunk, head_dim = uh_BCHQP.shape
        x_BCQHP = x_BLHP.view(batch, n_chunks, chunk, n_heads, head_dim)
        dt_BCQH = dt_BLH.view(batch, n_chunks, chunk, n_heads)
        d_state, width, rows = B_BCQN.shape[-1], n_heads * head_dim, batch * n_chunks * n_heads
        gy_BCQHP = gy_BLHP.reshape(batch, n_chunks, chunk, n_heads, head_dim)

        scratch = gy_BLHP.new_empty(max(gy_BLHP.numel(), H_BCFN.numel()))

        # 4. y_off = exp(cs) * z, z = C @ H^T. The per-position cs gradient is accumulated in float64, as the
        # forward's cumsum is: the chunk-state term below enters as -g_w[s] and +sum(g_w) at the chunk end, and the
        # suffix sums that turn it into d/da cancel those.
        g_cs_BCQH = _mul_sum(gy_BCQHP, z_BCQHP, -1, scratch).mul_(E_BCQH).double()
        gz_BCQF = (gy_BCQHP * E_BCQH[..., None]).view(batch, n_chunks, chunk, width)
        g_C_BCQN = gz_BCQF @ H_BCFN
        g_H_BCHX = (gz_BCQF.transpose(-1, -2) @ C_BCQN).view(batch, n_chunks, n_heads, head_dim * d_state)

        # 3. Reverse scan: the gradient reaching H[c] is g_S[c-1]; g_S[C-1] = 0 (the last state feeds nothing).
        g_S_BCHX = _chunk_scan(g_H_BCHX, eT_BCH, reverse=True)
        g_T_BCH = _mul_sum(g_S_BCHX, H_BCFN.view_as(g_S_BCHX), -1, scratch).mul_(eT_BCH)

        # 2. S = uw^T @ B, uw = u * exp(cs_last - cs).
        g_S_BCFN = g_S_BCHX.view(batch, n_chunks, width, d_state)
        g_uw_BCQHP = (B_BCQN @ g_S_BCFN.transpose(-1, -2)).view(batch, n_chunks, chunk, n_heads, head_dim)
        g_B_BCQN = uw_BCQF @ g_S_BCFN
        g_w_BCQH = _mul_sum(g_uw_BCQHP, x_BCQHP, -1, scratch).mul_(dt_BCQH * w_BCQH)
        g_cs_BCQH -= g_w_BCQH
        g_cs_BCQH[:, :, -1] += g_w_BCQH.sum(2) + g_T_BCH

        # 1. y_diag = (L * G) @ u per head, L = exp(cs_l - cs_s).
        gyh_BCHQP = _head_major(gy_BCQHP, scratch).view(rows, chunk, head_dim)  # dead before scratch's next use
        g_M_BCHQS = torch.bmm(gyh_BCHQP, uh_BCHQP.reshape(rows, chunk, head_dim).transpose(1, 2)).view_as(M_BCHQS)
        g_uh = torch.bmm(M_BCHQS.view(rows, chunk, chunk).transpose(1, 2), gyh_BCHQP)
        g_uh_BCQHP = g_uh.view(batch, n_chunks, n_heads, chunk, head_dim).transpose(2, 3)
        g_u_BCQHP = _contiguous_result(torch.addcmul, g_uh_BCQHP, g_uw_BCQHP, w_BCQH[..., None])
        # In place: g_M * L gives g_G (summed over heads), times G it is g_M * M = the gradient of log L.
        g_ML_BCHQS = g_M_BCHQS.mul_(L_BCHQS)
        g_G_BCQS = g_ML_BCHQS.sum(2)
        g_logL_BCHQS = g_ML_BCHQS.mul_(G_BCQS[:, :, None])
        # log L[l, s] = sum of a over (s, l], so a_q collects g over the block l >= q > s. Summed directly (a GEMM
        # with the strict prefix mask, then the l >= q rows), not as rowsum - colsum followed by suffix sums: those
        # cancel the large near-diagonal terms and left 1e-2 relative error on dA at strong decay.
        ones_QQ = torch.ones(chunk, chunk, dtype=g_logL_BCHQS.dtype, device=gy_BLHP.device)
        g_a_L_BCHQ = (g_logL_BCHQS @ ones_QQ.triu(diagonal=1)).mul_(ones_QQ.tril()).sum(-2)
        g_C_BCQN += g_G_BCQS @ B_BCQN
        g_B_BCQN += g_G_BCQS.transpose(-1, -2) @ C_BCQN

        # Inputs: cs = cumsum over the chunk of a = dt * A; u = x * dt.
        g_a_BLH = (_flip_cumsum(g_cs_BCQH, 2) + g_a_L_BCHQ.transpose(2, 3)).view_as(dt_BLH)
        g_u_BLHP = g_u_BCQHP.reshape(x_BLHP.shape)
        g_dt = _mul_sum(g_u_BLHP, x_BLHP, -1, scratch) + (g_a_BLH * A_H).to(x_BLHP.dtype)
        g_x = g_u_BLHP.mul_(dt_BLH[..., None])
        g_A = (g_a_BLH * dt_BLH).sum((0, 1)).to(x_BLHP.dtype)
        return g_x, g_dt, g_A, g_B_BCQN.view(batch, -1, d_state), g_C_BCQN.view(batch, -1, d_state), None


def _result_dtype(*inputs: Tensor) -> torch.dtype:
    """The dtype ``ssd_sequential_ref`` returns for these inputs (its elementwise ops promote): every backend returns
    it, so the M block after the op (D-skip, gated norm) runs in one dtype whichever backend a lane's arm uses."""
    return functools.reduce(torch.promote_types, (t.dtype for t in inputs))


def ssd_chunked(x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor, chunk: int) -> Tensor:
    """Chunked SSD; computes in float32 (float64 for float64 inputs) and returns the reference's (promoted) dtype.

    Mixed or bf16 inputs are upcast, as mamba_ssm's kernels accumulate in fp32; autocast is off inside the forward
    and the hand-written backward, so both see the same dtypes. Once differentiable (no double backward).
    """
    seq_len = x_BLHP.shape[1]
    if seq_len % chunk:
        raise ValueError(f"sequence length {seq_len} must be a multiple of the SSD chunk {chunk}")
    inputs = (x_BLHP, dt_BLH, A_H, B_BLN, C_BLN)
    compute = torch.float64 if any(t.dtype == torch.float64 for t in inputs) else torch.float32
    with torch.autocast(x_BLHP.device.type, enabled=False):
        y_BLHP = _ChunkedSSD.apply(*(t.to(compute).contiguous() for t in inputs), chunk)
    return y_BLHP.to(_result_dtype(*inputs))


_mamba_chunk_scan_combined: Optional[Callable[..., Tensor]] = None


def ssd_mamba_ssm(x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor, chunk: int) -> Tensor:
    """mamba_ssm takes raw x and dt and discretises inside; B/C carry an explicit group dim (ngroups=1)."""
    assert _mamba_chunk_scan_combined is not None, "resolve the 'mamba_ssm' backend through the dispatcher first"
    y_BLHP = _mamba_chunk_scan_combined(x_BLHP, dt_BLH, A_H, B_BLN.unsqueeze(2), C_BLN.unsqueeze(2), chunk_size=chunk)
    return y_BLHP.to(_result_dtype(x_BLHP, dt_BLH, A_H, B_BLN, C_BLN))


def _load_mamba_ssm() -> Callable[..., Tensor]:
    global _mamba_chunk_scan_combined
    _mamba_chunk_scan_combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
    return ssd_mamba_ssm


def _eligible_mamba_ssm(cap: Capability, ctx: Mapping[str, Any]) -> tuple[bool, str]:
    if not cap.cuda_available:
        return False, "mamba_ssm Triton kernels run on CUDA only"
    if not cap.mamba_ssm_importable:
        return False, "mamba_ssm is not installed"
    conv_channels = int(ctx.get("conv_channels", 0))
    if conv_channels % 8:
        return False, f"mamba_ssm needs conv channels % 8 == 0, have {conv_channels}"
    return True, "mamba_ssm.mamba_chunk_scan_combined (Triton)"


register(OpSpec(
    name="ssd",
    ref=ssd_sequential_ref,
    impls={
        "sequential": Impl(ssd_sequential_ref, always("sequential recurrence, one step per position")),
        "chunked": Impl(ssd_chunked, always("chunked SSD (ssd_minimal's four steps), hand-written backward")),
        "mamba_ssm": Impl(None, _eligible_mamba_ssm, fallback="chunked", load=_load_mamba_ssm),
    },
))
