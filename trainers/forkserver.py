"""Warm, still isolated arm processes: a per-node fork server that imported torch and the arm code, and nothing
else, forks one fresh child per arm.

How to use (``trainers.run`` does this for every one-worker arm and every rank of a multi-worker CPU arm)::

    proc = fork_arm(base_env, overlay_env, [spec, result, attempt], log_path, code="<fingerprint>")
    code = proc.wait(timeout=600)        # Popen-like: pid, poll(), wait(), kill(), returncode
    proc.prepared                        # what the receipt records: how this process was prepared

Why: a fresh ``python -m trainers.worker`` pays 2-4 s of imports (torch alone ~2 s) on the critical path of
every arm. The server pays them once per sweep and node; a fork costs milliseconds.

What keeps arms isolated: the server only *imports* (``PRELOAD``, and dynamo on a CPU build of torch), and types
one default lane and reads package versions (``_prepare_for_children``: plain data). It never builds a model, runs
an op, compiles, starts an OpenMP pool or touches CUDA (so no compile cache, allocator or kernel state exists to
inherit, and inductor and triton read the arm's private cache directories from the arm's own environment when they
first use them). Each arm is a new child of that pristine image, so whatever one arm changes (module state, caches,
threads) dies with its process and is never seen by the next.
``tests/trainers/test_forkserver.py`` checks both.

What a child gets is what ``subprocess.Popen`` in ``trainers.run`` would have given it: exactly the arm's
environment (``os.environ`` replaced before any arm code runs), the repository as working directory, the caller's
CPU affinity, stdout/stderr into the arm's log, stdin from /dev/null, and a passed descriptor (the pairing socket)
under the name the arm expects.
Settings a library reads once at import (OpenMP, BLAS) come from the server's own environment, so a server is
keyed by the arm's environment minus its per-arm entries, the interpreter and the code fingerprint: an arm never
runs in a server started for another environment or other code.

Lifetime: started on demand by the first arm that needs it (under a lock, so one per key), in its own session
so a trial's end does not take it down; it exits after ``IDLE_S`` without a child or a request, or when its
socket is removed. A requester that goes away takes its child with it. If the server cannot start, the arm
falls back to a fresh interpreter and the receipt says so (``prepared: fresh_interpreter`` with the reason).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "trainers.loop", "trainers.pairing", "trainers.result", "trainers.spec", "trainers.hostload",
           "ablate.config.load", "trainers.model", "trainers.model.flops", "kernels.dispatch", "ablate.config.pattern",
           "trainers.host_malloc", "psutil")
"""Imports only: none of them runs an op or starts a thread pool at import time. ``trainers.worker`` itself is not
preloaded: it runs as ``__main__`` in the child, as ``python -m`` would. ``ablate.config.load`` (OmegaConf, the
lane schema) is what ``ArmSpec.from_json`` imports first thing in every arm: 0.08-0.1 s of each arm's start
otherwise (measured in the forked child, 2 CPUs). The model, its FLOP count and the kernel registry
(``trainers.loop.run_worker``'s next imports; the kernels register their custom ops, which touches no device)
were another 0.05 s of every arm's start-up. ``trainers.host_malloc`` (ctypes) and psutil (the host-load probe's
first read) were the last imports an arm made on its own. psutil keeps the server's CPU times as its
``cpu_percent`` baseline: no arm code calls that (the host-load probe reads ``cpu_times``)."""
PRELOAD_CPU_BUILD = ("torch._dynamo",)
"""Also preloaded where torch was built without CUDA/ROCm: every arm imports dynamo before its features are read
(``trainers.loop``'s compile watch, ~1.5-2 s on 2 CPUs). It imports ``torch._inductor.config`` and triton, whose
cache directories are read when used, not at import (``cache_dir_utils.cache_dir``, ``triton.knobs``), so each
arm still compiles into its own empty caches (``tests/trainers/test_forkserver.py`` checks this). Left out on
GPU builds: a module that probes the driver at import (``cuInit``) would leave every forked child with a CUDA
that cannot initialise, and no GPU run has verified that none does."""
NEVER_PRELOADED = ("deepspeed", "ray")
"""Read their accelerator and launcher environment at import: the server refuses to start with one loaded. Ray's
per-worker variables (``RAY_*``) key no server (``trainers.run.LAUNCHER_ENV_PREFIXES``) only because none of them
can reach the server's state."""
WORKER_MODULE = "trainers.worker"
IDLE_S = 180.0
"""Long enough to bridge the gap between blocks (and a round gap of a short until-decided campaign)."""
START_TIMEOUT_S = 120.0
_HEADER = struct.Struct("!I")


@dataclass
class Prepared:
    """How an arm's process was prepared; the receipt records it (``identity.process``)."""

    how: str
    """fork_server (forked from a server that had imported torch and the arm code) or fresh_interpreter."""
    server_pid: Optional[int] = None
    server_started_at: Optional[float] = None
    forks_before: Optional[int] = None
    """Arms the server had forked before this one (0: this arm's request also started the server)."""
    request_s: Optional[float] = None
    """Request sent -> child's pid back (server start-up included when this request started it)."""
    fallback_reason: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class ForkServerUnavailable(RuntimeError):
    """The server could not be started or reached; the caller runs a fresh interpreter instead."""


# --- client -------------------------------------------------------------------------------------------------------

def _source_stamp() -> list[tuple[str, int, int]]:
    """Every Python source the arm code can import, by mtime and size: an edit (even one the content
    fingerprint of kernels/ and trainers/ does not cover, under ablate/) retires the server that imported the old
    version."""
    stamp = []
    for package in ("ablate", "trainers", "kernels"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            try:
                stat = path.stat()
            except OSError:  # an editor's lock file (a dangling symlink), a file deleted mid-scan: not importable
                continue
            stamp.append((str(path.relative_to(REPO_ROOT)), stat.st_mtime_ns, stat.st_size))
    return sorted(stamp)


def _packages_stamp(base_env: dict[str, str]) -> list[tuple[str, str, int]]:
    """Where the server's interpreter finds installed distributions (its site directories and the environment's
    ``PYTHONPATH``), as ``packages_stamp`` sees them: an install there retires the server that imported the old
    packages, and whose children report the versions it read (``read_installed_versions_for_children``)."""
    import site

    from trainers.provenance import packages_stamp

    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    return packages_stamp([*base_env.get("PYTHONPATH", "").split(os.pathsep), *site.getsitepackages(),
                           *([user] if isinstance(user, str) else [])])


def server_key(base_env: dict[str, str], code: Optional[str]) -> str:
    material = json.dumps({"python": sys.executable, "env": sorted(base_env.items()), "code": code,
                           "repo": str(REPO_ROOT), "sources": _source_stamp(), "packages": _packages_stamp(base_env)})
    return hashlib.sha256(material.encode()).hexdigest()[:20]


def server_directory() -> Path:
    """Where this user's fork servers listen (``TMPDIR`` or /tmp), created private if missing."""
    # Private to this user (0700): the socket runs arbitrary argv in a process that carries our environment.
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"ablate-forkserver-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.lstat()  # lstat: a symlink planted by someone else is not our directory
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ForkServerUnavailable(f"{directory} is not private to this user")
    return directory


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def _ensure_server(base_env: dict[str, str], key: str, directory: Optional[Path] = None) -> socket.socket:
    return _server_socket(base_env, key, directory)[0]


def _server_socket(base_env: dict[str, str], key: str, directory: Optional[Path] = None
                   ) -> tuple[socket.socket, bool]:
    """A connection to the server for ``key``, and whether this call launched that server (False when one listened,
    or another caller launched it while this one waited for the lock)."""
    directory = directory or server_directory()
    path = directory / f"{key}.sock"
    try:
        return _connect(path), False
    except OSError:
        pass
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent arms on the node start one server, not two
        try:
            return _connect(path), False
        except OSError:
            path.unlink(missing_ok=True)
        log_path, pid_path = directory / f"{key}.log", directory / f"{key}.pid"
        pid_path.unlink(missing_ok=True)
        with open(log_path, "ab") as log:
            # The launcher forks the server and exits at once: the server is nobody's child, so Ray's clean-up of
            # a trial worker's direct children (RAY_kill_child_processes_on_worker_exit, on by default) does not
            # take it down with the trial that happened to start it while other trials' arms still run from it.
            subprocess.run([sys.executable, "-m", "trainers.forkserver", str(path), str(IDLE_S), str(pid_path)],
                           cwd=REPO_ROOT, env=base_env, stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True, check=True, timeout=START_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return _connect(path), True
            except OSError:
                pass
            if not _running(pid_path):
                tail = log_path.read_text(errors="replace")[-1500:]
                raise ForkServerUnavailable(f"fork server exited while starting: {tail}")
            time.sleep(0.01)
        raise ForkServerUnavailable(f"fork server did not listen within {START_TIMEOUT_S:.0f}s")


def _running(pid_path: Path) -> bool:
    try:
        os.kill(int(pid_path.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def _send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(message).encode()
    header = _HEADER.pack(len(body))
    if fds:  # ancillary descriptors ride on the first bytes of the stream: the receiver gets them with the header
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(body)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class ArmProcess:
    """A forked arm process, driven like ``subprocess.Popen``: its exit status comes back over the request's
    connection (the server is its parent and reaps it)."""

    def __init__(self, sock: socket.socket, pid: int, prepared: Prepared) -> None:
        self._sock = sock
        self._buffer = b""
        self.pid = pid
        self.prepared = prepared
        self.returncode: Optional[int] = None

    def _read_exit(self, timeout: Optional[float]) -> Optional[int]:
        self._sock.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                chunk = self._sock.recv(4096)
                if not chunk:
                    # The server died under us: its child is an orphan now; kill it so nothing runs unaccounted.
                    self._kill_pid()
                    self.returncode = -signal.SIGKILL
                    return self.returncode
                self._buffer += chunk
        except (socket.timeout, BlockingIOError):
            return None
        line = self._buffer.split(b"\n", 1)[0]
        self.returncode = int(json.loads(line)["exit"])
        self._sock.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self.returncode if self.returncode is not None else self._read_exit(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is not None:
            return self.returncode
        code = self._read_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(WORKER_MODULE, timeout or 0.0)
        return code

    def _kill_pid(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        if self.returncode is None:
            self._kill_pid()


def prestart(base_env: dict[str, str], code: Optional[str], directory: Optional[Path] = None) -> bool:
    """Start the server an arm with ``base_env`` and ``code`` will fork from, if none listens yet, and return once
    it listens; True when this call started it. Its imports then overlap the sweep's own start instead of the first
    arms' (``ablate.sweep.run`` asks before Ray on a local runtime, else each node as soon as Ray is up). An arm
    still forks from a server that has run nothing: the check that it listens is a connection closed before any
    request. False when one listened already (this sweep's earlier round, or another sweep's arms with the same
    environment and code) or another caller started it while this one waited for the lock (the driver's start
    before Ray, an arm). ``directory``: the servers' directory (``server_directory``), when the caller found it
    before another thread may change ``TMPDIR``.

    Raises ForkServerUnavailable, as ``fork_arm`` does."""
    try:
        sock, launched = _server_socket(base_env, server_key(base_env, code), directory)
        sock.close()
    except ForkServerUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - as fork_arm: any failure to get a server is "unavailable"
        raise ForkServerUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return launched


def fork_arm(base_env: dict[str, str], overlay: dict[str, str], argv: list[str], log_path: Path, *,
             code: Optional[str], module: str = WORKER_MODULE, pass_fd: Optional[tuple[str, int]] = None,
             ) -> ArmProcess:
    """Fork ``python -m <module> <argv>`` from the server for ``base_env`` (started if needed). The child's
    environment is ``base_env`` plus ``overlay`` (and ``pass_fd``'s name bound to the passed descriptor).

    Raises ForkServerUnavailable when no server can be had; nothing has run then.
    """
    try:
        return _fork_arm(base_env, overlay, argv, log_path, code=code, module=module, pass_fd=pass_fd)
    except ForkServerUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to get a forked process ends in the fresh-interpreter path
        raise ForkServerUnavailable(f"{type(exc).__name__}: {exc}") from exc


def _fork_arm(base_env: dict[str, str], overlay: dict[str, str], argv: list[str], log_path: Path, *,
              code: Optional[str], module: str, pass_fd: Optional[tuple[str, int]]) -> ArmProcess:
    asked = time.perf_counter()
    key = server_key(base_env, code)
    request = {"module": module, "argv": argv, "env": {**base_env, **overlay}, "cwd": str(REPO_ROOT),
               "log": str(log_path), "affinity": sorted(os.sched_getaffinity(0)),
               "fd_env": pass_fd[0] if pass_fd else None}
    # A server that idled out just as we connected closes our connection unanswered: the second try starts a
    # new one.
    for tries_left in (1, 0):
        sock = _ensure_server(base_env, key)
        try:
            _send(sock, request, (pass_fd[1],) if pass_fd else ())
            sock.settimeout(START_TIMEOUT_S)
            buffer = b""
            while b"\n" not in buffer:
                chunk = sock.recv(4096)
                if not chunk:
                    raise ConnectionError("fork server closed the connection before forking")
                buffer += chunk
            break
        except (OSError, ValueError) as exc:
            sock.close()
            if not tries_left:
                raise ForkServerUnavailable(f"fork server request failed: {exc}") from exc
    line, rest = buffer.split(b"\n", 1)
    reply = json.loads(line)
    prepared = Prepared("fork_server", server_pid=reply["server_pid"], server_started_at=reply["server_started_at"],
                        forks_before=reply["forks_before"], request_s=round(time.perf_counter() - asked, 4))
    proc = ArmProcess(sock, int(reply["pid"]), prepared)
    proc._buffer = rest
    return proc


# --- server -------------------------------------------------------------------------------------------------------

@dataclass
class _Server:
    path: Path
    idle_s: float
    listener: socket.socket = field(init=False)
    started_at: float = field(default_factory=time.time)
    forks: int = 0
    children: dict[int, socket.socket] = field(default_factory=dict)

    def _inode(self) -> Optional[int]:
        try:
            return self.path.stat().st_ino
        except OSError:
            return None

    def serve(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(16)
        own_inode = self._inode()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd is what matters: reap promptly
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, "accept")
        selector.register(wake_r, selectors.EVENT_READ, "wake")
        last_active = time.monotonic()
        while True:
            for key, _ in selector.select(timeout=1.0):
                if key.data == "accept":
                    conn, _ = self.listener.accept()
                    self._handle(conn, selector, (self.listener, selector, wake_r, wake_w))
                    last_active = time.monotonic()  # a head start's ping too: its arms are about to ask
                elif key.data == "wake":
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                else:  # a requester's connection: readable only when it went away
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    try:
                        gone = conn.recv(1) == b""
                    except OSError:
                        gone = True
                    if gone:
                        selector.unregister(conn)
                        try:
                            os.kill(key.data, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            self._reap(selector)
            if self.children:
                last_active = time.monotonic()
            elif time.monotonic() - last_active > self.idle_s or self._inode() != own_inode:
                if self._inode() == own_inode:
                    self.path.unlink(missing_ok=True)
                return

    def _reap(self, selector: selectors.BaseSelector) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            try:
                selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()

    def _handle(self, conn: socket.socket, selector: selectors.BaseSelector, close_in_child: tuple[Any, ...]) -> None:
        conn.settimeout(10.0)
        try:
            header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 1)
            if not header and not fds:  # closed before any request: ``prestart`` checking that this server listens
                conn.close()
                return
            if len(header) < _HEADER.size:
                header += _recv_exact(conn, _HEADER.size - len(header))
            request = json.loads(_recv_exact(conn, _HEADER.unpack(header)[0]))
        except (OSError, ValueError, ConnectionError) as exc:
            print(f"forkserver: bad request: {exc}", file=sys.stderr, flush=True)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_arm(request, fds, conn, (*close_in_child, *self.children.values()))
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        try:
            conn.sendall(json.dumps({"pid": pid, "server_pid": os.getpid(), "server_started_at": self.started_at,
                                     "forks_before": self.forks}).encode() + b"\n")
        except OSError:
            os.kill(pid, signal.SIGKILL)
        self.forks += 1
        self.children[pid] = conn
        selector.register(conn, selectors.EVENT_READ, pid)


def _become_arm(request: dict[str, Any], fds: list[int], conn: socket.socket, close: tuple[Any, ...]) -> None:
    """In the forked child: turn into ``python -m <module> <argv>`` as Popen would have started it. Never returns."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        listener, selector, wake_r, wake_w, *siblings = close
        selector.close()
        listener.close()
        conn.close()
        os.close(wake_r)
        os.close(wake_w)
        for sibling in siblings:  # other arms' connections: an arm holds nothing of another arm
            sibling.close()
        env = dict(request["env"])
        if request.get("fd_env") and fds:
            env[request["fd_env"]] = str(fds[0])
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        try:
            os.sched_setaffinity(0, set(request["affinity"]))  # what a Popen child of the caller would inherit
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        import runpy

        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the arm's own crash: its log says why, its exit status says failed
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def _prepare_for_children() -> None:
    """The first uses every arm makes of two pure-Python facilities before its features are read, made once here:
    typing a lane (OmegaConf builds the lane schema and warms its own caches on its first merge: ~13 ms in a fresh
    process, ~5 ms after) and reading the installed packages' versions
    (``trainers.provenance.read_installed_versions_for_children``). Plain data: no op, thread, device or file an arm
    could see. The arms' start-up (fork request to features read, a block's two arms at once on one CPU), medians of
    the 36 arms of a smoke campaign, three campaigns each, alternating: 0.118, 0.117 and 0.127 s before this and the
    last two preloads, 0.091, 0.080 and 0.099 s after (stop 57)."""
    from ablate.config.load import lane_to_dict, load_lane
    from ablate.config.schema import LaneConfig
    from trainers.provenance import read_installed_versions_for_children

    load_lane(lane_to_dict(LaneConfig()))
    read_installed_versions_for_children()


def main(argv: list[str]) -> int:
    path, idle_s, pid_path = Path(argv[0]), float(argv[1]), Path(argv[2])
    child = os.fork()
    if child:  # the launcher: records the server's pid before its caller, waiting for this exit, looks for it
        pid_path.with_suffix(".tmp").write_text(str(child))
        os.replace(pid_path.with_suffix(".tmp"), pid_path)
        os._exit(0)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        for name in PRELOAD_CPU_BUILD:
            importlib.import_module(name)
    _prepare_for_children()
    loaded = [name for name in NEVER_PRELOADED if name in sys.modules]
    if loaded:
        print(f"forkserver: refusing to serve, import-time state of {loaded} would be shared", file=sys.stderr)
        return 3
    if torch.cuda.is_initialized():  # a CUDA context does not survive fork: every child would inherit a broken one
        print("forkserver: refusing to serve, CUDA was initialised by an import", file=sys.stderr)
        return 3
    _Server(path, idle_s).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
