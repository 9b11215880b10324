"""--write: defaults.yaml keeps comments and order, gains evidence, and marks stale evidence for revalidation."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Optional
from types import SimpleNamespace

import pytest
from conftest import DEFAULTS
from promote_sim import FeatureTruth, Sim, base_lane, moe, simulate
from ruamel.yaml import YAML

from ablate.config.load import flatten, lane_to_dict, load_defaults
from ablate.config.schema import LaneConfig
from ablate.promote import PROMOTE, REJECT, Policy, promote, render_defaults, with_overrides, write_defaults
from ablate.promote import defaults_writer, rule
from ablate.promote.analysis import FeatureVerdict

QUIET = {"noise": 0.007, "aa_per_host": 2}


def anywhere(policy: Policy) -> Policy:
    """The policy without the device-class condition: simulated receipts are CPU arms, and these tests are about
    what a global flip writes, not about which evidence may cause one."""
    return with_overrides(policy, {"scope.global_device_classes": []})


def comments(text: str) -> list[str]:
    return [m.group(0).strip() for m in re.finditer(r"#.*", text)]


def keys(path: Path) -> tuple[list[str], list[str]]:
    data = YAML(typ="safe").load(path.read_text())
    return list(data), list(data["features"])


def test_write_keeps_comments_and_order_and_records_evidence(policy: Policy, defaults_file: Path) -> None:
    before = defaults_file.read_text()
    result = promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=anywhere(policy),
                     defaults_path=defaults_file)
    v = result.verdicts[0]
    assert v.verdict == PROMOTE
    edits = write_defaults(result, defaults_file)
    after = defaults_file.read_text()
    assert edits == ["features.moe_dispatch.value: 'padded' -> 'jagged'",
                     f"features.moe_dispatch.evidence += {result.report_id} on {v.lane_key}"]
    assert write_defaults(result, defaults_file) == []  # idempotent: --write then --branch adds nothing twice
    flipped = f"# promoted by {result.report_id} on {result.date} (was padded); evidence below"
    old_comment = "# reference: route, permute, pad to capacity, batched GEMM"
    # Every comment, in order, except the flipped line's: it described the old value.
    assert comments(after) == [flipped if c == old_comment else c for c in comments(before)]
    assert keys(defaults_file) == (["version", "features"], ["moe_dispatch", "mla_ingress", "fused_residual",
                                                             "mamba_scan", "recurrent_scan", "compile", "warmup",
                                                             "stp"])
    assert f"value: jagged        {flipped}" in after  # same column as before
    untouched = before.split("  mla_ingress:")[1]
    assert after.split("  mla_ingress:")[1] == untouched  # other entries byte-identical (quotes kept: 'off')
    defaults = load_defaults(defaults_file)  # the sweep loader still accepts it
    assert defaults.values["moe_dispatch"] == "jagged"
    record = defaults.raw["features"]["moe_dispatch"]["evidence"][0]
    assert record["report"] == result.report_id and record["speedup"] == round(v.speedup, 4)
    assert record["ci95"] == [round(x, 4) for x in v.ci95] and record["blocks"] == 12 and record["hosts"] == 3
    assert record["lane_key"] == v.lane_key and record["software_fingerprint"] == "sw-1"
    assert record["rounds"] == ["sim-r1", "sim-r2"] and record["policy"] == policy.ref
    assert record["revalidate_when"] == ["software_fingerprint_change", "lane_key_change"]
    assert str(record["date"]) == result.date and record["previous"] == "padded"
    assert record["previous_comment"] == old_comment[2:]


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
    # Lane B did not promote (REJECT or HOLD: either way not every lane did), so nothing flips globally.
    assert [v.verdict == PROMOTE for v in sorted(result.verdicts, key=lambda v: v.verdict != PROMOTE)] == [True,
                                                                                                          False]
    [change] = result.changes
    assert change.scope == "lane" and change.new is None
    write_defaults(result, defaults_file)
    defaults = load_defaults(defaults_file)
    entry = defaults.raw["features"]["moe_dispatch"]
    assert defaults.values["moe_dispatch"] == "padded"  # the global default does not flip
    promoted_lane = next(v.lane_key for v in result.verdicts if v.verdict == PROMOTE)
    shape = next(v.lane_shape for v in result.verdicts if v.verdict == PROMOTE)
    assert entry["lane_overrides"] == [{"lane_shape": shape, "value": "jagged", "previous": "padded",
                                        "report": result.report_id, "date": result.date}]
    assert defaults.for_shape(shape)["moe_dispatch"] == "jagged"  # what that lane's next baseline runs
    assert entry["evidence"][0]["lane_key"] == promoted_lane
    assert entry["evidence"][0]["scope"] == "lane"
    assert "lane override" in result.markdown


def test_a_fingerprint_change_marks_the_earlier_promotion_for_revalidation(policy: Policy,
                                                                           defaults_file: Path) -> None:
    first = promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=anywhere(policy),
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


def test_the_old_receipts_of_the_recorded_lane_do_not_hide_its_new_software(policy: Policy,
                                                                             defaults_file: Path) -> None:
    """A promotion reads every sweep of the experiment (MLflow's default), so the recorded lane key is still
    measured in the campaign that promoted it, under the old software: its shape's lane measured as late or later
    under new software is what runs now, and the evidence is marked (found in review: the exact key was taken
    first, and nothing was marked)."""
    first_receipts = simulate(Sim(features=[moe(1.05)], **QUIET), 0)
    first = promote(first_receipts, policy_path=anywhere(policy), defaults_path=defaults_file)
    write_defaults(first, defaults_file)
    later = Sim(features=[FeatureTruth("mamba_scan", "chunked", "sequential", 1.0)],
                lane=base_lane(**{"features.moe_dispatch": "jagged"}), fingerprints=["sw-2", "sw-2"],
                campaign="later", block_prefix="L-", **QUIET)
    both = promote(first_receipts + simulate(later, 4), policy_path=policy, defaults_path=defaults_file)
    assert {lane.software_fingerprint for lane in both.lanes} == {"sw-1", "sw-2"}
    [reval] = both.revalidations
    assert (reval.feature, reval.recorded_fingerprint, reval.current_fingerprint) == ("moe_dispatch", "sw-1", "sw-2")
    assert write_defaults(both, defaults_file) == [
        f"features.moe_dispatch.evidence[{reval.lane_key}]: revalidation required"]
    # The promoting campaign alone (its lane last measured under sw-1, the record's software): nothing to mark.
    assert promote(first_receipts, policy_path=anywhere(policy), defaults_path=defaults_file).revalidations == []


def test_the_repository_defaults_file_is_not_touched_by_promote(policy: Policy) -> None:
    before = DEFAULTS.read_text()
    promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=policy, defaults_path=DEFAULTS)
    assert DEFAULTS.read_text() == before  # promote decides; only write_defaults writes


# --- writer-level: hand-made verdicts, no receipts (scope, overrides, comments, counts) ---

DATE = "2026-03-09"


def flat(**changes: object) -> dict:
    lane = flatten(lane_to_dict(LaneConfig()))
    lane.update(changes)
    return lane


CPU_LANE = flat()
CUDA_LANE = flat(**{"hardware.device": "cuda", "precision": "bf16", "batch.seq_len": 256})


def verdict(lane: dict, device: str, *, feature: str = "moe_dispatch", value: str = "jagged",
            baseline: str = "padded", outcome: str = PROMOTE, context: str = "") -> FeatureVerdict:
    from ablate.config.lane_shape import lane_shape

    shape = lane_shape(lane)
    return FeatureVerdict(feature=feature, value=value, baseline_value=baseline, kind="speed",
                          lane_key=f"lane-{device}-{shape[6:12]}{context}", software_fingerprint="sw-1",
                          lane_shape=shape, device_class=device, verdict=outcome, speedup=1.08, ci95=(1.04, 1.12),
                          n_blocks=12, n_hosts=3)


def write(path: Path, verdicts: list[FeatureVerdict], policy: Policy, report: str,
          revalidations: tuple = ()) -> tuple[list, list[str]]:
    """plan_changes + the round-trip edit, as `promote --write` runs them; returns (changes, edits)."""
    changes = defaults_writer.plan_changes(verdicts, load_defaults(path), policy, report_id=report, campaign="c",
                                           date=DATE)
    result = SimpleNamespace(changes=changes, revalidations=list(revalidations), report_id=report, date=DATE)
    text, edits = render_defaults(path.read_text(), result)
    path.write_text(text)
    load_defaults(path)  # whatever was written, the loader accepts
    return changes, edits


def test_cpu_only_evidence_never_flips_the_global_value(policy: Policy, defaults_file: Path) -> None:
    assert policy.scope.global_device_classes == ("cuda",)
    # One lane measured: "every lane promoted" holds trivially, yet a CPU lane must not decide GPU defaults.
    [change] = defaults_writer.plan_changes([verdict(CPU_LANE, "cpu")], load_defaults(defaults_file), policy,
                                            report_id="r1", campaign="c", date=DATE)
    assert (change.scope, change.new) == ("lane", None)
    assert change.overrides == {verdict(CPU_LANE, "cpu").lane_shape: "jagged"}
    assert any("no promoting lane on cuda" in why for why in change.not_global)
    # The same evidence plus a promoting cuda lane flips it everywhere ...
    [change] = defaults_writer.plan_changes([verdict(CPU_LANE, "cpu"), verdict(CUDA_LANE, "cuda")],
                                            load_defaults(defaults_file), policy, report_id="r1", campaign="c",
                                            date=DATE)
    assert (change.scope, change.new, change.overrides) == ("global", "jagged", {})
    # ... unless the value was rejected somewhere.
    rejected = verdict(flat(**{"batch.seq_len": 128}), "cpu", outcome=REJECT)
    [change] = defaults_writer.plan_changes([verdict(CPU_LANE, "cpu"), verdict(CUDA_LANE, "cuda"), rejected],
                                            load_defaults(defaults_file), policy, report_id="r1", campaign="c",
                                            date=DATE)
    assert change.scope == "lane" and set(change.overrides) == {verdict(CPU_LANE, "cpu").lane_shape,
                                                                verdict(CUDA_LANE, "cuda").lane_shape}


def test_a_cpu_only_promotion_is_written_as_that_lanes_override(policy: Policy, defaults_file: Path) -> None:
    _, edits = write(defaults_file, [verdict(CPU_LANE, "cpu")], policy, "r1")
    defaults = load_defaults(defaults_file)
    assert defaults.values["moe_dispatch"] == "padded"  # the global value stays
    assert defaults.effective(CPU_LANE)["moe_dispatch"] == "jagged"  # the lane's next baseline
    assert defaults.effective(CUDA_LANE)["moe_dispatch"] == "padded"
    assert defaults_writer.num_promoted(edits) == 1


def test_a_second_promotion_on_a_lane_updates_its_override(policy: Policy, defaults_file: Path) -> None:
    write(defaults_file, [verdict(CPU_LANE, "cpu")], policy, "r1")
    # Next campaign on the same lane (a new seed, so a new lane key): its baseline is now jagged.
    again = verdict(dict(CPU_LANE, seed=3), "cpu", value="grouped_mm", baseline="jagged", context="-s3")
    _, edits = write(defaults_file, [again], policy, "r2")
    shape = again.lane_shape
    assert f"features.moe_dispatch.lane_overrides[{shape}]: 'jagged' -> 'grouped_mm'" in edits
    assert defaults_writer.num_promoted(edits) == 1
    entry = load_defaults(defaults_file).raw["features"]["moe_dispatch"]
    assert entry["lane_overrides"] == [{"lane_shape": shape, "value": "grouped_mm", "previous": "jagged",
                                        "report": "r2", "date": DATE}]  # updated, not appended
    assert [r["report"] for r in entry["evidence"]] == ["r1", "r2"]  # both pieces of evidence are kept
    assert load_defaults(defaults_file).effective(CPU_LANE)["moe_dispatch"] == "grouped_mm"


def test_lanes_of_one_shape_that_disagree_get_no_override(policy: Policy, defaults_file: Path) -> None:
    # Two grid contexts of one lane shape: one promotes jagged, the other rejects it.
    won = verdict(CPU_LANE, "cpu", context="-ctx1")
    lost = verdict(CPU_LANE, "cpu", outcome=REJECT, context="-ctx2")
    [change], edits = write(defaults_file, [won, lost], policy, "r1")
    assert change.scope == "lane" and change.overrides == {}
    assert defaults_writer.num_promoted(edits) == 0
    assert load_defaults(defaults_file).effective(CPU_LANE)["moe_dispatch"] == "padded"


def test_a_lane_of_the_shape_that_held_or_measured_another_value_blocks_the_override(policy: Policy,
                                                                                     defaults_file: Path) -> None:
    # A grid campaign: the defaults lane held (a tie, a failure rate...) while a context lane of the same shape
    # promoted. The override would make the defaults lane run the value its own verdict did not earn.
    won = verdict(CPU_LANE, "cpu", context="-ctx1")
    for sibling in (verdict(CPU_LANE, "cpu", outcome="HOLD", context="-ctx0"),
                    verdict(CPU_LANE, "cpu", value="grouped_mm", outcome="HOLD", context="-ctx2")):
        [change], edits = write(defaults_file, [won, sibling], policy, "r1")
        assert change.scope == "lane" and change.overrides == {}, change.overrides
        assert any(sibling.lane_key[:12] in why and "HOLD" in why for why in change.not_global), change.not_global
        assert defaults_writer.num_promoted(edits) == 0
        assert load_defaults(defaults_file).effective(CPU_LANE)["moe_dispatch"] == "padded"
    # Alone, the promoting lane gets its override (the control) ...
    [change], _ = write(defaults_file, [won], policy, "r2")
    assert change.overrides == {won.lane_shape: "jagged"}
    # ... and so it does beside its own rival value's HOLD or REJECT (the value that lost to it in that lane).
    for outcome in ("HOLD", REJECT):
        rival = verdict(CPU_LANE, "cpu", value="grouped_mm", outcome=outcome, context="-ctx1")
        [change], _ = write(defaults_file, [won, rival], policy, "r3")
        assert change.overrides == {won.lane_shape: "jagged"}, change.not_global


def test_revalidation_marks_the_override_the_lane_runs(policy: Policy, defaults_file: Path) -> None:
    v = verdict(CPU_LANE, "cpu")
    write(defaults_file, [v], policy, "r1")
    reval = defaults_writer.Revalidation(feature="moe_dispatch", value="jagged", lane_key=v.lane_key,
                                         recorded_fingerprint="sw-1", current_fingerprint="sw-2", report="r1")
    _, edits = write(defaults_file, [], policy, "r9", revalidations=(reval,))
    assert edits == [f"features.moe_dispatch.evidence[{v.lane_key}]: revalidation required",
                     f"features.moe_dispatch.lane_overrides[{v.lane_shape}]: revalidation required"]
    entry = load_defaults(defaults_file).raw["features"]["moe_dispatch"]
    for marked in (entry["evidence"][0], entry["lane_overrides"][0]):
        assert marked["revalidate"]["required"] is True and marked["revalidate"]["current_fingerprint"] == "sw-2"


def test_a_flip_replaces_the_old_comment_and_counts_one_value(policy: Policy, defaults_file: Path) -> None:
    before = defaults_file.read_text()
    promoted = [verdict(CPU_LANE, "cpu", feature="mamba_scan", value="chunked", baseline="sequential"),
                verdict(CUDA_LANE, "cuda", feature="mamba_scan", value="chunked", baseline="sequential")]
    _, edits = write(defaults_file, promoted, policy, "r1")
    after = defaults_file.read_text()
    # One value promoted, though the flip also appended two evidence records.
    assert len(edits) == 3 and defaults_writer.num_promoted(edits) == 1
    line = next(x for x in after.splitlines() if "value: chunked" in x)
    assert line == "    value: chunked       # promoted by r1 on 2026-03-09 (was sequential); evidence below"
    assert "reference SSD recurrence" not in line  # it described the old value
    record = load_defaults(defaults_file).raw["features"]["mamba_scan"]["evidence"][0]
    assert record["previous_comment"] == "reference SSD recurrence" and record["device_class"] == "cpu"
    assert after.split("  recurrent_scan:")[1] == before.split("  recurrent_scan:")[1]  # the rest is untouched


def test_baseline_is_default_reads_the_lanes_override(policy: Policy, defaults_file: Path) -> None:
    import numpy as np

    from ablate.promote.analysis import Work

    write(defaults_file, [verdict(CPU_LANE, "cpu")], policy, "r1")
    defaults = load_defaults(defaults_file)
    # The next campaign on that lane measures grouped_mm against its override, jagged: that is its default.
    v = verdict(CPU_LANE, "cpu", value="grouped_mm", baseline="jagged")
    v.work = Work(log_ratios=np.zeros(8), hosts=np.array(["h"] * 8), candidate_first=np.ones(8, bool),
                  theta=np.zeros(8))
    clause = next(c for c in rule._promote_clauses(v, policy, defaults) if c.__name__ == "current_baseline")()
    assert clause.passed, clause.detail
    # On a lane without the override, jagged is not the default: the clause holds the promotion back.
    v.lane_shape = verdict(CUDA_LANE, "cuda").lane_shape
    clause = next(c for c in rule._promote_clauses(v, policy, defaults) if c.__name__ == "current_baseline")()
    assert not clause.passed and "the default is 'padded'" in clause.detail


def test_a_lane_promotion_of_a_feature_without_an_entry_keeps_the_registry_value_for_other_lanes(
        policy: Policy, defaults_file: Path) -> None:
    # The campaign pinned bucket_cap_mb to 50 MB (the registry's reference is 25): a new entry written with 50 as
    # its value would move every other lane's baseline to 50, though no verdict promoted it anywhere.
    reference = LaneConfig().engine.bucket_cap_mb
    assert reference == 25.0 and "bucket_cap_mb" not in load_defaults(defaults_file).values
    lane = flat(**{"engine.bucket_cap_mb": 50.0, "engine.workers": 2})
    v = verdict(lane, "cpu", feature="bucket_cap_mb", value=100.0, baseline=50.0)
    [change], edits = write(defaults_file, [v], policy, "r1")
    assert (change.scope, change.old, change.overrides) == ("lane", reference, {v.lane_shape: 100.0})
    assert change.evidence[0]["previous"] == 50.0  # the lane's own baseline is still recorded as such
    assert defaults_writer.num_promoted(edits) == 1
    defaults = load_defaults(defaults_file)
    assert defaults.values["bucket_cap_mb"] == reference
    assert defaults.effective(lane)["bucket_cap_mb"] == 100.0  # the promoting lane's shape gets its override
    assert defaults.effective(flat(**{"engine.workers": 2, "batch.seq_len": 128}))["bucket_cap_mb"] == reference
    # A global flip of a feature without an entry records the reference as the value it replaced.
    cuda = flat(**{"hardware.device": "cuda", "precision": "bf16", "engine.workers": 2})
    pinned = {"feature": "reduce_bucket_size", "value": 10**8, "baseline": 3 * 10**7}
    flips = [verdict(flat(**{"engine.workers": 2}), "cpu", **pinned), verdict(cuda, "cuda", **pinned)]
    [change], _ = write(defaults_file, flips, policy, "r2")
    replaced = LaneConfig().engine.reduce_bucket_size
    assert change.scope == "global" and change.old == replaced != 3 * 10**7
    assert {r["replaced"] for r in change.evidence} == {replaced}


def test_write_keeps_the_files_mode_and_symlink_and_leaves_no_temporary_file(
        policy: Policy, defaults_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=anywhere(policy),
                     defaults_path=defaults_file)
    before = defaults_file.read_text()

    # A failed replace (a busy file, another filesystem) leaves the file as it was and no temporary beside it.
    def refused(src: object, dst: object) -> None:
        raise OSError(errno.EBUSY, "Device or resource busy", str(dst))

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="busy"):
        write_defaults(result, defaults_file)
    monkeypatch.undo()
    assert defaults_file.read_text() == before and list(defaults_file.parent.iterdir()) == [defaults_file]
    # A group-writable file shared through a symlink stays both: the promotion lands in the link's target.
    shared = defaults_file.parent / "shared" / "defaults.yaml"
    shared.parent.mkdir()
    defaults_file.rename(shared)
    shared.chmod(0o664)
    defaults_file.symlink_to(shared)
    assert write_defaults(result, defaults_file)
    assert defaults_file.is_symlink() and load_defaults(shared).values["moe_dispatch"] == "jagged"
    assert stat.S_IMODE(shared.stat().st_mode) == 0o664
    assert sorted(p.name for p in shared.parent.iterdir()) == ["defaults.yaml"]


def test_a_plan_is_never_written_over_a_file_changed_since_it_was_decided(policy: Policy,
                                                                          defaults_file: Path) -> None:
    """Two promotions decided against the same file (two ``promote --write`` at once, or a result kept and written
    later): the second would replace a value promoted meanwhile with one measured only against the old default,
    and record the wrong value to roll back to. It is refused with the file named, and the file keeps the first."""
    from ablate.config.schema import ConfigError

    knobs = {**QUIET, "aa_per_host": 2}
    jagged = simulate(Sim(features=[FeatureTruth("moe_dispatch", "jagged", "padded", 1.05)], campaign="ca",
                          block_prefix="a-", **knobs), 0)
    grouped = simulate(Sim(features=[FeatureTruth("moe_dispatch", "grouped_mm", "padded", 1.05)], campaign="cb",
                           block_prefix="b-", **knobs), 1)
    first = promote(jagged, policy_path=anywhere(policy), defaults_path=defaults_file)
    second = promote(grouped, policy_path=anywhere(policy), defaults_path=defaults_file)
    assert [c.new for c in first.changes] == ["jagged"] and [c.new for c in second.changes] == ["grouped_mm"]
    assert write_defaults(first, defaults_file)
    written = defaults_file.read_text()
    with pytest.raises(ConfigError, match="changed since this promotion read it"):
        write_defaults(second, defaults_file)
    assert defaults_file.read_text() == written
    assert load_defaults(defaults_file).values["moe_dispatch"] == "jagged"
    # The same result again over what it wrote (``--write --branch``): accepted, and nothing more is written.
    assert write_defaults(first, defaults_file) == [] and defaults_file.read_text() == written


def test_a_value_measured_before_another_was_written_is_held(policy: Policy, defaults_file: Path) -> None:
    """Two campaigns planned on the same defaults, promoted by two ``promote --write`` runs: the second value was
    measured with the first feature's old value, and written it would run with the new one, a pair no block
    measured (one run over both campaigns holds it under the bundle rule). It is held, with the reason; measured
    again on the lane as the defaults make it now, it promotes."""
    knobs = {**QUIET, "aa_per_host": 2}
    moe_campaign = simulate(Sim(features=[moe(1.05)], campaign="c1", block_prefix="c1-", **knobs), 0)
    scan = FeatureTruth("mamba_scan", "chunked", "sequential", 1.06)
    scan_campaign = simulate(Sim(features=[scan], campaign="c2", block_prefix="c2-", **knobs), 1)
    assert {r.requested.lane["features.moe_dispatch"] for r in scan_campaign} == {"padded"}
    first = promote(moe_campaign, policy_path=anywhere(policy), defaults_path=defaults_file)
    assert write_defaults(first, defaults_file)
    second = promote(scan_campaign, policy_path=anywhere(policy), defaults_path=defaults_file)
    assert [v.verdict for v in second.verdicts] == [PROMOTE]
    [change] = second.changes
    assert change.new is None and "moe_dispatch=padded" in change.held and "moe_dispatch=jagged" in change.held
    assert "held" in second.markdown
    written = defaults_file.read_text()
    assert write_defaults(second, defaults_file) == [] and defaults_file.read_text() == written
    assert load_defaults(defaults_file).values["mamba_scan"] == "sequential"
    # Planned after the write, its lane runs moe_dispatch=jagged: nothing holds it, read alone or with the whole
    # experiment (MLflow's default), where the outdated lane's test is history once its shape was measured again.
    later = simulate(Sim(features=[scan], lane=base_lane(**{"features.moe_dispatch": "jagged"}), campaign="c3",
                         block_prefix="c3-", **knobs), 2)
    third = promote(later, policy_path=anywhere(policy), defaults_path=defaults_file)
    assert [c.new for c in third.changes] == ["chunked"] and not third.changes[0].held
    everything = promote(scan_campaign + later, policy_path=anywhere(policy), defaults_path=defaults_file)
    assert sorted(v.verdict for v in everything.verdicts) == [PROMOTE, PROMOTE]
    [change] = everything.changes
    assert change.new == "chunked" and not change.held
    assert [r["lane_key"] for r in change.evidence] == [third.verdicts[0].lane_key]  # the lane that runs now


def test_a_lane_is_outdated_by_any_value_the_file_replaced_since(policy: Policy, defaults_file: Path) -> None:
    """Two promotions in a row (eager -> regional -> whole): a campaign measured with ``eager`` is two writes out of
    date, and no single record names both ``eager`` and ``whole``; it is held all the same (found in review)."""
    knobs = {**QUIET, "aa_per_host": 2}
    scan = simulate(Sim(features=[FeatureTruth("mamba_scan", "chunked", "sequential", 1.06)], campaign="c2",
                        block_prefix="c2-", **knobs), 1)
    assert {r.requested.lane["compile.posture"] for r in scan} == {"eager"}
    for number, (new, old) in enumerate([("regional", "eager"), ("whole", "regional")]):
        step = simulate(Sim(features=[FeatureTruth("compile", new, old, 1.05)], campaign=f"k{number}",
                            lane=base_lane(**{"compile.posture": old}), block_prefix=f"k{number}-", **knobs), number)
        assert write_defaults(promote(step, policy_path=anywhere(policy), defaults_path=defaults_file),
                              defaults_file)
    assert load_defaults(defaults_file).values["compile"] == "whole"
    result = promote(scan, policy_path=anywhere(policy), defaults_path=defaults_file)
    [change] = result.changes
    assert change.new is None and "compile=eager" in change.held and "compile=whole" in change.held
    assert write_defaults(result, defaults_file) == []


@pytest.mark.parametrize("content", [None, "features:\n  moe_dispatch: {value: caf\xe9}\n".encode("latin-1")],
                         ids=["missing", "not-utf8"])
def test_a_defaults_file_that_cannot_be_read_is_refused_by_name(policy: Policy, tmp_path: Path,
                                                              content: bytes | None) -> None:
    from ablate.config.schema import ConfigError

    path = tmp_path / "defaults.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=str(path)):
        promote(simulate(Sim(features=[moe(1.05)], **QUIET), 0), policy_path=policy, defaults_path=path)


def test_a_global_records_baseline_outdates_only_its_own_shape(policy: Policy) -> None:
    """A global record's ``previous`` is its promoting lane's baseline, which may be that shape's override: a lane
    of another shape that runs that value on purpose was never run by the file there, and nothing holds it (found
    in review: held for good, with a false reason). On the record's own shape the same lane is outdated."""
    from ablate.config.load import Defaults
    from ablate.promote.analysis import FeatureVerdict
    from ablate.promote.defaults_writer import measured_before

    own, other = "shape-111111111111", "shape-222222222222"
    raw = {"features": {
        "compile": {"value": "regional", "kind": "speed",
                    "evidence": [{"report": "r1", "value": "regional", "previous": "whole", "replaced": "eager",
                                  "scope": "global", "lane_shape": own, "lane_key": "k-own"}]},
        "mamba_scan": {"value": "sequential", "kind": "speed", "evidence": []}}}
    defaults = Defaults(values={"compile": "regional", "mamba_scan": "sequential"}, raw=raw)
    # (lane, shape, compile posture the lane ran): whole on the record's shape, whole elsewhere, the replaced eager.
    runs = [("lane-own-whole", own, "whole"), ("lane-other-whole", other, "whole"),
            ("lane-other-eager", other, "eager")]
    lanes = {key: {"compile.posture": ran, "features.mamba_scan": "sequential"} for key, _, ran in runs}
    verdicts = [FeatureVerdict(feature="mamba_scan", value="chunked", baseline_value="sequential", kind="speed",
                               lane_key=key, software_fingerprint="sw", lane_shape=shape, device_class="cpu",
                               verdict=PROMOTE) for key, shape, _ in runs]
    found = measured_before(verdicts, defaults, lanes)
    assert {v.lane_key for v in verdicts if v.test_key in found} == {"lane-own-whole", "lane-other-eager"}
    assert all("compile=regional" in why for why in found.values())


def test_a_win_that_holds_only_for_short_runs_never_flips_the_global_default(policy: Policy) -> None:
    """A candidate 2% slower per step but 20 s cheaper to start wins a lane measured at 200 steps; flipping the global
    default made every 10,000-step run slower (review helper 2: global in 20 of 20 seeds). It is that lane's override,
    with the run length the win ends at as the reason."""
    shorter = FeatureTruth("moe_dispatch", "jagged", "padded", 0.98, baseline_one_time_s=20.0)
    for seed in range(2):
        result = promote(simulate(Sim(features=[shorter], horizon=200, aa_per_host=2), seed), policy_path=policy,
                         defaults_path=DEFAULTS, curves=False)
        (verdict,) = result.verdicts
        assert verdict.verdict == "PROMOTE" and verdict.break_even["kind"] == "until", verdict.reason
        (change,) = result.changes
        assert change.scope == "lane" and list(change.overrides.values()) == ["jagged"]
        assert any(why.startswith("it wins only for runs shorter than ") and "horizon of 200 steps" in why
                   for why in change.not_global), change.not_global


def test_an_auto_lane_won_on_cpu_gets_an_override_for_its_cpu_runs_only(policy: Policy, defaults_file: Path) -> None:
    """``hardware.device: auto`` runs on CUDA where a cluster has GPUs: a win measured on CPU is the lane's baseline
    on CPU only (before, the override was keyed by the lane as written, ``auto``, and reached its GPU runs)."""
    from ablate.config.lane_shape import lane_shape

    lane = base_lane()
    assert lane["hardware.device"] == "auto"
    result = promote(simulate(Sim(features=[moe(1.05)], lane=lane, device="cpu", **QUIET), 0), policy_path=policy,
                     defaults_path=defaults_file)
    [change] = result.changes
    assert change.scope == "lane"  # CPU evidence never flips a global value (scope.global_device_classes)
    assert change.overrides == {lane_shape(lane, "cpu"): "jagged"}
    write_defaults(result, defaults_file)
    defaults = load_defaults(defaults_file)
    assert defaults.effective(lane, "cpu")["moe_dispatch"] == "jagged"
    assert defaults.effective(lane, "cuda")["moe_dispatch"] == "padded"
    # The same lane with its device written out is the lane its CPU arms ran.
    assert defaults.effective({**lane, "hardware.device": "cpu"})["moe_dispatch"] == "jagged"


def _died_unobserved(receipt: object) -> None:
    """The arm's process died before it observed its hardware (a killed trial): no device kind in its receipt,
    and its lane's ``requested.device`` is ``auto``, as the trainer writes it."""
    from ablate.receipts.schema import Code, Disqualifier, Status
    from trainers.provenance import evidence_fingerprint

    ident = receipt.identity  # type: ignore[attr-defined]
    ident.status, receipt.projection = Status.failed, None  # type: ignore[attr-defined]
    receipt.disqualifiers += [Disqualifier(code=Code.ARM_FAILED)]  # type: ignore[attr-defined]
    receipt.observed.hardware, ident.hardware_fingerprint = {}, None  # type: ignore[attr-defined]
    ident.software_fingerprint = evidence_fingerprint(ident.software, ident.code_fingerprint, None)


def _auto_cpu_receipts(lane: dict, seed: int, features: Optional[list] = None, device: str = "cpu",
                       **knobs: object) -> list:
    receipts = simulate(Sim(features=features or [moe(1.05)], lane=lane, device=device, blocks_per_host=3, **QUIET,
                            **knobs), seed)
    for r in receipts:
        r.requested.device = "auto"  # trainers/receipt.py writes the lane's own hardware.device
    return receipts


def test_an_arm_that_died_unobserved_does_not_key_the_override_by_the_lane_as_written(
        policy: Policy, defaults_file: Path) -> None:
    """Found in review: a block whose baseline died before it observed its device resolved the shape to ``auto``
    as written, an override no sweep applies."""
    from ablate.config.lane_shape import lane_shape

    lane = base_lane()
    receipts = _auto_cpu_receipts(lane, 0)
    _died_unobserved(next(r for r in receipts if r.identity.arm.value == "baseline"))
    result = promote(receipts, policy_path=policy, defaults_path=defaults_file)
    [v] = result.verdicts
    assert (v.verdict, v.device_class, v.lane_shape) == (PROMOTE, "cpu", lane_shape(lane, "cpu"))
    assert result.changes[0].overrides == {lane_shape(lane, "cpu"): "jagged"}


def test_an_unjudged_lane_whose_arms_name_no_device_blocks_every_override(policy: Policy,
                                                                          defaults_file: Path) -> None:
    """Lane B (the same shape as lane A) had every block refused, and its readable arms died unobserved: which
    device it ran on is unknown, so it may be lane A's shape, and no override is written (found in review)."""
    lane_a, lane_b = base_lane(), base_lane(**{"features.mamba_scan": "chunked"})
    b = [r for r in _auto_cpu_receipts(lane_b, 1, block_prefix="B-", campaign="simb")
         if r.identity.arm.value != "candidate" and r.identity.feature]  # every block of B lost its candidate
    for r in b:
        _died_unobserved(r)
    result = promote(_auto_cpu_receipts(lane_a, 0) + b, policy_path=policy, defaults_path=defaults_file)
    [change] = result.changes
    assert change.overrides == {}
    assert any("whose shape no readable receipt names" in why for why in change.not_global), change.not_global


def _days_later(receipts: list, days: int) -> list:
    from datetime import datetime, timedelta

    for r in receipts:
        r.identity.created_at = (datetime.fromisoformat(r.identity.created_at) + timedelta(days=days)).isoformat()
    return receipts


@pytest.mark.parametrize("then", ["", "died_unobserved", "gpu_runs_later"])
def test_new_software_on_the_device_a_lane_override_was_won_on_marks_it_for_revalidation(
        policy: Policy, defaults_file: Path, then: str) -> None:
    """The newest block naming no device (its baseline died unobserved) still places the lane on its device, and
    the lane's runs on a GPU cluster a day later (the same lane key: auto as written) do not hide its CPU runs'
    new software (both found in review: the record went unmarked)."""
    lane = base_lane()
    first = _auto_cpu_receipts(lane, 0, fingerprints=["sw-1"] * 2)
    write_defaults(promote(first, policy_path=policy, defaults_path=defaults_file), defaults_file)
    # Another feature's campaign on the lane, whose baseline now runs jagged (another lane key).
    jagged, mamba = base_lane(**{"features.moe_dispatch": "jagged"}), [FeatureTruth("mamba_scan", "chunked",
                                                                                     "sequential", 1.0)]
    later = _days_later(_auto_cpu_receipts(jagged, 3, mamba, fingerprints=["sw-2"] * 2, campaign="later",
                                           block_prefix="L-"), 5)
    if then == "died_unobserved":
        _died_unobserved(max((r for r in later if r.identity.arm.value == "baseline"),
                             key=lambda r: r.identity.created_at))
    if then == "gpu_runs_later":
        gpu = _days_later(_auto_cpu_receipts(jagged, 4, mamba, device="cuda", fingerprints=["sw-2g"] * 2,
                                             campaign="later-gpu", block_prefix="G-"), 6)
        assert {r.identity.lane_key for r in gpu} == {r.identity.lane_key for r in later}
        later += gpu
    result = promote(first + later, policy_path=policy, defaults_path=defaults_file)
    assert [(r.recorded_fingerprint, r.current_fingerprint) for r in result.revalidations] == [("sw-1", "sw-2")]


def test_the_same_auto_lane_on_another_device_does_not_mark_an_override_won_on_cpu(
        policy: Policy, defaults_file: Path) -> None:
    """The lane key hashes hardware.device: auto as written, so a GPU cluster's runs of the lane share it: their
    software says nothing of what the CPU runs, and a mark would ask for a re-test no device can settle."""
    lane = base_lane()
    cpu = _auto_cpu_receipts(lane, 0, fingerprints=["sw-cpu"] * 2)
    write_defaults(promote(cpu, policy_path=policy, defaults_path=defaults_file), defaults_file)
    gpu = _days_later(simulate(Sim(features=[moe(1.0)], lane=lane, device="cuda", fingerprints=["sw-gpu"] * 2,
                                   campaign="gpu", block_prefix="G-", **QUIET), 1), 10)
    for r in gpu:
        r.requested.device = "auto"
    assert {r.identity.lane_key for r in gpu} == {r.identity.lane_key for r in cpu}  # padded on CUDA: the same key
    result = promote(cpu + gpu, policy_path=policy, defaults_path=defaults_file)
    assert result.revalidations == []
