"""Unmatched receipts are listed and refused with the reason, never silently paired or counted."""

from __future__ import annotations

from typing import Any

from conftest import DEFAULTS
from promote_sim import T0, base_lane, make_receipt, moe, Sim, simulate

from ablate.promote import Policy, promote
from ablate.promote.match import match_blocks
from ablate.receipts.schema import Receipt, Status


def pair(block: str, *, cand_lane: dict | None = None, cand_host: str = "node-0", cand_tokens: int = 1024,
         cand_data: str = "data-1", cand_fp: str = "sw-1", cand_order: int = 1,
         base_order: int | None = None) -> list[Receipt]:
    lane = base_lane()
    common = dict(sweep_id="r1", block_id=block, feature="moe_dispatch", baseline_value="padded", loss=5.0,
                  created_at=T0)
    base = make_receipt(receipt_id=f"{block}-a0", arm="baseline", arm_index=0, feature_value="padded",
                        order=1 - cand_order if base_order is None else base_order,
                        lane=lane, host="node-0", tps=5000.0, **common)
    cl = cand_lane if cand_lane is not None else {**lane, "features.moe_dispatch": "jagged"}
    cand = make_receipt(receipt_id=f"{block}-a1", arm="candidate", arm_index=1, feature_value="jagged",
                        order=cand_order, lane=cl,
                        host=cand_host, tps=5250.0, tokens_per_step=cand_tokens, data_fingerprint=cand_data,
                        software_fingerprint=cand_fp, lane_key=base.identity.lane_key, **common)
    return [base, cand]


def reasons(receipts: list[Receipt], policy: Policy) -> dict[str, str]:
    blocks, refusals = match_blocks(receipts, policy)
    return {r.block_id.split("/")[1]: r.reason for r in refusals} | {b.block_id.split("/")[1]: "matched"
                                                                       for b in blocks}


def test_a_clean_pair_matches(policy: Policy) -> None:
    assert reasons(pair("b1"), policy) == {"b1": "matched"}


def test_each_kind_of_mismatch_is_refused_with_a_clear_reason(policy: Policy) -> None:
    lane = base_lane()
    receipts = (pair("other-host", cand_host="node-1")
                + pair("seq-len", cand_lane={**lane, "features.moe_dispatch": "jagged", "batch.seq_len": 128})
                + pair("tokens", cand_tokens=2048) + pair("data", cand_data="data-2")
                + pair("software", cand_fp="sw-2") + pair("same-order", cand_order=0, base_order=0)
                + pair("not-tested-value", cand_lane={**lane, "features.moe_dispatch": "grouped_mm"})
                + pair("orphan")[:1])
    got = reasons(receipts, policy)
    assert got["other-host"] == "arms differ in host: 'node-0' vs 'node-1'"
    assert got["seq-len"] == ("lanes differ beyond the feature under test (features.moe_dispatch) at: "
                              "batch.seq_len (64 vs 128)")
    assert got["tokens"] == "different work: tokens_per_step 1024 vs 2048"
    assert got["data"] == "different data: data_fingerprint 'data-1' vs 'data-2'"
    assert got["software"] == "arms differ in software_fingerprint: 'sw-1' vs 'sw-2'"
    assert got["same-order"].startswith("arm orders 0 and 0")
    assert got["not-tested-value"] == ("candidate arm ran features.moe_dispatch='grouped_mm', not the tested "
                                       "value 'jagged'")
    assert got["orphan"].startswith("block has arm(s) baseline#0 only: its partner arm is missing")


def test_refused_receipts_are_reported_and_never_counted(policy: Policy) -> None:
    receipts = simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0)
    extra = pair("stray", cand_host="node-9")
    for r in extra:  # same lane key and round as the campaign, so only the host mismatch keeps it out
        r.identity.lane_key = receipts[0].identity.lane_key
    result = promote(receipts + extra, policy_path=policy, defaults_path=DEFAULTS)
    v = result.verdicts[0]
    assert v.n_blocks == 12 and "stray-a1" not in v.receipt_ids
    assert [(r.block_id, r.receipt_ids) for r in result.refusals] == [("r1/stray", ("stray-a0", "stray-a1"))]
    assert "arms differ in host: 'node-0' vs 'node-9'" in result.markdown
    assert result.to_dict()["refusals"][0]["reason"] == "arms differ in host: 'node-0' vs 'node-9'"


