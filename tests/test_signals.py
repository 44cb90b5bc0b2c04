"""Signals stop every command, done to real processes: Ctrl-C of `plan` and `estimate` ends them and
their trace children within seconds, even when the shell started them with SIGINT ignored (a
background job of a non-interactive shell). (`kill -9` of `train`: tests/train/test_liveness.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.cli import wait_for
from tests.helpers.processes import assert_all_gone, descendants

pytestmark = pytest.mark.slow


def _started_ignoring_sigint(*args: str) -> subprocess.Popen:
    """`python -m autotune ARGS` in a session of its own, started the way a non-interactive shell
    starts a background job: with SIGINT ignored."""
    script = f'trap "" INT; exec {sys.executable} -m autotune {" ".join(args)}'
    return subprocess.Popen(
        ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.parametrize(
    "args",
    [
        ("plan", "--model", "gpt2", "--gpu", "h100", "--no-cache"),
        ("estimate", "--model", "gpt2", "--micro-batch", "8", "--block-size", "512", "--no-cache"),
    ],
    ids=["plan", "estimate"],
)
def test_ctrl_c_stops_the_command_and_its_trace_children_within_seconds(args):
    command = _started_ignoring_sigint(*args)
    try:
        children = wait_for(lambda: descendants(command.pid), what="trace children")
        time.sleep(2)  # tracing by now
        children |= descendants(command.pid)
        os.killpg(command.pid, signal.SIGINT)  # what Ctrl-C at a terminal sends: the whole group
        sent = time.monotonic()
        _, stderr = command.communicate(timeout=30)
        assert time.monotonic() - sent < 5, "the command outlived Ctrl-C by 5 s"
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
    assert command.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "autotune: interrupted" and "Traceback" not in stderr
    assert_all_gone(children, within=5)
