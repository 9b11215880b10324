"""Chunked SSD vs the sequential recurrence (and a quadratic closed form); parallel minGRU scan vs its loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.dispatch import Dispatcher, get_op
from kernels.scan import linear_scan, mingru_parallel, mingru_sequential_ref
from kernels.ssd import causal_decay, ssd_chunked, ssd_sequential_ref


def _ssd_inputs(batch: int, seq_len: int, heads: int, head_dim: int, state: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seq_len * 31 + heads)
    x = torch.randn(batch, seq_len, heads, head_dim, generator=gen)
    dt = F.softplus(torch.randn(batch, seq_len, heads, generator=gen) - 1.0)
    A = -torch.exp(torch.rand(heads, generator=gen) * 2.0)
    B = torch.randn(batch, seq_len, state, generator=gen)
    C = torch.randn(batch, seq_len, state, generator=gen)
    return [t.to(dtype).requires_grad_(True) for t in (x, dt, A, B, C)]


def _grads(y: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
    return torch.autograd.grad(y, inputs, gy)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("shape,chunk", [((2, 64, 3, 8, 4), 16), ((1, 48, 2, 4, 8), 8), ((2, 32, 4, 8, 16), 32)])
def test_chunked_ssd_matches_sequential_fp32(shape: tuple, chunk: int) -> None:
    inputs = _ssd_inputs(*shape)
    y_ref = ssd_sequential_ref(*inputs)
    y = ssd_chunked(*inputs, chunk=chunk)
    assert (y - y_ref).abs().max().item() <= 1e-4
    for g, g_ref in zip(_grads(y, inputs), _grads(y_ref, inputs)):
        assert _rel_err(g, g_ref) <= 1e-4


def test_chunked_ssd_bf16_close_to_fp32_sequential() -> None:
    ref_inputs = _ssd_inputs(2, 32, 2, 8, 4)
    y_ref = ssd_sequential_ref(*ref_inputs)
    inputs = _ssd_inputs(2, 32, 2, 8, 4, dtype=torch.bfloat16)
    y = ssd_chunked(*inputs, chunk=16)
    assert y.dtype == torch.bfloat16
    assert _rel_err(y, y_ref) <= 3e-2
    for g, g_ref in zip(_grads(y, inputs), _grads(y_ref, ref_inputs)):
        assert _rel_err(g, g_ref) <= 5e-2


def test_sequential_ssd_matches_quadratic_closed_form() -> None:
    # Independent oracle (the SSD "attention" dual): y_t = sum_{s<=t} (C_t . B_s) exp(A sum_{s<r<=t} dt_r) dt_s x_s.
    x, dt, A, B, C = [t.detach().double() for t in _ssd_inputs(1, 6, 2, 3, 4)]
    y = torch.zeros_like(x)
    for t in range(6):
        for s in range(t + 1):
            decay = torch.exp(A * dt[0, s + 1:t + 1].sum(0))
            y[0, t] += ((C[0, t] @ B[0, s]) * decay * dt[0, s])[:, None] * x[0, s]
    torch.testing.assert_close(ssd_sequential_ref(x, dt, A, B, C), y, rtol=1e-10, atol=1e-10)


def test_causal_decay_is_masked_exp_of_differences() -> None:
    cs = torch.tensor([0.0, -0.5, -2.0], dtype=torch.float64)
    out = causal_decay(cs, torch.float32)
    assert out.dtype == torch.float32
    assert out[2, 0].item() == pytest.approx(torch.exp(torch.tensor(-2.0)).item())
    # Exact: exp(0) is 1 in IEEE arithmetic and the upper triangle is multiplied by a zero mask.
    assert out[1, 1].item() == 1.0 and out[0, 1].item() == 0.0 and out[0, 2].item() == 0.0


@pytest.mark.parametrize("shape,chunk", [((2, 16, 3, 4, 5), 4), ((1, 12, 2, 3, 2), 12), ((1, 12, 2, 3, 2), 3)])
def test_chunked_ssd_hand_written_backward_passes_gradcheck(shape: tuple, chunk: int) -> None:
    # float64 finite differences against the analytic backward, including one chunk (no inter-chunk scan) and many.
    inputs = [t.detach().double().requires_grad_(True) for t in _ssd_inputs(*shape)]
    assert torch.autograd.gradcheck(lambda *a: ssd_chunked(*a, chunk=chunk), inputs)


def test_chunked_ssd_under_autocast_and_mixed_dtypes() -> None:
    # The M block hands a bf16 x with an fp32 A under autocast: compute runs in fp32, grads come back per input dtype,
    # and the output has the sequential reference's dtype (fp32 here), so what follows the op runs alike in both arms.
    ref_inputs = _ssd_inputs(1, 32, 2, 8, 4)
    y_ref = ssd_sequential_ref(*ref_inputs)
    inputs = [t.detach().to(torch.bfloat16 if i == 0 else torch.float32).requires_grad_(True)
              for i, t in enumerate(ref_inputs)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ssd_chunked(*inputs, chunk=8)
        assert y.dtype == ssd_sequential_ref(*inputs).dtype == torch.float32
    assert _rel_err(y, y_ref) <= 3e-2
    grads = _grads(y, inputs)
    assert [g.dtype for g in grads] == [t.dtype for t in inputs]
    for g, g_ref in zip(grads, _grads(y_ref, ref_inputs)):
        assert _rel_err(g, g_ref) <= 5e-2


def test_chunked_ssd_takes_a_permuted_upstream_gradient() -> None:
    # A consumer that transposes heads hands back a non-contiguous gradient; the adjoint must not assume a layout.
    inputs = _ssd_inputs(2, 32, 3, 4, 5)
    weight = torch.randn(2, 3, 32, 4, generator=torch.Generator().manual_seed(9))
    grads = [torch.autograd.grad((fn(*inputs).transpose(1, 2) * weight).sum(), inputs)
             for fn in (lambda *a: ssd_chunked(*a, chunk=8), ssd_sequential_ref)]
    for g, g_ref in zip(*grads):
        assert _rel_err(g, g_ref) <= 1e-4


def test_chunked_ssd_backward_inside_autocast_stays_fp32() -> None:
    inputs = _ssd_inputs(1, 32, 2, 8, 4)
    y = ssd_chunked(*inputs, chunk=8)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    expected = torch.autograd.grad(y, inputs, gy, retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad(y, inputs, gy)
    for g, g_ref in zip(got, expected):
        assert _rel_err(g, g_ref) <= 1e-6


def test_chunked_ssd_refuses_double_backward_clearly() -> None:
    inputs = _ssd_inputs(1, 16, 1, 2, 2)
    y = ssd_chunked(*inputs, chunk=8)
    gy = torch.ones_like(y, requires_grad=True)  # a gradient penalty would differentiate through the backward
    (g_x, *_) = torch.autograd.grad(y, inputs, gy, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        g_x.sum().backward()


@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_chunked_ssd_gradients_stay_accurate_under_strong_decay(scale: float) -> None:
    # dt * 16: |dt * A| up to ~120 per step, in-chunk decays far below e^-80 (clamped before exp). dA sums suffix
    # sums of the cs gradient that cancel; accumulated in fp32 it was off by 1e-2 relative here (fp32 sequential:
    # 1e-7). Measured against the float64 recurrence.
    x, dt, A, B, C = _ssd_inputs(1, 64, 2, 4, 4)
    with torch.no_grad():
        dt.mul_(scale)
        A.mul_(2.0)
    cs = torch.cumsum((dt * A).detach()[0, :16, 0].double(), 0)
    assert scale == 1.0 or (cs[-1] - cs[0]).item() < -80, "the strong case must reach the clamped range"
    inputs = [x, dt, A, B, C]
    inputs64 = [t.detach().double().requires_grad_(True) for t in inputs]
    y, y64 = ssd_chunked(*inputs, chunk=16), ssd_sequential_ref(*inputs64)
    assert (y.double() - y64).abs().max().item() <= 1e-4
    for name, g, g64 in zip("x dt A B C".split(), _grads(y, inputs), _grads(y64, inputs64)):
        assert _rel_err(g, g64) <= 1e-5, f"d{name}"


def test_chunked_ssd_compiled_matches_eager_over_many_chunks() -> None:
    # The compiled trace takes the functional branches (slice assignment in the scans, no out= workspaces).
    inputs = _ssd_inputs(2, 40, 2, 4, 3)
    compiled = torch.compile(lambda *a: ssd_chunked(*a, chunk=8), backend="aot_eager", fullgraph=True)
    y, y_eager = compiled(*inputs), ssd_chunked(*inputs, chunk=8)
    torch.testing.assert_close(y, y_eager, rtol=1e-6, atol=1e-6)
    for g, g_eager in zip(_grads(y, inputs), _grads(y_eager, inputs)):
        torch.testing.assert_close(g, g_eager, rtol=1e-5, atol=1e-6)


def test_chunked_ssd_rejects_ragged_length() -> None:
    with pytest.raises(ValueError, match="multiple of the SSD chunk"):
        ssd_chunked(*_ssd_inputs(1, 20, 1, 2, 2), chunk=8)


def _scan_inputs(batch: int, seq_len: int, width: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seq_len + width)
    return [torch.randn(batch, seq_len, width, generator=gen).to(dtype).requires_grad_(True) for _ in range(2)]


@pytest.mark.parametrize("shape", [(2, 64, 16), (1, 257, 8), (3, 5, 4), (1, 1, 3)])
def test_parallel_scan_matches_sequential_fp32(shape: tuple) -> None:
    inputs = _scan_inputs(*shape)
    h_ref = mingru_sequential_ref(*inputs)
    h = mingru_parallel(*inputs)
    assert h.shape == h_ref.shape
    assert (h - h_ref).abs().max().item() <= 5e-4
    for g, g_ref in zip(_grads(h, inputs), _grads(h_ref, inputs)):
        assert _rel_err(g, g_ref) <= 5e-4


def test_parallel_scan_bf16_close_to_fp32_sequential() -> None:
    ref_inputs = _scan_inputs(2, 32, 8)
    h_ref = mingru_sequential_ref(*ref_inputs)
    inputs = _scan_inputs(2, 32, 8, dtype=torch.bfloat16)
    h = mingru_parallel(*inputs)
    assert h.dtype == torch.bfloat16
    assert _rel_err(h, h_ref) <= 2e-2
    for g, g_ref in zip(_grads(h, inputs), _grads(h_ref, ref_inputs)):
        assert _rel_err(g, g_ref) <= 5e-2


def test_linear_scan_handles_signed_inputs_and_odd_lengths() -> None:
    # Independent of minGRU: any a, b (signed b, as RG-LRU would need), lengths that are not powers of two.
    gen = torch.Generator().manual_seed(0)
    for seq_len in (1, 2, 7, 33):
        a, b = torch.rand(2, seq_len, 3, generator=gen), torch.randn(2, seq_len, 3, generator=gen)
        h, expected = torch.zeros(2, 3), []
        for t in range(seq_len):
            h = a[:, t] * h + b[:, t]
            expected.append(h)
        torch.testing.assert_close(linear_scan(a, b), torch.stack(expected, 1), rtol=1e-5, atol=1e-6)


def test_sequential_scan_is_the_mingru_recurrence() -> None:
    gate, cand = [t.detach() for t in _scan_inputs(1, 4, 3)]
    h = torch.zeros(3)
    for t in range(4):
        z = torch.sigmoid(gate[0, t])
        g = torch.where(cand[0, t] >= 0, cand[0, t] + 0.5, torch.sigmoid(cand[0, t]))
        h = (1 - z) * h + z * g
        torch.testing.assert_close(mingru_sequential_ref(gate, cand)[0, t], h)


@pytest.mark.parametrize("gate_offset", [0.0, 12.0, 20.0, -12.0])
def test_every_recurrent_scan_backend_holds_fp32_accuracy_at_saturated_gates(gate_offset: float) -> None:
    # +12 / +20: z within 6e-6 / 2e-9 of 1, the state forgets everything each step and the true gate gradient is
    # ~e^-gate; -12: z ~ 6e-6, the state barely moves. A log-space scan loses every digit here (measured 2e-2 gate
    # gradient error at +20, L=1024, where the float64 truth is 2e-7). The fp32 loop itself is ~5e-7 of the scale.
    gen = torch.Generator().manual_seed(1)
    gate, cand = torch.randn(1, 1024, 8, generator=gen) + gate_offset, torch.randn(1, 1024, 8, generator=gen)
    gy = torch.randn(1, 1024, 8, generator=gen)
    truth64 = [t.double().requires_grad_(True) for t in (gate, cand)]
    h64 = mingru_sequential_ref(*truth64)
    expected = (h64, *torch.autograd.grad(h64, truth64, gy.double()))
    for backend, impl in get_op("recurrent_scan").impls.items():
        inputs = [t.clone().requires_grad_(True) for t in (gate, cand)]
        h = impl.resolve_fn()(*inputs)
        got = (h, *torch.autograd.grad(h, inputs, gy))
        # One scale for all three: a tiny true gate gradient is only as exact as the values it is made from.
        scale = max(t.abs().max().item() for t in expected)
        for name, a, b in zip(("h", "dgate", "dcand"), got, expected):
            err = (a.double() - b).abs().max().item()
            assert err <= 1e-5 * scale, f"{backend} {name}: error {err:.2e} at gate offset {gate_offset}"


def test_heinsen_is_not_a_recurrent_scan_backend() -> None:
    # The log-space scan cannot hold fp32 accuracy at saturated gates (see kernels/scan.py), so it is not offered.
    with pytest.raises(ValueError, match="valid backends: \\['parallel', 'sequential'\\]"):
        Dispatcher(torch.device("cpu")).resolve("recurrent_scan", "heinsen")
