"""The store's plumbing: its engine and sessions, the one retry policy for writes, and finding a
study by name. The Store (store.py) and each of its parts (claims.py, runs.py, queue.py, tokens.py) hold one."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from autotune.vocabulary.errors import DatabaseError, StudyNotFound
from autotune.store.damage import find_damaged_json
from autotune.store.engine import busy_timeout_s, display_url, sqlite_path, writer
from autotune.store.failures import describe_failure, is_database_failure, is_transient
from autotune.store.names import check_study_lookup
from autotune.store.schema import Study

__all__ = ["TRANSIENT_RETRY_DELAYS", "Database", "is_transient", "retry_transient"]

T = TypeVar("T")

# A write that fails because the connection dropped (a server restart, a proxy, a network blip) is
# tried again after these pauses, so that a probe that took minutes is not lost to a moment's outage.
# Only failures that pass with time are retried (failures.is_transient): a full disk is told at once.
TRANSIENT_RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0)


def retry_transient(work: Callable[[], T], *, transient: Callable[[BaseException], bool] = is_transient) -> T:
    """Run `work`, again after each pause of TRANSIENT_RETRY_DELAYS while it fails transiently
    (pool_pre_ping replaces a dead connection on the next checkout). Other errors, and the last
    transient one, propagate. The one retry policy for autotune's tables and Optuna's alike."""
    for delay in TRANSIENT_RETRY_DELAYS:
        try:
            return work()
        except Exception as exc:
            if not transient(exc):
                raise
            time.sleep(delay)
    return work()


class Database:
    """One database as the Store's parts use it: its engine, a read session, a write transaction (the
    one place writes start), the retry policy, and finding a study by name."""

    def __init__(self, engine: Engine, *, read_only: bool = False) -> None:
        self.engine = engine
        self.read_only = read_only
        self._read_session = sessionmaker(engine, expire_on_commit=False)
        # Writes take SQLite's write lock at BEGIN, so concurrent writers queue (busy_timeout)
        # instead of failing on a lock upgrade.
        self._write = sessionmaker(writer(engine), expire_on_commit=False)
        # SQLite keeps writing to a file that was deleted (or moved, or replaced) under it: its open
        # connections hold the old inode, so a search would end "finished" with nothing on disk.
        # The file's identity when opened is checked before every write (_writing).
        self._path = sqlite_path(engine.url)
        self._file_id = _file_id(self._path) if self._path is not None else None

    @property
    def url(self) -> str:
        """The database, for messages (password hidden)."""
        return display_url(self.engine.url)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def writing(self) -> Iterator[Session]:
        """One write transaction: the one place writes start. A failure of the database itself
        that waiting will not cure (a full disk, a read-only file) becomes one DatabaseError line;
        a transient one propagates as it is, for retry_transient."""
        if self.read_only:  # a programming error, not a user's
            raise RuntimeError("this Store was opened read-only (open_store(read_only=True))")
        self._check_same_file()
        try:
            with self._write.begin() as session:
                yield session
        except json.JSONDecodeError as exc:
            raise self._damaged(exc) from exc
        except Exception as exc:
            if not is_database_failure(exc) or is_transient(exc):
                raise
            raise describe_failure(self.engine.url, exc) from exc

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """One read session. A stored value that is not JSON is told as one line naming its row
        (damage.py); a failure of the database itself (locked past the wait, gone, unreadable) as
        one DatabaseError line, as writes tell theirs."""
        try:
            with self._read_session() as session:
                yield session
        except json.JSONDecodeError as exc:
            raise self._damaged(exc) from exc
        except Exception as exc:
            if not is_database_failure(exc):
                raise
            raise describe_failure(self.engine.url, exc, waited_s=busy_timeout_s(self.read_only)) from exc

    def _damaged(self, exc: json.JSONDecodeError) -> BaseException:
        """The one-line DatabaseError for a stored JSON value that does not parse, naming the row; the
        error itself where the row cannot be found (then it is not the database's fault)."""
        try:
            with self._read_session() as session:
                found = find_damaged_json(session)
        except SQLAlchemyError:  # the search for the row failed too: tell what was found first
            found = None
        if found is None:
            return exc
        return DatabaseError(f"the results database {self.url} has a damaged row: {found.describe()}; {found.remedy()}")

    def _check_same_file(self) -> None:
        if self._path is None:
            return
        now = _file_id(self._path)
        if self._file_id is None:  # a Store made on a file not created yet: the first write makes it
            self._file_id = now
        elif now != self._file_id:
            raise DatabaseError(
                f"the results database {self._path} was deleted or replaced while autotune was using it; nothing more "
                f"is written there (what was, went with the old file). Restore it, or pass --db with its new place, "
                f"and run the command again."
            )

    def retry(self, work: Callable[[], T]) -> T:
        """retry_transient, and a failure that outlasts the retries told as one DatabaseError line."""
        try:
            return retry_transient(work)
        except Exception as exc:
            if not (is_database_failure(exc) and is_transient(exc)):
                raise
            raise describe_failure(self.engine.url, exc, retried_s=sum(TRANSIENT_RETRY_DELAYS)) from exc

    def retry_on_conflict(self, work: Callable[[], T]) -> T:
        """Run a get-or-create once more after a unique-key race lost to another process (possible
        on PostgreSQL; on SQLite, BEGIN IMMEDIATE serialises writers)."""
        try:
            return work()
        except IntegrityError:
            return work()

    def find_study(self, session: Session, name: str | None) -> Study:
        name = check_study_lookup(name)
        if name is None:
            study = session.scalars(select(Study).order_by(Study.updated_at.desc(), Study.id.desc()).limit(1)).first()
            if study is None:
                raise StudyNotFound(f"no studies in {self.url} yet; run `autotune search` first, or pass --db.")
            return study
        study = session.scalars(select(Study).where(Study.name == name)).one_or_none()
        if study is None:
            raise StudyNotFound(self.not_found_message(name))
        return study

    def not_found_message(self, name: str) -> str:
        return f"no study named {name!r} in {self.url}; list them with `autotune studies`."


def _file_id(path: os.PathLike[str] | str) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`; None when nothing is there."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino
