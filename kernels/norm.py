"""Residual add + RMSNorm: the pre-norm step of every layer, as one op with a reference twin.

How to use::

    y_TD, s_TD = add_rmsnorm(x_TD, residual_TD, weight_D, eps)   # s = x + residual, y = rmsnorm(s) * weight

Backends (op ``add_rmsnorm``; the feature ``fused_residual`` requests ``eager`` when off, and ``triton`` on CUDA or
``compiled`` on CPU when on):
- ``eager``: ``add_rmsnorm_ref``, separate add, square-mean, rsqrt, scale (HF/Llama convention: normalise in fp32,
  cast back, then multiply by the weight).
- ``compiled``: the same function through Inductor, which fuses add + reduction + scale into one pass (and its
  backward); needs a C++ compiler on CPU. Inside an already compiled region it is the reference itself, because the
  enclosing graph fuses it anyway and a nested compile would only add a guard; so a dispatcher whose compile
  posture is regional or whole records it as ``eager`` and hands out the reference (``fused_residual: on`` is then
  the baseline's code: inert, and the receipt says so instead of claiming ``compiled``).
- ``triton``: ``kernels.triton_add_rmsnorm`` (a ``torch.library.custom_op`` with fake and autograd), CUDA only;
  imported lazily so CPU never imports Triton. Tested on CPU under ``TRITON_INTERPRET=1``.

Shape suffix legend: T rows (any leading dims flattened), D normalised width.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from kernels.capability import Capability
from kernels.dispatch import Impl, OpSpec, always, register


def rmsnorm_ref(x_TD: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    xf = x_TD.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x_TD.dtype) * weight_D.to(x_TD.dtype)


def add_rmsnorm_ref(x_TD: Tensor, residual_TD: Tensor, weight_D: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual)."""
    s_TD = x_TD + residual_TD
    return rmsnorm_ref(s_TD, weight_D, eps), s_TD


_compiled_fn: Optional[Callable[..., tuple[Tensor, Tensor]]] = None


def add_rmsnorm_compiled(x_TD: Tensor, residual_TD: Tensor, weight_D: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if torch.compiler.is_compiling():
        return add_rmsnorm_ref(x_TD, residual_TD, weight_D, eps)
    global _compiled_fn
    if _compiled_fn is None:
        _compiled_fn = torch.compile(add_rmsnorm_ref, fullgraph=True)
    return _compiled_fn(x_TD, residual_TD, weight_D, eps)


def _load_triton() -> Callable[..., tuple[Tensor, Tensor]]:
    return importlib.import_module("kernels.triton_add_rmsnorm").add_rmsnorm_triton


def _eligible_compiled(cap: Capability, ctx: Mapping[str, Any]) -> tuple[bool, str]:
    if cap.device_type == "cuda":
        if cap.triton_importable:
            return True, "Inductor-generated Triton kernel for add + RMSNorm (fwd and bwd)"
        return False, "Inductor on CUDA needs Triton, which is not importable"
    if not cap.cpp_compiler:
        return False, "Inductor on CPU needs a C++ compiler (none of $CXX, g++, clang++, c++ found)"
    return True, "Inductor C++ kernel fusing add + RMSNorm (fwd and bwd)"


def _eligible_triton(cap: Capability, ctx: Mapping[str, Any]) -> tuple[bool, str]:
    if not cap.cuda_available:
        return False, "hand-written Triton kernel runs on CUDA only"
    if not cap.triton_importable:
        return False, "triton is not importable"
    return True, "hand-written Triton add + RMSNorm kernel (torch.library custom op)"


register(OpSpec(
    name="add_rmsnorm",
    ref=add_rmsnorm_ref,
    impls={
        "eager": Impl(add_rmsnorm_ref, always("separate add and RMSNorm ops (eager reference)")),
        "compiled": Impl(add_rmsnorm_compiled, _eligible_compiled, fallback="eager", traced_as=(
            "eager", "inside a compiled region the enclosing graph already fuses add + RMSNorm; the op runs as its "
                     "reference")),
        "triton": Impl(None, _eligible_triton, fallback="compiled", load=_load_triton),
    },
))
