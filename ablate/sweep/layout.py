"""Where a campaign's files live, locally and on shared storage.

``<storage>`` is ``--storage``, else the campaign's ``tracking.storage``, else ``<cwd>/ablate_runs``:

    <storage>/<campaign>/receipts/<receipt_id>.json   every arm's receipt (the source of truth)
    <storage>/<campaign>/spool.jsonl                   receipts MLflow has not taken yet (``ablate receipts sync``)
    <storage>/<campaign>/sweeps/<sweep_id>.json        what each sweep was: plan fingerprint, experiment, paths
    <storage>/<campaign>/LATEST                        the sweep id ``--resume`` continues
    <storage>/<campaign>/.sweep.lock                   held (flock) by the driver of the sweep running now
    <storage>/_tune/<campaign>/<sweep_id>/             Ray Tune's experiment (kept apart: its result.json files
                                                       are not receipts)

When ``<storage>`` is a URI (``s3://``, ``gs://``), the campaign directory is written on the driver under
``<cwd>/ablate_runs/<campaign>`` and every file is mirrored to ``<storage>/<campaign>/`` with pyarrow, so a sweep
submitted with ``ray job submit`` (whose working directory is temporary) loses nothing and can be resumed.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from ablate.receipts.store import atomic_write

LOCAL_ROOT = "ablate_runs"
TUNE_DIR = "_tune"
LATEST = "LATEST"
LOCK_FILE = ".sweep.lock"


def safe_name(name: str) -> str:
    """A campaign name usable as a directory, a Tune experiment name and an MLflow tag value."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "sweep"


def is_uri(path: str) -> bool:
    return "://" in path


@dataclass(frozen=True)
class Layout:
    campaign: str
    storage: str
    """Absolute local path or URI."""
    local_dir: Path
    """The campaign directory on the driver."""

    @classmethod
    def for_campaign(cls, campaign: str, storage: Optional[str], cwd: Optional[Path] = None) -> "Layout":
        cwd = (cwd or Path.cwd()).resolve()
        name = safe_name(campaign)
        root = storage or str(cwd / LOCAL_ROOT)
        if is_uri(root):
            return cls(campaign=name, storage=root.rstrip("/"), local_dir=cwd / LOCAL_ROOT / name)
        root_path = Path(root).expanduser()
        root_path = root_path if root_path.is_absolute() else (cwd / root_path)
        return cls(campaign=name, storage=str(root_path.resolve()), local_dir=root_path.resolve() / name)

    @property
    def remote(self) -> bool:
        return is_uri(self.storage)

    @property
    def receipts_dir(self) -> Path:
        return self.local_dir / "receipts"

    @property
    def tune_root(self) -> str:
        """Ray Tune ``storage_path``; the experiment ``name`` is the sweep id."""
        return f"{self.storage}/{TUNE_DIR}/{self.campaign}"

    def tune_path(self, sweep_id: str) -> str:
        return f"{self.tune_root}/{sweep_id}"

    def trial_receipt_dir(self) -> str:
        """Where trial processes write receipts: the campaign dir when it is on a (shared) filesystem, else a
        node-local directory (the driver then writes the copy it receives through ``tune.report``)."""
        if self.remote:
            return str(Path(tempfile.gettempdir()) / "ablate" / self.campaign / "receipts")
        return str(self.receipts_dir)

    def publish(self, local_file: Path) -> None:
        """Mirror one file of the campaign dir to remote storage (no-op for local storage)."""
        if not self.remote:
            return
        import pyarrow.fs as pafs

        relative = local_file.resolve().relative_to(self.local_dir.resolve()).as_posix()
        fs, base = pafs.FileSystem.from_uri(f"{self.storage}/{self.campaign}")
        target = f"{base}/{relative}"
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(target) as out:
            out.write(local_file.read_bytes())

    def mirrored(self, relative_dir: str) -> set[str]:
        """Names of the files remote storage holds in ``relative_dir`` of the campaign (one listing call)."""
        if not self.remote:
            return set()
        import pyarrow.fs as pafs

        fs, base = pafs.FileSystem.from_uri(f"{self.storage}/{self.campaign}")
        selector = pafs.FileSelector(f"{base}/{relative_dir}", allow_not_found=True)
        return {info.base_name for info in fs.get_file_info(selector) if info.type == pafs.FileType.File}

    def pull(self) -> None:
        """Copy the remote mirror into the local campaign dir (a resumed job starts in a fresh working dir)."""
        if not self.remote:
            return
        import pyarrow.fs as pafs

        fs, base = pafs.FileSystem.from_uri(f"{self.storage}/{self.campaign}")
        if fs.get_file_info(base).type != pafs.FileType.Directory:
            return
        self.local_dir.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(base, str(self.local_dir), source_filesystem=fs,
                        destination_filesystem=pafs.LocalFileSystem())

    def write(self, relative: str, text: str) -> Path:
        """A campaign file, written whole and synced (a refused receipt kept in rejected/ is its only copy once Ray
        Tune's result drops it), then mirrored."""
        path = self.local_dir / relative
        atomic_write(path, text, prefix=f".{path.name}-")  # not a receipt's: a resume leaves it alone
        self.publish(path)
        return path

    def read(self, relative: str) -> Optional[str]:
        """A campaign file, from the local dir or else (remote storage) from the mirror."""
        path = self.local_dir / relative
        if path.is_file():
            return path.read_text()
        if not self.remote:
            return None
        import pyarrow.fs as pafs

        fs, base = pafs.FileSystem.from_uri(f"{self.storage}/{self.campaign}")
        target = f"{base}/{relative}"
        if fs.get_file_info(target).type != pafs.FileType.File:
            return None
        with fs.open_input_stream(target) as stream:
            return stream.read().decode()


