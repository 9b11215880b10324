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
import time
from pathlib import Path
from typing import Callable, Iterator

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


def _slow_in(pid: int, parent_s: float, child_s: float) -> Callable[[int], tuple[int, int]]:
    def fn(x: int) -> tuple[int, int]:
        time.sleep(parent_s if os.getpid() == pid else child_s)
        return x * x, os.getpid()
    return fn


def test_results_in_order_and_computed_in_two_processes() -> None:
    parent, before = os.getpid(), _children()
    got = fork_map(_slow_in(parent, 0.005, 0.005), list(range(40)), processes=2)
    assert [value for value, _ in got] == [x * x for x in range(40)]
    pids = {pid for _, pid in got}
    assert parent in pids and len(pids) == 2, "both processes took chunks"
    assert not (pids - {parent}) & _children() and _children() <= before, "the child was reaped"


def test_a_slower_process_takes_fewer_items() -> None:
    """Chunks are taken one at a time: where the parent runs 10x slower (it also takes in what the children send
    back; its CPU may be shared), the child computes most of the items. Fixed halves made the CPU that finished
    first wait for the other."""
    parent = os.getpid()
    got = fork_map(_slow_in(parent, 0.02, 0.002), list(range(256)), processes=2)
    assert [value for value, _ in got] == [x * x for x in range(256)]
    in_parent = sum(pid == parent for _, pid in got)
    assert 0 < in_parent < 256 // 4, f"the parent computed {in_parent} of 256 items"


def test_every_item_is_computed_exactly_once(tmp_path: Path) -> None:
    log = tmp_path / "computed"

    def fn(x: int) -> int:
        with open(log, "a") as handle:  # O_APPEND: one line per call from every process
            handle.write(f"{x}\n")
        time.sleep(0.001)
        return x

    assert fork_map(fn, list(range(300)), processes=3) == list(range(300))
    assert sorted(int(line) for line in log.read_text().split()) == list(range(300))


def test_received_turns_what_a_child_sent_back_into_the_result_here() -> None:
    parent = os.getpid()

    def fn(x: int) -> tuple[str, int]:
        time.sleep(0.002)
        return ("light" if parallel.in_forked_child() else "full"), x

    def received(item: int, value: tuple[str, int]) -> tuple[str, int]:
        assert os.getpid() == parent and value[1] == item
        return "rebuilt", value[1]

    got = fork_map(fn, list(range(200)), processes=2, received=received)
    assert [x for _, x in got] == list(range(200))
    assert {kind for kind, _ in got} == {"full", "rebuilt"}, "the parent's own results are not passed to received"


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

    def dies_on_its_third_chunk(x: int) -> int:
        if os.getpid() != parent:
            dies_on_its_third_chunk.calls += 1  # type: ignore[attr-defined]
            if dies_on_its_third_chunk.calls == 3:  # type: ignore[attr-defined]
                os._exit(9)  # two chunks sent back, the third taken and lost
        time.sleep(0.002)
        return x * 3

    dies_on_its_third_chunk.calls = 0  # type: ignore[attr-defined]
    assert fork_map(dies_on_its_third_chunk, list(range(100)), processes=2) == [x * 3 for x in range(100)]

    def cannot_be_sent_back(x: int) -> Callable[[], int]:
        return lambda: x  # a lambda does not pickle: the child's results never reach the parent

    assert [f() for f in fork_map(cannot_be_sent_back, list(range(9)), processes=2)] == list(range(9))
    assert _children() <= before


def test_what_fn_raises_reaches_the_caller_and_no_child_is_left() -> None:
    before = _children()

    def fails_on_three(x: int) -> int:
        if x == 3:
            raise KeyError("three")
        return x

    with pytest.raises(KeyError, match="three"):
        fork_map(fails_on_three, list(range(8)), processes=2)  # 3 in a child's chunk: computed again here, raised
    with pytest.raises(KeyError, match="three"):
        fork_map(fails_on_three, [3] + list(range(4, 20)), processes=2)  # the parent's first chunk
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
    parent, seen = os.getpid(), []

    def fn(x: int) -> int:
        seen.append(x)
        time.sleep(0.003)
        return os.getpid()

    pids = fork_map(fn, list(range(60)), processes=2)
    assert set(pids) - {parent}, "the child took chunks"
    assert seen == [x for x, pid in enumerate(pids) if pid == parent], "only the parent's own chunks ran here"


