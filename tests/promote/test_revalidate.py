"""`ablate revalidate`: a value marked after a software change is re-tested against the value it replaced, then
confirmed, demoted (its win is gone) or kept still unconfirmed; bad records and campaigns are refused by name."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from conftest import DEFAULT_POLICY, SINGLE_NODE_POLICY
from promote_sim import FeatureTruth, Sim, make_receipt, moe, simulate
from ruamel.yaml import YAML
from sweeps_common import fresh_mlflow_uri, tiny_smoke
from typer.testing import CliRunner

from ablate.cli import app
from ablate.config.load import flat_lane, load_defaults, load_sweep, with_feature
from ablate.config.schema import ConfigError
from ablate.promote import HOLD, PROMOTE, REJECT, Policy, promote, with_overrides, write_defaults
from ablate.promote.defaults_writer import CONFIRMED, DEMOTED, UNCONFIRMED
from ablate.promote.evidence import shape_key
from ablate.promote.revalidate import find_targets, judge, plan_retests
from ablate.receipts.schema import Code, Disqualifier, Receipt
from ablate.sweep.plan import lane_key, plan_sweep

QUIET = {"noise": 0.007, "aa_per_host": 2}


@dataclass
class Marked:
    defaults: Path
    campaign: Path
    lane_key: str
    """The recorded lane: the tiny campaign's lane with moe_dispatch back at padded (what real sweeps hash)."""
    flat: dict
    report: str


def keyed(receipts: list[Receipt], key: str) -> list[Receipt]:
    """The simulator hashes lanes its own way; a real sweep's lane key is ``ablate.sweep.plan.lane_key``."""
    return [r.model_copy(update={"identity": r.identity.model_copy(update={"lane_key": key})}) for r in receipts]


def mark_jagged(tmp_path: Path, policy: Policy, device: str = "cuda") -> Marked:
    """moe_dispatch=jagged promoted globally on the tiny smoke lane under software sw-1, then marked for
    revalidation by a later campaign on that lane under sw-2, both on ``device``: the state `ablate revalidate`
    starts from."""
    campaign = tiny_smoke(tmp_path / "campaign", name="tiny")
    defaults = campaign.parent / "defaults.yaml"
    lane = load_sweep(campaign)[0].lane
    flat = flat_lane(lane)
    key = lane_key(lane)
    horizon = flat["budget.horizon_steps"]
    anywhere = with_overrides(policy, {"scope.global_device_classes": []})
    first = promote(keyed(simulate(Sim(features=[moe(1.05)], lane=flat, horizon=horizon, campaign="tiny",
                                       device=device, **QUIET), 0), key), policy_path=anywhere, defaults_path=defaults)
    assert first.verdicts[0].verdict == PROMOTE
    write_defaults(first, defaults)
    marked = later_campaign(defaults, lane, policy, software="sw-2", seed=4, device=device)
    assert [(r.feature, r.recorded_fingerprint, r.current_fingerprint) for r in marked.revalidations] == [
        ("moe_dispatch", "sw-1", "sw-2")]
    return Marked(defaults=defaults, campaign=campaign, lane_key=key, flat=flat, report=first.report_id)


def later_campaign(defaults: Path, lane: object, policy: Policy, software: str, seed: int,
                   device: str = "cuda") -> object:
    """Another feature's campaign on the lane (its baseline now runs jagged) under ``software``, written: it marks
    jagged's newest record when the software changed."""
    later = Sim(features=[FeatureTruth("mamba_scan", "chunked", "sequential", 1.0)],
                lane=flat_lane(with_feature(lane, "moe_dispatch", "jagged")),
                horizon=flat_lane(lane)["budget.horizon_steps"], fingerprints=[software, software],
                campaign=f"later-{software}", block_prefix=f"L-{software}-", device=device, **QUIET)
    marked = promote(simulate(later, seed), policy_path=policy, defaults_path=defaults)
    write_defaults(marked, defaults)
    return marked


def drop_from_record(defaults: Path, key: str) -> None:
    """The marked evidence record without ``key``, as an older or hand-edited defaults file would have it."""
    yaml = YAML()
    doc = yaml.load(defaults.read_text())
    del doc["features"]["moe_dispatch"]["evidence"][0][key]
    with defaults.open("w") as handle:
        yaml.dump(doc, handle)


def record(defaults: Path) -> dict:
    return load_defaults(defaults).raw["features"]["moe_dispatch"]["evidence"][0]


def invoke(*args: str) -> object:
    return CliRunner().invoke(app, ["revalidate", *map(str, args)], catch_exceptions=False)


# --- (a) plan mode ---


