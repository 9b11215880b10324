"""minGRU recurrence for the R (recurrent tail) block: sequential reference and two parallel scans.

How to use::

    h_BLD = mingru_parallel(gate_BLD, cand_BLD)   # == mingru_sequential_ref(gate_BLD, cand_BLD) within 5e-4

Math (minGRU, arXiv 2410.01201; ``lucidrains/minGRU-pytorch``), zero initial state:
  z_t = sigmoid(gate_t),  h_t = (1 - z_t) * h_{t-1} + z_t * g(cand_t),  g(v) = v + 0.5 if v >= 0 else sigmoid(v)
a first-order linear recurrence h_t = a_t h_{t-1} + b_t with a_t = sigmoid(-gate_t) in (0, 1), b_t = z_t g(cand_t).

Backends (op ``recurrent_scan``; the feature ``recurrent_scan`` requests ``sequential`` or ``parallel``):
- ``sequential``: ``mingru_sequential_ref``, L dependent steps (the parity oracle).
- ``parallel``: ``mingru_parallel``, an associative scan in linear space: the pair (a, b) composes as
  (a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2), so odd positions are scanned recursively on the combined pairs and
  even positions filled in from them (odd-even / Ladner-Fischer, log2(L) levels, O(L) work). Every product is of
  factors in (0, 1) and every sum is of like-signed terms, so it is stable in fp32 without logs.
- ``heinsen``: ``mingru_heinsen``, the log-space Heinsen scan (h > 0 makes log h well defined):
  log h_t = a*_t + logcumsumexp_{s<=t}(log z_s + log g(cand_s) - a*_s),  a*_t = cumsum log(1 - z).
  Kept as the published reference for minGRU's parallel mode; measured on this project's 2-core CPU it is slower
  (``logcumsumexp`` and its two-pass backward cost ~35 ns per element) and less exact (2e-4 vs 5e-7 at L=1024) than
  the linear-space scan, which is why ``parallel`` resolves to the latter.

Shape suffix legend: B batch, L sequence, D channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.dispatch import Impl, OpSpec, always, register


def _g(v: Tensor) -> Tensor:
    return torch.where(v >= 0, v + 0.5, torch.sigmoid(v))


def _log_g(v: Tensor) -> Tensor:
    # relu guards the log on the branch torch.where discards (its gradient would be 0/0 at v = -0.5).
    return torch.where(v >= 0, torch.log(F.relu(v) + 0.5), F.logsigmoid(v))


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


def mingru_heinsen(gate_BLD: Tensor, cand_BLD: Tensor) -> Tensor:
    # Work in fp32: the log-space scan loses accuracy fast in bf16.
    gate = gate_BLD.float()
    log_coeffs_BLD = F.logsigmoid(-gate)  # log(1 - z)
    log_values_BLD = F.logsigmoid(gate) + _log_g(cand_BLD.float())  # log z + log g
    a_star_BLD = torch.cumsum(log_coeffs_BLD, dim=1)
    log_h_BLD = a_star_BLD + torch.logcumsumexp(log_values_BLD - a_star_BLD, dim=1)
    return torch.exp(log_h_BLD).to(gate_BLD.dtype)


register(OpSpec(
    name="recurrent_scan",
    ref=mingru_sequential_ref,
    impls={
        "sequential": Impl(mingru_sequential_ref, always("sequential minGRU loop, one step per position")),
        "parallel": Impl(mingru_parallel, always("odd-even associative scan in linear space (log2 L levels)")),
        "heinsen": Impl(mingru_heinsen, always("Heinsen log-space scan (cumsum + logcumsumexp)")),
    },
))
