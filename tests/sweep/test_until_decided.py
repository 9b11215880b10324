"""``ablate sweep --until-decided`` (issue 15): the searcher runs blocks only for undecided tests, round after round.

The judge is the promotion rule itself (``promote`` under a sequential policy); the searcher is a real Ray Tune
``Searcher`` driving a real sweep; the rounds are real sweeps on a local Ray cluster with a real MLflow store.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from ruamel.yaml import YAML

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))

from promote_sim import FeatureTruth, Sim, moe, simulate  # noqa: E402
from sweeps_common import REPO, fresh_mlflow_uri, tiny_smoke  # noqa: E402

from ablate.config.load import load_sweep  # noqa: E402
from ablate.config.schema import ConfigError  # noqa: E402
from ablate.promote import PROMOTE, load_policy, with_overrides  # noqa: E402
from ablate.promote.sequential import CAP, LOWER, UPPER  # noqa: E402
from ablate.receipts.store import load_receipts  # noqa: E402
from ablate.sweep.plan import plan_sweep  # noqa: E402
from ablate.sweep.run import run_sweep  # noqa: E402
from ablate.sweep.until_decided import (DECIDED, OPEN, RoundRecord, Standing, UntilDecidedSearcher,  # noqa: E402
                                        block_keys, judge_states, next_round, sequential_policy)

POLICIES = REPO / "search_spaces" / "policies"
DEFAULTS = REPO / "search_spaces" / "defaults.yaml"
QUIET = {"noise": 0.007, "aa_per_host": 2}


def test_the_judge_is_the_promotion_rule_under_the_sequential_policy() -> None:
    """A clear 30% win is decided (upper crossing, then PROMOTE); a null is decided by the lower bound or left open,
    never promoted; a test with one round of blocks stays open (the rule needs two counted rounds)."""
    policy = load_policy(POLICIES / "default_sequential.yaml")
    mamba_null = FeatureTruth("mamba_scan", "chunked", "sequential", 1.0)
    two_rounds = simulate(Sim([moe(1.3), mamba_null], **QUIET), seed=3)
    states = {s.feature: s for s in judge_states(two_rounds, policy, DEFAULTS).values()}
    assert states["moe_dispatch"].decided and states["moe_dispatch"].verdict == PROMOTE
    assert states["moe_dispatch"].decision == UPPER and states["moe_dispatch"].llr >= states["moe_dispatch"].upper
    assert states["mamba_scan"].verdict != PROMOTE and states["mamba_scan"].decision != UPPER
    assert states["mamba_scan"].decided == (states["mamba_scan"].decision in (LOWER, CAP))

    one_round = simulate(Sim([moe(1.3)], rounds=1, **QUIET), seed=3)
    only = next(iter(judge_states(one_round, policy, DEFAULTS).values()))
    assert only.state == OPEN and only.decision != LOWER and "round" in only.why


def test_a_suspicious_win_stays_open_for_its_confirming_round() -> None:
    """A win beyond Amdahl's bound crosses the upper bound and holds for a confirming round, which comes after the
    decision by design: closed as decided, the campaign ended "every test decided" and it never ran (review)."""
    policy = load_policy(POLICIES / "default_sequential.yaml")
    two = next(iter(judge_states(simulate(Sim([moe(1.9)], **QUIET), seed=0), policy, DEFAULTS).values()))
    assert two.decision == UPPER and two.state == OPEN and two.verdict != PROMOTE
    assert "a later round confirms it" in two.why and "needs a confirming round" in two.why, two.why
    three = next(iter(judge_states(simulate(Sim([moe(1.9)], rounds=3, **QUIET), seed=0), policy, DEFAULTS).values()))
    assert three.state == DECIDED and three.verdict == PROMOTE, three.why


def test_a_decided_line_says_when_the_verdict_is_not_the_decisions_own() -> None:
    """A lower crossing the close-call check held reads like a rejection unless the line says the verdict; and each
    LLR trace is shown against its own bound (the promotion test's, far below the lower bound, looked decided)."""
    policy = load_policy(POLICIES / "default_sequential.yaml")
    held = next(iter(judge_states(simulate(Sim([moe(1.0)], **QUIET), seed=1), policy, DEFAULTS).values()))
    assert held.decision == LOWER and held.state == DECIDED and held.verdict != "REJECT"
    assert f"the verdict is {held.verdict}" in held.why, held.why
    line = held.line()
    assert "promotion test [" in line and "rejection test [" in line
    assert f"against {held.lower:.2f}" in line and f"against {held.upper:.2f}" in line


def test_a_policy_without_the_sequential_test_is_refused_before_anything_runs() -> None:
    with pytest.raises(ConfigError) as caught:
        sequential_policy(POLICIES / "single_node.yaml")
    assert "sequential.enabled" in str(caught.value) and "single_node_sequential.yaml" in str(caught.value)


def test_the_sequential_twins_differ_from_their_policies_only_in_the_sequential_switch() -> None:
    for fixed, twin in (("default", "default_sequential"), ("single_node", "single_node_sequential")):
        a, b = load_policy(POLICIES / f"{fixed}.yaml"), load_policy(POLICIES / f"{twin}.yaml")
        assert b.sequential.enabled and not a.sequential.enabled
        assert with_overrides(a, {"sequential.enabled": True}).__dict__ | {"name": b.name, "version": b.version,
                                                                             "path": b.path} == b.__dict__


@dataclass
class _Judged:
    """The judge's answers as data: the searcher's scheduling is tested apart from the rule."""

    answers: dict

    def states(self) -> dict:
        return dict(self.answers)


def _state(key: tuple, state: str) -> Standing:
    return Standing(feature=key[0], value=key[1], lane_key=key[2], state=state, verdict="HOLD", why="test says so")


def test_the_searcher_hands_out_open_blocks_in_plan_order_and_drops_a_test_decided_mid_round(tmp_path: Path) -> None:
    sweep, defaults = load_sweep(tiny_smoke(tmp_path, blocks=3, aa_blocks=1))
    plan = plan_sweep(sweep, "smoke-20261123-000000-ab12", defaults)
    keys = block_keys(plan)
    moe_key = next(k for _, k in keys if k and k[0] == "moe_dispatch")
    mamba_key = next(k for _, k in keys if k and k[0] == "mamba_scan")
    judge = _Judged({moe_key: _state(moe_key, DECIDED)})
    searcher = UntilDecidedSearcher(keys, judge)
    assert searcher.expected_blocks() == 3 + 1  # mamba's three blocks and the A/A block
    first = searcher.suggest("t1")
    assert first == {"block_id": next(b for b, k in keys if k != moe_key)}
    judge.answers[mamba_key] = _state(mamba_key, DECIDED)  # mamba crosses a bound with its first block
    searcher.on_trial_complete("t1")
    rest = []
    while (suggestion := searcher.suggest(f"t{len(rest) + 2}")) != UntilDecidedSearcher.FINISHED:
        rest.append(suggestion["block_id"])
    ran = [first["block_id"]] + rest
    assert [b for b, k in keys if b in ran] == ran  # plan order
    assert {k for b, k in keys if b in rest} == {None}  # after the decision: only the A/A block
    assert set(searcher.skipped) == {b for b, k in keys if k in (moe_key, mamba_key) and b != first["block_id"]}
    assert all("decided: test says so" in why for why in searcher.skipped.values())

    # Tune keeps the searcher in its experiment state (--resume): it pickles, and save/restore keep its place.
    copy = pickle.loads(pickle.dumps(searcher))
    assert copy.suggested == searcher.suggested
    searcher.save(str(tmp_path / "searcher.json"))
    fresh = UntilDecidedSearcher(keys, _Judged({}))
    fresh.restore(str(tmp_path / "searcher.json"))
    assert fresh.suggest("t9") == UntilDecidedSearcher.FINISHED and fresh.suggested == searcher.suggested


def _policy_file(directory: Path, **overrides: object) -> Path:
    yaml = YAML()
    data = yaml.load((POLICIES / "single_node_sequential.yaml").read_text())
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        data[section][key] = value
    path = directory / "policy.yaml"
    with path.open("w") as handle:
        yaml.dump(data, handle)
    return path


def test_until_decided_runs_only_undecided_tests_resumes_after_ctrl_c_and_stops_when_all_are_decided(
        ray_address: str, tmp_path: Path) -> None:
    """Real rounds through the CLI: a fixed sweep first gives moe_dispatch its capped evidence; `ablate sweep
    --until-decided` on the campaign with both features then runs mamba_scan's blocks (and the A/A blocks) only.
    Ctrl+C once its first block is in; `--until-decided --resume` continues that same round (Tune restores the
    searcher: no block twice, moe_dispatch still left out) and the campaign stops once mamba_scan is capped too.

    Every driver (the fixed sweep here, each CLI run through ``RAY_ADDRESS``) attaches to the one local Ray runtime
    of the ``ray_address`` fixture, as drivers submitted to a cluster do: a local runtime started per driver costs
    10-20 s of a 2-core host each time, and starting Ray is not what this test is about."""
    uri = fresh_mlflow_uri(tmp_path)
    storage = str(tmp_path / "storage")
    # min_aa_blocks 2, the round's A/A blocks: the lane is calibrated, so a test that crosses a bound is not held for
    # want of A/A blocks (which would run the campaign on to max_rounds for more of them).
    policy = _policy_file(tmp_path, **{"evidence.min_rounds": 1, "evidence.min_blocks_per_round": 2,
                                       "evidence.min_round_gap_s": 0, "sequential.min_blocks": 2,
                                       "sequential.max_blocks": 2, "sequential.max_rounds": 2,
                                       "threshold.min_aa_blocks": 2})
    # Two A/A blocks beside moe_dispatch's own: whichever bound its two blocks cross on this host's noise (or none),
    # it is decided here; with one, a crossed bound held for want of A/A blocks and ran again in the round below.
    earlier = tiny_smoke(tmp_path / "fixed", name="decide", steps=4, blocks=2, aa_blocks=2,
                         features={"moe_dispatch": ["jagged"]}, resources={"cpus_per_worker": 1,
                                                                           "max_concurrent_blocks": 1})
    first = run_sweep(earlier, tracking_uri=uri, storage=storage, progress=False)
    assert first.exit_code == 0 and first.blocks_done == 4

    campaign = tiny_smoke(tmp_path / "until", name="decide", steps=4, blocks=2, aa_blocks=2,
                          resources={"cpus_per_worker": 1, "max_concurrent_blocks": 1})
    receipts_dir = Path(storage) / "decide" / "receipts"
    command = [sys.executable, "-m", "ablate", "sweep", str(campaign), "--until-decided", "--policy", str(policy),
               "--storage", storage, "--tracking-uri", uri, "--no-progress"]

    def this_round() -> list:
        return [r for r in load_receipts(receipts_dir)[0] if r.identity.sweep_id != first.sweep_id]

    env = {**os.environ, "RAY_ADDRESS": ray_address}
    log_path = tmp_path / "driver.log"
    with log_path.open("w") as log:
        driver = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while len(this_round()) < 2:  # the round's first block (an interleaved pair writes both at its end)
            assert driver.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no block of the round in time"
            time.sleep(0.2)
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
    interrupted = log_path.read_text()
    assert "interrupted" in interrupted and "every speed test of the campaign is decided" not in interrupted, \
        interrupted[-3000:]
    assert f"--until-decided --policy {policy} --resume" in interrupted, interrupted[-3000:]
    round_id = this_round()[0].identity.sweep_id

    # Resumed without --until-decided, Tune would bring the searcher back while the receipts claimed a fixed
    # schedule: refused before anything runs.
    plain = subprocess.run(command[:5] + command[8:] + ["--resume"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    said = " ".join((plain.stdout + plain.stderr).split())  # the console wraps long lines
    assert plain.returncode == 2 and "it is an --until-decided round" in said, said[-2000:]

    resumed = subprocess.run(command + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "stopped: every speed test of the campaign is decided" in output, output[-4000:]
    assert f"round {round_id}: " in output and "1 round(s) this run" in output, output[-4000:]
    receipts = this_round()
    assert {r.identity.sweep_id for r in receipts} == {round_id}  # no second round was needed
    valid = [r for r in receipts if r.identity.status.value == "valid"]
    blocks = {(r.identity.block_id, r.identity.feature) for r in valid}
    assert {f for _, f in blocks} == {"mamba_scan", None} and len(blocks) == 4, blocks  # never moe_dispatch
    assert len(valid) == 8  # each of the four blocks once: nothing ran twice after the resume
    assert "moe_dispatch=jagged lane" in output and output.count(": decided (") >= 2, output[-4000:]
    assert f"--policy {policy}" in output
    assert "--defaults " in " ".join(output.split()), "promote reads the campaign's defaults, as the judge did"

    # Run again: every test is already decided, so nothing is planned, started or logged.
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 round(s) this run" in again.stdout, again.stdout[-2000:] + again.stderr
    assert {r.identity.sweep_id for r in this_round()} == {round_id}

    # The receipts say how their blocks were scheduled; the fixed rule holds the sequentially stopped test only.
    everything = load_receipts(receipts_dir)[0]
    assert {r.identity.schedule for r in everything if r.identity.sweep_id == round_id} == {"until_decided"}
    assert {r.identity.schedule for r in everything if r.identity.sweep_id == first.sweep_id} == {"fixed"}
    from ablate.promote import promote

    fixed = {v.feature: v for v in promote(everything, policy_path=POLICIES / "single_node.yaml",
                                           defaults_path=tmp_path / "until" / "defaults.yaml").verdicts}
    assert "--until-decided round(s)" in fixed["mamba_scan"].reason
    assert "--until-decided" not in fixed["moe_dispatch"].reason


def test_the_cli_refuses_a_fixed_policy_before_any_sweep_starts(tmp_path: Path) -> None:
    campaign = tiny_smoke(tmp_path, name="refused_policy")
    done = subprocess.run([sys.executable, "-m", "ablate", "sweep", str(campaign), "--until-decided", "--policy",
                           str(POLICIES / "single_node.yaml"), "--storage", str(tmp_path / "runs"),
                           "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sequential.enabled" in done.stdout + done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_judge_parses_each_receipt_file_once_and_again_when_it_changes(tmp_path: Path) -> None:
    from ablate.receipts.store import write_receipt
    from ablate.sweep.until_decided import CampaignJudge

    receipts = simulate(Sim([moe(1.3)], rounds=1, **QUIET), seed=5)
    directory = tmp_path / "campaign" / "receipts"
    for receipt in receipts[:4]:
        write_receipt(receipt, directory)
    judge = CampaignJudge(str(tmp_path / "campaign"), load_policy(POLICIES / "default_sequential.yaml"),
                          str(DEFAULTS))
    assert [r.identity.receipt_id for r in judge.receipts()] == sorted(r.identity.receipt_id for r in receipts[:4])
    first = judge.receipts()[0]
    assert judge.receipts()[0] is first  # served from the cache: the file did not change
    for receipt in receipts[4:]:
        write_receipt(receipt, directory)
    assert len(judge.receipts()) == len(receipts)
    (directory / f"{first.identity.receipt_id}.json").write_text("{not json")  # damaged after it was read
    assert first.identity.receipt_id not in {r.identity.receipt_id for r in judge.receipts()}
    assert pickle.loads(pickle.dumps(judge))._parsed == {}  # Tune's snapshot carries no cache


def test_an_upper_crossing_decides_even_when_a_fixed_clause_holds_the_verdict() -> None:
    """Stopping on the first look where every fixed-sample clause passes would peek those clauses into false
    passes: an upper crossing ends the test, and the verdict on those blocks says what holds it."""
    policy = load_policy(POLICIES / "default_sequential.yaml")
    worse = simulate(Sim([FeatureTruth("moe_dispatch", "jagged", "padded", 1.3, loss_effect=0.05)], **QUIET), seed=3)
    state = next(iter(judge_states(worse, policy, DEFAULTS).values()))
    assert state.decided and state.decision == UPPER and state.verdict != PROMOTE
    assert f"the verdict is {state.verdict}" in state.why


def test_the_next_round_waits_for_the_rules_round_gap_measured_from_the_first_arm_start() -> None:
    from datetime import datetime, timezone

    from ablate.sweep.until_decided import GAP_MARGIN_S, _gap_wait, _latest_start

    policy = load_policy(POLICIES / "default_sequential.yaml")
    receipts = simulate(Sim([moe(1.3)], **QUIET), seed=3)  # two sweeps, a day apart, in 2026-03
    by_sweep: dict = {}
    for r in receipts:
        start = datetime.fromisoformat(r.identity.created_at).timestamp() - r.time.wall_s
        by_sweep[r.identity.sweep_id] = min(start, by_sweep.get(r.identity.sweep_id, start))
    assert _latest_start(receipts) == pytest.approx(max(by_sweep.values()))
    assert _gap_wait(receipts, policy, resuming=False) == 0.0  # long ago
    now = datetime.now(timezone.utc)
    fresh = receipts[0].model_copy(update={"identity": receipts[0].identity.model_copy(
        update={"created_at": now.isoformat(), "sweep_id": "sim-r9"})})
    wait = _gap_wait(receipts + [fresh], policy, resuming=False)
    expected = policy.evidence.min_round_gap_s + GAP_MARGIN_S - fresh.time.wall_s
    assert expected - 2 < wait <= expected
    assert _gap_wait(receipts + [fresh], policy, resuming=True) == 0.0


def test_the_judge_leaves_out_blocks_whose_partner_arm_is_still_running() -> None:
    # Mid-round a block's first arm is written while its partner runs. A lone candidate's host-level code (which
    # the baseline will share, cancelling it) gated the test and closed it for the rest of the round.
    import copy

    from ablate.receipts.schema import Code, Disqualifier, Status
    from ablate.sweep.until_decided import settled_blocks

    policy = load_policy(POLICIES / "default_sequential.yaml")
    receipts = simulate(Sim([moe(1.02)], rounds=1, **QUIET), seed=3)
    lone = copy.deepcopy(next(r for r in receipts if r.identity.arm.value == "candidate"))
    lone.identity.block_id, lone.identity.receipt_id = "in-flight", "in-flight-a1"
    lone.steps.data_s = [x + 1e-6 for x in lone.steps.data_s]  # its own measurement, not a replayed copy
    lone.disqualifiers.append(Disqualifier(code=Code.BACKEND_FAILED_NODE_CHECK, detail="node check: wrong"))
    lone.identity.status = Status.disqualified
    (closed,) = judge_states(receipts + [lone], policy, DEFAULTS).values()
    assert closed.decided and "no_disqualifier" in closed.why, "the premise: read as is, the lone arm closes it"
    assert settled_blocks(receipts + [lone]) == receipts
    (state,) = judge_states(settled_blocks(receipts + [lone]), policy, DEFAULTS).values()
    assert state.state == OPEN, state.why
    # A retried block counts once its latest attempt has both arms; its earlier attempt's receipts stay.
    retried = copy.deepcopy([r for r in receipts if r.identity.block_id == receipts[-1].identity.block_id])
    for arm in retried:
        arm.identity.attempt, arm.identity.receipt_id = 1, arm.identity.receipt_id + "-1"
    assert len(settled_blocks(receipts + retried)) == len(receipts) + 2
    assert len(settled_blocks(receipts + retried[:1])) == len(receipts) - 2, "attempt 1 half-written: in flight"
    # A lone arm of an earlier sweep gets no partner any more: it is read, as promote reads it.
    later = copy.deepcopy(receipts[-1])
    later.identity.sweep_id, later.identity.receipt_id = "sim-r2", "later-a0"
    later.identity.created_at = "2099-01-01T00:00:00+00:00"
    assert lone in settled_blocks(receipts + [lone, later])


def _standing(feature: str, state: str, awaits_aa: bool = False) -> Standing:
    return Standing(feature=feature, value="v", lane_key="lane", state=state, verdict="HOLD", why="",
                    awaits_aa=awaits_aa)


def test_a_crossing_held_for_want_of_aa_blocks_stays_open_until_a_round_beside_them_calibrates_it() -> None:
    """A clear win whose sweeps ran A/A blocks only on another host crosses the upper bound and holds (its hosts'
    slot bias is unbounded). Closed, the campaign ended "every test decided" on that HOLD. The rule reads only A/A
    blocks of the test's own sweeps, so a round of A/A blocks alone settles nothing: the test stays open, and a
    round that runs its blocks beside A/A blocks on its hosts promotes it."""
    policy = load_policy(POLICIES / "default_sequential.yaml")
    win = simulate(Sim([moe(1.3)], aa_per_host=0, noise=0.007), seed=3)  # sweeps sim-r1, sim-r2
    aa = simulate(Sim([], hosts=4, aa_per_host=2, noise=0.007, rounds=3, block_prefix="aa-"), seed=1003)
    elsewhere = [r for r in aa if r.identity.host == "node-3" and r.identity.sweep_id != "sim-r3"]
    (held,) = judge_states(win + elsewhere, policy, DEFAULTS).values()
    assert held.decision == UPPER and held.verdict == "HOLD" and held.awaits_aa and held.state == OPEN
    assert "waits for A/A blocks beside its own (none on host(s) node-0, node-1, node-2)" in held.why, held.why
    rounds = [RoundRecord("r1", blocks_run=8, blocks_skipped=0, started_at=0.0, elapsed_s=1.0, exit_code=0)]
    stop, note = next_round([held.key], {held.key: held}, aa_blocks=2, rounds=rounds, max_rounds=4, resuming=False)
    assert stop == "" and "1 test(s) crossed a bound but hold for want of A/A blocks" in note
    # A campaign that plans no A/A block would run it for nothing: it ends, and says why the test still holds.
    stop, _ = next_round([held.key], {held.key: held}, aa_blocks=0, rounds=rounds, max_rounds=4, resuming=False)
    assert stop.startswith("every speed test of the campaign is decided") and "aa_blocks is 0" in stop
    stop, _ = next_round([held.key], {held.key: held}, aa_blocks=2, rounds=rounds * 4, max_rounds=4, resuming=False)
    assert "sequential.max_rounds" in stop

    third = [r for r in aa if r.identity.sweep_id == "sim-r3"]
    (alone,) = judge_states(win + elsewhere + third, policy, DEFAULTS).values()
    assert alone.awaits_aa and alone.verdict == "HOLD", "A/A blocks of a sweep the test did not run in bound nothing"
    beside = [r for r in simulate(Sim([moe(1.3)], aa_per_host=2, noise=0.007, rounds=3, block_prefix="r3-"), seed=5)
              if r.identity.sweep_id == "sim-r3"]
    (settled,) = judge_states(win + elsewhere + beside, policy, DEFAULTS).values()
    assert settled.decided and settled.verdict == PROMOTE and not settled.awaits_aa, settled.why
    stop, note = next_round([settled.key], {settled.key: settled}, aa_blocks=2, rounds=rounds, max_rounds=4,
                            resuming=False)
    assert (stop, note) == ("every speed test of the campaign is decided", "")


def test_the_next_round_runs_while_a_test_is_open_and_never_after_a_round_that_ran_nothing() -> None:
    open_, done = _standing("a", OPEN), _standing("b", DECIDED)
    states = {open_.key: open_, done.key: done}
    ran = RoundRecord("r1", blocks_run=3, blocks_skipped=1, started_at=0.0, elapsed_s=1.0, exit_code=0)
    assert next_round(list(states), states, aa_blocks=1, rounds=[ran], max_rounds=3, resuming=False) == ("", "")
    nothing = RoundRecord("r2", blocks_run=0, blocks_skipped=4, started_at=0.0, elapsed_s=1.0, exit_code=0)
    stop, _ = next_round(list(states), states, aa_blocks=1, rounds=[ran, nothing], max_rounds=3, resuming=False)
    assert stop.startswith("the last round ran no block")
    assert next_round([done.key], {done.key: done}, aa_blocks=1, rounds=[], max_rounds=3, resuming=True) == ("", "")
