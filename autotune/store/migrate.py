"""Schema revisions: reading a database's revision, creating or upgrading it, refusing one that is too new.

A database without our tables is created at the head in one step (create_schema: the models'
tables and the version row, Alembic's "Building an Up to Date Database from Scratch"); one at an
older revision is upgraded by the migration scripts. Alembic is imported only here and only for
an upgrade, so that read commands, and the first command on a new database, start without it. The migration scripts live in
`autotune/store/migrations/` (the package `autotune.store.migrations`); the Alembic
configuration is built in code, so no alembic.ini is needed at run time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Column, Connection, Engine, MetaData, PrimaryKeyConstraint, String, Table, inspect, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from autotune.vocabulary.errors import DatabaseError
from autotune.store.damage import check_tables
from autotune.store.engine import (
    busy_timeout_s,
    display_url,
    is_sqlite,
    make_engine,
    read_only_reason,
    sqlite_path,
    writer,
)
from autotune.store.failures import describe_failure
from autotune.store.schema import SCHEMA_REVISION, TABLE_PREFIX, VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config

# Any constant: PostgreSQL advisory lock that serialises concurrent upgrades of one database.
_PG_UPGRADE_LOCK = 0x6175746F74756E  # 'autotun'
# Another, held for the whole of a schema creation (schema_lock): ours and Optuna's tables.
_PG_SCHEMA_LOCK = 0x6175746F74756F
UPGRADE_HINT = "pip install -U autotune"
# How long a process waits for another to finish creating or upgrading the schema (schema_lock).
SCHEMA_LOCK_TIMEOUT_S = 120
# Optuna's tables (optuna/storages/_rdb/models.py, and its Alembic's default version table): a
# database holding only these is an Optuna storage autotune may share, not another application's.
OPTUNA_TABLES = ("studies", "trials", "version_info", "alembic_version")
OPTUNA_TABLE_PREFIXES = ("study_", "trial_")
# Alembic's version table as its MigrationContext makes it (a test holds the two equal), so that a
# database created at the head without Alembic is upgraded by Alembic later like any other.
VERSION_ROWS = Table(
    VERSION_TABLE,
    MetaData(),
    Column("version_num", String(32), nullable=False),
    PrimaryKeyConstraint("version_num", name=f"{VERSION_TABLE}_pkc"),
)


def script_location() -> Path:
    """The migrations' directory: the package `autotune.store.migrations`, wherever it is installed."""
    import autotune.store.migrations as migrations

    return Path(migrations.__file__).parent


def alembic_config(connection: Connection | None = None, url: URL | None = None) -> Config:
    """An Alembic Config for our migrations, built in code. With `connection`, env.py migrates on it
    (inside the caller's transaction); with only `url`, env.py makes its own engine."""
    from alembic.config import Config

    config = Config()
    # ConfigParser interpolates '%': a path or password containing one must be escaped.
    config.set_main_option("script_location", str(script_location()).replace("%", "%%"))
    config.set_main_option("version_table", VERSION_TABLE)
    # New scripts are named by their readable revision id alone: versions/0002_add_x.py.
    config.set_main_option("file_template", "%%(rev)s")
    if url is not None:
        config.set_main_option("sqlalchemy.url", url.render_as_string(hide_password=False).replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def known_revisions() -> set[str]:
    """Every revision id the installed migrations know."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory(str(script_location()))
    return {script.revision for script in scripts.walk_revisions()}


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(script_location())).get_current_head()


def current_revision(connection: Connection) -> str | None:
    """The database's revision, or None for a database without our tables. Uses no Alembic."""
    if not inspect(connection).has_table(VERSION_TABLE):
        return None
    revisions = [row[0] for row in connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))]
    if len(revisions) > 1:  # we keep one linear history; branches mean someone else wrote here
        raise DatabaseError(
            f"the results database has several schema heads ({', '.join(sorted(revisions))}); it was not written by autotune alone."
        )
    return revisions[0] if revisions else None


def has_our_tables(connection: Connection) -> bool:
    return any(name.startswith(TABLE_PREFIX) for name in inspect(connection).get_table_names())