class SweepLocked(RuntimeError):
    """Another live sweep driver holds the campaign directory; the message names it (PID, host, sweep id)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SweepLock:
    """One sweep driver per campaign directory: two sweeps of one campaign side by side would measure each other
    (and interleave their receipts and ``LATEST``). An exclusive ``flock`` on ``<campaign>/.sweep.lock``, which
    records its holder (PID, host, sweep id, start). The kernel drops the lock when its holder dies (kill -9
    included), so a lock file whose holder is gone is stale and simply taken over. The descriptor is not
    inherited by Ray's processes (Python opens files non-inheritable), so a dead driver's Ray workers cannot keep
    it. On a filesystem without ``flock`` support the sweep runs unlocked, with a warning."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._fd: Optional[int] = None
        self.stale: Optional[dict[str, Any]] = None
        """The holder a stale lock file named (a driver that died without releasing it), when taken over."""

    def holder(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text() or "{}")
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def describe(holder: dict[str, Any]) -> str:
        if not holder:
            return "an unknown process"
        return (f"sweep {holder.get('sweep_id', '?')} (PID {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
                f"started {holder.get('started_at', '?')})")

    def acquire(self, sweep_id: str, wait_s: float = 0.0, on_wait: Optional[Callable[[str], None]] = None,
                poll_s: float = 1.0) -> "SweepLock":
        """Take the lock, waiting up to ``wait_s`` seconds (``math.inf``: until it is free); raise ``SweepLocked``
        naming the holder when it stays taken."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = self.holder()
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise SweepLocked(
                        f"campaign directory {self.path.parent} is in use by {self.describe(holder)}: two sweeps of "
                        f"one campaign would measure each other. Wait for it with `ablate sweep ... --wait`, or stop "
                        f"it (its lock is {self.path})") from None
                if on_wait is not None and not told:
                    on_wait(f"waiting for {self.describe(holder)} to finish: it holds {self.path}")
                    told = True
                time.sleep(poll_s if math.isinf(wait_s) else min(poll_s, max(0.0, deadline - time.monotonic())))
            except OSError as exc:  # no flock on this filesystem (some network/FUSE mounts)
                os.close(fd)
                if on_wait is not None:
                    on_wait(f"warning: cannot lock {self.path} ({exc.strerror}); the sweep runs without a lock")
                return self
        previous = self.holder()
        if previous.get("pid") is not None and previous.get("released_at") is None:
            # Locked by nobody, yet never released: its driver died (kill -9, power loss, a full disk).
            self.stale = previous
        record = {"pid": os.getpid(), "host": socket.gethostname(), "sweep_id": sweep_id,
                  "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds without its description (holders are then "an unknown process")
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        try:
            record = self.holder()
            record["released_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(record).encode(), 0)
        except OSError:
            pass  # a full or read-only disk: the lock itself still goes with the descriptor
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
