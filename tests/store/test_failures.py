"""When the database itself fails: which errors pass with time (retried), which the user must fix
(told at once, in one line), and a database file deleted or replaced while a store writes to it."""

from __future__ import annotations

import os
import shutil
import sqlite3
import time

import pytest
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError, ProgrammingError

from autotune.vocabulary.errors import DatabaseError
from autotune.store import PG_CONNECT_TIMEOUT_S, PG_STATEMENT_TIMEOUT_S, open_store, resolve_url
from autotune.store import base
from autotune.store.engine import postgres_connect_args, sqlite_path
from autotune.store.failures import describe_failure, is_transient

from tests.helpers.store import ENV, config, make_study, result


def wrapped(message: str, cls=OperationalError, driver_error=sqlite3.OperationalError) -> Exception:
    """What SQLAlchemy raises for a driver error with `message`."""
    return cls("INSERT INTO autotune_probes ...", {}, driver_error(message))


@pytest.mark.parametrize(
    "message",
    [
        "database is locked",  # SQLite, past busy_timeout
        "database table is locked",
        "server closed the connection unexpectedly\n\tThis probably means the server terminated abnormally",
        'connection failed: connection to server at "10.0.0.5", port 5432 failed: Connection refused',
        "consuming input failed: server closed the connection unexpectedly",
        "terminating connection due to administrator command",
        "the database system is starting up",
        "connection timeout expired",
        "canceling statement due to statement timeout",
        "SSL connection has been closed unexpectedly",
        "the connection is closed",
        "sorry, too many clients already",
        "deadlock detected",
    ],
)
def test_errors_that_pass_with_time_are_transient(message):
    assert is_transient(wrapped(message))


@pytest.mark.parametrize(
    "message",
    [
        "database or disk is full",  # SQLite SQLITE_FULL
        "attempt to write a readonly database",  # SQLite SQLITE_READONLY
        "unable to open database file",
        "disk I/O error",
        "file is not a database",
        'could not extend file "base/16384/16397": No space left on device',  # PostgreSQL DiskFull
        "cannot execute INSERT in a read-only transaction",
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  password authentication failed for user "u"',
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  database "nope" does not exist',
        "no such table: autotune_probes",
    ],
)
def test_errors_that_waiting_does_not_cure_are_not_transient(message):
    # (Before, every OperationalError counted as transient: a full disk was retried for a minute.)
    assert not is_transient(wrapped(message))


def test_statement_and_data_mistakes_are_never_transient_and_a_dropped_connection_always_is():
    assert not is_transient(wrapped("UNIQUE constraint failed", IntegrityError, sqlite3.IntegrityError))
    assert not is_transient(wrapped("syntax error", ProgrammingError, sqlite3.ProgrammingError))
    assert not is_transient(wrapped("Error binding parameter 1", InterfaceError, sqlite3.InterfaceError))
    assert not is_transient(ValueError("database is locked"))
    dropped = wrapped("SSL SYSCALL error: EOF detected")
    dropped.connection_invalidated = True
    assert is_transient(dropped)


@pytest.mark.parametrize(
    "message, words",
    [
        ("database or disk is full", "the disk is full"),
        ("attempt to write a readonly database", "is read-only"),
        ("cannot execute UPDATE in a read-only transaction", "is read-only"),
        ("connection timeout expired", f"no answer within {PG_CONNECT_TIMEOUT_S} s"),
        ("canceling statement due to statement timeout", f"within {PG_STATEMENT_TIMEOUT_S} s"),
        ("file is not a database", "is not an SQLite database"),
    ],
)
def test_failures_are_told_in_one_line_with_what_to_do(tmp_path, message, words):
    url = resolve_url(tmp_path / "r.db")
    error = describe_failure(url, wrapped(message))
    assert isinstance(error, DatabaseError) and words in str(error) and str(tmp_path / "r.db") in str(error)
    assert "\n" not in str(error)


# -- a full disk, a read-only file: one line at once, nothing retried -----------------------------


def fill_up(store) -> None:
    """Emulate a full disk: SQLite's max_page_count, set on every new connection to the database's
    current size, makes the next write that needs a page fail with SQLITE_FULL, "database or disk
    is full", exactly as a full file system does."""
    with store.engine.connect() as connection:
        pages = connection.exec_driver_sql("PRAGMA page_count").scalar()
    event.listen(store.engine, "connect", lambda dbapi, _record: dbapi.execute(f"PRAGMA max_page_count = {pages}"))
    store.engine.dispose()  # pooled connections go; new ones get the limit


def test_a_full_disk_is_one_line_at_once_not_a_minute_of_retries(tmp_path):
    with open_store(tmp_path / "full.db") as store:
        study = make_study(store)
        fill_up(store)
        started = time.monotonic()
        with pytest.raises(DatabaseError, match="the disk is full") as info:
            for _ in range(50):  # a few probes fit in the pages there are; the next one does not
                store.record_probe(study.id, config(4), result(error="x" * 20_000), env_fingerprint=ENV.fingerprint())
        assert time.monotonic() - started < 5  # (old code: OperationalError after 61 s of retries)
    message = str(info.value)
    assert str(tmp_path / "full.db") in message and "database or disk is full" in message and "\n" not in message


