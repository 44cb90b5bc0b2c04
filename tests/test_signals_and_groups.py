"""SIGHUP (a closed terminal) stops a command as SIGTERM does, and every process a search starts goes
with it, a probe child's own children included: a helper a model's own code starts, that ignores
SIGTERM and has no parent-death signal, is killed with the probe child's process group, whether the
search stops the child, ends on a signal, or is killed with -9 (the guard in the group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import autotune_command, wait_for
from tests.helpers.faults import fault_env
from tests.helpers.processes import alive

pytestmark = pytest.mark.slow

# A helper that a model's code might start: it ignores SIGTERM and SIGHUP and dies with no parent.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "signal.signal(signal.SIGHUP, signal.SIG_IGN); time.sleep(600)"
)


def _assert_gone(pids: list[int], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:  # (not left behind for the next test, whatever this one says)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {within:.0f} s later: {left}"


def _pids(path: Path) -> list[int]:
    return [int(word) for word in path.read_text().split()] if path.exists() else []


# -- spawn targets (run in the children; module-level so that spawn finds them) -----------------------
def start_stubborn_helper(pidfile: str) -> None:
    """A stand-in probe child: start the helper, say both pids, and wait to be killed."""
    helper = subprocess.Popen([sys.executable, "-c", STUBBORN])
    Path(pidfile).write_text(f"{os.getpid()} {helper.pid}\n")
    time.sleep(600)


def ready_child_with_helper(conn, pidfile: str) -> None:
    """A stand-in for the probe child's main: Ready, the helper, then wait to be told to stop."""
    from autotune.probe.protocol import Ready

    helper = subprocess.Popen([sys.executable, "-c", STUBBORN])
    Path(pidfile).write_text(f"{os.getpid()} {helper.pid}\n")
    conn.send(Ready(startup_seconds=0.0))
    while conn.recv() is not None:
        pass


# -- signals ----------------------------------------------------------------------------------------
def test_sighup_aborts_a_search_as_sigterm_does():
    from autotune.host.processes import Terminated
    from autotune.search.loop import stop_on_first_interrupt

    # (A suite started under nohup has SIGHUP ignored, which autotune rightly keeps: not this test's case.)
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(Terminated):
            with stop_on_first_interrupt():
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(5)  # (the handler raises before this ends)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_sighup_stays_ignored_under_nohup():
    from autotune.host.processes import on_termination

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        replaced = on_termination(lambda *_: None)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signal.SIGHUP not in replaced
        for signum, handler in replaced.items():
            signal.signal(signum, handler)
    finally:
        signal.signal(signal.SIGHUP, previous)


def _hangup_as_a_terminal_would() -> None:
    """A search started from a terminal takes SIGHUP's default (a suite under nohup would pass
    its SIG_IGN on, and autotune keeps an ignored SIGHUP ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


# -- process groups ---------------------------------------------------------------------------------
def test_kill_9_of_the_parent_takes_the_childs_stubborn_helper_too(tmp_path):
    """The parent (a search, here a stand-in) killed with -9: the child dies by its parent-death
    signal, and the helper, which neither signal reaches, by the guard of the child's group."""
    pidfile = tmp_path / "pids"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import multiprocessing as mp, os, sys, time\n"
                "from autotune.host.processes import run_as_child\n"
                "p = mp.get_context('spawn').Process(target=run_as_child, args=(os.getpid(), "
                f"'tests.test_signals_and_groups:start_stubborn_helper', {str(pidfile)!r}), daemon=True)\n"
                "p.start(); time.sleep(600)\n"
            ),
        ],
        cwd=Path(__file__).parent.parent,
    )
    try:
        wait_for(lambda: len(_pids(pidfile)) == 2, seconds=60, what="the child and its helper")
        child, helper = _pids(pidfile)
        assert os.getpgid(child) == child and os.getpgid(helper) == child  # the child leads the helper's group
        parent.kill()
        parent.wait(timeout=10)
        _assert_gone([child, helper])
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.parametrize("how", ["close", "kill"])
def test_the_runner_stops_the_childs_group_with_it(how, tmp_path, monkeypatch):
    """The runner's polite stop (after a probe) and its kill (a timeout, a second Ctrl-C) both take
    whatever the child started."""
    from autotune.probe import runner as runner_module
    from autotune.probe.settings import ProbeSettings

    pidfile = tmp_path / "pids"
    monkeypatch.setattr(runner_module, "CHILD_MAIN", "tests.test_signals_and_groups:ready_child_with_helper")
    monkeypatch.chdir(Path(__file__).parent.parent)
    runner = runner_module.ProbeRunner(ProbeSettings(device="cpu"), standby=False)
    original = runner._spawn

    def spawn(**limits):  # the stand-in's target takes the pid file after the pipe
        return original(str(pidfile), **limits)

    runner._spawn = spawn
    try:
        runner._start_child(60)
        child, helper = _pids(pidfile)
        assert alive(helper)
        runner.close() if how == "close" else runner._kill()
        _assert_gone([child, helper])
    finally:
        runner._spawn = original
        runner.close()


