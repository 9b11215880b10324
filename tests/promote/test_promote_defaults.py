"""--write: defaults.yaml keeps comments and order, gains evidence, and marks stale evidence for revalidation."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import DEFAULTS
from promote_sim import FeatureTruth, Sim, base_lane, moe, simulate
from ruamel.yaml import YAML

from ablate.config.load import load_defaults
from ablate.promote import PROMOTE, REJECT, Policy, promote, render_defaults, write_defaults

QUIET = {"noise": 0.007, "aa_per_host": 2}


def comments(text: str) -> list[str]:
    return [m.group(0).strip() for m in re.finditer(r"#.*", text)]


def keys(path: Path) -> tuple[list[str], list[str]]:
    data = YAML(typ="safe").load(path.read_text())
    return list(data), list(data["features"])


def test_write_keeps_comments_and_order_and_records_evidence(policy: Policy, defaults_file: Path) -> None:
    before = defaults_file.read_text()
    result = promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=policy,
                     defaults_path=defaults_file)
    v = result.verdicts[0]
    assert v.verdict == PROMOTE
    edits = write_defaults(result, defaults_file)
    after = defaults_file.read_text()
    assert edits == ["features.moe_dispatch.value: 'padded' -> 'jagged'",
                     f"features.moe_dispatch.evidence += {result.report_id} on {v.lane_key}"]
    assert write_defaults(result, defaults_file) == []  # idempotent: --write then --branch adds nothing twice
    assert comments(after) == comments(before)  # every comment, in order
    assert keys(defaults_file) == (["version", "features"], ["moe_dispatch", "mla_ingress", "fused_residual",
                                                             "mamba_scan", "recurrent_scan", "compile", "warmup",
                                                             "stp"])
    assert "value: jagged        # reference: route, permute" in after  # the comment stays on its line
    untouched = before.split("  mla_ingress:")[1]
    assert after.split("  mla_ingress:")[1] == untouched  # other entries byte-identical (quotes kept: 'off')
    defaults = load_defaults(defaults_file)  # the sweep loader still accepts it
    assert defaults.values["moe_dispatch"] == "jagged"
    record = defaults.raw["features"]["moe_dispatch"]["evidence"][0]
    assert record["report"] == result.report_id and record["speedup"] == round(v.speedup, 4)
    assert record["ci95"] == [round(x, 4) for x in v.ci95] and record["blocks"] == 12 and record["hosts"] == 3
    assert record["lane_key"] == v.lane_key and record["software_fingerprint"] == "sw-1"
    assert record["rounds"] == ["sim-r1", "sim-r2"] and record["policy"] == "default@1"
    assert record["revalidate_when"] == ["software_fingerprint_change", "lane_key_change"]
    assert str(record["date"]) == result.date and record["previous"] == "padded"


def test_nothing_promoted_leaves_the_file_byte_identical(policy: Policy, defaults_file: Path) -> None:
    before = defaults_file.read_text()
    result = promote(simulate(Sim(features=[moe(1.0)], **QUIET), 0), policy_path=policy,
                     defaults_path=defaults_file)
    assert result.changes == []
    text, edits = render_defaults(before, result)
    assert edits == [] and text == before  # the round trip itself changes nothing
    assert write_defaults(result, defaults_file) == [] and defaults_file.read_text() == before


def test_a_win_in_one_lane_only_becomes_a_lane_override(policy: Policy, defaults_file: Path) -> None:
    lane_a, lane_b = base_lane(), base_lane(**{"batch.seq_len": 128})
    receipts = (simulate(Sim(features=[moe(1.05)], lane=lane_a, block_prefix="A-", **QUIET), 0)
                + simulate(Sim(features=[moe(1.0)], lane=lane_b, block_prefix="B-", **QUIET), 1))
    result = promote(receipts, policy_path=policy, defaults_path=defaults_file)
    assert sorted(v.verdict for v in result.verdicts) == [PROMOTE, REJECT]
    [change] = result.changes
    assert change.scope == "lane" and change.new is None
    write_defaults(result, defaults_file)
    defaults = load_defaults(defaults_file)
    entry = defaults.raw["features"]["moe_dispatch"]
    assert defaults.values["moe_dispatch"] == "padded"  # the global default does not flip
    promoted_lane = next(v.lane_key for v in result.verdicts if v.verdict == PROMOTE)
    assert entry["lane_overrides"] == [{"lane_key": promoted_lane, "value": "jagged", "report": result.report_id}]
    assert entry["evidence"][0]["scope"] == "lane"
    assert "lane override" in result.markdown


def test_a_fingerprint_change_marks_the_earlier_promotion_for_revalidation(policy: Policy,
                                                                           defaults_file: Path) -> None:
    first = promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=policy,
                    defaults_path=defaults_file)
    write_defaults(first, defaults_file)
    # Later campaign on the same lane shape (its baseline now has jagged, so its lane key differs) under new
    # software: the recorded moe_dispatch evidence no longer describes what runs.
    later = Sim(features=[FeatureTruth("mamba_scan", "chunked", "sequential", 1.0)],
                lane=base_lane(**{"features.moe_dispatch": "jagged"}), fingerprints=["sw-2", "sw-2"],
                campaign="later", block_prefix="L-", **QUIET)
    second = promote(simulate(later, 4), policy_path=policy, defaults_path=defaults_file)
    assert second.verdicts[0].lane_key != first.verdicts[0].lane_key
    [reval] = second.revalidations
    assert (reval.feature, reval.value, reval.recorded_fingerprint, reval.current_fingerprint) == (
        "moe_dispatch", "jagged", "sw-1", "sw-2")
    assert "Needs revalidation" in second.markdown
    edits = write_defaults(second, defaults_file)
    assert edits == [f"features.moe_dispatch.evidence[{reval.lane_key}]: revalidation required"]
    record = load_defaults(defaults_file).raw["features"]["moe_dispatch"]["evidence"][0]
    assert record["revalidate"]["required"] is True and record["revalidate"]["current_fingerprint"] == "sw-2"
    # Marked once: running promote again on the same receipts does not flag it a second time.
    again = promote(simulate(later, 4), policy_path=policy, defaults_path=defaults_file)
    assert again.revalidations == []


def test_the_repository_defaults_file_is_not_touched_by_promote(policy: Policy) -> None:
    before = DEFAULTS.read_text()
    promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=policy, defaults_path=DEFAULTS)
    assert DEFAULTS.read_text() == before  # promote decides; only write_defaults writes
