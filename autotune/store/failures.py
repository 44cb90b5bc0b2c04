"""What a database error means: one that passes with time (worth trying again), or one the user must
fix (a full disk, a read-only file, a server that does not answer), told in one line.

Decided from the driver's message, lower-cased, against the listed fragments below: SQLite's
(sqlite3) and PostgreSQL's (libpq, psycopg) own wording. Unit-tested on canned messages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from sqlalchemy.engine import URL

from autotune.vocabulary.errors import DatabaseError
from autotune.store.engine import PG_STATEMENT_TIMEOUT_S, connect_timeout_s, display_url

log = logging.getLogger("autotune")

# Errors that pass with time: another process holds a lock, the connection dropped, the server is
# restarting or busy. Everything else (a full disk, a read-only file, a wrong password, a missing
# database, a bad statement) fails the same way however long one waits.
TRANSIENT_MESSAGES = (
    # SQLite: another process held the write lock past busy_timeout, or changed the schema under us.
    "database is locked",
    "database table is locked",
    "database schema has changed",
    # PostgreSQL (libpq, psycopg): the server went away, is starting or stopping, or is busy.
    "server closed the connection",
    "connection refused",
    "could not connect to server",
    "could not receive data from server",
    "could not send data to server",
    "no connection to the server",
    "connection is closed",
    "connection is lost",
    "connection already closed",
    "connection was closed",
    "consuming input failed",
    "sending query failed",
    "ssl connection has been closed unexpectedly",
    "terminating connection",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "too many clients already",
    "too many connections",
    "deadlock detected",
    "could not serialize access",
    "timeout",  # connection timeout expired; statement or lock timeout
    "network is unreachable",
    "no route to host",
)

READ_ONLY_MESSAGES = ("readonly database", "read-only", "read only")
FULL_MESSAGES = ("database or disk is full", "no space left on device", "disk full", "disk quota exceeded")


def detail_of(exc: BaseException) -> str:
    """The driver's own first line (SQLAlchemy's wrapper adds the statement and a link)."""
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0].strip()


def is_transient(exc: BaseException) -> bool:
    """A database error worth trying again: the connection was lost, the server was busy or
    restarting, another process held the lock, as opposed to a full disk, a read-only file, or a
    mistake in the statement or the data."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    orig = getattr(exc, "orig", None) or exc
    message = " ".join(str(orig).lower().split())
    return any(fragment in message for fragment in TRANSIENT_MESSAGES)


def fails_for_good(exc: BaseException) -> bool:
    """A full disk or a read-only file: every later write fails the same way, and the next write of
    autotune's own record says so in one line (so a side write, such as a heartbeat, stays quiet)."""
    cause = exc.__cause__ if exc.__cause__ is not None and not hasattr(exc, "orig") else exc
    low = detail_of(cause).lower()
    return any(fragment in low for fragment in FULL_MESSAGES + READ_ONLY_MESSAGES)


def is_database_failure(exc: BaseException) -> bool:
    """An error of the database itself (its file, disk, server or connection), as opposed to a
    statement or data that autotune got wrong (IntegrityError, ProgrammingError, DataError: bugs)."""
    from sqlalchemy import exc as sa_exc

    return (
        isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.InternalError))
        or type(exc) is sa_exc.DatabaseError
    )


def describe_failure(
    url: URL, exc: BaseException, *, retried_s: float | None = None, waited_s: float | None = None
) -> DatabaseError:
    """One line for a database that cannot be opened or written, from the driver's own first line:
    what is wrong with it and what to do. `retried_s`: how long a transient failure was retried;
    `waited_s`: how long the connection waited for another process's lock (its busy timeout)."""
    detail = detail_of(exc)
    low = detail.lower()
    where = display_url(url)
    if waited_s is not None and ("database is locked" in low or "database table is locked" in low):
        return DatabaseError(
            f"the results database {where} is locked by another process; waited {waited_s:.0f} s. "
            f"Run the command again when that process is done (`fuser {where}` names it), or pass "
            f"--db with another database."
        )
    if "file is not a database" in low or "file is encrypted" in low:
        return DatabaseError(f"{where} is not an SQLite database; pass --db with another file, or move that one away.")
    if any(fragment in low for fragment in READ_ONLY_MESSAGES):
        return DatabaseError(
            f"the results database {where} is read-only ({detail}); make it and its directory writable "
            f"(chmod u+w), or pass --db with a writable path."
        )
    if any(fragment in low for fragment in FULL_MESSAGES):
        return DatabaseError(
            f"cannot write to the results database {where}: the disk is full ({detail}); free some space "
            f"there, or pass --db with a path on another disk."
        )
    if "unable to open database file" in low:
        # Also what SQLite says when the file is there but its directory is read-only: WAL mode
        # needs to create the -wal and -shm files beside it.
        return DatabaseError(
            f"cannot open the results database {where} (unable to open the file, or the -wal/-shm files "
            f"beside it); make it and its directory writable, or pass --db with a writable file path."
        )
    if "statement timeout" in low:
        return DatabaseError(
            f"the results database {where} did not finish a statement within {PG_STATEMENT_TIMEOUT_S} s "
            f"(its statement timeout; a lock held by another session?); check the server and try again."
        )
    if "timeout" in low and ("connect" in low or "expired" in low):
        return DatabaseError(
            f"cannot reach the results database {where}: no answer within {connect_timeout_s(url)} s (its "
            f"connect timeout); check that the server is up and reachable, or pass another --db."
        )
    after = f" (still failing after {retried_s:.0f} s of retries)" if retried_s else ""
    return DatabaseError(f"cannot use the results database {where}: {detail}{after}")


@contextlib.contextmanager
def written_if_possible(what: str) -> Iterator[None]:
    """A write on the way out of an aborted search, tried once: a database that fails (often why
    the search is ending: a server stopped, a full disk) must not bury the error that ended it
    under its own. What cannot be written now reads right anyway (a running study whose owner is
    gone reads as interrupted: store/liveness.py) and the next search puts it right (claims of
    workers gone: Store.release_dead_claims)."""
    try:
        yield
    except Exception as exc:
        if not (isinstance(exc, DatabaseError) or is_database_failure(exc)):
            raise
        log.debug("could not write %s on the way out: %s", what, exc)
