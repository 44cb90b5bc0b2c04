"""`autotune studies`, `autotune leaderboard` and `autotune db upgrade`: output, errors, start-up."""

from __future__ import annotations

import csv
import io
import json
import sqlite3

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.render.tables import LEADERBOARD_FIELDS
from autotune.store import open_store
from autotune.store.schema import SCHEMA_REVISION, VERSION_TABLE
from tests.helpers.cli import heavy_modules_loaded
from tests.helpers.cli import invoke as autotune  # main(), in this process: see _assert_one_line_error
from tests.helpers.store import ENV, GiB, config, make_study, result


@pytest.fixture
def filled_db(tmp_path):
    """A database with two studies; 'b' is the most recent and has three ok probes and an oom."""
    db = tmp_path / "results.db"
    with open_store(db) as store:
        a = make_study(store, "a")
        store.record_probe(a.id, config(1), result("ok", 50.0), env_fingerprint=ENV.fingerprint())
        b = make_study(store, "b")
        for mb, status, speed, peak in (
            (1, "ok", 900.0, 2 * GiB),
            (2, "ok", 1600.0, 3 * GiB),
            (4, "ok", 2500.5, 5 * GiB),
            (8, "oom", None, None),
        ):
            store.record_probe(b.id, config(mb), result(status, speed, peak), env_fingerprint=ENV.fingerprint())
    return str(db)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_leaderboard_table_defaults_to_the_latest_study(filled_db):
    out = invoke("leaderboard", "--db", filled_db)
    assert out.exit_code == 0
    header, rule, *rows = out.output.splitlines()
    assert header.split() == ["rank", "config", "status", "peak", "reserved", "tokens/s", "step", "s"]
    assert rows[0].split()[:2] == ["1", "mb4x8"] and "5.00 GiB" in rows[0] and "2,500" in rows[0]
    assert len(rows) == 3  # the oom is not on it
    assert len(invoke("leaderboard", "--db", filled_db, "--study", "a").output.splitlines()) == 3


def test_leaderboard_json_and_csv(filled_db):
    data = json.loads(invoke("leaderboard", "--db", filled_db, "--format", "json", "--top", "2").output)
    assert [row["micro_batch"] for row in data] == [4, 2]
    assert {
        "micro_batch",
        "grad_accum",
        "precision",
        "checkpointing",
        "block_size",
        "attention",
        "tokens_per_s",
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "budget_bytes",
    } <= set(data[0])
    assert list(data[0]) == list(LEADERBOARD_FIELDS)  # CSV header and JSON keys stay in step
    table = list(csv.DictReader(io.StringIO(invoke("leaderboard", "--db", filled_db, "--format", "csv").output)))
    assert [row["rank"] for row in table] == ["1", "2", "3"] and table[0]["tokens_per_s"] == "2500.5"


def test_studies_table_and_json(filled_db):
    out = invoke("studies", "--db", filled_db).output.splitlines()
    assert out[0].split()[:4] == ["study", "model", "device", "budget"]
    assert out[2].split()[0] == "b" and out[3].split()[0] == "a"
    data = json.loads(invoke("studies", "--db", filled_db, "--format", "json").output)
    assert [(s["name"], s["probes"], s["ok"], s["oom"], s["best_tokens_per_s"]) for s in data] == [
        ("b", 4, 3, 1, 2500.5),
        ("a", 1, 1, 0, 50.0),
    ]


def test_empty_database(tmp_path):
    # (Changed: `studies` used to create the missing file. It reads only now, so the database is
    # made first, as `autotune search` or `autotune db upgrade` would.)
    db = str(tmp_path / "empty.db")
    invoke("db", "upgrade", "--db", db)
    assert "No studies yet" in invoke("studies", "--db", db).output
    assert json.loads(invoke("studies", "--db", db, "--format", "json").output) == []


def test_db_upgrade_command(tmp_path):
    db = str(tmp_path / "up.db")
    assert invoke("db", "upgrade", "--db", db).output.strip() == f"{db}: upgraded from empty to {SCHEMA_REVISION}"
    assert invoke("db", "upgrade", "--db", db).output.strip() == f"{db}: already at {SCHEMA_REVISION}"


def test_db_defaults_to_autotune_db(filled_db):
    result_ = autotune("leaderboard", "--format", "json", env={"AUTOTUNE_DB": filled_db})
    assert result_.returncode == 0 and len(json.loads(result_.stdout)) == 3


def _assert_one_line_error(proc, *words: str) -> None:
    # `proc`: `autotune ARGS` through main(), as the console script runs it, in this process (its
    # one-line refusals and exit statuses without a second interpreter's start; the local `invoke`
    # above calls the click group, without main's wrapper).
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0]


def test_unknown_study_is_one_line_exit_2(filled_db):
    _assert_one_line_error(autotune("leaderboard", "--study", "nope", "--db", filled_db), "no study named 'nope'")


def test_a_text_file_is_one_line_exit_2(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n" * 100)
    _assert_one_line_error(autotune("studies", "--db", str(notes)), "is not an SQLite database")


def test_a_newer_database_is_one_line_exit_2(filled_db):
    with sqlite3.connect(filled_db) as raw:
        raw.execute(f"UPDATE {VERSION_TABLE} SET version_num = '0099_future'")
    for command in (["studies"], ["leaderboard"], ["db", "upgrade"]):
        _assert_one_line_error(autotune(*command, "--db", filled_db), "0099_future", "pip install -U autotune")


def test_a_missing_database_is_one_line_exit_2_and_not_created(tmp_path):
    for command in (["studies"], ["leaderboard"], ["best"]):
        _assert_one_line_error(autotune(*command, "--db", str(tmp_path / "typo" / "x.db")), "no results database at")
    assert not (tmp_path / "typo").exists()


def test_reading_commands_import_neither_torch_nor_transformers_nor_optuna(filled_db):
    # Alembic too: the database is already at this code's revision, so nothing needs migrating.
    assert heavy_modules_loaded("leaderboard", "--db", filled_db) == ["sqlalchemy"]
    assert heavy_modules_loaded("studies", "--db", filled_db) == ["sqlalchemy"]
    assert heavy_modules_loaded("--help") == []
    # Nor does refusing a database that is not there.
    assert heavy_modules_loaded("leaderboard", "--db", filled_db + ".missing") == ["sqlalchemy"]
