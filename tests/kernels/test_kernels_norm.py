"""add+RMSNorm: reference vs F.rms_norm, Inductor-compiled CPU path, and the Triton kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.capability import probe
from kernels.norm import add_rmsnorm_compiled, add_rmsnorm_ref

ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(shape))
    x, r = (torch.randn(shape, generator=gen).to(dtype).requires_grad_(True) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).requires_grad_(True)
    return [x, r, w]


def _run(fn, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    y, s = fn(*inputs, 1e-5)
    gen = torch.Generator().manual_seed(5)
    gy, gs = (torch.randn(y.shape, generator=gen).to(y.dtype) for _ in range(2))
    return (y, s) + torch.autograd.grad((y * gy).sum() + (s * gs).sum(), inputs)


def _assert_close(got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    for name, a, b in zip(("y", "s", "dx", "dr", "dw"), got, ref):
        assert a.dtype == b.dtype == dtype, name
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e}"


def test_reference_matches_torch_rms_norm() -> None:
    x, r, w = _inputs((4, 16), torch.float32)
    y, s = add_rmsnorm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, F.rms_norm(x + r, (16,), w, 1e-5))


@pytest.mark.skipif(not probe(torch.device("cpu")).cpp_compiler, reason="Inductor CPU needs a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_reference(dtype: torch.dtype) -> None:
    inputs = _inputs((6, 32), dtype)
    _assert_close(_run(add_rmsnorm_compiled, inputs), _run(add_rmsnorm_ref, inputs), dtype)


_TRITON_CHECK = textwrap.dedent("""
    import json, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    sys.path.insert(0, {root!r})
    from kernels.norm import add_rmsnorm_ref
    from kernels.triton_add_rmsnorm import add_rmsnorm_triton
    results = []
    # (x, residual, weight): the last is the model's own call under bf16 autocast (a bf16 block output added to
    # the fp32 residual stream, an fp32 norm weight): the stream must stay fp32, as the reference keeps it.
    f32, bf16 = torch.float32, torch.bfloat16
    for dtypes in ((f32, f32, f32), (bf16, bf16, bf16), (bf16, f32, f32)):
        for shape in ((5, 24), (2, 3, 40)):
            gen = torch.Generator().manual_seed(len(shape))
            x, r = (torch.randn(shape, generator=gen).to(dt).requires_grad_(True) for dt in dtypes[:2])
            w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtypes[2]).requires_grad_(True)
            gy, gs = (torch.randn(shape, generator=gen).to(torch.promote_types(*dtypes[:2])) for _ in range(2))
            outs = []
            for fn in (add_rmsnorm_triton, add_rmsnorm_ref):
                y, s = fn(x, r, w, 1e-5)
                outs.append((y, s) + torch.autograd.grad((y * gy).sum() + (s * gs).sum(), [x, r, w]))
            errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(*outs)]
            results.append({{"dtypes": [str(dt) for dt in dtypes], "shape": list(shape), "errors": errs,
                             "out_dtype": str(outs[1][1].dtype),
                             "dtypes_ok": all(a.dtype == b.dtype for a, b in zip(*outs))}})
    print(json.dumps(results))
""")


def test_triton_kernel_matches_reference_under_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRITON_CHECK.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 6
    for case in results:
        tol = TOL[torch.float32] if case["out_dtype"] == "torch.float32" else TOL[torch.bfloat16]
        assert case["dtypes_ok"], case
        assert max(case["errors"]) <= tol, case
