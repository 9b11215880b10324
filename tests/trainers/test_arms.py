"""One-worker arms end to end, each in a fresh process (the subprocess executor): a valid receipt whose time
adds up, what it records, and every disqualifier provoked by a real arm. The arms run two at a time."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from ablate.receipts.schema import BADPUT_CATEGORIES, Code, Receipt, Severity, Status, validate_receipt
from ablate.receipts.store import load_receipts
from trainer_helpers import CORPUS, make_spec, tiny_lane
from trainers import run_arm
from trainers.host_malloc import ENV_NAMES
from trainers.provenance import code_fingerprint, evidence_fingerprint, hardware_fingerprint
from trainers.data import TextSource
from ablate.redact import REDACTED

REPO = Path(__file__).resolve().parents[2]

SECRETS = {
    "TORCH_HUB_TOKEN": "hf_planted_token_7c1e9",
    "NCCL_IB_SECRET_KEY": "nccl-planted-secret-31ab",
    "MLFLOW_TRACKING_URI": "https://alice:planted-pa55w0rd@mlflow.example:5000",
    "AWS_SECRET_ACCESS_KEY": "aws-planted-secret-0d9f",
    "NCCL_DEBUG": "WARN",
}
SECRET_VALUES = ("hf_planted_token_7c1e9", "nccl-planted-secret-31ab", "planted-pa55w0rd", "aws-planted-secret-0d9f")
TRANSITION_S = 0.6
COMPILE_FAST = {"compile_backend": "eager"}  # dynamo traces and counts as with inductor, without C++ codegen


@pytest.fixture(scope="module")
def receipt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("arms") / "receipts"


@pytest.fixture(scope="module")
def arms(receipt_dir: Path) -> dict[str, Receipt]:
    plans = {
        # Orchestrator clock 1000 s ahead of the worker's: first in the queue so it is still "in the future".
        "raise_skewed": (make_spec(tiny_lane(), receipt_dir, inject={"raise_at_step": 1},
                                   scheduled_at=time.time() + 1000), {}),
        # A slow transition out of explicit warmup (optimizer reset, energy meter): a one-time cost.
        "valid": (make_spec(tiny_lane(model={"pattern": "AEM"}, data={"source": "text", "path": str(CORPUS)}),
                            receipt_dir, inject={"transition_sleep_s": TRANSITION_S}), {}),
        "disqualified": (make_spec(tiny_lane(features={"moe_dispatch": "grouped_mm"},
                                             hardware={"device": "cuda", "cpu_fallback": True},
                                             budget={"min_steady_steps": 50}), receipt_dir,
                                   feature="bucket_cap_mb"), {}),
        "nan": (make_spec(tiny_lane(), receipt_dir, inject={"nan_at_step": 2}), {}),
        "oom": (make_spec(tiny_lane(), receipt_dir, inject={"oom_at_step": 1}), {}),
        "killed": (make_spec(tiny_lane(), receipt_dir, inject={"kill_at_step": 2}), {"max_failures": 1}),
        "killed_for_good": (make_spec(tiny_lane(), receipt_dir, inject={"kill_at_step": 1}), {"max_failures": 0}),
        "whole_broken": (make_spec(tiny_lane(compile={"posture": "whole"}), receipt_dir,
                                   inject={**COMPILE_FAST, "graph_break": True, "geometry_change_at_step": 3}), {}),
        "regional": (make_spec(tiny_lane(compile={"posture": "regional"}), receipt_dir, inject=COMPILE_FAST), {}),
        "system_allocator": (replace(make_spec(tiny_lane(), receipt_dir, block_id="block-system"),
                                     host_allocator="system"), {}),
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in SECRETS.items():
            patch.setenv(name, value)
        for name in ("LD_PRELOAD", "GLIBC_TUNABLES", *ENV_NAMES):  # a shell's allocator would win over the policy
            patch.delenv(name, raising=False)
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {name: pool.submit(run_arm, spec, **kwargs) for name, (spec, kwargs) in plans.items()}
            return {name: future.result() for name, future in futures.items()}


def _codes(receipt: Receipt) -> set[str]:
    return receipt.codes()


def _time_sum(receipt: Receipt) -> float:
    return receipt.time.goodput_s + sum(receipt.time.badput_s.values())


def test_valid_arm_validates_and_its_time_adds_up(arms: dict[str, Receipt], receipt_dir: Path) -> None:
    receipt = arms["valid"]
    assert receipt.identity.status is Status.valid, receipt.disqualifiers
    # A busy test host may make the arm wait for a CPU: that is reported as a warning, and only when measured.
    assert [(d.code, d.severity) for d in receipt.disqualifiers] == \
        ([(Code.HOST_CONTENDED, Severity.warn)] if receipt.host_load.contended else [])
    validate_receipt(json.loads(receipt.model_dump_json()))
    assert receipt.identity.executor == "subprocess" and receipt.identity.attempt == 0
    assert set(receipt.time.badput_s) == set(BADPUT_CATEGORIES)
    assert abs(_time_sum(receipt) - receipt.time.wall_s) <= 0.01 * receipt.time.wall_s
    assert all(value >= 0 for name, value in receipt.time.badput_s.items() if name != "unattributed")
    # Every part is measured on its own: what nothing explains is small, not a plug that closes the sum.
    assert abs(receipt.time.badput_s["unattributed"]) <= 0.02 * receipt.time.wall_s
    assert receipt.time.goodput_s > 0 and receipt.time.badput_s["startup"] > 0 and receipt.time.badput_s["setup"] > 0
    assert receipt.time.badput_s["compile_warmup"] > 0          # the explicit warmup step
    # Executor start-up (imports, spawn) is recorded but never in the projection the verdict compares.
    proj = receipt.projection
    assert proj is not None and proj.one_time_s == pytest.approx(receipt.time.badput_s["setup"] + proj.warm_s)
    assert proj.horizon_steps == 10_000 and proj.recurring_steps == 5
    assert proj.projected_s == pytest.approx(proj.one_time_s + 10_000 * proj.recurring_step_s)
    # The transition out of explicit warmup is the warmup's (one-time), never in a budget step's cadence, where
    # the recurring mean would carry it to the horizon.
    steps = receipt.steps
    last_warmup = max(i for i, p in enumerate(steps.phases) if p == "warmup")
    assert steps.cadence_s[last_warmup] >= TRANSITION_S and proj.warm_s >= TRANSITION_S
    assert steps.cadence_s[last_warmup + 1] < TRANSITION_S / 2 and proj.recurring_step_s < TRANSITION_S / 6
    assert receipt.host_load.niceness == 0 and receipt.host_load.window_s > 0
    # The evidence key covers packages, this repository's arm code and the hardware together.
    ident = receipt.identity
    assert ident.code_fingerprint == code_fingerprint(REPO) and ident.hardware_fingerprint
    assert ident.software_fingerprint == evidence_fingerprint(ident.software, ident.code_fingerprint,
                                                              ident.hardware_fingerprint)
    # 1 explicit warmup step + 6 budget steps, the last one sampled for family share -> 5 steady.
    assert (receipt.steps.total, receipt.steps.warmup, receipt.steps.steady) == (7, 1, 5)
    assert len(receipt.steps.series) == 6 and len(receipt.steps.loss_series) == 6
    assert all(v is not None and math.isfinite(v) for v in receipt.steps.loss_series)
    assert receipt.steps.p50_s is not None and receipt.steps.p90_s >= receipt.steps.p50_s
    assert receipt.steps.ideal_s is not None and 0 < receipt.steps.time_to_first_step_s < receipt.time.wall_s
    assert receipt.throughput.tokens == 6 * 64
    assert receipt.throughput.wall_tokens_per_s == pytest.approx(receipt.throughput.tokens / receipt.time.wall_s)
    assert receipt.throughput.steady_tokens_per_s > receipt.throughput.wall_tokens_per_s
    assert receipt.throughput.mfu is None and receipt.throughput.peak_flops is None   # CPU: peak unknown
    assert receipt.quality.loss_final is not None and math.isfinite(receipt.quality.loss_final)
    on_disk = receipt_dir / f"{receipt.identity.receipt_id}.json"
    assert json.loads(on_disk.read_text())["identity"]["receipt_id"] == receipt.identity.receipt_id


def test_valid_arm_records_requested_and_observed_facts(arms: dict[str, Receipt]) -> None:
    receipt = arms["valid"]
    requested = receipt.requested
    assert requested.lane["model.pattern"] == "AEM" and requested.lane["features.moe_dispatch"] == "padded"
    assert requested.layer_counts == {"A": 1, "M": 1, "E": 1, "R": 0}
    assert requested.params_total > requested.params_active > 0
    assert (requested.tokens_per_step, requested.world_size, requested.device) == (64, 1, "auto")
    assert requested.data_fingerprint == TextSource(str(CORPUS), seed=0, vocab_size=256).fingerprint
    hardware = receipt.observed.hardware
    assert hardware["kind"] == "cpu" and hardware["torch_threads"] == 1 and hardware["logical_cpus"] >= 1
    assert hardware["host_allocator"] == "retain"  # the default, applied in the arm's own process
    moe = [b for b in receipt.observed.backends if b.op == "moe"]
    assert moe and moe[0].requested == moe[0].observed == "padded"
    compile_record = receipt.observed.compile
    assert (compile_record.posture_requested, compile_record.posture_observed) == ("eager", "eager")
    assert compile_record.warmup_resolved == "explicit" and "not CUDA" in compile_record.warmup_reason
    assert receipt.observed.engine["engine"] == "ddp" and receipt.observed.engine["bucket_cap_mb"] is None
    assert receipt.memory.kind == "cpu" and receipt.memory.peak_rss_bytes > 50 * 2 ** 20
    share = receipt.family_share
    assert share["R"] is None                                  # no R block in the pattern
    assert all(0 < share[f] < 1 for f in "AEM") and sum(share[f] for f in "AEM") <= 1.0
    assert receipt.family_share_method == "hooks"
    assert receipt.identity.software["torch"] and len(receipt.identity.software_fingerprint) == 16
    # The node's deep-check document the arm ran under (none on a test host: the receipt says why), and energy:
    # a number with its source where the host has readable counters, else null with the reason.
    node_check = receipt.observed.node_check
    assert node_check["path"].endswith("node_check.json")
    assert node_check["sha256"] or "no document at" in node_check["why"], node_check
    energy = receipt.energy
    assert energy is not None and energy.tokens in (None, receipt.throughput.tokens)
    assert (energy.source is not None and energy.joules > 0) or (energy.source is None and energy.why), energy
    assert receipt.identity.config_hash and receipt.identity.host and receipt.identity.pid


def test_the_host_allocator_asked_for_is_the_one_the_arm_ran_and_fingerprinted(arms: dict[str, Receipt]) -> None:
    retained, system = arms["valid"], arms["system_allocator"]
    assert system.identity.status is Status.valid, system.codes()
    assert system.observed.hardware["host_allocator"] == "system"
    # Evidence measured under one policy never pairs or pools with the other's (match.py compares fingerprints).
    assert system.identity.hardware_fingerprint != retained.identity.hardware_fingerprint
    as_retained = {**system.observed.hardware, "host_allocator": "retain"}
    assert hardware_fingerprint(as_retained, system.identity.software) == retained.identity.hardware_fingerprint


def test_secrets_never_reach_a_receipt(arms: dict[str, Receipt], receipt_dir: Path) -> None:
    assert arms["valid"].env["NCCL_DEBUG"] == "WARN"
    # Secret-named variables never reach the arm's process (trainers.run._arm_env), allowlisted prefix or not.
    assert "TORCH_HUB_TOKEN" not in arms["valid"].env and "NCCL_IB_SECRET_KEY" not in arms["valid"].env
    assert "AWS_SECRET_ACCESS_KEY" not in arms["valid"].env
    assert arms["valid"].env["MLFLOW_TRACKING_URI"] == f"https://{REDACTED}@mlflow.example:5000"
    texts = [r.model_dump_json() for r in arms.values()] + [p.read_text() for p in receipt_dir.glob("*.json")]
    for text in texts:
        for secret in SECRET_VALUES:
            assert secret not in text


def test_receipts_on_disk_load_and_no_scratch_is_left(arms: dict[str, Receipt], receipt_dir: Path) -> None:
    loaded, rejected = load_receipts(receipt_dir)
    ids = {r.identity.receipt_id for r in loaded}
    # Everything loads except the skewed arm, whose time cannot add up (it is failed, so it still validates).
    assert {r.identity.receipt_id for r in arms.values()} == ids and rejected == []
    assert not (receipt_dir / ".work").exists()


@pytest.mark.parametrize(("arm", "code"), [
    ("disqualified", "BACKEND_FALLBACK"),
    ("disqualified", "HARDWARE_MISMATCH"),
    ("disqualified", "INERT_TOGGLE"),
    ("disqualified", "INSUFFICIENT_STEADY_STEPS"),
    ("whole_broken", "GRAPH_BREAK"),
    ("whole_broken", "RECOMPILE_IN_STEADY_STATE"),
    ("whole_broken", "BATCH_GEOMETRY_CHANGED"),
    ("nan", "NONFINITE_LOSS"),
    ("oom", "OOM"),
    ("raise_skewed", "ARM_FAILED"),
    ("raise_skewed", "TIME_ACCOUNTING_VIOLATION"),
])
def test_each_disqualifier_is_provoked(arms: dict[str, Receipt], arm: str, code: str) -> None:
    receipt = arms[arm]
    assert code in _codes(receipt), (arm, [d.model_dump() for d in receipt.disqualifiers])
    for other in ("valid", "regional", "killed"):
        assert code not in _codes(arms[other])


def test_lane_fact_disqualifiers_carry_their_evidence(arms: dict[str, Receipt]) -> None:
    receipt = arms["disqualified"]
    assert receipt.identity.status is Status.disqualified
    validate_receipt(json.loads(receipt.model_dump_json()))      # disqualified, but its time still adds up
    moe = next(b for b in receipt.observed.backends if b.op == "moe")
    assert (moe.requested, moe.observed) == ("grouped_mm", "jagged") and "CUTLASS" in moe.reason
    assert receipt.requested.device == "cuda" and receipt.observed.hardware["kind"] == "cpu"
    detail = {d.code.value: d.detail for d in receipt.disqualifiers}
    assert "one worker" in detail["INERT_TOGGLE"] and "50" in detail["INSUFFICIENT_STEADY_STEPS"]


def test_compile_disqualifiers_carry_their_evidence(arms: dict[str, Receipt]) -> None:
    receipt = arms["whole_broken"]
    compile_record = receipt.observed.compile
    assert compile_record.posture_observed == "whole" and compile_record.graph_breaks >= 1
    assert any("graph_break" in reason for reason in compile_record.graph_break_reasons)
    assert compile_record.recompiles_in_steady_state >= 1
    assert any("size mismatch" in reason for reason in compile_record.recompile_reasons)
    assert receipt.observed.tokens_per_step == 32                 # seq_len halved from step 3
    assert receipt.time.badput_s["recompile"] > 0
    assert receipt.family_share_method == "eager_proxy"
    assert receipt.identity.status is Status.disqualified


def test_regional_compile_arm_is_clean(arms: dict[str, Receipt]) -> None:
    receipt = arms["regional"]
    compile_record = receipt.observed.compile
    assert receipt.identity.status is Status.valid, receipt.disqualifiers
    assert compile_record.posture_observed == "regional"
    assert compile_record.unique_graphs == 4                      # one graph per block family
    assert compile_record.graph_breaks == 0 and compile_record.recompiles_in_steady_state == 0
    assert compile_record.compile_time_s > 0 and receipt.time.badput_s["compile_warmup"] > 0
    assert all(receipt.family_share[f] is not None and receipt.family_share[f] > 0 for f in "AEMR")


def test_failed_arms_keep_their_cause_and_measurements(arms: dict[str, Receipt]) -> None:
    nan = arms["nan"]
    assert nan.identity.status is Status.failed and "ARM_FAILED" in _codes(nan)
    assert next(d for d in nan.disqualifiers if d.code.value == "NONFINITE_LOSS").step == 2
    assert len(nan.steps.loss_series) == 3 and nan.steps.loss_series[2] is None   # stopped at the bad step
    oom = arms["oom"]
    assert oom.identity.status is Status.failed and oom.error is not None and oom.error.type == "OutOfMemoryError"
    skewed = arms["raise_skewed"]
    assert skewed.identity.status is Status.failed and "injected failure" in skewed.error.message
    for receipt in (nan, oom, skewed):
        validate_receipt(json.loads(receipt.model_dump_json()))   # failed receipts are kept, not rejected


def test_killed_worker_is_relaunched_and_the_receipt_says_so(arms: dict[str, Receipt]) -> None:
    receipt = arms["killed"]
    assert receipt.identity.status is Status.valid and receipt.identity.attempt == 1
    # The relaunch compiled into caches of its own: the dead attempt's kernels would have made its compile warm.
    assert receipt.env["TORCHINDUCTOR_CACHE_DIR"].endswith("/inductor-cache-restart1")
    assert receipt.env["TRITON_CACHE_DIR"].endswith("/triton-cache-restart1")
    assert arms["valid"].env["TORCHINDUCTOR_CACHE_DIR"].endswith("/inductor-cache")
    assert receipt.time.badput_s["restart"] > 0                    # the killed attempt's time, billed as restart
    assert len(receipt.steps.series) == 6
    assert abs(_time_sum(receipt) - receipt.time.wall_s) <= 0.01 * receipt.time.wall_s


def test_a_worker_that_dies_for_good_still_leaves_a_failed_receipt(arms: dict[str, Receipt]) -> None:
    receipt = arms["killed_for_good"]
    assert receipt.identity.status is Status.failed and receipt.identity.attempt == 0
    assert receipt.error is not None and receipt.error.type == "WorkerDied" and "signal 9" in receipt.error.message
    assert "ARM_FAILED" in _codes(receipt) and receipt.steps.total == 0
    assert receipt.requested.layer_counts == {"A": 1, "M": 1, "E": 1, "R": 1}    # from the pattern, no worker
    assert receipt.time.badput_s["queue_wait"] >= 0 and receipt.time.badput_s["restart"] > 0
    validate_receipt(json.loads(receipt.model_dump_json()))
