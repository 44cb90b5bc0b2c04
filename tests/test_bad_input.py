"""Mistakes a careful user made, through the real command line: each is one line on stderr, exit
status 2, no traceback, and the database exactly as it was (its bytes, or its absence: no file or
directory created). See tests/helpers/cli.py for the contract."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from autotune.store import open_store
from autotune.store.schema import SCHEMA_REVISION
from tests.helpers.cli import Unchanged, autotune, invoke, refused
from tests.helpers.store import ENV, FakeModel, GiB, config, make_study, result

BIG = "99999999999999999999"  # > 2**63 - 1: what SQLite and PostgreSQL store as an integer
FIXTURE_0001 = Path(__file__).parent / "store" / "fixtures" / "autotune-0001.db"


def run(*args: str):
    """`autotune ARGS` in this process: a mistake must be refused before any process starts
    (tests/conftest.py fails a test that starts one without the `slow` mark)."""
    return invoke(*args)


def database(hermetic_home) -> str:
    return str(hermetic_home / "autotune.db")


# -- 1. numbers too large for the database ----------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--gpu-budget", "9999999TiB"], "--gpu-budget: '9999999TiB' is too large"),
        (["--gpu-budget", "8GiB", "--micro-batches", BIG], f"--micro-batches: {BIG} is too large"),
        (["--gpu-budget", "8GiB", "--block-sizes", BIG], f"--block-sizes: {BIG} is too large"),
        (["--gpu-budget", "8GiB", "--effective-batch", BIG], "--effective-batch must be a whole number from 1 to"),
        (["--gpu-budget", "8GiB", "--effective-tokens", BIG, "--block-sizes", "32,64"], "--effective-tokens must be"),
    ],
)
def test_numbers_past_64_bits_are_refused_where_parsed(work, hermetic_home, tiny_model, args, needle):
    # (Old code: OverflowError from SQLite at the first write, after a probe child had started.)
    with Unchanged(work, hermetic_home):
        refused(run("search", "--model", tiny_model, *args, "--device", "cpu"), needle)


def test_a_top_past_64_bits_is_refused(work, hermetic_home):
    with Unchanged(work, hermetic_home):
        refused(run("leaderboard", "--top", BIG), "--top must be a whole number from 1 to")


# -- 1. a read-only database, an in-memory one, a server that never answers -------------------------


def test_a_read_only_database_is_one_line(work, hermetic_home):
    db = work / "old.db"  # at an older revision: upgrading it writes
    shutil.copy(FIXTURE_0001, db)
    if os.geteuid() == 0:  # root ignores file modes: SQLite's read-only URI mode refuses writes the same way
        url = f"sqlite:///file:{db}?mode=ro&uri=true"
    else:
        os.chmod(db, 0o444)
        url = str(db)
    try:
        with Unchanged(work, hermetic_home):
            refused(run("db", "upgrade", "--db", url), f"the results database {db} is read-only")
    finally:
        os.chmod(db, 0o644)


@pytest.mark.parametrize(
    "command, db",
    [
        (["studies"], "sqlite:///:memory:"),
        (["leaderboard"], "sqlite://"),
        (["best"], ":memory:"),
        (["db", "upgrade"], "sqlite://"),
    ],
)
def test_an_in_memory_database_is_refused_with_the_reason(work, hermetic_home, command, db):
    with Unchanged(work, hermetic_home):
        refused(run(*command, "--db", db), "in-memory SQLite database")


def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers (loopback only)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, held


# The URL's own connect timeout (libpq's least, 2 s), waited out in full: the default one
# (PG_CONNECT_TIMEOUT_S, 10 s) only where a URL sets none (tests/store/test_failures.py).
CONNECT_TIMEOUT_S = 2


def test_a_postgresql_server_that_never_answers_is_one_line_within_the_timeout(work, hermetic_home):
    server, held = silent_server()
    port = server.getsockname()[1]
    started = time.monotonic()
    try:
        with Unchanged(work, hermetic_home):
            proc = autotune(
                "studies",
                "--db",
                f"postgresql+psycopg://u@127.0.0.1:{port}/db?connect_timeout={CONNECT_TIMEOUT_S}",
                timeout=CONNECT_TIMEOUT_S + 20,
            )
    finally:
        server.shutdown(socket.SHUT_RDWR)  # (wakes the accepting thread: a plain close() leaves it listening)
        server.close()
        for connection in held:
            connection.close()
    took = time.monotonic() - started
    refused(proc, f"no answer within {CONNECT_TIMEOUT_S} s")
    assert CONNECT_TIMEOUT_S <= took < CONNECT_TIMEOUT_S + 8 and held  # (old code: hung until killed)


# -- 2. empty values do not mean "the default" ------------------------------------------------------


@pytest.mark.parametrize(
    "command, db", [(["studies"], ""), (["leaderboard"], "  "), (["best"], ""), (["db", "upgrade"], "")]
)
def test_an_empty_db_is_refused(work, hermetic_home, command, db):
    with Unchanged(work, hermetic_home):
        refused(run(*command, "--db", db), "--db is empty")


@pytest.mark.parametrize("command", [["leaderboard"], ["best"]])
@pytest.mark.parametrize("study", ["", " "])
def test_an_empty_study_is_refused_not_read_as_the_latest(work, hermetic_home, command, study):
    with Unchanged(work, hermetic_home):
        refused(run(*command, "--study", study), "--study is empty")


def test_train_refuses_an_empty_study_or_output_dir(work, hermetic_home):
    with Unchanged(work, hermetic_home):
        refused(run("train", "--study", "", "--dataset", "corpus.txt"), "--study is empty")
        refused(run("train", "--study", "s1", "--dataset", "corpus.txt", "--output-dir", " "), "--output-dir is empty")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--micro-batches", ""], "--micro-batches"),
        (["--block-sizes", ""], "--block-sizes"),
        (["--study", ""], "--study is empty"),
        (["--study", ".."], "--study '..' names a directory"),
        (["--allocators", "default,huge"], "--allocators: unknown value 'huge'"),
        (["--compile", "sometimes"], "--compile: unknown value 'sometimes'"),
        (["--liger", "yes"], "--liger: unknown value 'yes'"),
    ],
)
def test_search_refuses_empty_lists_and_bad_study_names(work, hermetic_home, tmp_path, args, needle):
    # A model that does not exist: old code, reading the empty value as "the default", stops there.
    with Unchanged(work, hermetic_home):
        refused(run("search", "--model", str(tmp_path / "no-model"), "--gpu-budget", "8GiB", *args), needle)


# -- 3. study names that would become paths ---------------------------------------------------------


@pytest.mark.parametrize(
    "name, needle", [("..", "names a directory"), ("a/b", "cannot have"), ("-x", "starts with '-'")]
)
def test_train_refuses_a_study_name_that_would_become_a_path(work, hermetic_home, tiny_model, name, needle):
    (work / "corpus.txt").write_text("some text " * 100)
    with Unchanged(work, hermetic_home):
        refused(
            run("train", "--model", tiny_model, "--gpu-budget", "8GiB", "--study", name, "--dataset", "corpus.txt"),
            f"--study {name!r} {needle}" if needle != "cannot have" else needle,
        )


# -- 4. read commands never create or upgrade a database --------------------------------------------


@pytest.mark.parametrize(
    "command", [["studies"], ["leaderboard"], ["best"], ["train", "--study", "s1", "--dataset", "c.txt"]]
)
def test_read_commands_do_not_create_a_database(work, hermetic_home, command):
    with Unchanged(work, hermetic_home):
        refused(
            run(*command, "--db", "typo/x.db"),
            f"no results database at {work / 'typo' / 'x.db'}; `autotune search` creates it",
        )
    assert not (work / "typo").exists()


def test_read_commands_on_the_default_database_do_not_create_it(work, hermetic_home):
    os.remove(hermetic_home / "autotune.db")
    with Unchanged(work, hermetic_home):
        refused(run("leaderboard"), f"no results database at {hermetic_home / 'autotune.db'}")


@pytest.mark.parametrize(
    "command", [["studies"], ["leaderboard"], ["best"], ["train", "--study", "fixture-0001", "--dataset", "c.txt"]]
)
def test_read_commands_do_not_upgrade_an_older_database(work, hermetic_home, command):
    db = work / "old.db"
    shutil.copy(FIXTURE_0001, db)
    with Unchanged(work, hermetic_home):
        refused(
            run(*command, "--db", str(db)),
            f"older than this autotune's '{SCHEMA_REVISION}'; upgrade it: autotune db upgrade --db {db}",
        )


def test_read_commands_refuse_a_database_with_no_autotune_tables(work, hermetic_home):
    db = work / "other.db"
    with sqlite3.connect(db) as raw:  # someone else's (rollback-journal) database: WAL would rewrite its header
        raw.execute("CREATE TABLE notes (body TEXT)")
    raw.close()
    with Unchanged(work, hermetic_home):
        refused(run("leaderboard", "--db", str(db)), "has no autotune tables; `autotune search` creates them")


def test_db_upgrade_still_creates_and_upgrades(work):
    db = work / "old.db"
    shutil.copy(FIXTURE_0001, db)
    assert (
        run("db", "upgrade", "--db", str(db)).stdout.strip() == f"{db}: upgraded from 0001_initial to {SCHEMA_REVISION}"
    )
    assert "fixture-0001" in run("studies", "--db", str(db)).stdout
    assert run("db", "upgrade", "--db", "new/n.db").returncode == 0 and (work / "new" / "n.db").is_file()


# -- 7. train --output-dir that cannot be one ---------------------------------------------------------


@pytest.fixture
def trainable(work, tiny_model, hermetic_home):
    """A study of the tiny model with an ok probe, in the default database."""
    from autotune.specs.models import resolve_model

    spec = resolve_model(tiny_model)
    with open_store(hermetic_home / "autotune.db") as store:
        study = make_study(store, "tiny", model=FakeModel(tiny_model, spec.fingerprint), budget=GiB)
        store.record_probe(
            study.id,
            config(1, model=tiny_model, block_size=64, grad_accum=1),
            result(budget_bytes=GiB),
            env_fingerprint=ENV.fingerprint(),
        )
    (work / "corpus.txt").write_text("some text " * 2000)
    return "tiny"


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda w: w / "notes.txt", "is a file, not a directory"),
        (lambda w: w / "notes.txt" / "run", "is a file, so no directory can be made there"),
    ],
)
def test_train_refuses_an_output_dir_that_cannot_be_one_before_recording(work, hermetic_home, trainable, make, needle):
    (work / "notes.txt").write_text("keep me\n")
    with Unchanged(work, hermetic_home):
        refused(
            run(
                "train",
                "--study",
                trainable,
                "--dataset",
                "corpus.txt",
                "--device",
                "cpu",
                "--output-dir",
                str(make(work)),
            ),
            needle,
        )
    with open_store(hermetic_home / "autotune.db", read_only=True) as store:
        assert store.runs.all() == []


# -- recipe levers (autotune.levers.recipes) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--optimizers", "adamw,adam"], "--optimizers: unknown value 'adam'"),
        (["--weights", "fp8"], "--weights: unknown value 'fp8'"),
        (["--lora-rank", "4"], "--lora-rank only apply with --peft"),
        (["--peft", "ia3"], "--peft 'ia3' is unknown"),
        (["--trainer", "lightning"], "--trainer 'lightning' is unknown; choose from transformers, trl"),
        (
            ["--trainer", "trl", "--task", "classification"],
            "--trainer trl is TRL's SFTTrainer, which trains causal LMs",
        ),
    ],
)
def test_recipe_mistakes_are_refused_before_anything_starts(work, hermetic_home, tiny_model, args, needle):
    with Unchanged(work, hermetic_home):
        refused(run("search", "--model", tiny_model, "--gpu-budget", "1GiB", "--device", "cpu", *args), needle)


@pytest.mark.parametrize(
    "command, args, needle",
    [
        ("probe", ["--allocator", "huge"], "--allocator 'huge' is unknown"),
        ("probe", ["--precision", "tf16"], "--precision 'tf16' is unknown"),
        ("probe", ["--trainer", "sft"], "--trainer 'sft' is unknown"),
        ("estimate", ["--liger"], "--liger: the estimator cannot trace Liger's Triton kernels"),
    ],
)
def test_speed_lever_mistakes_are_one_line(work, hermetic_home, tiny_model, command, args, needle):
    budget = ["--gpu-budget", "1GiB"] + (["--device", "cpu"] if command == "probe" else [])
    with Unchanged(work, hermetic_home):
        refused(run(command, "--model", tiny_model, "--micro-batch", "2", "--block-size", "32", *budget, *args), needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--gpu", "h1000"], "--gpu 'h1000' is unknown; choose from"),
        (["--gpu", "rtx4090", "--gpu-budget", "30GiB"], "--gpu-budget 30.00 GiB is more than the"),
        (["--gpu", "cpu"], "--gpu cpu needs --gpu-budget"),
        (["--gpu", "h100", "--allocators", "big"], "--allocators: unknown value 'big'"),
    ],
)
def test_plan_mistakes_are_one_line(work, hermetic_home, tiny_model, args, needle):
    with Unchanged(work, hermetic_home):
        refused(run("plan", "--model", tiny_model, *args), needle)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--peft", "qlora"], "--peft qlora quantizes the base to 4 bits"),
        (["--peft", "lora", "--lora-targets", "q_proj,v_proj"], "--lora-targets q_proj,v_proj: Target modules"),
    ],
)
def test_recipes_this_model_or_machine_cannot_train_are_one_line_and_write_nothing(
    work, hermetic_home, tiny_model, args, needle, warm_child
):
    # Told by building the model (meta device) in the probe child, before the study is written.
    with Unchanged(work, hermetic_home):
        refused(
            invoke(
                "search",
                "--model",
                tiny_model,
                "--gpu-budget",
                "1GiB",
                "--device",
                "cpu",
                "--micro-batches",
                "1",
                "--effective-batch",
                "1",
                *args,
            ),
            needle,
        )
    if "targets" in needle:  # (the estimator predicts QLoRA for a card: tests/probe/test_qlora.py)
        # --json: without it, a trace that takes 30 s (a loaded machine importing peft) says so on
        # stderr before its refusal, as a long estimate should.
        with Unchanged(work, hermetic_home):
            refused(
                autotune(
                    "estimate", "--model", tiny_model, "--micro-batch", "1", "--block-size", "32", "--json", *args
                ),
                needle.split(":")[0],
            )


@pytest.mark.slow
def test_lora_targets_no_module_matches_are_one_line_from_a_plan_traced_by_two_children(
    work, hermetic_home, tiny_model, monkeypatch
):
    # Told by a trace child building the model; with two children sharing the plan's traces (one
    # per core, the default on a 2-core machine) the refusal came from a child's thread: it was
    # printed as that thread's traceback, and the plan went on to say "nothing fits", exit 0.
    space = ["--micro-batches", "1,2", "--block-sizes", "32", "--precisions", "bf16", "--no-cache"]
    # (two children as a 2-core machine has them; set in process, not through the environment, which
    # the worker's fork server was started with: both children are forked from it, warm)
    monkeypatch.setattr("autotune.search.launch.trace_processes", lambda: 2)
    with Unchanged(work, hermetic_home):
        refused(
            invoke(
                "plan",
                "--model",
                tiny_model,
                "--gpu",
                "h100",
                "--peft",
                "lora",
                "--lora-targets",
                "nosuch_proj",
                *space,
            ),
            "--lora-targets nosuch_proj: Target modules",
        )


@pytest.mark.parametrize(
    "command, args, needle",
    [
        ("search", ["--gpus", "0"], "--gpus must be a whole number of at least 1"),
        ("search", ["--gpus", "2", "--strategies", "zero3"], "--strategies: unknown value 'zero3'"),
        ("search", ["--gpus", "2", "--peft", "qlora"], "--peft qlora with --gpus 2 or more is not supported"),
        ("search", ["--gpus", "2", "--nodes", "2"], "--nodes 2 needs --rendezvous HOST:PORT"),
        ("search", ["--rendezvous", "127.0.0.1:29500"], "--rendezvous is where several nodes meet"),
        ("search", ["--gpus", "2", "--nodes", "2", "--rendezvous", "nope"], "--rendezvous 'nope' is not HOST:PORT"),
        (
            "probe",
            ["--micro-batch", "2", "--block-size", "64", "--strategy", "fsdp"],
            "--strategy fsdp shares a run across ranks",
        ),
        ("probe", ["--micro-batch", "2", "--block-size", "64", "--nodes", "2"], "--nodes 2 needs --rendezvous"),
    ],
)
def test_ranks_and_nodes_given_wrong_are_one_line_and_write_nothing(
    work, hermetic_home, tiny_model, command, args, needle
):
    with Unchanged(work, hermetic_home):
        refused(run(command, "--model", tiny_model, "--gpu-budget", "1GiB", *args, "--device", "cpu"), needle)
