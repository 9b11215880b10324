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
  a hand-written backward. On the 2-core CPU Q=32 is fastest fwd+bwd (Q=16 and Q=64 about 1.4x slower at L=512).
- ``mamba_ssm``: ``mamba_chunk_scan_combined`` (Triton) when the package is installed on CUDA; lazy import.

Shape suffix legend: B batch, L sequence, H heads, P head dim, N state dim, Q chunk length, C number of chunks
(L/Q), S source position within a chunk, F = H*P, X = P*N, T any trailing length.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

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


def causal_decay(cs_XT: Tensor, dtype: torch.dtype) -> Tensor:
    """exp(cs[i] - cs[j]) for j <= i and 0 above the diagonal, from a float64 cumulative sum ``cs``.

    The difference is taken in float64 and rounded once: an fp32 cumsum difference loses digits when |cumsum| is large
    next to a short segment (measured 1.1e-4 vs the sequential recurrence at Q=64, 2.6e-5 for ssd_minimal's masked
    segsum, 1.1e-5 this way), and it avoids segsum's Q x Q cumsum.
    """
    length = cs_XT.shape[-1]
    # x + (-y) on the small vector rather than x - y on the grid: one full-grid pass fewer.
    diff_XTT = (cs_XT[..., :, None] + (-cs_XT)[..., None, :]).to(dtype)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=cs_XT.device))
    return torch.exp(diff_XTT.masked_fill(~causal, float("-inf")))


def _flip_cumsum(x: Tensor, dim: int) -> Tensor:
    """Suffix sums along ``dim``: the adjoint of ``cumsum``."""
    return torch.flip(torch.cumsum(torch.flip(x, [dim]), dim), [dim])


