"""Dispatcher: requested vs observed with reasons, strict mode, forcing, JSON table; kernels imports no Triton."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.capability import probe
from kernels.dispatch import BackendMismatchError, Dispatcher, registered_ops
from kernels.moe import moe_jagged, moe_padded
from kernels.norm import add_rmsnorm_compiled, add_rmsnorm_ref

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def test_grouped_mm_on_cpu_falls_back_to_jagged_with_reason() -> None:
    d = Dispatcher(CPU)
    resolved = d.resolve("moe", "grouped_mm", dims=(64, 128, 256))
    assert resolved.record.observed == "jagged"
    assert resolved.fn is moe_jagged
    assert "SM90" in resolved.record.reason and "cpu" in resolved.record.reason
    assert d.fallbacks() == [resolved.record.as_dict()]


def test_strict_mode_raises_on_fallback_but_not_on_match() -> None:
    d = Dispatcher(CPU, strict=True)
    assert d.resolve("moe", "jagged", dims=(64, 128, 256)).record.observed == "jagged"
    with pytest.raises(BackendMismatchError, match="grouped_mm"):
        d.resolve("moe", "grouped_mm", dims=(64, 128, 256))
    # The refused resolution is still in the ledger, so a receipt can show why.
    assert any(r["requested"] == "grouped_mm" for r in d.table())


def test_misaligned_dims_fall_back_to_loop_where_grouped_gemm_runs() -> None:
    # Resolution logic for an A100-like device (no GPU here): _grouped_mm needs 16-byte aligned strides.
    d = Dispatcher(CPU)
    d.capability = dataclasses.replace(d.capability, device_type="cuda", cuda_available=True,
                                       cuda_capability=(8, 0), grouped_mm_fast_path=False)
    record = d.resolve("moe", "jagged", dims=(60, 128, 256)).record
    assert record.observed == "jagged_loop" and "multiples of 8" in record.reason


def test_cpu_jagged_is_expert_major_for_any_dims() -> None:
    # The CPU path is plain mm per expert: no alignment rule, so misaligned dims stay on jagged and say why.
    record = Dispatcher(CPU).resolve("moe", "jagged", dims=(60, 128, 256)).record
    assert record.observed == "jagged" and "expert-major" in record.reason


def test_gpu_only_backends_fall_back_on_cpu() -> None:
    d = Dispatcher(CPU)
    assert d.resolve("ssd", "mamba_ssm", conv_channels=64).record.observed == "chunked"
    norm = d.resolve("add_rmsnorm", "triton").record
    expected = "compiled" if probe(CPU).cpp_compiler else "eager"
    assert norm.observed == expected and "CUDA" in norm.reason


def test_unknown_backend_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid backends.*jagged"):
        Dispatcher(CPU).resolve("moe", "magic")
    with pytest.raises(ValueError, match="registered ops"):
        Dispatcher(CPU).resolve("nope", "x")


def test_force_pins_backend_and_says_so() -> None:
    d = Dispatcher(CPU)
    with d.forced("moe", "padded"):
        record = d.resolve("moe", "jagged", dims=(64, 128, 256))
    assert record.fn is moe_padded and record.record.observed == "padded" and "forced" in record.record.reason
    after = d.resolve("moe", "jagged", dims=(64, 128, 256))
    assert after.fn is moe_jagged and after.record.observed == "jagged", "the pin must end with the context"
    # Both were handed out, so both stay in the receipt's table.
    assert [row["observed"] for row in d.table()] == ["padded", "jagged"]


def test_forced_context_restores_an_outer_pin() -> None:
    d = Dispatcher(CPU)
    d.force("moe", "padded")
    with d.forced("moe", "jagged_loop"):
        assert d.resolve("moe", "jagged", dims=(64, 128, 256)).record.observed == "jagged_loop"
    assert d.resolve("moe", "jagged", dims=(64, 128, 256)).record.observed == "padded"


def test_strict_raises_on_every_resolution_that_falls_back() -> None:
    d = Dispatcher(CPU, strict=True)
    for _ in range(3):
        with pytest.raises(BackendMismatchError, match="grouped_mm"):
            d.resolve("moe", "grouped_mm", dims=(64, 128, 256))
    assert len(d.table()) == 1, "the refused row is recorded once"


def test_resolution_is_cached_per_context_not_reused_across_dims() -> None:
    # Eligibility of jagged on a CUDA device without CUTLASS depends on dims (16-byte aligned strides).
    d = Dispatcher(CPU)
    d.capability = dataclasses.replace(d.capability, device_type="cuda", cuda_available=True,
                                       cuda_capability=(8, 0), grouped_mm_fast_path=False)
    assert d.resolve("moe", "jagged", dims=(64, 128, 256)).record.observed == "jagged"
    assert d.resolve("moe", "jagged", dims=(60, 128, 256)).record.observed == "jagged_loop"
    assert d.resolve("moe", "jagged", dims=[64, 128, 256]).record.observed == "jagged", "a list is the same context"
    assert d.resolve("moe", "jagged", dims=(64, 128, 256)) is d.resolve("moe", "jagged", dims=(64, 128, 256))
    assert sorted(row["observed"] for row in d.table()) == ["jagged", "jagged_loop"]
    fresh = Dispatcher(CPU)
    fresh.capability = d.capability
    assert fresh.resolve("moe", "jagged", dims=(60, 128, 256)).record.observed == "jagged_loop"
    assert fresh.resolve("moe", "jagged", dims=(64, 128, 256)).record.observed == "jagged"


@pytest.mark.parametrize("posture", ["regional", "whole"])
def test_compiled_norm_inside_a_compiled_posture_is_recorded_and_run_as_eager(posture: str) -> None:
    # add_rmsnorm_compiled returns the reference while Dynamo traces it: inside compiled blocks it is the baseline.
    for requested in ("compiled", "triton"):
        resolved = Dispatcher(CPU, compile_posture=posture).resolve("add_rmsnorm", requested)
        assert resolved.record.observed == "eager" and resolved.fn is add_rmsnorm_ref
        assert "enclosing graph already fuses add + RMSNorm" in resolved.record.reason
        assert posture in resolved.record.reason


@pytest.mark.skipif(not probe(CPU).cpp_compiler, reason="Inductor CPU needs a C++ compiler")
def test_compiled_norm_in_eager_posture_runs_compiled() -> None:
    for d in (Dispatcher(CPU), Dispatcher(CPU, compile_posture="eager")):
        resolved = d.resolve("add_rmsnorm", "compiled")
        assert resolved.record.observed == "compiled" and resolved.fn is add_rmsnorm_compiled


def test_compile_posture_changes_nothing_else() -> None:
    # The audit: no other backend defers to another one under compile, so a compiling posture records the same rows.
    requests = [("moe", "jagged", {"dims": (64, 128, 256)}), ("moe", "padded", {}), ("ssd", "chunked", {}),
                ("ssd", "mamba_ssm", {"conv_channels": 64}), ("mla_ingress", "fused", {}),
                ("recurrent_scan", "parallel", {}), ("add_rmsnorm", "eager", {})]
    eager, regional = Dispatcher(CPU), Dispatcher(CPU, compile_posture="regional")
    for op, backend, ctx in requests:
        assert regional.resolve(op, backend, **ctx).record == eager.resolve(op, backend, **ctx).record, op


def test_unknown_compile_posture_lists_allowed() -> None:
    with pytest.raises(ValueError, match="compile_posture.*'full'.*eager, regional, whole"):
        Dispatcher(CPU, compile_posture="full")


def test_resolves_once_and_table_is_json() -> None:
    d = Dispatcher(CPU)
    first = d.resolve("recurrent_scan", "parallel")
    assert d.resolve("recurrent_scan", "parallel") is first
    d.resolve("mla_ingress", "fused")
    table = d.table()
    assert [row["op"] for row in table] == ["mla_ingress", "recurrent_scan"]
    assert json.loads(json.dumps(table)) == table
    assert set(table[0]) == {"op", "requested", "observed", "reason"}
    assert d.fallbacks() == []
    json.dumps(probe(CPU).as_dict())


def test_every_op_registered_with_a_reference() -> None:
    assert registered_ops() == ["add_rmsnorm", "mla_ingress", "moe", "recurrent_scan", "ssd"]


def test_importing_kernels_does_not_import_triton() -> None:
    code = ("import sys; sys.path.insert(0, %r); import kernels, kernels.dispatch; "
            "from kernels.dispatch import Dispatcher; import torch; "
            "Dispatcher(torch.device('cpu')).resolve('add_rmsnorm', 'triton'); "
            "print('triton' in sys.modules, 'mamba_ssm' in sys.modules)") % str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_the_torch_free_traced_table_is_the_registry_s() -> None:
    # The receipt writer and promote read ablate.config.backends.TRACED_AS without importing torch.
    from ablate.config.backends import TRACED_AS, fell_back
    from kernels.dispatch import get_op

    registry = {(op, name): impl.traced_as[0] for op in registered_ops()
                for name, impl in get_op(op).impls.items() if impl.traced_as is not None}
    assert TRACED_AS == registry and registry
    (op, backend), traced = next(iter(registry.items()))
    assert not fell_back(op, backend, traced, "regional") and not fell_back(op, backend, traced, "whole")
    assert fell_back(op, backend, traced, "eager"), "without a compiled region it is a real fallback"
    assert fell_back("moe", "grouped_mm", "jagged", "regional")
