"""Which MLflow tracking store a sweep writes to, and how it is shown.

Order: an explicit URI (``--tracking-uri`` or the campaign's ``tracking.uri``), then ``$MLFLOW_TRACKING_URI``,
then the embedded default ``sqlite:///<absolute cwd>/mlflow.db``. Relative SQLite paths are made absolute
against the driver's working directory, because Ray Tune changes the working directory of trial processes and a
relative store would silently become a different database (shared/notes/ray-tune-train.md §5).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ablate.redact import redact_uri

DEFAULT_DB = "mlflow.db"


def default_tracking_uri(cwd: Optional[Path] = None) -> str:
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / DEFAULT_DB}"


def absolute_sqlite(uri: str, cwd: Optional[Path] = None) -> str:
    """``sqlite:///rel.db`` -> ``sqlite:////abs/rel.db``; other URIs unchanged (in-memory SQLite included)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return uri
    path = uri[len(prefix):]
    if not path or path == ":memory:" or path.startswith("/"):
        return uri
    return f"{prefix}{((cwd or Path.cwd()) / path).resolve()}"


def resolve_tracking_uri(explicit: Optional[str] = None, cwd: Optional[Path] = None) -> str:
    uri = explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(cwd)
    return absolute_sqlite(uri, cwd)


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of an absolute SQLite URI, else None."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and uri[len(prefix):].startswith("/"):
        return Path(uri[len(prefix):])
    return None


def shown(uri: str) -> str:
    """A tracking URI as it may appear in logs, tags and summaries: never with its password."""
    return redact_uri(uri)
