"""What every benchmark record says about its host, and the append-only results file it goes to."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def host(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """Platform, CPUs, load average before and now, and the thread settings the run saw."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load_before,
            "load_after": os.getloadavg(),
            "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}


def compile_tree(tree: Path, packages: tuple[str, ...] = ("ablate", "kernels", "trainers")) -> dict[str, Any]:
    """Write the bytecode of ``tree``'s packages before any timed run, and say so in the record. A tree unpacked from
    ``git archive`` has none, and where PYTHONDONTWRITEBYTECODE is set (this sandbox sets it) every process of that
    tree compiles the project from source again (~0.1 s an interpreter), which a tree with ``__pycache__`` skips: a
    comparison of two trees timed that cost on one side only."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(tree / name) for name in packages
                                                                if (tree / name).is_dir())], check=True,
                   stdout=subprocess.DEVNULL)
    return {"bytecode": "compiled before timing (compileall)",
            "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}


def stop_fork_servers(timeout_s: float = 10.0) -> int:
    """Stop every fork server of this user (``python -m trainers.forkserver``, of any tree) before a timed run, so
    each run starts its own, cold. A server idles 180 s before it exits: a run within that time of an earlier run of
    the same tree (same key) found it listening and paid no imports, a head start no user gets on a first sweep.
    Arms forked from a server keep its command line, so this stops any arm still running too: run benchmarks alone
    (as they must be for their timings anyway). Returns how many were stopped."""
    pids = _fork_servers()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and set(pids) & set(_fork_servers()):
        time.sleep(0.05)
    for pid in set(pids) & set(_fork_servers()):  # one that ignored SIGTERM (looked up again: no reused pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _fork_servers() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            owner = entry.stat().st_uid
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if owner == os.getuid() and not zombie and b"trainers.forkserver" in argv and b"-m" in argv:
            pids.append(int(entry.name))
    return pids


def timed_sweep(tree: Path, campaign: Path, run_dir: Path) -> dict[str, Any]:
    """``python -m ablate sweep <campaign>`` with ``tree``'s code, in ``run_dir`` (local Ray, MLflow in that
    directory's sqlite store), timed as a user waits for it; every fork server stopped first, so it starts its own,
    cold. Its output goes to ``run_dir/sweep.log``. Returns exit status, wall seconds, the load average before, how
    many servers were stopped, and the receipts it wrote (parsed)."""
    stopped = stop_fork_servers()
    load = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ablate", "sweep", str(campaign), "--no-progress",
                           "--tracking-uri", f"sqlite:///{run_dir}/mlflow.db"], cwd=run_dir,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (run_dir / "sweep.log").write_text(proc.stdout + proc.stderr)
    return {"exit": proc.returncode, "wall_s": wall, "load_before": load, "fork_servers_stopped_before": stopped,
            "receipts": [json.loads(p.read_text()) for p in run_dir.glob("ablate_runs/*/receipts/*.json")]}


def append(path: Path, record: dict[str, Any]) -> None:
    """Add ``record`` to ``{"runs": [...]}`` in ``path``: every run is kept, none is overwritten."""
    history = json.loads(path.read_text())["runs"] if path.exists() else []
    path.write_text(json.dumps({"runs": [*history, record]}, indent=1) + "\n")
    print(f"appended to {path}")
