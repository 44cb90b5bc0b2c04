"""The store's plumbing: its engine and sessions, the one retry policy for writes, and finding a
study by name. The Store (store.py) and its parts (claims.py, runs.py) build on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from autotune.errors import StudyNotFound
from autotune.store.engine import display_url, writer
from autotune.store.schema import Study

T = TypeVar("T")

# A write that fails because the connection dropped (a server restart, a proxy, a network blip) is
# tried again after these pauses, so that a probe that took minutes is not lost to a moment's outage.
TRANSIENT_RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0)


def is_transient(exc: BaseException) -> bool:
    """A database error worth trying again: the connection was lost or the server was busy, as
    opposed to a mistake in the statement or the data."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


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


class StoreBase:
    """Engine, sessions and shared helpers of the Store."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        # Writes take SQLite's write lock at BEGIN, so concurrent writers queue (busy_timeout)
        # instead of failing on a lock upgrade.
        self._write = sessionmaker(writer(engine), expire_on_commit=False)

    @property
    def url(self) -> str:
        """The database, for messages (password hidden)."""
        return display_url(self.engine.url)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        with self._write.begin() as session:
            yield session

    def _retry_transient(self, work: Callable[[], T]) -> T:
        return retry_transient(work)

    def _retry_on_conflict(self, work: Callable[[], T]) -> T:
        """Run a get-or-create once more after a unique-key race lost to another process (possible
        on PostgreSQL; on SQLite, BEGIN IMMEDIATE serialises writers)."""
        try:
            return work()
        except IntegrityError:
            return work()

    def _find_study(self, session: Session, name: str | None) -> Study:
        if name is None:
            study = session.scalars(select(Study).order_by(Study.updated_at.desc(), Study.id.desc()).limit(1)).first()
            if study is None:
                raise StudyNotFound(f"no studies in {self.url} yet; run `autotune search` first, or pass --db.")
            return study
        study = session.scalars(select(Study).where(Study.name == name)).one_or_none()
        if study is None:
            raise StudyNotFound(self._not_found_message(name))
        return study

    def _not_found_message(self, name: str) -> str:
        return f"no study named {name!r} in {self.url}; list them with `autotune studies`."

