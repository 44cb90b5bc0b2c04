"""Where the results database is, and how to connect to it.

`--db URL`, else `$AUTOTUNE_DB`, else `autotune.db` in the user data directory (`$AUTOTUNE_HOME`
when set). A value without `://` is a file path and becomes an SQLite URL: a path ending in .db,
.sqlite, .sqlite3 or .db3, or an existing file (a stray word such as `AUTOTUNE_DB=garbage` is
refused rather than made a database in the working directory). Any SQLAlchemy URL works;
PostgreSQL (`postgresql+psycopg://...`) is the one teams use. An in-memory SQLite database is
refused: a search's results (and its Optuna study) must outlive the process and reach its workers.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from autotune.vocabulary.errors import BadInput, DatabaseError
from autotune.host.paths import data_dir

DB_FILENAME = "autotune.db"
# Writers wait this long for another process's write transaction before giving up. Probes take
# seconds to minutes and a write milliseconds, so contention is short; 30 s covers slow disks.
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Commands that only read give up sooner: a reader waits only on a lock another process holds for
# the whole file (`PRAGMA locking_mode=EXCLUSIVE`, a rollback-journal writer, a recovery), which is
# either over in milliseconds or not soon; `autotune studies` should say so, not hang for minutes.
SQLITE_READ_BUSY_TIMEOUT_MS = 5_000
# The execution option that picks the SQLite BEGIN mode of a transaction (see make_engine).
SQLITE_BEGIN_OPTION = "autotune_sqlite_begin"
# PostgreSQL: a server that accepts connections and never answers (a hung host, a firewall that
# drops packets, a proxy with no backend) must not hang every command. Connecting gives up after
# PG_CONNECT_TIMEOUT_S; the server cancels any one statement after PG_STATEMENT_TIMEOUT_S (autotune's
# statements take milliseconds; an upgrade waiting on another process's upgrade lock takes longer).
# A URL that sets `connect_timeout` or `options` itself keeps its own.
PG_CONNECT_TIMEOUT_S = 10
PG_STATEMENT_TIMEOUT_S = 120

# What a plain path (no `scheme://`) must end in to name a new SQLite file.
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3", ".db3")

_NO_MEMORY = (
    "an in-memory SQLite database is gone when this process ends, and the search's Optuna study and "
    "results must outlive it and be shared with its probe workers; give a file path, e.g. --db results.db"
)


def default_url() -> str:
    """The database used when no --db is given: `$AUTOTUNE_DB`, else a file in data_dir()."""
    # An empty (or blank) variable counts as unset, as shells treat `AUTOTUNE_DB=`.
    env = os.environ.get("AUTOTUNE_DB", "").strip()
    if env:
        return env
    return f"sqlite:///{(data_dir() / DB_FILENAME).resolve()}"


def check_service_database(db: str | os.PathLike[str] | None) -> None:
    """A service's or a queue worker's --db: a SQLite file in a directory that exists. They run for
    days against one database, which a typo must not replace with a new empty one somewhere else:
    only the default database's directory (the user data directory) is made for them."""
    if db is None:
        return
    path = sqlite_path(resolve_url(db))
    if path is not None and not path.parent.is_dir():
        raise BadInput(
            f"--db {db}: the directory {path.parent} does not exist; create it first, or give --db a file in a "
            f"directory that does."
        )


def resolve_url(db: str | os.PathLike[str] | None = None) -> URL:
    """The SQLAlchemy URL for a `--db` value (URL or file path), or for the default when None.
    An empty value given explicitly is refused rather than read as "the default": `--db "$VAR"`
    with VAR unset must not write into the user's default database."""
    if db is None:
        text = default_url()
        flag = "$AUTOTUNE_DB" if os.environ.get("AUTOTUNE_DB", "").strip() else "--db"
    else:
        text, flag = os.fspath(db).strip(), "--db"
        if not text:
            raise DatabaseError(
                "--db is empty; give a file path or a database URL, or leave --db out for the default "
                "($AUTOTUNE_DB, else autotune.db in the user data directory)."
            )
    if text == ":memory:":
        raise DatabaseError(f"{flag} {text}: {_NO_MEMORY}.")
    if "://" not in text:
        # A plain path: absolute, so that the database does not depend on the working directory.
        text = f"sqlite:///{_plain_path(text, flag)}"
    try:
        url = make_url(text)
    except (ArgumentError, ValueError):  # (a port that is not a number, an unclosed [IPv6 address] ...)
        shown = re.sub(r"(//[^:/@]*):[^@/]*@", r"\1:***@", text)  # a password stays off the screen
        raise DatabaseError(
            f"{flag}: cannot read {shown!r} as a database URL; give a file path or a URL such as "
            f"sqlite:///path/autotune.db or postgresql+psycopg://user@host/db."
        ) from None
    check_query(url, flag)
    if is_sqlite(url) and not is_sqlite_file(url):
        raise DatabaseError(f"{flag} {text}: {_NO_MEMORY}.")
    path = sqlite_path(url)
    if path is not None:
        _stat(path, flag)
    return url


