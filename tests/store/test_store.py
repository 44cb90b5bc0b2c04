"""The store's API: studies, probes, the cache, the leaderboard, runs, and where the database is."""

from __future__ import annotations

import dataclasses
import math
import sqlite3
from datetime import timezone
from pathlib import Path

import pytest
from sqlalchemy import text

from autotune.vocabulary.errors import BadInput, DatabaseError, StudyNotFound
from autotune.vocabulary.status import CACHEABLE
from autotune.store import SCHEMA_REVISION, check_study_name, open_store, resolve_url, upgrade_database
from autotune.store.schema import VERSION_TABLE

from tests.helpers.store import ENV, FakeModel, GiB, config, make_study, result


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "store.db") as opened:
        yield opened


# -- where the database is ----------------------------------------------------------------------


def test_default_is_autotune_db_then_home(tmp_path, monkeypatch, hermetic_home):
    assert resolve_url(None).database == str(hermetic_home / "autotune.db")  # $AUTOTUNE_DB from conftest
    monkeypatch.delenv("AUTOTUNE_DB")
    monkeypatch.setenv("AUTOTUNE_HOME", str(tmp_path / "elsewhere"))
    assert resolve_url(None).database == str(tmp_path / "elsewhere" / "autotune.db")
    with open_store() as opened:  # creates the directory and the file
        assert Path(opened.url) == tmp_path / "elsewhere" / "autotune.db"
    assert (tmp_path / "elsewhere" / "autotune.db").is_file()


def test_plain_paths_become_absolute_sqlite_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = resolve_url("results/my.db")
    assert url.drivername == "sqlite" and url.database == str(tmp_path / "results" / "my.db")
    assert resolve_url("postgresql+psycopg://u:secret@db.example/at").get_backend_name() == "postgresql"


def test_bad_urls_are_user_errors():
    with pytest.raises(DatabaseError, match="cannot read"):
        resolve_url("not a url://")
    with pytest.raises(DatabaseError, match="no SQLAlchemy dialect"):
        open_store("nosuchdb://host/x")


def test_sqlite_connection_settings(store):
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


