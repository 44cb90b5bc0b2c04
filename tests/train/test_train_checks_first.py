"""`train` finds a user's mistakes before it searches, records or caches anything: blank text in
any number of rows, an evaluation share that leaves nothing to train on, a corrupt safetensors
file, an absurd --epochs, an --output-dir on a full disk. A disk that fills while the run saves is
an outcome (the run marked failed, one line), not a traceback."""

from __future__ import annotations

import errno
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from autotune.vocabulary.errors import BadInput, DatasetError
from tests.helpers.cli import assert_usage_error, autotune
from tests.helpers.models import write_model_dir


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def _jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def test_blank_text_in_many_rows_is_refused_when_loaded(tmp_path):
    from autotune.data.text import load_text

    with pytest.raises(DatasetError, match="no text"):
        load_text(_jsonl(tmp_path / "blank.jsonl", ["", "  ", "\n"] * 500))  # 1,500 rows, none with text
    assert load_text(_jsonl(tmp_path / "late.jsonl", [""] * 1500 + ["words at last"])).train.num_rows == 1501


def test_an_eval_share_that_leaves_nothing_to_train_on_is_refused(tmp_path):
    from autotune.data.text import load_text

    with pytest.raises(DatasetError, match="at most 50%"):
        load_text(_jsonl(tmp_path / "some.jsonl", ["some text"] * 10), eval_split="99.99%")


def test_a_corrupt_safetensors_file_is_refused_before_anything(tmp_path):
    from autotune.specs.models import resolve_model
    from autotune.train.loading import check_weights

    model = write_model_dir(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"\xff" * 64)  # a header length far past the file's end
    with pytest.raises(BadInput, match="model.safetensors is not a readable safetensors file"):
        check_weights(resolve_model(str(model)))
    check_weights(resolve_model(str(model)), random_init=True)  # (not read: not used)
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    check_weights(resolve_model(str(model)))


def test_an_output_dir_on_a_full_disk_is_refused(tmp_path, monkeypatch):
    from autotune.train import fine_tune

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(BadInput, match="free on its disk"):
        fine_tune.check_output_dir(tmp_path / "out")


def test_a_disk_filling_while_saving_is_told_as_such():
    from autotune.train.run import disk_full

    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(
        RuntimeError(
            "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing "
            "file data/0: file write failed"
        )
    )
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_full(wrapped)
    assert not disk_full(RuntimeError("shapes do not match"))


@pytest.mark.parametrize("case", ["corrupt-weights", "epochs", "blank-text"])
def test_train_refuses_before_writing_anything(case, tmp_path, datasets_cache):
    """The command: exit 2, one line, no database, no output directory, no datasets cache."""
    model = write_model_dir(tmp_path / "model")
    data = _jsonl(tmp_path / "data.jsonl", ["some text to train on"] * 20)
    extra: list[str] = []
    if case == "corrupt-weights":
        (model / "model.safetensors").write_bytes(b"not safetensors at all")
    elif case == "epochs":
        extra = ["--epochs", "1e308"]
    else:
        data = _jsonl(tmp_path / "data.jsonl", [""] * 1500)
    db, out = tmp_path / "train.db", tmp_path / "out"
    done = autotune(
        "train",
        "--model",
        str(model),
        "--gpu-budget",
        "1GiB",
        "--dataset",
        data,
        "--device",
        "cpu",
        "--output-dir",
        str(out),
        "--db",
        f"sqlite:///{db}",
        *extra,
        env={"HF_DATASETS_CACHE": str(datasets_cache)},
    )
    assert_usage_error(done, {"corrupt-weights": "safetensors", "epochs": "--epochs", "blank-text": "no text"}[case])
    assert not db.exists() and not out.exists()
    if case != "blank-text":  # (refused before the data is read)
        assert not datasets_cache.exists() or not any(datasets_cache.iterdir())
