"""The issue's GPU checks: gpt2 under a card-sized budget and under 8 GiB. Skipped without CUDA."""

from __future__ import annotations

import pytest

from autotune.config import ProbeConfig
from autotune.probe import ProbeSettings, run_probe

pytestmark = pytest.mark.gpu
GiB = 2**30


def _card_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def test_trainer_defaults_fit_the_whole_card_and_oom_under_8gib():
    cfg = ProbeConfig(model="gpt2", micro_batch=8, block_size=512, precision="fp32", attention="sdpa")
    settings = ProbeSettings(device="cuda")
    whole = run_probe(cfg, _card_bytes(), settings=settings)
    assert whole.status == "ok", whole.error
    assert whole.peak_reserved_bytes > 6 * GiB  # far above a load-time estimate of ~2 GiB
    small = run_probe(cfg, 8 * GiB, settings=settings)
    assert small.status == "oom"


def test_bf16_with_checkpointing_fits_8gib():
    cfg = ProbeConfig(model="gpt2", micro_batch=8, block_size=512, precision="bf16", checkpointing=True)
    result = run_probe(cfg, 8 * GiB, settings=ProbeSettings(device="cuda"))
    assert result.status == "ok", result.error
    assert result.required_bytes + result.margin_bytes <= 8 * GiB
    assert result.mfu is not None and 0 < result.mfu < 1
