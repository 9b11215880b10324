"""Shared fixtures. Tests run from the repository root so search_spaces/ resolves."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]

# Keep Ray, torch and MLflow quiet and inside the sandbox; tests never reach the network.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# What ablate remembers per user (accepted receipt payloads, the empty MLflow store: ablate.user_cache): never in
# the user's own cache.
if "ABLATE_CACHE_DIR" not in os.environ:
    os.environ["ABLATE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ablate-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ABLATE_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


@pytest.fixture
def repo() -> Path:
    return REPO


SHARED_RAY = "ray_address"
"""The fixture of the modules that share one local Ray runtime. They run one after another (``pytest_collection_
modifyitems``), and the runtime stays up from one to the next when the last one left it idle: starting and stopping
Ray costs ~7 s a module on 2 CPUs."""

_shared_modules: set[Any] = set()
_started_here = [False]


def _uses_shared_ray(item: pytest.Item) -> bool:
    return SHARED_RAY in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after -k/-m deselect: a module whose Ray tests were deselected is not one of them
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The shared-Ray modules move, whole and in their order, to where the first of them was; nothing else moves."""
    modules: dict[Any, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(getattr(item, "module", None), []).append(item)
    shared = [module for module, group in modules.items()
              if module is not None and any(_uses_shared_ray(item) for item in group)]
    _shared_modules.update(shared)
    if len(shared) < 2:
        return
    ordered: list[pytest.Item] = []
    for module, group in modules.items():
        if module is shared[0]:
            ordered.extend(item for name in shared for item in modules[name])
        elif module not in _shared_modules:
            ordered.extend(group)
    items[:] = ordered


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    """The shared runtime stops before the first test outside the shared modules (and at the end): only those
    modules' tests run beside it."""
    yield
    if _started_here[0] and (nextitem is None or getattr(nextitem, "module", None) not in _shared_modules):
        import ray

        ray.shutdown()
        _started_here[0] = False


def _idle(ray: Any, wait_s: float = 10.0) -> bool:
    """Every scheduling resource free again and no placement group left, not even a pending one (the last module's
    trials, actors and tasks are gone), within ``wait_s``: Ray releases a finished trial's resources
    asynchronously. Actors without resources do not count: nothing waits for them."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + wait_s
    while True:
        try:
            free, total = ray.available_resources(), ray.cluster_resources()
            # Objects still in the store hold no scheduling resource: only what a block could wait for counts.
            if all(free.get(name) == amount for name, amount in total.items() if name != "object_store_memory") \
                    and len(ray.nodes()) == 1 \
                    and all(group.get("state") == "REMOVED" for group in placement_group_table().values()):
                return True
        except Exception:  # noqa: BLE001 - a runtime the last module broke: start a fresh one
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A real local Ray runtime with 2 CPUs, shared by the modules that ask for it: a module reuses the runtime the
    last one left idle, or starts a fresh one (anything still held, or none running)."""
    import ray

    from ablate.sweep.node_wait import prompt_node_wait
    from ablate.sweep.resources import local_ray_init_kwargs

    if ray.is_initialized() and not (_started_here[0] and _idle(ray)):
        ray.shutdown()
    if not ray.is_initialized():
        # "local": a cluster someone else started on this machine (``ray start``) is never attached to by accident.
        with prompt_node_wait():
            ray.init(address="local", **local_ray_init_kwargs(num_cpus=2, num_gpus=0), include_dashboard=False,
                     log_to_driver=False)
        _started_here[0] = True
    yield ray.get_runtime_context().gcs_address