def _campaign() -> list:
    sim = Sim(features=[moe(1.06), FeatureTruth("mamba_scan", "chunked", "sequential", 1.0),
                        FeatureTruth("fused_residual", True, False, 1.03)], hosts=3, blocks_per_host=3, rounds=2)
    return [seal(r) for r in simulate(sim, seed=5)]


def _calls_by_kind(log: Path) -> dict[str, list[int]]:
    """The pids that logged each kind of call (every process appends its own lines)."""
    kinds: dict[str, list[int]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        kind, pid = line.split()
        kinds.setdefault(kind, []).append(int(pid))
    return kinds


def _logging(log: Path, kind: str, fn, pause_s: float = 0.0):
    def logged(*args, **kwargs):
        with open(log, "a") as handle:
            handle.write(f"{kind} {os.getpid()}\n")
        time.sleep(pause_s)  # long enough for the child to take chunks before the parent has taken them all
        return fn(*args, **kwargs)
    return logged


def test_promotion_report_is_the_same_with_and_without_forking(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.promote import engine, match, promote

    receipts = _campaign()
    policy, defaults = REPO / "search_spaces/policies/default.yaml", REPO / "search_spaces/defaults.yaml"
    log = tmp_path / "calls"
    monkeypatch.setattr(engine, "ANALYSE_MIN_SHARE", 1)
    monkeypatch.setattr(match, "MATCH_MIN_SHARE", 1)
    monkeypatch.setattr(engine, "analyse", _logging(log, "analyse", engine.analyse))
    monkeypatch.setattr(match, "_matched", _logging(log, "match", match._matched, pause_s=0.005))
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    forked = promote(receipts, policy_path=policy, defaults_path=defaults)
    forked_calls = _calls_by_kind(log)
    log.unlink()
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    single = promote(receipts, policy_path=policy, defaults_path=defaults)
    single_calls = _calls_by_kind(log)
    tests = len(single.verdicts)
    assert tests >= 2 and len(forked_calls["analyse"]) == len(single_calls["analyse"]) == tests
    assert len(forked_calls["match"]) == len(single_calls["match"]) >= 2, "every block matched once either way"
    assert {*single_calls["analyse"], *single_calls["match"]} == {os.getpid()}
    assert len(set(forked_calls["analyse"])) == 2, "the child measured some of the tests"
    assert len(set(forked_calls["match"])) == 2, "the child matched some of the blocks"
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

    log = tmp_path / "calls"
    monkeypatch.setattr(bulk_read, "_check_result", _logging(log, "check", bulk_read._check_result, pause_s=0.01))
    monkeypatch.setattr(bulk_read, "PARALLEL_MIN_SHARE", 1)
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    monkeypatch.setenv(accepted.CACHE_ENV, accepted.OFF)  # every payload checked, both times
    forked = load_receipts_from_mlflow(uri, "ablate")
    # Nothing remembered (the cache is off): every run with payload tags, damaged ones included, is decoded and
    # checked in the process that took its chunk (_check_result).
    checks = _calls_by_kind(log)["check"]
    assert len(checks) == len(receipts) and len(set(checks)) == 2, "each run checked once, the child took some"
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    single = load_receipts_from_mlflow(uri, "ablate")
    assert len(forked[0]) == len(receipts) - 2 and len(forked[1]) == 2
    assert [r.model_dump_json() for r in forked[0]] == [r.model_dump_json() for r in single[0]]
    assert forked[1] == single[1] and forked[2] == single[2]
    assert any("content does not match its digest" in why for _, why in forked[1])
