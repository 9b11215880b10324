"""A missing embedded SQLite store, created as a copy of the empty store MLflow builds, instead of by MLflow
running its whole migration history again.

Why: MLflow makes a new SQLite store by creating its first schema and then running every alembic migration since
(67 Python files in MLflow 3.17, many of them SQLite table copies): 1.3-1.9 s of CPU on a 2-core machine, paid by
every first sweep in a directory (at the moment Ray starts on the same two cores) and by most tests.

Why it is the same store: the template is built by the very call ``SqlAlchemyStore`` makes on a file without tables
(``mlflow.store.db.utils._initialize_tables``), through the engine MLflow would use, and is named by MLflow's and
SQLAlchemy's versions and the schema head revision. A copy becomes a store only while its bytes are at that head and
hold no experiment and no run: MLflow then opens it as a current store (its own ``_verify_schema`` runs as on any
store) and creates the Default experiment itself, with this store's artifact root and clock. The template lives in
the user cache (``ablate.user_cache``) and is trusted as the accepted-payload cache is: a file another user could
have written is never copied. Whatever goes wrong (no cache, another MLflow, a file system without hard links, a
damaged template) leaves the store to MLflow, as before: it costs time, never a store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Optional
from urllib.parse import quote

from ablate.tracking.uri import sqlite_path
from ablate.user_cache import cache_dir, private, trusted

log = logging.getLogger(__name__)

PREFIX = "mlflow-empty-"
KEEP_OTHER_TEMPLATES = 2
"""Templates of other MLflow versions kept beside the current one (a switched environment may come back)."""
_EVIDENCE_TABLES = ("experiments", "runs")
"""What a copy must not bring along: a run in the template would be in every store made from it."""


def seed_sqlite_store(uri: str, cache: Optional[Path] = None) -> bool:
    """Create the missing SQLite file of ``uri`` from the template kept in ``cache`` (default: the user cache; see
    the module docstring). True when this call created it; False when it left the store to MLflow (not a local
    SQLite URI, a file already there, no usable template, another process creating it at the same moment). Never
    raises."""
    path = sqlite_path(uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    try:
        head = _head()
        template = _template(cache, head)
        return template is not None and _create_from(template, path, head)
    except Exception as exc:  # noqa: BLE001 - only time is at stake: MLflow creates the store itself
        log.info("MLflow store %s: made by MLflow itself (no template: %s: %s)", path, type(exc).__name__, exc)
        return False


def current_template(cache: Optional[Path] = None) -> Optional[Path]:
    """The template for the installed MLflow in ``cache`` (default: the user cache), built first when it is missing,
    stale or damaged; None when there is no trusted cache directory to keep it in."""
    return _template(cache, _head())


def _template(cache: Optional[Path], head: str) -> Optional[Path]:
    try:
        directory = cache if cache is not None else cache_dir()
    except (RuntimeError, OSError):  # no home directory
        return None
    if directory is None:
        return None
    import mlflow
    import sqlalchemy

    path = directory / f"{PREFIX}{mlflow.__version__}-{sqlalchemy.__version__}-{head}.db"
    if not (path.exists() and trusted(path) and _usable(path, head)):
        if directory.exists() and not private(directory):
            return None  # a directory another user can write to: nothing built there is ours alone
        _build(path)
        if not (trusted(path) and _usable(path, head)):
            return None
        _prune(path)
    return path


def _usable(path: Path, head: str) -> bool:
    """At the schema head, whole, and without an experiment or a run."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)) as connection:
            if connection.execute("PRAGMA quick_check(1)").fetchall() != [("ok",)]:
                return False
            if [row[0] for row in connection.execute("SELECT version_num FROM alembic_version")] != [head]:
                return False
            return not any(connection.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchone()
                           for table in _EVIDENCE_TABLES)
    except sqlite3.Error:  # not a database, a table missing: not MLflow's empty store
        return False


def _build(path: Path) -> None:
    """MLflow's own empty store at ``path``, written whole (a reader never sees a half-built template)."""
    from mlflow.store.db import utils as db_utils

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{PREFIX}", suffix=".db", delete=False)
    handle.close()
    try:
        engine = db_utils.create_sqlalchemy_engine_with_retry(f"sqlite:///{handle.name}")
        try:
            db_utils._initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(handle.name, path)
    finally:
        if os.path.exists(handle.name):
            os.unlink(handle.name)


def _head() -> str:
    from mlflow.store.db import utils as db_utils

    return db_utils._get_latest_schema_revision()


def _create_from(template: Path, path: Path, head: str) -> bool:
    """``path`` as a copy of ``template``, unless another process creates ``path`` first (theirs stands) or the
    copied bytes are not an empty store at ``head``."""
    temporary = path.with_name(f".{path.name}.seed-{os.getpid()}-{secrets.token_hex(4)}")
    # 0o644: the permissions SQLite gives a database file it creates for MLflow (before the user's umask); a store
    # others could write is a store others could plant runs in.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(descriptor, "wb") as target, template.open("rb") as source:
            shutil.copyfileobj(source, target)
        if not _usable(temporary, head):  # the bytes that become the store, not the file checked a moment ago
            return False
        try:
            os.link(temporary, path)  # never replaces: a store made meanwhile, by MLflow or by us, is kept
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: left to MLflow, whose creation is race-safe
            return False
        return True
    finally:
        temporary.unlink(missing_ok=True)


def _prune(current: Path) -> None:
    others = sorted((p for p in current.parent.glob(f"{PREFIX}*.db") if p != current),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in others[KEEP_OTHER_TEMPLATES:]:
        stale.unlink(missing_ok=True)
