"""An arm whose receipt cannot be read holds its test (clause ``every_arm_read``): deleting or damaging a
candidate's losing or failed receipt must never turn its test into a PROMOTE."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from conftest import DEFAULTS
from promote_sim import FeatureTruth, Sim, moe, simulate

from ablate.promote import Policy, promote
from ablate.promote.report import PromotionResult
from ablate.receipts.rejection import Rejection, UnreadArm, from_run_tags
from ablate.receipts.schema import Status
from ablate.receipts.store import load_receipts, write_receipt
from ablate.tracking.mapping import TAG
from ablate.tracking.receipt_bundle import deleted_notes

QUIET = {"noise": 0.003, "aa_per_host": 2}
FEATURES = [moe(1.10), FeatureTruth("mamba_scan", "chunked", "sequential", 1.10)]


@pytest.fixture(scope="module")
def receipts() -> list:
    return simulate(Sim(features=FEATURES, **QUIET), 0)


def _written(receipts: list, directory: Path) -> dict[str, Path]:
    return {r.identity.receipt_id: write_receipt(r, directory) for r in receipts}


def _damage(path: Path) -> None:
    raw = json.loads(path.read_text())
    raw["time"]["wall_s"] += 0.5  # the digest no longer matches: the file is refused, its identity still readable
    path.write_text(json.dumps(raw))


def _verdicts(directory: Path, policy: Policy) -> tuple[PromotionResult, dict[str, object]]:
    loaded, rejected = load_receipts(directory)
    result = promote(loaded, policy_path=policy, defaults_path=DEFAULTS, rejected=rejected)
    return result, {v.feature: v for v in result.verdicts}


def _failing(verdict: object) -> list[str]:
    return [c.name for c in verdict.clauses if not c.passed]  # type: ignore[attr-defined]


def test_control_every_test_promotes(receipts: list, policy: Policy, tmp_path: Path) -> None:
    _written(receipts, tmp_path)
    _, by_feature = _verdicts(tmp_path, policy)
    assert {f: v.verdict for f, v in by_feature.items()} == {"moe_dispatch": "PROMOTE", "mamba_scan": "PROMOTE"}


def test_a_damaged_candidate_receipt_holds_its_test_only(receipts: list, policy: Policy, tmp_path: Path) -> None:
    paths = _written(receipts, tmp_path)
    victim = next(r for r in receipts if r.identity.feature == "moe_dispatch" and r.identity.arm.value == "candidate")
    _damage(paths[victim.identity.receipt_id])
    result, by_feature = _verdicts(tmp_path, policy)
    moe_v, mamba_v = by_feature["moe_dispatch"], by_feature["mamba_scan"]
    assert moe_v.verdict == "HOLD" and _failing(moe_v) == ["every_arm_read"]
    assert victim.identity.receipt_id[:8] in moe_v.reason and "could not be read" in moe_v.reason
    assert mamba_v.verdict == "PROMOTE", "an arm of another feature's test holds nothing here"
    assert not result.changes or all(c.feature != "moe_dispatch" for c in result.changes)
    assert any(row.get("unread_arm", {}).get("feature") == "moe_dispatch"
               for row in result.to_dict()["rejected_receipts"])
    assert "arms that could not be read" in result.markdown


def test_a_damaged_aa_receipt_holds_every_test_of_its_lane(receipts: list, policy: Policy, tmp_path: Path) -> None:
    paths = _written(receipts, tmp_path)
    victim = next(r for r in receipts if r.identity.feature is None)
    _damage(paths[victim.identity.receipt_id])
    _, by_feature = _verdicts(tmp_path, policy)
    assert all(v.verdict == "HOLD" and "every_arm_read" in _failing(v) for v in by_feature.values())


def test_a_driver_refused_candidate_receipt_holds_its_test(receipts: list, policy: Policy, tmp_path: Path) -> None:
    campaign = tmp_path / "campaign"
    paths = _written(receipts, campaign / "receipts")
    victim = next(r for r in receipts if r.identity.feature == "mamba_scan" and r.identity.arm.value == "candidate")
    refused = campaign / "rejected" / f"{victim.identity.block_id}-1-attempt0.json.txt"
    refused.parent.mkdir()
    paths[victim.identity.receipt_id].rename(refused)
    _damage(refused)
    _, by_feature = _verdicts(campaign, policy)
    assert by_feature["mamba_scan"].verdict == "HOLD" and _failing(by_feature["mamba_scan"]) == ["every_arm_read"]
    assert by_feature["moe_dispatch"].verdict == "PROMOTE"


def test_a_damaged_second_copy_of_a_read_receipt_holds_nothing(receipts: list, policy: Policy,
                                                              tmp_path: Path) -> None:
    paths = _written(receipts, tmp_path / "a")
    victim = next(r for r in receipts if r.identity.feature == "moe_dispatch" and r.identity.arm.value == "candidate")
    copy = tmp_path / "b" / paths[victim.identity.receipt_id].name
    copy.parent.mkdir()
    copy.write_text(paths[victim.identity.receipt_id].read_text())
    _damage(copy)
    loaded, rejected = load_receipts(tmp_path)
    assert [r.unread.receipt_id for r in rejected if isinstance(r, Rejection) and r.unread] == \
        [victim.identity.receipt_id]
    result = promote(loaded, policy_path=policy, defaults_path=DEFAULTS, rejected=rejected)
    assert {v.feature: v.verdict for v in result.verdicts} == {"moe_dispatch": "PROMOTE", "mamba_scan": "PROMOTE"}


def test_unread_arms_from_other_fingerprints_or_lanes_hold_nothing() -> None:
    arm = UnreadArm(origin="x", lane_key="lane-a", feature="moe_dispatch", software_fingerprint="fp1", receipt_id="r")
    assert arm.concerns("moe_dispatch", "lane-a", "fp1")
    assert not arm.concerns("moe_dispatch", "lane-a", "fp2"), "superseded evidence is not this test's"
    assert not arm.concerns("moe_dispatch", "lane-b", "fp1")
    assert not arm.concerns("mamba_scan", "lane-a", "fp1")
    aa = UnreadArm(origin="x", lane_key="lane-a", feature=None, software_fingerprint=None)
    assert aa.concerns("mamba_scan", "lane-a", "any"), "an A/A arm of unknown fingerprint calibrates every test"


def test_deleted_mlflow_arm_runs_are_attributed_from_their_tags() -> None:
    tags = {TAG + "sweep_id": "s1", TAG + "receipt_id": "rid-1", TAG + "lane_key": "lane-a",
            TAG + "feature": "A/A", TAG + "software_fingerprint": "fp1"}
    (line,) = deleted_notes({"run-1": tags}, skip=set())
    origin, reason = line
    assert origin == "run run-1" and "deleted in MLflow" in reason
    assert line.unread == UnreadArm(origin="run run-1", lane_key="lane-a", feature=None, software_fingerprint="fp1",
                                    receipt_id="rid-1")
    assert pickle.loads(pickle.dumps(line)).unread == line.unread, "reject lines cross fork_map's pickling"
    bare = from_run_tags("run run-2", "why", {TAG + "receipt_id": "rid-2"}, TAG)
    assert bare == ("run run-2", "why") and bare.unread is None, "no lane tag: a plain line, nothing held"


def _died_unobserved(arm: object) -> None:
    """A candidate whose worker died before reporting (kill, segfault, timeout): no hardware was observed, so its
    fingerprint hashes None for it, as trainers.receipt writes one."""
    from ablate.receipts.schema import Code, Disqualifier, Status
    from trainers.provenance import evidence_fingerprint

    ident = arm.identity  # type: ignore[attr-defined]
    ident.status = Status.failed
    arm.projection = None  # type: ignore[attr-defined]
    arm.disqualifiers += [Disqualifier(code=Code.ARM_FAILED)]  # type: ignore[attr-defined]
    arm.observed.hardware = {}  # type: ignore[attr-defined]
    ident.hardware_fingerprint = None
    ident.software_fingerprint = evidence_fingerprint(ident.software, ident.code_fingerprint, None)


def test_deleted_runs_of_candidates_that_died_unobserved_hold_their_test(policy: Policy) -> None:
    import copy

    from ablate.tracking.mapping import receipt_tags

    base = simulate(Sim(features=[moe(1.05)], blocks_per_host=3, noise=0.007, aa_per_host=2), 0)
    crashed = copy.deepcopy(base)
    victims = [r for r in crashed if r.identity.arm.value == "candidate"][:4]
    for arm in victims:
        _died_unobserved(arm)
    kept = promote(crashed, policy_path=policy, defaults_path=DEFAULTS)
    (v,) = kept.verdicts
    assert v.verdict == "HOLD" and v.failures["candidate"]["failed"] == 4, "the crashes count while they are read"
    gone = {a.identity.receipt_id for a in victims}
    rejected = [from_run_tags(f"run {rid[:8]}", "arm run is deleted in MLflow", receipt_tags(a), TAG)
                for a in victims for rid in [a.identity.receipt_id]]
    assert all(r.unread is not None and r.unread.software_fingerprint is None for r in rejected)
    deleted = promote([r for r in crashed if r.identity.receipt_id not in gone], policy_path=policy,
                      defaults_path=DEFAULTS, rejected=rejected)
    (v,) = deleted.verdicts
    assert v.verdict == "HOLD" and "every_arm_read" in _failing(v), \
        "deleting the FAILED runs must not leave the test decided on the arms that survived"
    assert not deleted.changes
    # The same from a damaged receipt file: its identity says failed with no hardware.
    raw = victims[0].model_dump(mode="json")
    from ablate.receipts.rejection import from_identity
    assert from_identity("file x", "digest", raw).unread.software_fingerprint is None  # type: ignore[union-attr]
    ok = next(r for r in base if r.identity.arm.value == "candidate").model_dump(mode="json")
    assert from_identity("file y", "digest", ok).unread.software_fingerprint == \
        ok["identity"]["software_fingerprint"]  # type: ignore[union-attr]


def test_promote_sweep_selection_holds_a_test_with_arms_in_the_sweeps_left_out(receipts: list, tmp_path: Path) -> None:
    # --sweep chose which rounds a test is decided on: r1 alone could promote while r2 lost. A test with arms in
    # sweeps the selection left out is decided on all of its evidence or held.
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    _written(receipts, tmp_path / "receipts")

    def promote_cli(*selection: str) -> dict:
        out_dir = tmp_path / "reports" / "-".join(selection)
        done = subprocess.run([sys.executable, "-m", "ablate", "promote", "--source", str(tmp_path / "receipts"),
                               "--defaults", str(DEFAULTS), "--out", str(out_dir),
                               *[x for s in selection for x in ("--sweep", s)]],
                              cwd=repo, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        (report,) = out_dir.glob("*.json")
        return {v["feature"]: v for v in json.loads(report.read_text())["verdicts"]}

    one_round = promote_cli("sim-r1")
    assert {f: v["verdict"] for f, v in one_round.items()} == {"moe_dispatch": "HOLD", "mamba_scan": "HOLD"}
    moe_v = one_round["moe_dispatch"]
    assert moe_v["left_out_arms"] and all("sweep sim-r2" in arm for arm in moe_v["left_out_arms"])
    assert not moe_v["unread_arms"] and "--sweep selection left out" in moe_v["reason"]
    whole = promote_cli("sim")  # the campaign: every round of it
    assert {f: v["verdict"] for f, v in whole.items()} == {"moe_dispatch": "PROMOTE", "mamba_scan": "PROMOTE"}


def test_leaving_out_the_newer_software_s_sweeps_does_not_make_the_older_evidence_current(policy: Policy) -> None:
    # Round 2 ran under new software (its fingerprint supersedes round 1's). Selecting round 1 alone made round
    # 1's fingerprint the lane's current one; its newer arms, under another fingerprint, concerned no test.
    receipts = simulate(Sim(features=[moe(1.10)], rounds=3, fingerprints=["fp-old", "fp-old", "fp-new"], **QUIET), 0)
    kept = [r for r in receipts if r.identity.sweep_id != "sim-r3"]
    left = [r for r in receipts if r.identity.sweep_id == "sim-r3"]
    (v,) = promote(kept, policy_path=policy, defaults_path=DEFAULTS, left_out=left).verdicts
    assert v.verdict == "HOLD" and _failing(v)[0] == "every_arm_read" and "left out" in v.reason
    # Older rounds left out (superseded anyway) hold nothing: the newest software decides on its own evidence.
    newest = simulate(Sim(features=[moe(1.10)], rounds=4, fingerprints=["fp-old", "fp-old", "fp-new", "fp-new"],
                          **QUIET), 0)
    (v,) = promote([r for r in newest if r.identity.sweep_id in ("sim-r3", "sim-r4")], policy_path=policy,
                   defaults_path=DEFAULTS,
                   left_out=[r for r in newest if r.identity.sweep_id in ("sim-r1", "sim-r2")]).verdicts
    assert v.verdict == "PROMOTE" and not v.left_out_arms, v.reason


def test_a_sweep_selection_never_chooses_a_reject_either(policy: Policy) -> None:
    receipts = simulate(Sim(features=[moe(1.0)], hosts=6, rounds=3, noise=0.003, aa_per_host=1), 2)
    kept = [r for r in receipts if r.identity.sweep_id != "sim-r3"]
    (control,) = promote(kept, policy_path=policy, defaults_path=DEFAULTS).verdicts
    assert control.verdict == "REJECT", "the premise: the kept rounds alone reject the null"
    (v,) = promote(kept, policy_path=policy, defaults_path=DEFAULTS,
                   left_out=[r for r in receipts if r.identity.sweep_id == "sim-r3"]).verdicts
    assert v.verdict == "HOLD" and v.left_out_arms
    assert "--sweep selection left out" in next(c.detail for c in v.clauses if c.name == "win_possible")


def test_a_lane_not_judged_here_never_lets_another_lane_flip_the_global_default(policy: Policy, tmp_path: Path
                                                                                ) -> None:
    # Lane A's rounds promote jagged; lane B's, in the same store, reject it. `promote --sweep <lane A's>` judged
    # lane A alone and flipped the global default that lane B rejects; so did damaging lane B's receipts (every one,
    # or its candidates only: its blocks then match nothing and it has no test), and so did refusing every block of
    # lane B. A global flip needs every lane's evidence: a lane whose arms of the feature were not judged here keeps
    # the change to the lanes judged.
    from promote_sim import base_lane

    lane_a = simulate(Sim(features=[moe(1.10)], campaign="lane-a", **QUIET), 0)
    lane_b = simulate(Sim(features=[moe(0.90)], campaign="lane-b", lane=base_lane(**{"model.seq_len": 256}),
                          block_prefix="B", **QUIET), 1)
    lane_a_key, lane_b_key = lane_a[0].identity.lane_key, lane_b[0].identity.lane_key
    assert lane_b_key != lane_a_key
    both = promote(lane_a + lane_b, policy_path=policy, defaults_path=DEFAULTS)
    assert sorted(v.verdict for v in both.verdicts) == ["PROMOTE", "REJECT"], "the premise"
    (change,) = both.changes
    assert change.scope == "lane" and "rejected in another lane" in change.not_global

    def lane_scoped(result: PromotionResult, why: str, override: bool = True) -> None:
        assert [(v.lane_key, v.verdict) for v in result.verdicts] == [(lane_a_key, "PROMOTE")], \
            "lane A is judged on all of its own evidence"
        (change,) = result.changes
        assert change.scope == "lane" and change.new is None and change.lanes == [lane_a_key]
        reason = change.not_global[0]
        assert reason.startswith("1 lane(s) with arms of it were not judged here") and \
            f"lane {lane_b_key[:12]} ({why}" in reason, reason
        assert "were not judged here" in result.markdown
        if override:  # lane B's shape is another: lane A's shape keeps its override
            assert list(change.overrides.values()) == ["jagged"] and len(change.not_global) == 1
        else:  # no readable receipt names lane B's shape: it may be lane A's
            assert change.overrides == {} and "whose shape no readable receipt names" in change.not_global[1]

    lane_scoped(promote(lane_a, policy_path=policy, defaults_path=DEFAULTS, left_out=iter(lane_b)),
                "left out by the --sweep selection")
    for damaged_roles in (("candidate",), ("baseline", "candidate", "aa")):
        directory = tmp_path / "-".join(damaged_roles)
        paths = _written(lane_a + lane_b, directory)
        for receipt in lane_b:
            if receipt.identity.arm.value in damaged_roles:
                _damage(paths[receipt.identity.receipt_id])
        loaded, rejected = load_receipts(directory)
        assert len(rejected) == sum(r.identity.arm.value in damaged_roles for r in lane_b)
        # Candidates only: lane B's baselines are read (their blocks refused, partner missing), so its shape is known.
        lane_scoped(promote(loaded, policy_path=policy, defaults_path=DEFAULTS, rejected=rejected), "unreadable",
                    override=damaged_roles == ("candidate",))
    # Every block of lane B refused (both arms ran at inherited low priority): nothing measured it there either.
    from ablate.receipts.schema import Code, Disqualifier, Status

    low_priority = [r.model_copy(deep=True) for r in lane_b]
    for receipt in low_priority:
        receipt.identity.status = Status.disqualified
        receipt.disqualifiers.append(Disqualifier(code=Code.LOW_PRIORITY, detail="niceness 15"))
    lane_scoped(promote(lane_a + low_priority, policy_path=policy, defaults_path=DEFAULTS),
                "its blocks were refused, e.g. 'the baseline arm is disqualified (LOW_PRIORITY)")

    # A refusal's reason quotes what the receipts say (here a host that is a URL with a password): redacted in the
    # report and its JSON, before it is shortened (a cut before the "@" would leave the password unmatched).
    hostile = [r.model_copy(deep=True) for r in lane_b]
    for receipt in hostile:
        if receipt.identity.arm.value == "candidate":
            receipt.identity.host = "https://bob:hunter2hunter2@mlflow.example/"
    result = promote(lane_a + hostile, policy_path=policy, defaults_path=DEFAULTS)
    lane_scoped(result, "its blocks were refused, e.g. 'arms differ in host")
    assert "hunter2" not in result.markdown and "hunter2" not in result.to_json()
    assert "hunter2" not in " ".join(result.changes[0].not_global)

    # A lane of simulated arms (the test-only no-op executor) ran nothing: it holds nothing back.
    from ablate.receipts.schema import SIMULATED_EXECUTOR

    simulated = [r.model_copy(deep=True) for r in lane_b]
    for receipt in simulated:
        receipt.identity.executor = SIMULATED_EXECUTOR
    result = promote(lane_a + simulated, policy_path=policy, defaults_path=DEFAULTS)
    assert result.refusals and all("simulated arms" in r.reason for r in result.refusals)
    (change,) = result.changes
    assert change.scope == "global" and change.new == "jagged" and not change.not_global

    # Only lanes that measured the feature count: lane B measuring another feature leaves lane A's flip global.
    other = simulate(Sim(features=[FeatureTruth("mamba_scan", "chunked", "sequential", 0.90)], campaign="lane-b",
                         lane=base_lane(**{"model.seq_len": 256}), block_prefix="B", **QUIET), 1)
    (change,) = promote(lane_a, policy_path=policy, defaults_path=DEFAULTS, left_out=other).changes
    assert change.scope == "global" and change.new == "jagged" and not change.not_global


def test_a_sweep_selection_never_writes_an_override_a_left_out_lane_of_its_shape_did_not_earn(policy: Policy
                                                                                            ) -> None:
    # Lane B differs from lane A only in another feature's value: one shape, so one override would cover both.
    # Judged together, B's REJECT stops the override; `--sweep <lane A's>` wrote it, and lane B ran the value.
    from promote_sim import base_lane

    lane_a = simulate(Sim(features=[moe(1.10)], campaign="lane-a", **QUIET), 0)
    lane_b = simulate(Sim(features=[moe(0.90)], campaign="lane-b",
                          lane=base_lane(**{"features.mamba_scan": "chunked"}), block_prefix="B", **QUIET), 1)
    (change,) = promote(lane_a + lane_b, policy_path=policy, defaults_path=DEFAULTS).changes
    assert change.overrides == {} and any("also rejected it" in why for why in change.not_global), "the premise"
    result = promote(lane_a, policy_path=policy, defaults_path=DEFAULTS, left_out=lane_b)
    ((verdict,), (change,)) = result.verdicts, result.changes
    assert verdict.verdict == "PROMOTE" and change.scope == "lane" and change.overrides == {}
    assert f"no override for {verdict.lane_shape}: its lanes include {lane_b[0].identity.lane_key[:12]}, which was " \
           f"not judged here (left out by the --sweep selection)" in change.not_global


def test_a_newest_round_whose_blocks_were_all_refused_leaves_no_older_software_current(policy: Policy) -> None:
    # Lane B promoted under sw-1; three days later, under sw-2, every block of its next campaign was refused (both
    # arms at low priority). Its sw-1 PROMOTE stayed current, and with lane A's the flip went global (helper 15).
    # A refused candidate of software no matched block of its lane ran, after the newest matched one, holds the
    # lane's current test, as such an unread arm does; one of software already matched holds nothing.
    from datetime import datetime, timedelta

    from promote_sim import base_lane

    from ablate.receipts.schema import Code, Disqualifier, Status

    lane = base_lane(**{"model.seq_len": 256})
    lane_a = simulate(Sim(features=[moe(1.10)], campaign="lane-a", **QUIET), 0)
    lane_b = simulate(Sim(features=[moe(1.10)], campaign="lane-b-old", lane=lane, block_prefix="B", **QUIET), 1)

    def refused_later(software: str) -> list:
        newer = simulate(Sim(features=[moe(0.90)], campaign="lane-b-new", lane=lane, block_prefix="N",
                             fingerprints=[software, software], **QUIET), 2)
        for receipt in newer:
            receipt.identity.created_at = (datetime.fromisoformat(receipt.identity.created_at)
                                           + timedelta(days=3)).isoformat()
            if software != "sw-1":  # new software: other packages, not only another fingerprint
                receipt.identity.software = {**receipt.identity.software, "torch": "9.9.9"}
            receipt.identity.status = Status.disqualified
            receipt.disqualifiers.append(Disqualifier(code=Code.LOW_PRIORITY, detail="niceness 15"))
        return newer

    lane_b_key = lane_b[0].identity.lane_key
    result = promote(lane_a + lane_b + refused_later("sw-2"), policy_path=policy, defaults_path=DEFAULTS)
    verdicts = {v.lane_key: v for v in result.verdicts}
    assert verdicts[lane_b_key].verdict == "HOLD" and _failing(verdicts[lane_b_key])[0] == "every_arm_read"
    assert "refused: the baseline arm is disqualified (LOW_PRIORITY)" in verdicts[lane_b_key].reason
    # Its receipts are fine: the clause says what holds the test, not "restore or repair them".
    assert "are in blocks that were refused" in verdicts[lane_b_key].reason
    assert "could not be read" not in verdicts[lane_b_key].reason
    assert verdicts[lane_b_key].refused_arms and not verdicts[lane_b_key].unread_arms
    assert "arms of newer software in refused blocks" in result.markdown
    (change,) = result.changes
    assert change.scope == "lane" and "not every measured lane promoted it" in change.not_global
    # The control: the refused round ran the software lane B's matched blocks ran: it measured nothing, holds nothing.
    result = promote(lane_a + lane_b + refused_later("sw-1"), policy_path=policy, defaults_path=DEFAULTS)
    assert {v.lane_key: v.verdict for v in result.verdicts}[lane_b_key] == "PROMOTE"
    assert [c.scope for c in result.changes] == ["global"]


def test_a_refused_crash_of_the_newest_block_is_a_failure_not_an_unread_arm(policy: Policy) -> None:
    # The candidate of the newest block crashed before observing its hardware (its fingerprint hashes none) and its
    # baseline never ran: the block is refused, its crash counted by the failure rate. Its fingerprint matches no
    # block's, but its packages and code do: it is the lane's software, not an unmeasured newer one (helper 16).
    from datetime import datetime, timedelta

    receipts = [r.model_copy(deep=True) for r in simulate(Sim(features=[moe(1.10)], **QUIET), 0)]
    newest = max((r for r in receipts if r.identity.feature), key=lambda r: r.identity.created_at)
    block = (newest.identity.sweep_id, newest.identity.block_id)
    kept = []
    for receipt in receipts:
        ident = receipt.identity
        if (ident.sweep_id, ident.block_id) == block:
            if ident.arm.value == "baseline":
                continue
            ident.status, ident.hardware_fingerprint, ident.software_fingerprint = Status.failed, None, "sw-unobserved"
            ident.created_at = (datetime.fromisoformat(ident.created_at) + timedelta(hours=1)).isoformat()
            receipt.projection = None
        kept.append(receipt)
    result = promote(kept, policy_path=policy, defaults_path=DEFAULTS)
    (v,) = result.verdicts
    assert len(result.refusals) == 1 and "partner arm is missing" in result.refusals[0].reason
    clauses = {c.name: c for c in v.clauses}
    assert clauses["every_arm_read"].passed, clauses["every_arm_read"].detail
    assert "with the arms of 1 refused block(s)" in clauses["failure_rate"].detail


def test_a_deleted_unobserved_crash_of_superseded_software_holds_nothing_now(policy: Policy) -> None:
    # Its own fingerprint hashes no hardware; its block partner, read, says which software it ran: the old one.
    import copy

    from ablate.tracking.mapping import receipt_tags

    receipts = copy.deepcopy(simulate(Sim(features=[moe(1.10)], rounds=4,
                                          fingerprints=["fp-old", "fp-old", "fp-new", "fp-new"], **QUIET), 0))
    victim = next(r for r in receipts if r.identity.sweep_id == "sim-r1" and r.identity.arm.value == "candidate")
    _died_unobserved(victim)
    line = from_run_tags("run x", "arm run is deleted in MLflow", receipt_tags(victim), TAG)
    assert line.unread is not None and line.unread.software_fingerprint is None
    rest = [r for r in receipts if r is not victim]
    (v,) = promote(rest, policy_path=policy, defaults_path=DEFAULTS, rejected=[line]).verdicts
    assert v.verdict == "PROMOTE" and not v.unread_arms, v.reason
    # Its partner gone too: nothing says which software it ran, so it holds the current test (conservative).
    partner = next(r for r in rest if r.identity.block_id == victim.identity.block_id)
    (v,) = promote([r for r in rest if r is not partner], policy_path=policy, defaults_path=DEFAULTS,
                   rejected=[line]).verdicts
    assert v.verdict == "HOLD" and v.unread_arms


def test_a_sweep_selection_never_chooses_a_gate_or_flakiness_reject(policy: Policy) -> None:
    # The selection kept the round whose candidates crashed (Fisher rejects on it alone); all rounds together hold.
    from ablate.receipts.schema import Code, Disqualifier, Status

    # Enough candidate arms in r1 (9), failing on every host (3), that a REJECT may stand on r1's evidence alone.
    receipts = simulate(Sim(features=[moe(1.05)], hosts=3, blocks_per_host=3, rounds=3, **QUIET), 4)
    r1 = [r for r in receipts if r.identity.sweep_id == "sim-r1" and r.identity.arm.value == "candidate"]
    by_host = {host: [r for r in r1 if r.identity.host == host] for host in sorted({r.identity.host for r in r1})}
    for arm in [arm for arms in by_host.values() for arm in arms[:2]]:
        arm.identity.status = Status.failed
        arm.projection = None
        arm.disqualifiers.append(Disqualifier(code=Code.ARM_FAILED))
    kept = [r for r in receipts if r.identity.sweep_id == "sim-r1"]
    (alone,) = promote(kept, policy_path=policy, defaults_path=DEFAULTS).verdicts
    assert alone.verdict == "REJECT" and _failing(alone) == ["not_flaky"], "the premise: r1 alone rejects"
    (v,) = promote(kept, policy_path=policy, defaults_path=DEFAULTS,
                   left_out=[r for r in receipts if r.identity.sweep_id != "sim-r1"]).verdicts
    assert v.verdict == "HOLD" and "not_flaky would reject" in v.reason and "left out" in v.reason


def test_unreadable_newest_software_does_not_make_the_older_evidence_current(policy: Policy, tmp_path: Path) -> None:
    # Rounds 1-2 under old software win by 10%; round 3, under new software, is 5% slower. With round 3's runs
    # deleted (or its files damaged) the old fingerprint became the lane's current one and promoted, while round
    # 3's unread arms, under a fingerprint no read block had, concerned no test.
    old = simulate(Sim(features=[moe(1.10)], rounds=2, fingerprints=["fp-old"] * 2, **QUIET), 0)
    new = [r for r in simulate(Sim(features=[moe(0.95)], rounds=3, fingerprints=["fp-old", "fp-old", "fp-new"],
                                   **QUIET), 1) if r.identity.sweep_id == "sim-r3"]
    (v,) = promote(old + new, policy_path=policy, defaults_path=DEFAULTS).verdicts
    assert v.verdict == "HOLD" and v.software_fingerprint == "fp-new", "the premise: the new software decides"
    from ablate.tracking.mapping import receipt_tags

    deleted = [from_run_tags(f"run {r.identity.receipt_id}", "arm run is deleted in MLflow", receipt_tags(r), TAG)
               for r in new]
    (v,) = promote(old, policy_path=policy, defaults_path=DEFAULTS, rejected=deleted).verdicts
    assert v.verdict == "HOLD" and _failing(v)[0] == "every_arm_read" and len(v.unread_arms) == len(new)
    paths = _written(old + new, tmp_path)
    for receipt in new:
        _damage(paths[receipt.identity.receipt_id])
    loaded, rejected = load_receipts(tmp_path)
    (v,) = promote(loaded, policy_path=policy, defaults_path=DEFAULTS, rejected=rejected).verdicts
    assert v.verdict == "HOLD" and _failing(v)[0] == "every_arm_read", v.reason
    # Only the newest round's baselines (and one arm of each A/A block) readable: refused unpaired, they made
    # no block, so their fingerprint is not the lane's current one and the older rounds decided (found in review).
    for receipt in new:
        if receipt.identity.arm.value == "baseline" or (receipt.identity.arm.value == "aa"
                                                        and receipt.identity.arm_index == 1):
            _written([receipt], tmp_path)  # the intact copy back
    loaded, rejected = load_receipts(tmp_path)
    (v,) = promote(loaded, policy_path=policy, defaults_path=DEFAULTS, rejected=rejected).verdicts
    assert v.verdict == "HOLD" and _failing(v)[0] == "every_arm_read", v.reason
    # An unread arm of superseded software (its fingerprint among the read ones) still holds nothing.
    victim = next(r for r in old if r.identity.sweep_id == "sim-r1" and r.identity.feature)
    line = from_run_tags(f"run {victim.identity.receipt_id}", "deleted", receipt_tags(victim), TAG)
    (v,) = promote(old + new, policy_path=policy, defaults_path=DEFAULTS, rejected=[line]).verdicts
    assert v.software_fingerprint == "fp-new" and not v.unread_arms


def test_deleted_runs_of_superseded_software_hold_nothing_once_placed_in_time(policy: Policy) -> None:
    # Round 1 ran software no round since has run; its runs were deleted. Written before the lane's newest block,
    # they are superseded whatever their fingerprint (found in review: they held the current test for good). A
    # run logged before arm runs carried the ablate.created_at tag cannot be placed: it holds, conservatively.
    from ablate.tracking.mapping import receipt_tags

    receipts = simulate(Sim(features=[moe(1.10)], rounds=3, fingerprints=["fp-ancient", "fp-new", "fp-new"],
                            **QUIET), 0)
    ancient = [r for r in receipts if r.identity.sweep_id == "sim-r1"]
    rest = [r for r in receipts if r.identity.sweep_id != "sim-r1"]
    lines = [from_run_tags(f"run {r.identity.receipt_id}", "deleted", receipt_tags(r), TAG) for r in ancient]
    assert all(line.unread.created_at for line in lines)
    (v,) = promote(rest, policy_path=policy, defaults_path=DEFAULTS, rejected=lines).verdicts
    assert v.verdict == "PROMOTE" and v.software_fingerprint == "fp-new" and not v.unread_arms, v.reason
    untimed = [from_run_tags(f"run {r.identity.receipt_id}", "deleted",
                             {k: t for k, t in receipt_tags(r).items() if k != TAG + "created_at"}, TAG) for r in ancient]
    (v,) = promote(rest, policy_path=policy, defaults_path=DEFAULTS, rejected=untimed).verdicts
    assert v.verdict == "HOLD" and _failing(v)[0] == "every_arm_read"


def test_a_receipt_refused_for_its_time_is_not_placed_by_it(policy: Policy, tmp_path: Path) -> None:
    # The newest round (new software, 5% slower) wrote local times without their offset: the validator refuses
    # them, and read as UTC they fell hours before the older rounds' last block, so they held nothing and the
    # older software promoted (found in review). Only a stamp the validator accepts places an arm in time.
    from datetime import datetime, timedelta

    old = simulate(Sim(features=[moe(1.10)], rounds=2, fingerprints=["fp-old"] * 2, **QUIET), 0)
    new = [r for r in simulate(Sim(features=[moe(0.95)], rounds=3, fingerprints=["fp-old", "fp-old", "fp-new"],
                                   **QUIET), 1) if r.identity.sweep_id == "sim-r3"]
    for receipt in new:  # two hours after the older rounds' last arm
        receipt.identity.created_at = (datetime.fromisoformat(receipt.identity.created_at) - timedelta(hours=22)
                                       ).isoformat()
    assert min(r.identity.created_at for r in new) > max(r.identity.created_at for r in old), "the premise"
    paths = _written(old + new, tmp_path)
    for receipt in new:
        raw = json.loads(paths[receipt.identity.receipt_id].read_text())
        local = datetime.fromisoformat(raw["identity"]["created_at"]) - timedelta(hours=8)
        raw["identity"]["created_at"] = local.replace(tzinfo=None).isoformat()
        paths[receipt.identity.receipt_id].write_text(json.dumps(raw))
    loaded, rejected = load_receipts(tmp_path)
    assert len(rejected) == len(new) and all("+00:00" in reason for _, reason in rejected)
    (v,) = promote(loaded, policy_path=policy, defaults_path=DEFAULTS, rejected=rejected).verdicts
    assert v.verdict == "HOLD" and _failing(v)[0] == "every_arm_read" and len(v.unread_arms) == len(new), v.reason