def test_a_lane_key_shared_by_different_lanes_is_refused(policy: Policy) -> None:
    good = pair("b1") + pair("b2")
    odd = pair("b3", cand_lane={**base_lane(**{"batch.micro_batch": 4}), "features.moe_dispatch": "jagged"})
    odd[0].requested.lane["batch.micro_batch"] = 4  # a whole block on another lane, mislabelled with b1's key
    got = reasons(good + odd, policy)
    assert got["b1"] == got["b2"] == "matched"
    assert "is shared with blocks whose baseline lane differs at batch.micro_batch" in got["b3"]


def test_seed_is_a_replication_unit_not_a_lane_difference(policy: Policy) -> None:
    a, b = pair("s1"), pair("s2")
    for r in b:
        r.requested.lane["seed"] = 7
    assert reasons(a + b, policy) == {"s1": "matched", "s2": "matched"}
    b[1].requested.lane["seed"] = 8  # but the two arms of one block must share it
    assert "lanes differ beyond the feature under test" in reasons(a + b, policy)["s2"]


def test_aborted_arms_and_disqualified_baselines_are_refused(policy: Policy) -> None:
    aborted, bad_base = pair("ab"), pair("db")
    aborted[1].identity.status = Status.aborted
    bad_base[0].identity.status = Status.disqualified
    got = reasons(aborted + bad_base, policy)
    assert got["ab"] == "candidate arm #1 was aborted: neither evidence nor a failure"
    assert got["db"] == "the baseline arm is disqualified (DISQUALIFIED): the block cannot measure anything"


def _failed(receipt: Receipt, attempt: int, order: int) -> Receipt:
    copy = receipt.model_copy(deep=True)
    copy.identity.receipt_id = f"{receipt.identity.receipt_id}-t{attempt}"
    copy.identity.attempt, copy.identity.order, copy.identity.status = attempt, order, Status.failed
    copy.throughput.wall_tokens_per_s = None
    # Another attempt is another measurement: its step timings are its own (equal ones are a replay).
    copy.steps.step_s = [s * (1.0 + 1e-12 * (attempt + 1) * (order + 2)) for s in copy.steps.step_s]
    return copy


def test_a_retried_block_uses_its_last_attempt_and_keeps_the_failure(policy: Policy) -> None:
    # The sweep retries whole blocks: attempt 0 stopped at the failed candidate (the baseline never ran).
    base, cand = pair("rt")
    for receipt in (base, cand):
        receipt.identity.attempt = 1
    blocks, refusals = match_blocks([_failed(cand, 0, 0), base, cand], policy)
    assert refusals == [] and blocks[0].candidate.receipt_id == "rt-a1" and blocks[0].candidate.attempt == 1
    assert blocks[0].earlier_failures == {"candidate": 1}


def test_a_block_whose_retries_ran_out_is_a_candidate_loss(policy: Policy) -> None:
    base, cand = pair("out")  # attempt 0: baseline fine, candidate failed; attempt 1: candidate failed first
    blocks, refusals = match_blocks([base, _failed(cand, 0, 1), _failed(cand, 1, 0)], policy)
    assert refusals == [] and blocks[0].baseline.receipt_id == "out-a0"
    assert blocks[0].candidate.receipt_id == "out-a1-t1" and blocks[0].earlier_failures == {"candidate": 1}
    assert blocks[0].log_ratio(policy.failures.failed_log_ratio) == policy.failures.failed_log_ratio


def test_arms_on_different_hardware_or_code_are_not_one_block(policy: Policy) -> None:
    # A different GPU model or count, driver or CUDA stack gives another hardware fingerprint; an edit to
    # kernels/ or trainers/ another code fingerprint: either way the two arms measured different things.
    gpu, code = pair("gpu"), pair("code")
    gpu[1].identity.hardware_fingerprint = "hw-other-gpu"
    code[1].identity.code_fingerprint = "code-edited"
    got = reasons(gpu + code, policy)
    assert got["gpu"] == "arms differ in hardware_fingerprint: 'hw-cpu' vs 'hw-other-gpu'"
    assert got["code"] == "arms differ in code_fingerprint: 'code-1' vs 'code-edited'"
    cpu_gpu = pair("device")
    cpu_gpu[1].observed.hardware["kind"] = "cuda"
    assert reasons(cpu_gpu, policy)["device"] == "arms ran on different device types: cpu vs cuda"


