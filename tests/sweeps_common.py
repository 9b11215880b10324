"""Helpers shared by tests/sweep and tests/tracking (imported by name: tests/ is on sys.path via conftest)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from collections import defaultdict
from typing import Any

from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[1]
SMOKE_RECEIPTS = REPO / "tests" / "promote" / "assets" / "smoke_run" / "receipts"
SMOKE_ROUND = "smoke-20261122-180629-0b9e"
"""One round of the recorded smoke run (real receipts of a real sweep)."""


def tiny_smoke(directory: Path, steps: int = 4, name: str = "smoke", lane: dict[str, dict[str, Any]] | None = None,
               **overrides: Any) -> Path:
    """A tiny version of the smoke campaign (search_spaces/smoke.yaml): its defaults and resources, a small AEMR
    lane, two features with one block each, one A/A block and no bundle block, and a tiny step budget; ``lane``
    sections are merged into the lane (``{"engine": {"workers": 2}}``), other keyword arguments replace top-level
    keys."""
    yaml = YAML()
    data = yaml.load((REPO / "search_spaces" / "smoke.yaml").read_text())
    data["name"] = name
    data["lane"] = {"model": {"pattern": "AEMR", "d_model": 64, "n_heads": 4, "n_experts": 4, "top_k": 2,
                              "d_expert": 64, "ssm_chunk": 16},
                    "batch": {"micro_batch": 2, "seq_len": 64},
                    "budget": {"steps": steps, "family_sample_steps": 2, "min_steady_steps": 2},
                    "compile": {"warmup_steps": 1}}
    data["features"] = {"moe_dispatch": ["jagged"], "mamba_scan": ["chunked"]}
    data["blocks"], data["aa_blocks"], data["bundle_blocks"] = 1, 1, 0
    for section, values in (lane or {}).items():
        data["lane"].setdefault(section, {}).update(values)
    data.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "defaults.yaml").write_text((REPO / "search_spaces" / "defaults.yaml").read_text())
    path = directory / f"{name}.yaml"
    with path.open("w") as handle:
        yaml.dump(data, handle)
    return path


def start_mlflow_server(backend: Path, artifacts: Path, log: Path, port: int | None = None
                        ) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``mlflow server`` on loopback (SQLite backend, artifacts served from ``artifacts``), answering HTTP;
    returns the process (its own session: ``stop_mlflow_server`` ends every worker) and its URL."""
    port = port or closed_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{backend}",
               "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    # No job-execution runner (MLflow's huey consumer for GenAI scorer jobs, a second process importing MLflow
    # beside the server's): nothing here submits jobs, and on 2 cores it costs 2-4 s of every start.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            # Ready = answers HTTP: on a loaded host the port accepts well before the app serves, and a sweep
            # started then (no retries) would find MLflow unreachable from its first call.
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    stop_mlflow_server(server)
    raise AssertionError("mlflow server did not start")


def stop_mlflow_server(server: subprocess.Popen[bytes]) -> None:
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_TEMPLATES = Path(tempfile.mkdtemp(prefix="ablate-test-store-template-"))
"""Where this test process keeps its store template, whatever cache a test points ablate at (or turns off)."""
atexit.register(shutil.rmtree, _TEMPLATES, True)


def fresh_mlflow_uri(directory: Path) -> str:
    """A new, empty MLflow SQLite store in ``directory``, made as a sweep makes one: copied from this test process's
    template (``ablate.tracking.store_template``), so MLflow's migrations run once per process, not per store."""
    from ablate.tracking.store_template import seed_sqlite_store

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "mlflow.db"
    target.unlink(missing_ok=True)
    uri = f"sqlite:///{target}"
    assert seed_sqlite_store(uri, _TEMPLATES), f"no store template could be kept in {_TEMPLATES}"
    return uri


def log_campaign(uri: str, receipts: list[Any]) -> tuple[Any, dict[str, str]]:
    """Log receipts as the sweep driver does (a parent run per sweep, an arm run each) into experiment "ablate";
    (the tracking client, sweep id -> parent run id)."""
    from ablate.tracking.mlflow_store import TrackingClient

    client = TrackingClient(uri, "ablate")
    parents: dict[str, str] = {}
    for receipt in receipts:
        sweep = receipt.identity.sweep_id
        if sweep not in parents:
            parents[sweep] = client.parent_run(sweep, receipt.identity.campaign)[0]
        client.log_receipt(receipt, parents[sweep])
    return client, parents


def by_block(receipts: list[Any]) -> dict[str, list[Any]]:
    blocks: dict[str, list[Any]] = defaultdict(list)
    for receipt in receipts:
        blocks[receipt.identity.block_id].append(receipt)
    return blocks



def smoke_round(directory: Path, feature: str = "moe_dispatch", sweep_id: str = SMOKE_ROUND) -> Path:
    """A sweep directory holding one recorded smoke round's receipts of ``feature`` (four blocks, eight arms):
    a real campaign's evidence that syncs into MLflow in seconds."""
    import json
    import shutil

    receipts = directory / "receipts"
    receipts.mkdir(parents=True, exist_ok=True)
    for path in sorted(SMOKE_RECEIPTS.glob("*.json")):
        identity = json.loads(path.read_text())["identity"]
        if identity["sweep_id"] == sweep_id and identity["feature"] == feature:
            shutil.copy(path, receipts / path.name)
    return directory
