"""minGRU recurrence for the R (recurrent tail) block: sequential reference and a parallel linear-space scan.

How to use::

    h_BLD = mingru_parallel(gate_BLD, cand_BLD)   # == mingru_sequential_ref(gate_BLD, cand_BLD) to fp32 rounding

Math (minGRU, arXiv 2410.01201; ``lucidrains/minGRU-pytorch``), zero initial state:
  z_t = sigmoid(gate_t),  h_t = (1 - z_t) * h_{t-1} + z_t * g(cand_t),  g(v) = v + 0.5 if v >= 0 else sigmoid(v)
a first-order linear recurrence h_t = a_t h_{t-1} + b_t with a_t = sigmoid(-gate_t) in (0, 1), b_t = z_t g(cand_t).

Backends (op ``recurrent_scan``; the feature ``recurrent_scan`` requests ``sequential`` or ``parallel``):
- ``sequential``: ``mingru_sequential_ref``, L dependent steps (the parity oracle).
- ``parallel``: ``mingru_parallel``, an associative scan in linear space: the pair (a, b) composes as
  (a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2), so odd positions are scanned recursively on the combined pairs and
  even positions filled in from them (odd-even / Ladner-Fischer, log2(L) levels, O(L) work). Every product is of
  factors in (0, 1) and every sum is of like-signed terms, so it is stable in fp32 without logs, saturated gates
  included (measured against the float64 recurrence at L=1024: the same ~5e-7 as the fp32 loop).

No log-space (Heinsen) backend: log h_t = a*_t + logcumsumexp(log b_s - a*_s) with a*_t = cumsum log(1 - z) takes
the difference of two numbers that grow with t. At saturated gates (z -> 1, a* ~ -gate * t) fp32 keeps no digits of
it: measured at L=1024 the gate gradient was off by 2e-2 where the float64 truth is 2e-7 (h off by 4e-3), and by
1e-3 even at ordinary gates; it was also slower than the linear-space scan on the 2-core CPU. Making it stable
needs a chunked carry and a hand-written backward, i.e. the linear-space scan again, so it was removed.

Shape suffix legend: B batch, L sequence, D channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.dispatch import Impl, OpSpec, always, register


def _g(v: Tensor) -> Tensor:
    return torch.where(v >= 0, v + 0.5, torch.sigmoid(v))


def mingru_sequential_ref(gate_BLD: Tensor, cand_BLD: Tensor) -> Tensor:
    z_BLD = torch.sigmoid(gate_BLD)
    g_BLD = _g(cand_BLD)
    h_BD = gate_BLD.new_zeros(gate_BLD.shape[0], gate_BLD.shape[2])
    hs = []
    for t in range(gate_BLD.shape[1]):
        h_BD = torch.lerp(h_BD, g_BLD[:, t], z_BLD[:, t])  # (1 - z) * h + z * g
        hs.append(h_BD)
    return torch.stack(hs, dim=1)


def linear_scan(a_BLD: Tensor, b_BLD: Tensor) -> Tensor:
    """h_t = a_t * h_{t-1} + b_t along dim 1 with h_{-1} = 0, by recursive odd-even reduction."""
    seq_len = a_BLD.shape[1]
    if seq_len == 1:
        return b_BLD
    if seq_len % 2:
        # Identity step (a=1, b=0) at the end makes the length even without changing earlier outputs.
        a_BLD = F.pad(a_BLD, (0, 0, 0, 1), value=1.0)
        b_BLD = F.pad(b_BLD, (0, 0, 0, 1))
    a_even, a_odd = a_BLD[:, 0::2], a_BLD[:, 1::2]
    b_even, b_odd = b_BLD[:, 0::2], b_BLD[:, 1::2]
    # Odd position 2j+1 after composing steps 2j and 2j+1: one recursive scan of half the length.
    h_odd = linear_scan(a_odd * a_even, torch.addcmul(b_odd, a_odd, b_even))
    # Even position 2j = one step from the odd position before it (nothing before position 0).
    h_even_rest = torch.addcmul(b_even[:, 1:], a_even[:, 1:], h_odd[:, :-1])
    h_even = torch.cat([b_even[:, :1], h_even_rest], dim=1)
    return torch.stack([h_even, h_odd], dim=2).flatten(1, 2)[:, :seq_len]


def mingru_parallel(gate_BLD: Tensor, cand_BLD: Tensor) -> Tensor:
    gate = gate_BLD.float()
    z = torch.sigmoid(gate)
    # sigmoid(-gate), not 1 - z: exact when z is within rounding of 1 (a gate that forgets everything).
    return linear_scan(torch.sigmoid(-gate), z * _g(cand_BLD.float())).to(gate_BLD.dtype)


register(OpSpec(
    name="recurrent_scan",
    ref=mingru_sequential_ref,
    impls={
        "sequential": Impl(mingru_sequential_ref, always("sequential minGRU loop, one step per position")),
        "parallel": Impl(mingru_parallel, always("odd-even associative scan in linear space (log2 L levels)")),
    },
))
