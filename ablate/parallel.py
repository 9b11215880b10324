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
import signal
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PROCESSES_ENV = "ABLATE_PROCESSES"
"""How many processes ``fork_map`` may use (1: none forked); default: the CPUs this process may run on."""


_allowed = False
_in_child = False
_meanwhile: list[Callable[[], object]] = []


def while_children_work(task: Callable[[], object]) -> None:
    """Have this process run ``task`` once, while the next ``fork_map`` that forks has children at work (they take
    the chunks it would have taken meanwhile), instead of on its own later: for work the caller does anyway, such
    as an import its later steps need. Only inside ``forking()``, and dropped when the outermost such block ends:
    if no ``fork_map`` forks there, the task never runs, and the later steps do that work themselves; what it
    raises is dropped, and raised again there. A task must not call ``fork_map`` or start threads (the next fork
    would copy them mid-work)."""
    if _allowed:
        _meanwhile.append(task)


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
        if not before:  # the command is over: what it left for its children's time is not another's to run
            _meanwhile.clear()


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

_CHUNK_NUMBER = struct.Struct("<I")
_WAIT_MS = 50
"""How often the parent, out of chunks, looks for a child that exited without sending back a chunk it took."""


def fork_map(fn: Callable[[T], R], items: Sequence[T], processes: Optional[int] = None,
             min_share: int = 1, received: Optional[Callable[[T, R], R]] = None) -> list[R]:
    """``[fn(item) for item in items]``. Inside ``forking()`` up to ``processes`` processes, this one included, and
    no more than one per ``min_share`` items, take chunks of consecutive items (``CHUNKS_PER_PROCESS``) one at a
    time until none is left. ``fn`` must not depend on state it changes (a child's changes are lost) and its
    results must pickle. A result may be sent back lighter from a child (``in_forked_child``): ``received(item,
    result)`` is then what this process makes of it, applied here to every result a child sent back, between its
    own chunks. When items fail, what the first failing item raises is raised, as in one process."""
    num_processes = min(processes or usable_processes(), len(items) // max(1, min_share)) if _allowed else 1
    if num_processes < 2 or not hasattr(os, "fork"):
        return [fn(item) for item in items]
    chunk_size = -(-len(items) // min(MAX_CHUNKS, num_processes * CHUNKS_PER_PROCESS))
    chunks = [range(start, min(start + chunk_size, len(items))) for start in range(0, len(items), chunk_size)]
    try:
        shared = _Chunks(len(chunks))
    except OSError:  # no temporary directory or no pipe left: this process computes everything, as on one CPU
        return [fn(item) for item in items]
    with shared:
        return _Map(fn, items, chunks, received, shared).run(num_processes)


class _Map:
    """One ``fork_map`` call in the parent: its children, the results so far, the chunks still missing."""

    def __init__(self, fn: Callable[[T], R], items: Sequence[T], chunks: list[range],
                 received: Optional[Callable[[T, R], R]], shared: "_Chunks") -> None:
        self.fn, self.items, self.chunks, self.received, self.shared = fn, items, chunks, received, shared
        self.results: list[Any] = [None] * len(items)
        self.pending = set(range(len(chunks)))
        self.children: dict[int, int] = {}  # child number -> pid

    def run(self, num_processes: int) -> list[Any]:
        try:
            parent = os.getpid()
            for number in range(1, num_processes):
                with _sigint_held() as mask:  # a Ctrl+C during the fork finds the child's pid already recorded
                    pid = _fork_child(self.fn, self.items, self.chunks, self.shared, number, parent, mask)
                    if pid is not None:
                        self.children[number] = pid
            while self.children and _meanwhile:
                try:
                    _meanwhile.pop(0)()
                except Exception:  # noqa: BLE001 - the caller's later steps do that work, and raise what it raises
                    pass
            while (chunk := self.shared.take()) is not None:
                self._compute(chunk)
                self._take_in(wait=False)
            while self.children:  # they finish the chunks they took; one that died leaves them to this process
                self._take_in(wait=True)
                for number in _reap_exited(self.children):
                    self._take_in(wait=False)
                    for chunk in sorted(self.shared.taken_by(number) & self.pending):
                        self._compute(chunk)
            for chunk in sorted(self.pending):  # taken by a child that died before it could write down taking it
                self._compute(chunk)
        except BaseException:
            _stop(self.children)  # none outlives the call, none is left a zombie
            raise
        return self.results

    def _compute(self, chunk: int) -> None:
        try:
            for index in self.chunks[chunk]:
                self.results[index] = self.fn(self.items[index])
        except Exception as exc:  # noqa: BLE001 - raised below, once the earlier chunks are known to pass
            failure = exc
        else:
            self.pending.discard(chunk)
            return
        # One process raises at the first item that fails: the earlier chunks children took are computed here
        # first, and what one of them raises is raised instead (outside the except block: not chained to this one).
        _stop(self.children)
        self._take_in(wait=False)
        for earlier in sorted(c for c in self.pending if c < chunk):
            for index in self.chunks[earlier]:
                self.results[index] = self.fn(self.items[index])
            self.pending.discard(earlier)
        raise failure

    def _take_in(self, wait: bool) -> None:
        for chunk in self.shared.ready(wait):
            path = self.shared.result_path(chunk)
            try:
                with open(path, "rb") as handle:
                    values = pickle.load(handle)
                path.unlink()
            except Exception:  # noqa: BLE001 - unreadable results: computed again here once their child has exited
                continue
            if chunk not in self.pending or not isinstance(values, list) or len(values) != len(self.chunks[chunk]):
                continue
            for index, value in zip(self.chunks[chunk], values):
                self.results[index] = value if self.received is None else self.received(self.items[index], value)
            self.pending.discard(chunk)


class _Chunks:
    """What the processes of one ``fork_map`` share: the chunk numbers not yet taken (a pipe filled before the
    fork: a read of 4 bytes takes one, atomically), one results file per chunk a child computed, written whole or
    not at all, its number on a second pipe to wake the parent, and each child's list of the chunks it took, so
    that the chunk a child was computing when it died is computed again here."""

    def __init__(self, num_chunks: int) -> None:
        self._fds: list[int] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="ablate-fork-")
        try:
            self._queue_r, queue_w = self._pipe()
            os.write(queue_w, b"".join(_CHUNK_NUMBER.pack(chunk) for chunk in range(num_chunks)))
            self._fds.remove(queue_w)  # before closing: a number closed twice may by then be another file's
            os.close(queue_w)  # every reader sees the end once the numbers are taken
            self._done_r, self.done_w = self._pipe()
        except BaseException:
            self.__exit__()
            raise
        self.directory = Path(self._tmp.name)
        os.set_blocking(self._done_r, False)  # the parent drains it between chunks, never waiting there
        self._done = select.poll()  # not select.select: it refuses file descriptors past 1023
        self._done.register(self._done_r, select.POLLIN)
        self._unread = b""

    def _pipe(self) -> tuple[int, int]:
        read, write = os.pipe()
        self._fds += [read, write]
        return read, write

    def __enter__(self) -> "_Chunks":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._tmp.cleanup()

    def take(self) -> Optional[int]:
        data = os.read(self._queue_r, _CHUNK_NUMBER.size)
        return _CHUNK_NUMBER.unpack(data)[0] if len(data) == _CHUNK_NUMBER.size else None

    def result_path(self, chunk: int) -> Path:
        return self.directory / f"chunk-{chunk}.pickle"

    def claims_path(self, number: int) -> Path:
        return self.directory / f"taken-by-{number}"

    def taken_by(self, number: int) -> set[int]:
        try:
            data = self.claims_path(number).read_bytes()
        except OSError:
            return set()
        return {value for (value,) in _CHUNK_NUMBER.iter_unpack(data[:len(data) - len(data) % _CHUNK_NUMBER.size])}

    def ready(self, wait: bool) -> list[int]:
        """Chunks whose results file a child finished since the last call; ``wait``: for up to ``_WAIT_MS`` if
        none did."""
        if wait:
            self._done.poll(_WAIT_MS)
        try:
            while data := os.read(self._done_r, 4096):
                self._unread += data
        except BlockingIOError:
            pass
        whole = len(self._unread) - len(self._unread) % _CHUNK_NUMBER.size
        numbers, self._unread = self._unread[:whole], self._unread[whole:]
        return [value for (value,) in _CHUNK_NUMBER.iter_unpack(numbers)]


@contextlib.contextmanager
def _sigint_held() -> Iterator[set]:
    """Ctrl+C (SIGINT, sent to the whole process group) held back for the block, which gets the signal mask it
    replaced: it is raised once the block has recorded what it forked or reaped, never between a fork or a wait
    and that record."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _fork_child(fn: Callable[[T], R], items: Sequence[T], chunks: list[range], shared: _Chunks,
                number: int, parent: int, mask: set) -> Optional[int]:
    """The child's pid (None when it could not be forked); the child itself never returns. Called with SIGINT
    held (``_sigint_held``): the child's KeyboardInterrupt is raised inside its own try, never unwinding into the
    parent's code, its exit handlers and its cleanup."""
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
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        claims = os.open(shared.claims_path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        # A child whose parent is gone stops: nobody would read what it computes.
        while os.getppid() == parent and (chunk := shared.take()) is not None:
            os.write(claims, _CHUNK_NUMBER.pack(chunk))  # before computing it: from here a death leaves it to the parent
            values = [fn(items[index]) for index in chunks[chunk]]
            path = shared.result_path(chunk)
            partial = path.with_suffix(".partial")
            with open(partial, "wb") as handle:
                pickle.dump(values, handle, protocol=pickle.HIGHEST_PROTOCOL)
            partial.rename(path)  # complete or absent: a killed child never leaves half a result
            os.write(shared.done_w, _CHUNK_NUMBER.pack(chunk))  # 4 bytes: one atomic write on a pipe
        code = 0
    except BaseException:  # noqa: BLE001 - the parent computes the chunk again and raises what fn raises
        code = 1
    finally:
        os._exit(code)


def _reap_exited(children: dict[int, int]) -> list[int]:
    """The numbers of the children (number -> pid) that exited, reaped and removed from ``children``."""
    exited = []
    with _sigint_held():  # a pid reaped is never left in ``children`` to be killed later, when it may be reused
        for number, pid in list(children.items()):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                del children[number]
                exited.append(number)
    return exited


def _stop(children: dict[int, int]) -> None:
    """Kill and reap every child in ``children`` (number -> pid), removing each as it is reaped."""
    with _sigint_held():
        for number, pid in list(children.items()):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            del children[number]