def test_plan_mode_writes_a_retest_of_the_promoted_value_against_the_previous_one(policy: Policy,
                                                                                  tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    assert record(m.defaults)["revalidate"]["required"] is True
    before = m.defaults.read_text()
    out = tmp_path / "retests"
    result = invoke("--defaults", m.defaults, "--campaign", m.campaign, "--campaign-dir", out,
                    "--policy", DEFAULT_POLICY)
    assert result.exit_code == 0, result.output
    [written] = sorted(out.glob("revalidate-*.yaml"))
    assert str(written) in result.output.replace("\n", "") and "dry plan" in result.output
    assert m.defaults.read_text() == before  # a plan writes campaigns, never the defaults
    sweep, defaults = load_sweep(written)
    plan = plan_sweep(sweep, "t", defaults)
    assert plan.lane_keys() == [m.lane_key]  # the recorded lane, though its default now runs jagged
    tests = [b for b in plan.blocks if b.feature]
    assert {(b.feature, b.baseline_value, b.candidate_value) for b in tests} == {("moe_dispatch", "padded",
                                                                                  "jagged")}
    # Enough for the default policy to decide: 2 rounds x 4 blocks = its 8 blocks, 2 x 2 A/A = its 4.
    assert (len(tests), len(plan.blocks) - len(tests)) == (4, 2) and "2 round(s)" in result.output


def test_without_campaign_the_file_named_like_the_records_campaign_is_used(policy: Policy,
                                                                            tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    plans, refused, _ = plan_retests(m.defaults, policy, out_dir=tmp_path / "r")
    assert refused == [] and [p.source for p in plans] == [m.campaign]  # tiny.yaml, `name: tiny`, beside it


# --- (b) the outcome, from simulated re-test receipts with known truth ---


def retest(m: Marked, policy: Policy, tmp_path: Path, sim: Sim, seed: int = 7) -> object:
    [target], refused, _ = find_targets(m.defaults)
    assert refused == []
    receipts = keyed(simulate(sim, seed), m.lane_key)
    result = judge([target], receipts, policy, m.defaults, workdir=tmp_path / "work")
    write_defaults(result, m.defaults)
    return result


def retest_sim(m: Marked, truth: FeatureTruth, software: str = "sw-2", **knobs: object) -> Sim:
    params = {**QUIET, **knobs}
    return Sim(features=[truth], lane=m.flat, horizon=m.flat["budget.horizon_steps"], fingerprints=[software] * 2,
               campaign=f"revalidate-moe-{software}", block_prefix=f"R-{software}-", **params)


def test_a_retest_without_a_win_demotes_the_value_and_says_why(policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    result = retest(m, policy, tmp_path, retest_sim(m, moe(0.95)))
    [v] = result.verdicts
    assert v.verdict == REJECT and v.baseline_value == "padded"
    defaults = load_defaults(m.defaults)
    assert defaults.values["moe_dispatch"] == "padded"  # back to the value it replaced
    mark = record(m.defaults)["revalidate"]
    assert (mark["required"], mark["status"]) == (False, DEMOTED)
    [t] = mark["retests"]
    assert t["verdict"] == REJECT and t["software_fingerprint"] == "sw-2" and t["report"] == result.report_id
    assert t["speedup"] < 1.0 and t["ci95"][1] < 1.01 and t["reason"] == v.reason
    assert "demoted by" in m.defaults.read_text()  # the value line says so too
    assert record(m.defaults)["replaced"] == "padded"  # what the global promotion replaced: what comes back
    md = result.markdown
    assert "### Demoted (the win is gone on re-test)" in md and "`jagged` → `padded`" in md
    assert "| `moe_dispatch` | `jagged` | `padded` | global |" in md  # the defaults diff row
    # Resolved: the same software no longer finds it, and writing the report again changes nothing.
    assert find_targets(m.defaults)[0] == []
    assert write_defaults(result, m.defaults) == []


def test_a_retest_with_a_clear_win_confirms_the_value_and_resolves_the_mark(policy: Policy,
                                                                              tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    result = retest(m, policy, tmp_path, retest_sim(m, moe(1.05)))
    assert [v.verdict for v in result.verdicts] == [PROMOTE]
    entry = load_defaults(m.defaults).raw["features"]["moe_dispatch"]
    assert entry["value"] == "jagged"
    old, fresh = entry["evidence"]
    assert (old["revalidate"]["required"], old["revalidate"]["status"]) == (False, CONFIRMED)
    assert fresh["software_fingerprint"] == "sw-2" and fresh["revalidates"] == m.report
    assert fresh["lane_key"] == m.lane_key and fresh["previous"] == "padded" and "revalidate" not in fresh
    assert "### Revalidated (the value stays)" in result.markdown and "Demoted" not in result.markdown
    assert result.changes == []  # nothing in the defaults diff: the value stays


def test_a_retest_on_another_device_neither_demotes_nor_confirms(policy: Policy, tmp_path: Path) -> None:
    """The tiny lane says hardware.device: auto and its win was measured on CUDA: a re-test whose cluster ran it on
    CPU measured another lane (before, its REJECT demoted the GPU win)."""
    m = mark_jagged(tmp_path, policy)
    assert m.flat["hardware.device"] == "auto" and record(m.defaults)["device_class"] == "cuda"
    result = retest(m, policy, tmp_path, retest_sim(m, moe(0.95), device="cpu"))
    [v] = result.verdicts
    assert (v.verdict, v.device_class) == (REJECT, "cpu")
    [o] = result.revalidations
    assert o.outcome == UNCONFIRMED and "re-tested on cpu (REJECT), but the value was won on cuda" in o.reason
    assert load_defaults(m.defaults).values["moe_dispatch"] == "jagged"
    assert record(m.defaults)["revalidate"]["required"] is True  # still marked: a re-test on CUDA can settle it
    # ... and it is planned again without --repeat: the CPU re-test measured another lane, it settled nothing.
    [target], _, notes = find_targets(m.defaults)
    assert (target.lane_key, target.device_class, notes) == (m.lane_key, "cuda", [])
    result = retest(m, policy, tmp_path, retest_sim(m, moe(0.95), software="sw-3"), seed=8)  # its own report
    assert [o.outcome for o in result.revalidations] == [DEMOTED]


def test_a_record_keyed_by_an_auto_lane_as_written_is_neither_demoted_nor_confirmed(policy: Policy,
                                                                                   tmp_path: Path) -> None:
    """Records written before a shape named its device hashed hardware.device: auto: a demotion keyed by such a
    shape would be an override no sweep applies, and the lane would keep running the lost win (found in review)."""
    from ablate.config.lane_shape import lane_shape

    defaults, keys, flats = two_marked_lanes(tmp_path, policy, again="B")
    yaml = YAML()
    doc = yaml.load(defaults.read_text())
    for rec in doc["features"]["moe_dispatch"]["evidence"]:
        rec["lane_shape"] = lane_shape(flats["A" if rec["lane_key"] == keys["A"] else "B"])  # as written: auto
    with defaults.open("w") as handle:
        yaml.dump(doc, handle)
    targets, _, _ = find_targets(defaults)
    sim = Sim(features=[moe(0.95)], lane=flats["B"], horizon=flats["B"]["budget.horizon_steps"],
              fingerprints=["sw-2"] * 2, campaign="reval-sw-2", block_prefix="RB-", **QUIET)
    result = judge(targets, keyed(simulate(sim, 7), keys["B"]), policy, defaults, workdir=tmp_path / "B")
    [o] = result.revalidations
    wanted = shape_key(flats["B"], policy, "cuda")
    assert o.outcome == UNCONFIRMED and f"({wanted} if that is cuda), then re-test" in o.reason
    write_defaults(result, defaults)
    assert load_defaults(defaults).values["moe_dispatch"] == "jagged" and "lane_overrides" not in \
        load_defaults(defaults).raw["features"]["moe_dispatch"]
    # Re-keyed as the reason says, the record is re-tested without --repeat (that re-test measured another lane)
    # and the lost win is put back on lane B.
    doc = yaml.load(defaults.read_text())
    [b_record] = [r for r in doc["features"]["moe_dispatch"]["evidence"] if r["lane_key"] == keys["B"]]
    b_record["lane_shape"] = wanted
    with defaults.open("w") as handle:
        yaml.dump(doc, handle)
    targets, _, notes = find_targets(defaults)
    assert keys["B"] in [t.lane_key for t in targets], notes
    sim.campaign, sim.block_prefix = "reval-sw-2b", "RB2-"
    result = judge([t for t in targets if t.lane_key == keys["B"]], keyed(simulate(sim, 8), keys["B"]), policy,
                   defaults, workdir=tmp_path / "B2")
    assert [o.outcome for o in result.revalidations] == [DEMOTED]
    write_defaults(result, defaults)
    assert load_defaults(defaults).lane_default("moe_dispatch", wanted) == "padded"


def test_a_confirmed_global_value_is_still_demoted_when_a_later_retest_finds_the_win_gone(
        policy: Policy, tmp_path: Path) -> None:
    # Hole: the confirming record was written without ``replaced``, so after the next software change a re-test
    # that found a 5% slowdown could only say "unconfirmed", and the slower value stayed the default for good.
    m = mark_jagged(tmp_path, policy)
    retest(m, policy, tmp_path, retest_sim(m, moe(1.05)))
    fresh = load_defaults(m.defaults).raw["features"]["moe_dispatch"]["evidence"][-1]
    assert (fresh["scope"], fresh["replaced"], fresh["software_fingerprint"]) == ("global", "padded", "sw-2")
    marked = later_campaign(m.defaults, load_sweep(m.campaign)[0].lane, policy, software="sw-3", seed=9)
    assert [(r.recorded_fingerprint, r.current_fingerprint) for r in marked.revalidations] == [("sw-2", "sw-3")]
    result = retest(m, policy, tmp_path / "sw-3", retest_sim(m, moe(0.95), software="sw-3"), seed=11)
    assert [(o.verdict, o.outcome) for o in result.revalidations] == [(REJECT, DEMOTED)]
    assert load_defaults(m.defaults).values["moe_dispatch"] == "padded"


def test_an_inconclusive_retest_keeps_the_value_and_the_mark(policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    # One round of 3 blocks: too little for the rule to promote or to reject "no win".
    result = retest(m, policy, tmp_path, retest_sim(m, moe(1.0), blocks_per_host=1, rounds=1))
    [v] = result.verdicts
    assert v.verdict not in (PROMOTE, REJECT)
    assert load_defaults(m.defaults).values["moe_dispatch"] == "jagged"
    mark = record(m.defaults)["revalidate"]
    assert (mark["required"], mark["status"]) == (True, UNCONFIRMED)
    assert [t["verdict"] for t in mark["retests"]] == [v.verdict]
    # Still marked, but inconclusive is sticky: no second re-test of the same mark unless asked for.
    targets, _, [note] = find_targets(m.defaults)
    assert targets == [] and "--repeat" in note and v.verdict in note
    assert [t.feature for t in find_targets(m.defaults, repeat=True)[0]] == ["moe_dispatch"]
    assert "still unconfirmed" in result.markdown
    assert write_defaults(result, m.defaults) == []  # the same re-test is recorded once


def as_lane_override(m: Marked) -> dict:
    """The same promotion as a lane override (CPU evidence under the default policy is never global): its record."""
    yaml = YAML()
    doc = yaml.load(m.defaults.read_text())
    entry = doc["features"]["moe_dispatch"]
    rec = entry["evidence"][0]
    entry["value"], rec["scope"] = "padded", "lane"
    entry["lane_overrides"] = [{"lane_shape": rec["lane_shape"], "value": "jagged", "previous": "padded",
                                "report": rec["report"], "date": rec["date"], "revalidate": dict(rec["revalidate"])}]
    with m.defaults.open("w") as handle:
        yaml.dump(doc, handle)
    return dict(rec)


def test_a_lane_override_is_demoted_by_removing_it(policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    rec = as_lane_override(m)
    result = retest(m, policy, tmp_path, retest_sim(m, moe(0.95)))
    assert [v.verdict for v in result.verdicts] == [REJECT]
    defaults = load_defaults(m.defaults)
    assert defaults.overrides == {}  # the lane runs the global padded again
    assert "lane_overrides" not in defaults.raw["features"]["moe_dispatch"]
    assert "### Demoted" in result.markdown
    # The defaults diff shows the removal it makes (it used to say "nothing was promoted"): the global value
    # stays, the lane's override goes.
    [change] = result.changes
    assert (change.scope, change.old, change.new) == ("lane", "padded", None)
    assert change.override_edits == {rec["lane_shape"]: ("jagged", None)}
    diff = result.markdown.split("### Defaults diff")[1].split("\n### ")[0]
    assert "nothing was promoted" not in diff and "Rollback" not in diff
    assert (f"| `moe_dispatch` | `jagged` (lane override on `{rec['lane_shape'][:12]}…`) | `padded` (override "
            f"removed: the lane runs the global value) | lane |") in diff


def test_a_global_demotion_diff_shows_the_restored_value_and_the_override_it_moves(policy: Policy,
                                                                                 tmp_path: Path) -> None:
    # The promoting lane ran an override (grouped_mm) while the global value was padded: a demotion restores the
    # global padded (``replaced``) and puts the lane's override back on grouped_mm (``previous``). The diff said
    # the global value became grouped_mm, a value the file never gets.
    m = mark_jagged(tmp_path, policy)
    # The lane runs where grouped_mm has its own backend (bf16 on CUDA): on CPU jagged and grouped_mm run the same
    # code, and a re-test that finds the toggle inert keeps a global value instead of demoting it.
    sim = retest_sim(m, FeatureTruth("moe_dispatch", "jagged", "grouped_mm", 0.95))
    sim.lane = {**sim.lane, "hardware.device": "cuda", "precision": "bf16", "features.moe_dispatch": "grouped_mm"}
    yaml = YAML()
    doc = yaml.load(m.defaults.read_text())
    entry = doc["features"]["moe_dispatch"]
    rec = entry["evidence"][0]
    rec["previous"], rec["lane_shape"] = "grouped_mm", shape_key(sim.lane, policy)
    assert (rec["replaced"], entry["value"]) == ("padded", "jagged")
    entry["lane_overrides"] = [{"lane_shape": rec["lane_shape"], "value": "jagged", "previous": "grouped_mm",
                                "report": rec["report"], "date": rec["date"]}]
    with m.defaults.open("w") as handle:
        yaml.dump(doc, handle)
    result = retest(m, policy, tmp_path, sim)
    assert [(o.outcome, o.scope) for o in result.revalidations] == [(DEMOTED, "global")]
    assert result.verdicts[0].inert_reason is None
    defaults = load_defaults(m.defaults)
    assert defaults.values["moe_dispatch"] == "padded"
    assert defaults.for_shape(rec["lane_shape"])["moe_dispatch"] == "grouped_mm"
    [change] = result.changes
    assert (change.scope, change.old, change.new) == ("global", "jagged", "padded")
    assert change.override_edits == {rec["lane_shape"]: ("jagged", "grouped_mm")}
    md = result.markdown
    diff = md.split("### Defaults diff")[1].split("\n### ")[0]
    assert "| `moe_dispatch` | `jagged` | `padded` | global |" in diff
    assert f"| `moe_dispatch` | `jagged` (lane override on `{rec['lane_shape'][:12]}…`) | `grouped_mm` (lane " \
           f"override) | lane |" in diff
    assert "`grouped_mm` | global" not in diff
    assert "| `moe_dispatch` | `jagged` → `padded` | global |" in md.split("### Demoted")[1]


# --- (d) bad input ---


def test_a_marked_record_without_its_previous_value_is_refused(policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    drop_from_record(m.defaults, "previous")
    targets, [refused], _ = find_targets(m.defaults)
    assert targets == []
    assert refused.key.endswith(f"features.moe_dispatch.evidence[{m.lane_key}].previous")
    assert refused.value is None and "jagged" in refused.allowed and "guess" in refused.allowed
    result = invoke("--defaults", m.defaults, "--campaign", m.campaign, "--campaign-dir", tmp_path / "r")
    assert result.exit_code == 2 and "previous" in result.output and "nothing to re-test" in result.output


def test_a_campaign_on_another_lane_is_refused_naming_both_keys(policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    other = tiny_smoke(tmp_path / "other", name="tiny", lane={"batch": {"seq_len": 128}})
    _, [refused], _ = plan_retests(m.defaults, policy, campaigns=[other], out_dir=tmp_path / "r")
    assert isinstance(refused, ConfigError)
    assert "lane key" in refused.key and str(other) in refused.key
    assert refused.value == lane_key(with_feature(load_sweep(other)[0].lane, "moe_dispatch", "padded"))
    assert m.lane_key in refused.allowed and "padded" in refused.allowed
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*.yaml"))  # nothing written
    result = invoke("--defaults", m.defaults, "--campaign", other, "--campaign-dir", tmp_path / "r")
    assert result.exit_code == 2 and m.lane_key in result.output


def test_write_without_run_is_refused(policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    result = invoke("--defaults", m.defaults, "--write")
    assert result.exit_code == 2 and "--write needs --run" in result.output


# --- (c) end to end on a real tiny CPU campaign ---


@pytest.mark.ray
def test_revalidate_run_write_end_to_end(ray_address: str, policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy, device="cpu")  # the re-test runs here, where the value was won: on CPU
    uri = fresh_mlflow_uri(tmp_path / "mlflow")
    started = time.monotonic()
    result = invoke("--defaults", m.defaults, "--campaign", m.campaign, "--campaign-dir", tmp_path / "retests",
                    "--run", "--write", "--blocks", 1, "--aa-blocks", 1, "--rounds", 1, "--policy",
                    SINGLE_NODE_POLICY, "--tracking-uri", uri, "--storage", tmp_path / "runs", "--no-progress",
                    "--out", tmp_path / "reports")
    assert result.exit_code == 0, result.output
    elapsed = time.monotonic() - started
    mark = record(m.defaults)["revalidate"]
    [t] = mark["retests"]
    assert len(t["sweeps"]) == 1 and t["software_fingerprint"] not in (None, "sw-1")  # this machine's software
    [report] = sorted((tmp_path / "reports").glob("*.md"))
    assert t["report"] == report.stem
    # The receipts reached MLflow under the re-test's sweep.
    from ablate.tracking.mlflow_store import load_receipts_from_mlflow

    logged = [r for r in load_receipts_from_mlflow(uri, "ablate")[0] if r.identity.sweep_id == t["sweeps"][0]]
    assert len(logged) == 4 and {r.identity.lane_key for r in logged} == {m.lane_key}
    # One block cannot confirm the value; only a gate (a disqualified candidate) could reject it.
    assert t["verdict"] != PROMOTE
    value = load_defaults(m.defaults).values["moe_dispatch"]
    if t["verdict"] == REJECT:
        assert (mark["status"], value) == (DEMOTED, "padded")
    else:
        assert (mark["status"], mark["required"], value) == (UNCONFIRMED, True, "jagged")
    print(f"end-to-end revalidation: {elapsed:.1f} s, verdict {t['verdict']}")


def test_a_global_value_is_not_demoted_to_a_guess_when_its_record_does_not_say_what_it_replaced(
        policy: Policy, tmp_path: Path) -> None:
    """A record's ``previous`` is its lane's baseline, not necessarily the global value the promotion replaced (a
    lane running an override); records written before ``replaced`` was kept cannot say: the re-test's REJECT
    keeps the value and the mark, and says to set it back by hand."""
    m = mark_jagged(tmp_path, policy)
    drop_from_record(m.defaults, "replaced")
    result = retest(m, policy, tmp_path, retest_sim(m, moe(0.95)))
    assert [v.verdict for v in result.verdicts] == [REJECT]
    assert load_defaults(m.defaults).values["moe_dispatch"] == "jagged"
    mark = record(m.defaults)["revalidate"]
    assert mark["required"] is True and mark["status"] != DEMOTED
    assert "by hand" in mark["retests"][0]["reason"] and "which global value" in mark["retests"][0]["reason"]


def inert_candidates(receipts: list[Receipt]) -> list[Receipt]:
    """Every candidate arm observed the toggle acting on nothing (say the new software falls back to the reference
    path on this lane): the re-test REJECTs it as inert."""
    for r in receipts:
        if r.identity.arm.value == "candidate":
            r.disqualifiers.append(Disqualifier(code=Code.INERT_TOGGLE, detail="dispatch fell back to padded"))
    return receipts


def test_a_global_value_found_inert_on_its_retest_lane_stays_marked_instead_of_being_demoted(
        policy: Policy, tmp_path: Path) -> None:
    """A global flip needs every measured lane's win; the toggle doing nothing on the re-tested lane says nothing
    about the lanes where it acts, so the value stays, still marked, and the reason says what to do by hand."""
    m = mark_jagged(tmp_path, policy)
    [target], _, _ = find_targets(m.defaults)
    receipts = inert_candidates(keyed(simulate(retest_sim(m, moe(1.0)), 7), m.lane_key))
    result = judge([target], receipts, policy, m.defaults, workdir=tmp_path / "work")
    write_defaults(result, m.defaults)
    [v] = result.verdicts
    assert v.verdict == REJECT and v.inert_reason is not None
    assert [o.outcome for o in result.revalidations] == [UNCONFIRMED]
    assert load_defaults(m.defaults).values["moe_dispatch"] == "jagged"
    mark = record(m.defaults)["revalidate"]
    assert mark["required"] is True and mark["status"] == UNCONFIRMED
    reason = mark["retests"][0]["reason"]
    assert "inert" in reason and "by hand" in reason and "features.moe_dispatch.value" in reason
    assert result.changes == [] and "### Demoted" not in result.markdown


def test_a_lane_override_found_inert_on_its_lane_is_still_demoted(policy: Policy, tmp_path: Path) -> None:
    """A lane override only ever acted on its own lane: inert there, it goes (the lane runs the global value)."""
    m = mark_jagged(tmp_path, policy)
    as_lane_override(m)
    [target], _, _ = find_targets(m.defaults)
    receipts = inert_candidates(keyed(simulate(retest_sim(m, moe(1.0)), 7), m.lane_key))
    result = judge([target], receipts, policy, m.defaults, workdir=tmp_path / "work")
    write_defaults(result, m.defaults)
    assert [(o.verdict, o.outcome) for o in result.revalidations] == [(REJECT, DEMOTED)]
    assert load_defaults(m.defaults).overrides == {}


def gated(receipts: list[Receipt], code: Code, hosts: int, per_host: int = 1) -> list[Receipt]:
    """``per_host`` candidate arms of the tested feature on each of the first ``hosts`` hosts carry ``code``."""
    marked: dict[str, int] = {}
    for r in receipts:
        host = r.identity.host
        if r.identity.feature and r.identity.arm.value == "candidate" and marked.get(host, 0) < per_host and (
                host in marked or len(marked) < hosts):
            r.disqualifiers.append(Disqualifier(code=code, detail="from the re-test"))
            marked[host] = marked.get(host, 0) + 1
    assert sorted(marked.values()) == [per_host] * hosts
    return receipts


def judged(m: Marked, policy: Policy, tmp_path: Path, receipts: list[Receipt]) -> object:
    [target], _, _ = find_targets(m.defaults, repeat=True)  # an unconfirmed re-test is not planned again unasked
    return judge([target], receipts, policy, m.defaults, workdir=tmp_path / "work")


def test_a_gate_on_fewer_hosts_than_a_promote_needs_keeps_the_value_marked(policy: Policy, tmp_path: Path) -> None:
    """The rule REJECTs on one gated candidate arm; on a re-test that alone demoted a 5% win for every run (found in
    review). A gate demotes when its arms are on evidence.min_hosts hosts and gated more often than the baseline's;
    a node's own facts and INERT_TOGGLE (on some arms: the toggle acted on the others) count as none."""
    m = mark_jagged(tmp_path, policy)
    win = keyed(simulate(retest_sim(m, moe(1.05)), 7), m.lane_key)
    cases = [(Code.INERT_TOGGLE, 3, 2), (Code.NONFINITE_LOSS, 1, 1), (Code.NONFINITE_LOSS, 2, 2),
             (Code.NONFINITE_LOSS, 3, 1)]
    for code, hosts, per_host in cases:
        receipts = gated([r.model_copy(deep=True) for r in win], code, hosts, per_host)
        result = judged(m, policy, tmp_path / f"{code.value}-{hosts}-{per_host}", receipts)
        [v] = result.verdicts
        assert v.verdict == REJECT and code.value in v.reason, (code, hosts)
        [o] = result.revalidations
        assert o.outcome == UNCONFIRMED and "too thin to demote on" in o.reason, (code, hosts, o.reason)
        assert result.changes == []
    # A node's own facts reject nothing at all: their arms are left out as evidence, and the rest decides (one arm
    # of twelve: the win stands; six: too few blocks left, held).
    for code, hosts, per_host, verdict, outcome in [(Code.LOW_PRIORITY, 1, 1, PROMOTE, CONFIRMED),
                                                    (Code.LOW_PRIORITY, 3, 2, HOLD, UNCONFIRMED),
                                                    (Code.HARDWARE_MISMATCH, 3, 2, HOLD, UNCONFIRMED)]:
        receipts = gated([r.model_copy(deep=True) for r in win], code, hosts, per_host)
        result = judged(m, policy, tmp_path / f"{code.value}-{hosts}-{per_host}", receipts)
        [v] = result.verdicts
        [clause] = [c for c in v.clauses if c.name == "no_disqualifier"]
        assert clause.passed and "left out as evidence for their node's facts" in clause.detail, clause.detail
        assert (v.verdict, result.revalidations[0].outcome) == (verdict, outcome), (code, hosts, v.reason)
        assert result.changes == []
    result = judged(m, policy, tmp_path / "all", gated([r.model_copy(deep=True) for r in win], Code.NONFINITE_LOSS,
                                                       3, 2))
    assert [(o.verdict, o.outcome) for o in result.revalidations] == [(REJECT, DEMOTED)]


def test_a_thin_gate_does_not_shield_a_lost_win_from_the_demotion(policy: Policy, tmp_path: Path) -> None:
    """The rule stops at its first failing REJECT clause; behind one LOW_PRIORITY arm a 10% slower value was kept
    for good (found in review): the later clauses still demote it."""
    m = mark_jagged(tmp_path, policy)
    result = judged(m, policy, tmp_path, gated(keyed(simulate(retest_sim(m, moe(0.90)), 7), m.lane_key),
                                               Code.NONFINITE_LOSS, 1))
    [v] = result.verdicts
    assert v.reason.startswith("candidate arms disqualified: NONFINITE_LOSS")
    assert "win_possible" in [c.name for c in v.also_rejected]
    [o] = result.revalidations
    assert o.outcome == DEMOTED and o.reason.startswith("no meaningful win") and "too thin" in o.reason


def test_under_a_single_node_policy_one_gated_arm_of_twelve_does_not_demote(single_node_policy: Policy,
                                                                          tmp_path: Path) -> None:
    """min_hosts is 1 there: the host floor alone let one OOM arm of twelve demote a 5% win (found in review)."""
    m = mark_jagged(tmp_path, single_node_policy)
    win = keyed(simulate(retest_sim(m, moe(1.05), hosts=1, blocks_per_host=12), 7), m.lane_key)
    result = judged(m, single_node_policy, tmp_path / "one", gated([r.model_copy(deep=True) for r in win], Code.OOM,
                                                                   1))
    assert [(v.verdict, o.outcome) for v, o in zip(result.verdicts, result.revalidations)] == [(REJECT, UNCONFIRMED)]
    result = judged(m, single_node_policy, tmp_path / "most", gated([r.model_copy(deep=True) for r in win], Code.OOM,
                                                                    1, 8))
    assert [o.outcome for o in result.revalidations] == [DEMOTED]


def test_a_slower_value_with_one_inert_arm_and_a_gate_on_every_host_is_demoted(policy: Policy,
                                                                              tmp_path: Path) -> None:
    """INERT_TOGGLE on one arm of twelve is not "the toggle is inert here": it must not shield a value that is 10%
    slower and loses its loss on every host from the demotion (found in review of the inert rule)."""
    m = mark_jagged(tmp_path, policy)
    receipts = gated(gated(keyed(simulate(retest_sim(m, moe(0.90)), 7), m.lane_key), Code.NONFINITE_LOSS, 3),
                     Code.INERT_TOGGLE, 1)
    result = judged(m, policy, tmp_path, receipts)
    [v] = result.verdicts
    assert v.verdict == REJECT and not v.inert_everywhere and v.reason.startswith("candidate arms disqualified")
    assert [o.outcome for o in result.revalidations] == [DEMOTED]
    write_defaults(result, m.defaults)
    assert load_defaults(m.defaults).values["moe_dispatch"] == "padded"


def test_a_retest_under_the_software_it_was_promoted_on_decides_nothing(policy: Policy, tmp_path: Path) -> None:
    """The mark asks whether the win holds under the new software: receipts of the recorded software neither
    confirm (and resolve the mark) nor demote."""
    m = mark_jagged(tmp_path, policy)
    for truth, verdict in ((moe(1.05), PROMOTE), (moe(0.95), REJECT)):
        result = judged(m, policy, tmp_path / str(truth.ratio),
                        keyed(simulate(retest_sim(m, truth, software="sw-1"), 7), m.lane_key))
        [o] = result.revalidations
        assert (o.verdict, o.outcome) == (verdict, UNCONFIRMED) and "promoted on (sw-1)" in o.reason
        assert o.evidence is None and result.changes == []
        write_defaults(result, m.defaults)
        assert record(m.defaults)["revalidate"]["required"] is True
        assert load_defaults(m.defaults).values["moe_dispatch"] == "jagged"


def two_marked_lanes(tmp_path: Path, policy: Policy, again: str = "AB") -> tuple[Path, dict[str, str], dict[str, dict]]:
    """moe_dispatch=jagged promoted globally from two lanes in one report (sw-1), the lanes in ``again`` measured
    again under sw-2: their records of the one global value are marked."""
    campaigns = {"A": tiny_smoke(tmp_path / "a", name="tiny"),
                 "B": tiny_smoke(tmp_path / "b", name="tinyb", lane={"batch": {"seq_len": 128}})}
    defaults = campaigns["A"].parent / "defaults.yaml"
    lanes = {k: load_sweep(c)[0].lane for k, c in campaigns.items()}
    flats, keys = {k: flat_lane(lane) for k, lane in lanes.items()}, {k: lane_key(lane) for k, lane in lanes.items()}
    receipts = []
    for i, k in enumerate("AB"):
        receipts += keyed(simulate(Sim(features=[moe(1.05)], lane=flats[k], horizon=flats[k]["budget.horizon_steps"],
                                       campaign="tiny", block_prefix=f"P{k}-", **QUIET), i), keys[k])
    first = promote(receipts, policy_path=with_overrides(policy, {"scope.global_device_classes": []}),
                    defaults_path=defaults)
    assert [(c.scope, c.new) for c in first.changes] == [("global", "jagged")]
    write_defaults(first, defaults)
    for i, k in enumerate(again):
        later_campaign(defaults, lanes[k], policy, software="sw-2", seed=20 + i)
    return defaults, keys, flats


def test_retests_of_one_global_value_that_disagree_both_stay_marked(policy: Policy, tmp_path: Path) -> None:
    """Lane A confirms, lane B finds the win gone: applied one by one, the order of the evidence records chose the
    file's end state, and A's confirmed win ran nowhere with its mark resolved (found in review)."""
    defaults, keys, flats = two_marked_lanes(tmp_path, policy)
    targets, refused, _ = find_targets(defaults)
    assert refused == [] and len(targets) == 2
    receipts = []
    for i, (k, effect) in enumerate((("A", 1.05), ("B", 0.95))):
        sim = Sim(features=[moe(effect)], lane=flats[k], horizon=flats[k]["budget.horizon_steps"],
                  fingerprints=["sw-2"] * 2, campaign="reval-sw-2", block_prefix=f"R{k}-", **QUIET)
        receipts += keyed(simulate(sim, 7 + i), keys[k])
    for order in (targets, targets[::-1]):
        result = judge(order, receipts, policy, defaults, workdir=tmp_path / "work")
        assert sorted(v.verdict for v in result.verdicts) == [PROMOTE, REJECT]
        assert [o.outcome for o in result.revalidations] == [UNCONFIRMED, UNCONFIRMED]
        assert all("conflicting re-tests" in o.reason and o.evidence is None for o in result.revalidations)
        assert result.changes == [] and "### Demoted" not in result.markdown
    write_defaults(result, defaults)
    assert load_defaults(defaults).values["moe_dispatch"] == "jagged"
    assert len(find_targets(defaults, repeat=True)[0]) == 2  # both still marked


def test_a_global_promotion_that_only_moved_an_override_is_demoted_by_moving_it_back(policy: Policy,
                                                                                      tmp_path: Path) -> None:
    """jagged was already the global value; the promotion moved the lane's padded override onto it (``replaced``
    is jagged). Found in review: the demotion wrote "jagged -> jagged (demoted)" over the value's comment."""
    m = mark_jagged(tmp_path, policy)
    yaml = YAML()
    doc = yaml.load(m.defaults.read_text())
    entry = doc["features"]["moe_dispatch"]
    rec = entry["evidence"][0]
    rec["replaced"] = "jagged"
    entry["lane_overrides"] = [{"lane_shape": rec["lane_shape"], "value": "jagged", "previous": "padded",
                                "report": rec["report"], "date": rec["date"]}]
    with m.defaults.open("w") as handle:
        yaml.dump(doc, handle)
    result = judged(m, policy, tmp_path, keyed(simulate(retest_sim(m, moe(0.95)), 7), m.lane_key))
    assert [o.outcome for o in result.revalidations] == [DEMOTED]
    edits = [str(e) for e in write_defaults(result, m.defaults)]
    defaults = load_defaults(m.defaults)
    assert defaults.values["moe_dispatch"] == "jagged"
    assert defaults.for_shape(rec["lane_shape"])["moe_dispatch"] == "padded"
    assert any("lane_overrides" in e and "demoted with the global value" in e for e in edits)
    assert not any("features.moe_dispatch.value:" in e for e in edits)
    assert "(was jagged: its win is gone" not in m.defaults.read_text()  # the value's own comment is kept
    demoted = result.markdown.split("### Demoted")[1].split("\n### ")[0]
    assert "`jagged` → `jagged`" not in demoted and "the global value stays" in demoted


def test_a_demotion_with_nothing_to_put_back_stays_unconfirmed(policy: Policy, tmp_path: Path) -> None:
    """The global promotion found jagged in place and moved the lane's override, since removed by hand: a demotion
    would edit nothing, yet resolved the mark "demoted" and the report claimed a move (found in review)."""
    m = mark_jagged(tmp_path, policy)
    yaml = YAML()
    doc = yaml.load(m.defaults.read_text())
    doc["features"]["moe_dispatch"]["evidence"][0]["replaced"] = "jagged"
    doc["features"]["moe_dispatch"].pop("lane_overrides", None)
    with m.defaults.open("w") as handle:
        yaml.dump(doc, handle)
    result = judged(m, policy, tmp_path, keyed(simulate(retest_sim(m, moe(0.95)), 7), m.lane_key))
    [o] = result.revalidations
    assert o.verdict == REJECT and o.outcome == UNCONFIRMED and "by hand" in o.reason
    assert result.changes == [] and "### Demoted" not in result.markdown
    write_defaults(result, m.defaults)
    assert record(m.defaults)["revalidate"]["required"] is True


def test_gates_in_refused_blocks_count_on_their_hosts(policy: Policy, tmp_path: Path) -> None:
    """A candidate that lost its loss while its block's baseline never ran leaves a refused block: its gate counts
    in the verdict, and now on its host too (it counted on none, found in review)."""
    m = mark_jagged(tmp_path, policy)
    receipts = gated(keyed(simulate(retest_sim(m, moe(1.05)), 7), m.lane_key), Code.NONFINITE_LOSS, 3, 2)
    hit = {r.identity.block_id for r in receipts if r.disqualifiers and r.identity.arm.value == "candidate"}
    receipts = [r for r in receipts if not (r.identity.block_id in hit and r.identity.arm.value == "baseline")]
    [v] = judged(m, policy, tmp_path, receipts).verdicts
    assert v.gated_disqualifiers == {"NONFINITE_LOSS": 6} and all("(block refused)" in a for a in v.gated_arms)
    assert (v.gated_hosts, v.gated_own_arms) == (3, 6)


def with_a_failed_first_attempt(receipts: list[Receipt], failing: dict[tuple[str, str], str],
                                code: Code) -> list[Receipt]:
    """Blocks (sweep id, block id) that ran twice: attempt 0's arm of the given role failed with ``code`` beside a
    valid partner, attempt 1 is the standing pair."""
    extra = []
    for arm in [r for r in receipts if r.identity.feature and (r.identity.sweep_id, r.identity.block_id) in failing]:
        ident = arm.identity
        failed = ident.arm.value == failing[(ident.sweep_id, ident.block_id)]
        extra.append(make_receipt(
            receipt_id=ident.receipt_id + "-attempt0", sweep_id=ident.sweep_id, block_id=ident.block_id,
            arm=ident.arm.value, arm_index=ident.arm_index, order=ident.order, feature=ident.feature,
            feature_value=ident.feature_value, baseline_value=ident.baseline_value, lane=arm.requested.lane,
            host=ident.host, tps=None if failed else 5000.0, loss=5.0, lane_key=ident.lane_key,
            status="failed" if failed else "valid",
            disqualifiers=({"code": code.value, "detail": "from attempt 0"}, {"code": "ARM_FAILED"}) if failed else (),
            software_fingerprint=ident.software_fingerprint, campaign=ident.campaign,
            created_at=datetime.fromisoformat(ident.created_at) - timedelta(minutes=1), attempt=0))
        ident.attempt = 1
    return receipts + extra


def blocks_by_host(receipts: list[Receipt]) -> dict[str, list[tuple[str, str]]]:
    by_host: dict[str, list[tuple[str, str]]] = {}
    for host, sweep, block in sorted({(r.identity.host, r.identity.sweep_id, r.identity.block_id) for r in receipts
                                      if r.identity.feature}):
        by_host.setdefault(host, []).append((sweep, block))
    return by_host


def test_a_feature_that_loses_its_loss_everywhere_with_a_retry_is_demoted_not_a_crash(policy: Policy,
                                                                                       tmp_path: Path) -> None:
    """Counting gated views, a retried block counted twice against one block in the denominator: the Fisher table
    went negative and promote raised (found in review). Gates are counted by block."""
    m = mark_jagged(tmp_path, policy)
    receipts = gated(keyed(simulate(retest_sim(m, moe(0.95)), 7), m.lane_key), Code.NONFINITE_LOSS, 3, 4)
    first = next(iter(blocks_by_host(receipts).values()))[0]
    result = judged(m, policy, tmp_path, with_a_failed_first_attempt(receipts, {first: "candidate"},
                                                                     Code.NONFINITE_LOSS))
    [v] = result.verdicts
    assert v.verdict == REJECT and v.gated_own_arms == 13 and v.gate_fisher_p < 0.01
    assert [o.outcome for o in result.revalidations] == [DEMOTED]


def test_a_gate_both_arms_share_at_the_same_rate_does_not_demote(policy: Policy, tmp_path: Path) -> None:
    """The new software OOMs baseline and candidate arms alike: the gate is the software's, not the feature's. A
    gated baseline's block is refused, so it was invisible and a 5% win was demoted (found in review)."""
    m = mark_jagged(tmp_path, policy)
    win = keyed(simulate(retest_sim(m, moe(1.05), blocks_per_host=8), 7), m.lane_key)
    by_host = blocks_by_host(win)
    role = {**{k: "candidate" for keys in by_host.values() for k in keys[0:4:2]},
            **{k: "baseline" for keys in by_host.values() for k in keys[1:4:2]}}
    refused = [r.model_copy(deep=True) for r in win]  # the standing pair carries the gate: a gated baseline is refused
    for r in refused:
        if r.identity.feature and role.get((r.identity.sweep_id, r.identity.block_id)) == r.identity.arm.value:
            r.disqualifiers.append(Disqualifier(code=Code.OOM, detail="CUDA out of memory"))
    retried = with_a_failed_first_attempt([r.model_copy(deep=True) for r in win], role, Code.OOM)  # kept, retried
    for receipts in (refused, retried):
        result = judged(m, policy, tmp_path, receipts)
        [v] = result.verdicts
        assert v.verdict == REJECT and v.gated_hosts == 3 and v.gate_fisher_p > 0.5
        assert [o.outcome for o in result.revalidations] == [UNCONFIRMED]


def test_a_thin_gate_does_not_shield_a_counter_on_every_host(policy: Policy, tmp_path: Path) -> None:
    m = mark_jagged(tmp_path, policy)
    receipts = keyed(simulate(retest_sim(m, moe(1.05)), 7), m.lane_key)
    for r in receipts:
        if r.identity.feature and r.identity.arm.value == "candidate":
            r.observed.compile.graph_breaks = 3
    result = judged(m, policy, tmp_path, gated(receipts, Code.NONFINITE_LOSS, 1))
    [v] = result.verdicts
    assert failing_names(v) == ["no_disqualifier"] and "exact_counters" in [c.name for c in v.also_rejected]
    assert [o.outcome for o in result.revalidations] == [DEMOTED]


def test_two_lanes_that_both_find_the_win_gone_both_demote(policy: Policy, tmp_path: Path) -> None:
    """The first demotion puts the global value back; the second lane's then edits nothing, and was called "set it
    back by hand" although the file already had (found in review)."""
    defaults, keys, flats = two_marked_lanes(tmp_path, policy)
    targets, _, _ = find_targets(defaults)
    receipts = []
    for i, k in enumerate("AB"):
        sim = Sim(features=[moe(0.95)], lane=flats[k], horizon=flats[k]["budget.horizon_steps"],
                  fingerprints=["sw-2"] * 2, campaign="reval-sw-2", block_prefix=f"R{k}-", **QUIET)
        receipts += keyed(simulate(sim, 7 + i), keys[k])
    result = judge(targets, receipts, policy, defaults, workdir=tmp_path / "work")
    assert [o.outcome for o in result.revalidations] == [DEMOTED, DEMOTED]
    assert "put back with lane" in result.revalidations[1].reason
    write_defaults(result, defaults)
    assert load_defaults(defaults).values["moe_dispatch"] == "padded"
    assert find_targets(defaults, repeat=True)[0] == []


def failing_names(v: object) -> list[str]:
    return [c.name for c in v.clauses if not c.passed]


def test_one_lanes_lost_win_puts_back_that_lane_only_while_another_lane_still_holds_the_global_value_up(
        policy: Policy, tmp_path: Path) -> None:
    """jagged went global on lanes A and B; only B was measured again (sw-2) and its re-test finds the win gone.
    B's evidence restored padded for every lane, A included, whose win nobody re-measured; from a CPU lane that
    reached GPU lanes too (found in review). Now B's shape goes back to padded, the global value stays, and A is
    marked for a re-test; once A's win is gone too, the global value goes back."""
    defaults, keys, flats = two_marked_lanes(tmp_path, policy, again="B")
    shapes = {k: shape_key(flats[k], policy, "cuda") for k in "AB"}  # the simulated arms ran on CUDA

    def retest_lane(k: str, seed: int) -> object:
        targets, refused, _ = find_targets(defaults)
        assert refused == [] and [t.lane_key for t in targets] == [keys[k]]
        sim = Sim(features=[moe(0.95)], lane=flats[k], horizon=flats[k]["budget.horizon_steps"],
                  fingerprints=["sw-2"] * 2, campaign="reval-sw-2", block_prefix=f"R{k}-", **QUIET)
        result = judge(targets, keyed(simulate(sim, seed), keys[k]), policy, defaults, workdir=tmp_path / k)
        write_defaults(result, defaults)
        return result

    first = retest_lane("B", 7)
    after = load_defaults(defaults)
    assert after.values["moe_dispatch"] == "jagged"
    assert [after.lane_default("moe_dispatch", shapes[k]) for k in "AB"] == ["jagged", "padded"]
    [o] = first.revalidations
    assert (o.outcome, o.scope, o.still_supported_by) == (DEMOTED, "global", (keys["A"],))
    assert "the global 'jagged' stays" in o.reason and keys["A"][:12] in o.reason
    [change] = first.changes
    assert (change.scope, change.new, change.override_edits) == ("lane", None, {shapes["B"]: (None, "padded")})
    assert "`jagged` → `padded` (this lane's override; the global value stays)" in first.markdown
    # A's record is marked for a re-test under the software B's re-test ran
    mark = next(r for r in after.raw["features"]["moe_dispatch"]["evidence"] if r["lane_key"] == keys["A"])["revalidate"]
    assert (mark["required"], mark["current_fingerprint"]) == (True, "sw-2") and keys["B"][:12] in mark["reason"]

    second = retest_lane("A", 8)  # control: no lane holds it up any more, so the global value goes back
    assert [(o.outcome, o.still_supported_by) for o in second.revalidations] == [(DEMOTED, ())]
    final = load_defaults(defaults)
    assert final.values["moe_dispatch"] == "padded"
    assert [final.lane_default("moe_dispatch", shapes[k]) for k in "AB"] == ["padded", "padded"]
    # B's override goes with it: the global value says it now, and a later global flip must not find B pinned
    assert "lane_overrides" not in final.raw["features"]["moe_dispatch"]
    assert find_targets(defaults, repeat=True)[0] == []


def test_a_lane_that_confirmed_under_the_retests_software_holds_the_value_up_without_a_new_mark(
        policy: Policy, tmp_path: Path) -> None:
    """A confirmed jagged under sw-2 (a fresh sw-2 record); then B's sw-2 re-test finds the win gone. A's fresh
    record holds the global value up, and is not marked for a sw-2 re-test: that re-test could only end "still
    unconfirmed", which is sticky and would block the re-test a later software needs (found in review)."""
    defaults, keys, flats = two_marked_lanes(tmp_path, policy)
    shapes = {k: shape_key(flats[k], policy, "cuda") for k in "AB"}  # the simulated arms ran on CUDA
    for seed, (k, effect, outcome) in enumerate((("A", 1.05, CONFIRMED), ("B", 0.95, DEMOTED)), start=7):
        targets = [t for t in find_targets(defaults)[0] if t.lane_key == keys[k]]
        sim = Sim(features=[moe(effect)], lane=flats[k], horizon=flats[k]["budget.horizon_steps"],
                  fingerprints=["sw-2"] * 2, campaign=f"reval-{k}", block_prefix=f"R{k}-", **QUIET)
        result = judge(targets, keyed(simulate(sim, seed), keys[k]), policy, defaults, workdir=tmp_path / k)
        assert [o.outcome for o in result.revalidations] == [outcome]
        write_defaults(result, defaults)
    after = load_defaults(defaults)
    assert after.values["moe_dispatch"] == "jagged"
    assert [after.lane_default("moe_dispatch", shapes[k]) for k in "AB"] == ["jagged", "padded"]
    fresh = [r for r in after.raw["features"]["moe_dispatch"]["evidence"] if r["software_fingerprint"] == "sw-2"]
    assert [(r["lane_key"], "revalidate" in r) for r in fresh] == [(keys["A"], False)]
    assert find_targets(defaults, repeat=True)[0] == []


def test_a_record_on_the_demoted_lanes_shape_does_not_hold_the_global_value_up(policy: Policy,
                                                                                tmp_path: Path) -> None:
    """Lanes A and A2 share a shape (they differ in another feature's value). A's re-test finds the win gone and A2's
    gives no verdict: an override on that shape would take A2 off the value too, leaving a global value no lane
    left to re-test holds up (found in review). The global value goes back."""
    campaigns = {"A": tiny_smoke(tmp_path / "a", name="tiny"),
                 "A2": tiny_smoke(tmp_path / "a2", name="tinyc", lane={"features": {"mla_ingress": "fused"}})}
    defaults = campaigns["A"].parent / "defaults.yaml"
    lanes = {k: load_sweep(c)[0].lane for k, c in campaigns.items()}
    flats, keys = {k: flat_lane(lane) for k, lane in lanes.items()}, {k: lane_key(lane) for k, lane in lanes.items()}
    assert shape_key(flats["A"], policy) == shape_key(flats["A2"], policy) and keys["A"] != keys["A2"]
    receipts = []
    for i, k in enumerate(("A", "A2")):
        receipts += keyed(simulate(Sim(features=[moe(1.05)], lane=flats[k], horizon=flats[k]["budget.horizon_steps"],
                                       campaign="tiny", block_prefix=f"P{k}-", **QUIET), i), keys[k])
    first = promote(receipts, policy_path=with_overrides(policy, {"scope.global_device_classes": []}),
                    defaults_path=defaults)
    write_defaults(first, defaults)
    later_campaign(defaults, lanes["A"], policy, software="sw-2", seed=20)
    targets, _, _ = find_targets(defaults)
    assert sorted(t.lane_key for t in targets) == sorted(keys.values())
    sim = Sim(features=[moe(0.95)], lane=flats["A"], horizon=flats["A"]["budget.horizon_steps"],
              fingerprints=["sw-2"] * 2, campaign="reval-sw-2", block_prefix="RA-", **QUIET)
    result = judge(targets, keyed(simulate(sim, 7), keys["A"]), policy, defaults, workdir=tmp_path / "work")
    assert {o.lane_key: (o.outcome, o.still_supported_by) for o in result.revalidations} == {
        keys["A"]: (DEMOTED, ()), keys["A2"]: (UNCONFIRMED, ())}
    write_defaults(result, defaults)
    assert load_defaults(defaults).values["moe_dispatch"] == "padded"


def test_a_global_record_whose_lane_runs_another_value_since_is_not_retested(policy: Policy, tmp_path: Path) -> None:
    """The lane that measured the global jagged runs a grouped_mm override since: re-testing jagged there decided the
    global value on a lane it no longer reaches (found in review). An override holding jagged itself (the promotion
    carried it along) still makes the record a target (test_a_global_demotion_diff_shows_...)."""
    m = mark_jagged(tmp_path, policy)
    yaml = YAML()
    doc = yaml.load(m.defaults.read_text())
    entry = doc["features"]["moe_dispatch"]
    rec = entry["evidence"][0]
    entry["lane_overrides"] = [{"lane_shape": rec["lane_shape"], "value": "grouped_mm", "previous": "jagged",
                                "report": "promote-later", "date": rec["date"]}]
    with m.defaults.open("w") as handle:
        yaml.dump(doc, handle)
    targets, refused, notes = find_targets(m.defaults)
    assert targets == [] and refused == []
    assert notes == [f"features.moe_dispatch.evidence[{m.lane_key}]: 'jagged' is no longer what the lane runs "
                     f"('grouped_mm'); not re-tested"]