@dataclass(frozen=True, slots=True)
class Survey:
    """What a database holds, read before anything is written to it."""

    revision: str | None
    tables: tuple[str, ...]

    @property
    def ours(self) -> bool:
        return self.revision is not None or any(name.startswith(TABLE_PREFIX) for name in self.tables)

    @property
    def foreign(self) -> tuple[str, ...]:
        """Tables neither autotune's nor Optuna's."""
        return tuple(
            name
            for name in self.tables
            if not name.startswith(TABLE_PREFIX)
            and name not in OPTUNA_TABLES
            and not name.startswith(OPTUNA_TABLE_PREFIXES)
        )


NOTHING = Survey(None, ())


def survey(engine: Engine, *, read_only: bool) -> Survey:
    """The database's revision and tables, through `engine` (one that writes nothing on connect:
    make_engine(read_only=True)). A missing or empty SQLite file holds nothing and is not opened
    (opening would create it). A database at SCHEMA_REVISION is also checked for every table and
    column of it (damage.check_tables). Another process's lock is waited on for as long as a
    read-only (or a writing) store waits, then told in one line with the figure."""
    url = engine.url
    path = sqlite_path(url)
    if path is not None:
        try:
            if path.stat().st_size == 0:
                return NOTHING
        except FileNotFoundError:
            return NOTHING
        except OSError:
            pass  # (opening it says what is wrong, in describe_failure's words)

    def look() -> Survey:
        with engine.connect() as connection:
            found = Survey(current_revision(connection), tuple(sorted(inspect(connection).get_table_names())))
            if found.revision == SCHEMA_REVISION:
                check_tables(connection, display_url(url), SCHEMA_REVISION)
            return found

    limit = busy_timeout_s(read_only)
    started = time.monotonic()
    while True:
        try:
            return look()
        except (sa_exc.OperationalError, sa_exc.DatabaseError, sa_exc.InterfaceError) as exc:
            # SQLite answers "database is locked" without waiting in a few cases (another process
            # switching a new file to WAL, or recovering its WAL): those pass in a moment.
            waited = time.monotonic() - started
            if _sqlite_busy(exc) and waited < limit:
                time.sleep(0.1)
                continue
            raise describe_failure(url, exc, waited_s=waited if _sqlite_busy(exc) else None) from None


def refuse_foreign(url: URL, found: Survey) -> None:
    """DatabaseError when the SQLite file at `url` is another application's: it has tables, and none
    of them autotune's or Optuna's. Creating autotune's tables in it would change a file that is not
    ours. (A server database is left to its owners: teams share one among applications, and our
    tables carry a prefix to sit beside others.)"""
    if not is_sqlite(url) or found.ours or not found.foreign:
        return
    raise DatabaseError(
        f"{display_url(url)} is not autotune's database: it holds another application's tables "
        f"({_names(found.foreign)}) and none of autotune's, and autotune changes nothing in it; pass "
        f"--db with autotune's database or a new file (e.g. autotune.db)."
    )


def _names(tables: tuple[str, ...]) -> str:
    return ", ".join(tables[:3]) + (f" and {len(tables) - 3} more" if len(tables) > 3 else "")


