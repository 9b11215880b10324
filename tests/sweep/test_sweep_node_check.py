"""The sweep holds the campaign's lanes against each node's deep-check document before any block runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ablate.config.schema import ConfigError, LaneConfig, NodeCheckConfig
from ablate.deep_check import run_deep
from ablate.sweep.node_check import (ENV, NodeCheckRefused, Request, assess, lane_requests, read_document,
                                     read_node_checks, _pinned, _remote_reader)
from kernels.dispatch import Impl, OpSpec, always, get_op, register
from sweeps_common import fresh_mlflow_uri, tiny_smoke


def _document(tmp_path: Path, broken: bool) -> Path:
    """A real deep-check document of this node for the recurrent scan, with ``parallel`` broken on request."""
    spec = get_op("recurrent_scan")
    if broken:
        parallel = spec.impls["parallel"]
        # Off by 2%: a silent kernel bug of the kind the node check exists for.
        register(OpSpec(spec.name, spec.ref, {**spec.impls, "parallel": replace(
            parallel, fn=lambda g, c: spec.ref(g, c) * 1.02, load=None, eligible=always("broken (test)"))}))
    try:
        report = run_deep(torch.device("cpu"), ops=["recurrent_scan"], sizes=("small",), dtypes=("fp32",),
                          families="", repeats=1)
    finally:
        register(spec)
    path = tmp_path / ("broken.json" if broken else "good.json")
    path.write_text(json.dumps(report.as_dict()))
    return path


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("node-check")
    return {"broken": _document(tmp, True), "good": _document(tmp, False)}


def _lane(**features: str) -> LaneConfig:
    lane = LaneConfig()
    return replace(lane, model=replace(lane.model, pattern="AEMR"),
                   features=replace(lane.features, **{k: type(getattr(lane.features, k))(v)
                                                      for k, v in features.items()}))


def _findings(path: Path, lanes: list[LaneConfig], config: NodeCheckConfig = NodeCheckConfig()) -> list:
    doc = read_document(str(path), "node-a", "node-a", has_gpu=False)
    return assess(lambda has_gpu: lane_requests(lanes, has_gpu), [doc], config)


def test_a_wrong_backend_refuses_and_the_allowance_does_not_cover_it(documents: dict[str, Path]) -> None:
    lanes = [_lane(recurrent_scan="sequential"), _lane(recurrent_scan="parallel")]
    for config in (NodeCheckConfig(), NodeCheckConfig(allow_fallback=["recurrent_scan"])):
        refusing = [f for f in _findings(documents["broken"], lanes, config) if f.refuses]
        assert [(f.status, f.request.backend) for f in refusing] == [("wrong", "parallel")]
        assert "fails its reference twin" in refusing[0].reason and "fp32 small" in refusing[0].reason
    # The same lanes against the healthy document: only ops the narrowed run did not check, and those only warn.
    findings = _findings(documents["good"], lanes)
    assert findings and all(f.status == "unchecked" and not f.refuses for f in findings)
    assert {f.request.op for f in findings} == {"add_rmsnorm", "mla_ingress", "moe", "ssd"}


def test_an_absent_backend_refuses_unless_the_campaign_allows_its_fallback(tmp_path: Path) -> None:
    report = run_deep(torch.device("cpu"), ops=["moe"], sizes=("small",), dtypes=("fp32",), families="", repeats=1)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(report.as_dict()))
    lanes = [_lane(moe_dispatch="grouped_mm")]  # CUDA-only: on a CPU node the arm would run the fallback
    refusing = [f for f in _findings(path, lanes) if f.refuses]
    assert [(f.status, f.request.backend) for f in refusing] == [("unavailable", "grouped_mm")]
    assert "allow_fallback: [moe_dispatch]" in refusing[0].reason
    allowed = [f for f in _findings(path, lanes, NodeCheckConfig(allow_fallback=["moe_dispatch"]))
               if f.request is not None and f.request.op == "moe"]
    assert [(f.status, f.refuses) for f in allowed] == [("unavailable", False)]


def test_a_missing_stale_or_foreign_document_warns_or_refuses_when_required(tmp_path: Path,
                                                                              documents: dict[str, Path]) -> None:
    lanes = [_lane()]
    missing = _findings(tmp_path / "none.json", lanes)
    assert [(f.status, f.refuses) for f in missing] == [("no-document", False)]
    assert "ablate doctor --deep --json" in missing[0].reason
    assert [f.refuses for f in _findings(tmp_path / "none.json", lanes, NodeCheckConfig(required=True))] == [True]

    data = json.loads(documents["good"].read_text())
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({**data, "torch_version": "1.0.0"}))
    (finding,) = _findings(stale, lanes)
    assert finding.status == "no-document" and "torch 1.0.0" in finding.reason

    foreign = tmp_path / "cuda.json"  # checked on CUDA; this CPU lane's backends were never checked on its device
    foreign.write_text(json.dumps({**data, "device": "cuda:0"}))
    (finding,) = _findings(foreign, lanes)
    assert finding.status == "no-document" and "checked device cuda" in finding.reason

    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    (finding,) = _findings(garbage, lanes)
    assert finding.status == "no-document" and "not a node check document" in finding.reason


def test_allow_fallback_names_only_kernel_features() -> None:
    with pytest.raises(ConfigError) as err:
        NodeCheckConfig(allow_fallback=["stp"])
    assert "node_check.allow_fallback" in str(err.value) and "'stp'" in str(err.value)
    assert "moe_dispatch" in str(err.value)


def test_a_remote_node_reads_its_own_document_through_a_pinned_task(ray_address: str,
                                                                    documents: dict[str, Path]) -> None:
    import ray

    here = ray.get_runtime_context().get_node_id()
    remote = ray.get(_remote_reader().options(scheduling_strategy=_pinned(here))
                     .remote(str(documents["broken"]), here, "node-a", False))
    local = read_document(str(documents["broken"]), here, "node-a", False)
    assert remote.sha256 == local.sha256 and remote.document == local.document and remote.why == ""
    (doc,) = read_node_checks(str(documents["broken"]))
    assert doc.node_id == here and doc.sha256 == local.sha256


def test_a_sweep_requesting_a_broken_backend_refuses_before_any_block(
        ray_address: str, tmp_path: Path, documents: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    from ablate.sweep.run import run_sweep

    uri = fresh_mlflow_uri(tmp_path)
    monkeypatch.setenv(ENV, str(documents["broken"]))
    campaign = tiny_smoke(tmp_path / "c", features={"recurrent_scan": ["parallel"]})
    with pytest.raises(NodeCheckRefused) as err:
        run_sweep(campaign, tracking_uri=uri, storage=str(tmp_path / "runs"), progress=False)
    message = str(err.value)
    assert "refused before any block" in message and "recurrent_scan -> recurrent_scan/parallel on cpu" in message
    assert "wrong" in message
    assert MlflowClient(uri).search_experiments(filter_string="name = 'ablate'") == [], "nothing was logged"
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "receipt" in p.name], "no arm ran"

    # A lane that does not request the broken backend passes the same document: the healthy sequential scan is
    # checked, the ops the narrowed run left out only warn.
    requests = lane_requests([_lane(mamba_scan="chunked")], has_gpu=False)
    assert Request("cpu", "recurrent_scan", "recurrent_scan", "sequential") in requests
    findings = assess(lambda g: requests, read_node_checks(str(documents["broken"])), NodeCheckConfig())
    assert findings and not any(f.refuses for f in findings)


def test_a_device_the_document_did_not_check_is_reported(tmp_path: Path, documents: dict[str, Path]) -> None:
    # A GPU node whose document checked CUDA only, running a CPU lane and an auto (CUDA there) lane.
    data = json.loads(documents["good"].read_text())
    gpu_doc = tmp_path / "gpu.json"
    gpu_doc.write_text(json.dumps({**data, "device": "cuda:0"}))
    cpu_lane = _lane()
    cpu_lane = replace(cpu_lane, hardware=replace(cpu_lane.hardware, device=type(cpu_lane.hardware.device)("cpu")))
    doc = read_document(str(gpu_doc), "node-g", "node-g", has_gpu=True)
    for required in (False, True):
        findings = assess(lambda has_gpu: lane_requests([cpu_lane, _lane()], has_gpu), [doc],
                          NodeCheckConfig(required=required))
        missing = [f for f in findings if f.status == "no-document"]
        assert len(missing) == 1 and "the lane runs on cpu here" in missing[0].reason
        assert missing[0].refuses is required


def test_an_arm_that_ran_a_backend_its_node_found_wrong_is_disqualified(tmp_path: Path,
                                                                          documents: dict[str, Path]) -> None:
    """The sweep refuses such a lane up front; a receipt made anyway (a node checked after the sweep started, an
    arm run by hand) carries BACKEND_FAILED_NODE_CHECK, which gates promotion like any fatal code."""
    import time

    from ablate.config.load import load_lane
    from trainers.run import run_arm
    from trainers.spec import ArmSpec

    lane = load_lane({"model": {"pattern": "AR", "d_model": 32, "n_heads": 2, "ssm_chunk": 16, "q_lora_rank": 16,
                                "kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8},
                      "features": {"recurrent_scan": "parallel"}, "batch": {"micro_batch": 2, "seq_len": 32},
                      "budget": {"steps": 4, "family_sample_steps": 1, "min_steady_steps": 2},
                      "hardware": {"threads": 1}})

    def arm(document: Path) -> Any:
        return run_arm(ArmSpec(lane=lane, sweep_id="s", campaign="c", block_id="b0", arm="candidate", arm_index=1,
                               order=0, feature="recurrent_scan", feature_value="parallel",
                               baseline_value="sequential", kind="speed", lane_key="k",
                               receipt_dir=str(tmp_path / document.stem), scheduled_at=time.time(),
                               node_check_path=str(document)))

    broken, good = arm(documents["broken"]), arm(documents["good"])
    assert broken.observed.node_check["wrong"] == ["recurrent_scan/parallel"]
    (code,) = [d for d in broken.disqualifiers if d.code.value == "BACKEND_FAILED_NODE_CHECK"]
    assert "fails its reference twin" in code.detail and broken.observed.node_check["sha256"][:16] in code.detail
    assert good.observed.node_check["wrong"] == [] and "BACKEND_FAILED_NODE_CHECK" not in good.codes()
