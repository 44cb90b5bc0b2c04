"""Schema revisions: reading a database's revision, upgrading it, refusing one that is too new.

Alembic is imported only here and only when a database is not already at SCHEMA_REVISION, so that
read commands on an up-to-date database start without it. The migration scripts live in the
repository's top-level `migrations/` folder, installed as `autotune.store.migrations`; the Alembic
configuration is built in code, so no alembic.ini is needed at run time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL

from autotune.errors import DatabaseError
from autotune.store.base import retry_transient
from autotune.store.engine import display_url, is_sqlite, make_engine, writer
from autotune.store.failures import describe_failure
from autotune.store.schema import SCHEMA_REVISION, TABLE_PREFIX, VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config

# Any constant: PostgreSQL advisory lock that serialises concurrent upgrades of one database.
_PG_UPGRADE_LOCK = 0x6175746F74756E  # 'autotun'
UPGRADE_HINT = "pip install -U autotune"


def script_location() -> Path:
    """The migrations' directory, installed as `autotune.store.migrations` (the repository's
    top-level migrations/ folder)."""
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
        raise DatabaseError(f"the results database has several schema heads ({', '.join(sorted(revisions))}); it was not written by autotune alone.")
    return revisions[0] if revisions else None


def has_our_tables(connection: Connection) -> bool:
    return any(name.startswith(TABLE_PREFIX) for name in inspect(connection).get_table_names())


def newer_error(url: URL, revision: str) -> DatabaseError:
    return DatabaseError(
        f"the results database {display_url(url)} is at schema revision {revision!r}, newer than this "
        f"autotune knows (up to {SCHEMA_REVISION!r}); upgrade autotune: {UPGRADE_HINT}"
    )


def upgrade(url: URL, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade the database at `url` to `revision` in one transaction; returns (before, after).

    Concurrent upgrades of one database serialise: SQLite's BEGIN IMMEDIATE, PostgreSQL's advisory
    lock. The revision is read again under the lock, so the second process finds nothing to do.
    """
    from alembic import command

    # Foreign keys off on SQLite: a batch migration rebuilds a table by dropping it, and with
    # foreign keys on that drop would cascade into the rows referring to it.
    migration_engine = make_engine(url, foreign_keys=False)
    try:
        with writer(migration_engine).begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_UPGRADE_LOCK})
            before = current_revision(connection)
            if before is not None and before not in known_revisions():
                raise newer_error(url, before)
            command.upgrade(alembic_config(connection), revision)
            after = current_revision(connection)
            if is_sqlite(url):
                # Foreign keys were not enforced during the migration: check before committing.
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise DatabaseError(f"upgrading {display_url(url)} would break {len(broken)} foreign key(s) (first: {tuple(broken[0])}); nothing was changed.")
    except (sa_exc.OperationalError, sa_exc.DatabaseError, sa_exc.InterfaceError) as exc:
        raise describe_failure(url, exc) from None
    finally:
        migration_engine.dispose()
    return before, after


def _sqlite_busy(exc: BaseException) -> bool:
    """Narrower than failures.is_transient on purpose: opening a database whose server refuses
    the connection (a mistyped --db) should fail now, not after a minute of retries."""
    return isinstance(exc, sa_exc.OperationalError) and "database is locked" in str(exc)


def ensure_current(engine: Engine, *, auto_upgrade: bool | None = None, read_only: bool = False) -> str:
    """Make sure the database behind `engine` is at SCHEMA_REVISION, upgrading it when allowed.

    `auto_upgrade=None` (the default) upgrades a local SQLite database, and creates the tables in
    a server database that has none of ours yet; a server database at an older revision is shared
    by a team, so it waits for an explicit `autotune db upgrade`. True always upgrades; False never.
    A database at an unknown (newer) revision is refused. `read_only`: never upgrade, and a
    database without our tables is told apart (nothing was searched there). Returns the revision.
    """
    url = engine.url

    def look() -> tuple[str | None, bool]:
        with engine.connect() as connection:
            revision = current_revision(connection)
            return revision, revision is not None or has_our_tables(connection)

    try:
        # SQLite answers "database is locked" without waiting in a few cases (another process
        # switching a new file to WAL, or recovering its WAL): those pass in a moment.
        revision, ours = retry_transient(look, transient=_sqlite_busy)
    except (sa_exc.OperationalError, sa_exc.DatabaseError, sa_exc.InterfaceError) as exc:
        raise describe_failure(url, exc) from None
    if revision == SCHEMA_REVISION:
        return revision
    if revision is not None and revision not in known_revisions():
        raise newer_error(url, revision)
    if read_only and not ours:
        raise DatabaseError(f"the results database {display_url(url)} has no autotune tables; `autotune search` "
                            f"creates them (or check --db).")
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
        if numbers:
            upgrade(url)
        engine = make_engine(url, foreign_keys=False)
        try:
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