def test_a_candidate_that_ran_its_baselines_code_is_an_observed_inert_toggle(policy: Policy) -> None:
    # The registry cannot know (say, a fallback only this node takes): the candidate's observed backends,
    # compile, engine and model equal its own baseline's, so its "win" is noise and it is gated as inert.
    receipts = simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0)
    for r in receipts:
        if r.identity.arm.value == "candidate":
            for record in r.observed.backends:
                if record.op == "moe":
                    record.observed = "padded"  # requested jagged, ran the baseline's padded path
    result = promote(receipts, policy_path=policy, defaults_path=DEFAULTS)
    v = result.verdicts[0]
    assert v.verdict == "REJECT" and v.reason.startswith("INERT_TOGGLE disqualifier on 12 candidate arm")
    assert v.gated_disqualifiers["INERT_TOGGLE"] == 12 and v.gated_disqualifiers["BACKEND_FALLBACK"] == 12


def test_arms_prepared_differently_are_not_one_block(policy: Policy) -> None:
    # One arm forked from the fork server (its imports already paid, the server's pages mapped into its peak RSS)
    # and one in a fresh interpreter (a fallback) did not start from the same place.
    from ablate.receipts.schema import ProcessStart

    mixed, forked = pair("mixed"), pair("forked")
    for receipt in (*forked, mixed[0]):
        receipt.identity.process = ProcessStart(how="fork_server", server_pid=7, forks_before=0)
    mixed[1].identity.process = ProcessStart(how="fresh_interpreter", fallback_reason="no server")
    got = reasons(mixed + forked, policy)
    assert got["mixed"] == ("arms differ in process preparation: 'fork_server' vs 'fresh_interpreter' "
                            "(identity.process.how)")
    assert got["forked"] == "matched"


def _moe_win() -> list[Receipt]:
    return simulate(Sim(features=[moe(1.05)], noise=0.003, aa_per_host=2), 0)


def _moe_verdict(receipts: list[Receipt], policy: Policy) -> Any:
    [verdict] = [v for v in promote(receipts, policy_path=policy, defaults_path=DEFAULTS).verdicts
                 if v.feature == "moe_dispatch"]
    return verdict


def _in_sim_r1(receipts: list[Receipt]) -> list[Receipt]:
    for receipt in receipts:
        receipt.identity.sweep_id = "sim-r1"
    return receipts


def test_a_candidate_that_crashed_on_every_attempt_of_an_unpaired_block_holds_its_test(policy: Policy) -> None:
    """A candidate-first block whose candidate crashed on every attempt leaves no baseline: the block is refused,
    but its crashes hold the test as a matched block's would (found in review: they vanished and the test
    promoted). They only hold: Fisher, which may REJECT, counts matched blocks only."""
    base, cand = _in_sim_r1(pair("cf", cand_order=0))
    crashes = [_failed(cand, 0, 0), _failed(cand, 1, 0)]
    assert _moe_verdict(_moe_win(), policy).verdict == "PROMOTE"  # the control: a clean 5% win
    verdict = _moe_verdict(_moe_win() + crashes, policy)
    assert verdict.verdict == "HOLD" and verdict.refused_failures["candidate"] == {"failed": 2, "arms": 2}
    assert "with the arms of 1 refused block(s) (e.g. sim-r1/cf): candidate 2/14, baseline 0/12" in verdict.reason
    assert verdict.failures["candidate"]["failed"] == 0 and verdict.fisher_p == 1.0
    _, refusals = match_blocks(crashes, policy)
    assert refusals[0].failures == {"baseline": {"failed": 0, "arms": 0}, "candidate": {"failed": 2, "arms": 2}}


def test_many_unpaired_crashes_hold_a_test_but_never_reject_it(policy: Policy) -> None:
    # Enough crashes that Fisher would reject on them: refused blocks cannot be told from copies or placed in a
    # round (found in review: a relabelled copy of a round counted its crash-only blocks twice and rejected).
    crashes = []
    for number in range(6):
        base, cand = _in_sim_r1(pair(f"cf{number}", cand_order=0))
        cand.identity.host = f"node-{number % 3}"
        crashes += [_failed(cand, 0, 0), _failed(cand, 1, 0)]
    verdict = _moe_verdict(_moe_win() + crashes, policy)
    assert verdict.verdict == "HOLD" and verdict.refused_failures["candidate"]["failed"] == 12
    assert [c.name for c in verdict.also_rejected] == []