@contextmanager
def schema_lock(url: URL | str, *, timeout_s: float = SCHEMA_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold this while creating or upgrading a database's schema, so that a second process doing
    the same waits and then finds it done. autotune's migrations take it (upgrade); Optuna's
    RDBStorage, which creates its tables, version row and Alembic stamp with no lock of its own
    (two searches started together on a new database: `table studies already exists`, or a
    duplicate alembic_version row), must be built under it too.

    SQLite file: an flock on the file's directory (nothing is left beside the database; the
    directory must exist; where the file system has no flock, as on some network file systems,
    nothing is locked). PostgreSQL: a session advisory lock. Other backends: nothing."""
    url = make_url(url) if isinstance(url, str) else url
    path = sqlite_path(url)
    if path is not None:
        with _directory_lock(path.parent, timeout_s, display_url(url)):
            yield
    elif url.get_backend_name() == "postgresql":
        with _pg_session_lock(url):
            yield
    else:
        yield


@contextmanager
def _directory_lock(directory: Path, timeout_s: float, where: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: nothing to lock with
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # no directory (yet), or not one we may open: creating the database says what is wrong
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DatabaseError(
                        f"another process has been creating or upgrading the schema of {where} for "
                        f"{timeout_s:.0f} s; wait for it to finish (or end it), then run the command "
                        f"again."
                    ) from None
                time.sleep(0.05)
            except OSError:  # no flock on this file system: go on unlocked, as before there was a lock
                break
        yield
    finally:
        os.close(fd)  # (releases the lock)


@contextmanager
def _pg_session_lock(url: URL) -> Iterator[None]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            try:
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _PG_SCHEMA_LOCK})
                connection.commit()
            except (sa_exc.OperationalError, sa_exc.DatabaseError, sa_exc.InterfaceError) as exc:
                raise describe_failure(url, exc) from None
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _PG_SCHEMA_LOCK})
                connection.commit()
    finally:
        engine.dispose()


def newer_error(url: URL, revision: str) -> DatabaseError:
    return DatabaseError(
        f"the results database {display_url(url)} is at schema revision {revision!r}, newer than this "
        f"autotune knows (up to {SCHEMA_REVISION!r}); upgrade autotune: {UPGRADE_HINT}"
    )


def upgrade(url: URL, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade the database at `url` to `revision` in one transaction; returns (before, after).

    Concurrent upgrades of one database serialise: schema_lock, and within it SQLite's BEGIN
    IMMEDIATE and PostgreSQL's advisory lock. The revision is read again under the lock, so the
    second process finds nothing to do. Before anything is written: another application's SQLite
    file is refused (refuse_foreign), a database already at the head is left alone (even one this
    process cannot write), and one this process cannot write is refused.
    """
    look = make_engine(url, read_only=True)
    try:
        found = survey(look, read_only=True)
    finally:
        look.dispose()
    refuse_foreign(url, found)
    if found.revision is not None and found.revision not in known_revisions():
        raise newer_error(url, found.revision)
    to_head = revision in ("head", SCHEMA_REVISION)
    if to_head and found.revision == SCHEMA_REVISION:
        return found.revision, found.revision
    reason = read_only_reason(url)
    if reason is not None:
        state = "has no schema yet" if found.revision is None else f"is at the older schema revision {found.revision!r}"
        raise DatabaseError(
            f"the results database {display_url(url)} is read-only ({reason}), and it {state}: making "
            f"it {SCHEMA_REVISION!r} writes; make it and its directory writable (chmod u+w), or pass "
            f"--db with a writable path."
        )
    # Foreign keys off on SQLite: a batch migration rebuilds a table by dropping it, and with
    # foreign keys on that drop would cascade into the rows referring to it.
    migration_engine = make_engine(url, foreign_keys=False)
    try:
        with schema_lock(url), writer(migration_engine).begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_UPGRADE_LOCK})
            before = current_revision(connection)
            if before is not None and before not in known_revisions():
                raise newer_error(url, before)
            if before is None and to_head and not has_our_tables(connection):
                create_schema(connection)
            else:
                from alembic import command

                command.upgrade(alembic_config(connection), revision)
            after = current_revision(connection)
            if is_sqlite(url):
                # Foreign keys were not enforced during the migration: check before committing.
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise DatabaseError(
                        f"upgrading {display_url(url)} would break {len(broken)} foreign key(s) (first: {tuple(broken[0])}); nothing was changed."
                    )
    except (sa_exc.OperationalError, sa_exc.DatabaseError, sa_exc.InterfaceError) as exc:
        raise describe_failure(url, exc) from None
    finally:
        migration_engine.dispose()
    return before, after


def create_schema(connection: Connection) -> None:
    """Our tables at SCHEMA_REVISION in a database that has none of them, in the caller's
    transaction: the models' tables and the version row. Replaying every migration instead costs
    a tenth of a second or more (SQLite's batch migrations rebuild tables) on every new database,
    and tests/store/test_schema.py holds the two ways to the same schema."""
    from autotune.store.schema import Base

    Base.metadata.create_all(connection, checkfirst=False)
    VERSION_ROWS.create(connection)
    connection.execute(VERSION_ROWS.insert().values(version_num=SCHEMA_REVISION))


def _sqlite_busy(exc: BaseException) -> bool:
    """Narrower than failures.is_transient on purpose: opening a database whose server refuses
    the connection (a mistyped --db) should fail now, not after a minute of retries."""
    return isinstance(exc, sa_exc.OperationalError) and "database is locked" in str(exc)


