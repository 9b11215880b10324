"""CPU-bound, side-effect-free work of one command (checking 10,000 receipts, analysing each test, drawing each
lane's plot) spread over this machine's cores by forking.

A forked child already holds the parent's data, so nothing is pickled on the way in; each child sends back only
its results, a file per chunk of items, and exits without running the parent's exit handlers or flushing its
buffers. The parent computes chunks too, taking in the children's results between its own. Whatever goes wrong in
a child (an exception, a crash, a kill, results that cannot be read back) costs time, never a result: the parent
computes what that child took itself, so ``fork_map`` always returns exactly ``[fn(item) for item in items]`` or
raises what that raises.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

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


CHUNKS_PER_PROCESS = 32
"""How finely ``fork_map`` cuts its items: every process takes the next chunk when it finishes one, so a slower
process (the parent, which also takes in what the children send back; a CPU shared with another job) takes fewer.
Fixed halves left one of 2 CPUs idle for 0.4-0.8 s of a 10 s promotion over 10,000 receipts: the parent finished its
half up to 0.5 s after the child, then rebuilt the child's receipts alone. The last chunks bound what is left
uneven: 1/32 of a process's share."""

MAX_CHUNKS = 1024
"""Chunk numbers are written into a pipe before the fork, 4 bytes each: 4 KB, what any pipe holds (Linux shrinks a
pipe to one page for a user past ``pipe-user-pages-soft``), so the write never blocks."""

_NUMBER = struct.Struct("<I")
_WAIT_S = 0.05
"""How often the parent, out of chunks, looks for a child that exited without sending back a chunk it took."""


