"""A lane with ``hardware.device: auto`` runs the lane overrides won on the device its arms run on, never those won on
another: a sweep plans for this machine's device and, once Ray is up and before anything is written, plans again
for the device the cluster runs the arms on; ``--until-decided`` asks where the arms run before its first look at
the evidence and plans every round for it; what cannot be planned again (a re-test, a round started elsewhere) is
refused when that device changes a baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from sweeps_common import fresh_mlflow_uri, tiny_smoke

from ablate.config import auto_device
from ablate.config.load import lane_shape_of, load_sweep
from ablate.config.schema import ConfigError
from ablate.sweep.run import _check_auto_device, run_sweep


def _with_override(campaign: Path, device: str, value: str = "jagged") -> None:
    """A moe_dispatch lane override for the campaign's lane shape as it runs on ``device``, in its defaults.yaml."""
    shape = lane_shape_of(load_sweep(campaign)[0].lane, device)
    defaults = campaign.parent / "defaults.yaml"
    override = (f"    lane_overrides:\n      - lane_shape: {shape}\n        value: {value}\n"
                f"        report: promote-test-1\n")
    defaults.write_text(defaults.read_text().replace("  moe_dispatch:\n", "  moe_dispatch:\n" + override, 1))


@pytest.fixture
def planned_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto_device, "local_device_class", lambda: "cpu")


