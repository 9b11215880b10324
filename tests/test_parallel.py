"""``ablate.parallel.fork_map``: the work of one command split over forked processes returns exactly what one
process computes, and whatever goes wrong in a child costs time, never a result.

The parity tests run the two users of it on real data: the promotion rule over a simulated multi-lane campaign
(one JSON report, byte for byte, with and without forking), and the bulk receipt reader over a real SQLite MLflow
store holding damaged payloads (same receipts, same rejects, same reasons).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
from sweeps_common import fresh_mlflow_uri, log_campaign

sys.path.insert(0, str(Path(__file__).resolve().parent / "promote"))

from promote_sim import FeatureTruth, Sim, moe, simulate  # noqa: E402

from ablate import parallel  # noqa: E402
from ablate.parallel import fork_map  # noqa: E402
from ablate.receipts.store import seal  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def forking() -> Iterator[None]:
    with parallel.forking():
        yield


def _children() -> set[int]:
    # The test process may hold other children (servers, Ray) started by earlier tests: compare snapshots.
    import psutil

    return {child.pid for child in psutil.Process().children()}


def test_results_in_order_and_computed_in_two_processes() -> None:
    parent, before = os.getpid(), _children()
    got = fork_map(lambda x: (x * x, os.getpid()), list(range(11)), processes=2)
    assert [value for value, _ in got] == [x * x for x in range(11)]
    pids = [pid for _, pid in got]
    assert set(pids[0::2]) == {parent} and len(set(pids[1::2])) == 1 and pids[1] != parent
    assert pids[1] not in _children() <= before, "the child was reaped"


def test_one_process_and_small_inputs_fork_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = os.getpid()
    with parallel.forking():
        pass
    assert parallel._allowed, "leaving an inner block keeps the outer one's permission"
    assert {pid for pid in fork_map(lambda _: os.getpid(), range(5), processes=2, min_share=3)} == {parent}
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    assert {pid for pid in fork_map(lambda _: os.getpid(), range(50))} == {parent}
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    monkeypatch.setattr(parallel, "_allowed", False)  # outside forking(): a sweep driver's threads are never forked
    assert {pid for pid in fork_map(lambda _: os.getpid(), range(50))} == {parent}


@pytest.mark.parametrize("value", ["0", "two", "-3"])
def test_a_bad_process_count_names_the_variable_the_value_and_what_is_allowed(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(parallel.PROCESSES_ENV, value)
    with pytest.raises(ValueError, match=rf"{parallel.PROCESSES_ENV}='{value}'.*allowed: a whole number >= 1"):
        fork_map(str, range(4))


def test_a_child_that_dies_or_raises_costs_time_never_a_result() -> None:
    parent, before = os.getpid(), _children()

    def dies_in_child(x: int) -> int:
        if os.getpid() != parent:
            os._exit(9)  # a crash, a kill: no result file
        return x + 1

    assert fork_map(dies_in_child, list(range(9)), processes=2) == [x + 1 for x in range(9)]

    def raises_in_child(x: int) -> int:
        if os.getpid() != parent:
            raise MemoryError("child only")
        return -x

    assert fork_map(raises_in_child, list(range(9)), processes=2) == [-x for x in range(9)]
    assert _children() <= before


def test_what_fn_raises_reaches_the_caller_and_no_child_is_left() -> None:
    before = _children()

    def fails_on_three(x: int) -> int:
        if x == 3:
            raise KeyError("three")
        return x

    with pytest.raises(KeyError, match="three"):
        fork_map(fails_on_three, list(range(8)), processes=2)  # 3 is in the child's share: recomputed, raised
    with pytest.raises(KeyError, match="three"):
        fork_map(fails_on_three, [3] + list(range(4, 20)), processes=2)  # in the parent's own share
    assert _children() <= before


def test_a_raise_while_recomputing_a_share_leaves_no_later_child_behind() -> None:
    import time

    parent, before = os.getpid(), _children()

    def fails_on_one(x: int) -> int:
        if x == 1:
            raise KeyError("one")  # child 1's share: its child fails, the parent's recompute raises
        if os.getpid() != parent and x % 3 == 2:
            time.sleep(30)  # child 2, still at work when the parent raises
        return x

    started = time.monotonic()
    with pytest.raises(KeyError, match="one"):
        fork_map(fails_on_one, list(range(9)), processes=3)
    assert _children() <= before, "child 2 was stopped and reaped, not left running or as a zombie"
    assert time.monotonic() - started < 20


def test_state_a_child_changes_is_not_seen_by_the_parent() -> None:
    seen: list[int] = []
    fork_map(seen.append, list(range(6)), processes=2)
    assert seen == [0, 2, 4], "only the parent's own share ran here"


def _campaign() -> list:
    sim = Sim(features=[moe(1.06), FeatureTruth("mamba_scan", "chunked", "sequential", 1.0),
                        FeatureTruth("fused_residual", True, False, 1.03)], hosts=3, blocks_per_host=3, rounds=2)
    return [seal(r) for r in simulate(sim, seed=5)]


def test_promotion_report_is_the_same_with_and_without_forking(monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.promote import engine, match, promote

    receipts = _campaign()
    policy, defaults = REPO / "search_spaces/policies/default.yaml", REPO / "search_spaces/defaults.yaml"
    calls: list[int] = []
    matched: list[int] = []
    real, real_matched = engine.analyse, match._matched

    def recording(*args, **kwargs):
        calls.append(os.getpid())
        return real(*args, **kwargs)

    def recording_matched(*args, **kwargs):
        matched.append(os.getpid())
        return real_matched(*args, **kwargs)

    monkeypatch.setattr(engine, "ANALYSE_MIN_SHARE", 1)
    monkeypatch.setattr(match, "MATCH_MIN_SHARE", 1)
    monkeypatch.setattr(engine, "analyse", recording)
    monkeypatch.setattr(match, "_matched", recording_matched)
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    forked = promote(receipts, policy_path=policy, defaults_path=defaults)
    in_parent, matched_in_parent = len(calls), len(matched)
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    single = promote(receipts, policy_path=policy, defaults_path=defaults)
    tests, blocks = len(single.verdicts), len(matched) - matched_in_parent
    assert tests >= 2 and len(calls) == in_parent + tests
    assert in_parent == (tests + 1) // 2, "the child measured the other half (its calls are not recorded here)"
    assert blocks >= 2 and matched_in_parent == (blocks + 1) // 2, "the child matched the other half of the blocks"
    assert json.loads(forked.to_json()) == json.loads(single.to_json())
    assert forked.markdown == single.markdown


def test_bulk_read_is_the_same_with_and_without_forking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.receipts import accepted
    from ablate.tracking import bulk_read, payload
    from ablate.tracking.mlflow_store import load_receipts_from_mlflow

    receipts = _campaign()[:14]
    uri = fresh_mlflow_uri(tmp_path)
    client, _ = log_campaign(uri, receipts)
    runs = {rid: run.info.run_id for rid, run in client.arm_runs().items()}
    edited = json.loads(receipts[3].model_dump_json())
    edited["quality"]["loss_final"] = 0.001  # digest kept: refused
    for key, value in payload.encode_json(json.dumps(edited).encode()).items():
        client.client.set_tag(runs[receipts[3].identity.receipt_id], key, value)
    client.client.set_tag(runs[receipts[8].identity.receipt_id], payload.PAYLOAD_TAG + "0", "not base64 !")

    calls: list[int] = []
    real = bulk_read._check_result

    def recording(item):
        calls.append(os.getpid())
        return real(item)

    monkeypatch.setattr(bulk_read, "_check_result", recording)
    monkeypatch.setattr(bulk_read, "PARALLEL_MIN_SHARE", 1)
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    monkeypatch.setenv(accepted.CACHE_ENV, accepted.OFF)  # every payload checked, both times
    forked = load_receipts_from_mlflow(uri, "ablate")
    # Nothing remembered (the cache is off): every run with payload tags, damaged ones included, is decoded and
    # checked where its share is (_check_result).
    assert len(calls) == (len(receipts) + 1) // 2, "the child checked the other half"
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    single = load_receipts_from_mlflow(uri, "ablate")
    assert len(forked[0]) == len(receipts) - 2 and len(forked[1]) == 2
    assert [r.model_dump_json() for r in forked[0]] == [r.model_dump_json() for r in single[0]]
    assert forked[1] == single[1] and forked[2] == single[2]
    assert any("content does not match its digest" in why for _, why in forked[1])
