"""Which MLflow tracking store a sweep writes to, and how it is shown.

Credentials inside an http(s) URI are moved to ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` so
no URL MLflow prints carries them. Order: an explicit URI (``--tracking-uri`` or the campaign's ``tracking.uri``), then ``$MLFLOW_TRACKING_URI``,
then the embedded default ``sqlite:///<absolute cwd>/mlflow.db``. Relative SQLite paths are made absolute
against the driver's working directory, because Ray Tune changes the working directory of trial processes and a
relative store would silently become a different database (shared/notes/ray-tune-train.md §5).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from ablate.redact import redact_uri

DEFAULT_DB = "mlflow.db"
LOCAL_UI = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves by default: the base of run links for a store that is not a server."""
_QUICK_CHECK_MAX_BYTES = 1 << 30


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


def move_credentials(uri: str) -> str:
    """``http://user:pw@host`` -> ``http://host``, with user and password handed to MLflow's basic-auth variables.

    MLflow prints and logs run URLs built from the tracking URI; a password left inside it would land on stdout
    and in warnings. Variables the user already set win.
    """
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    if user:
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", unquote(user))
    if password:
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", unquote(password))
    return urlunsplit(parts._replace(netloc=hostport))


def resolve_tracking_uri(explicit: Optional[str] = None, cwd: Optional[Path] = None) -> str:
    uri = explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(cwd)
    return absolute_sqlite(move_credentials(uri), cwd)


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of an absolute SQLite URI, else None."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and uri[len(prefix):].startswith("/"):
        return Path(uri[len(prefix):])
    return None


def shown(uri: str) -> str:
    """A tracking URI as it may appear in logs, tags and summaries: never with its password."""
    return redact_uri(uri)


def ui_base(tracking_uri: str, ui_url: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(base URL of the MLflow UI that run links point into, the command that serves it or None).

    ``ui_url`` when given (a proxy, a port-forward), else the tracking server itself; a store that is not a
    server (SQLite, a directory) has no UI until ``mlflow ui`` serves it, so its links point at that command's
    default address and the command is returned to be printed next to them. Never with a password."""
    if ui_url:
        return _link_base(ui_url), None
    if tracking_uri.startswith(("http://", "https://")):
        return _link_base(tracking_uri), None
    return LOCAL_UI, f"mlflow ui --backend-store-uri {shlex.quote(shown(tracking_uri))}"


def _link_base(url: str) -> str:
    """``url`` without user info (a browser asks for the login itself; a redaction mark would break the link)
    or secret query parameters, and without a trailing slash."""
    parts = urlsplit(url)
    return redact_uri(urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))).rstrip("/")


class TrackingStoreError(RuntimeError):
    """An MLflow store that cannot be used as it is; the message names it and what to do."""


def check_sqlite_store(uri: str, must_exist: bool = False, every_page: bool = True) -> None:
    """Refuse an embedded SQLite store that is not a readable SQLite database (``TrackingStoreError``), and with
    ``must_exist`` one that is missing: opening a missing file through MLflow silently creates an empty store,
    which a reader (``promote``, ``receipts list``) would then report as "no receipts". Other URIs pass.

    ``every_page`` (a writer: a sweep, a sync) reads every page of the file (``PRAGMA quick_check``), which finds
    damage anywhere before anything is written into it. A reader passes False: SQLite checks the header (garbage,
    a file shorter than its header says) and a damaged or missing page is reported when a read reaches it
    (``mlflow_store.store_failure``); pages no read reaches cannot change what it reads. Reading every page of a
    10,000-receipt store (460 MB) cost a promotion 2 s with a cold page cache, for pages (metrics, mostly) it never
    reads."""
    import sqlite3

    path = sqlite_path(uri)
    if path is None:
        return
    if not path.exists():
        if must_exist:
            raise TrackingStoreError(
                f"no MLflow store at {path} (the tracking URI {shown(uri)} names a file that does not exist); "
                f"give --tracking-uri, or --source <campaign dir> to read the receipts on disk, or rebuild the "
                f"store with `ablate receipts sync <campaign dir>`")
        return
    try:
        # mode=rw, not ro: a driver killed mid-write leaves a hot journal that SQLite rolls back on open (a
        # read-only connection cannot, and says "readonly database"); rw never creates a missing file.
        connection = sqlite3.connect(f"file:{quote(str(path))}?mode=rw", uri=True)
        try:
            connection.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
            # Reading page 1, SQLite has checked the header: garbage is "not a database", and (outside WAL mode, or
            # once the log is checkpointed) a file shorter than the page count it states is "malformed". quick_check
            # reads every page (it finds a page overwritten inside, or cut off under a live WAL log); bounded for
            # huge stores.
            small = path.stat().st_size < _QUICK_CHECK_MAX_BYTES
            problems = [row[0] for row in connection.execute("PRAGMA quick_check(1)").fetchall()] \
                if every_page and small else []
        finally:
            connection.close()
    except sqlite3.Error as exc:
        if not any(word in str(exc) for word in ("not a database", "malformed", "corrupt")):
            return  # busy (another writer), read-only, unopenable: not damage; MLflow reports those itself
        problems = [str(exc)]
    if problems and problems != ["ok"]:
        raise TrackingStoreError(corrupt_store_message(path, problems[0]))


def corrupt_store_message(path: Path, why: str) -> str:
    return (f"the MLflow store {path} is damaged ({why}); move it aside (mv {path} {path}.damaged) and rebuild it "
            f"from the receipts on disk with `ablate receipts sync <campaign dir>`: the receipt files are the "
            f"source of truth")
