"""``ablate.parallel.fork_map``: the work of one command split over forked processes returns exactly what one
process computes, and whatever goes wrong in a child costs time, never a result.

The parity tests run the two users of it on real data: the promotion rule over a simulated multi-lane campaign
(one JSON report, byte for byte, with and without forking), and the bulk receipt reader over a real SQLite MLflow
store holding damaged payloads (same receipts, same rejects, same reasons).
"""

from __future__ import annotations

import contextlib
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
    assert not parallel._meanwhile, "the outermost forking() block dropped what was left for children's time"


@contextlib.contextmanager
def _not_forking() -> Iterator[None]:
    # Not monkeypatch: conftest's autouse fixture sets monkeypatch up before this module's forking(), so its undo
    # would run last and leave forking allowed for every later test in the process.
    before, parallel._allowed = parallel._allowed, False
    try:
        yield
    finally:
        parallel._allowed = before


def _children() -> set[int]:
    # The test process may hold other children (servers, Ray) started by earlier tests: compare snapshots.
    import psutil

    return {child.pid for child in psutil.Process().children()}


def _meeting(directory: Path, processes: int = 2) -> Callable[[], None]:
    """Called first thing in ``fn``: each process's first call waits (30 s at most) until every process has made
    its first, so each takes at least one chunk whatever the machine's load (no process waits for another's second
    call, so none can wait forever)."""
    directory.mkdir(exist_ok=True)

    def meet() -> None:
        mine = directory / str(os.getpid())
        if mine.exists():
            return
        mine.touch()
        deadline = time.monotonic() + 30
        while len(list(directory.iterdir())) < processes and time.monotonic() < deadline:
            time.sleep(0.001)
    return meet


def test_results_in_order_and_computed_in_two_processes(tmp_path: Path) -> None:
    parent, before, meet = os.getpid(), _children(), _meeting(tmp_path)

    def fn(x: int) -> tuple[int, int]:
        meet()
        return x * x, os.getpid()

    got = fork_map(fn, list(range(40)), processes=2)
    assert [value for value, _ in got] == [x * x for x in range(40)]
    pids = {pid for _, pid in got}
    assert parent in pids and len(pids) == 2, "both processes took chunks"
    assert not (pids - {parent}) & _children() and _children() <= before, "the child was reaped"


def test_a_process_held_up_takes_fewer_items(tmp_path: Path) -> None:
    """Chunks are taken one at a time: a process held up (the parent taking in what the children send back; a CPU
    shared with another job) computes fewer items. Here the parent's first item waits until the child has computed
    all but one chunk's worth, so the parent computes that one chunk (4 items of 256), where fixed halves gave it
    128 whatever the child did."""
    parent, log = os.getpid(), tmp_path / "by-child"

    def fn(x: int) -> tuple[int, int]:
        if os.getpid() != parent:
            with open(log, "a") as handle:
                handle.write(f"{x}\n")
        elif not fn.waited:  # type: ignore[attr-defined]
            fn.waited = True  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (not log.exists() or len(log.read_text().split()) < 252):
                time.sleep(0.005)
        return x * x, os.getpid()

    fn.waited = False  # type: ignore[attr-defined]
    got = fork_map(fn, list(range(256)), processes=2)
    assert [value for value, _ in got] == [x * x for x in range(256)]
    assert sum(pid == parent for _, pid in got) == 4, "the parent computed the one chunk it took"


def test_every_item_is_computed_exactly_once(tmp_path: Path) -> None:
    log = tmp_path / "computed"

    def fn(x: int) -> int:
        with open(log, "a") as handle:  # O_APPEND: one line per call from every process
            handle.write(f"{x}\n")
        time.sleep(0.001)
        return x

    assert fork_map(fn, list(range(300)), processes=3) == list(range(300))
    assert sorted(int(line) for line in log.read_text().split()) == list(range(300))


