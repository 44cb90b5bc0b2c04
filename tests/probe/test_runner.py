"""Real probes of a tiny GPT-2 on CPU, through the real child process."""

from __future__ import annotations

import time

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput, BudgetError
from autotune.probe import ProbeRunner, ProbeSettings, run_probe
from tests.helpers.faults import fault_env, inject_fault

MiB = 2**20
GiB = 2**30
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner(probe_runner):
    """The worker's warm child, for the tests that expect clean probes (as the search uses it)."""
    return probe_runner(ProbeSettings(device="cpu", measure_steps=2))


def config(model: str, **levers) -> ProbeConfig:
    return ProbeConfig(model=model, **{"micro_batch": 4, "block_size": 128, **levers})


def test_ok_probe_measures_speed_and_peak(tiny_model):
    result = run_probe(config(tiny_model), 1 * GiB, device="cpu")
    assert result.status == "ok", result.error
    assert result.tokens_per_s > 0 and result.samples_per_s > 0 and result.step_seconds > 0
    assert result.tokens_per_s == pytest.approx(4 * 128 / result.step_seconds)
    # 2 layers x 64 wide, vocab 1024: ~0.17M params; weights + grads + 2 Adam moments alone are ~2.7 MB.
    assert 2.5 * MiB < result.peak_allocated_bytes <= result.peak_reserved_bytes < 1 * GiB
    assert result.context_bytes == 0 and result.device.startswith("cpu")
    assert result.first_loss == pytest.approx(6.93, abs=0.3)  # ln(1024) for an untrained model
    assert result.wall_seconds >= result.measured_seconds > 0
    assert result.startup_seconds > 0  # a fresh child


def test_the_environment_comes_back_as_plain_values(runner):
    # torch.__version__ is a TorchVersion: unpickled here it would import torch into the parent,
    # which never needs it (seconds of every `autotune search`).
    environment = runner.environment()
    assert type(environment.torch_version) is str and environment.device_type == "cpu"


def test_budget_too_small_is_oom(runner, tiny_model):
    result = runner.run(config(tiny_model), runner.settings.budget(4 * MiB))
    assert result.status == "oom"
    assert "out of memory" in result.error
    assert result.tokens_per_s is None


def test_checkpointing_lowers_the_peak_at_the_same_shape(runner, tiny_model):
    plain = runner.run(config(tiny_model, checkpointing=False), runner.settings.budget(1 * GiB))
    ckpt = runner.run(config(tiny_model, checkpointing=True), runner.settings.budget(1 * GiB))
    assert plain.status == ckpt.status == "ok"
    assert ckpt.peak_allocated_bytes < 0.8 * plain.peak_allocated_bytes


def test_peak_grows_with_micro_batch(runner, tiny_model):
    small = runner.run(config(tiny_model, micro_batch=1), runner.settings.budget(1 * GiB))
    large = runner.run(config(tiny_model, micro_batch=8), runner.settings.budget(1 * GiB))
    assert small.peak_allocated_bytes < large.peak_allocated_bytes


def test_warm_child_measures_what_a_fresh_one_does(runner, tiny_model):
    cfg = config(tiny_model, micro_batch=2, precision="bf16")
    warm_first = runner.run(cfg, runner.settings.budget(1 * GiB))
    warm_again = runner.run(cfg, runner.settings.budget(1 * GiB))
    fresh = run_probe(cfg, 1 * GiB, settings=ProbeSettings(device="cpu", measure_steps=2))
    assert warm_again.startup_seconds == 0  # reused
    assert warm_first.peak_allocated_bytes == warm_again.peak_allocated_bytes == fresh.peak_allocated_bytes


def test_cpu_child_goes_on_after_the_accountants_oom_and_measures_what_a_fresh_one_does(runner, tiny_model):
    # The CPU accountant's OOM is an exception of our own: the child is kept (no restart to pay)
    # and the next probe in it measures the same peak, to the byte, as a fresh process.
    runner.run(config(tiny_model), runner.settings.budget(1 * GiB))  # a warm child
    started = runner.children_started
    assert runner.run(config(tiny_model, micro_batch=8), runner.settings.budget(4 * MiB)).status == "oom"
    after = runner.run(config(tiny_model), runner.settings.budget(1 * GiB))
    fresh = run_probe(config(tiny_model), 1 * GiB, settings=ProbeSettings(device="cpu", measure_steps=2))
    assert after.status == "ok" and after.startup_seconds == 0 and runner.children_started == started
    assert (after.peak_allocated_bytes, after.peak_reserved_bytes) == (
        fresh.peak_allocated_bytes,
        fresh.peak_reserved_bytes,
    )


