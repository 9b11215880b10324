"""`ablate doctor --deep` on CPU: every backend against its twin, CUDA-only ones named, a broken one fails the node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ablate.deep_check import check_backends, check_families, resolve_device
from kernels.dispatch import Impl, OpSpec, always, get_op, register, registered_ops
from kernels.examples import EXAMPLES

REPO = Path(__file__).resolve().parents[1]
CUDA_ONLY = {("moe", "grouped_mm"), ("ssd", "mamba_ssm"), ("add_rmsnorm", "triton")}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "PYTHONPATH": str(REPO), "COLUMNS": "240", **extra}


@pytest.fixture(scope="module")
def cpu_rows() -> list:
    return check_backends(torch.device("cpu"), sizes=("small",), dtypes=("fp32", "bf16"), repeats=1)


def test_every_registered_backend_gets_a_row(cpu_rows: list) -> None:
    assert set(registered_ops()) <= set(EXAMPLES), "every registered op needs example inputs for the node check"
    expected = {(op, backend) for op in registered_ops() for backend in get_op(op).impls}
    assert {(r.op, r.backend) for r in cpu_rows} == expected


def test_cpu_backends_equal_their_twins_forward_and_backward(cpu_rows: list) -> None:
    ran = [r for r in cpu_rows if (r.op, r.backend) not in CUDA_ONLY]
    assert ran and all(r.status == "ok" for r in ran), [(r.op, r.backend, r.status, r.parity) for r in ran]
    for row in ran:
        assert {(p.dtype, p.size) for p in row.parity} == {("fp32", "small"), ("bf16", "small")}
        assert all(p.rel_error is not None and p.rel_error <= p.tolerance for p in row.parity), row


def test_cuda_only_backends_are_unavailable_with_the_dispatchers_reason(cpu_rows: list) -> None:
    for row in (r for r in cpu_rows if (r.op, r.backend) in CUDA_ONLY):
        assert row.status == "unavailable" and row.parity == [], row
        assert row.observed != row.backend and "not eligible on cpu" in row.reason, row


_BROKEN = textwrap.dedent("""
    import sys
    from kernels.dispatch import Impl, OpSpec, always, get_op, register
    spec = get_op("recurrent_scan")
    # Off by 2% everywhere: the kind of silent kernel bug a node check must stop.
    broken = Impl(lambda gate, cand: spec.ref(gate, cand) * 1.02, always("deliberately broken (test)"))
    register(OpSpec(spec.name, spec.ref, {**spec.impls, "broken": broken}))
    from ablate.cli import main
    sys.argv = ["ablate", "doctor", "--deep", "--device", "cpu", "--op", "recurrent_scan", "--sizes", "small",
                "--dtypes", "fp32", "--families", "", "--json", sys.argv[1]]
    main()
""")


def test_a_broken_backend_fails_the_check_and_the_command_exits_nonzero(tmp_path: Path) -> None:
    spec = get_op("recurrent_scan")
    register(OpSpec(spec.name, spec.ref, {
        **spec.impls,
        "broken": Impl(lambda g, c: spec.ref(g, c) * 1.02, always("deliberately broken (test)")),
        # NaN compares false with everything: a max over errors would drop it and pass the backend.
        "nan": Impl(lambda g, c: spec.ref(g, c) * torch.where(g > 2.0, float("nan"), 1.0), always("NaN (test)")),
    }))
    try:
        rows = check_backends(torch.device("cpu"), ops=["recurrent_scan"], sizes=("small",), dtypes=("fp32",))
    finally:
        register(spec)
    by_backend = {r.backend: r for r in rows}
    broken, nan = by_backend["broken"], by_backend["nan"]
    assert broken.status == "wrong" and broken.parity[0].rel_error == pytest.approx(0.02, rel=0.05)
    assert nan.status == "wrong" and nan.parity[0].rel_error is None and "NaN" in nan.parity[0].error
    assert all(r.status == "ok" for r in rows if r.backend not in ("broken", "nan"))

    out = tmp_path / "deep.json"
    proc = subprocess.run([sys.executable, "-c", _BROKEN, str(out)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fails its reference twin" in proc.stderr
    document = json.loads(out.read_text())
    assert document["ok"] is False
    assert {r["backend"]: r["status"] for r in document["backends"]} == \
        {"sequential": "ok", "parallel": "ok", "broken": "wrong"}
    # The node's collective backend was measured too: gloo between two fresh CPU processes.
    comm = document["comm"]
    assert (comm["backend"], comm["ranks"], comm["why"]) == ("gloo", 2, "")
    assert [r["size_mb"] for r in comm["rows"]] == [1, 16, 64] and all(r["busbw_gbps"] > 0 for r in comm["rows"])
    assert "all-reduce, gloo over 2 ranks" in proc.stdout


def test_triton_kernel_runs_in_the_interpreter_on_cpu_and_the_json_says_so(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "deep.json"
    proc = subprocess.run([sys.executable, "-m", "ablate", "doctor", "--deep", "--device", "cpu", "--op", "add_rmsnorm",
                           "--sizes", "small", "--dtypes", "fp32,bf16", "--families", "", "--no-comm", "--json", str(out)],
                          cwd=tmp_path, env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    document = json.loads(out.read_text())
    rows = {r["backend"]: r for r in document["backends"]}
    assert rows["triton"]["status"] == "interpreted" and rows["triton"]["observed"] == "triton"
    assert [p["ok"] for p in rows["triton"]["parity"]] == [True, True]
    assert rows["triton"]["speedup"] is None, "interpreter speed means nothing: never reported"
    assert document["ok"] is True and document["nvml"]["available"] is False and document["comm"] == {}
    assert "interpreted" in proc.stdout and "backends on cpu" in proc.stdout


def test_each_family_block_compiles_fullgraph_and_matches_eager() -> None:
    rows = check_families(torch.device("cpu"), "AEMR", backend="aot_eager")
    assert [r.family for r in rows] == list("AEMR")
    for row in rows:
        assert row.ok and row.graph_breaks == 0 and row.graphs == 1, row
        assert row.rel_error is not None and row.rel_error <= 1e-4


def test_cuda_on_a_node_without_one_is_refused_by_name() -> None:
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            resolve_device("cuda")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="allowed: cpu, cuda, auto"):
        resolve_device("tpu")


def test_a_collective_that_cannot_run_fails_the_node() -> None:
    from ablate.comm_check import allreduce_bandwidth
    from ablate.deep_check import DeepReport

    broken = allreduce_bandwidth(torch.device("cpu"), sizes_mb=(1,), repeats=0)  # no timing to take: ranks raise
    assert broken["rows"] == [] and broken["why"] and broken["ranks"] == 2
    report = DeepReport("cpu", "x", torch.__version__, 1, "", [], [], {}, broken)
    assert report.ok is False and report.comm_ok is False
    one_gpu = {"backend": "nccl", "ranks": 1, "rows": [], "why": "1 GPU on this node: ..."}
    assert DeepReport("cuda:0", "x", torch.__version__, 1, "", [], [], {}, one_gpu).ok is True
