"""What every benchmark record says about its host, and the append-only results file it goes to."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
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


def append(path: Path, record: dict[str, Any]) -> None:
    """Add ``record`` to ``{"runs": [...]}`` in ``path``: every run is kept, none is overwritten."""
    history = json.loads(path.read_text())["runs"] if path.exists() else []
    path.write_text(json.dumps({"runs": [*history, record]}, indent=1) + "\n")
    print(f"appended to {path}")