def ensure_current(engine: Engine, *, auto_upgrade: bool | None = None, read_only: bool = False) -> str:
    """Make sure the database behind `engine` is at SCHEMA_REVISION, upgrading it when allowed.

    `engine` should write nothing on connect (make_engine(read_only=True)): the database is read
    before it is known to be autotune's. `auto_upgrade=None` (the default) upgrades a local SQLite database, and creates the tables in
    a server database that has none of ours yet; a server database at an older revision is shared
    by a team, so it waits for an explicit `autotune db upgrade`. True always upgrades; False never.
    A database at an unknown (newer) revision is refused. `read_only`: never upgrade, and a
    database without our tables is told apart (nothing was searched there). Returns the revision.
    """
    url = engine.url
    found = survey(engine, read_only=read_only)
    if not read_only:
        refuse_foreign(url, found)
    revision, ours = found.revision, found.ours
    if revision == SCHEMA_REVISION:
        return revision
    if revision is not None and revision not in known_revisions():
        raise newer_error(url, revision)
    if read_only and not ours:
        foreign = found.foreign if is_sqlite(url) else ()
        other = (
            f", in a new file: this one holds another application's tables ({_names(foreign)}); check --db"
            if foreign
            else " (or check --db)"
        )
        raise DatabaseError(
            f"the results database {display_url(url)} has no autotune tables; `autotune search` creates them{other}."
        )
    allowed = False if read_only else auto_upgrade if auto_upgrade is not None else (is_sqlite(url) or not ours)
    if not allowed:
        raise DatabaseError(
            f"the results database {display_url(url)} is at schema revision {revision!r}, older than this "
            f"autotune's {SCHEMA_REVISION!r}; upgrade it: autotune db upgrade --db {display_url(url)}"
        )
    _, after = upgrade(url)
    if after != SCHEMA_REVISION:  # pragma: no cover - SCHEMA_REVISION out of step with the scripts
        raise RuntimeError(f"upgraded to {after!r}, but this code expects {SCHEMA_REVISION!r}")
    return after


def compare_schema(connection: Connection) -> list[Any]:
    """Differences between the models and the database, as Alembic's autogenerate sees them
    (with our filters): empty when the migrations and the models agree."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from autotune.store.schema import Base
    from autotune.store.migrations.filters import include_name, include_object

    context = MigrationContext.configure(
        connection,
        opts={
            "compare_type": True,
            "compare_server_default": True,
            "include_name": include_name,
            "include_object": include_object,
            "version_table": VERSION_TABLE,
            "render_as_batch": is_sqlite(connection.engine.url),
        },
    )
    return list(compare_metadata(context, Base.metadata))


def new_revision(message: str) -> Path:
    """Developers: autogenerate the next revision (`NNNN_slug`) from the models, against a scratch
    SQLite database upgraded to the current head. Returns the new script's path."""
    import re
    import tempfile

    from alembic import command

    from autotune.store.engine import resolve_url

    slug = re.sub(r"[^a-z0-9]+", "_", message.lower()).strip("_")[:40] or "change"
    numbers = [int(m.group(1)) for m in (re.match(r"(\d{4})_", r) for r in known_revisions()) if m]
    rev_id = f"{max(numbers, default=0) + 1:04d}_{slug}"
    with tempfile.TemporaryDirectory() as scratch:
        url = resolve_url(Path(scratch) / "scratch.db")
        engine = make_engine(url, foreign_keys=False)
        try:
            # By the scripts, not create_schema: autogenerate compares the models with what the
            # scripts build, and create_schema would build the changed models themselves.
            if numbers:
                with writer(engine).begin() as connection:
                    command.upgrade(alembic_config(connection), "head")
            with writer(engine).begin() as connection:
                script = command.revision(alembic_config(connection), message, autogenerate=True, rev_id=rev_id)
        finally:
            engine.dispose()
    assert script is not None and not isinstance(script, list)
    return Path(script.path)


if __name__ == "__main__":  # pragma: no cover - a developer tool
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "revision":
        sys.exit("usage: python -m autotune.store.migrate revision MESSAGE")
    print(new_revision(sys.argv[2]))
