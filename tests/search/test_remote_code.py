"""A model that brings its own code (`auto_map`): refused without --trust-remote-code (one line,
nothing written: tests/search/test_faults.py), searched with it, its memory predicted too (the
estimator builds the model's own classes in its trace child)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.estimate import estimate_memory
from tests.helpers.cli import autotune, invoke
from tests.helpers.models import write_remote_model

pytestmark = pytest.mark.slow


@pytest.fixture
def remote_model(tmp_path, monkeypatch) -> str:
    """A tiny GPT-2 under a model type transformers does not ship, with its code beside it."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))  # where transformers copies the code
    return str(write_remote_model(tmp_path / "remote-gpt2"))


def test_the_estimator_builds_the_models_own_code_when_allowed(remote_model):
    config = ProbeConfig(model=remote_model, micro_batch=2, block_size=64)
    with pytest.raises(BadInput, match="--trust-remote-code"):
        estimate_memory(config, device_type="cpu", use_cache=False)
    estimate = estimate_memory(config, device_type="cpu", use_cache=False, trust_remote_code=True)
    assert estimate.params > 0 and estimate.peak_bytes > estimate.params


def test_a_search_with_trust_remote_code_predicts_and_probes(remote_model, tmp_path):
    db = str(tmp_path / "remote.db")
    flags = [
        "--model",
        remote_model,
        "--gpu-budget",
        "64MiB",
        "--device",
        "cpu",
        "--micro-batches",
        "1,2",
        "--block-sizes",
        "64",
        "--effective-batch",
        "2",
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--measure-steps",
        "1",
        "--db",
        db,
        "--json",
    ]
    refused = invoke("search", *flags)  # (a refusal: read in this process)
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr
    assert not Path(db).exists()
    done = autotune("search", *flags, "--trust-remote-code")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "finished" and summary["best"] is not None
    from autotune.store import open_store

    with open_store(db) as store:  # predictions ran (not --no-predict) and were stored beside the probes
        assert all(p.predicted_peak_bytes for p in store.probes(summary["study"]) if p.result.status == "ok")
