"""Interleaved blocks: the two arms of a block run side by side in their own processes and take turns.

How to use (``trainers.run.run_pair`` does this)::

    coordinator = TurnCoordinator(first=0)             # trial side: arm 0 takes the first turn
    child_fds = coordinator.child_fds()                # one socket per arm, passed to its worker process
    ... start both workers with ABLATE_TURN_FD=<fd> ...; coordinator.start(); ...; coordinator.close()

    gate = TurnGate.from_env()                         # worker side (a no-op gate when not paired)
    waited = gate.acquire(); step(); gate.release()    # every measured phase (setup, each step) is one turn;
                                                       # ``waited``: seconds that belonged to the partner

Why: on a shared or virtualised host the machine's speed drifts over seconds (neighbours, frequency). Arms run
back to back sample different drift, which on the 2-core CPU machine made one block's log ratio scatter by 11-13%
(A/A, 8 pairs); alternating the two arms' steps on the same CPUs samples the same drift in both and cut it to
1.4-2.9% (same host, same lane; see the closing note of the issue "right verdicts"). Only executor start-up
(spawn, imports) runs concurrently; it is recorded and never compared. Each turn is one measured phase (setup,
one warmup step, one budget step), strictly alternating, the block's first arm first. A partner that has finished
or died no longer holds anyone up. Time an arm spends waiting for its turn is ``paired_wait`` badput and is never
inside a step's cadence, so the recurring step time is the arm's own.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import socket
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Optional

from trainers.hostload import run_delay_s

ENV_FD = "ABLATE_TURN_FD"
ENV_CPUS = "ABLATE_PAIR_CPUS"
SLOT_DIR = Path(tempfile.gettempdir()) / f"ablate-cpu-slots-{os.getuid()}"
"""Node-local lock files, one per CPU: concurrent interleaved blocks on one node take disjoint CPUs."""
_REQUEST, _GRANT, _DONE = b"R", b"G", b"D"


@contextmanager
def cpu_slot(count: int) -> Iterator[Optional[list[int]]]:
    """Hold ``count`` CPUs of this process's affinity that no other interleaved block on the node holds.

    Two blocks interleaving on the same CPUs would time-share them unevenly (one arm of a block overlapping the
    other block's heavier arm); on disjoint CPUs each pair only shares caches and memory. Yields None when the
    node has no free CPUs left (more concurrent blocks than CPUs): the pair then runs unpinned.
    """
    try:
        candidates = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        yield None
        return
    SLOT_DIR.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        held: list[int] = []
        for cpu in candidates:
            handle = stack.enter_context(open(SLOT_DIR / f"cpu{cpu}.lock", "w"))
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            held.append(cpu)
            if len(held) == count:
                break
        yield held if len(held) == count else None


_inherited_cpus: Optional[int] = None
"""How many CPUs this process could run on before ``pin`` narrowed it to its pair's slot (None: never pinned)."""


def pin(cpus: set[int]) -> None:
    """Run this process on its pair's CPUs from now on, remembering the allotment it inherited: that allotment is
    the node's (what a hardware fingerprint compares), the slot is one block's placement (``cpu_slot`` gives a
    pinned slot or none by what else holds the node's CPUs at that moment)."""
    global _inherited_cpus
    before = len(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    # On Linux the call sets one thread's mask: threads started before it (the OpenMP pool a parallel op in
    # start-up created, allocator or runtime threads) kept the node's CPUs and ran outside the slot, beside
    # another block's arms (found in review). Every thread of this process goes into the slot.
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # it exited meanwhile
    if _inherited_cpus is None:
        _inherited_cpus = before


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def inherited_cpus() -> Optional[int]:
    return _inherited_cpus


class TurnGate:
    """The worker's side: ask for a turn, run, give it back. Without a coordinator every turn is granted at once."""

    def __init__(self, sock: Optional[socket.socket], cpus: Optional[set[int]] = None) -> None:
        self.sock = sock
        self.cpus = cpus
        self.turns = 0
        self._released_at: Optional[float] = None
        self._own_s = 0.0
        self._own_delay_s: Optional[float] = 0.0
        self._turn: Optional[tuple[float, Optional[float]]] = None
        self._lost = False

    @classmethod
    def from_env(cls) -> "TurnGate":
        fd = os.environ.pop(ENV_FD, "")
        cpus = os.environ.pop(ENV_CPUS, "")
        return cls(socket.socket(fileno=int(fd)) if fd.isdigit() else None,
                   {int(c) for c in cpus.split(",")} if cpus else None)

    @property
    def paired(self) -> bool:
        return self.sock is not None

    def acquire(self) -> float:
        """Block until it is this arm's turn; returns the seconds that belong to the partner.

        Counted from this arm's previous release, not from this call: once the partner is woken it usually takes
        the CPU before this process reaches its next request, and that time is the partner's, not a gap of ours.
        """
        if self.sock is None:
            return 0.0
        start = self._released_at if self._released_at is not None else time.perf_counter()
        if self.cpus is not None and self.turns == 0:
            # Start-up ran on any CPU (it is never compared); every turn runs on the pair's own CPUs.
            try:
                pin(self.cpus)
            except OSError:
                self.cpus = None
        try:
            self.sock.sendall(_REQUEST)
            if self.sock.recv(1) != _GRANT:
                self._drop(lost=True)  # the coordinator went away: run unpaired rather than hang
        except OSError:
            self._drop(lost=True)
        self.turns += 1
        granted = time.perf_counter()
        if self.sock is not None:
            self._turn = (granted, run_delay_s())
        return granted - start

    def release(self) -> None:
        if self.sock is None:
            return
        self._end_turn()
        try:
            self._released_at = time.perf_counter()
            self.sock.sendall(_DONE)
        except OSError:
            self._drop(lost=True)

    def own_turns(self) -> Optional[tuple[float, Optional[float]]]:
        """(seconds inside this arm's own turns, seconds its threads were runnable but waiting for a CPU inside
        them; None without schedstat), summed since the gate opened; None when not paired, or once the coordinator
        was lost mid-run (later steps ran outside any turn).

        Why not the run delay of the whole loop minus the partner's turns: right after giving its turn back an arm
        still has a few microseconds to run before it blocks for the next one, and the partner, woken on the same
        CPU, often pre-empts it there. The arm then stays runnable, not blocked, until the scheduler gives it the
        CPU back, often part of the partner's turn, and the kernel counts that as run delay. On the 2-core machine
        that put ~12% of every smoke arm's loop into its run delay against ~5% inside its own turns (2 CPUs, two
        blocks at once), and flagged every interleaved arm HOST_CONTENDED; two pairs alone on the machine: 6-9%
        against 1.1-1.3%. Left out too: the wait for the CPU between the grant and this arm running again, which
        is before its step's clock starts (``paired_wait``), not inside it."""
        if self._lost or (self.sock is None and self.turns == 0):
            return None
        return self._own_s, self._own_delay_s

    def close(self) -> None:
        """This arm has no more turns: its partner stops waiting for it (before the arm's own teardown)."""
        self._end_turn()
        self._drop()

    def _end_turn(self) -> None:
        if self._turn is None:
            return
        (start, delay), self._turn = self._turn, None
        now_delay = run_delay_s()
        self._own_s += time.perf_counter() - start
        if delay is None or now_delay is None or self._own_delay_s is None:
            self._own_delay_s = None
        else:
            self._own_delay_s += now_delay - delay

    def _drop(self, lost: bool = False) -> None:
        self._lost = self._lost or lost
        if self.sock is not None:
            self.sock.close()
        self.sock = None


class TurnCoordinator:
    """The trial's side: grants turns to two arms in strict alternation, the block's first arm first."""

    def __init__(self, first: int = 0) -> None:
        self._pairs = [socket.socketpair() for _ in range(2)]
        self._next = first
        self._waiting = [False, False]
        self._finished = [False, False]
        self._holder: Optional[int] = None
        self._thread: Optional[threading.Thread] = None
        self.turns = [0, 0]

    def child_fds(self) -> list[int]:
        return [child.fileno() for _, child in self._pairs]

    def start(self) -> None:
        # The workers hold their own copies of the children now: closing ours makes a worker's exit an EOF here.
        for _, child in self._pairs:
            child.close()
        self._thread = threading.Thread(target=self._serve, name="ablate-turns", daemon=True)
        self._thread.start()

    def _grant(self) -> None:
        if self._holder is not None:
            return
        for arm in (self._next, 1 - self._next):
            # The arm whose turn it is goes; the other goes only if that one has finished (or died).
            if self._waiting[arm] and (arm == self._next or self._finished[self._next]):
                self._waiting[arm] = False
                self._holder = arm
                self.turns[arm] += 1
                try:
                    self._pairs[arm][0].sendall(_GRANT)
                except OSError:
                    self._finish(arm)
                return

    def _finish(self, arm: int) -> None:
        self._finished[arm] = True
        self._waiting[arm] = False
        if self._holder == arm:
            self._holder = None
            self._next = 1 - arm

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        for arm, (own, _) in enumerate(self._pairs):
            selector.register(own, selectors.EVENT_READ, arm)
        while not all(self._finished):
            for key, _ in selector.select():
                arm = key.data
                try:
                    data = key.fileobj.recv(64)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(key.fileobj)
                    self._finish(arm)
                for byte in data:
                    if bytes([byte]) == _REQUEST:
                        self._waiting[arm] = True
                    elif bytes([byte]) == _DONE and self._holder == arm:
                        self._holder = None
                        self._next = 1 - arm
                self._grant()
        selector.close()

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        for own, _ in self._pairs:
            own.close()
