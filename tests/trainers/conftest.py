"""One local Ray runtime for the trainer modules that run Ray Train (``test_ray_train``, ``test_train_start``): they
run one after the other, and starting and stopping Ray costs each of them several seconds on 2 CPUs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from ablate.sweep.node_wait import prompt_node_wait

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="package")
def train_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Ray with 2 CPUs; yields the workers' ``TORCH_EXTENSIONS_DIR`` (empty: no DeepSpeed op may be built there)."""
    ray = pytest.importorskip("ray")
    extensions = tmp_path_factory.mktemp("torch_extensions")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TORCH_EXTENSIONS_DIR": str(extensions)}
    with prompt_node_wait():
        ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env},
                 log_to_driver=False)
    try:
        yield extensions
    finally:
        ray.shutdown()
