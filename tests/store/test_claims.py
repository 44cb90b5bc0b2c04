"""Claims: several workers on one study settle every configuration once. Atomic in the database,
on SQLite and on PostgreSQL (skipped where no server can be started)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from autotune.store import MAX_ATTEMPTS, open_store
from autotune.store import base as store_base

from tests.helpers.store import ENV, config, make_study, result

STALE = 0.3  # seconds without a heartbeat before a claim is stale


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'claims.db'}"
    return request.getfixturevalue("postgres_url")


def settle(store, study, cfg, res, how, worker, **kw):
    return store.claims.settle(study.id, cfg, res, how=how, worker=worker, env_fingerprint=ENV.fingerprint(), **kw)


def test_of_many_claimers_at_once_exactly_one_wins(db_url):
    with open_store(db_url) as store:
        study = make_study(store)
    start, won = threading.Barrier(6), []

    def claimer(name: str) -> None:
        with open_store(db_url) as store:  # each its own engine and connections, as separate workers have
            start.wait(timeout=30)
            won.append((name, store.claims.take(study.id, config(4).key(), name, stale_after=60)))

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    winners = [name for name, attempt in won if attempt == 1]
    assert len(won) == 6 and len(winners) == 1 and [a for _, a in won if a != 1] == [None] * 5
    with open_store(db_url) as store:
        [claim] = store.claims.of_study(study.id, stale_after=60)
        assert (claim.worker, claim.state, claim.attempts, claim.stale) == (winners[0], "running", 1, False)
        assert store.claims.beat(study.id, claim.config_key, winners[0])
        assert not store.claims.beat(study.id, claim.config_key, "someone-else")


def test_a_stale_claim_is_taken_over_once_then_recorded_as_crashed(db_url):
    key = config(8).key()
    with open_store(db_url) as store:
        study = make_study(store)
        assert store.claims.take(study.id, key, "w1", stale_after=STALE) == 1
        assert store.claims.take(study.id, key, "w2", stale_after=STALE) is None  # w1 is alive
        time.sleep(STALE + 0.2)  # w1 dies: no heartbeat
        [claim] = store.claims.of_study(study.id, stale_after=STALE)
        assert claim.stale
        assert store.claims.take(study.id, key, "w2", stale_after=STALE) == 2  # taken over: a retry
        assert store.claims.take(study.id, key, "w3", stale_after=STALE) is None
        assert not store.claims.beat(study.id, key, "w1")  # w1's claim is gone
        time.sleep(STALE + 0.2)  # w2 dies as well
        assert store.claims.take(study.id, key, "w3", stale_after=STALE) is None  # no third attempt
        crashed = result("crashed", None, None, error="stopped heartbeating twice")
        # Recording the abandoned claim as crashed happens once, and only once it is stale.
        assert settle(store, study, config(8), crashed, "abandoned", "w3", stale_after=60) is None
        assert settle(store, study, config(8), crashed, "abandoned", "w3", stale_after=STALE) is not None
        assert settle(store, study, config(8), crashed, "abandoned", "w4", stale_after=STALE) is None
        [claim] = store.claims.of_study(study.id, stale_after=STALE)
        assert (claim.state, claim.attempts, claim.worker) == ("crashed", MAX_ATTEMPTS, "w3")
        [probe] = store.probes(study.name)
        assert probe.result.status == "crashed" and probe.worker == "w3"


def test_the_first_worker_to_settle_a_taken_over_claim_wins(db_url):
    key = config(2).key()
    with open_store(db_url) as store:
        study = make_study(store)
        store.claims.take(study.id, key, "slow", stale_after=STALE)
        time.sleep(STALE + 0.2)  # 'slow' looks dead (a long pause) but is not
        assert store.claims.take(study.id, key, "fast", stale_after=STALE) == 2
        assert settle(store, study, config(2), result("ok", 900.0), "claimed", "fast") is not None
        assert settle(store, study, config(2), result("ok", 950.0), "claimed", "slow") is None
        [probe] = store.probes(study.name)
        assert (probe.worker, probe.result.tokens_per_s) == ("fast", 900.0)
        [claim] = store.claims.of_study(study.id, stale_after=STALE)
        assert claim.state == "done"


def test_skips_are_written_once_and_only_for_unclaimed_configs(db_url):
    with open_store(db_url) as store:
        study = make_study(store)
        skipped = result("skipped", None, None, error="ruled out")
        assert settle(store, study, config(16), skipped, "unclaimed", "w1") is not None
        assert settle(store, study, config(16), skipped, "unclaimed", "w2") is None
        store.claims.take(study.id, config(32).key(), "w1", stale_after=60)  # in flight: not to be skipped over
        assert settle(store, study, config(32), skipped, "unclaimed", "w2") is None
        assert [p.config.micro_batch for p in store.probes(study.name)] == [16]
        states = {c.config_key: (c.state, c.attempts) for c in store.claims.of_study(study.id, stale_after=60)}
        assert states == {config(16).key(): ("done", 0), config(32).key(): ("running", 1)}


def test_a_resumed_search_reopens_timeouts_and_crashes_only(tmp_path):
    with open_store(tmp_path / "r.db") as store:
        study = make_study(store)
        for mb, status in ((1, "ok"), (2, "timeout"), (4, "crashed")):
            store.claims.take(study.id, config(mb).key(), "w", stale_after=60)
            settle(store, study, config(mb), result(status), "claimed", "w")
        store.claims.take(study.id, config(8).key(), "w", stale_after=60)  # in flight
        assert store.claims.reopen(study.id, ("timeout", "crashed", "error")) == 2
        assert {c.config_key for c in store.claims.of_study(study.id, stale_after=60)} == {
            config(1).key(),
            config(8).key(),
        }


def test_a_finished_probe_survives_a_dropped_connection(tmp_path, monkeypatch):
    monkeypatch.setattr(store_base, "TRANSIENT_RETRY_DELAYS", (0.05, 0.05))
    with open_store(tmp_path / "drop.db") as store:
        study = make_study(store)
        store.claims.take(study.id, config(4).key(), "w", stale_after=60)
        failures = []

        @event.listens_for(store.engine, "before_cursor_execute")
        def drop_once(conn, cursor, statement, parameters, context, executemany):
            if statement.startswith("INSERT INTO autotune_probes") and not failures:
                failures.append(statement)
                raise OperationalError(statement, parameters, Exception("server closed the connection unexpectedly"))

        probe_id = settle(store, study, config(4), result("ok", 1234.0), "claimed", "w")
        assert failures and probe_id is not None
        [probe] = store.probes(study.name)
        assert probe.id == probe_id and probe.result.tokens_per_s == 1234.0
        [claim] = store.claims.of_study(study.id, stale_after=60)
        assert claim.state == "done"


def test_postgresql_connections_killed_between_writes_are_replaced(postgres_url):
    import psycopg

    with open_store(postgres_url) as store:
        study = make_study(store)
        store.claims.take(study.id, config(1).key(), "w", stale_after=60)
        url = store.engine.url
        with psycopg.connect(
            host=url.host, port=url.port, user=url.username, dbname=url.database, autocommit=True
        ) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()[0]
        assert killed >= 1  # the store's pooled connection, idle while a probe "ran"
        assert settle(store, study, config(1), result("ok"), "claimed", "w") is not None
        assert len(store.probes(study.name)) == 1