def read_only_url(path) -> tuple[str, str]:
    """A URL that opens `path` read-only, and how. chmod 444 does nothing to root (root ignores file
    modes), so as root the file is opened through SQLite's read-only URI mode, which refuses every
    write with the same SQLITE_READONLY error a read-only file gives."""
    if os.geteuid() == 0:
        return f"sqlite:///file:{path}?mode=ro&uri=true", "mode=ro URI (root ignores file modes)"
    os.chmod(path, 0o444)
    return str(path), "chmod 444"


def test_a_read_only_database_is_one_line(tmp_path):
    db = tmp_path / "ro.db"
    with open_store(db) as store:
        make_study(store)
    url, how = read_only_url(db)
    try:
        with open_store(url) as store:
            assert sqlite_path(store.engine.url) == db
            with pytest.raises(DatabaseError, match="is read-only") as info:
                make_study(store, "s2")
            with pytest.raises(DatabaseError, match="is read-only"):
                store.set_study_status("s1", "finished")
            assert [s.name for s in store.studies()] == ["s1"], how  # reading still works
    finally:
        os.chmod(db, 0o644)
    assert str(db) in str(info.value) and "\n" not in str(info.value)


def test_a_transient_failure_that_outlasts_the_retries_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "TRANSIENT_RETRY_DELAYS", (0.0, 0.0))

    class Locked:
        calls = 0

        def begin(self):
            Locked.calls += 1
            raise wrapped("database is locked")

    with open_store(tmp_path / "locked.db") as store:
        study = make_study(store)
        store.db._write = Locked()
        with pytest.raises(DatabaseError, match="database is locked"):
            store.record_probe(study.id, config(4), result(), env_fingerprint=ENV.fingerprint())
    assert Locked.calls == 3  # tried, and again after each pause


# -- the file deleted or replaced mid-search ----------------------------------------------------


def remove_database(db) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{db}{suffix}"):
            os.remove(f"{db}{suffix}")


@pytest.mark.parametrize("how", ["file deleted", "directory deleted", "file replaced"])
def test_a_database_deleted_or_replaced_while_open_stops_the_next_write(tmp_path, how):
    # SQLite keeps writing to a deleted file's inode: without the check the search would go on
    # "successfully" and end with nothing on disk.
    folder = tmp_path / "results"
    db = folder / "live.db"
    with open_store(db) as store:
        study = make_study(store)
        store.record_probe(study.id, config(1), result(), env_fingerprint=ENV.fingerprint())
        if how == "file deleted":
            remove_database(db)
        elif how == "directory deleted":
            shutil.rmtree(folder)
        else:
            shutil.copy(db, tmp_path / "copy.db")
            os.replace(tmp_path / "copy.db", db)
        with pytest.raises(DatabaseError, match="was deleted or replaced while autotune was using it") as info:
            store.record_probe(study.id, config(2), result(), env_fingerprint=ENV.fingerprint())
        with pytest.raises(DatabaseError, match="deleted or replaced"):
            store.set_study_status(study.id, "finished")
    assert str(db) in str(info.value) and "\n" not in str(info.value)


def test_a_store_opened_read_only_changes_nothing(tmp_path):
    db = tmp_path / "ro.db"
    with open_store(db) as store:
        make_study(store)
    before = db.read_bytes()
    with open_store(db, read_only=True) as store:
        assert [s.name for s in store.studies()] == ["s1"]
        with pytest.raises(RuntimeError, match="read-only"):
            make_study(store, "s2")
    assert db.read_bytes() == before and sorted(p.name for p in tmp_path.glob("ro.db*")) == ["ro.db"]


def test_writes_go_on_while_the_file_stays(tmp_path):
    with open_store(tmp_path / "stays.db") as store:
        study = make_study(store)
        for mb in (1, 2, 4):
            store.record_probe(study.id, config(mb), result(), env_fingerprint=ENV.fingerprint())
        assert len(store.probes()) == 3


# -- PostgreSQL timeouts --------------------------------------------------------------------------


def test_postgresql_connections_carry_a_connect_and_a_statement_timeout():
    url = resolve_url("postgresql+psycopg://u@db.example/at")
    assert postgres_connect_args(url) == {
        "connect_timeout": PG_CONNECT_TIMEOUT_S,
        "options": f"-c statement_timeout={PG_STATEMENT_TIMEOUT_S * 1000}",
    }
    # A URL that sets them keeps its own.
    own = resolve_url("postgresql+psycopg://u@db.example/at?connect_timeout=3&options=-c%20statement_timeout%3D5000")
    assert postgres_connect_args(own) == {}
    # And the line for a server that never answered says the timeout that was waited.
    assert "no answer within 3 s (its connect timeout)" in str(
        describe_failure(own, wrapped("connection timeout expired"))
    )


def test_a_real_postgresql_session_has_the_statement_timeout(postgres_url):
    with open_store(postgres_url) as store:
        with store.engine.connect() as connection:
            setting = connection.exec_driver_sql(
                "SELECT setting FROM pg_settings WHERE name = 'statement_timeout'"
            ).scalar()
    assert int(setting) == PG_STATEMENT_TIMEOUT_S * 1000  # milliseconds
