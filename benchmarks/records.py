"""What every benchmark record says about its host, and the append-only results file it goes to."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def host(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """Platform, CPUs, load average before and now, and the thread settings the run saw."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load_before,
            "load_after": os.getloadavg(),
            "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}


def append(path: Path, record: dict[str, Any]) -> None:
    """Add ``record`` to ``{"runs": [...]}`` in ``path``: every run is kept, none is overwritten."""
    history = json.loads(path.read_text())["runs"] if path.exists() else []
    path.write_text(json.dumps({"runs": [*history, record]}, indent=1) + "\n")
    print(f"appended to {path}")