def test_a_file_that_is_not_a_database_is_refused_and_left_alone(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("shopping: milk, eggs\n" * 20)
    with pytest.raises(DatabaseError, match="is not an SQLite database") as info:
        open_store(notes)
    assert "\n" not in str(info.value)
    assert notes.read_text() == "shopping: milk, eggs\n" * 20
    assert not Path(f"{notes}-wal").exists()


def test_a_newer_database_is_refused_with_the_fix(tmp_path):
    db = tmp_path / "newer.db"
    open_store(db).close()
    with sqlite3.connect(db) as raw:
        raw.execute(f"UPDATE {VERSION_TABLE} SET version_num = '0042_from_the_future'")
    for attempt in (lambda: open_store(db), lambda: upgrade_database(db)):
        with pytest.raises(DatabaseError, match="pip install -U autotune") as info:
            attempt()
        assert "0042_from_the_future" in str(info.value) and "\n" not in str(info.value)


def test_a_database_behind_this_code_waits_for_db_upgrade_when_told_to(tmp_path):
    # What a server database at an older revision gets (upgrade=None means False there): one line
    # naming the command. With one revision so far, "older" is a database with our tables and no
    # revision recorded.
    db = tmp_path / "old.db"
    open_store(db).close()
    with sqlite3.connect(db) as raw:
        raw.execute(f"DELETE FROM {VERSION_TABLE}")
    with pytest.raises(DatabaseError, match="upgrade it: autotune db upgrade --db") as info:
        open_store(db, upgrade=False)
    assert "\n" not in str(info.value)


def test_db_upgrade_reports_what_it_did(tmp_path):
    report = upgrade_database(tmp_path / "new.db")
    assert (report.before, report.after, report.changed) == (None, SCHEMA_REVISION, True)
    again = upgrade_database(tmp_path / "new.db")
    assert (again.before, again.after, again.changed) == (SCHEMA_REVISION, SCHEMA_REVISION, False)


# -- studies --------------------------------------------------------------------------------------


def test_study_is_created_then_resumed(store):
    first = make_study(store)
    assert (first.status, first.budget_bytes, first.env_fingerprint) == ("running", 8 * GiB, ENV.fingerprint())
    assert first.environment["torch_version"] == "2.13.0" and first.created_at.tzinfo == timezone.utc
    store.set_study_status(first.id, "interrupted")
    resumed = store.get_or_create_study(
        "s1",
        model=FakeModel("openai-community/gpt2"),
        environment=ENV,
        budget_bytes=8 * GiB,
        margin_bytes=GiB // 4,
        effective_batch=32,
        space={"micro_batch": [1, 2, 4, 8, 16]},
    )
    assert resumed.id == first.id and resumed.status == "running"  # same architecture, other spelling
    assert resumed.space == {"micro_batch": [1, 2, 4, 8, 16]}
    assert store.study("s1").model_reference == "openai-community/gpt2"  # (it follows the model: below)


def test_a_study_resumed_with_its_model_at_another_path_follows_it_and_keeps_every_probe(store):
    # A second checkout of the same model (the demo run in two clones sharing the user's database):
    # the configs' keys name the model's path, so without the move every config was measured again
    # under new keys and the leaderboard showed each twice, the decision naming the pick as tied with itself.
    old, new = FakeModel("/old/demo-gpt2"), FakeModel("/new/demo-gpt2")
    study = make_study(store, model=old)
    fp = ENV.fingerprint()
    fast, slow = config(4, model=old.recorded), config(2, model=old.recorded)
    store.record_probe(study.id, fast, result("ok", 1500.0), env_fingerprint=fp)
    store.record_probe(study.id, slow, result("ok", 1000.0), env_fingerprint=fp)
    assert store.claims.take(study.id, slow.key(), "w1", stale_after=60) is not None
    store.set_confirmation(
        study.id,
        {
            "winner": fast.key(),
            "winner_label": fast.label(),
            "tied": [slow.label()],
            "tied_keys": [slow.key()],
            "probes": 4,
            "seconds": 9.0,
        },
    )
    store.set_study_status(study.id, "finished")

    resumed = make_study(store, model=new)
    moved_fast, moved_slow = (dataclasses.replace(c, model=new.recorded) for c in (fast, slow))
    assert resumed.id == study.id and resumed.model_reference == new.recorded
    rows = store.leaderboard("s1")
    assert [(r.config_key, r.config.model, r.tokens_per_s) for r in rows] == [
        (moved_fast.key(), new.recorded, 1500.0),
        (moved_slow.key(), new.recorded, 1000.0),
    ]
    decision = store.study("s1").confirmation
    assert (decision["winner"], decision["tied_keys"]) == (moved_fast.key(), [moved_slow.key()])
    assert [c.config_key for c in store.claims.of_study(study.id, stale_after=60)] == [moved_slow.key()]
    # ...and back: a study measured at both paths keeps one claim per config
    store.record_probe(study.id, moved_fast, result("ok", 1400.0), env_fingerprint=fp)
    store.claims.take(study.id, moved_fast.key(), "w2", stale_after=60)
    store.set_study_status(study.id, "finished")
    make_study(store, model=old)
    assert sorted(c.config_key for c in store.claims.of_study(study.id, stale_after=60)) == sorted(
        [fast.key(), slow.key()]
    )
    assert {r.config_key for r in store.leaderboard("s1")} == {fast.key(), slow.key()}
    # ...and a study measured at two paths, each with its claims, resumed from a third: one claim each
    store.claims.take(study.id, moved_fast.key(), "w3", stale_after=60)
    store.record_probe(study.id, moved_fast, result("ok", 1300.0), env_fingerprint=fp)
    store.set_study_status(study.id, "finished")
    third = FakeModel("/third/demo-gpt2")
    make_study(store, model=third)
    keys = sorted(c.config_key for c in store.claims.of_study(study.id, stale_after=60))
    assert keys == sorted(dataclasses.replace(c, model=third.recorded).key() for c in (fast, slow))
    assert len(store.leaderboard("s1")) == 2
    assert store.study("s1").confirmation is None  # (it weighed the two paths' probes as two configs)


def test_a_study_searched_now_from_another_path_is_not_moved_under_it(store, monkeypatch):
    make_study(store, model=FakeModel("/old/demo-gpt2"))
    monkeypatch.setattr("autotune.store.store.owner_label", lambda: "elsewhere:1")  # another live search holds it
    with pytest.raises(BadInput, match="being searched now with the model at /old/demo-gpt2"):
        make_study(store, model=FakeModel("/new/demo-gpt2"))
    assert store.study("s1").model_reference == "/old/demo-gpt2"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model": FakeModel("gpt2-medium", "aaaa")}, "model 'gpt2'"),
        ({"budget": 4 * GiB}, "budget 8.00 GiB (not 4.00 GiB)"),
        ({"margin": GiB}, "margin"),
    ],
)
def test_a_study_name_taken_by_another_model_or_budget_is_refused(store, change, words):
    make_study(store)
    with pytest.raises(BadInput, match="pick another --study name") as info:
        make_study(store, **change)
    assert words in str(info.value)


