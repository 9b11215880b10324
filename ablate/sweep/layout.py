"""Where a campaign's files live, locally and on shared storage.

``<storage>`` is ``--storage``, else the campaign's ``tracking.storage``, else ``<cwd>/ablate_runs``:

    <storage>/<campaign>/receipts/<receipt_id>.json   every arm's receipt (the source of truth)
    <storage>/<campaign>/spool.jsonl                   receipts MLflow has not taken yet (``ablate receipts sync``)
    <storage>/<campaign>/sweeps/<sweep_id>.json        what each sweep was: plan fingerprint, experiment, paths
    <storage>/<campaign>/LATEST                        the sweep id ``--resume`` continues
    <storage>/_tune/<campaign>/<sweep_id>/             Ray Tune's experiment (kept apart: its result.json files
                                                       are not receipts)

When ``<storage>`` is a URI (``s3://``, ``gs://``), the campaign directory is written on the driver under
``<cwd>/ablate_runs/<campaign>`` and every file is mirrored to ``<storage>/<campaign>/`` with pyarrow, so a sweep
submitted with ``ray job submit`` (whose working directory is temporary) loses nothing and can be resumed.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

LOCAL_ROOT = "ablate_runs"
TUNE_DIR = "_tune"
LATEST = "LATEST"


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
        path = self.local_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
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
