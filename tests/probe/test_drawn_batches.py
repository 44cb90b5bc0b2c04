"""A padded run's probe (autotune.levers.lengths): its timed window draws batches of the data's lengths,
each padded to its longest row, in whole cycles, and counts their real tokens; its memory is the
worst batch's, to the byte of the estimator's trace of that batch."""

from __future__ import annotations

import statistics

import pytest

torch = pytest.importorskip("torch")

from autotune.levers import lengths  # noqa: E402
from autotune.results.budget import Budget  # noqa: E402
from autotune.levers.config import ProbeConfig  # noqa: E402
from autotune.specs.models import resolve_model  # noqa: E402
from autotune.probe.step import ProbeStep, build_random_model, make_optimizer  # noqa: E402
from tests.helpers.models import TINY_GPT2, write_model_dir  # noqa: E402
from tests.helpers.lengths import TEXT  # noqa: E402

GiB = 2**30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_model_dir(tmp_path_factory.mktemp("drawn") / "tiny", **TINY_GPT2))


@pytest.mark.parametrize("task", ["causal-lm", "classification"])
def test_each_drawn_micro_batch_is_padded_to_its_longest_row_and_masks_the_padding(model_dir, task):
    cpu = torch.device("cpu")
    extra = {"task": "classification", "num_labels": 3} if task == "classification" else {}
    config = ProbeConfig(model=model_dir, micro_batch=4, grad_accum=2, block_size=64, lengths=TEXT, **extra)
    model, hf_config = build_random_model(resolve_model(model_dir), config, cpu, False)
    step = ProbeStep(model, make_optimizer(model, cpu), config, cpu, hf_config.vocab_size)
    worst = step.batches[0]
    assert (
        worst["input_ids"].shape == (4, 64) and int(worst["attention_mask"].sum()) < 4 * 64
    )  # (padding in its last row)
    step.draw_cycle(1)
    rows = lengths.timing_rows(TEXT, 4, 8, 64, 1)
    assert len(step.drawn) == len(rows) // 4 == lengths.cycle_steps(8) * 2
    for index, batch in enumerate(step.drawn):
        batch_rows = rows[4 * index : 4 * index + 4]
        assert batch["input_ids"].shape == (4, max(batch_rows))
        assert batch["attention_mask"].sum(dim=1).tolist() == batch_rows
        if task == "causal-lm":  # the padding carries no loss
            assert torch.equal(batch["labels"] == -100, batch["attention_mask"] == 0)
        else:
            assert batch["labels"].shape == (4,) and int(batch["labels"].max()) < 3
    step()  # an optimizer step of 2 micro-batches takes the drawn ones in order
    assert step.next_drawn == 2


@pytest.mark.slow
def test_a_padded_runs_probe_times_whole_cycles_of_real_tokens_and_measures_its_worst_batch(model_dir, trace_children):
    from autotune.estimate import estimate_memories
    from autotune.probe import child
    from autotune.probe.protocol import ProbeRequest
    from autotune.probe.settings import ProbeSettings

    config = ProbeConfig(model=model_dir, micro_batch=2, grad_accum=4, block_size=128, lengths=TEXT)
    result = child.run_probe_in_process(
        ProbeRequest(
            config=config,
            model=resolve_model(model_dir),
            budget=Budget(4 * GiB, 0),
            settings=ProbeSettings(device="cpu", warmup_steps=2, measure_steps=3, measure_seconds=0.1),
        )
    )
    assert result.status == "ok", result.error
    cycle = config.timing_cycle
    assert result.measured_steps % cycle == 0 and result.measured_steps >= 2 * cycle
    assert result.step_seconds == pytest.approx(statistics.fmean(result.step_times))
    assert result.tokens_per_s == pytest.approx(config.tokens_per_step / result.step_seconds)
    assert config.tokens_per_step == pytest.approx(8 * lengths.real_tokens_per_row(TEXT, 128))
    [estimate] = estimate_memories([config], device_type="cpu", use_cache=False, children=trace_children)
    assert (estimate.peak_bytes, estimate.reserved_bytes) == (result.peak_allocated_bytes, result.peak_reserved_bytes)
