"""The fork server hands every arm a process of its own that ran nothing before it, with the arm's own environment,
and real arms forked from it leave receipts that say so."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ablate.receipts.schema import Status, validate_receipt
from trainer_helpers import make_spec, tiny_lane
from trainers.forkserver import ForkServerUnavailable, fork_arm, prestart, server_directory, server_key
from trainers.run import _arm_env, _worker_env, run_arm, run_pair

PROBE = "tests.trainers.forkserver_probe"
REPO = Path(__file__).resolve().parents[2]
SHARED = str(time.time())
"""Tests that do not count forks share one server."""


def _base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = _arm_env(tmp_path)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name)
    return {**env, **extra}


def _probe(tmp_path: Path, name: str, base: dict[str, str], *args: str, **overlay: str):  # noqa: ANN202
    out = tmp_path / f"{name}.json"
    proc = fork_arm(base, overlay, [str(out), *args], tmp_path / f"{name}.log", code="test", module=PROBE)
    return proc, out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_each_fork_is_a_new_process_that_inherits_no_state_from_the_last(tmp_path: Path) -> None:
    base = _base_env(tmp_path, ABLATE_PROBE_KEY=str(time.time()))
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "one-inductor"),
              "TRITON_CACHE_DIR": str(tmp_path / "one-triton")}
    first, first_out = _probe(tmp_path, "first", base, PROBE_ARM="one", **caches)
    assert first.wait(timeout=120) == 0
    second, second_out = _probe(tmp_path, "second", base, PROBE_ARM="two")
    assert second.wait(timeout=60) == 0
    one, two = json.loads(first_out.read_text()), json.loads(second_out.read_text())
    # Two arms, two processes, neither the caller nor the server; both children of one warm server.
    assert len({one["pid"], two["pid"], os.getpid(), first.prepared.server_pid}) == 4
    assert one["ppid"] == two["ppid"] == first.prepared.server_pid == second.prepared.server_pid
    assert (first.prepared.forks_before, second.prepared.forks_before) == (0, 1)
    # The first arm's module-level change died with its process.
    assert one["seen_mark"] is None and two["seen_mark"] is None
    # Imports were paid by the server (dynamo too on a CPU build of torch), DeepSpeed's never.
    import torch

    cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    assert two["preloaded"] == {"torch": True, "trainers.loop": True, "torch._dynamo": cpu_build,
                                "deepspeed": False, "ablate.config.load": True, "psutil": True,
                                "trainers.host_malloc": True}
    # So were a lane's first typing and the package versions: what the server read is what the arm finds on disk,
    # and the arm still probes torch's build itself.
    prepared = two["prepared"]
    assert prepared["lane_schema_built"] is True
    assert prepared["versions_read_by_server"][1] == prepared["versions_read_here"]
    assert {k: v for k, v in prepared["software_versions"].items() if k in prepared["versions_read_here"]} \
        == prepared["versions_read_here"]
    assert prepared["software_versions"]["torch.git"] == torch.version.git_version
    # Inductor and triton, preloaded or not, compile into this arm's own empty cache directories.
    assert one["caches"] == {"inductor": caches["TORCHINDUCTOR_CACHE_DIR"], "triton": caches["TRITON_CACHE_DIR"]}
    # Exactly the arm's environment, as Popen would give it, and the caller's cwd and affinity.
    assert one["env"] == {**base, "PROBE_ARM": "one", **caches} and two["env"]["PROBE_ARM"] == "two"
    assert one["cwd"] == str(REPO) and one["affinity"] == sorted(os.sched_getaffinity(0))
    assert "probe wrote" in (tmp_path / "first.log").read_text()


def test_an_install_on_the_arms_path_retires_the_server_and_its_versions(tmp_path: Path) -> None:
    """A server's children report the package versions it read after its imports; a distribution installed on their
    import path since would run (or, for what the server imported, be read) differently. So the install retires the
    server: the next arm forks from a new one, and reports the new version."""
    site = tmp_path / "site"
    site.mkdir()
    base = _base_env(tmp_path, ABLATE_PROBE_KEY=str(time.time()))
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), base.get("PYTHONPATH", "")) if p)
    first, first_out = _probe(tmp_path, "before", base)
    assert first.wait(timeout=120) == 0
    again, _ = _probe(tmp_path, "again", base)
    assert again.wait(timeout=60) == 0
    assert again.prepared.server_pid == first.prepared.server_pid  # nothing installed: the same server
    dist = site / "nvidia_late_cu99-9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-late-cu99\nVersion: 9.9\n")
    after, after_out = _probe(tmp_path, "after", base)
    assert after.wait(timeout=120) == 0
    assert after.prepared.server_pid != first.prepared.server_pid
    before, now = (json.loads(out.read_text())["prepared"] for out in (first_out, after_out))
    assert "nvidia-late-cu99" not in before["software_versions"]
    assert now["versions_read_by_server"][1]["nvidia-late-cu99"] == "9.9"
    assert now["software_versions"]["nvidia-late-cu99"] == "9.9"


def test_what_the_server_prepares_for_its_children_imports_no_torch() -> None:
    # A server only imports torch and the arm code; its preparation must not be where a CUDA probe (cuInit, which no
    # forked child survives) or anything else of torch's could run.
    code = ("import sys; from trainers.forkserver import _prepare_for_children; _prepare_for_children(); "
            "from trainers import provenance; assert provenance._READ_BY_PARENT is not None; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_head_start_is_the_server_the_next_arm_forks_from(tmp_path: Path) -> None:
    """``prestart`` (a sweep's head start) leaves a listening server that has forked nothing: the first arm is its
    first child, and the check that it listens is no request (nothing forked, nothing in its log)."""
    base = _base_env(tmp_path, ABLATE_PROBE_KEY=str(time.time()))
    assert prestart(base, "test") is True
    assert prestart(base, "test") is False, "already listening: not a second server"
    before = time.time()
    proc, out = _probe(tmp_path, "after-head-start", base)
    assert proc.wait(timeout=60) == 0 and out.exists()
    assert proc.prepared.forks_before == 0 and proc.prepared.server_started_at < before
    assert proc.prepared.request_s < 10, "the server was listening: no import paid by this arm"
    log = (server_directory() / f"{server_key(base, 'test')}.log").read_text()
    assert "bad request" not in log and "forkserver:" not in log


def test_variables_of_one_arm_or_of_tunes_trial_key_no_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a trial's own process holds (Tune's ``TUNE_ORIG_WORKING_DIR``, an allotment in the launcher's
    environment) still reaches the arm, but the server is keyed without it: a plain Ray task on the node (the head
    start) and every kind of arm find one server."""
    for name in [n for n in os.environ if n.startswith(("RAY_", "TUNE_"))] + ["PYTHONBREAKPOINT"]:
        monkeypatch.delenv(name, raising=False)
    plain = _worker_env(tmp_path / "a", {})[0]
    monkeypatch.setenv("TUNE_ORIG_WORKING_DIR", "/somewhere/the/driver/ran")
    monkeypatch.setenv("ABLATE_ARM_CPUS", "3")
    # What Ray sets in each of its workers: a driver that starts the server before Ray has none of it.
    ray_worker = {"RAY_RAYLET_PID": "4242", "RAY_JOB_ID": "01000000", "PYTHONBREAKPOINT": "ray.util.rpdb.set_trace"}
    for name, value in ray_worker.items():
        monkeypatch.setenv(name, value)
    for work, given in ((tmp_path / "a", {}), (tmp_path / "b", {"ABLATE_ARM_CPUS": "1", "ABLATE_PAIR_CPUS": "0"})):
        base, overlay = _worker_env(work, given)
        assert base == plain
        assert {**base, **overlay} == {**_arm_env(work), **given}, "the arm's environment is unchanged"
        assert overlay["TUNE_ORIG_WORKING_DIR"] == "/somewhere/the/driver/ran"
        assert overlay["ABLATE_ARM_CPUS"] == given.get("ABLATE_ARM_CPUS", "3")
        assert {name: overlay[name] for name in ray_worker} == ray_worker, "the arm still gets Ray's variables"
    # The environment given instead of this process's: what a driver predicts for its trials keys the same server.
    assert _worker_env(tmp_path / "a", {}, {**os.environ, "OMP_NUM_THREADS": "7"})[0] == {**plain,
                                                                                         "OMP_NUM_THREADS": "7"}


def test_a_server_that_imported_ray_refuses_to_serve(tmp_path: Path) -> None:
    """Ray's per-worker variables key no server only while nothing the server preloads imports ray (which reads
    them at import): a server that finds ray loaded after its preloads refuses, and arms fall back to fresh
    interpreters instead of sharing what ray read."""
    sock, pid = tmp_path / "s.sock", tmp_path / "s.pid"
    code = f"import ray, sys, trainers.forkserver as f\nsys.exit(f.main([{str(sock)!r}, '5', {str(pid)!r}]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**_arm_env(tmp_path)}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]  # the launcher: it forks the server and exits at once
    assert "forkserver: refusing to serve, import-time state of ['ray'] would be shared" in out.stderr, \
        out.stderr[-2000:]
    assert not sock.exists()


def test_a_preloaded_library_reaches_the_forked_arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's ``LD_PRELOAD`` (jemalloc, tcmalloc) is what its arms must train with, and their receipts name it:
    the arm's environment keeps it, the server it forks from is started with it (the loader reads it at exec, not at
    fork), so the arm's process has the library mapped; a server of another preload is another server."""
    import ctypes.util

    lib = ctypes.util.find_library("anl")  # glibc's libanl: installed with glibc, loaded by nothing of ours
    assert lib, "glibc's libanl.so.1 is missing"
    own = {Path(line.split()[-1]).name for line in Path("/proc/self/maps").read_text().splitlines()}
    assert not any(name.startswith("libanl") for name in own)
    monkeypatch.setenv("LD_PRELOAD", lib)
    base = _base_env(tmp_path, ABLATE_PROBE_KEY=str(time.time()))
    assert base["LD_PRELOAD"] == lib
    assert server_key(base, "test") != server_key({k: v for k, v in base.items() if k != "LD_PRELOAD"}, "test")
    proc, out = _probe(tmp_path, "preload", base)
    assert proc.wait(timeout=120) == 0
    probe = json.loads(out.read_text())
    assert probe["env"]["LD_PRELOAD"] == lib
    assert any(Path(path).name.startswith("libanl") for path in probe["mapped"])


