"""The defects a first GPU run would hit, each exercised where it can be without CUDA.

The process tests run real probes of a tiny GPT-2 in real probe children, misbehaving through
tests/helpers/faults: a module-wide code patch (what Liger does), a tensor left alive, an illegal memory
access whose cleanup raises again, and the standby child surviving a probe that retires its own.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from autotune.levers import speed_levers
from autotune.levers.config import ProbeConfig
from autotune.estimate import cuda_constants
from autotune.probe import ProbeRunner, ProbeSettings
from autotune.probe.cap import context_bytes
from autotune.probe.devices import process_bytes, supports_attention_dtype
from autotune.probe.hygiene import LEFTOVER_TOLERANCE_BYTES, CodeWatch, why_not_reused
from autotune.probe.speedups import use_allocator
from autotune.levers.recipes import memory_caveats
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.status import ProbeStatus
from tests.helpers.faults import inject_fault

MiB = 2**20
GiB = 2**30
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


# --- the allocator lever: both variable names, the newer one first ----------------------------------


def test_the_allocator_lever_sets_both_variable_names_or_unsets_both():
    assert speed_levers.allocator_environment("expandable") == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    assert speed_levers.allocator_environment("default") == {
        "PYTORCH_ALLOC_CONF": None,
        "PYTORCH_CUDA_ALLOC_CONF": None,
    }
    assert speed_levers.environment_line("expandable") == (
        "export PYTORCH_ALLOC_CONF=expandable_segments:True PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )


def test_the_newer_allocator_variable_is_the_one_that_counts():
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert speed_levers.effective_alloc_conf(both) == "expandable_segments:False"
    assert speed_levers.effective_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "x"}) == "x"
    assert speed_levers.effective_alloc_conf({}) == ""


def test_a_training_run_unsets_a_users_allocator_setting_its_probe_did_not_measure(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    said = use_allocator("default")
    assert said == "PYTORCH_ALLOC_CONF=expandable_segments:True unset (its probe measured the default allocator)"
    assert speed_levers.effective_alloc_conf(os.environ) == ""
    assert use_allocator("expandable") == "PYTORCH_ALLOC_CONF=expandable_segments:True"
    assert os.environ["PYTORCH_ALLOC_CONF"] == os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# --- the CUDA context: this process's memory, not the card's ----------------------------------------


def test_the_context_is_this_processs_memory_outside_its_allocator():
    # NVML lists this process at 1.5 GiB with 1 GiB reserved by its allocator: 0.5 GiB of context,
    # however much the card's other processes hold.
    assert context_bytes(1 * GiB, own_bytes=3 * GiB // 2, card_used_bytes=40 * GiB) == GiB // 2
    # Without NVML's figure, the card's used memory: an upper bound.
    assert context_bytes(1 * GiB, card_used_bytes=3 * GiB) == 2 * GiB
    assert context_bytes(2 * GiB, own_bytes=1 * GiB) == 0  # never negative
    with pytest.raises(ValueError):
        context_bytes(0)


def test_nvml_process_lists_give_one_processs_bytes():
    listed = [(100, 5 * GiB), (200, None), (300, 600 * MiB)]
    assert process_bytes(listed, 300) == 600 * MiB
    assert process_bytes(listed, 200) is None  # listed without a figure
    assert process_bytes(listed, 400) is None and process_bytes(None, 100) is None


# --- lasting skips and caveats ----------------------------------------------------------------------


def test_flash_attention_in_fp32_is_a_lasting_skip_with_what_to_do():
    why = supports_attention_dtype("flash_attention_2", "fp32", "fp32")
    assert why is not None and "--precisions bf16" in why
    assert supports_attention_dtype("flash_attention_2", "tf32", "fp32") is not None
    assert supports_attention_dtype("flash_attention_2", "bf16", "fp32") is None
    assert supports_attention_dtype("flash_attention_2", "fp32", "bf16") is None  # the tensors are bf16
    assert supports_attention_dtype("sdpa", "fp32", "fp32") is None


def test_a_paged_optimizers_state_outside_the_cap_is_said():
    assert memory_caveats("adamw") == []
    (caveat,) = memory_caveats("paged_adamw_8bit")
    assert "outside PyTorch's allocator" in caveat and "the cap does not hold it" in caveat


def test_a_measured_cuda_constant_is_recorded_beside_the_others(tmp_path):
    copy = tmp_path / "cuda_constants.json"
    assumed = {
        name: {"bytes": c.bytes, "source": "assumed: for this test"} for name, c in cuda_constants.load().items()
    }
    copy.write_text(json.dumps(assumed))
    assert not any(c.measured for c in cuda_constants.load(copy).values())
    cuda_constants.record_measured(
        cuda_constants.CONTEXT, 531 * MiB, "NVIDIA H100, driver 580, torch 2.11, 2026-11-25", path=copy
    )
    constants = cuda_constants.load(copy)
    assert constants[cuda_constants.CONTEXT].bytes == 531 * MiB and constants[cuda_constants.CONTEXT].measured
    assert (
        constants[cuda_constants.CUBLAS_WORKSPACES].source == "assumed: for this test"
    )  # the others kept as they were
    with pytest.raises(KeyError):
        cuda_constants.record_measured("cudnn_bytes", 1, "here", path=copy)
    assert json.loads(copy.read_text())[cuda_constants.CONTEXT]["source"].startswith("measured on NVIDIA H100")


# --- whether a probe process may run the next probe -------------------------------------------------


def result(status: ProbeStatus, error: str | None = None) -> ProbeResult:
    return ProbeResult(status=status, budget_bytes=GiB, margin_bytes=0, error=error)


def test_a_process_is_reused_only_after_a_clean_probe_that_patched_and_kept_nothing():
    assert why_not_reused(result(ProbeStatus.OK), CUDA, 0, []) is None
    assert why_not_reused(result(ProbeStatus.OK), CUDA, LEFTOVER_TOLERANCE_BYTES, []) is None
    assert why_not_reused(result(ProbeStatus.OOM, "CUDA out of memory"), CUDA, 0, []) == "the probe ended oom"
    assert why_not_reused(result(ProbeStatus.ERROR), CPU, 0, []) == "the probe ended error"
    assert "left 4,194,304 bytes allocated" in why_not_reused(result(ProbeStatus.OK), CUDA, 4 * MiB, [])
    many = [f"m.f{i}" for i in range(5)]
    assert (
        why_not_reused(result(ProbeStatus.OK), CUDA, 0, many)
        == "the probe replaced module code (m.f0, m.f1, m.f2 and 2 more)"
    )


def test_code_watch_sees_a_function_or_a_method_replaced_module_wide(monkeypatch):
    import torch.nn.functional as F
    from transformers.models.gpt2 import modeling_gpt2

    watch = CodeWatch()
    watch.note()
    assert watch.replaced() == []
    monkeypatch.setattr(F, "gelu", lambda x: x)
    monkeypatch.setattr(modeling_gpt2.GPT2MLP, "forward", lambda self, x: x)
    assert sorted(watch.replaced()) == [
        "torch.nn.functional.gelu",
        "transformers.models.gpt2.modeling_gpt2.GPT2MLP.forward",
    ]


# --- the same, in real probe children ---------------------------------------------------------------


def config(model: str, **levers) -> ProbeConfig:
    return ProbeConfig(model=model, **{"micro_batch": 2, "block_size": 64, **levers})


def settings() -> ProbeSettings:
    return ProbeSettings(device="cpu", measure_steps=2)


@pytest.mark.slow
def test_clean_probes_of_several_levers_share_one_child(tiny_model):
    # No false alarm: checkpointing, bf16 and another micro-batch in one warm child.
    with ProbeRunner(settings()) as runner:
        for levers in ({}, {"checkpointing": True}, {"precision": "bf16"}, {"micro_batch": 4}):
            assert runner.run(config(tiny_model, **levers), runner.settings.budget(GiB)).status == "ok"
        assert runner.children_started == 1 and runner.retired == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, why",
    [
        (
            "patch-module",
            "the probe replaced module code (transformers.models.gpt2.modeling_gpt2.eager_attention_forward)",
        ),
        ("leak", "the probe left 4,194,304 bytes allocated"),
    ],
)
def test_a_probe_that_patches_code_or_keeps_memory_is_the_last_in_its_process(tiny_model, monkeypatch, fault, why):
    inject_fault(monkeypatch, fault)
    with ProbeRunner(settings()) as runner:
        first = runner.run(config(tiny_model), runner.settings.budget(GiB))
        assert first.status == "ok", first.error  # the probe itself measured what it said
        assert runner.retired == [why]
        second = runner.run(config(tiny_model), runner.settings.budget(GiB))
        assert second.status == "ok" and second.startup_seconds > 0 and runner.children_started == 2


@pytest.mark.slow
def test_an_illegal_access_whose_cleanup_raises_again_is_reported_with_its_own_message(tiny_model, monkeypatch):
    inject_fault(monkeypatch, "poison")
    with ProbeRunner(settings()) as runner:
        got = runner.run(config(tiny_model), runner.settings.budget(GiB))
    assert got.status == "error"  # not "crashed (exit code 1)", and not retried in fresh processes
    assert "an illegal memory access was encountered" in got.error and "raised again" not in got.error
    assert runner.children_started == 1 and runner.retired == ["the probe ended error"]


@pytest.mark.slow
def test_the_standby_child_survives_a_probe_that_retires_its_own(tiny_model, monkeypatch, spawned_children):
    # An error ends the child after its reply; the standby started beside it (on CUDA, always) must
    # not be stopped with it, as it was when every untrusted probe closed the runner.
    inject_fault(monkeypatch, "error")
    with ProbeRunner(settings(), standby=True) as runner:
        first = runner.run(config(tiny_model), runner.settings.budget(GiB))
        assert first.status == "error" and first.startup_seconds > 0
        spare = runner._spare
        assert spare is not None and spare[1].poll(120)  # kept, and it said Ready
        second = runner.run(config(tiny_model), runner.settings.budget(GiB))
        assert second.status == "error" and second.startup_seconds < 0.5 < first.startup_seconds
        assert runner.retired == ["the probe ended error"] * 2 and runner.children_started == 3
