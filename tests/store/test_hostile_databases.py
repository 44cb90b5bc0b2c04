"""Issue 48: a study name that is not text, a database URL whose query cannot be used, a database
that is not autotune's or not whole, read-only or locked, and two processes creating one schema.
Each mistake is one line (exit status 2 at the command line) naming what is wrong, and leaves the
database byte for byte as it was, with nothing beside it."""

from __future__ import annotations

import hashlib
import multiprocessing
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from autotune.vocabulary.errors import BadInput, DatabaseError
from autotune.store import SCHEMA_REVISION, check_study_lookup, open_store, upgrade_database
from autotune.store import engine as store_engine
from autotune.store.schema import VERSION_TABLE
from tests.helpers.store import ENV, config, make_study, result

NOT_UTF8 = b"\xff\xfe".decode("utf-8", "surrogateescape")  # what Python makes of `--study $'\xff\xfe'`


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def beside(path: Path) -> list[str]:
    """The files SQLite keeps beside a database while it is open (or after a read-only close)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name) and p != path)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """The real entry point (autotune.cli.app.main) in this process: (exit status, stdout, stderr)."""
    from autotune.cli import app

    with (
        mock.patch.object(sys, "argv", ["autotune", *args]),
        mock.patch.object(app, "stop_on_signals"),
        mock.patch.object(app, "quiet_openmp"),
    ):
        try:
            app.main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def refused_in_one_line(outcome: tuple[int, str, str], *needles: str) -> str:
    code, out, err = outcome
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def filled(tmp_path) -> Path:
    """A database with a study 's1' and two ok probes, closed (no -wal or -shm beside it)."""
    db = tmp_path / "data" / "results.db"  # (alone in its directory: tmp_path also holds AUTOTUNE_HOME)
    with open_store(db) as store:
        study = make_study(store, "s1")
        store.record_probe(study.id, config(4), result(), env_fingerprint=ENV.fingerprint())
        store.record_probe(study.id, config(8), result(tokens_per_s=2000.0), env_fingerprint=ENV.fingerprint())
    assert beside(db) == []
    return db


# -- 2. a study name that is not text ---------------------------------------------------------------


@pytest.mark.parametrize("command", [["leaderboard"], ["best"], ["report"], ["runs"], ["plot"]])
def test_a_study_name_that_is_not_utf8_is_one_line(capsys, filled, command):
    before = digest(filled)
    line = refused_in_one_line(
        run_cli(capsys, *command, "--study", NOT_UTF8, "--db", str(filled)), "--study '\\xff\\xfe'", "not valid UTF-8"
    )
    assert "surrogates" not in line
    assert digest(filled) == before and beside(filled) == []


def test_every_study_lookup_of_the_store_checks_the_name(filled):
    # worker (join_study), train (study_winner) and plan (plan_for) look their --study up through
    # Store.study, as leaderboard, best, report and plot do.
    with open_store(filled) as store:
        for lookup in (store.study, store.leaderboard, store.probes, store.runs.all):
            with pytest.raises(BadInput, match="not valid UTF-8"):
                lookup(NOT_UTF8)
        with pytest.raises(BadInput, match="cannot be printed"):
            store.study("s1\n")
        with pytest.raises(BadInput, match="no study name is longer than 200"):
            store.study("s" * 10_000)
        with pytest.raises(BadInput, match="--study is empty"):
            store.study("  ")
        assert store.study("s1").name == "s1"


def test_a_looked_up_name_is_checked_more_loosely_than_a_new_one():
    # Names from before check_study_name (a space, accents) must still be found.
    assert check_study_lookup("my old study é") == "my old study é"
    assert check_study_lookup(None) is None
    with pytest.raises(BadInput, match=r"'a\\tb' holds characters that cannot be printed \('\\t'\)"):
        check_study_lookup("a\tb")


# -- 3. the database URL's query string -------------------------------------------------------------

BAD_QUERIES = {
    "timeout=abc": "timeout='abc' is not a number of seconds",
    "timeout=-1": "timeout='-1' is not a number of seconds",
    "detect_types=banana": "detect_types='banana' is not a whole number",
    "check_same_thread=maybe": "check_same_thread='maybe' is neither true nor false",
    "cached_statements=x": "cached_statements='x' is not a whole number",
    "timeout=1&timeout=2": "the query parameter 'timeout' is given 2 times",
    "colour=blue": "SQLite takes no query parameter 'colour'",
    "isolation_level=bogus": "remove isolation_level=bogus",
    "mode=ro": "mode=ro takes effect only in an SQLite file: URI with uri=true",
    "mode=ro&uri=true": "mode=ro takes effect only in an SQLite file: URI",  # (would open 'results.db?mode=ro')
}


@pytest.mark.parametrize("query", list(BAD_QUERIES))
@pytest.mark.parametrize("command", [["studies"], ["db", "upgrade"]])
def test_a_query_parameter_that_cannot_be_used_is_one_line_naming_it(capsys, filled, query, command):
    before = digest(filled)
    refused_in_one_line(run_cli(capsys, *command, "--db", f"sqlite:///{filled}?{query}"), "--db: ", BAD_QUERIES[query])
    assert digest(filled) == before
    assert sorted(p.name for p in filled.parent.iterdir()) == ["results.db"]


def test_a_bad_query_creates_no_new_database(capsys, tmp_path):
    refused_in_one_line(
        run_cli(capsys, "db", "upgrade", "--db", f"sqlite:///{tmp_path}/data/new.db?detect_types=banana"),
        "detect_types='banana'",
    )
    assert not (tmp_path / "data").exists()


def test_good_query_parameters_still_work(filled):
    with open_store(f"sqlite:///{filled}?timeout=2.5&check_same_thread=false&detect_types=0") as store:
        assert store.study("s1").name == "s1"
    with open_store(f"sqlite:///file:{filled}?mode=ro&uri=true", read_only=True) as store:
        assert [row.probe_id for row in store.leaderboard("s1")] == [2, 1]


# -- 4. a database that is not autotune's -----------------------------------------------------------


@pytest.fixture
def other_application(tmp_path) -> Path:
    db = tmp_path / "shop.db"
    with sqlite3.connect(db) as raw:
        raw.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        raw.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer INTEGER)")
        raw.execute("INSERT INTO customers VALUES (1, 'Ada')")
    raw.close()
    return db


@pytest.mark.parametrize(
    "command, needle",
    [
        (["db", "upgrade"], "is not autotune's database: it holds another application's tables (customers, orders)"),
        (
            ["studies"],
            "has no autotune tables; `autotune search` creates them, in a new file: this one holds another "
            "application's tables (customers, orders)",
        ),
        (["leaderboard"], "has no autotune tables"),
    ],
)
def test_another_applications_database_is_refused_and_left_alone(capsys, other_application, command, needle):
    before = digest(other_application)
    refused_in_one_line(run_cli(capsys, *command, "--db", str(other_application)), str(other_application), needle)
    assert digest(other_application) == before and beside(other_application) == []


def test_a_search_on_another_applications_database_never_reaches_optuna(other_application):
    # `search` opens the store to write; before, it added our tables and crashed in Optuna's schema check.
    before = digest(other_application)
    for attempt in (lambda: open_store(other_application), lambda: upgrade_database(other_application)):
        with pytest.raises(DatabaseError, match="is not autotune's database"):
            attempt()
    assert digest(other_application) == before and beside(other_application) == []


def test_an_empty_file_is_a_new_database(tmp_path):
    db = tmp_path / "touched.db"
    db.touch()
    assert upgrade_database(db).after == SCHEMA_REVISION


# -- 4. a database that is not whole ----------------------------------------------------------------


@pytest.mark.parametrize("command", [["leaderboard"], ["best"], ["studies"]])
def test_a_dropped_column_is_one_line_naming_table_and_column(capsys, filled, command):
    with sqlite3.connect(filled) as raw:
        raw.execute("ALTER TABLE autotune_probes DROP COLUMN mfu")
    raw.close()
    before = digest(filled)
    refused_in_one_line(
        run_cli(capsys, *command, "--db", str(filled)),
        "is damaged: table autotune_probes has no column mfu",
        SCHEMA_REVISION,
    )
    assert digest(filled) == before and beside(filled) == []
    with pytest.raises(DatabaseError, match="table autotune_probes has no column mfu"):
        open_store(filled)  # a resuming search


def test_a_dropped_table_is_one_line_naming_it(filled):
    with sqlite3.connect(filled) as raw:
        raw.execute("DROP TABLE autotune_claims")
    raw.close()
    with pytest.raises(DatabaseError, match="it has no table autotune_claims"):
        open_store(filled, read_only=True)


@pytest.mark.parametrize("command", [["leaderboard"], ["best"], ["studies"]])
def test_a_value_that_is_not_json_is_one_line_naming_study_and_row(capsys, filled, command):
    with sqlite3.connect(filled) as raw:
        raw.execute("UPDATE autotune_probes SET phase_peaks = '{oops' WHERE id = 2")
    raw.close()
    before = digest(filled)
    refused_in_one_line(
        run_cli(capsys, *command, "--db", str(filled)),
        "damaged row: study 's1', probe id 2 (autotune_probes): its phase_peaks is not JSON ('{oops')",
    )
    assert digest(filled) == before


def test_a_resuming_search_on_a_damaged_row_is_one_line(filled):
    with sqlite3.connect(filled) as raw:
        raw.execute("UPDATE autotune_studies SET space = 'not json' WHERE name = 's1'")
    raw.close()
    with open_store(filled) as store:
        with pytest.raises(DatabaseError, match=r"study 's1' \(autotune_studies id 1\): its space is not JSON") as info:
            make_study(store, "s1")  # get_or_create_study, as a resumed search does
        assert "\n" not in str(info.value)
        with pytest.raises(DatabaseError, match="its space is not JSON"):
            store.probes("s1")


# -- 4. a read-only database leaves nothing beside it -----------------------------------------------


def test_a_read_only_database_is_read_and_refused_leaving_nothing(capsys, filled):
    url = f"sqlite:///file:{filled}?mode=ro&uri=true"  # (chmod does nothing to root; this does)
    before = digest(filled)
    code, out, err = run_cli(capsys, "studies", "--db", url)
    assert code == 0 and "s1" in out, err
    assert beside(filled) == []
    with open_store(url) as store:
        with pytest.raises(DatabaseError, match=f"the results database {filled} is read-only"):
            make_study(store, "s2")
    assert beside(filled) == [] and digest(filled) == before


def test_upgrading_a_read_only_database_is_refused_leaving_nothing(capsys, filled):
    with sqlite3.connect(filled) as raw:
        raw.execute(f"UPDATE {VERSION_TABLE} SET version_num = '0008_phases'")
    raw.close()
    before = digest(filled)
    refused_in_one_line(
        run_cli(capsys, "db", "upgrade", "--db", f"sqlite:///file:{filled}?mode=ro&uri=true"),
        f"the results database {filled} is read-only (mode=ro in --db)",
        "0008_phases",
    )
    assert beside(filled) == [] and digest(filled) == before


# -- 4. a locked database: a bounded wait, said --------------------------------------------------------

HOLD = """
import sqlite3, sys, time
raw = sqlite3.connect(sys.argv[1], isolation_level=None)
raw.execute("PRAGMA locking_mode = EXCLUSIVE")
raw.execute("BEGIN EXCLUSIVE")
raw.execute("UPDATE autotune_studies SET name = name")
print("held", flush=True)
time.sleep(60)
"""


def test_a_locked_database_is_waited_on_for_a_bounded_time(capsys, filled, monkeypatch):
    monkeypatch.setattr(store_engine, "SQLITE_READ_BUSY_TIMEOUT_MS", 1000)  # (5 s in the product)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(filled)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        refused_in_one_line(
            run_cli(capsys, "studies", "--db", str(filled)),
            f"the results database {filled} is locked by another process; waited 1 s",
        )
        assert time.monotonic() - started < 4  # (before: 287 s)
    finally:
        holder.kill()
        holder.wait()


# -- 8. two processes creating one new database's schema at once ---------------------------------------


def _create_schema(path: str, barrier) -> str | None:
    """What a search does first: open the store (our migrations), then Optuna's storage (its tables),
    each as the search makes it (autotune.search.trials.optuna_storage takes schema_lock)."""
    from autotune.search.trials import optuna_storage

    try:
        barrier.wait(timeout=30)
        open_store(path).close()
        optuna_storage(f"sqlite:///{path}").engine.dispose()
        return None
    except Exception as exc:  # reported to the parent, which fails the test with it
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("attempt", range(2))
def test_two_processes_creating_the_schema_at_once_both_succeed(tmp_path, attempt):
    # Before schema_lock, most such pairs failed: "table studies already exists", or a duplicate
    # alembic_version row, in Optuna's RDBStorage.
    path = str(tmp_path / "new" / "race.db")
    # spawn, not fork: a fork of a threaded process (the suite's workers are) can deadlock on a lock
    # another thread held (it hung the whole suite)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(2)
        with context.Pool(2) as pool:
            outcomes = pool.starmap(_create_schema, [(path, barrier)] * 2)
    assert outcomes == [None, None]
    with open_store(path, read_only=True) as store:
        assert store.studies() == []
    with sqlite3.connect(path) as raw:
        tables = {row[0] for row in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert raw.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)
    raw.close()
    assert {"autotune_studies", VERSION_TABLE, "studies", "trials", "version_info"} <= tables
