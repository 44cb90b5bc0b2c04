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

from autotune.vocabulary.errors import DatabaseError, StudyNotFound
from autotune.vocabulary.status import ProbeStatus, StudyStatus
from autotune.store import open_store
from tests.helpers.cli import autotune, autotune_command, invoke, wait_for
from tests.helpers.faults import GATE_ENV, fault_env
from tests.helpers.processes import assert_all_gone, descendants, probe_children

pytestmark = pytest.mark.slow

# Four candidates of the tiny GPT-2.
SPACE = [
    "--device",
    "cpu",
    "--micro-batches",
    "1,2,4,8",
    "--block-sizes",
    "128",
    "--effective-batch",
    "8",
    "--precisions",
    "fp32",
    "--checkpointing",
    "off",
    "--attention",
    "sdpa",
    "--no-predict",
    "--measure-steps",
    "1",
]


def test_timeout_ends_the_command_in_time_and_the_same_command_goes_on(tiny_model, tmp_path, warm_child):
    db = f"sqlite:///{tmp_path / 'deadline.db'}"
    # The search's second probe waits at its first step for a gate that never opens (tests/helpers/
    # faults): the command cannot end within 20 s, start-up included (which a busy machine can stretch
    # past 10 s), and waits without taking the CPU from other work.
    held = fault_env("gate", on_probe=2)
    held[GATE_ENV] = str(tmp_path / "never")
    started = time.monotonic()
    cut = autotune(
        "search",
        "--model",
        tiny_model,
        "--gpu-budget",
        "1GiB",
        *SPACE,
        "--study",
        "d",
        "--db",
        db,
        "--timeout",
        "20s",
        "--json",
        env=held,
    )
    took = time.monotonic() - started
    assert cut.returncode == 0, cut.stderr
    summary = json.loads(cut.stdout)
    assert 20 <= took < 20 + 10, took  # (interpreter start and imports included)
    assert summary["stop_reason"] == "timeout" and summary["status"] == StudyStatus.INTERRUPTED
    assert summary["deadline_note"] and summary["confirmation"] is None
    # The deadline is no probe's outcome: a probe it stopped is not stored, and will be probed again.
    kept = _probes(db, "d")
    assert len(kept) == 1 and ProbeStatus.TIMEOUT not in {p.result.status for p in kept}
    # (The same command again, in this process with the worker's warm probe child: the cut is the subject.)
    done = invoke(
        "search",
        "--model",
        tiny_model,
        "--gpu-budget",
        "1GiB",
        *SPACE,
        "--measure-seconds",
        "0.2",
        "--study",
        "d",
        "--db",
        db,
        "--json",
    )
    assert done.returncode == 0, done.stderr
    finished = json.loads(done.stdout)
    assert finished["status"] == StudyStatus.FINISHED and finished["confirmation"] is not None
    # Each config settled once: what the cut search measured was kept, not measured again (the
    # confirmation round re-times the contenders in place: it adds no rows).
    assert sorted(Counter(p.config_key for p in _probes(db, "d")).values()) == [1, 1, 1, 1]


@pytest.mark.parametrize("predict", ["--no-predict", "--predict"])
def test_a_timeout_that_ends_before_the_first_probe_is_one_line_and_writes_nothing(tiny_model, tmp_path, predict):
    db = tmp_path / "short.db"
    # The probe's process (and its fork server) never gets past importing torch (tests/helpers/
    # faults): the deadline holds the wait for it, which a busy machine's imports stretched past 10 s
    # while multiprocessing waited for the fork server without a limit; and so it does for the
    # estimator's processes, started first (forked from the same server) when the search predicts.
    stuck = fault_env("stuck-start")
    stuck[GATE_ENV] = str(tmp_path / "never")
    started = time.monotonic()
    short = autotune(
        "search",
        "--model",
        tiny_model,
        "--gpu-budget",
        "1GiB",
        *SPACE,
        predict,
        "--study",
        "short",
        "--db",
        f"sqlite:///{db}",
        "--timeout",
        "1s",
        env=stuck,
    )
    lines = short.stderr.strip().splitlines()
    assert short.returncode == 2 and len(lines) == 1 and "--timeout 1 s ran out" in lines[0], short.stderr
    assert "give a longer --timeout" in lines[0] and not db.exists()
    assert time.monotonic() - started < 1 + 10  # (interpreter start and imports included)


def test_a_stopped_probe_child_ends_as_a_timeout_within_its_limit_and_the_search_finishes(tiny_model, tmp_path):
    db = f"sqlite:///{tmp_path / 'stopped.db'}"
    # The child's second probe waits at the gate (tests/helpers/faults) until the child is stopped:
    # the stop comes mid-probe whatever the machine's speed.
    gate = tmp_path / "gate"
    search = subprocess.Popen(
        autotune_command(
            "search",
            "--model",
            tiny_model,
            "--gpu-budget",
            "1GiB",
            *SPACE,
            "--study",
            "s",
            "--db",
            db,
            "--probe-timeout",
            "5s",
            "--no-confirm",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**fault_env("gate", on_probe=2), GATE_ENV: str(gate)},
    )
    try:
        wait_for(lambda: _probes(db, "s"), what="the first probe")
        [child] = wait_for(lambda: probe_children(search.pid), what="the probe child")
        os.kill(child, signal.SIGSTOP)
        stopped = time.monotonic()
        gate.touch()  # (the next child's probes go on)
        wait_for(
            lambda: [p for p in _probes(db, "s") if p.result.status == ProbeStatus.TIMEOUT],
            seconds=30,
            what="a timeout probe",
        )
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
