"""cluster.yaml passes Ray's own launcher validator and keeps the promises ablate's scheduling depends on."""

from __future__ import annotations

import copy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ablate.config.load import load_sweep
from ablate.sweep.plan import plan_blocks
from ablate.sweep.resources import DRIVER_CPU, DRIVER_GPU, block_need, fit_node, plan_capacity

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def _validated(config: dict[str, Any]) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_ray_validator_accepts_it_and_rejects_a_broken_copy(cluster: dict[str, Any]) -> None:
    prepared = _validated(cluster)
    assert prepared["provider"]["type"] == "aws" and prepared["head_node_type"] == "head.cpu"
    broken = copy.deepcopy(cluster)
    del broken["available_node_types"]["worker.gpu"]["node_config"]
    with pytest.raises(Exception, match="node_config"):
        _validated(broken)


def test_head_keeps_work_off_and_the_dashboard_private(cluster: dict[str, Any]) -> None:
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and DRIVER_CPU not in head["resources"]
    start = " ".join(cluster["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in start
    for command in (*cluster["head_start_ray_commands"], *cluster["worker_start_ray_commands"]):
        if "ray start" in command:
            assert "RAY_AUTH_MODE=token" in command, command
    assert "~/.ray/auth_token" in cluster["file_mounts"], "every node needs the client's token"


def test_setup_installs_this_project(cluster: dict[str, Any]) -> None:
    mounts = cluster["file_mounts"]
    target = next(remote for remote, local in mounts.items() if local == ".")
    assert any(f"cd {target}" in c and "pip install" in c and "-e ." in c for c in cluster["setup_commands"])
    assert ".gitignore" in cluster.get("rsync_filter", [])


def test_gpu_nodes_run_the_deep_node_check_with_flags_the_cli_has(cluster: dict[str, Any]) -> None:
    (command,) = [c for c in cluster["worker_setup_commands"] if "doctor --deep" in c]
    words = shlex.split(command.split("&&")[-1])
    assert words[words.index("--device") + 1] == "cuda" and words[words.index("--json") + 1].endswith(".json")
    helptext = subprocess.run([sys.executable, "-m", "ablate", "doctor", "--help"], capture_output=True, text=True,
                              env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, cwd=REPO,
                              timeout=120).stdout
    assert all(flag in helptext for flag in ("--deep", "--device", "--json"))


def test_gpu_nodes_declare_driver_resources_equal_to_their_cpus_and_gpus(cluster: dict[str, Any]) -> None:
    workers = {name: t for name, t in cluster["available_node_types"].items() if name != cluster["head_node_type"]}
    assert workers
    for name, node_type in workers.items():
        resources = node_type["resources"]
        assert resources[DRIVER_CPU] == resources["CPU"] and resources[DRIVER_GPU] == resources["GPU"] > 0, name


@pytest.mark.parametrize("campaign", ["nam56r_gpu.yaml", "smoke.yaml"])
def test_every_campaign_fits_a_gpu_node(cluster: dict[str, Any], campaign: str) -> None:
    sweep, _ = load_sweep(REPO / "search_spaces" / campaign)
    need = block_need(plan_blocks(sweep, "fit"), sweep.resources)
    gpu = cluster["available_node_types"]["worker.gpu"]["resources"]
    nodes = [fit_node(need, f"gpu{i}", "aws", {k: float(v) for k, v in gpu.items()}) for i in range(2)]
    head = fit_node(need, "head", "aws", {"CPU": 0.0})
    capacity = plan_capacity(need, [head, *nodes], campaign=sweep.name)
    assert head.arms == 0 and all(node.arms >= 1 for node in nodes)
    assert capacity.max_concurrent == sum(node.arms for node in nodes)