def test_a_standby_child_takes_over_after_a_probe_kills_its_own(tiny_model, monkeypatch, spawned_children):
    # On CUDA a standby child is started while each probe runs; forced here on CPU. The first
    # child's second probe is killed (SIGKILL); the next probe runs in the standby, already
    # imported, instead of waiting seconds for a new process.
    for key, value in fault_env("kill", on_probe=2).items():
        monkeypatch.setenv(key, value)
    with ProbeRunner(ProbeSettings(device="cpu", measure_steps=2), standby=True) as standby_runner:
        first = standby_runner.run(config(tiny_model), standby_runner.settings.budget(1 * GiB))
        assert first.status == "ok" and first.startup_seconds > 0
        assert standby_runner.run(config(tiny_model), standby_runner.settings.budget(1 * GiB)).status == "crashed"
        spare = standby_runner._spare
        assert spare is not None and spare[1].poll(120)  # the standby said Ready
        after = standby_runner.run(config(tiny_model), standby_runner.settings.budget(1 * GiB))
        assert after.status == "ok" and after.startup_seconds < 0.5 < first.startup_seconds
        assert standby_runner.children_started == 3  # first, its standby, and the next standby
    assert standby_runner._spare is None and standby_runner._process is None  # both stopped on close


def test_without_reuse_a_standby_gives_each_probe_a_fresh_process_started_ahead(tiny_model, spawned_children):
    # What the GPU evidence's noise-proof truth measures with: every probe in a new process, the
    # next one's imports done while the last probe ran.
    with ProbeRunner(ProbeSettings(device="cpu", measure_steps=2), reuse_child=False, standby=True) as runner:
        budget = runner.settings.budget(1 * GiB)
        first = runner.run(config(tiny_model), budget)
        assert first.status == "ok" and runner._process is None and runner._spare is not None
        assert runner._spare[1].poll(120)  # the standby said Ready
        second = runner.run(config(tiny_model), budget)
        assert second.status == "ok" and second.startup_seconds < 0.5 < first.startup_seconds
        assert runner.children_started == 3  # the first, and a standby during each probe
    assert runner._spare is None and runner._process is None


def test_hung_child_ends_as_timeout_within_its_limit(tiny_model, monkeypatch):
    inject_fault(monkeypatch, "hang")
    started = time.perf_counter()
    # (The limit counts from the child's Ready: its imports, seconds here, come on top.)
    result = run_probe(config(tiny_model), 1 * GiB, settings=ProbeSettings(device="cpu", timeout=4))
    elapsed = time.perf_counter() - started
    assert result.status == "timeout"
    assert elapsed < 4 + 10


def test_killed_child_ends_as_crashed(tiny_model, monkeypatch):
    inject_fault(monkeypatch, "kill")
    result = run_probe(config(tiny_model), 1 * GiB, device="cpu")
    assert result.status == "crashed"
    assert "signal 9" in result.error


def test_non_finite_loss_is_unstable(tiny_model, monkeypatch):
    inject_fault(monkeypatch, "nan")
    assert run_probe(config(tiny_model), 1 * GiB, device="cpu").status == "unstable"


def test_unexpected_exception_is_error_with_its_message(tiny_model, monkeypatch):
    inject_fault(monkeypatch, "error")
    result = run_probe(config(tiny_model), 1 * GiB, device="cpu")
    assert result.status == "error"
    assert "injected failure" in result.error


def test_user_errors_raise_before_or_from_the_child(tiny_model):
    with pytest.raises(BadInput, match="--block-size 512"):
        run_probe(config(tiny_model, block_size=512), 1 * GiB, device="cpu")
    with pytest.raises(BudgetError, match="larger than this machine"):
        run_probe(config(tiny_model), 2**50, device="cpu")


def test_8_bit_adamw_runs_on_cpu_with_less_memory_than_adamw(runner, tiny_model):
    # bitsandbytes' 8-bit AdamW (optim="adamw_8bit") keeps two 8-bit states per parameter where AdamW keeps two fp32.
    adamw = runner.run(config(tiny_model), runner.settings.budget(1 * GiB))
    eight_bit = runner.run(config(tiny_model, optimizer="adamw_8bit"), runner.settings.budget(1 * GiB))
    assert eight_bit.status == "ok", eight_bit.error
    assert eight_bit.peak_allocated_bytes < adamw.peak_allocated_bytes