def _plain_path(text: str, flag: str) -> Path:
    """The absolute path of a --db value given without a scheme, when it names an SQLite file: an
    existing file, or a name ending in one of SQLITE_SUFFIXES."""
    path = Path(text).expanduser()
    found = _stat(path, flag)
    if found is not None and not stat.S_ISDIR(found.st_mode):
        return path.resolve()
    if found is not None:
        raise DatabaseError(f"{flag} {text}: that is a directory; give a file in it, e.g. {path / DB_FILENAME}.")
    if path.suffix.lower() not in SQLITE_SUFFIXES:
        raise DatabaseError(
            f"{flag} {text!r}: neither a database URL (scheme://..., e.g. postgresql+psycopg://user@host/db) "
            f"nor an SQLite file (an existing file, or a path ending in {', '.join(SQLITE_SUFFIXES)}); "
            f"name the file {path.name or 'results'}.db, or write sqlite:///{text} to use the name as it is."
        )
    return path.resolve()


def _stat(path: Path, flag: str) -> os.stat_result | None:
    """The file's status, None when there is none yet; DatabaseError when the path cannot name a
    file (a name past the file system's limit, a directory that cannot be searched), so that
    nothing is created on the way to finding out."""
    try:
        return path.stat()
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        hint = "give a shorter path" if exc.errno == errno.ENAMETOOLONG else "give a path you can read and write"
        raise DatabaseError(
            f"{flag}: cannot use {str(path)[:120]}{'...' if len(str(path)) > 120 else ''} as the "
            f"results database ({exc.strerror}); {hint}."
        ) from None


# The query parameters of an SQLite URL: those SQLAlchemy hands to Python's sqlite3.connect (it
# converts each with the type given, and a value it cannot convert is a ValueError at connect time),
# and those of SQLite's own file: URIs, which take effect only with uri=true. isolation_level is
# left out on purpose: autotune issues BEGIN itself (make_engine) and would silently override it.
_SQLITE_DRIVER_PARAMETERS = ("uri", "timeout", "detect_types", "check_same_thread", "cached_statements")
_SQLITE_URI_PARAMETERS = {
    "mode": ("ro", "rw", "rwc", "memory"),
    "cache": ("shared", "private"),
    "immutable": None,
    "nolock": None,
    "psow": None,
    "vfs": None,
    "modeof": None,
}
_TRUE = ("true", "yes", "on", "y", "t", "1")
_FALSE = ("false", "no", "off", "n", "f", "0")


