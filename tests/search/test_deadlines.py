"""Deadlines by the wall clock, done to real processes: `--timeout` ends the whole command in time,
confirmation included, and the same command goes on; a probe child stopped with SIGSTOP ends as a
`timeout` within its limit and the search finishes; a fleet worker stopped the same way is killed."""

from __future__ import annotations

import json
import os
from collections import Counter
import signal
import subprocess
import time

import pytest

from autotune.errors import DatabaseError, StudyNotFound
from autotune.status import ProbeStatus, StudyStatus
from autotune.store import open_store
from tests.helpers.cli import autotune, autotune_command, wait_for
from tests.helpers.models import write_model_dir
from tests.helpers.processes import assert_all_gone, cmdline, descendants, parent_of

pytestmark = pytest.mark.slow

# Four candidates, each probe timed for at least `--measure-seconds`.
SPACE = ["--device", "cpu", "--micro-batches", "1,2,4,8", "--block-sizes", "128", "--effective-batch", "8",
         "--precisions", "fp32", "--checkpointing", "off", "--attention", "sdpa", "--no-predict", "--measure-steps", "1"]


@pytest.fixture
def small_model(tmp_path) -> str:
    """A GPT-2 large enough that a step takes a good part of a second on a CPU: the tiny one's
    steps take milliseconds, and its windows end at their 50-step limit, not at --measure-seconds."""
    return str(write_model_dir(tmp_path / "small-gpt2", n_layer=4, n_embd=256, n_head=4))


def test_timeout_ends_the_command_in_time_and_the_same_command_goes_on(small_model, tmp_path):
    db = f"sqlite:///{tmp_path / 'deadline.db'}"
    started = time.monotonic()
    # Three or four probes of 4 s and a confirmation round of two or more cannot end within 20 s,
    # start-up included (which a busy machine can stretch past 10 s).
    cut = autotune("search", "--model", small_model, "--gpu-budget", "1GiB", *SPACE, "--measure-seconds", "4",
                   "--study", "d", "--db", db, "--timeout", "20s", "--json")
    took = time.monotonic() - started
    assert cut.returncode == 0, cut.stderr
    summary = json.loads(cut.stdout)
    assert took < 20 + 10, took  # (interpreter start and imports included)
    assert summary["stop_reason"] == "timeout" and summary["status"] == StudyStatus.INTERRUPTED
    assert summary["deadline_note"] and summary["confirmation"] is None
    # The deadline is no probe's outcome: a probe it stopped is not stored, and will be probed again.
    assert ProbeStatus.TIMEOUT not in {p.result.status for p in _probes(db, "d")}
    done = autotune("search", "--model", small_model, "--gpu-budget", "1GiB", *SPACE, "--measure-seconds", "0.2",
                    "--study", "d", "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    finished = json.loads(done.stdout)
    assert finished["status"] == StudyStatus.FINISHED and finished["confirmation"] is not None
    # Each config settled once: what the cut search measured was kept, not measured again (the
    # confirmation round re-times the contenders in place: it adds no rows).
    assert sorted(Counter(p.config_key for p in _probes(db, "d")).values()) == [1, 1, 1, 1]


def test_a_timeout_that_ends_before_the_first_probe_is_one_line_and_writes_nothing(tiny_model, tmp_path):
    db = tmp_path / "short.db"
    started = time.monotonic()
    # No probe process starts, imports torch and builds the model within 1 s.
    short = autotune("search", "--model", tiny_model, "--gpu-budget", "1GiB", *SPACE, "--study", "short",
                     "--db", f"sqlite:///{db}", "--timeout", "1s")
    lines = short.stderr.strip().splitlines()
    assert short.returncode == 2 and len(lines) == 1 and "--timeout 1 s ran out" in lines[0], short.stderr
    assert "give a longer --timeout" in lines[0] and not db.exists()
    assert time.monotonic() - started < 1 + 10


def test_a_stopped_probe_child_ends_as_a_timeout_within_its_limit_and_the_search_finishes(small_model, tmp_path):
    db = f"sqlite:///{tmp_path / 'stopped.db'}"
    search = subprocess.Popen(autotune_command("search", "--model", small_model, "--gpu-budget", "1GiB", *SPACE,
                                               "--measure-seconds", "0.5", "--study", "s", "--db", db,
                                               "--probe-timeout", "5s", "--no-confirm"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _probes(db, "s"), what="the first probe")
        # (The child's group guard is a fork of it, with the same command line: the search's own child.)
        [child] = wait_for(lambda: [p for p in descendants(search.pid) if b"spawn_main" in cmdline(p)
                                    and parent_of(p) == search.pid], what="the probe child")
        os.kill(child, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: [p for p in _probes(db, "s") if p.result.status == ProbeStatus.TIMEOUT], seconds=30,
                 what="a timeout probe")
        assert time.monotonic() - stopped < 5 + 10
        _, stderr = search.communicate(timeout=180)
    finally:
        if search.poll() is None:
            search.kill()
    assert search.returncode == 3, stderr  # the stopped config could not be measured: said, and resumable
    # (A busy machine can time out a later probe of a fresh child too: at least the stopped one.)
    statuses = [p.result.status for p in _probes(db, "s")]
    assert ProbeStatus.TIMEOUT in statuses and ProbeStatus.OK in statuses and len(statuses) == 4
    assert_all_gone({child, *descendants(search.pid)})


def _probes(db: str, study: str) -> list:
    try:
        with open_store(db, read_only=True) as store:
            return store.probes(study)
    except (DatabaseError, StudyNotFound):  # not created yet
        return []