# -- a real search ------------------------------------------------------------------------------------
MODELING = """import os
import subprocess
import sys

from transformers import GPT2LMHeadModel

from .configuration_remote import RemoteGPT2Config

if os.environ.get("HELPER_PIDS"):  # a helper of the model's own, as some models' code starts
    _helper = subprocess.Popen([sys.executable, "-c", {stubborn!r}])
    with open(os.environ["HELPER_PIDS"], "a") as _pids:
        _pids.write(f"{{_helper.pid}}\\n")


class RemoteGPT2LMHeadModel(GPT2LMHeadModel):
    config_class = RemoteGPT2Config
"""


def test_sighup_mid_probe_stops_the_search_and_everything_it_started(tmp_path):
    """A terminal closed on a search of a model whose code starts a stubborn helper: exit 143 in
    one line, the study interrupted, no claim running, and no process left, the helper included."""
    from tests.helpers.models import write_remote_model
    from tests.helpers.processes import descendants
    from tests.helpers.studies import TWO_CANDIDATES as SPACE
    from tests.helpers.studies import running_claims, status

    model = write_remote_model(tmp_path / "remote-gpt2", MODELING.format(stubborn=STUBBORN))
    db, pidfile = str(tmp_path / "hup.db"), tmp_path / "helpers"
    # The probe hangs in its first timed step (tests/helpers/faults): the signal comes mid-probe
    # whatever the machine's speed.
    env = {**fault_env("hang"), "HELPER_PIDS": str(pidfile), "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    search = subprocess.Popen(
        autotune_command("search", "--model", str(model), *SPACE, "--trust-remote-code", "--db", db, "--study", "hup"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_hangup_as_a_terminal_would,
    )
    try:
        wait_for(lambda: _pids(pidfile) and running_claims(db, "hup"), seconds=120, what="a probe in flight")
        started = descendants(search.pid) | set(_pids(pidfile))
        search.send_signal(signal.SIGHUP)
        _, stderr = search.communicate(timeout=60)
    finally:
        if search.poll() is None:
            search.kill()
    lines = stderr.strip().splitlines()
    assert search.returncode == 143 and len(lines) == 1 and "terminated" in lines[0], stderr
    assert status(db, "hup") == "interrupted" and not running_claims(db, "hup")
    _assert_gone(sorted(started))


# -- a signal at the instant a thing is made -------------------------------------------------------
def test_a_signal_in_a_held_block_arrives_just_after_it_whichever_thread_the_kernel_gives_it():
    import threading

    from autotune.host.processes import signals_held

    arrived: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: arrived.append("handled"))
    other = threading.Event()
    # (A second thread that does not block the signal, as the search's and the test runner's have.)
    waiter = threading.Thread(target=other.wait, args=(30,), daemon=True)
    waiter.start()
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            arrived.append("end of the block")
        arrived.append("after it")
    finally:
        signal.signal(signal.SIGTERM, previous)
        other.set()
    assert arrived == ["end of the block", "handled", "after it"]


def test_a_rank_launch_stopped_as_it_begins_leaves_no_directory(tmp_path, monkeypatch):
    from autotune.probe.torchrun import RankLaunch
    from autotune.host.processes import Terminated

    def terminate(signum, frame):
        raise Terminated

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (read TMPDIR again)
    previous = signal.signal(signal.SIGTERM, terminate)
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp_then_sigterm(*args, **kwargs):  # the signal in the instant after the directory is made
        made = real_mkdtemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return made

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_sigterm)
    try:
        with pytest.raises(Terminated):
            with RankLaunch("autotune-ranks-"):
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(temporary.iterdir()) == []


def test_a_rank_launch_killed_with_9_leaves_no_directory_and_no_janitor(tmp_path):
    # The search that made the run directory is killed with -9 (its agent and ranks die with it):
    # the janitor it started beside the directory removes it, then ends.
    code = (
        "import time\nfrom autotune.probe.torchrun import RankLaunch\n"
        "with RankLaunch('autotune-ranks-') as launch:\n"
        "    print(launch.run_dir, launch.janitor.pid, flush=True)\n    time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=Path(__file__).parent.parent,
    )
    try:
        run_dir, janitor = parent.stdout.readline().split()
        assert Path(run_dir).parent == tmp_path and Path(run_dir).is_dir()
        parent.kill()
        parent.wait(timeout=10)
        wait_for(
            lambda: not Path(run_dir).exists() and not alive(int(janitor)),
            seconds=15,
            what="the run directory removed and the janitor gone",
        )
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_rank_launch_that_ends_stops_its_janitor_and_removes_the_directory(tmp_path, monkeypatch):
    from autotune.probe.torchrun import RankLaunch

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (read TMPDIR again)
    with RankLaunch("autotune-ranks-") as launch:
        janitor = launch.janitor
        assert janitor.poll() is None and Path(launch.run_dir).parent == temporary
    assert janitor.returncode is not None  # stopped and reaped
    assert list(temporary.iterdir()) == []
