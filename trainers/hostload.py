"""How fairly an arm was measured: its CPU priority, the CPUs it may use, and what else ran on the node.

How to use::

    reset_priority()                       # first thing in a fresh arm process (before heavy imports)
    probe = HostLoadProbe(local_ranks=1)
    probe.start(turns=gate); ...measured loop...; facts = probe.stop()   # -> the receipt's ``host_load``

Ray starts its worker processes at niceness 15 (``RAY_worker_niceness``) so its own daemons keep priority; an
arm process inherits that, and then any other process on the node pre-empts the measurement. The sweep asks Ray
for niceness 0 where it can (``RAY_worker_niceness=0`` in the runtime environment, ``cluster.yaml``); here the
arm resets whatever it inherited when the OS allows it (root or CAP_SYS_NICE). When it cannot, the receipt
says so and the arm carries LOW_PRIORITY: it is not measured, rather than measured unfairly.

Contention is measured, not guessed from the load average: the kernel's scheduler statistics
(``/proc/self/task/*/schedstat``) count the time each of this process's threads was runnable but waiting for a
CPU. An arm whose threads waited more than ``CONTENDED_RUN_DELAY`` of its measured loop was pre-empted by something
else on the node: ``contended``. An interleaved arm counts only its own turns (``TurnGate.own_turns``): between
two of them it is often still runnable, pre-empted by its partner on their shared CPU just before it blocks, and
the kernel counts the time until it gets the CPU back (often part of the partner's turn) as run delay. For
context the receipt also records the CPU time the whole node spent busy (procfs, steal included) beyond this
arm's own, and the load average (1, 5, 15 min) at both ends.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Optional, Protocol

CONTENDED_RUN_DELAY = 0.05
"""Share of the measured loop (an interleaved arm's: of its own turns) the arm's threads may spend
runnable-but-waiting before the block is flagged (an idle 2-core machine: ~0.04%; two CPU hogs beside one arm:
~34%; an interleaved pair alone on a CPU: ~1%)."""

_PRIORITY: dict[str, Optional[int]] = {"inherited": None, "now": None}


class OwnTurns(Protocol):
    def own_turns(self) -> Optional[tuple[float, Optional[float]]]: ...


def reset_priority() -> tuple[Optional[int], Optional[int]]:
    """Reset this process's niceness to 0 if it was raised; returns (inherited, now). Never raises."""
    try:
        inherited = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return None, None
    now = inherited
    if inherited > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            now = os.getpriority(os.PRIO_PROCESS, 0)
        except OSError:
            now = inherited  # no CAP_SYS_NICE: the receipt will say so (LOW_PRIORITY)
    _PRIORITY.update(inherited=inherited, now=now)
    return inherited, now


def _busy_cpu_s() -> Optional[float]:
    try:
        import psutil

        t = psutil.cpu_times()
    except Exception:  # noqa: BLE001 - procfs unavailable (odd sandboxes): record null, never a guess
        return None
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_delay_s() -> Optional[float]:
    """Seconds this process's threads spent runnable but not running (sum over threads; None without schedstat)."""
    total, read = 0, 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as handle:
                total += int(handle.read().split()[1])
            read += 1
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended between the listing and the read
    # No thread's statistics at all (a kernel without schedstat, a sandbox hiding them): unknown, not zero.
    return total / 1e9 if read else None


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 3) for x in os.getloadavg()]
    except OSError:
        return None


def _cpus() -> tuple[Optional[list[int]], int]:
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return affinity, os.cpu_count() or 1


class HostLoadProbe:
    """Brackets the measured loop; ``stop()`` returns the receipt's ``host_load`` mapping."""

    def __init__(self, local_ranks: int = 1) -> None:
        self.local_ranks = max(1, local_ranks)
        self._t0: Optional[float] = None
        self._busy0: Optional[float] = None
        self._own0 = 0.0
        self._load0: Optional[list[float]] = None
        self._delay0: Optional[float] = None
        self._turns: Optional[OwnTurns] = None
        self._turns0: Optional[tuple[float, Optional[float]]] = None

    def start(self, turns: Optional[OwnTurns] = None) -> None:
        """``turns``: an interleaved arm's gate (``trainers.pairing.TurnGate``); its run delay is then taken over
        its own turns from here on (``TurnGate.own_turns``)."""
        self._turns = turns
        self._turns0 = turns.own_turns() if turns is not None else None
        self._load0 = _loadavg()
        self._delay0 = run_delay_s()
        self._busy0 = _busy_cpu_s()
        self._own0 = _own_cpu_s()
        self._t0 = time.perf_counter()

    def stop(self, paired_wait_s: float = 0.0) -> dict[str, Any]:
        """An interleaved arm started with its gate (``start(turns=gate)``): the run delay inside its own turns, as
        a share of them. Otherwise (unpaired, or a gate that lost its coordinator mid-run) the whole window's, as a
        share of the window less ``paired_wait_s`` (the time the loop waited while a partner took its turns: over
        the whole window the threshold acted as twice itself, found in review). That fallback still counts any run
        delay the arm accrued between its turns (``TurnGate.own_turns`` says when it does)."""
        window = time.perf_counter() - self._t0 if self._t0 is not None else None
        busy1, own1, delay1 = _busy_cpu_s(), _own_cpu_s(), run_delay_s()
        affinity, logical = _cpus()
        niceness: Optional[int]
        try:
            niceness = os.getpriority(os.PRIO_PROCESS, 0)
        except OSError:
            niceness = None
        facts: dict[str, Any] = {
            "niceness": niceness, "niceness_inherited": _PRIORITY["inherited"], "affinity": affinity,
            "logical_cpus": logical, "loadavg_start": self._load0, "loadavg_end": _loadavg(), "window_s": window,
            "own_cpus": None, "foreign_cpus": None, "run_delay_s": None, "run_delay_share": None,
            "contended": False, "detail": "",
        }
        if window and window > 0 and self._busy0 is not None and busy1 is not None:
            # Every local rank of a multi-worker arm runs the same loop: count them all as the arm's own load.
            own = (own1 - self._own0) * self.local_ranks / window
            facts.update(own_cpus=round(own, 3), foreign_cpus=round(max(0.0, (busy1 - self._busy0) / window - own), 3))
        measured = self._own_turn_delay()
        if measured is not None:
            delay, running = measured
            scope = "of its own turns"
        elif window and window > 0 and self._delay0 is not None and delay1 is not None:
            # Unpaired (or a gate that lost its coordinator mid-run): the whole loop, less any partner's turns.
            delay = delay1 - self._delay0
            running = window - paired_wait_s if 0.0 <= paired_wait_s < window else window
            scope = "of its measured loop" + (", its partner's turns left out" if running < window else "")
        else:
            return facts
        share = delay / running
        facts.update(run_delay_s=round(delay, 4), run_delay_share=round(share, 4))
        if share > CONTENDED_RUN_DELAY:
            facts["contended"] = True
            facts["detail"] = (f"the arm's threads waited {delay:.2f}s for a CPU ({share:.0%} {scope}) while "
                               f"other processes ran on the node (they kept {facts['foreign_cpus']} CPUs busy of "
                               f"{logical})")
        return facts

    def _own_turn_delay(self) -> Optional[tuple[float, float]]:
        """(run delay, seconds) inside the arm's own turns since ``start``; None unless every turn was counted."""
        if self._turns is None or self._turns0 is None:
            return None
        now = self._turns.own_turns()
        if now is None or now[1] is None or self._turns0[1] is None or now[0] - self._turns0[0] <= 0:
            return None
        return now[1] - self._turns0[1], now[0] - self._turns0[0]
