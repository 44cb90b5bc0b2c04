"""A throwaway PostgreSQL server for the store and fleet tests (the fixtures are in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _postgres_bin() -> Path:
    """$AUTOTUNE_TEST_PG_BIN, else the newest of Debian's /usr/lib/postgresql/<version>/bin."""
    if "AUTOTUNE_TEST_PG_BIN" in os.environ:
        return Path(os.environ["AUTOTUNE_TEST_PG_BIN"])
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0
    )
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


POSTGRES_BIN = _postgres_bin()


class PostgresServer:
    """A private PostgreSQL server on 127.0.0.1, trusting local connections as `postgres`."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new, empty database; returns its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(
            host=self.host, port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(
            host=self.host, port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def postgres_unavailable() -> str | None:
    import importlib.util
    import pwd

    for tool in ("initdb", "pg_ctl", "postgres"):
        if not (POSTGRES_BIN / tool).exists():
            return f"PostgreSQL binaries not found in {POSTGRES_BIN} (set AUTOTUNE_TEST_PG_BIN)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
        if not shutil.which("runuser"):
            return "running as root and runuser is missing"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install 'autotune[postgres]')"
    return None