class _ChunkedSSD(torch.autograd.Function):
    """The four steps of Listing 1 (ssd_minimal) with a hand-written backward.

    Autograd over the same steps records ~50 nodes whose backward adds layout copies, full-grid masked_fill and
    transpose passes; saving the few operands each GEMM needs and writing the adjoint directly measured 1.5x faster
    fwd+bwd on the 2-core CPU (benchmarks/results/kernels.json). The inter-chunk recurrence runs as a scan over the
    L/Q chunk states (as mamba_ssm's state_passing kernel does) instead of ssd_minimal's (C+1)^2 decay GEMM.
    """

    @staticmethod
    def forward(ctx: Any, x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor,
                chunk: int) -> Tensor:
        batch, seq_len, n_heads, head_dim = x_BLHP.shape
        n_chunks, d_state, width = seq_len // chunk, B_BLN.shape[-1], n_heads * head_dim
        rows = batch * n_chunks * n_heads
        # Discretise as mamba_ssm's test does: ssd_minimal(x * dt, A * dt, B, C).
        u_BCQHP = (x_BLHP * dt_BLH[..., None]).view(batch, n_chunks, chunk, n_heads, head_dim)
        cs64_BCQH = torch.cumsum((dt_BLH * A_H).view(batch, n_chunks, chunk, n_heads).double(), dim=2)
        cs_BCQH = cs64_BCQH.to(x_BLHP.dtype)
        B_BCQN = B_BLN.reshape(batch, n_chunks, chunk, d_state)
        C_BCQN = C_BLN.reshape(batch, n_chunks, chunk, d_state)

        # 1. Intra-chunk: y_l = sum_{s<=l} (C_l . B_s) exp(cs_l - cs_s) u_s per head; heads are the bmm batch.
        G_BCQS = C_BCQN @ B_BCQN.transpose(-1, -2)
        L_BCHQS = causal_decay(cs64_BCQH.transpose(2, 3), x_BLHP.dtype)
        M_BCHQS = L_BCHQS * G_BCQS[:, :, None]
        uh_BCHQP = u_BCQHP.transpose(2, 3).contiguous()
        y_diag_BCHQP = torch.bmm(M_BCHQS.view(rows, chunk, chunk), uh_BCHQP.view(rows, chunk, head_dim))

        # 2. Each chunk's own end state: S = sum_s exp(cs_last - cs_s) u_s B_s^T, heads folded into the GEMM width
        # (B and C are shared by all heads).
        w_BCQH = torch.exp((cs64_BCQH[:, :, -1:] - cs64_BCQH).to(x_BLHP.dtype))
        uw_BCQF = (u_BCQHP * w_BCQH[..., None]).view(batch, n_chunks, chunk, width)
        S_BCHX = (uw_BCQF.transpose(-1, -2) @ B_BCQN).view(batch, n_chunks, n_heads, head_dim * d_state)

        # 3. State entering chunk c: H[0] = 0, H[c] = exp(T[c-1]) H[c-1] + S[c-1], T = a chunk's total decay.
        # Filled slice by slice: stacking a list costs a full extra pass (measured); no out= because Dynamo rejects a
        # non-contiguous out tensor.
        eT_BCH = torch.exp(cs_BCQH[:, :, -1])
        H_BCHX = torch.empty_like(S_BCHX)
        H_BCHX[:, 0] = 0
        for c in range(1, n_chunks):
            H_BCHX[:, c] = torch.addcmul(S_BCHX[:, c - 1], H_BCHX[:, c - 1], eT_BCH[:, c - 1, :, None])
        H_BCFN = H_BCHX.view(batch, n_chunks, width, d_state)

        # 4. Read the carried state out with C_l, decayed to position l; add the intra-chunk part.
        E_BCQH = torch.exp(cs_BCQH)
        z_BCQHP = (C_BCQN @ H_BCFN.transpose(-1, -2)).view(batch, n_chunks, chunk, n_heads, head_dim)
        y_diag_BCQHP = y_diag_BCHQP.view(batch, n_chunks, n_heads, chunk, head_dim).transpose(2, 3)
        y_BCQHP = torch.addcmul(y_diag_BCQHP, z_BCQHP, E_BCQH[..., None])
        ctx.save_for_backward(x_BLHP, dt_BLH, A_H, B_BCQN, C_BCQN, u_BCQHP, uh_BCHQP, G_BCQS, L_BCHQS, M_BCHQS,
                              w_BCQH, uw_BCQF, eT_BCH, H_BCFN, E_BCQH, z_BCQHP)
        return y_BCQHP.reshape(batch, seq_len, n_heads, head_dim)

    @staticmethod
    def backward(ctx: Any, gy_BLHP: Tensor) -> tuple[Optional[Tensor], ...]:
        (x_BLHP, dt_BLH, A_H, B_BCQN, C_BCQN, u_BCQHP, uh_BCHQP, G_BCQS, L_BCHQS, M_BCHQS,
         w_BCQH, uw_BCQF, eT_BCH, H_BCFN, E_BCQH, z_BCQHP) = ctx.saved_tensors
        batch, n_chunks, chunk, n_heads, head_dim = u_BCQHP.shape
        d_state, width, rows = B_BCQN.shape[-1], n_heads * head_dim, batch * n_chunks * n_heads
        gy_BCQHP = gy_BLHP.reshape(batch, n_chunks, chunk, n_heads, head_dim)

        # 4. y_off = exp(cs) * z, z = C @ H^T.
        g_cs_BCQH = (gy_BCQHP * z_BCQHP).sum(-1).mul_(E_BCQH)
        gz_BCQF = (gy_BCQHP * E_BCQH[..., None]).view(batch, n_chunks, chunk, width)
        g_C_BCQN = gz_BCQF @ H_BCFN
        g_H_BCHX = (gz_BCQF.transpose(-1, -2) @ C_BCQN).view(batch, n_chunks, n_heads, head_dim * d_state)

        # 3. Reverse scan: the gradient reaching H[c] is g_S[c-1]; g_S[C-1] = 0 (the last state feeds nothing).
        g_S_BCHX = torch.empty_like(g_H_BCHX)
        g_S_BCHX[:, -1] = 0
        for c in range(n_chunks - 1, 0, -1):
            g_S_BCHX[:, c - 1] = g_H_BCHX[:, c] if c == n_chunks - 1 else torch.addcmul(
                g_H_BCHX[:, c], g_S_BCHX[:, c], eT_BCH[:, c, :, None])
        g_T_BCH = (g_S_BCHX * H_BCFN.view_as(g_S_BCHX)).sum(-1).mul_(eT_BCH)

        # 2. S = uw^T @ B, uw = u * exp(cs_last - cs).
        g_S_BCFN = g_S_BCHX.view(batch, n_chunks, width, d_state)
        g_uw_BCQHP = (B_BCQN @ g_S_BCFN.transpose(-1, -2)).view(batch, n_chunks, chunk, n_heads, head_dim)
        g_B_BCQN = uw_BCQF @ g_S_BCFN
        g_w_BCQH = (g_uw_BCQHP * u_BCQHP).sum(-1).mul_(w_BCQH)
        g_cs_BCQH -= g_w_BCQH
        g_cs_BCQH[:, :, -1] += g_w_BCQH.sum(2) + g_T_BCH

        # 1. y_diag = (L * G) @ u per head; L = exp(cs_l - cs_s), so d/dcs_l = +rowsum, d/dcs_s = -colsum.
        gyh_BCHQP = gy_BCQHP.transpose(2, 3).contiguous().view(rows, chunk, head_dim)
        g_M_BCHQS = torch.bmm(gyh_BCHQP, uh_BCHQP.view(rows, chunk, head_dim).transpose(1, 2)).view_as(M_BCHQS)
        g_uh = torch.bmm(M_BCHQS.view(rows, chunk, chunk).transpose(1, 2), gyh_BCHQP)
        g_u_BCQHP = torch.addcmul(g_uh.view(batch, n_chunks, n_heads, chunk, head_dim).transpose(2, 3),
                                  g_uw_BCQHP, w_BCQH[..., None])
        g_G_BCQS = (g_M_BCHQS * L_BCHQS).sum(2)
        g_logL_BCHQS = g_M_BCHQS.mul_(M_BCHQS)
        g_cs_BCQH += (g_logL_BCHQS.sum(-1) - g_logL_BCHQS.sum(-2)).transpose(2, 3)
        g_C_BCQN += g_G_BCQS @ B_BCQN
        g_B_BCQN += g_G_BCQS.transpose(-1, -2) @ C_BCQN

        # Inputs: cs = cumsum over the chunk of a = dt * A; u = x * dt.
        g_a_BLH = _flip_cumsum(g_cs_BCQH, 2).view_as(dt_BLH)
        g_u_BLHP = g_u_BCQHP.reshape(x_BLHP.shape)
        g_x = g_u_BLHP * dt_BLH[..., None]
        g_dt = (g_u_BLHP * x_BLHP).sum(-1) + g_a_BLH * A_H
        g_A = (g_a_BLH * dt_BLH).sum((0, 1))
        return g_x, g_dt, g_A, g_B_BCQN.view(batch, -1, d_state), g_C_BCQN.view(batch, -1, d_state), None