def test_study_names_are_checked(store):
    with pytest.raises(BadInput, match="--study"):
        make_study(store, name="  ")


@pytest.mark.parametrize(
    "name, needle",
    [
        ("", "--study is empty"),
        (" \t", "--study is empty"),
        (".", "names a directory"),
        ("..", "names a directory"),
        ("a/b", "characters a study name cannot have ('/')"),
        ("../x", "cannot have"),
        ("/abs", "cannot have"),
        ("two words", "(' ')"),
        ("-rf", "starts with '-'"),
        ("x" * 201, "201 characters long"),
        ("é", "cannot have"),
    ],
)
def test_a_study_name_that_would_become_a_path_or_a_flag_is_refused_before_writing(store, name, needle):
    with pytest.raises(BadInput, match="--study") as info:
        make_study(store, name=name)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert store.studies() == []


@pytest.mark.parametrize(
    "name", ["gpt2-8GiB", "tiny-gpt2-2.3GiB", "team:gpt2@h100+ckpt", "a_b.c", "x" * 200, "..-8GiB"]
)
def test_study_names_users_write_are_accepted(store, name):
    assert check_study_name(name) == name
    assert make_study(store, name=name).name == name


def test_an_empty_study_name_is_not_read_as_the_latest(store):
    make_study(store, "s1")
    for read in (store.study, store.leaderboard, store.probes):
        with pytest.raises(BadInput, match="--study is empty"):
            read("  ")


def test_studies_list_counts_and_best(store):
    a = make_study(store, "a")
    for mb, status, speed in (
        (1, "ok", 900.0),
        (2, "ok", 1500.0),
        (4, "oom", None),
        (8, "skipped", None),
        (16, "timeout", None),
    ):
        store.record_probe(a.id, config(mb), result(status, speed), env_fingerprint=ENV.fingerprint())
    make_study(store, "b")  # most recent, no probes
    b_summary, a_summary = store.studies()
    assert (b_summary.name, b_summary.probes_total, b_summary.best_tokens_per_s) == ("b", 0, None)
    assert (a_summary.probes_total, a_summary.probes_ok, a_summary.probes_oom, a_summary.probes_skipped) == (5, 2, 1, 1)
    assert a_summary.best_tokens_per_s == 1500.0
    assert store.latest_study_name() == "b"
    store.record_probe(a.id, config(32), result(), env_fingerprint=ENV.fingerprint())
    assert store.latest_study_name() == "a"  # probing a study makes it the most recent