def test_a_retry_that_crashed_on_another_node_holds_its_test(policy: Policy) -> None:
    """Attempt 0: baseline fine, candidate crashed; attempt 1 (its last): the candidate crashed again on another
    node. The block is refused for its hosts, and both crashes hold the test as when the retry stays on the node."""
    for retry_host in ("node-0", "node-1"):
        base, cand = _in_sim_r1(pair("rh"))
        retry = _failed(cand, 1, 0)
        retry.identity.host = retry_host
        verdict = _moe_verdict(_moe_win() + [base, _failed(cand, 0, 1), retry], policy)
        assert verdict.verdict == "HOLD" and "2/14, baseline 0/13" in verdict.reason, (retry_host, verdict.reason)


def test_an_aborted_retry_is_not_a_candidate_arm_that_ran(policy: Policy) -> None:
    # Found in review: each crash followed by an aborted retry counted 2 arms, diluting the rate below the policy's.
    base, cand = _in_sim_r1(pair("ab", cand_order=0))
    aborted = _failed(cand, 1, 0)
    aborted.identity.status = Status.aborted
    _, refusals = match_blocks([_failed(cand, 0, 0), aborted], policy)
    assert refusals[0].failures["candidate"] == {"failed": 1, "arms": 1}


def test_crashes_of_arms_that_did_not_run_their_test_or_its_software_are_not_its(policy: Policy) -> None:
    """Found in review: a candidate that ran another lane (a pair refused within one attempt), or an older
    software's crash that observed no hardware, held (then rejected) a clean win on the current software."""
    other_lane = _in_sim_r1(pair("ol", cand_lane={**base_lane(), "features.moe_dispatch": "jagged",
                                                  "batch.micro_batch": 4}))
    other_lane[1] = _failed(other_lane[1], 0, 1)
    other_lane[1].identity.attempt = 0
    _, refusals = match_blocks(other_lane, policy)
    assert "lanes differ" in refusals[0].reason and refusals[0].failures == {}
    old = []
    for number in range(3):
        base, cand = _in_sim_r1(pair(f"old{number}", cand_order=0))
        crash = _failed(cand, 0, 0)
        crash.identity.software = {**crash.identity.software, "torch": "0.0-old"}
        crash.identity.hardware_fingerprint = None  # died before observing its hardware
        crash.identity.software_fingerprint = "sw-old-no-hardware"
        old.append(crash)
    verdict = _moe_verdict(_moe_win() + old, policy)
    assert verdict.verdict == "PROMOTE" and verdict.refused_failures["candidate"]["failed"] == 0
    same = []
    for crash in old:  # the same crashes under the current packages and code are the current test's
        copy = crash.model_copy(deep=True)
        copy.identity.software = dict(_moe_win()[0].identity.software)
        copy.identity.code_fingerprint = _moe_win()[0].identity.code_fingerprint
        same.append(copy)
    assert _moe_verdict(_moe_win() + same, policy).refused_failures["candidate"]["failed"] == 3


def test_failures_of_receipts_that_cannot_be_told_apart_are_not_counted(policy: Policy) -> None:
    base, cand = pair("dup")
    crash = _failed(cand, 0, 1)
    twin = crash.model_copy(deep=True)
    twin.identity.receipt_id = "dup-twin"
    twin.steps.step_s = [s * (1.0 + 1e-9) for s in twin.steps.step_s]  # not a replay: a second record of one arm
    _, refusals = match_blocks([base, crash, twin], policy)
    assert "two receipts for arm_index 1" in refusals[0].reason and refusals[0].failures == {}


def test_newer_software_crashes_with_no_matched_block_of_their_own_hold_the_test(policy: Policy) -> None:
    """A later round under new packages whose candidate-first blocks all crashed leaves no matched block of that
    software, so the lane's current test is still the old one: the crashes, newer than its evidence, hold it, as
    unread arms of that software would (found in review: they were dropped and the old evidence promoted)."""
    from datetime import timedelta

    win = _moe_win()
    newest = max(r.identity.created_at for r in win)
    crashes = []
    for number in range(3):
        base, cand = _in_sim_r1(pair(f"new{number}", cand_order=0))
        for attempt in (0, 1):
            crash = _failed(cand, attempt, 0)
            crash.identity.sweep_id = "sim-r9"
            crash.identity.software = {**crash.identity.software, "torch": "9.9.9"}
            crash.identity.software_fingerprint = "sw-9"
            crash.identity.created_at = (T0 + timedelta(days=30, minutes=number * 5 + attempt)).isoformat()
            assert crash.identity.created_at > newest
            crashes.append(crash)
    verdict = _moe_verdict(win + crashes, policy)
    assert verdict.verdict == "HOLD" and verdict.refused_failures["candidate"] == {"failed": 6, "arms": 6}
    for crash in crashes:  # the same software's crashes written before the lane's newest block are not its
        crash.identity.created_at = (T0 - timedelta(days=30)).isoformat()
    assert _moe_verdict(win + crashes, policy).verdict == "PROMOTE"


