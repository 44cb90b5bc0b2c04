"""The store on PostgreSQL: the team set-up. Skips where no PostgreSQL server can be started."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from autotune.vocabulary.errors import DatabaseError
from autotune.store import SCHEMA_REVISION, open_store, upgrade_database
from autotune.store.migrate import compare_schema

from tests.helpers.store import ENV, GiB, built_by_the_scripts, config, make_study, result, schema_of


def test_store_upgrades_and_round_trips_a_probe_on_postgresql(postgres_url):
    with open_store(postgres_url) as store:  # an empty server database gets our tables on open
        assert store.engine.dialect.name == "postgresql"
        with store.engine.connect() as connection:
            assert compare_schema(connection) == []
        study = make_study(store)
        measured = result("ok", 1234.5, 5 * GiB, context_bytes=600 * 2**20, last_loss=float("nan"))
        probe_id = store.record_probe(study.id, config(8), measured, env_fingerprint=ENV.fingerprint(), trial_number=3)
        [stored] = store.probes("s1")
        assert stored.id == probe_id and stored.config == config(8)
        assert stored.result.to_dict() == measured.to_dict()
        assert stored.finished_at.utcoffset() is not None
        assert store.find_cached(config(8).key(), ENV.fingerprint(), "31d84ffb8ce5f836", 8 * GiB, GiB // 4) is not None
        [row] = store.leaderboard()
        assert (row.rank, row.tokens_per_s, row.peak_reserved_bytes) == (1, 1234.5, 5 * GiB)  # BIGINT bytes
        run_id = store.runs.start(config=config(8), study_id=study.id, probe_id=probe_id)
        store.runs.finish(run_id, steps=10, summary={"ok": True})
        assert store.runs.get(run_id).summary == {"ok": True}
        assert store.studies()[0].probes_ok == 1
    assert upgrade_database(postgres_url).after == SCHEMA_REVISION


def test_a_new_postgresql_database_is_made_with_the_tables_the_scripts_build(postgres_url, postgres_server):
    # migrate.create_schema in one step on the server too (types, defaults and constraint names
    # are PostgreSQL's own here), against the scripts replayed on a second empty database.
    scripts = postgres_server.create_database("scripts_" + postgres_url.rsplit("_", 1)[-1])
    try:
        built_by_the_scripts(scripts)
        open_store(postgres_url).close()
        assert schema_of(postgres_url) == schema_of(scripts)
        assert "autotune_probes" in schema_of(postgres_url)
    finally:
        postgres_server.drop_database(scripts.rsplit("/", 1)[-1])


def test_optuna_and_our_tables_share_a_postgresql_database(postgres_url):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with open_store(postgres_url) as store:  # ours first this time, then Optuna's
        make_study(store)
    storage = optuna.storages.RDBStorage(postgres_url)
    optuna.create_study(study_name="search", storage=storage).optimize(lambda t: t.suggest_int("mb", 1, 8), n_trials=2)
    with open_store(postgres_url) as store:
        with store.engine.connect() as connection:
            assert compare_schema(connection) == []
            tables = set(inspect(connection).get_table_names())
    assert {"studies", "trials", "alembic_version", "autotune_probes", "autotune_alembic_version"} <= tables
    storage.engine.dispose()


def test_an_unreachable_server_is_one_line(postgres_server):
    url = postgres_server.url("no_such_database")
    with pytest.raises(DatabaseError, match="cannot use the results database") as info:
        open_store(url)
    assert "\n" not in str(info.value) and "no_such_database" in str(info.value)
