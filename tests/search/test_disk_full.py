"""A disk that fills mid-search: the search stops with one line, its study reads as interrupted,
and with space freed the same command goes on. (Its own module, so that the test workers share
the fault tests between them.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from autotune.vocabulary.status import StudyStatus
from autotune.store import open_store
from tests.helpers.cli import autotune_command, invoke, wait_for
from tests.helpers.studies import probes

pytestmark = pytest.mark.slow


def _stored(db: str, study: str) -> int:
    try:
        return len(probes(db, study))
    except Exception:  # the study is not created yet
        return 0


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_a_disk_filling_mid_search_leaves_the_study_interrupted_and_resumable(tiny_model, tmp_path, warm_child):
    """The results database on a small tmpfs; once the first probe is stored, the rest of the disk
    is filled. The search stops with one line, its study reads as interrupted (its process is gone),
    and with space freed the same command goes on and finishes, re-running nothing it stored."""
    disk = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount_tmpfs(disk, "16m"):
        pytest.skip("mounting a tmpfs needs root (and a kernel that lets this container mount)")
    try:
        db = f"sqlite:///{disk / 'full.db'}"
        args = [
            "search",
            "--model",
            tiny_model,
            "--gpu-budget",
            "1GiB",
            "--device",
            "cpu",
            "--micro-batches",
            "1,2,4,8",
            "--block-sizes",
            "64",
            "--effective-batch",
            "8",
            "--precisions",
            "fp32",
            "--checkpointing",
            "off",
            "--attention",
            "sdpa",
            "--no-predict",
            "--no-confirm",
            "--measure-seconds",
            "0.5",
            "--measure-steps",
            "1",
            "--study",
            "full",
            "--db",
            db,
        ]
        # The filler is created while there is room, then filled once the first probe is stored;
        # unbuffered, so that closing it has nothing left to write (a buffered file's close flushes
        # again, and raised ENOSPC outside pytest.raises, in 3 runs of 3 beside the evidence test).
        with open(disk / "filler", "wb", buffering=0) as filler:
            search = subprocess.Popen(
                autotune_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            wait_for(lambda: _stored(db, "full") >= 1, what="the first probe")
            with pytest.raises(OSError):  # every byte left
                while True:
                    filler.write(b"\0" * 65536)
        _, stderr = search.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        assert search.returncode == 2 and len(lines) == 1 and "disk is full" in lines[0], stderr
        with open_store(db, read_only=True) as store:
            assert store.study("full").status == StudyStatus.INTERRUPTED
            stored = {p.config_key for p in store.probes("full")}
        (disk / "filler").unlink()
        done = invoke(*args)  # (in this process, with the worker's warm probe child: the full disk is the subject)
        assert done.returncode == 0, done.stderr
        with open_store(db, read_only=True) as store:
            assert store.study("full").status == StudyStatus.FINISHED
            keys = [p.config_key for p in store.probes("full")]
        assert len(keys) == len(set(keys)) == 4 and stored <= set(keys)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
