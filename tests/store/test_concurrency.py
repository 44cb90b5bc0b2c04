"""Several processes writing one SQLite file at once lose nothing: a search with several probe
workers, or two searches sharing the default database."""

from __future__ import annotations

import multiprocessing

from autotune.store import open_store

from tests.helpers.store import ENV, config, make_study, result

PROCESSES, PROBES_EACH = 4, 50


def _write_probes(db: str, worker: str, start, done) -> None:
    # Imports happen before the barrier (the module is imported to unpickle this function), so the
    # processes really start together: all four also create (upgrade) the fresh database and
    # get-or-create the same study at once.
    start.wait(timeout=60)
    with open_store(db) as store:
        study = make_study(store, "shared")
        for i in range(PROBES_EACH):
            store.record_probe(
                study.id,
                config(1 + i, grad_accum=1),
                result(tokens_per_s=100.0 + i),
                env_fingerprint=ENV.fingerprint(),
                worker=worker,
                trial_number=i,
            )
    done.put(worker)


def test_four_processes_writing_at_once_lose_no_probe(tmp_path):
    db = str(tmp_path / "shared.db")  # does not exist yet
    ctx = multiprocessing.get_context("spawn")
    start, done = ctx.Barrier(PROCESSES), ctx.Queue()
    workers = [ctx.Process(target=_write_probes, args=(db, f"w{n}", start, done)) for n in range(PROCESSES)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=120)
    assert [p.exitcode for p in workers] == [0] * PROCESSES
    assert sorted(done.get(timeout=5) for _ in workers) == [f"w{n}" for n in range(PROCESSES)]

    with open_store(db) as store:
        [summary] = store.studies()
        probes = store.probes("shared")
    assert summary.probes_total == len(probes) == PROCESSES * PROBES_EACH
    by_worker: dict[str, list[int]] = {}
    for probe in probes:
        by_worker.setdefault(probe.worker or "", []).append(probe.trial_number or 0)
    assert {w: sorted(t) for w, t in by_worker.items()} == {f"w{n}": list(range(PROBES_EACH)) for n in range(PROCESSES)}


def _write_forever(db: str) -> None:
    with open_store(db) as store:
        study = make_study(store, "killed")
        for i in range(100_000):
            store.record_probe(
                study.id,
                config(1 + i % 64, grad_accum=1, block_size=128 + i),
                result(tokens_per_s=float(i)),
                env_fingerprint=ENV.fingerprint(),
                trial_number=i,
            )


def test_killing_a_writer_at_any_moment_leaves_only_whole_rows(tmp_path):
    import sqlite3
    import time

    db = str(tmp_path / "killed.db")
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(target=_write_forever, args=(db,))
    writer.start()
    deadline = time.monotonic() + 60
    count = 0
    while count < 30 and time.monotonic() < deadline and writer.is_alive():
        time.sleep(0.05)
        try:
            with sqlite3.connect(db, timeout=5) as raw:
                count = raw.execute("SELECT count(*) FROM autotune_probes").fetchone()[0]
        except sqlite3.OperationalError:  # not created yet
            pass
    writer.kill()  # SIGKILL: no clean-up, mid-transaction or not
    writer.join(timeout=10)
    assert count >= 30

    with open_store(db) as store:
        with store.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
        probes = store.probes("killed")
    assert len(probes) >= count
    # Every row is whole: its trial number, config and measurement agree, and they run 0..n-1.
    assert [p.trial_number for p in probes] == list(range(len(probes)))
    for p in probes:
        assert p.config.block_size == 128 + p.trial_number and p.result.tokens_per_s == float(p.trial_number)