def check_query(url: URL, flag: str = "--db") -> None:
    """DatabaseError naming the first query parameter of `url` that cannot be used: given twice,
    unknown to SQLite, a value of the wrong kind, or an SQLite URI parameter without `uri=true` and a
    `file:` URI (without them SQLite ignores it, or takes the whole string as a file name). Checked
    before anything connects, so that a mistyped parameter is one line, not a ValueError from the
    driver. Other backends: a parameter given twice, and PostgreSQL's connect_timeout."""
    query: dict[str, str] = {}
    for key, value in url.query.items():
        if not isinstance(value, str):
            raise DatabaseError(f"{flag}: the query parameter {key!r} is given {len(value)} times; give it once.")
        query[key] = value
    if url.get_backend_name() == "postgresql" and "connect_timeout" in query:
        _whole(flag, "connect_timeout", query["connect_timeout"], "seconds", 0, 2**31 - 1)
    if not is_sqlite(url):
        return
    known = ", ".join((*_SQLITE_DRIVER_PARAMETERS, *_SQLITE_URI_PARAMETERS))
    for key, value in query.items():
        if key == "isolation_level":
            raise DatabaseError(
                f"{flag}: remove isolation_level={value}; autotune begins its own transactions "
                f"(DEFERRED to read, IMMEDIATE to write) and would override it."
            )
        if key not in _SQLITE_DRIVER_PARAMETERS and key not in _SQLITE_URI_PARAMETERS:
            raise DatabaseError(
                f"{flag}: SQLite takes no query parameter {key!r}; remove it (those it takes: {known})."
            )
    uri = _boolean(flag, "uri", query["uri"]) if "uri" in query else False
    for key in ("check_same_thread",):
        if key in query:
            _boolean(flag, key, query[key])
    if "timeout" in query:
        try:
            seconds = float(query["timeout"])
        except ValueError:
            seconds = float("nan")
        if not 0 <= seconds <= 2**31 / 1000:  # (nan fails too) sqlite3 takes milliseconds in a C int
            raise DatabaseError(
                f"{flag}: timeout={query['timeout']!r} is not a number of seconds from 0 to "
                f"{2**31 // 1000}; write e.g. ?timeout=30, or leave it out."
            )
    if "detect_types" in query:
        _whole(
            flag,
            "detect_types",
            query["detect_types"],
            "a sum of sqlite3.PARSE_DECLTYPES (1) and PARSE_COLNAMES (2)",
            0,
            3,
        )
    if "cached_statements" in query:
        _whole(flag, "cached_statements", query["cached_statements"], "statements", 0, 2**31 - 1)
    uri_keys = [key for key in query if key in _SQLITE_URI_PARAMETERS]
    if uri_keys and not (uri and str(url.database).startswith("file:")):
        example = (
            f"sqlite:///file:{str(url.database).removeprefix('file:')}?{uri_keys[0]}={query[uri_keys[0]]}&uri=true"
        )
        raise DatabaseError(
            f"{flag}: {uri_keys[0]}={query[uri_keys[0]]} takes effect only in an SQLite file: URI "
            f"with uri=true (without them SQLite ignores it, or makes a file of that name); write "
            f"{example}"
        )
    for key in uri_keys:
        allowed = _SQLITE_URI_PARAMETERS[key]
        if allowed is not None and query[key] not in allowed:
            raise DatabaseError(f"{flag}: {key}={query[key]!r} is not one of {', '.join(allowed)}; fix or remove it.")
        if allowed is None and key in ("immutable", "nolock", "psow"):
            _boolean(flag, key, query[key])


def _boolean(flag: str, key: str, value: str) -> bool:
    low = value.strip().lower()
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise DatabaseError(
        f"{flag}: {key}={value!r} is neither true nor false; write {key}=true or {key}=false, or leave it out."
    )


