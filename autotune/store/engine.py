"""Where the results database is, and how to connect to it.

`--db URL`, else `$AUTOTUNE_DB`, else `autotune.db` in the user data directory (`$AUTOTUNE_HOME`
when set). A value without `://` is a file path and becomes an SQLite URL. Any SQLAlchemy URL works;
PostgreSQL (`postgresql+psycopg://...`) is the one teams use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from autotune.errors import DatabaseError
from autotune.paths import data_dir

DB_FILENAME = "autotune.db"
# Writers wait this long for another process's write transaction before giving up. Probes take
# seconds to minutes and a write milliseconds, so contention is short; 30 s covers slow disks.
SQLITE_BUSY_TIMEOUT_MS = 30_000
# The execution option that picks the SQLite BEGIN mode of a transaction (see make_engine).
SQLITE_BEGIN_OPTION = "autotune_sqlite_begin"


def default_url() -> str:
    """The database used when no --db is given: `$AUTOTUNE_DB`, else a file in data_dir()."""
    env = os.environ.get("AUTOTUNE_DB")
    if env:
        return env
    return f"sqlite:///{(data_dir() / DB_FILENAME).resolve()}"


def resolve_url(db: str | os.PathLike[str] | None = None) -> URL:
    """The SQLAlchemy URL for a `--db` value (URL or file path), or for the default when None."""
    text = os.fspath(db) if db is not None else ""
    text = text.strip() or default_url()
    if "://" not in text:
        # A plain path: absolute, so that the database does not depend on the working directory.
        text = f"sqlite:///{Path(text).expanduser().resolve()}"
    try:
        return make_url(text)
    except ArgumentError:
        raise DatabaseError(
            f"--db: cannot read {text!r} as a database URL; give a file path or a URL such as "
            f"sqlite:///path/autotune.db or postgresql+psycopg://user@host/db."
        ) from None


def display_url(url: URL) -> str:
    """The URL for messages: a file path for SQLite, the password hidden otherwise."""
    if is_sqlite_file(url):
        return str(url.database)
    return url.render_as_string(hide_password=True)


def is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def is_sqlite_file(url: URL) -> bool:
    return is_sqlite(url) and url.database not in (None, "", ":memory:") and url.query.get("mode") != "memory"


def make_engine(url: URL, *, foreign_keys: bool = True) -> Engine:
    """An engine with our connection settings.

    SQLite: WAL (readers never block the writer, so a leaderboard can be read during a search),
    a busy timeout (several processes write probes to one file), foreign keys on (off only for
    migrations, where batch table rebuilds would otherwise cascade deletes).

    Python's sqlite3 module starts transactions lazily and never for DDL, which makes migrations
    non-atomic and lets two writers deadlock on a read-to-write lock upgrade, where busy_timeout
    does not help. So we turn its transaction handling off and issue BEGIN ourselves (SQLAlchemy's
    documented recipe): DEFERRED for reads, IMMEDIATE for writes (the write lock up front, waiting
    for it under busy_timeout).
    """
    kwargs: dict[str, Any] = {}
    if url.get_backend_name() == "postgresql":
        # A connection dropped by the server or a proxy while a long probe ran is replaced quietly.
        kwargs["pool_pre_ping"] = True
    if is_sqlite_file(url):
        path = Path(str(url.database))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatabaseError(f"cannot create the directory of the results database {path.parent}: {exc.strerror}; pass --db with a writable path.") from None
    try:
        engine = create_engine(url, **kwargs)
    except NoSuchModuleError:
        raise DatabaseError(f"--db: no SQLAlchemy dialect for {url.drivername!r}; use sqlite:///path or postgresql+psycopg://...") from None
    except ModuleNotFoundError as exc:
        hint = " (pip install 'autotune[postgres]')" if url.get_backend_name() == "postgresql" else ""
        raise DatabaseError(f"--db: the database driver {exc.name!r} is not installed{hint}.") from None

    if is_sqlite(url):
        _configure_sqlite(engine, foreign_keys=foreign_keys)
    return engine


def _configure_sqlite(engine: Engine, *, foreign_keys: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves; see make_engine
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching to WAL takes a lock another process may hold.
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
            if is_sqlite_file(engine.url):
                cursor.execute("PRAGMA journal_mode = WAL")
                # With WAL, NORMAL is still crash-safe for the database (a power cut may lose the
                # last commits, never corrupt), and saves an fsync per probe.
                cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        mode = connection.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")


def writer(engine: Engine) -> Engine:
    """The same engine (same pool), whose transactions take SQLite's write lock at BEGIN."""
    if engine.dialect.name != "sqlite":
        return engine
    return engine.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE"})
