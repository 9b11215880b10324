"""Where ablate keeps what it remembers per user (``ablate.receipts.accepted``, ``ablate.tracking.store_template``),
and which files there it may trust.

``$ABLATE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ablate``, else ``~/.cache/ablate``); ``off`` turns every cache
off. Whoever can write a cached file decides what ablate skips (checks, MLflow's migrations), so a file or directory
owned by another user, or writable by group or others, is never read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

CACHE_ENV = "ABLATE_CACHE_DIR"
OFF = "off"


def cache_dir() -> Optional[Path]:
    """The cache directory (it may not exist yet); None when turned off. Raises ``RuntimeError`` or ``OSError``
    without a home directory."""
    configured = os.environ.get(CACHE_ENV, "").strip()
    if configured.lower() == OFF:
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "ablate"


def private(item: Path) -> bool:
    """Owned by this user and not writable by group or others."""
    info = item.stat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def trusted(path: Path) -> bool:
    """Only this user can have written it: the file and its directory are private."""
    return private(path) and private(path.parent)