def test_study_status_and_unknown_studies(store):
    assert store.latest_study_name() is None
    with pytest.raises(StudyNotFound, match="no studies"):
        store.leaderboard()
    make_study(store)
    store.set_study_status("s1", "finished")
    assert store.study().status == "finished"
    with pytest.raises(StudyNotFound, match="no study named 'nope'"):
        store.leaderboard("nope")
    with pytest.raises(StudyNotFound):
        store.set_study_status("nope", "finished")
    with pytest.raises(ValueError):
        store.set_study_status("s1", "done")


# -- probes ---------------------------------------------------------------------------------------


def test_probe_round_trip_keeps_every_field(store):
    study = make_study(store)
    measured = result(
        cap_bytes=7 * GiB,
        context_bytes=GiB // 2,
        samples_per_s=2.5,
        mfu=0.41,
        first_loss=10.8,
        last_loss=float("nan"),
        warmup_steps=2,
        measured_steps=3,
        startup_seconds=2.0,
        build_seconds=1.5,
        measured_seconds=4.0,
        error="note",
    )
    probe_id = store.record_probe(
        study.id,
        config(4, precision="bf16", checkpointing=True),
        measured,
        trial_number=7,
        env_fingerprint=ENV.fingerprint(),
        predicted_peak_bytes=3 * GiB,
        worker="w1",
    )
    [stored] = store.probes("s1")
    assert stored.id == probe_id and stored.trial_number == 7 and stored.worker == "w1"
    assert stored.config == config(4, precision="bf16", checkpointing=True)
    assert stored.config_key == stored.config.key()
    expected = measured.to_dict()
    assert math.isnan(measured.last_loss) and expected["last_loss"] is None  # NaN is stored as NULL
    assert stored.result.to_dict() == expected
    assert stored.predicted_peak_bytes == 3 * GiB and stored.cacheable
    assert (stored.finished_at - stored.started_at).total_seconds() == pytest.approx(12.5)
    assert stored.to_dict()["label"] == "mb4x8 blk512 bf16 ckpt sdpa"


def test_an_evaluating_probe_keeps_its_recipe_and_each_phases_peaks(store):
    study = make_study(store)
    evaluating = config(4, eval_batch=16, eval_logits="kept", eval_accumulation_steps=2)
    peaks = {"train": {"allocated": 3 * GiB, "reserved": 4 * GiB}, "eval": {"allocated": 5 * GiB, "reserved": 6 * GiB}}
    measured = result("oom", peak=6 * GiB, phase_peaks=peaks, failed_phase="eval", error="eval phase: out of memory")
    store.record_probe(study.id, evaluating, measured, env_fingerprint=ENV.fingerprint())
    ok = result(peak=4 * GiB, phase_peaks={**peaks, "eval": {"allocated": GiB, "reserved": 2 * GiB}})
    store.record_probe(
        study.id,
        config(2, eval_batch=16, eval_logits="kept", eval_accumulation_steps=2),
        ok,
        env_fingerprint=ENV.fingerprint(),
    )
    stored = store.probes("s1")
    assert stored[0].config == evaluating and stored[0].result.to_dict() == measured.to_dict()
    [row] = store.leaderboard("s1")
    assert row.phase_peaks == ok.phase_peaks and row.to_dict()["phase_peaks"] == ok.phase_peaks


