"""Fixtures for the promotion tests: a fast policy (fewer bootstrap resamples), a scratch defaults file."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))  # promote_sim

from ablate.promote import Policy, load_policy  # noqa: E402

DEFAULT_POLICY = REPO / "search_spaces" / "policies" / "default.yaml"
SINGLE_NODE_POLICY = REPO / "search_spaces" / "policies" / "single_node.yaml"
DEFAULTS = REPO / "search_spaces" / "defaults.yaml"
FAST = {"bootstrap.resamples": 2000, "bootstrap.loss_resamples": 500}


@pytest.fixture(scope="session")
def policy() -> Policy:
    return load_policy(DEFAULT_POLICY, overrides=FAST)


@pytest.fixture(scope="session")
def single_node_policy() -> Policy:
    return load_policy(SINGLE_NODE_POLICY, overrides=FAST)


@pytest.fixture
def defaults_file(tmp_path: Path) -> Path:
    target = tmp_path / "defaults.yaml"
    shutil.copy(DEFAULTS, target)
    return target
