"""The stated error of a CUDA prediction (estimate/stated_error.py): what `estimate` and `plan` print
beside a prediction, and the search's skip margin."""

from __future__ import annotations

import json

import pytest

from autotune.levers.config import ProbeConfig
from autotune.estimate import MemoryEstimate
from autotune.estimate import stated_error
from autotune.estimate.stated_error import ALL, StatedError, skip_margin, stated
from autotune.render.estimate_table import render_estimate
from autotune.levers.recipes import peft_text
from autotune.search.common import SearchOptions

ERRORS = {
    ("allocated", "full"): StatedError("allocated", "full", 8, 0.02, 0.061),
    ("allocated", "lora"): StatedError("allocated", "lora", 2, 0.01, 0.015),  # too few to state alone
    ("allocated", ALL): StatedError("allocated", ALL, 14, 0.03, 0.083),
    ("nvidia-smi", ALL): StatedError("nvidia-smi", ALL, 9, 0.01, 0.02),
}


def test_a_method_with_enough_measurements_is_stated_alone_else_every_method():
    assert stated("allocated", None, ERRORS).method == "full"
    assert stated("allocated", peft_text("lora"), ERRORS).method == ALL  # 2 < MIN_OF_A_METHOD
    assert stated("reserved", None, ERRORS) is None


def test_the_skip_margin_is_the_worst_error_rounded_up_to_a_percent():
    assert skip_margin(None, ERRORS) == 0.07
    assert skip_margin(peft_text("qlora"), ERRORS) == 0.09
    assert skip_margin(None, {}) is None


def test_the_search_skips_only_beyond_the_stated_error_on_cuda(monkeypatch):
    monkeypatch.setattr(stated_error, "load", lambda path=stated_error.FILE: ERRORS)
    assert SearchOptions().margin_for("cuda") == 0.07
    assert SearchOptions().margin_for("cuda", peft_text("lora")) == 0.09
    assert SearchOptions().margin_for("cpu") == 0.0  # the CPU estimate equals the probe
    assert SearchOptions(predict_margin=0.2).margin_for("cuda") == 0.2  # the user's own wins
    monkeypatch.setattr(stated_error, "load", lambda path=stated_error.FILE: {})
    assert SearchOptions().margin_for("cuda") == 0.10  # nothing published: the default


def test_the_committed_figures_load_and_cover_every_kind():
    errors = stated_error.load()
    assert {kind for kind, _ in errors} == set(stated_error.KINDS)
    for error in errors.values():
        assert error.count >= 1 and 0 <= error.median <= error.worst
    assert json.loads(stated_error.FILE.read_text())["source"].startswith("python -m benchmarks.published")


def _estimate(device_type: str) -> MemoryEstimate:
    return MemoryEstimate(
        config=ProbeConfig(model="gpt2", micro_batch=8, block_size=512),
        device_type=device_type,
        params=100,
        grads=0,
        optimizer=200,
        activations=600,
        temporaries=50,
        workspace=0,
        peak_bytes=950,
        reserved_bytes=1200,
        context_bytes=0,
        seconds=0.1,
    )


@pytest.mark.parametrize("device_type, shown", [("cuda", True), ("cpu", False)])
def test_estimate_states_its_error_for_a_card_not_for_a_cpu(device_type, shown):
    text = render_estimate(_estimate(device_type))
    assert ("stated error" in text) == shown
    data = _estimate(device_type).to_dict()
    assert bool(data["stated_error"]) == shown
    if shown:
        assert "published measurements of" in text and "peak allocated" in text and "(nvidia-smi)" in text
