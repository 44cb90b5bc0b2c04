"""The device a run trains on (`autotune.probe.devices.resolve_training_device`): with several
GPUs the chosen one becomes the only one visible to Trainer. GPUs are faked by count; the final
check is resolve_device's, recorded here rather than run."""

from __future__ import annotations

import os

import pytest
import torch

import autotune.probe.devices as devices
from autotune.vocabulary.errors import DeviceError


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n) pretends to have n GPUs; it returns the list of strings handed on to resolve_device."""
    resolved: list[str] = []

    def fake(count: int, started: bool = False) -> list[str]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)
        monkeypatch.setattr(devices, "resolve_device", lambda text: resolved.append(text) or torch.device("cpu"))
        return resolved

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored after the test, as it was
    return fake


def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_training_device(None) == torch.device("cpu")
    assert devices.resolve_training_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        devices.resolve_training_device("cuda")


def test_the_chosen_gpu_becomes_the_only_visible_one(gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6")
    resolved = gpus(3)
    devices.resolve_training_device("cuda:2")
    assert resolved == ["cuda:0"] and os.environ["CUDA_VISIBLE_DEVICES"] == "6"


def test_auto_with_several_gpus_is_the_first(gpus):
    resolved = gpus(2)
    devices.resolve_training_device("auto")
    assert resolved == ["cuda:0"] and os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_one_gpu_is_not_narrowed(gpus):
    resolved = gpus(1)
    devices.resolve_training_device("cuda")
    assert resolved == ["cuda"] and "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize("spec", ["cuda:7", "cuda:x", "mps"])
def test_what_is_not_a_gpu_here_is_left_to_resolve_device(gpus, spec):
    resolved = gpus(2)
    devices.resolve_training_device(spec)
    assert resolved == [spec] and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_once_cuda_started_only_its_first_gpu_can_be_chosen(gpus):
    resolved = gpus(2, started=True)
    devices.resolve_training_device("cuda")
    assert resolved == ["cuda:0"] and "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES=1"):
        devices.resolve_training_device("cuda:1")
