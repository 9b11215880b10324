"""Start-up of multi-worker arms (issue 14): what ``trainers.run`` changes in Ray Train, and that each arm still gets
worker processes of its own. Timings live in ``benchmarks/bench_runner.py``; these tests assert behaviour."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from trainers.run import TRAIN_ENV_DEFAULTS, _backend_config, _train_env, _trainer_class, state_api_served


def test_train_env_applies_defaults_keeps_a_set_value_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    names = list(TRAIN_ENV_DEFAULTS)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(names[0], "7")  # set by whoever launched the sweep: it wins
    with _train_env() as in_force:
        assert in_force[names[0]] == os.environ[names[0]] == "7"
        for name in names[1:]:
            assert in_force[name] == os.environ[name] == TRAIN_ENV_DEFAULTS[name]
    assert os.environ[names[0]] == "7"
    assert all(name not in os.environ for name in names[1:])  # later one-worker arms do not inherit them


def _probe_loop_factory() -> Callable[[dict[str, Any]], None]:
    """A train function built here so cloudpickle ships it by value (workers cannot import this test module)."""

    def probe(config: dict[str, Any]) -> None:
        import os
        import sys

        import ray.train
        import torch.distributed as dist

        import trainers.run as run_module

        # What a previous arm may have left in this process: a module attribute and an imported module.
        seen = {"attribute": getattr(run_module, "_probe_arm", None), "module": "ablate_probe_marker" in sys.modules}
        run_module._probe_arm = config["arm"]  # type: ignore[attr-defined]
        sys.modules["ablate_probe_marker"] = run_module
        ctx = ray.train.get_context()
        rank = ctx.get_world_rank()
        # What Ray's torch set-up leaves on a worker, whoever drove it (the distributed env of torchrun).
        torch_env = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                              "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
        record = {"pid": os.getpid(), "seen": seen, "world": dist.get_world_size() if dist.is_initialized() else 0,
                  "dist_rank": dist.get_rank() if dist.is_initialized() else None,
                  "backend": dist.get_backend() if dist.is_initialized() else None, "torch_env": torch_env,
                  "local_rank": ctx.get_local_rank(),
                  "env": {name: os.environ.get(name) for name in config["env_names"]}}
        Path(config["out"], f"{config['arm']}-{rank}.json").write_text(json.dumps(record))
        ray.train.report({"rank": rank})  # the controller's callback records what its process imported

    return probe


def _controller_probe(out: Path, arm: str) -> Any:
    """A Train user callback, which runs in the controller: records its pid and whether torch was imported there."""
    import ray.train

    class ControllerProbe(ray.train.UserCallback):
        def after_report(self, run_context: Any, metrics: Any, checkpoint: Any) -> None:
            import os
            import sys

            Path(out, f"{arm}-controller.json").write_text(json.dumps({"pid": os.getpid(),
                                                                        "torch": "torch" in sys.modules}))

    return ControllerProbe()


def _launcher_probe_factory() -> Callable[[dict[str, Any]], None]:
    """What a worker of a CPU arm has when its train function starts (``ArmTorchConfig(arm_process=True)``):
    the variables its rank's arm process will form the group from, and whether anything imported torch."""

    def probe(config: dict[str, Any]) -> None:
        import os
        import sys

        import ray.train

        from trainers.train_backend import ARM_PROCESS_ENV

        rank = ray.train.get_context().get_world_rank()
        record = {"pid": os.getpid(), "torch": "torch" in sys.modules, "local_rank":
                  ray.train.get_context().get_local_rank(),
                  "torch_env": {name: os.environ.get(name) for name in ARM_PROCESS_ENV}}
        Path(config["out"], f"{config['arm']}-{rank}.json").write_text(json.dumps(record))
        ray.train.report({"rank": rank})

    return probe