def _whole(flag: str, key: str, value: str, unit: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise DatabaseError(
            f"{flag}: {key}={value!r} is not a whole number from {low} to {high} ({unit}); fix it, or leave it out."
        )
    return number


def read_only_reason(url: URL) -> str | None:
    """Why this process cannot write the SQLite file behind `url` (None when it can, or it is not
    an SQLite file): the URL opens it read-only, the file is not writable, or its directory is not
    (a WAL database keeps -wal and -shm files beside it). Root passes the permission checks, as it
    passes SQLite's."""
    path = sqlite_path(url)
    if path is None:
        return None
    exists = path.exists()
    if exists and not os.access(path, os.W_OK):
        return "the file is not writable"
    parent = path.parent
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        if not exists:
            return "its directory is not writable"
        if not (Path(f"{path}-wal").exists() and Path(f"{path}-shm").exists()):
            return "its directory is not writable, and SQLite keeps -wal and -shm files beside the database"
    if url.query.get("mode") == "ro":
        return "mode=ro in --db"
    if str(url.query.get("immutable", "0")).strip().lower() in _TRUE:
        return "immutable in --db"
    return None


def busy_timeout_s(read_only: bool) -> float:
    """How long a connection of a read-only (or a writing) store waits for another process's lock."""
    return (SQLITE_READ_BUSY_TIMEOUT_MS if read_only else SQLITE_BUSY_TIMEOUT_MS) / 1000


def _untouched(url: URL, path: Path) -> URL:
    """`url` opening the file immutable (SQLite creates no -wal or -shm beside it and takes no locks),
    for a database this process cannot write anyway, and with no -wal or -journal beside it, so that
    everything committed is in the file itself. Reading a WAL database read-only otherwise leaves
    -wal and -shm files behind, which only a writer's close removes."""
    if any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-journal")):
        return url
    query = {key: value for key, value in url.query.items() if key != "uri"}
    query.update(mode="ro", immutable="1", uri="true")
    return url.set(database=f"file:{quote(str(path), safe='/')}", query=query)


def display_url(url: URL) -> str:
    """The URL for messages: a file path for SQLite, the password hidden otherwise."""
    path = sqlite_path(url)
    if path is not None:
        return str(path)
    return url.render_as_string(hide_password=True)


def is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def is_sqlite_file(url: URL) -> bool:
    return (
        is_sqlite(url)
        and url.database not in (None, "", ":memory:")
        and url.query.get("mode") != "memory"
        and not str(url.database).startswith("file::memory:")
    )


def sqlite_path(url: URL) -> Path | None:
    """The file behind an SQLite URL (None for another database): the path itself, or the path part
    of a `file:` URI (`sqlite:///file:/data/a.db?mode=ro&uri=true`)."""
    if not is_sqlite_file(url):
        return None
    database = str(url.database)
    if url.query.get("uri") in ("true", "1") and database.startswith("file:"):
        return Path(unquote(urlsplit(database).path))
    return Path(database)


def make_engine(url: URL, *, foreign_keys: bool = True, read_only: bool = False) -> Engine:
    """An engine with our connection settings.

    SQLite: WAL (readers never block the writer, so a leaderboard can be read during a search),
    a busy timeout (several processes write probes to one file), foreign keys on (off only for
    migrations, where batch table rebuilds would otherwise cascade deletes). `read_only`: for
    commands that only read, no directory is created, the file's journal mode is left as it is
    (switching to WAL rewrites the file's header), and another process's lock is waited on for
    SQLITE_READ_BUSY_TIMEOUT_MS only. A file this process cannot write (read_only_reason) is opened
    immutable where nothing is pending beside it, so that reading it leaves no -wal or -shm files.

    PostgreSQL: a connect timeout and a statement timeout (PG_CONNECT_TIMEOUT_S,
    PG_STATEMENT_TIMEOUT_S), and dead pooled connections replaced quietly.

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
        kwargs["connect_args"] = postgres_connect_args(url)
    path = sqlite_path(url)
    if path is not None and read_only_reason(url) is not None:
        url = _untouched(url, path)  # (writes fail as they would, "attempt to write a readonly database")
    if path is not None and not read_only:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatabaseError(
                f"cannot create the directory of the results database {path.parent}: {exc.strerror}; pass --db with a writable path."
            ) from None
    try:
        engine = create_engine(url, **kwargs)
    except NoSuchModuleError:
        raise DatabaseError(
            f"--db: no SQLAlchemy dialect for {url.drivername!r}; use sqlite:///path or postgresql+psycopg://..."
        ) from None
    except ModuleNotFoundError as exc:
        hint = " (pip install 'autotune[postgres]')" if url.get_backend_name() == "postgresql" else ""
        raise DatabaseError(f"--db: the database driver {exc.name!r} is not installed{hint}.") from None

    if is_sqlite(url):
        _configure_sqlite(
            engine,
            foreign_keys=foreign_keys,
            wal=not read_only and url.query.get("immutable") != "1",
            busy_timeout_ms=round(busy_timeout_s(read_only) * 1000),
        )
    return engine


def connect_timeout_s(url: URL) -> int:
    """How long a PostgreSQL connection waits for the server: the URL's own `connect_timeout`
    (checked a whole number of seconds before any connection), else PG_CONNECT_TIMEOUT_S."""
    given = url.query.get("connect_timeout")
    return int(given) if isinstance(given, str) and given.strip().isdigit() else PG_CONNECT_TIMEOUT_S


def postgres_connect_args(url: URL) -> dict[str, Any]:
    """psycopg's connect arguments for the timeouts (see PG_CONNECT_TIMEOUT_S), unless the URL sets
    `connect_timeout` or `options` itself. (PgBouncer refuses the `options` startup parameter unless
    its `ignore_startup_parameters` lists it.) For any engine on a PostgreSQL URL, Optuna's included."""
    args: dict[str, Any] = {}
    if "connect_timeout" not in url.query:
        args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
    if "options" not in url.query:
        args["options"] = f"-c statement_timeout={PG_STATEMENT_TIMEOUT_S * 1000}"
    return args


def _configure_sqlite(
    engine: Engine, *, foreign_keys: bool, wal: bool = True, busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS
) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves; see make_engine
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching to WAL takes a lock another process may hold.
            cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
            cursor.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
            if wal and is_sqlite_file(engine.url):
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
