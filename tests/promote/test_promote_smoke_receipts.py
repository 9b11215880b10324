"""Receipts from a real smoke sweep (search_spaces/smoke.yaml with blocks: 2, aa_blocks: 2, run on 2 CPUs).

The assets were written by ``ablate sweep`` itself (trainers/receipt.py), so this catches drift between what
the runner records and what promotion reads: per-arm feature values, A/A kind, block ids per sweep, 1.x schema.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import HERE

from ablate.promote import HOLD, Policy, promote
from ablate.receipts.store import load_receipts

ASSETS = HERE / "assets" / "smoke_receipts"


def test_a_real_smoke_sweep_is_matched_calibrated_and_held(single_node_policy: Policy, tmp_path: Path) -> None:
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text("version: 1\nfeatures:\n  moe_dispatch: {value: padded, kind: speed}\n"
                        "  mamba_scan: {value: sequential, kind: speed}\n")
    receipts, rejected = load_receipts(ASSETS)
    assert len(receipts) == 12 and rejected == []
    result = promote(receipts, policy_path=single_node_policy, defaults_path=defaults, rejected=rejected)
    assert result.refusals == [] and result.campaigns == ["smoke"] and len(result.rounds) == 1
    assert sorted((v.feature, v.value, v.baseline_value) for v in result.verdicts) == [
        ("mamba_scan", "chunked", "sequential"), ("moe_dispatch", "jagged", "padded")]
    [lane] = result.lanes
    assert lane.calibration.num_blocks == 2 and lane.calibration.loss_spread == 0.0  # deterministic CPU twins
    for v in result.verdicts:
        # One sweep of 2 blocks per feature: evidence too thin, whatever the speedup says.
        assert v.verdict == HOLD and v.reason.startswith("2 blocks < 8") and v.bootstrap_unit == "block"
        assert v.n_blocks == 2 and v.order == {} and v.amdahl["bound"] > 1.0
        assert v.epsilon == single_node_policy.quality.min_epsilon and abs(v.loss_delta) < v.epsilon
    assert result.changes == [] and "block bootstrap" in result.markdown
    assert json.loads(result.to_json())["lanes"][0]["hosts"] == ["vm"]