def ssd_chunked(x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor, chunk: int) -> Tensor:
    """Chunked SSD; computes in float32 (float64 for float64 inputs) and returns x's dtype.

    Mixed or bf16 inputs are upcast, as mamba_ssm's kernels accumulate in fp32; autocast is off inside so the forward
    and the hand-written backward see the same dtypes.
    """
    seq_len = x_BLHP.shape[1]
    if seq_len % chunk:
        raise ValueError(f"sequence length {seq_len} must be a multiple of the SSD chunk {chunk}")
    inputs = (x_BLHP, dt_BLH, A_H, B_BLN, C_BLN)
    compute = torch.float64 if any(t.dtype == torch.float64 for t in inputs) else torch.float32
    with torch.autocast(x_BLHP.device.type, enabled=False):
        y_BLHP = _ChunkedSSD.apply(*(t.to(compute) for t in inputs), chunk)
    return y_BLHP.to(x_BLHP.dtype)


_mamba_chunk_scan_combined: Optional[Callable[..., Tensor]] = None


def ssd_mamba_ssm(x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor, chunk: int) -> Tensor:
    """mamba_ssm takes raw x and dt and discretises inside; B/C carry an explicit group dim (ngroups=1)."""
    assert _mamba_chunk_scan_combined is not None, "resolve the 'mamba_ssm' backend through the dispatcher first"
    return _mamba_chunk_scan_combined(x_BLHP, dt_BLH, A_H, B_BLN.unsqueeze(2), C_BLN.unsqueeze(2), chunk_size=chunk)


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
        "chunked": Impl(ssd_chunked, always("chunked SSD (ssd_minimal), pure torch einsums")),
        "mamba_ssm": Impl(None, _eligible_mamba_ssm, fallback="chunked", load=_load_mamba_ssm),
    },
))