def test_find_cached_reuses_only_lasting_outcomes_of_the_same_setting(store):
    study = make_study(store)
    env_fp = ENV.fingerprint()
    key_args = dict(
        env_fingerprint=env_fp, model_fingerprint=FakeModel().fingerprint, budget_bytes=8 * GiB, margin_bytes=GiB // 4
    )
    for mb, status in (
        (1, "ok"),
        (2, "oom"),
        (4, "unstable"),
        (8, "skipped"),
        (16, "timeout"),
        (32, "crashed"),
        (64, "error"),
    ):
        store.record_probe(study.id, config(mb, grad_accum=1), result(status), env_fingerprint=env_fp)
    reused = {mb: store.find_cached(config(mb, grad_accum=1).key(), **key_args) for mb in (1, 2, 4, 8, 16, 32, 64)}
    assert {mb: r.status for mb, r in reused.items() if r} == {1: "ok", 2: "oom", 4: "unstable", 8: "skipped"}
    assert set(CACHEABLE) == {"ok", "oom", "unstable", "skipped"}
    assert reused[1].tokens_per_s == 1000.0

    key = config(1, grad_accum=1).key()
    assert store.find_cached(key, **{**key_args, "env_fingerprint": "other-env"}) is None
    assert store.find_cached(key, **{**key_args, "model_fingerprint": "other-model"}) is None
    # Under another budget a result is reused where it decides that budget too: a fit (4 GiB needed)
    # under one that allows at least its need, with that budget's figures; an OOM under a smaller one.
    assert store.find_cached(key, **{**key_args, "budget_bytes": 4 * GiB}) is None
    looser = store.find_cached(key, **{**key_args, "margin_bytes": 0})
    assert looser.status == "ok" and (looser.budget_bytes, looser.margin_bytes) == (8 * GiB, 0)
    oom_key = config(2, grad_accum=1).key()
    assert store.find_cached(oom_key, **{**key_args, "budget_bytes": 6 * GiB}).status == "oom"
    assert store.find_cached(oom_key, **{**key_args, "budget_bytes": 16 * GiB}) is None
    # Another study of the same model and budget shares the cache; the latest outcome wins.
    other = make_study(store, "s2")
    store.record_probe(other.id, config(1, grad_accum=1), result("ok", 1200.0), env_fingerprint=env_fp)
    assert store.find_cached(key, **key_args).tokens_per_s == 1200.0
    # An outcome the caller marks as not measured here (a predicted skip) is never reused.
    store.record_probe(other.id, config(128, grad_accum=1), result("skipped"), env_fingerprint=env_fp, cacheable=False)
    assert store.find_cached(config(128, grad_accum=1).key(), **key_args) is None


# -- leaderboard ----------------------------------------------------------------------------------


def test_leaderboard_ranks_ok_probes_fastest_first_ties_to_lower_peak(store):
    study = make_study(store)
    fp = ENV.fingerprint()
    store.record_probe(study.id, config(1), result("ok", 800.0, 2 * GiB), env_fingerprint=fp)
    store.record_probe(study.id, config(2), result("ok", 1500.0, 5 * GiB), env_fingerprint=fp)
    store.record_probe(study.id, config(4), result("ok", 1500.0, 3 * GiB), env_fingerprint=fp)
    store.record_probe(study.id, config(8), result("oom", None, None), env_fingerprint=fp)
    store.record_probe(study.id, config(16), result("timeout"), env_fingerprint=fp)
    rows = store.leaderboard("s1")
    assert [(r.rank, r.config.micro_batch) for r in rows] == [(1, 4), (2, 2), (3, 1)]
    assert {r.status for r in rows} == {"ok"}
    assert rows[0].budget_bytes == 8 * GiB and rows[0].peak_reserved_bytes == 3 * GiB
    assert [r.config.micro_batch for r in store.leaderboard(top=2)] == [4, 2]  # default: the latest study


def test_leaderboard_counts_a_config_once_with_its_latest_measurement(store):
    study = make_study(store)
    fp = ENV.fingerprint()
    store.record_probe(study.id, config(2), result("ok", 2000.0), env_fingerprint=fp)
    store.record_probe(study.id, config(4), result("ok", 1500.0), env_fingerprint=fp)
    store.record_probe(study.id, config(2), result("ok", 1000.0), env_fingerprint=fp)  # re-measured (--fresh)
    rows = store.leaderboard()
    assert [(r.config.micro_batch, r.tokens_per_s) for r in rows] == [(4, 1500.0), (2, 1000.0)]


def test_leaderboard_of_another_study_is_separate(store):
    a, b = make_study(store, "a"), make_study(store, "b")
    store.record_probe(a.id, config(1), result("ok", 10.0), env_fingerprint=ENV.fingerprint())
    assert store.leaderboard("b") == [] and len(store.leaderboard("a")) == 1
    assert b.id != a.id


