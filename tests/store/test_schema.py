"""The schema is Alembic's alone, upgrades cleanly from every earlier revision, and shares a
database with Optuna."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult
from autotune.store import SCHEMA_REVISION, open_store
from autotune.store.migrate import compare_schema, head_revision, known_revisions, script_location
from autotune.store.schema import VERSION_TABLE, Probe

from tests.helpers.store import ENV, FakeModel, built_by_the_scripts, config, make_study, result, schema_of

FIXTURES = Path(__file__).parent / "fixtures"


def test_schema_revision_is_alembics_head():
    # The store skips Alembic when a database is at SCHEMA_REVISION: it must be the real head.
    assert head_revision() == SCHEMA_REVISION
    assert "0001_initial" in known_revisions()


def test_migrations_ship_as_a_package_without_alembic_ini():
    location = script_location()
    assert (location / "__init__.py").is_file() and (location / "env.py").is_file()
    assert (location / "script.py.mako").is_file() and (location / "versions" / "0001_initial.py").is_file()
    assert not (location / "alembic.ini").exists()


def test_the_scripts_on_an_empty_database_leave_no_autogenerate_differences(tmp_path):
    url = f"sqlite:///{tmp_path / 'scripts.db'}"
    built_by_the_scripts(url)
    with open_store(url) as store:
        with store.engine.connect() as connection:
            assert compare_schema(connection) == []
            tables = set(inspect(connection).get_table_names())
            version = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one()
    assert tables == {
        "autotune_studies",
        "autotune_probes",
        "autotune_runs",
        "autotune_claims",
        "autotune_searches",
        "autotune_tokens",
        "autotune_workers",
        VERSION_TABLE,
    }
    assert "alembic_version" not in tables  # that name is Optuna's
    assert version == SCHEMA_REVISION


def test_a_new_database_is_made_in_one_step_with_the_tables_the_scripts_build(tmp_path):
    # migrate.create_schema: the models' tables and the version row, instead of replaying every
    # script (SQLite's batch migrations rebuild tables: a tenth of a second or more per database).
    scripts, created = f"sqlite:///{tmp_path / 'scripts.db'}", f"sqlite:///{tmp_path / 'created.db'}"
    built_by_the_scripts(scripts)
    open_store(created).close()
    assert schema_of(created) == schema_of(scripts)
    assert set(schema_of(created)) >= {"autotune_probes", VERSION_TABLE}
    # And made so, it is upgraded by the scripts like any other: downgraded one step, then opened.
    from alembic import command

    from autotune.store.migrate import alembic_config
    from sqlalchemy import create_engine

    engine = create_engine(created)
    with engine.begin() as connection:
        command.downgrade(alembic_config(connection), "-1")
    engine.dispose()
    with open_store(created) as store:
        with store.engine.connect() as connection:
            assert compare_schema(connection) == []
    assert schema_of(created) == schema_of(scripts)


def test_making_a_new_database_needs_no_alembic(tmp_path):
    # The first command on a new machine starts without Alembic's import (a quarter of a second).
    code = (
        "import sys; from autotune.store import open_store; open_store(sys.argv[1]).close(); "
        "print('alembic' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "new.db")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_every_config_and_result_field_has_a_column():
    # A field added to ProbeConfig/ProbeResult without a column (and a revision) would not be stored.
    columns = set(Probe.__table__.columns.keys())
    missing = {f.name for f in (*fields(ProbeConfig), *fields(ProbeResult))} - columns
    assert not missing, f"add columns (and a migration) for {sorted(missing)}"


def test_the_model_change_check_catches_a_drift(tmp_path):
    # The no-differences test is only worth something if a difference shows.
    with open_store(tmp_path / "drift.db") as store:
        with store.engine.begin() as connection:
            connection.exec_driver_sql("DROP INDEX ix_autotune_probes_cache")
            diffs = compare_schema(connection)
    assert any(d[0] == "add_index" and d[1].name == "ix_autotune_probes_cache" for d in diffs)


def test_database_written_by_revision_0001_upgrades_and_reads_back(tmp_path):
    db = tmp_path / "autotune-0001.db"
    shutil.copy(FIXTURES / "autotune-0001.db", db)
    with open_store(db) as store:
        with store.engine.connect() as connection:
            assert compare_schema(connection) == []
        [study] = store.studies()
        assert (study.name, study.model_reference, study.status, study.budget_bytes) == (
            "fixture-0001",
            "gpt2",
            "finished",
            8 * 2**30,
        )
        assert (study.probes_total, study.probes_ok, study.probes_oom, study.best_tokens_per_s) == (2, 1, 1, 18005.3)
        ok, oom = store.probes("fixture-0001")
        assert ok.config == ProbeConfig("gpt2", 8, 512, grad_accum=4, precision="bf16")
        # Rows from before tasks (0003_tasks) read as causal-LM probes.
        assert (ok.config.task, ok.config.target_length, ok.config.num_labels, ok.result.parameters) == (
            "causal-lm",
            None,
            None,
            None,
        )
        assert (ok.result.peak_reserved_bytes, ok.result.startup_seconds, ok.worker) == (
            5_600_000_000,
            3.1,
            "gpu-host-1",
        )
        assert ok.finished_at.tzinfo is not None and ok.finished_at.isoformat().startswith("2026-01-02T03:05:20")
        assert oom.result.status == "oom" and "out of memory" in oom.result.error
        [top] = store.leaderboard()
        assert top.label == "mb8x4 blk512 bf16 no-ckpt sdpa" and top.tokens_per_s == 18005.3
        [run] = store.runs.all("fixture-0001")
        assert (run.status, run.steps, run.summary) == ("finished", 500, {"epochs": 1})
        # And the upgraded database takes new rows.
        record = store.study("fixture-0001")
        store.record_probe(record.id, config(2), result(), env_fingerprint=record.env_fingerprint)
        assert len(store.probes("fixture-0001")) == 3


def test_optuna_storage_and_ours_share_one_sqlite_file(tmp_path):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 'shared.db'}"

    def objective(trial):
        return trial.suggest_int("micro_batch", 1, 8)

    study = optuna.create_study(study_name="search", storage=optuna.storages.RDBStorage(url))
    study.optimize(objective, n_trials=3)

    with open_store(url) as store:  # upgrades: adds our tables beside Optuna's
        record = make_study(store, model=FakeModel())
        store.record_probe(record.id, config(), result(), env_fingerprint=ENV.fingerprint(), trial_number=0)
        with store.engine.connect() as connection:
            assert compare_schema(connection) == []  # Optuna's tables are not ours to drop

    # Optuna still works on the same file, with our tables in it.
    again = optuna.load_study(study_name="search", storage=optuna.storages.RDBStorage(url))
    again.optimize(objective, n_trials=2)
    assert len(again.trials) == 5
    with open_store(url) as store:
        assert [p.trial_number for p in store.probes(record.name)] == [0]

    tables = set(inspect(create_engine(url)).get_table_names())
    assert {"studies", "trials", "version_info", "alembic_version"} <= tables  # Optuna's
    assert {"autotune_studies", "autotune_probes", VERSION_TABLE} <= tables  # ours
