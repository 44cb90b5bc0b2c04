"""Shared fixtures. Every test runs hermetically: AUTOTUNE_HOME and AUTOTUNE_DB point into
tmp_path, so nothing touches a user's real data."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# A 2-layer GPT-2, small enough that a CPU probe takes about a second of steps.
TINY_GPT2 = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 2,
    "vocab_size": 1024, "n_positions": 256, "n_ctx": 256, "bos_token_id": 0, "eos_token_id": 0,
}


@pytest.fixture(autouse=True)
def hermetic_home(tmp_path, monkeypatch):
    home = tmp_path / "autotune-home"
    home.mkdir()
    monkeypatch.setenv("AUTOTUNE_HOME", str(home))
    monkeypatch.setenv("AUTOTUNE_DB", f"sqlite:///{home / 'autotune.db'}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # tests never reach for the hub
    monkeypatch.delenv("AUTOTUNE_TEST_FAULT", raising=False)
    return home


def write_model_dir(path: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_GPT2, **overrides}))
    return path


@pytest.fixture
def tiny_model(tmp_path) -> str:
    """A local directory holding only the config.json of a tiny GPT-2."""
    return str(write_model_dir(tmp_path / "tiny-gpt2"))


def cuda_available() -> bool:
    # Ask torch only when a driver is visible: importing torch costs seconds.
    if not (shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia")):
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
