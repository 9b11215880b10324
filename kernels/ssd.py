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
  chunks of length Q, a linear recurrence over the L/Q chunk states. GEMM-shaped work instead of L tiny steps. On
  the 2-core CPU Q=32 is fastest fwd+bwd (Q=16 and Q=64 about 1.5x slower at L=512).
- ``mamba_ssm``: ``mamba_chunk_scan_combined`` (Triton) when the package is installed on CUDA; lazy import.

Shape suffix legend: B batch, L sequence, H heads, P head dim, N state dim, Q chunk length, C number of chunks
(L/Q), S source position within a chunk, Z = C + 1 (chunk boundaries), F = H*P, X = P*N.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
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


def segsum(x_XT: Tensor) -> Tensor:
    """Stable segment sum: out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above the diagonal.

    Built from a masked cumsum instead of cumsum differences, so no catastrophic cancellation (ssd_minimal.segsum).
    """
    length = x_XT.shape[-1]
    x_XTT = x_XT[..., None].expand(*x_XT.shape, length)
    strict_lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x_XT.device), diagonal=-1)
    x_XTT = x_XTT.masked_fill(~strict_lower, 0)
    sums_XTT = torch.cumsum(x_XTT, dim=-2)
    lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x_XT.device), diagonal=0)
    return sums_XTT.masked_fill(~lower, float("-inf"))


def _intra_chunk_decay(A_BCQH: Tensor) -> Tensor:
    """exp(segsum(A)) per chunk and head, as cumsum differences taken in float64.

    Same values as ``exp(segsum(...))``: the fp32 cumsum difference loses digits when |cumsum| is large next to a
    short segment (measured 1.1e-4 vs the sequential recurrence at Q=64, against 2.6e-5 for segsum); in float64 the
    difference is exact to fp32 precision, and it avoids segsum's Q x Q cumsum and its flip-based backward.
    """
    cumsum_BCHQ = torch.cumsum(A_BCQH.double(), dim=2).transpose(2, 3)
    chunk = cumsum_BCHQ.shape[-1]
    # x + (-y) on the small vector rather than x - y on the Q x Q grid: the backward then skips a full-grid negate.
    diff_BCHQS = (cumsum_BCHQ[..., :, None] + (-cumsum_BCHQ)[..., None, :]).to(A_BCQH.dtype)
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=A_BCQH.device))
    return torch.exp(diff_BCHQS.masked_fill(~causal, float("-inf")))


def ssd_chunked(x_BLHP: Tensor, dt_BLH: Tensor, A_H: Tensor, B_BLN: Tensor, C_BLN: Tensor, chunk: int) -> Tensor:
    batch, seq_len, n_heads, head_dim = x_BLHP.shape
    if seq_len % chunk:
        raise ValueError(f"sequence length {seq_len} must be a multiple of the SSD chunk {chunk}")
    n_chunks, d_state = seq_len // chunk, B_BLN.shape[-1]
    # Stay in the input's (B, C, Q, H, P) layout: B and C are shared by all heads, so the state and output GEMMs
    # fold heads into the matrix width (H*P) instead of broadcasting B/C per head. Discretise as mamba_ssm's test
    # does: ssd_minimal(x * dt, A * dt, B, C).
    x_BCQHP = (x_BLHP * dt_BLH[..., None]).reshape(batch, n_chunks, chunk, n_heads, head_dim)
    A_BCQH = (dt_BLH * A_H).reshape(batch, n_chunks, chunk, n_heads)
    A_cumsum_BCQH = torch.cumsum(A_BCQH, dim=2)
    B_BCQN = B_BLN.reshape(batch, n_chunks, chunk, d_state)
    C_BCQN = C_BLN.reshape(batch, n_chunks, chunk, d_state)

    # 1. Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(segsum(A))[l, s] x_s, per head.
    decay_BCHQS = _intra_chunk_decay(A_BCQH)
    scores_BC1QS = (C_BCQN @ B_BCQN.transpose(-1, -2)).unsqueeze(2)
    y_diag_BCHQP = (decay_BCHQS * scores_BC1QS) @ x_BCQHP.transpose(2, 3)

    # 2. State at the end of each chunk from that chunk's inputs: sum_s exp(A_cs[-1] - A_cs[s]) x_s B_s^T.
    decay_states_BCQH = torch.exp(A_cumsum_BCQH[:, :, -1:] - A_cumsum_BCQH)
    x_decayed_BCQF = (x_BCQHP * decay_states_BCQH[..., None]).view(batch, n_chunks, chunk, n_heads * head_dim)
    states_BCFN = x_decayed_BCQF.transpose(-1, -2) @ B_BCQN

    # 3. Inter-chunk recurrence over chunk states, per head: a (C+1)^2 decay matrix, zero initial state in front.
    decay_chunk_BHZZ = torch.exp(segsum(F.pad(A_cumsum_BCQH[:, :, -1].transpose(1, 2), (1, 0))))
    states_BHZX = F.pad(states_BCFN.view(batch, n_chunks, n_heads, head_dim * d_state).transpose(1, 2), (0, 0, 1, 0))
    carried_BHCX = (decay_chunk_BHZZ @ states_BHZX)[:, :, :-1]
    carried_BCFN = carried_BHCX.transpose(1, 2).reshape(batch, n_chunks, n_heads * head_dim, d_state)

    # 4. State carried into each chunk, read out by C_l and decayed to position l; plus the diagonal part.
    y_off_BCQHP = (C_BCQN @ carried_BCFN.transpose(-1, -2)).view(batch, n_chunks, chunk, n_heads, head_dim)
    y_BCQHP = y_off_BCQHP * torch.exp(A_cumsum_BCQH)[..., None] + y_diag_BCHQP.transpose(2, 3)
    return y_BCQHP.reshape(batch, seq_len, n_heads, head_dim)


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