@pytest.fixture(scope="module")
def two_arms(train_ray: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[dict[str, list[dict[str, Any]]], Any]]:
    """Two arms with the arm in the Train workers (the GPU path, run here on gloo as its CPU twin), then one with
    the CPU path's backend (each rank's arm in a process of its own, ``launcher``)."""
    import ray
    import ray.train

    from trainers.train_backend import ArmTorchConfig

    out = tmp_path_factory.mktemp("train_start")
    arms: dict[str, list[dict[str, Any]]] = {}
    for arm in ("first", "second", "launcher"):
        with _train_env() as train_env:
            trainer = _trainer_class()(
                _launcher_probe_factory() if arm == "launcher" else _probe_loop_factory(),
                train_loop_config={"arm": arm, "out": str(out), "env_names": list(TRAIN_ENV_DEFAULTS)},
                scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
                torch_config=ArmTorchConfig(backend="gloo", arm_process=arm == "launcher"),
                run_config=ray.train.RunConfig(name=f"probe-{arm}", storage_path=str(out / "ray"),
                                               worker_runtime_env={"env_vars": dict(train_env)},
                                               callbacks=[_controller_probe(out, arm)]))
            trainer.fit()
        arms[arm] = [json.loads((out / f"{arm}-{rank}.json").read_text()) for rank in range(2)]
        arms[arm + "-controller"] = [json.loads((out / f"{arm}-controller.json").read_text())]
    from ray._private.state import actors

    # Every actor the runtime has run so far (dead ones included), by class: what each arm cost in processes.
    arms["actor_classes"] = [{"class": a["ActorClassName"]} for a in actors().values()]
    yield arms, ray


def test_consecutive_two_worker_arms_never_share_a_process(two_arms: tuple[dict[str, list[dict[str, Any]]], Any]
                                                           ) -> None:
    arms, _ = two_arms
    first, second = ({record["pid"] for record in arms[arm]} for arm in ("first", "second"))
    assert len(first) == 2 and len(second) == 2 and first.isdisjoint(second)
    assert os.getpid() not in first | second
    assert all(record["world"] == 2 for arm in ("first", "second") for record in arms[arm])  # the gloo group


def test_the_process_group_is_rays_and_the_controller_never_imports_torch(
        two_arms: tuple[dict[str, list[dict[str, Any]]], Any]) -> None:
    """``trainers.train_backend`` drives Ray's own torch set-up from the workers: every rank joins one gloo group at
    its Train rank with torchrun's variables set as ``TorchConfig`` sets them, while the controller (5 s of CPU
    per arm when it unpickled ``TorchConfig``) never loads torch."""
    arms, _ = two_arms
    for arm in ("first", "second"):
        ranks = sorted(arms[arm], key=lambda record: record["dist_rank"])
        assert [r["dist_rank"] for r in ranks] == [0, 1] and {r["backend"] for r in ranks} == {"gloo"}
        for rank, record in enumerate(ranks):
            env = record["torch_env"]
            assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(record["local_rank"]))
            assert env["MASTER_ADDR"] and env["MASTER_PORT"] == ranks[0]["torch_env"]["MASTER_PORT"]
        controller = arms[arm + "-controller"][0]
        assert controller["torch"] is False, controller
        assert controller["pid"] not in {r["pid"] for r in ranks} | {os.getpid()}


