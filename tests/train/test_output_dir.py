"""Where a run writes: the default directory derived from a study's name is one plain path part
(never `.`, `..` or absolute, whatever an older autotune stored), and an --output-dir that cannot
be a directory is refused before anything is recorded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autotune.vocabulary.errors import BadInput
from autotune.train import DEFAULT_OUTPUT_ROOT, default_output_dir
from autotune.train.fine_tune import check_output_dir


@pytest.mark.parametrize(
    "study, part",
    [
        ("gpt2-8GiB", "gpt2-8GiB"),
        ("..", "__"),  # (old code: autotune-runs/.. , the working directory itself)
        (".", "_"),
        ("...", "___"),
        ("", "_"),
        ("/etc", "_etc"),
        ("../../x", ".._.._x"),
        ("team:gpt2@h100+ckpt", "team_gpt2_h100_ckpt"),
        ("a b", "a_b"),
    ],
)
def test_the_default_output_dir_is_one_plain_part_under_the_root(study, part):
    path = default_output_dir(study)
    assert path == Path(DEFAULT_OUTPUT_ROOT) / part
    assert not path.is_absolute() and len(path.parts) == 2 and path.name not in (".", "..", "")
    assert Path(os.path.normpath(path)).parent == Path(DEFAULT_OUTPUT_ROOT)


def test_an_output_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(BadInput, match="is a file, not a directory"):
        check_output_dir(notes)
    with pytest.raises(BadInput, match="is a file, so no directory can be made there"):
        check_output_dir(notes / "run" / "deeper")
    assert notes.read_text() == "keep me"


def test_new_and_existing_directories_are_accepted_and_nothing_is_made(tmp_path):
    check_output_dir(tmp_path)
    check_output_dir(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory whatever its mode")
def test_a_directory_this_user_cannot_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(BadInput, match="cannot be written by this user"):
            check_output_dir(locked / "run")
    finally:
        locked.chmod(0o755)
