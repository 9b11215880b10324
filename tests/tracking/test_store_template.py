"""A missing embedded store is created from MLflow's own empty store (``ablate.tracking.store_template``): the same
schema and the same first contents as a store MLflow migrates itself, never a run or an experiment from elsewhere,
never over an existing file, and MLflow's own creation whenever the template cannot be trusted."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.store.db import utils as db_utils

from ablate.tracking import store_template
from ablate.tracking.mlflow_store import TrackingClient
from ablate.user_cache import CACHE_ENV


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One template, built once for the module (each build runs MLflow's migrations: seconds on 2 CPUs)."""
    template = store_template.current_template(tmp_path_factory.mktemp("built") / "cache")
    assert template is not None
    return template


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user cache of this test's own."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(directory))
    return directory


@pytest.fixture
def primed(cache: Path, built: Path) -> Path:
    """This test's user cache, holding a copy of the module's template (private, as a build leaves it)."""
    cache.mkdir(mode=0o700)
    shutil.copy2(built, cache / built.name)
    return cache / built.name


def _schema(db: Path) -> dict[str, list[str]]:
    """Each table's and index's definition as a set of lines: MLflow's own migrations write a table's constraints
    in an order that varies with the hash seed (two stores it makes itself differ so), never in their content."""
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall()
    return {name: sorted(line.strip().rstrip(",") for line in sql.splitlines()) for name, sql in rows}


def _rows(db: Path, skip: tuple[str, ...] = ()) -> dict[str, list[tuple]]:
    with sqlite3.connect(db) as connection:
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {table: sorted(connection.execute(f'SELECT * FROM "{table}"').fetchall(), key=repr)
                for table in tables if table not in skip}


def _forbid_migrations(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(engine):  # noqa: ANN001 - MLflow's signature
        raise AssertionError("MLflow migrated a store the template should have made")
    monkeypatch.setattr(db_utils, "_initialize_tables", refuse)


def test_a_seeded_store_is_the_store_mlflow_makes_itself(tmp_path: Path, cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "own.db"
    umask = os.umask(0o002)  # a umask that lets group write: a seeded store must still get SQLite's own 0644
    try:
        MlflowClient(tracking_uri=f"sqlite:///{own}").search_experiments()  # MLflow's creation, before any template
        assert not cache.exists()
        first = tmp_path / "first.db"
        assert store_template.seed_sqlite_store(f"sqlite:///{first}")  # builds the template, then copies it
    finally:
        os.umask(umask)
    assert oct(first.stat().st_mode & 0o777) == oct(own.stat().st_mode & 0o777) == "0o644"
    templates = list(cache.glob(f"{store_template.PREFIX}*.db"))
    assert len(templates) == 1
    built = templates[0].stat()
    _forbid_migrations(monkeypatch)
    second = tmp_path / "second.db"
    assert store_template.seed_sqlite_store(f"sqlite:///{second}")  # the same template, not built again
    assert (templates[0].stat().st_ino, templates[0].stat().st_mtime_ns) == (built.st_ino, built.st_mtime_ns)

    client = MlflowClient(tracking_uri=f"sqlite:///{second}")  # opens without migrating (they would raise)
    default = client.get_experiment("0")
    assert default is not None and default.name == "Default"
    assert _schema(second) == _schema(own)
    # Row for row what MLflow's creation holds, but the Default experiment's clock and artifact root (its own).
    assert _rows(second, skip=("experiments",)) == _rows(own, skip=("experiments",))
    run = client.create_run(client.create_experiment("e"))
    client.log_metric(run.info.run_id, "m", 1.0)
    assert client.get_run(run.info.run_id).data.metrics == {"m": 1.0}
    assert oct(second.stat().st_mode & 0o777) == oct(own.stat().st_mode & 0o777)


def test_tracking_client_creates_a_missing_store_from_the_template(tmp_path: Path, primed: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_migrations(monkeypatch)
    client = TrackingClient(f"sqlite:///{tmp_path / 'mlflow.db'}", "ablate")
    assert client.client.get_experiment(client.experiment_id).name == "ablate"


def test_an_existing_store_is_never_touched(tmp_path: Path, primed: Path) -> None:
    existing = tmp_path / "mlflow.db"
    existing.write_bytes(b"not yet a database")
    assert not store_template.seed_sqlite_store(f"sqlite:///{existing}")
    assert existing.read_bytes() == b"not yet a database"
    # Made by another process between the check and the copy: theirs stands, no stray file is left.
    assert not store_template._create_from(primed, existing, db_utils._get_latest_schema_revision())
    assert existing.read_bytes() == b"not yet a database"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mlflow.db"]


def test_a_template_holding_a_run_or_at_another_revision_is_rebuilt_before_use(tmp_path: Path, primed: Path) -> None:
    template = primed
    client = MlflowClient(tracking_uri=f"sqlite:///{template}")
    client.create_run(client.create_experiment("planted"))  # a run that must never reach a new store
    head = db_utils._get_latest_schema_revision()
    refused = tmp_path / "refused.db"
    assert not store_template._create_from(template, refused, head)  # the copied bytes are checked, too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert store_template.current_template() == template
    made = tmp_path / "new.db"
    assert store_template.seed_sqlite_store(f"sqlite:///{made}")
    assert MlflowClient(tracking_uri=f"sqlite:///{made}").get_experiment_by_name("planted") is None

    with sqlite3.connect(template) as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'older'")
    assert store_template.current_template() == template
    with sqlite3.connect(template) as connection:
        assert connection.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (db_utils._get_latest_schema_revision(),)]


def test_no_template_from_a_cache_others_can_write_or_with_the_cache_off(tmp_path: Path, primed: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    template, cache = primed, primed.parent
    os.chmod(template, 0o664)  # group-writable: someone else may have planted it
    planted = template.stat().st_ino
    assert store_template.current_template() == template  # built again by us, private
    assert template.stat().st_ino != planted and template.stat().st_mode & 0o022 == 0

    os.chmod(cache, 0o777)
    assert store_template.current_template() is None
    made = tmp_path / "made-by-mlflow.db"
    assert not store_template.seed_sqlite_store(f"sqlite:///{made}")
    assert not made.exists()
    TrackingClient(f"sqlite:///{made}", "ablate")  # MLflow creates it, as before
    assert made.exists()

    monkeypatch.setenv(CACHE_ENV, "off")
    assert store_template.current_template() is None
    assert not store_template.seed_sqlite_store(f"sqlite:///{tmp_path / 'off.db'}")


def test_only_local_sqlite_files_are_seeded(tmp_path: Path, cache: Path) -> None:
    for uri in ("http://127.0.0.1:1", "sqlite:///relative.db", "sqlite:///:memory:", "postgresql://h/db",
                f"sqlite:///{tmp_path / 'no-such-dir' / 'mlflow.db'}"):
        assert not store_template.seed_sqlite_store(uri), uri
    assert not (tmp_path / "no-such-dir").exists()
    assert not cache.exists()