def test_received_turns_what_a_child_sent_back_into_the_result_here(tmp_path: Path) -> None:
    parent, meet = os.getpid(), _meeting(tmp_path)

    def fn(x: int) -> tuple[str, int]:
        meet()
        return ("light" if parallel.in_forked_child() else "full"), x

    def received(item: int, value: tuple[str, int]) -> tuple[str, int]:
        assert os.getpid() == parent and value == ("light", item)
        return "rebuilt", item

    got = fork_map(fn, list(range(200)), processes=2, received=received)
    assert [x for _, x in got] == list(range(200))
    assert {kind for kind, _ in got} == {"full", "rebuilt"}, "the parent's own results are not passed to received"


def test_work_for_meanwhile_runs_once_in_the_parent_while_children_compute(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "_meanwhile", [])
    parent, ran, marker = os.getpid(), [], tmp_path / "task-done"

    def task() -> None:  # the children take chunks while it runs: it ends only once the child has taken 20
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(tmp_path.glob("item-*"))) < 20:
            time.sleep(0.002)
        ran.append(os.getpid())
        marker.touch()

    def fn(x: int) -> tuple[int, int, bool]:
        if os.getpid() != parent:
            (tmp_path / f"item-{x}").touch()
        return x, os.getpid(), marker.exists()

    def fails() -> None:
        raise ImportError("a preload that fails is the later steps' to raise")

    parallel.while_children_work(fails)
    parallel.while_children_work(task)
    got = fork_map(fn, list(range(64)), processes=2)
    assert [x for x, _, _ in got] == list(range(64)) and ran == [parent]
    assert all(done for _, pid, done in got if pid == parent), "the parent took chunks only once the task was done"
    assert sum(pid != parent for _, pid, _ in got) >= 20
    fork_map(fn, list(range(64)), processes=2)
    assert ran == [parent], "a task runs once"
    parallel.while_children_work(task)
    fork_map(fn, list(range(64)), processes=1)
    assert ran == [parent], "no fork: the task does not run"
    with _not_forking():
        parallel.while_children_work(task)
    assert len(parallel._meanwhile) == 1, "outside forking(), where nothing forks, nothing is kept"


def test_one_process_and_small_inputs_fork_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = os.getpid()
    with parallel.forking():
        pass
    assert parallel._allowed, "leaving an inner block keeps the outer one's permission"
    assert {pid for pid in fork_map(lambda _: os.getpid(), range(5), processes=2, min_share=3)} == {parent}
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    assert {pid for pid in fork_map(lambda _: os.getpid(), range(50))} == {parent}
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    with _not_forking():  # outside forking(): a sweep driver's threads are never forked
        assert {pid for pid in fork_map(lambda _: os.getpid(), range(50))} == {parent}


