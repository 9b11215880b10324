"""CPU-bound, side-effect-free work of one command (checking 10,000 receipts, analysing each test, drawing each
lane's plot) spread over this machine's cores by forking.

A forked child already holds the parent's data, so nothing is pickled on the way in; each child sends back only
its results, through a file, and exits without running the parent's exit handlers or flushing its buffers. The
parent computes its own share meanwhile. Whatever goes wrong in a child (an exception, a crash, a kill, results
that cannot be read back) costs time, never a result: the parent computes that share itself, so ``fork_map`` always
returns exactly ``[fn(item) for item in items]`` or raises what that raises.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PROCESSES_ENV = "ABLATE_PROCESSES"
"""How many processes ``fork_map`` may use (1: none forked); default: the CPUs this process may run on."""


_allowed = False
_in_child = False


def in_forked_child() -> bool:
    """True inside a ``fork_map`` child: a function whose result is costly to pickle may send back less there and
    let the caller rebuild it (``bulk_read``: a checked receipt is re-parsed from its bytes faster than it unpickles)."""
    return _in_child


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Let ``fork_map`` fork inside this block. Off by default: only a command that owns its whole process (``ablate
    promote``) turns it on. A process with other threads at work (the sweep driver: Ray's and gRPC's) must not
    fork, since a child could inherit a lock one of them holds; there ``fork_map`` computes everything itself."""
    global _allowed
    before, _allowed = _allowed, True
    try:
        yield
    finally:
        _allowed = before


def usable_processes() -> int:
    configured = os.environ.get(PROCESSES_ENV, "").strip()
    if configured:
        try:
            value = int(configured)
        except ValueError:
            raise ValueError(f"{PROCESSES_ENV}={configured!r}: allowed: a whole number >= 1") from None
        if value < 1:
            raise ValueError(f"{PROCESSES_ENV}={configured!r}: allowed: a whole number >= 1")
        return value
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def fork_map(fn: Callable[[T], R], items: Sequence[T], processes: Optional[int] = None,
             min_share: int = 1) -> list[R]:
    """``[fn(item) for item in items]``. Inside ``forking()`` the items are dealt round-robin (a share's cost does not
    depend on where the costly items sit) over up to ``processes`` processes, this one included, with at least
    ``min_share`` items each. ``fn`` must not depend on state it changes (a child's changes are lost) and its
    results must pickle. A result may be sent back lighter from a child (``in_forked_child``) when the caller
    rebuilds what it left out."""
    count = min(processes or usable_processes(), len(items) // max(1, min_share)) if _allowed else 1
    if count < 2 or not hasattr(os, "fork"):
        return [fn(item) for item in items]
    shares = [range(start, len(items), count) for start in range(count)]
    results: list[Optional[R]] = [None] * len(items)
    with tempfile.TemporaryDirectory(prefix="ablate-fork-") as tmp:
        children = {}
        for number, share in enumerate(shares[1:], start=1):
            path = Path(tmp) / f"share-{number}.pickle"
            pid = _fork_child(fn, items, share, path)
            if pid is not None:
                children[number] = (pid, path)
        try:
            for index in shares[0]:
                results[index] = fn(items[index])
        except BaseException:
            _stop(children.values())
            raise
        for number, share in enumerate(shares[1:], start=1):
            got = _collect(*children.pop(number)) if number in children else None
            try:
                values = got if got is not None and len(got) == len(share) else [fn(items[i]) for i in share]
            except BaseException:
                _stop(children.values())  # the later children too: none outlives the call, none left a zombie
                raise
            for index, value in zip(share, values):
                results[index] = value
    return results  # type: ignore[return-value]


def _fork_child(fn: Callable[[T], R], items: Sequence[T], share: range, path: Path) -> Optional[int]:
    for stream in (sys.stdout, sys.stderr):  # else a child's exit could repeat what the parent buffered
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        pid = os.fork()
    except OSError:  # no memory or process slots: the parent does the share
        return None
    if pid:
        return pid
    global _in_child
    _in_child = True
    code = 1
    try:
        values = [fn(items[index]) for index in share]
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as handle:
            pickle.dump(values, handle, protocol=pickle.HIGHEST_PROTOCOL)
        partial.rename(path)  # complete or absent: a killed child never leaves half a result
        code = 0
    except BaseException:  # noqa: BLE001 - the parent recomputes the share and raises what fn raises
        code = 1
    finally:
        os._exit(code)


def _stop(children) -> None:
    import signal

    for pid, _ in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _collect(pid: int, path: Path) -> Optional[list]:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        status = -1
    if status != 0 or not path.exists():
        return None
    try:
        with open(path, "rb") as handle:
            values = pickle.load(handle)
    except Exception:  # noqa: BLE001 - unreadable results: the parent recomputes them
        return None
    return values if isinstance(values, list) else None