def test_a_cpu_arms_workers_never_import_torch_and_hand_their_rank_the_group(
        two_arms: tuple[dict[str, list[dict[str, Any]]], Any]) -> None:
    """``ArmTorchConfig(arm_process=True)``: the backend sets exactly the variables Ray's torch set-up sets (the
    in-worker arms above saw the same ones), without importing torch into the worker; the rank's arm process
    forms the gloo group from them (``trainers.worker``; the group itself is checked by the real two-worker arms
    in ``test_ray_train``)."""
    arms, _ = two_arms
    ranks = sorted(arms["launcher"], key=lambda record: int(record["torch_env"]["RANK"]))
    assert all(record["torch"] is False for record in ranks), ranks
    for rank, record in enumerate(ranks):
        env = record["torch_env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == \
            (str(rank), "2", str(record["local_rank"]), "2", "0")
        assert env["MASTER_ADDR"] and env["MASTER_PORT"] == ranks[0]["torch_env"]["MASTER_PORT"]
        assert env["ACCELERATE_TORCH_DEVICE"] == "cpu"
        in_worker = next(r for r in arms["first"] if r["torch_env"]["RANK"] == str(rank))["torch_env"]
        same = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
        assert {name: env[name] for name in same} == {name: in_worker[name] for name in same}
    assert arms["launcher-controller"][0]["torch"] is False


def test_module_state_of_one_arm_is_not_seen_by_the_next(two_arms: tuple[dict[str, list[dict[str, Any]]], Any]
                                                         ) -> None:
    arms, _ = two_arms
    for arm in ("first", "second"):
        for record in arms[arm]:
            assert record["seen"] == {"attribute": None, "module": False}, (arm, record)


def test_workers_see_the_train_settings_the_receipt_records(two_arms: tuple[dict[str, list[dict[str, Any]]], Any]
                                                            ) -> None:
    arms, _ = two_arms
    for record in arms["second"]:
        assert record["env"] == TRAIN_ENV_DEFAULTS


def test_arm_trainer_drops_only_callbacks_whose_actor_would_do_nothing(
        two_arms: tuple[dict[str, list[dict[str, Any]]], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray Data callback goes when the arm passes no datasets; the placement-group cleaner when no State API
    answers (this runtime has no dashboard, like a sweep's embedded one), and then no cleaner actor was started for
    either arm. A State API that answers, here a real HTTP server at ``RAY_API_SERVER_ADDRESS``, keeps it."""
    arms, ray = two_arms
    import ray.data
    import ray.train
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    def names(trainer: Any) -> set[str]:
        return {type(callback).__name__ for callback in trainer._create_default_callbacks()}

    scaling = ray.train.ScalingConfig(num_workers=2, use_gpu=False)
    assert state_api_served() is False
    plain = names(_trainer_class()(lambda: None, scaling_config=scaling))
    assert {DatasetsCallback.__name__, PlacementGroupCleanerCallback.__name__}.isdisjoint(plain)
    assert {"BackendSetupCallback", "AcceleratorSetupCallback"} <= plain
    started = [a["class"] for a in arms["actor_classes"]]
    assert started.count("RayTrainWorker") >= 4 and "PlacementGroupCleaner" not in started, started
    with_data = names(_trainer_class()(lambda: None, scaling_config=scaling,
                                       datasets={"train": ray.data.from_items([{"x": 1}])}))
    assert with_data == plain | {DatasetsCallback.__name__}

    with _answering_server() as address:
        monkeypatch.setenv("RAY_API_SERVER_ADDRESS", address)
        assert state_api_served() is True
        assert names(_trainer_class()(lambda: None, scaling_config=scaling)) == \
            plain | {PlacementGroupCleanerCallback.__name__}
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", address)  # the same port, nothing listening on it any more
    assert state_api_served() is False


@contextlib.contextmanager
def _answering_server() -> Iterator[str]:
    """An HTTP server on a free loopback port that answers every GET with 401, as a dashboard that wants a token
    does; yields its ``host:port``."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name in http.server
            self.send_error(401)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_train_v1_gets_rays_own_torch_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch-free backend follows Train V2's order of calls; V1 sets the torch variables later, in
    ``on_training_start``, so it gets Ray's ``TorchConfig``. Both name the same process-group backend."""
    from ray.train.torch import TorchConfig

    from trainers.train_backend import ArmTorchConfig

    monkeypatch.delenv("RAY_TRAIN_V2_ENABLED", raising=False)
    v2 = _backend_config(False)
    assert isinstance(v2, ArmTorchConfig) and v2.backend == "gloo" and v2.to_dict()["backend"] == "gloo"
    assert v2.arm_process is True                # CPU: each rank's arm in a process of its own
    spanning = _backend_config(False, one_node=False)  # the rank files need the arm's dir on every node
    assert spanning.backend == "gloo" and spanning.arm_process is False
    gpu = _backend_config(True)
    assert gpu.backend == "nccl" and gpu.arm_process is False  # GPU: Ray's set-up, the arm in the worker
    with pytest.raises(ValueError, match="arm_process is for gloo"):
        ArmTorchConfig(backend="nccl", arm_process=True)
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "0")
    v1 = _backend_config(False)
    assert type(v1) is TorchConfig and v1.backend == "gloo"


def test_a_ranks_process_stops_when_the_worker_that_launched_it_is_gone(tmp_path: Path) -> None:
    """A rank that lost its Train worker (killed by Train, OOM-killed, crashed) must not train on, or wait in the
    group's rendezvous, on the CPUs the next arm is measured on: here rank 1 of a group whose rank 0 never comes,
    launched as a fresh interpreter (no fork server to kill it), and its launcher is killed."""
    import signal
    import subprocess
    import sys
    import time

    from sweeps_common import closed_port
    from trainer_helpers import make_spec, tiny_lane
    from trainers.result import WorkerContext
    from trainers.run import _arm_env
    from trainers.worker import LAUNCHER_GONE_STATUS

    launcher = subprocess.Popen(["sleep", "120"])
    spec = tmp_path / "spec.json"
    spec.write_text(make_spec(tiny_lane(engine={"workers": 2}), tmp_path / "receipts").to_json())
    context = WorkerContext(rank=1, world_size=2, local_rank=1, local_world_size=2, executor="ray_train",
                            work_dir=str(tmp_path))
    rank_doc = tmp_path / "rank.json"
    rank_doc.write_text(json.dumps({"context": context.__dict__, "backend": "gloo", "timeout_s": 120,
                                    "launcher_pid": launcher.pid}))
    env = {**_arm_env(tmp_path), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(closed_port()), "RANK": "1",
           "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    with (tmp_path / "rank.log").open("w") as log:
        rank = subprocess.Popen([sys.executable, "-m", "trainers.worker", str(spec), str(tmp_path / "result.json"),
                                 "0", str(rank_doc)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            time.sleep(1.0)
            assert rank.poll() is None  # waiting for its group while the launcher lives
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
            status = rank.wait(timeout=30)
        finally:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert status == LAUNCHER_GONE_STATUS, (tmp_path / "rank.log").read_text()
    assert f"launched this rank (pid {launcher.pid}) is gone" in (tmp_path / "rank.log").read_text()
    assert not (tmp_path / "result.json").exists()


def test_the_receipt_names_a_rank_that_fell_back_to_a_fresh_interpreter(tmp_path: Path) -> None:
    from trainers.run import _ranks_process

    assert _ranks_process(tmp_path, 0) is None
    forked = {"how": "fork_server", "server_pid": 11, "forks_before": 3}
    for rank in (0, 1):
        (tmp_path / f"process-0-rank{rank}.state").write_text(json.dumps({**forked, "forks_before": rank}))
    assert _ranks_process(tmp_path, 0) == {**forked, "forks_before": 0}  # rank 0's when every rank was forked
    (tmp_path / "process-1-rank0.state").write_text(json.dumps(forked))
    (tmp_path / "process-1-rank1.state").write_text(json.dumps({"how": "fresh_interpreter",
                                                                 "fallback_reason": "no server"}))
    assert _ranks_process(tmp_path, 1) == {"how": "fresh_interpreter", "fallback_reason": "rank 1: no server"}


def test_a_failed_arm_is_described_by_the_processes_of_the_attempt_its_measurements_come_from(
        tmp_path: Path) -> None:
    """Attempt 0's rank 0 failed and left partial measurements; attempt 1 died without any (a rank killed before
    it raised), after one of its ranks had fallen back to a fresh interpreter. The receipt's measurements are
    attempt 0's, so its process record must be too; a record cut short by a kill reads as missing."""
    from trainer_helpers import make_spec, tiny_lane
    from trainers.receipt import LaunchInfo
    from trainers.result import WorkerResult
    from trainers.run import _collect_arm

    for attempt in (0, 1):
        (tmp_path / f"attempt-{attempt}.state").touch()
    partial = WorkerResult(rank=0, world_size=2, attempt=0, executor="ray_train", pid=4321, host="h", node_id=None,
                           fn_start=1.0, error={"type": "RuntimeError", "message": "out of memory"})
    (tmp_path / "partial-0.state").write_text(partial.to_json())
    forked = {"how": "fork_server", "server_pid": 11, "forks_before": 0}
    for rank in (0, 1):
        (tmp_path / f"process-0-rank{rank}.state").write_text(json.dumps({**forked, "forks_before": rank}))
    (tmp_path / "process-1-rank0.state").write_text(json.dumps(forked))
    (tmp_path / "process-1-rank1.state").write_text(json.dumps({"how": "fresh_interpreter",
                                                                 "fallback_reason": "no server"}))
    launch = LaunchInfo(executor="ray_train", run_start=0.0, end=2.0)
    result = _collect_arm(tmp_path, make_spec(tiny_lane(), tmp_path), launch, None)
    assert result is not None and result.attempt == 0 and result.pid == 4321
    assert launch.restarts == 1
    assert launch.process == forked  # attempt 0's processes, not attempt 1's fallback
    (tmp_path / "process-0-rank0.state").write_text('{"how": "fork_ser')  # killed mid-write
    launch = LaunchInfo(executor="ray_train", run_start=0.0, end=2.0)
    assert _collect_arm(tmp_path, make_spec(tiny_lane(), tmp_path), launch, None).pid == 4321
    assert launch.process == {**forked, "forks_before": 1}  # the record that could be read
