"""MoE dispatch parity: jagged == dropless padded to fp32 rounding (fwd, bwd); padded drops counted; bf16 close.

Bit-identity is asserted only where it is structural (the same function on the same operands, integer counts,
gradients written as zeros). Paths that run different GEMM call shapes (a padded bmm against per-expert mm) agree
to rounding only: how BLAS blocks a reduction depends on the shape, the library build and the CPU vendor.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import (expert_capacity, expert_counts, expert_mlp, experts_expert_major, experts_grouped_gemm,
                         load_balance_loss, moe_dropless_padded_ref, moe_grouped_mm, moe_jagged, moe_jagged_loop,
                         moe_padded, route)

# (tokens, experts, top_k, d_model, d_expert, skew): skew biases the router towards expert 0 (ragged loads; with
# skew > 1 the last expert gets nothing).
SHAPES = [(64, 4, 2, 32, 16, 0.0), (97, 8, 2, 16, 8, 2.0), (96, 8, 2, 16, 8, 3.0), (33, 4, 3, 24, 16, 1.0),
          (40, 4, 2, 12, 6, 0.0)]  # the last is not 8-aligned: the CPU expert-major path takes any dims


def _inputs(tokens: int, experts: int, top_k: int, d_model: int, d_expert: int, skew: float,
            dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_model, generator=gen).to(dtype).requires_grad_(True)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += skew
    logits[:, -1] -= 10.0 * (skew > 1)  # starve the last expert entirely on heavily skewed shapes
    topv, topi, _ = route(logits, top_k)
    topv = topv.detach().requires_grad_(True)
    w13 = (0.2 * torch.randn(experts, d_model, 2 * d_expert, generator=gen)).to(dtype).requires_grad_(True)
    w2 = (0.2 * torch.randn(experts, d_expert, d_model, generator=gen)).to(dtype).requires_grad_(True)
    return x, topi, topv, w13, w2


# Relative to the tensor's largest magnitude: one fp32 GEMM rounding is ~1e-7 of it; a wrong row, weight or expert
# is O(1). bf16 keeps 8 bits, so one rounding flip of a differently blocked GEMM is ~4e-3.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    if not got.is_floating_point():
        assert torch.equal(got, ref), what  # integer counts: exact by construction
        return
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= REL_TOL[ref.dtype] * max(scale, 1e-12), f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def _fwd_bwd(fn, x, topi, topv, w13, w2, cf: float = 1.25) -> tuple[torch.Tensor, ...]:
    y, dropped = fn(x, topi, topv, w13, w2, cf)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    grads = torch.autograd.grad(y, [x, topv, w13, w2], gy)
    return (y, dropped) + grads


def _dense_oracle(x, topi, topv, w13, w2) -> torch.Tensor:
    """Per token, per choice: the literal definition, no sorting or padding."""
    hidden = w2.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topi.shape[1]):
            e = int(topi[t, j])
            h = x[t] @ w13[e]
            out[t] += topv[t, j] * ((F.silu(h[:hidden]) * h[hidden:]) @ w2[e])
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_jagged_matches_dropless_padded_fp32(shape: tuple) -> None:
    inputs = _inputs(*shape)
    loads = expert_counts(inputs[1], shape[1])
    assert loads.max() > 2 * loads.float().mean() or shape[5] < 2, "skewed shapes must be ragged"
    ref = _fwd_bwd(moe_dropless_padded_ref, *inputs)
    for fn in (moe_jagged, moe_jagged_loop):
        got = _fwd_bwd(fn, *inputs)
        for name, a, b in zip(("y", "dropped", "dx", "dtopv", "dw13", "dw2"), got, ref):
            _assert_close(a, b, f"{fn.__name__} {name} vs dropless padded")


@pytest.mark.parametrize("shape", SHAPES[:4])  # _grouped_mm needs 8-aligned dims (misaligned resolve to the loop)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_major_cpu_path_equals_grouped_gemm_path(shape: tuple, dtype: torch.dtype) -> None:
    # CUDA runs the stage-by-stage grouped GEMM, CPU the expert-major loop; on CPU both run, fwd and bwd, and agree
    # to rounding (aten's grouped-mm loop and elementwise ops over differently sliced tensors need not round alike),
    # empty experts included (zero weight gradients).
    x, topi, _, w13, w2 = _inputs(*shape, dtype=dtype)
    counts = expert_counts(topi, shape[1])
    xs = x.detach().index_select(0, torch.argsort(topi.reshape(-1), stable=True) // shape[2]).requires_grad_(True)
    gy = torch.randn(xs.shape[0], shape[3], generator=torch.Generator().manual_seed(5)).to(dtype)
    results = []
    for experts in (experts_grouped_gemm, experts_expert_major):
        y = experts(xs, w13, w2, counts)
        results.append((y, *torch.autograd.grad(y, [xs, w13, w2], gy)))
    for name, a, b in zip(("y", "dxs", "dw13", "dw2"), *results):
        _assert_close(b, a, f"{name}: expert-major vs grouped GEMM")
    if (counts == 0).any():
        # Exact: the expert-major backward writes an empty expert's weight gradient as zeros.
        assert torch.equal(results[1][2][counts == 0], torch.zeros_like(w13[counts == 0]))


def test_expert_mlp_custom_ops_pass_opcheck() -> None:
    # Schema, fake (meta) kernel, autograd registration and AOT tracing of the opaque CPU ops.
    x, topi, _, w13, w2 = _inputs(*SHAPES[1])
    counts = expert_counts(topi, SHAPES[1][1])
    xs = x.detach().index_select(0, torch.argsort(topi.reshape(-1), stable=True) // SHAPES[1][2]).requires_grad_(True)
    torch.library.opcheck(expert_mlp, (xs, w13, w2, torch.cumsum(counts, 0)))


def test_single_row_groups_within_rounding() -> None:
    inputs = _inputs(50, 8, 1, 8, 8, 4.0)
    assert 1 in expert_counts(inputs[1], 8).tolist(), "shape meant to produce 1-row expert groups"
    # A 1-row group is a BLAS gemv, not a gemm: another kernel, so agreement is to rounding.
    for name, a, b in zip(("y", "dropped", "dx", "dtopv", "dw13", "dw2"), _fwd_bwd(moe_jagged, *inputs),
                          _fwd_bwd(moe_dropless_padded_ref, *inputs)):
        _assert_close(a, b, name)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_dropless_reference_matches_dense_oracle(shape: tuple) -> None:
    x, topi, topv, w13, w2 = _inputs(*shape)
    y, dropped = moe_dropless_padded_ref(x, topi, topv, w13, w2)
    torch.testing.assert_close(y, _dense_oracle(x, topi, topv, w13, w2), rtol=1e-5, atol=1e-5)
    assert int(dropped) == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_padded_drops_are_counted_and_excluded(shape: tuple) -> None:
    x, topi, topv, w13, w2 = _inputs(*shape)
    tokens, experts, top_k = shape[0], shape[1], shape[2]
    cf = 0.75
    capacity = expert_capacity(tokens, top_k, experts, cf)
    y, dropped = moe_padded(x, topi, topv, w13, w2, cf)
    # Independent bookkeeping: experts keep their first `capacity` routed rows in (token, choice) order.
    seen = [0] * experts
    keep = torch.zeros_like(topv, dtype=torch.bool)
    for t in range(tokens):
        for j in range(top_k):
            e = int(topi[t, j])
            keep[t, j] = seen[e] < capacity
            seen[e] += 1
    expected_drops = sum(max(0, n - capacity) for n in seen)
    assert int(dropped) == expected_drops
    assert expected_drops > 0, "the test shape should overflow at cf 0.75"
    oracle = _dense_oracle(x, topi, topv * keep, w13, w2)
    torch.testing.assert_close(y, oracle, rtol=1e-5, atol=1e-5)


def test_padded_with_ample_capacity_equals_reference() -> None:
    inputs = _inputs(*SHAPES[1])
    ref = _fwd_bwd(moe_dropless_padded_ref, *inputs)
    got = _fwd_bwd(moe_padded, *inputs, cf=float(SHAPES[1][1]))  # capacity = every routed row
    assert int(got[1]) == 0
    for name, a, b in zip(("dx", "dtopv", "dw13", "dw2"), got[2:], ref[2:]):
        _assert_close(a, b, name)  # capacity differs from the reference's, so the bmm shapes do too


@pytest.mark.parametrize("fn", [moe_jagged, moe_grouped_mm, moe_padded])
def test_bf16_close_to_fp32_reference(fn) -> None:
    shape = (64, 4, 2, 32, 16, 1.0)
    ref = _fwd_bwd(moe_dropless_padded_ref, *_inputs(*shape))
    got = _fwd_bwd(fn, *_inputs(*shape, dtype=torch.bfloat16), cf=4.0)
    for a, b in zip(got[2:], ref[2:]):
        assert a.dtype in (torch.bfloat16, torch.float32)
        scale = b.abs().max().item()
        assert (a.float() - b).abs().max().item() <= 3e-2 * scale, "bf16 error beyond 3% of the value range"


def test_grouped_mm_backend_is_jagged_math_in_bf16() -> None:
    inputs = _inputs(*SHAPES[0], dtype=torch.bfloat16)
    for a, b in zip(_fwd_bwd(moe_grouped_mm, *inputs), _fwd_bwd(moe_jagged, *inputs)):
        assert torch.equal(a, b)  # exact by construction: both are _jagged with bf16 operands, the same calls


def test_static_counts_match_bincount_and_capacity_formula() -> None:
    _, topi, _, _, _ = _inputs(50, 8, 1, 8, 8, 4.0)
    counts = expert_counts(topi, 8)
    assert torch.equal(counts, torch.bincount(topi.reshape(-1), minlength=8))  # integers
    assert counts[-1] == 0, "ragged shape should starve the last expert"
    assert expert_capacity(4096, 2, 8, 1.25) == math.ceil(1.25 * 4096 * 2 / 8)


def test_load_balance_loss_is_one_when_uniform_and_grows_with_skew() -> None:
    experts = 4
    probs = torch.full((8, experts), 1.0 / experts)
    uniform = torch.full((experts,), 4)
    assert load_balance_loss(probs, uniform).item() == pytest.approx(1.0)
    skewed_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    skewed_counts = torch.tensor([13, 1, 1, 1])
    expected = experts * sum(c / 16 * p for c, p in zip([13, 1, 1, 1], [0.7, 0.1, 0.1, 0.1]))
    assert load_balance_loss(skewed_probs, skewed_counts).item() == pytest.approx(expected)
    assert expected > 1.0