def test_exit_status_timeout_kill_and_a_vanished_caller(tmp_path: Path) -> None:
    base = _base_env(tmp_path, ABLATE_PROBE_KEY=SHARED)
    failing, _ = _probe(tmp_path, "fails", base, "0", "7")
    assert failing.wait(timeout=120) == 7
    sleeper, out = _probe(tmp_path, "sleeps", base, "60")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.3)
    sleeper.kill()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    # A caller that goes away (a trial killed by Ray) takes its arm with it.
    orphan, out = _probe(tmp_path, "orphan", base, "60")
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    orphan._sock.close()
    deadline = time.monotonic() + 10
    while _alive(orphan.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(orphan.pid)


def test_a_server_is_never_shared_across_environments_or_code() -> None:
    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    assert server_key(env, "code-a") != server_key({**env, "OMP_NUM_THREADS": "2"}, "code-a")
    assert server_key(env, "code-a") != server_key(env, "code-b")
    assert server_key(env, "code-a") == server_key(dict(reversed(list(env.items()))), "code-a")


def test_a_source_edit_retires_the_server_that_imported_the_old_code() -> None:
    env = {"PATH": "/usr/bin"}
    source = Path(__file__).resolve().parents[2] / "ablate" / "redact.py"  # outside the content fingerprint
    before = source.stat()
    key = server_key(env, "code")
    try:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        assert server_key(env, "code") != key
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert server_key(env, "code") == key


def test_a_shared_server_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Anyone who can reach the socket can run code as us: a directory others can write is not used.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    shared = tmp_path / f"ablate-forkserver-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ForkServerUnavailable, match="not private"):
        fork_arm({"PATH": os.environ["PATH"]}, {}, [], tmp_path / "x.log", code="test", module=PROBE)


@pytest.mark.slow
def test_real_arms_are_forked_and_their_receipts_say_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ABLATE_PROBE_KEY", str(time.time()))  # a server of this test's own
    lane = tiny_lane()
    pairs = []
    for index in range(2):
        first = make_spec(lane, tmp_path, block_id=f"b{index}")
        second = type(first)(**{**first.__dict__, "arm_index": 1, "order": 1})
        pairs.append(run_pair((first, second)))
    receipts = [receipt for pair in pairs for receipt in pair]
    for receipt in receipts:
        validate_receipt(receipt)
        assert receipt.identity.status is Status.valid
        assert receipt.identity.process is not None and receipt.identity.process.how == "fork_server"
    servers = {r.identity.process.server_pid for r in receipts}  # type: ignore[union-attr]
    pids = [r.identity.pid for r in receipts]
    assert len(servers) == 1 and len(set(pids)) == 4 and not servers & set(pids) and os.getpid() not in pids
    # One warm server, four forks: each arm its own.
    assert len({r.identity.process.forks_before for r in receipts}) == 4  # type: ignore[union-attr]
    # The fresh-interpreter path is still there, and says so.
    fresh = run_arm(make_spec(lane, tmp_path, block_id="fresh"), fork_server=False)
    assert fresh.identity.status is Status.valid and fresh.identity.process is not None
    assert fresh.identity.process.how == "fresh_interpreter" and "fork_server=False" in str(
        fresh.identity.process.fallback_reason)


def test_a_passed_descriptor_reaches_the_arm_under_its_name(tmp_path: Path) -> None:
    base = _base_env(tmp_path, ABLATE_PROBE_KEY=SHARED)
    ours, theirs = socket.socketpair()
    out = tmp_path / "fd.json"
    proc = fork_arm(base, {}, [str(out)], tmp_path / "fd.log", code="test", module=PROBE,
                    pass_fd=("PROBE_FD", theirs.fileno()))
    theirs.close()
    assert proc.wait(timeout=120) == 0
    ours.settimeout(5)
    assert ours.recv(16) == b"probe"
    # The server closed its copy: once the arm exits, the caller sees end-of-stream (the turn coordinator
    # relies on this to know an arm finished).
    assert ours.recv(16) == b""