def fork_map(fn: Callable[[T], R], items: Sequence[T], processes: Optional[int] = None,
             min_share: int = 1, received: Optional[Callable[[T, R], R]] = None) -> list[R]:
    """``[fn(item) for item in items]``. Inside ``forking()`` the items are cut into chunks of consecutive items
    (``CHUNKS_PER_PROCESS``) that up to ``processes`` processes, this one included, each with at least ``min_share``
    items, take one at a time until none is left. ``fn`` must not depend on state it changes (a child's changes are
    lost) and its results must pickle. A result may be sent back lighter from a child (``in_forked_child``):
    ``received(item, result)`` is then what this process makes of it, applied here to every result a child sent
    back, between its own chunks."""
    count = min(processes or usable_processes(), len(items) // max(1, min_share)) if _allowed else 1
    if count < 2 or not hasattr(os, "fork"):
        return [fn(item) for item in items]
    size = -(-len(items) // min(MAX_CHUNKS, count * CHUNKS_PER_PROCESS))
    chunks = [range(start, min(start + size, len(items))) for start in range(0, len(items), size)]
    results: list[Optional[R]] = [None] * len(items)
    pending = set(range(len(chunks)))  # chunks whose results are not in ``results`` yet

    def compute(chunk: int) -> None:
        for index in chunks[chunk]:
            results[index] = fn(items[index])
        pending.discard(chunk)

    with _Chunks(len(chunks)) as shared:
        children: dict[int, int] = {}
        for number in range(1, count):
            pid = _fork_child(fn, items, chunks, shared, number)
            if pid is not None:
                children[number] = pid
        try:
            while (chunk := shared.take()) is not None:
                compute(chunk)
                _take_in(shared, chunks, items, results, pending, received, wait=False)
            while children:  # the children finish the chunks they took; one that died leaves them to this process
                _take_in(shared, chunks, items, results, pending, received, wait=True)
                for number, pid in list(children.items()):
                    if _exited(pid):
                        del children[number]
                        _take_in(shared, chunks, items, results, pending, received, wait=False)
                        for chunk in sorted(shared.taken_by(number) & pending):
                            compute(chunk)
            for chunk in sorted(pending):  # none, unless a child could not be forked the moment it took one
                compute(chunk)
        except BaseException:
            _stop(children.values())  # none outlives the call, none is left a zombie
            raise
    return results  # type: ignore[return-value]


class _Chunks:
    """What the processes of one ``fork_map`` share: the chunk numbers not yet taken (a pipe filled before the
    fork: a read of 4 bytes takes one, atomically), one results file per chunk a child computed, written whole or
    not at all, a byte per such file on a second pipe to wake the parent, and each child's list of the chunks it
    took, so that the chunk a child was computing when it died is computed again here."""

    def __init__(self, count: int) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="ablate-fork-")
        self.directory = Path(self._tmp.name)
        self._queue_r, queue_w = os.pipe()
        try:
            os.write(queue_w, b"".join(_NUMBER.pack(chunk) for chunk in range(count)))
        finally:
            os.close(queue_w)  # every reader sees the end once the numbers are taken
        self._done_r, self.done_w = os.pipe()
        os.set_blocking(self._done_r, False)  # the parent drains it between chunks, never waiting there
        self._seen: set[str] = set()

    def __enter__(self) -> "_Chunks":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in (self._queue_r, self._done_r, self.done_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._tmp.cleanup()

    def take(self) -> Optional[int]:
        data = os.read(self._queue_r, _NUMBER.size)
        return _NUMBER.unpack(data)[0] if len(data) == _NUMBER.size else None

    def result_path(self, chunk: int) -> Path:
        return self.directory / f"chunk-{chunk}.pickle"

    def claims_path(self, number: int) -> Path:
        return self.directory / f"taken-by-{number}"

    def taken_by(self, number: int) -> set[int]:
        try:
            data = self.claims_path(number).read_bytes()
        except OSError:
            return set()
        return {value for (value,) in _NUMBER.iter_unpack(data[:len(data) - len(data) % _NUMBER.size])}

    def ready(self, wait: bool) -> list[int]:
        """Chunks whose results file appeared since the last call; ``wait``: for up to ``_WAIT_S`` if none did."""
        if wait:
            select.select([self._done_r], [], [], _WAIT_S)
        try:
            while os.read(self._done_r, 4096):
                pass
        except BlockingIOError:
            pass
        found = []
        for name in os.listdir(self.directory):
            if name.endswith(".pickle") and name not in self._seen:
                self._seen.add(name)
                found.append(int(name[len("chunk-"):-len(".pickle")]))
        return found


def _take_in(shared: _Chunks, chunks: list[range], items: Sequence[T], results: list, pending: set[int],
             received: Optional[Callable[[T, Any], Any]], wait: bool) -> None:
    for chunk in shared.ready(wait):
        try:
            with open(shared.result_path(chunk), "rb") as handle:
                values = pickle.load(handle)
        except Exception:  # noqa: BLE001 - unreadable results: computed again here once their child has exited
            continue
        if chunk not in pending or not isinstance(values, list) or len(values) != len(chunks[chunk]):
            continue
        for index, value in zip(chunks[chunk], values):
            results[index] = received(items[index], value) if received is not None else value
        pending.discard(chunk)


def _fork_child(fn: Callable[[T], R], items: Sequence[T], chunks: list[range], shared: _Chunks,
                number: int) -> Optional[int]:
    for stream in (sys.stdout, sys.stderr):  # else a child's exit could repeat what the parent buffered
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        pid = os.fork()
    except OSError:  # no memory or process slots: the other processes take its chunks
        return None
    if pid:
        return pid
    global _in_child
    _in_child = True
    code = 1
    try:
        claims = os.open(shared.claims_path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        while (chunk := shared.take()) is not None:
            os.write(claims, _NUMBER.pack(chunk))  # before computing it: a death from here on leaves it to the parent
            values = [fn(items[index]) for index in chunks[chunk]]
            path = shared.result_path(chunk)
            partial = path.with_suffix(".partial")
            with open(partial, "wb") as handle:
                pickle.dump(values, handle, protocol=pickle.HIGHEST_PROTOCOL)
            partial.rename(path)  # complete or absent: a killed child never leaves half a result
            os.write(shared.done_w, b".")
        code = 0
    except BaseException:  # noqa: BLE001 - the parent computes the chunk again and raises what fn raises
        code = 1
    finally:
        os._exit(code)


def _exited(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done != 0


def _stop(children: Iterable[int]) -> None:
    import signal

    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
