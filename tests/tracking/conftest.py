"""Fixtures shared by the tracking tests: one real smoke block (two arms run by ``trainers.run_arm`` in fresh
processes, no Ray), under a sweep id shaped like the runner's (``<campaign>-<date>-<time>-<4 hex>``)."""

from __future__ import annotations

import pytest
from sweeps_common import tiny_smoke

from ablate.config.load import load_sweep
from ablate.receipts.schema import Receipt
from ablate.sweep.plan import plan_sweep
from ablate.sweep.trial import make_arm_spec

SWEEP_ID = "smoke-20261123-001547-3f2a"


@pytest.fixture(scope="session")
def block_arms(tmp_path_factory: pytest.TempPathFactory) -> list[Receipt]:
    """The two receipts of the moe_dispatch block, in the order they ran."""
    from trainers import run_arm

    directory = tmp_path_factory.mktemp("block-arms")
    sweep, _ = load_sweep(tiny_smoke(directory))
    block = next(b for b in plan_sweep(sweep, SWEEP_ID).blocks if b.feature == "moe_dispatch")
    return [run_arm(make_arm_spec(block, position, arm, sweep_id=SWEEP_ID, campaign=sweep.name,
                                  receipt_dir=str(directory / "receipts")))
            for position, arm in block.run_order()]