@pytest.mark.parametrize("value", ["0", "two", "-3"])
def test_a_bad_process_count_names_the_variable_the_value_and_what_is_allowed(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(parallel.PROCESSES_ENV, value)
    with pytest.raises(ValueError, match=rf"{parallel.PROCESSES_ENV}='{value}'.*allowed: a whole number >= 1"):
        fork_map(str, range(4))


def test_a_child_that_dies_or_raises_costs_time_never_a_result(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
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

    calls = tmp_path / "child-calls"

    def dies_after_two_chunks(x: int) -> tuple[int, int]:  # 100 items: chunks of 2
        if os.getpid() != parent:
            with open(calls, "a") as handle:
                handle.write(f"{x}\n")
            if len(calls.read_text().split()) == 5:  # the first item of its third chunk: taken, never sent back
                os._exit(9)
        elif not dies_after_two_chunks.waited:  # type: ignore[attr-defined]
            dies_after_two_chunks.waited = True  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30  # the parent's first item: until the child is at its fifth
            while time.monotonic() < deadline and (not calls.exists() or len(calls.read_text().split()) < 5):
                time.sleep(0.002)
        return x * 3, os.getpid()

    dies_after_two_chunks.waited = False  # type: ignore[attr-defined]
    got = fork_map(dies_after_two_chunks, list(range(100)), processes=2)
    assert [value for value, _ in got] == [x * 3 for x in range(100)]
    assert sum(pid != parent for _, pid in got) == 4, "the child's two chunks were taken in before it died"

    def cannot_be_sent_back(x: int) -> Callable[[], int]:
        return lambda: x  # a lambda does not pickle: the child's results never reach the parent

    assert [f() for f in fork_map(cannot_be_sent_back, list(range(9)), processes=2)] == list(range(9))

    real_take = parallel._Chunks.take

    def dies_once_it_took_one(self: parallel._Chunks) -> object:
        chunk = real_take(self)
        if os.getpid() != parent:
            os._exit(9)  # after taking a chunk, before writing down that it did
        return chunk

    monkeypatch.setattr(parallel._Chunks, "take", dies_once_it_took_one)
    assert fork_map(lambda x: x - 1, list(range(64)), processes=3) == [x - 1 for x in range(64)]
    assert _children() <= before


def test_what_fn_raises_reaches_the_caller_and_no_child_is_left() -> None:
    before = _children()

    def fails_on_three(x: int) -> int:
        if x == 3:
            raise KeyError("three")
        return x

    with pytest.raises(KeyError, match="three"):
        fork_map(fails_on_three, list(range(8)), processes=2)  # in either process's chunk: raised here
    with pytest.raises(KeyError, match="three"):
        fork_map(fails_on_three, [3] + list(range(4, 20)), processes=2)  # the first chunk
    assert _children() <= before


def test_of_two_failing_items_the_first_ones_error_is_raised(tmp_path: Path) -> None:
    """As in one process, whichever process reaches which item first: the chunk of 11 is taken before the chunk
    of 40, so a process failing at 40 computes the earlier chunks still missing before it raises."""
    before = _children()

    def fails_twice(x: int) -> int:
        if x == 11:
            raise KeyError("eleven")
        if x == 40:
            raise ValueError("forty")
        return x

    for _ in range(3):
        with pytest.raises(KeyError, match="eleven") as raised:
            fork_map(fails_twice, list(range(64)), processes=2)
        assert raised.value.__context__ is None, "not raised while handling the later item's error"

    parent, marker = os.getpid(), tmp_path / "child-failed"

    def child_fails_first(x: int) -> int:  # the child takes the chunk of 11; the parent then fails at 40
        if os.getpid() != parent and x == 11:
            marker.touch()
        elif os.getpid() == parent and not marker.exists():
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.002)
        return fails_twice(x)

    with pytest.raises(KeyError, match="eleven") as raised:
        fork_map(child_fails_first, list(range(64)), processes=2)
    assert raised.value.__context__ is None, "computed again here after 40 failed, not raised while handling it"
    assert _children() <= before


def test_ctrl_c_during_a_fork_leaves_no_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT arriving while the parent forks (here: sent just before) is raised once the child is recorded, so
    the child is killed and reaped, not left computing or as a zombie; the child never raises it in the parent's
    code."""
    import signal

    before, real_fork = _children(), os.fork

    def interrupted_fork() -> int:
        os.kill(os.getpid(), signal.SIGINT)
        return real_fork()

    monkeypatch.setattr(parallel.os, "fork", interrupted_fork)
    # Python's own Ctrl+C handler: an earlier test in the process (Ray, Tune) may have left another installed.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            fork_map(lambda x: time.sleep(0.01) or x, list(range(40)), processes=3)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert _children() <= before, "every forked child was killed and reaped"


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


def _logging(log: Path, kind: str, fn):
    meet = _meeting(log.parent / f"meet-{kind}")  # the child takes a chunk before the parent has taken them all

    def logged(*args, **kwargs):
        with open(log, "a") as handle:
            handle.write(f"{kind} {os.getpid()}\n")
        meet()
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
    monkeypatch.setattr(match, "_matched", _logging(log, "match", match._matched))
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
    monkeypatch.setattr(bulk_read, "_check_result", _logging(log, "check", bulk_read._check_result))
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