# -- runs -----------------------------------------------------------------------------------------


def test_runs_start_finish_and_fail(store, tmp_path):
    study = make_study(store)
    probe_id = store.record_probe(study.id, config(4), result(), env_fingerprint=ENV.fingerprint())
    run_id = store.runs.start(
        config=config(4), study_id=study.id, probe_id=probe_id, output_dir=tmp_path / "out", dataset="text:corpus.txt"
    )
    running = store.runs.get(run_id)
    assert (running.status, running.finished_at, running.output_dir) == ("running", None, str(tmp_path / "out"))
    assert running.config["micro_batch"] == 4
    store.runs.finish(
        run_id,
        steps=100,
        tokens_per_s=950.0,
        peak_allocated_bytes=GiB,
        peak_reserved_bytes=2 * GiB,
        final_loss=3.2,
        summary={"epochs": 1},
    )
    done = store.runs.get(run_id)
    assert (done.status, done.steps, done.final_loss, done.summary) == ("finished", 100, 3.2, {"epochs": 1})
    assert done.finished_at >= done.started_at

    failed_id = store.runs.start(config={"micro_batch": 64})
    store.runs.fail(failed_id, "CUDA out of memory at step 3")
    failed = store.runs.get(failed_id)
    assert (failed.status, failed.error, failed.study_id) == ("failed", "CUDA out of memory at step 3", None)
    assert [r.id for r in store.runs.all("s1")] == [run_id]
    assert [r.id for r in store.runs.all()] == [run_id, failed_id]
    with pytest.raises(LookupError):
        store.runs.finish(999)


def test_deleting_a_study_removes_its_probes_but_keeps_its_runs(store):
    # The foreign keys (enforced on SQLite by our connect hook) do what the schema says.
    study = make_study(store)
    store.record_probe(study.id, config(4), result(), env_fingerprint=ENV.fingerprint())
    run_id = store.runs.start(config=config(4), study_id=study.id)
    with store.engine.begin() as connection:
        connection.execute(text("DELETE FROM autotune_studies WHERE id = :id"), {"id": study.id})
        assert connection.execute(text("SELECT count(*) FROM autotune_probes")).scalar() == 0
    assert store.runs.get(run_id).study_id is None


def test_records_are_detached_plain_values(store):
    study = make_study(store)
    store.record_probe(study.id, config(4), result(), env_fingerprint=ENV.fingerprint())
    probes, rows, summaries = store.probes(), store.leaderboard(), store.studies()
    store.close()  # the records stay readable after their sessions and the engine are gone
    assert probes[0].result.tokens_per_s == rows[0].tokens_per_s == summaries[0].best_tokens_per_s == 1000.0
    for record in (study, probes[0], rows[0], summaries[0]):
        assert not hasattr(record, "_sa_instance_state")
        assert isinstance(record.to_dict(), dict)


@pytest.mark.parametrize("db", ["sqlite://", "sqlite:///:memory:", ":memory:", "sqlite:///file:x?mode=memory&uri=true"])
def test_an_in_memory_database_is_refused_with_the_reason(db):
    # (This test used to open "sqlite://" and work in it. A search's results and Optuna study must
    # outlive the process and reach its probe workers, so an in-memory database is refused everywhere.)
    with pytest.raises(DatabaseError, match="in-memory SQLite database .* give a file path"):
        open_store(db)
    with pytest.raises(DatabaseError, match="in-memory"):
        upgrade_database(db)


@pytest.mark.parametrize("db", ["", "   "])
def test_an_empty_db_is_refused_not_read_as_the_default(db, hermetic_home):
    with pytest.raises(DatabaseError, match="--db is empty"):
        open_store(db)
    assert not (hermetic_home / "autotune.db").exists()


def test_an_empty_autotune_db_variable_means_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_DB", "  ")
    monkeypatch.setenv("AUTOTUNE_HOME", str(tmp_path / "home"))
    assert resolve_url(None).database == str(tmp_path / "home" / "autotune.db")
