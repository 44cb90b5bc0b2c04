"""A training run whose process is gone never reads as running: `kill -9` of `autotune train`
leaves its run `interrupted` for the next command (autotune/store/liveness.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers.cli import autotune, wait_for

pytestmark = pytest.mark.slow


def test_kill_9_of_train_leaves_its_run_interrupted_for_the_next_command(workspace, tmp_path):
    """`workspace` (tests/train/conftest.py) holds a finished CPU study of a tiny model with its
    tokenizer, and a corpus."""
    out = tmp_path / "run"
    train = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune",
            "train",
            "--study",
            workspace.study,
            "--db",
            workspace.db,
            "--dataset",
            str(workspace.corpus),
            "--output-dir",
            str(out),
            "--device",
            "cpu",
            "--max-steps",
            "100000",
            "--save-steps",
            "100000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: _runs(workspace.db) and _runs(workspace.db)[-1]["status"] == "running", what="the run")
        os.killpg(train.pid, signal.SIGKILL)
        train.wait(timeout=30)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    assert _runs(workspace.db)[-1]["status"] == "interrupted"
    listed = autotune("runs", "--db", workspace.db)
    assert listed.returncode == 0 and "interrupted" in listed.stdout and "running" not in listed.stdout


def _runs(db: str) -> list[dict]:
    listed = autotune("runs", "--db", db, "--format", "json")
    return json.loads(listed.stdout) if listed.returncode == 0 else []
