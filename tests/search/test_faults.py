"""What clusters and users do to a search, done for real: kill -9, SIGTERM, Ctrl-C twice, probes
that crash every time, a fleet killed on PostgreSQL, and mistakes refused before anything is
written. Real `autotune` processes, real signals, real probe children (tests/helpers/faults makes a probe
hang or die on purpose). Each test asserts that no process of the search is left after 10 s, that
no completed probe is lost, and that the same command resumes and measures what was not measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest

from autotune.vocabulary.status import ProbeStatus, StudyStatus
from tests.helpers.cli import autotune_command, invoke, wait_for
from tests.helpers.faults import fault_env, inject_fault
from tests.helpers.models import write_model_dir
from tests.helpers.runners import commands_probe_with
from tests.helpers.processes import assert_all_gone, descendants, name, trace_children
from tests.helpers.studies import TWO_CANDIDATES as SPACE
from tests.helpers.studies import WatchedStudy, probes, running_claims, status

pytestmark = pytest.mark.slow


def second_probe_running(watched: WatchedStudy) -> bool:
    """The first probe is stored and the second is claimed: the search is mid-probe."""
    try:
        return len(watched.probes()) == 1 and bool(watched.running_claims())
    except Exception:  # the study is not created yet
        return False


def wait_for_second_probe(db: str, study: str) -> None:
    with WatchedStudy(db, study) as watched:
        wait_for(lambda: second_probe_running(watched), what="the second probe")


@pytest.fixture
def model(tmp_path) -> str:
    return str(write_model_dir(tmp_path / "tiny-gpt2"))


def start_search(
    model: str, db: str, study: str, fault: str, *extra: str, on_probe: int = 0, tmpdir: Path | None = None
) -> subprocess.Popen:
    env = fault_env(fault, on_probe=on_probe)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.Popen(
        autotune_command("search", "--model", model, *SPACE, "--db", db, "--study", study, *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def resume(model: str, db: str, study: str, *extra: str):
    """The same command again, fault gone, in this process with the worker's warm probe child
    (`warm_child`): the fault and what it left are the subject, a second interpreter is not."""
    return invoke("search", "--model", model, *SPACE, "--db", db, "--study", study, *extra)


def assert_resumes_and_finishes(model: str, db: str, study: str, completed_before: list) -> None:
    """The same command, fault gone: exit 0, the study finished, every candidate measured, and each
    probe that had completed before kept as it was (not probed again)."""
    done = resume(model, db, study)
    assert done.returncode == 0, done.stdout + done.stderr
    assert status(db, study) == StudyStatus.FINISHED
    after = probes(db, study)
    assert {p.config.micro_batch for p in after if p.result.status == ProbeStatus.OK} == {1, 2}
    for before in completed_before:
        again = [p for p in after if p.config_key == before.config_key]
        assert [p.id for p in again] == [before.id], "a completed probe was lost or probed again"


# -- the tests -------------------------------------------------------------------------------------
def test_kill_9_mid_probe_leaves_no_process_and_loses_no_probe(model, tmp_path, warm_child):
    db = str(tmp_path / "kill9.db")
    tmpdir = tmp_path / "tmp"  # (the fork server's socket directory is made here: removed too)
    tmpdir.mkdir()
    search = start_search(model, db, "kill9", "hang", on_probe=2, tmpdir=tmpdir)
    try:
        wait_for_second_probe(db, "kill9")
        below = descendants(search.pid)
        assert below, "the probe child should be running"
        search.send_signal(signal.SIGKILL)
        search.wait(timeout=30)
        assert_all_gone(below)
        assert list(tmpdir.glob("pymp-*")) == []  # (torch keeps its compile cache in TMPDIR, by design)
    finally:
        search.kill()
    completed = probes(db, "kill9")
    assert [p.result.status for p in completed] == [ProbeStatus.OK]
    # kill -9 runs no code: its claim goes stale, and the study, stored as running, reads as
    # interrupted since its process is gone (store/liveness.py).
    assert status(db, "kill9") == StudyStatus.INTERRUPTED
    assert_resumes_and_finishes(model, db, "kill9", completed)


def test_kill_9_while_predicting_leaves_no_estimator_process(model, tmp_path):
    # The estimator's trace children start with the search, before its probe child is up.
    db = str(tmp_path / "kill9-predicting.db")
    search = subprocess.Popen(
        autotune_command("search", "--model", model, *SPACE[:-3], "--predict", "--db", db),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tracing = wait_for(lambda: trace_children(search.pid), what="a trace child")
        # Forked from the search's fork server (its probe child's too): torch imported once.
        assert {name(p) for p in tracing} == {"autotune-trace"}
        below = descendants(search.pid)
        search.send_signal(signal.SIGKILL)
        search.wait(timeout=30)
        # At once: a trace child is not left to finish its imports and notice its stdin closed.
        assert_all_gone(below, within=2.0)
    finally:
        search.kill()


def test_sigterm_mid_probe_stops_marks_interrupted_and_releases_the_claim(model, tmp_path, warm_child):
    db = str(tmp_path / "term.db")
    search = start_search(model, db, "term", "hang", on_probe=2)
    try:
        wait_for_second_probe(db, "term")
        below = descendants(search.pid)
        search.send_signal(signal.SIGTERM)
        _, stderr = search.communicate(timeout=60)
    finally:
        search.kill()
    assert search.returncode == 143, stderr
    assert "terminated" in stderr.strip().splitlines()[-1]
    assert "Traceback" not in stderr
    assert_all_gone(below)
    assert status(db, "term") == StudyStatus.INTERRUPTED
    assert running_claims(db, "term") == []  # given back, not left to go stale
    assert_resumes_and_finishes(model, db, "term", probes(db, "term"))


def test_ctrl_c_twice_aborts_the_probe_and_leaves_the_study_interrupted(model, tmp_path):
    db = str(tmp_path / "twice.db")
    search = start_search(model, db, "twice", "hang", on_probe=2)
    try:
        wait_for_second_probe(db, "twice")
        below = descendants(search.pid)
        search.send_signal(signal.SIGINT)
        time.sleep(1.0)
        search.send_signal(signal.SIGINT)
        _, stderr = search.communicate(timeout=60)
    finally:
        search.kill()
    assert search.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert_all_gone(below)
    assert status(db, "twice") == StudyStatus.INTERRUPTED
    assert running_claims(db, "twice") == []


def test_a_probe_that_crashes_every_time_is_not_a_finished_study(model, tmp_path, monkeypatch, probe_runner):
    db = str(tmp_path / "crash.db")
    flags = ["--micro-batches", "2"]  # one candidate: the one that crashes
    # In this process: what is killed is each probe child, which the search forks afresh from this
    # worker's fork server with the fault named in the environment of the moment (tests/helpers/
    # faults); a second interpreter, with a fork server of its own, is not the subject.
    with monkeypatch.context() as faulty:
        inject_fault(faulty, "kill")
        crashed = invoke("search", "--model", model, *SPACE, *flags, "--db", db, "--study", "crash")
    assert crashed.returncode == 3, crashed.stdout + crashed.stderr
    assert "could not be measured" in crashed.stdout and "mb2x1" in crashed.stdout
    assert "No configuration fits" not in crashed.stdout
    assert status(db, "crash") == StudyStatus.INCOMPLETE
    [row] = probes(db, "crash")
    assert row.result.status == ProbeStatus.CRASHED and "crashed 3 times" in row.result.error

    # The same command without the fault measures it; --json says so.
    with commands_probe_with(probe_runner):
        done = resume(model, db, "crash", *flags, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == StudyStatus.FINISHED and summary["unmeasured"] == []
    assert summary["best"]["micro_batch"] == 2


def test_a_fleet_killed_with_kill_9_on_postgresql_leaves_no_worker_and_no_files(model, postgres_url):
    scratch_before = set(Path("/tmp").glob("autotune-workers-*"))
    search = subprocess.Popen(
        autotune_command(
            "search",
            "--model",
            model,
            *SPACE,
            "--db",
            postgres_url,
            "--study",
            "fleet",
            "--workers",
            "2",
            "--heartbeat",
            "0.5",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=fault_env("hang"),
    )
    try:
        with WatchedStudy(postgres_url, "fleet") as watched:
            wait_for(lambda: len(watched.running_claims()) == 2, what="both workers probing")
        below = descendants(search.pid)
        assert len(below) >= 4, below  # two workers, each with its probe child
        search.send_signal(signal.SIGKILL)
        search.wait(timeout=30)
        assert_all_gone(below)
    finally:
        search.kill()
    assert set(Path("/tmp").glob("autotune-workers-*")) == scratch_before


# -- mistakes: refused before the first write --------------------------------------------------------
def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


BAD_MODELS = {
    "no-vocab": ({"vocab_size": None}, [], "no vocab_size"),
    "unknown-type": ({"model_type": "no-such-architecture"}, [], "cannot read its config.json"),
    "remote-code": ({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, [], "--trust-remote-code"),
    # t5 has no causal-LM class: asked to train it as one, the search refuses (tasks: tests/test_tasks.py).
    "no-class-for-task": (
        {
            "model_type": "t5",
            "architectures": ["T5ForConditionalGeneration"],
            "d_model": 64,
            "num_layers": 1,
            "num_heads": 2,
            "d_kv": 32,
            "d_ff": 128,
        },
        ["--task", "causal-lm"],
        "has no causal-lm class in transformers",
    ),
    "flash-on-cpu": ({}, ["--attention", "flash_attention_2", "--precisions", "bf16"], "--attention flash_attention_2"),
    "budget-above-host": ({}, ["--gpu-budget", "100TiB"], "larger than this machine's memory"),
}


@pytest.fixture(scope="module")
def upgraded_db(tmp_path_factory) -> Path:
    """A database made by `autotune db upgrade`, once for the module: each case below refuses
    against its own copy of it (the file is the same each time). In this process: what the
    command writes into the environment is put back (a module's fixture runs outside the
    per-test restore, tests/conftest.py)."""
    root = tmp_path_factory.mktemp("upgraded")
    db = root / "existing.db"
    # (Set up before the per-test hermetic home: its own, so nothing touches the user's.)
    home = {"AUTOTUNE_HOME": str(root / "home"), "AUTOTUNE_DB": f"sqlite:///{root / 'home' / 'autotune.db'}"}
    with mock.patch.dict(os.environ):
        upgraded = invoke("db", "upgrade", "--db", str(db), env=home)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    return db


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_a_mistake_found_before_the_first_probe_leaves_the_database_as_it_was(case, tmp_path, upgraded_db, warm_child):
    overrides, flags, needle = BAD_MODELS[case]
    config = {
        k: v
        for k, v in {
            **json.loads(Path(write_model_dir(tmp_path / "m") / "config.json").read_text()),
            **overrides,
        }.items()
        if v is not None
    }
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    existing, fresh = tmp_path / "existing.db", tmp_path / "fresh.db"
    shutil.copyfile(upgraded_db, existing)
    before = _digest(existing)
    for db in (existing, fresh):
        # (In this process, with the worker's warm probe child where only the model's build can tell.)
        proc = invoke("search", "--model", str(tmp_path / "m"), *SPACE, *flags, "--db", str(db), "--study", "bad")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert _digest(existing) == before, "the refused search wrote to the database"
    assert not fresh.exists(), "the refused search created a database"
