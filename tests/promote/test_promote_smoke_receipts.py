"""Receipts from a real smoke run: `bash scripts/smoke.sh`'s two rounds of search_spaces/smoke.yaml on the
2-core CPU machine (written by ``benchmarks/bench_smoke.py --keep``), decided with the single-node policy.

The assets were written by ``ablate sweep`` itself (trainers/receipt.py), so this catches drift between what the
runner records and what promotion reads, and it asserts the smoke run's real decisions: chunked SSD PROMOTE (a
true, large win), jagged MoE PROMOTE (clear on that lane: capacity factor 2.0), the inert recurrent toggle refused
before any arm ran, and the STP tax reported with its cost against its budget.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import HERE, SINGLE_NODE_POLICY

from ablate.promote import PROMOTE, TAX_REPORTED, load_policy, promote, with_overrides
from ablate.receipts.store import load_receipts
from ablate.tracking.mlflow_store import not_run_from_dir

RUN = HERE / "assets" / "smoke_run"


def test_the_smoke_run_ends_in_real_decisions(tmp_path: Path) -> None:
    policy = load_policy(SINGLE_NODE_POLICY)  # the shipped policy, resamples and all: what smoke.sh runs
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text((HERE.parents[1] / "search_spaces" / "defaults.yaml").read_text())
    receipts, rejected = load_receipts(RUN / "receipts")
    assert len(receipts) == 72 and rejected == []  # 2 rounds x 18 blocks x 2 arms, every one valid
    result = promote(receipts, policy_path=policy, defaults_path=defaults, rejected=rejected,
                     not_run=not_run_from_dir(RUN))
    assert result.refusals == [] and result.campaigns == ["smoke"] and len(result.rounds) == 2
    verdicts = {(v.feature, v.value): v for v in result.verdicts}
    chunked, jagged, stp = (verdicts[k] for k in (("mamba_scan", "chunked"), ("moe_dispatch", "jagged"),
                                                   ("stp", "on")))
    assert chunked.verdict == PROMOTE and chunked.lower_adj > 1.2, chunked.reason
    assert jagged.verdict == PROMOTE and jagged.lower_adj > 1.15, jagged.reason
    assert stp.verdict == TAX_REPORTED and stp.within_budget and stp.budget == 0.10
    for v in (chunked, jagged):
        # Interleaved arms; start-up excluded; no one-time cost to amortise on this eager lane.
        assert v.n_blocks == 8 and v.n_rounds == 2 and v.bootstrap_unit == "block"
        assert v.break_even["kind"] == "immediately" or abs(v.one_time_delta_s) < 0.2
        assert v.amdahl["bound"] is not None and v.steady_speedup <= v.amdahl["bound"] * 1.1
    [lane] = result.lanes
    assert lane.calibration.num_blocks == 12 and lane.calibration.contains_one
    assert lane.calibration.delta(policy) < 0.05 and lane.device_class == "cpu" and lane.threads == [1]
    assert {r.identity.pairing for r in receipts} == {"interleaved"}
    assert [n["what"] for n in result.not_run] == ["recurrent_scan=parallel"]
    assert "no R (recurrent) blocks" in result.not_run[0]["why"]
    # Two wins in one lane and no bundle blocks (the smoke campaign plans none yet): the set is held from --write,
    # and the report says which campaign to run.
    [bundle] = result.bundles
    assert bundle.status == "not_measured" and bundle.values == {"mamba_scan": "chunked", "moe_dispatch": "jagged"}
    assert result.changes == [] and "bundle not measured" in bundle.reason and "held from --write" in result.markdown
    # Without the bundle requirement, one CPU lane never flips a global default: both wins become lane overrides.
    lax = promote(receipts, policy_path=with_overrides(policy, {"bundle.required": False}), defaults_path=defaults)
    assert sorted((c.feature, c.scope) for c in lax.changes) == [("mamba_scan", "lane"), ("moe_dispatch", "lane")]
    md = result.markdown
    assert "### Trade-off: one-time cost against per-step speed" in md and "### Refused before any arm ran" in md
    assert json.loads(result.to_json())["lanes"][0]["label"].startswith("cpu · fp32 · 1 thread(s) · world 1")