def test_each_refused_arm_is_placed_on_its_own_whatever_the_reading_order(policy: Policy) -> None:
    """Attempt 0's candidate crashed on the current software and hardware; its retry crashed on another node with
    other hardware. The first crash is the current test's whichever receipt is read last (found in review: the
    block's crashes were all placed under the last one read, so the order decided HOLD or PROMOTE)."""
    blocks = []
    for number in range(3):
        base, cand = _in_sim_r1(pair(f"hw{number}"))
        retry = _failed(cand, 1, 0)
        retry.identity.host = "node-9"
        retry.identity.hardware_fingerprint = "hw-other"
        retry.identity.software = {**retry.identity.software, "torch": "9.9.9"}  # nothing the lane ran
        retry.identity.software_fingerprint = "sw-other"
        blocks.append([base, _failed(cand, 0, 1), retry])
    counts = []
    for order in (lambda b: b, lambda b: [b[2], b[0], b[1]]):
        verdict = _moe_verdict(_moe_win() + [r for b in blocks for r in order(b)], policy)
        counts.append((verdict.verdict, verdict.refused_failures["candidate"]))
    assert counts[0] == counts[1] and counts[0][0] == "HOLD" and counts[0][1]["failed"] >= 3, counts


def test_a_refused_block_never_clears_a_hold_its_test_earned(policy: Policy) -> None:
    """A matched block's candidate crashed on its first attempt: the test holds (1/13 against 0/12). A refused block
    whose baseline crashed (OOM) and whose candidate ran adds baseline 1/1, candidate 0/1; refused blocks only hold,
    so the clause must pass with and without them (found in review: the hold cleared and the test promoted)."""
    from ablate.receipts.schema import Code, Disqualifier

    win = _moe_win()
    block = sorted({r.identity.block_id for r in win if r.identity.feature == "moe_dispatch"})[0]
    arms = [r for r in win if r.identity.block_id == block]
    base = next(r for r in arms if r.identity.arm.value == "baseline")
    cand = next(r for r in arms if r.identity.arm.value == "candidate")
    for receipt in arms:
        receipt.identity.attempt = 1
    early = _failed(cand, 0, cand.identity.order)
    assert _moe_verdict(win + [early], policy).verdict == "HOLD"  # the matched crash holds it
    oom_base, ran = base.model_copy(deep=True), cand.model_copy(deep=True)
    for receipt, rid in ((oom_base, "oom-b"), (ran, "oom-c")):
        receipt.identity.receipt_id, receipt.identity.block_id, receipt.identity.attempt = rid, f"{block}-x", 0
        receipt.steps.step_s = [s * 1.001 for s in receipt.steps.step_s]  # its own measurement, not a replay
    oom_base.identity.status = Status.failed
    oom_base.throughput.wall_tokens_per_s = None
    oom_base.disqualifiers.append(Disqualifier(code=Code.OOM, detail="baseline OOM"))
    verdict = _moe_verdict(win + [early, oom_base, ran], policy)
    assert verdict.refused_failures["baseline"] == {"failed": 1, "arms": 1}  # the refused block is counted...
    assert verdict.verdict == "HOLD" and "candidate failed 1/13, baseline 0/12" in verdict.reason  # ...and holds


def test_a_retry_that_ran_another_lane_is_not_its_tests_crash(policy: Policy) -> None:
    # Across attempts only what a retry may change (its node, its code) is forgiven when counting crashes: a retry
    # that ran another lane did not run the test (found in review: it was charged to it).
    base, cand = _in_sim_r1(pair("rl"))
    retry = _failed(cand, 1, 0)
    retry.identity.host = "node-9"
    other = _failed(cand, 1, 0)
    other.identity.host = "node-9"
    other.requested.lane = {**other.requested.lane, "batch.micro_batch": 4}
    _, [node] = match_blocks([base, _failed(cand, 0, 1), retry], policy)
    _, [lane] = match_blocks([base, _failed(cand, 0, 1), other], policy)
    assert "host" in node.reason and node.failures["candidate"]["failed"] == 2
    assert lane.failures == {}, lane.reason
