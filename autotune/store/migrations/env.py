"""Alembic environment for autotune's results database.

Called by `autotune.store.migrate`, which passes an open connection inside its own transaction
(`config.attributes["connection"]`), or with a `sqlalchemy.url` main option for offline SQL.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import Connection

from autotune.store.schema import VERSION_TABLE, Base, UTCDateTime
from autotune.store.migrations.filters import include_name, include_object

config = context.config
target_metadata = Base.metadata


def render_item(type_: str, obj: object, autogen_context: object) -> str | bool:
    """Render our column types as plain SQLAlchemy ones, so that a migration script never imports
    the product code it may outlive."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _options(dialect_name: str) -> dict[str, Any]:
    return {
        "target_metadata": target_metadata,
        # Our own version table: Optuna keeps its revision in `alembic_version` in the same database.
        "version_table": VERSION_TABLE,
        "include_name": include_name,
        "include_object": include_object,
        "compare_type": True,
        "compare_server_default": True,
        "render_item": render_item,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        "render_as_batch": dialect_name == "sqlite",
    }


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`--sql`) instead of running it."""
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("offline migrations need the sqlalchemy.url option")
    from sqlalchemy.engine import make_url

    context.configure(url=url, literal_binds=True, **_options(make_url(url).get_backend_name()))
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    # On SQLite our engine issues BEGIN itself, so DDL is transactional there too.
    context.configure(connection=connection, transactional_ddl=True, **_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from sqlalchemy.engine import make_url

    from autotune.store.engine import make_engine, writer

    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("give a connection in config.attributes['connection'] or the sqlalchemy.url option")
    engine = make_engine(make_url(url), foreign_keys=False)
    try:
        with writer(engine).begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
