"""Shared fixtures. Tests run from the repository root so search_spaces/ resolves."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]

# Keep Ray, torch and MLflow quiet and inside the sandbox; tests never reach the network.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Accepted receipt payloads are remembered per machine (ablate.receipts.accepted): never in the user's cache.
if "ABLATE_CACHE_DIR" not in os.environ:
    os.environ["ABLATE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ablate-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ABLATE_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A real local Ray runtime with 2 CPUs, one per test module (start-up costs seconds)."""
    import ray

    from ablate.sweep.resources import local_ray_init_kwargs

    ray.init(**local_ray_init_kwargs(num_cpus=2, num_gpus=0), include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