def test_the_check_refuses_only_a_cluster_whose_device_changes_a_baseline(tmp_path: Path,
                                                                          planned_on_cpu: None) -> None:
    campaign = tiny_smoke(tmp_path / "c", name="auto", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(campaign, "cpu")
    sweep, defaults = load_sweep(campaign)
    assert sweep.lane.hardware.device.value == "auto"
    assert sweep.lane.features.moe_dispatch.value == "jagged"  # planned on CPU, where the override was won
    _check_auto_device(campaign, sweep, defaults, cluster_gpus=0)  # the cluster runs it on CPU too
    with pytest.raises(ConfigError) as refused:
        _check_auto_device(campaign, sweep, defaults, cluster_gpus=1)
    message = str(refused.value)
    assert refused.value.key == "lane.hardware.device" and "cpu or cuda written out" in message
    assert "moe_dispatch: 'jagged' planned, 'padded' on cuda" in message, message
    # The reverse: an override won on CUDA is not planned here, and the GPU cluster would run it.
    won_on_cuda = tiny_smoke(tmp_path / "cuda", name="auto", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(won_on_cuda, "cuda")
    sweep, defaults = load_sweep(won_on_cuda)
    with pytest.raises(ConfigError, match="moe_dispatch: 'padded' planned, 'jagged' on cuda"):
        _check_auto_device(won_on_cuda, sweep, defaults, cluster_gpus=1)
    # No refusal where no baseline changes: the device written out, the feature pinned by the campaign, or no
    # override at all.
    for name, lane, override in (("written", {"hardware": {"device": "cpu"}}, True),
                                 ("pinned", {"features": {"moe_dispatch": "jagged"}}, True), ("none", {}, False)):
        other = tiny_smoke(tmp_path / name, name="auto", lane=lane, features={"mamba_scan": ["chunked"]}, aa_blocks=0)
        if override:
            _with_override(other, "cpu")
        sweep, defaults = load_sweep(other)
        _check_auto_device(other, sweep, defaults, cluster_gpus=1)


def test_planned_again_a_value_the_other_devices_override_made_the_baseline_is_skipped_not_refused(
        tmp_path: Path, planned_on_cpu: None) -> None:
    """Planned again for CUDA, a tested value that CUDA's lane override made the baseline is skipped with the notice
    naming the override, as a GPU head plans it, and the files read again must be the ones read first."""
    from ablate.sweep.plan import plan_sweep
    from ablate.sweep.run import _file_hashes, _planned_for_cluster

    campaign = tiny_smoke(tmp_path / "c", name="auto", features={"moe_dispatch": ["jagged"],
                                                                "mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(campaign, "cuda")
    sweep, defaults = load_sweep(campaign)  # this machine: CPU, where jagged is still a candidate
    plan = plan_sweep(sweep, "auto-r1", defaults)
    assert not plan.skipped and {b.feature for b in plan.blocks} == {"moe_dispatch", "mamba_scan"}
    hashes = _file_hashes(campaign, sweep)
    again, _, replanned = _planned_for_cluster(campaign, str(tmp_path / "runs"), sweep, defaults, plan, "cpu", "cuda",
                                               hashes)
    assert replanned.sweep_id == "auto-r1" and again.lane.features.moe_dispatch.value == "jagged"
    assert {b.feature for b in replanned.blocks} == {"mamba_scan"}
    [(what, why)] = replanned.skipped
    assert what == "moe_dispatch=jagged" and "already this lane's default (lane override" in why, why
    campaign.write_text(campaign.read_text() + "\n# edited while the sweep waited\n")
    with pytest.raises(ConfigError, match="changed since this sweep read it"):
        _planned_for_cluster(campaign, str(tmp_path / "runs"), sweep, defaults, plan, "cpu", "cuda", hashes)


def test_validate_plan_says_what_the_other_device_would_run(tmp_path: Path, planned_on_cpu: None) -> None:
    """``ablate validate --plan`` on a head node without a GPU shows the plan for CPU, and for an ``auto`` lane the
    baselines a GPU cluster would plan instead."""
    from ablate.sweep.plan import plan_sweep
    from ablate.sweep.plan_view import render_plan

    def line(campaign: Path) -> str:
        sweep, defaults = load_sweep(campaign)
        rendered = [str(r) for r in render_plan(sweep, plan_sweep(sweep, "validate", defaults), campaign)]
        (found,) = [text for text in rendered if text.startswith("device auto:")]
        return found

    won_on_cpu = tiny_smoke(tmp_path / "c", name="auto", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(won_on_cpu, "cpu")
    assert line(won_on_cpu).endswith("plans it again with other baselines: moe_dispatch 'jagged' -> 'padded'")
    # What the other device's plan leaves out, and a plan it refuses: the only tested value is CUDA's baseline.
    won_on_cuda = tiny_smoke(tmp_path / "g", name="auto", features={"moe_dispatch": ["jagged"],
                                                                    "mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(won_on_cuda, "cuda")
    assert "; not run there: moe_dispatch=jagged (already this lane's default (lane override" in line(won_on_cuda)
    only = tiny_smoke(tmp_path / "o", name="auto", features={"moe_dispatch": ["jagged"]}, aa_blocks=0)
    _with_override(only, "cuda")
    assert "plans it again, and refuses it there: " in line(only), line(only)
    plain = tiny_smoke(tmp_path / "p", name="plain", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    assert "planned for cpu (this machine)" in line(plain) and line(plain).endswith("with the same baselines")
    written = tiny_smoke(tmp_path / "w", name="written", lane={"hardware": {"device": "cpu"}},
                         features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    sweep, defaults = load_sweep(written)
    assert not [r for r in render_plan(sweep, plan_sweep(sweep, "validate", defaults), written)
                if str(r).startswith("device auto:")]


@pytest.fixture(scope="module")
def one_gpu_cluster() -> Iterator[None]:
    """A real local Ray runtime that offers one GPU (a logical resource: no arm is meant to reach it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_a_sweep_planned_on_cpu_runs_the_gpu_baselines_on_a_gpu_cluster(
        tmp_path: Path, planned_on_cpu: None, one_gpu_cluster: None, caplog: pytest.LogCaptureFixture) -> None:
    """A head node without a GPU plans an ``auto`` lane for CPU; its GPU workers run it on CUDA, so the sweep is
    planned again, before anything is written, with the baselines defaults.yaml gives CUDA: the override won on CPU
    is not the GPU arms' baseline."""
    import json
    import logging

    campaign = tiny_smoke(tmp_path / "c", name="auto", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(campaign, "cpu")
    assert load_sweep(campaign)[0].lane.features.moe_dispatch.value == "jagged"  # as this machine plans it
    storage = tmp_path / "runs"
    with caplog.at_level(logging.WARNING, logger="ablate.sweep.run"):
        summary = run_sweep(campaign, tracking_uri=fresh_mlflow_uri(tmp_path / "store"), storage=str(storage),
                            progress=False, simulate_arms=True)
    assert summary.exit_code == 0, summary.render()
    (meta,) = [json.loads(p.read_text()) for p in storage.rglob("sweeps/*.json")]
    assert meta["device"] == "cuda" and meta["sweep_id"] == summary.sweep_id
    assert meta["params"]["lane.features.moe_dispatch"] == "padded", "the CUDA baseline, not the CPU override"
    assert "planned again with the baselines" in caplog.text and "moe_dispatch: 'jagged' -> 'padded'" in caplog.text


@pytest.mark.ray
def test_what_cannot_be_planned_again_is_refused_before_anything_is_written(
        tmp_path: Path, planned_on_cpu: None, one_gpu_cluster: None) -> None:
    """An ``--until-decided`` round started by another caller than ``run_until_decided`` (which plans it for the
    cluster's device from the start) chose its tests from this machine's plan, and a re-test names the device its
    value was won on: neither is planned again for the cluster's device."""
    campaign = tiny_smoke(tmp_path / "c", name="auto", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(campaign, "cpu")
    storage = tmp_path / "runs"
    uri = fresh_mlflow_uri(tmp_path / "store")
    with pytest.raises(ConfigError, match="lane.hardware.device"):
        run_sweep(campaign, tracking_uri=uri, storage=str(storage), progress=False,
                  searcher_factory=lambda plan: pytest.fail("no round may start"))
    from mlflow import MlflowClient

    assert not list(storage.rglob("sweeps/*.json")), "no sweep metadata is written"
    experiments = MlflowClient(uri).search_experiments()
    assert not MlflowClient(uri).search_runs([e.experiment_id for e in experiments]), "no MLflow run is opened"
    # A re-test (``ablate revalidate --run``) names the device its value was won on: the cluster must run it there,
    # whatever the defaults say.
    plain = tiny_smoke(tmp_path / "plain", name="plain", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    with pytest.raises(ConfigError, match="a lane this cluster runs on cpu, where the value it re-tests was won"):
        run_sweep(plain, tracking_uri=uri, storage=str(storage), progress=False, device="cpu")
    assert not list(storage.rglob("sweeps/*.json"))


@pytest.mark.ray
def test_until_decided_on_a_head_without_a_gpu_plans_every_round_for_the_gpu_workers(
        tmp_path: Path, planned_on_cpu: None, one_gpu_cluster: None) -> None:
    """The tests the loop waits for are those of the plan its rounds run: here CPU's override makes the only tested
    value the baseline, so this machine's plan has no speed test (it was refused: "at least one speed feature"),
    while the GPU workers, whose baseline is another, test it."""
    import json

    from ablate.receipts.store import load_receipts
    from ablate.sweep.plan import plan_sweep
    from ablate.sweep.until_decided import block_keys, run_until_decided
    from test_until_decided import _policy_file

    campaign = tiny_smoke(tmp_path / "c", name="auto", features={"moe_dispatch": ["jagged"]}, aa_blocks=1)
    _with_override(campaign, "cpu")
    here, defaults = load_sweep(campaign)
    assert not [k for _, k in block_keys(plan_sweep(here, "here", defaults)) if k], "no speed test on this machine"
    there, defaults = load_sweep(campaign, device="cuda")
    gpu_plan = plan_sweep(there, "there", defaults, device="cuda")
    (gpu_test,) = {k for _, k in block_keys(gpu_plan) if k}
    storage, lines = tmp_path / "runs", []
    summary = run_until_decided(campaign, policy_path=_policy_file(tmp_path, **{"sequential.max_rounds": 1,
                                                                                "evidence.min_rounds": 1}),
                                tracking_uri=fresh_mlflow_uri(tmp_path / "store"), storage=str(storage),
                                progress=False, echo=lines.append, sleep=lambda seconds: None, simulate_arms=True)
    assert len(summary.rounds) == 1 and summary.rounds[0].blocks_run == len(gpu_plan.blocks), "\n".join(lines)
    (meta,) = [json.loads(p.read_text()) for p in storage.rglob("sweeps/*.json")]
    assert meta["device"] == "cuda" and meta["params"]["schedule"] == "until_decided"
    assert meta["params"]["lane.features.moe_dispatch"] == "padded", "CUDA's baseline, not CPU's override"
    receipts, _ = load_receipts(next(storage.rglob("receipts")))
    assert {(r.identity.feature, r.identity.lane_key) for r in receipts if r.identity.kind == "speed"} == {
        (gpu_test[0], gpu_test[2])}, "the round ran the GPU plan's test"


def test_until_decided_asks_where_the_arms_run_before_any_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cluster to attach to, the device is the one the local runtime a round starts would offer (Ray's
    own count of this machine's visible GPUs), found without starting Ray."""
    import ray

    from ablate.config.schema import LaneConfig
    from ablate.sweep import resources
    from ablate.sweep.until_decided import arms_device

    lane = LaneConfig()
    assert lane.hardware.device.value == "auto"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("no Ray is started to ask"))
    for gpus, device in ((0, "cpu"), (1, "cuda")):
        monkeypatch.setattr(resources, "detect_local", lambda num_cpus=None, num_gpus=None, g=gpus: (2, g))
        assert arms_device(lane) == device


@pytest.mark.ray
def test_a_round_started_on_one_device_is_not_resumed_on_another(tmp_path: Path, planned_on_cpu: None,
                                                                  one_gpu_cluster: None) -> None:
    import json

    from ablate.sweep.layout import LATEST, Layout
    from ablate.sweep.plan import ORDERS_IN_PAIRS, plan_sweep

    campaign = tiny_smoke(tmp_path / "c", name="resumed", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    storage = tmp_path / "runs"
    sweep, defaults = load_sweep(campaign)
    plan = plan_sweep(sweep, "resumed-r1", defaults, orders_scheme=ORDERS_IN_PAIRS)
    layout = Layout.for_campaign(sweep.name, str(storage))
    # What a sweep that started on a CPU-only cluster left (its metadata names the device it ran the lane on).
    layout.write("sweeps/resumed-r1.json", json.dumps({"sweep_id": plan.sweep_id, "orders": ORDERS_IN_PAIRS,
                                                        "plan_fingerprint": plan.fingerprint(), "device": "cpu"}))
    layout.write(LATEST, "resumed-r1\n")
    with pytest.raises(ConfigError, match="a cluster that runs the lane on cpu, as sweep resumed-r1 did"):
        run_sweep(campaign, resume=True, tracking_uri=fresh_mlflow_uri(tmp_path / "store"), storage=str(storage),
                  progress=False)
    # An --until-decided invocation that found the arms on CUDA: refused as plainly, before its plan is compared.
    with pytest.raises(ConfigError, match="a cluster that runs the lane on cpu, as sweep resumed-r1 did .* on cuda"):
        run_sweep(campaign, resume=True, tracking_uri=fresh_mlflow_uri(tmp_path / "store"), storage=str(storage),
                  progress=False, device="cuda")
    # A sweep from before sweeps recorded their device, whose plan for CUDA differs: said so, not "changed since".
    _with_override(campaign, "cpu")
    sweep, defaults = load_sweep(campaign)
    plan = plan_sweep(sweep, "resumed-r1", defaults, orders_scheme=ORDERS_IN_PAIRS)
    layout.write("sweeps/resumed-r1.json", json.dumps({"sweep_id": plan.sweep_id, "orders": ORDERS_IN_PAIRS,
                                                        "plan_fingerprint": plan.fingerprint()}))
    with pytest.raises(ConfigError, match="sweep resumed-r1 did not .* planned for cuda its blocks differ"):
        run_sweep(campaign, resume=True, tracking_uri=fresh_mlflow_uri(tmp_path / "store"), storage=str(storage),
                  progress=False, device="cuda")


@pytest.mark.ray
def test_a_round_is_resumed_with_the_plan_of_the_device_it_ran_on(tmp_path: Path, planned_on_cpu: None,
                                                                   one_gpu_cluster: None) -> None:
    """A sweep that ran an ``auto`` lane on GPU workers is resumed from a head node without a GPU: it is planned for
    the device its metadata names, as it was when it started, not refused as a changed campaign."""
    import json

    from ablate.sweep.layout import LATEST, Layout
    from ablate.sweep.plan import ORDERS_IN_PAIRS, plan_sweep

    campaign = tiny_smoke(tmp_path / "c", name="resumed", features={"mamba_scan": ["chunked"]}, aa_blocks=0)
    _with_override(campaign, "cpu")
    storage = tmp_path / "runs"
    sweep, defaults = load_sweep(campaign, device="cuda")
    plan = plan_sweep(sweep, "resumed-r1", defaults, orders_scheme=ORDERS_IN_PAIRS)
    here, here_defaults = load_sweep(campaign)  # as this machine plans it: with the override won on CPU
    assert plan.fingerprint() != plan_sweep(here, "resumed-r1", here_defaults, orders_scheme=ORDERS_IN_PAIRS).fingerprint()
    layout = Layout.for_campaign(sweep.name, str(storage))
    layout.write("sweeps/resumed-r1.json", json.dumps({"sweep_id": plan.sweep_id, "orders": ORDERS_IN_PAIRS,
                                                        "plan_fingerprint": plan.fingerprint(), "device": "cuda"}))
    layout.write(LATEST, "resumed-r1\n")
    summary = run_sweep(campaign, resume=True, tracking_uri=fresh_mlflow_uri(tmp_path / "store"),
                        storage=str(storage), progress=False, simulate_arms=True)
    assert summary.exit_code == 0 and summary.sweep_id == "resumed-r1", summary.render()


@pytest.mark.ray
def test_revalidate_runs_only_the_retests_this_cluster_runs_where_their_value_was_won(
        tmp_path: Path, one_gpu_cluster: None) -> None:
    from ablate.promote.revalidate import RetestPlan, Target, runnable

    campaign = tiny_smoke(tmp_path / "c", name="tiny", features={"mamba_scan": ["chunked"]}, aa_blocks=0)

    def plan(device: object) -> RetestPlan:
        target = Target(feature="moe_dispatch", value="jagged", previous="padded", scope="global", lane_key="k",
                        lane_shape=None, report="r1", campaign="tiny", recorded_fingerprint="sw-1",
                        current_fingerprint="sw-2", policy=None, device_class=device)  # type: ignore[arg-type]
        return RetestPlan(target=target, campaign_path=campaign, source=campaign, name=f"won-on-{device}", blocks=1,
                          aa_blocks=1, rounds=1)

    kept, skipped = runnable([plan("cpu"), plan("cuda"), plan(None)])
    assert [p.name for p in kept] == ["won-on-cuda", "won-on-None"]  # this cluster runs the auto lane on CUDA
    [line] = skipped
    assert line.startswith("won-on-cpu: not run") and "this cluster runs its lane on cuda" in line


def test_auto_resolves_as_the_trainer_resolves_it() -> None:
    from ablate.config.schema import Device, LaneConfig

    lane = LaneConfig()
    assert lane.hardware.device is Device.auto
    assert (auto_device.cluster_device(lane, 0), auto_device.cluster_device(lane, 1)) == ("cpu", "cuda")
    written = LaneConfig(hardware=type(lane.hardware)(device=Device.cpu))
    assert auto_device.cluster_device(written, 1) == auto_device.planned_device(written) == "cpu"
    cuda = LaneConfig(hardware=type(lane.hardware)(device=Device.cuda))
    fallback = LaneConfig(hardware=type(lane.hardware)(device=Device.cuda, cpu_fallback=True))
    assert auto_device.cluster_device(cuda, 0) == "cuda"  # refused by gpu_resources, never run on CPU
    assert (auto_device.cluster_device(fallback, 0), auto_device.cluster_device(fallback, 1)) == ("cpu", "cuda")


def test_a_machine_that_hides_its_gpus_plans_auto_lanes_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    auto_device.local_device_class.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        assert auto_device.local_device_class() == "cpu"
    finally:
        auto_device.local_device_class.cache_clear()


def test_an_auto_lane_planned_on_cpu_trains_on_cpu_where_cuda_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray does not hide GPUs from a process that reserved none: an arm of an auto lane the driver planned (and
    reserved) for CPU would otherwise train on whatever GPU it sees, against defaults chosen for the lane on CPU."""
    import torch

    from ablate.config.schema import LaneConfig
    from ablate.sweep.plan import ArmPlan, Block
    from ablate.sweep.trial import make_arm_spec
    from trainers.loop import resolve_device
    from trainers.spec import ArmSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a worker that sees a GPU (CI has none)
    hardware = LaneConfig().hardware
    assert resolve_device(hardware, 0, planned="cpu").type == "cpu"
    assert resolve_device(hardware, 0).type == resolve_device(hardware, 0, planned="cuda").type == "cuda"
    # Planned (and reserved) for CUDA where torch sees none (a CPU-only build): refused, never trained on CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="planned this arm for cuda"):
        resolve_device(hardware, 0, planned="cuda")
    assert resolve_device(hardware, None).type == "cpu"
    # The plan's device reaches the trainer: the sweep puts it in the trial context, the spec carries it.
    lane = LaneConfig()
    block = Block(block_id="b000", feature=None, candidate_value=None, baseline_value=None, kind="aa",
                  lane_key="k", arms=(ArmPlan("aa", 0, lane, None), ArmPlan("aa", 1, lane, None)), order=(0, 1))
    spec = make_arm_spec(block, 0, block.arms[0], sweep_id="s", campaign="c", receipt_dir="/tmp", device="cpu")
    assert ArmSpec.from_json(spec.to_json()).device == "cpu"
