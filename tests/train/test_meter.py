"""The run's meter on CPU: the memory accountant watches the first optimizer steps (after which
every step repeats them) and each evaluation, and the steps between run without it, as a probe's
timed window does (the accountant slows a step by about 40%: `autotune train` ran at 0.74-0.82x of
its probe with it on throughout, docs/measurements.md). Real tensors, a real accountant."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from autotune.results.budget import Budget
from autotune.vocabulary.defaults import WARMUP_STEPS
from autotune.probe.cap import cap_memory
from autotune.train.meter import RunMeter

MiB = 2**20


def test_the_accountant_watches_the_first_steps_and_each_evaluation_and_not_the_steps_between():
    limits = cap_memory(torch.device("cpu"), Budget(1 << 30, 0))
    meter = RunMeter(limits, tokens_per_step=64, echo=None)
    state = SimpleNamespace(global_step=0)
    kept = []
    with limits.guard():
        for step in range(1, WARMUP_STEPS + 3):
            state.global_step = step
            meter.on_step_begin(None, state, None)
            kept.append(torch.ones(MiB, dtype=torch.uint8))  # what each step leaves alive
            meter.on_step_end(None, state, None)
            assert limits.accountant.watching == (step < WARMUP_STEPS), step
        with meter.evaluating(state.global_step):
            assert limits.accountant.watching
            batch = torch.ones(4 * MiB, dtype=torch.uint8)
            del batch
        assert not limits.accountant.watching
        meter.on_step_begin(None, state, None)
        kept.append(torch.ones(8 * MiB, dtype=torch.uint8))  # a later step: a repeat, not watched
        meter.on_step_end(None, state, None)
    # The steps it watched count; the steps after them do not; the evaluation counts from what was
    # alive when it began, as the accountant saw it.
    assert meter.phase_peaks == {
        "train": {"allocated": WARMUP_STEPS * MiB, "reserved": WARMUP_STEPS * MiB},
        "eval": {"allocated": (WARMUP_STEPS + 4) * MiB, "reserved": (WARMUP_STEPS + 4) * MiB},
    }
    # The `with` that entered it left nothing on torch's dispatch stack, suspended or not.
    assert not limits.accountant.watching and torch._C._len_torch_dispatch_stack() == 0


def test_a_suspended_accountant_still_counts_out_what_it_saw_freed():
    limits = cap_memory(torch.device("cpu"), Budget(1 << 30, 0))
    with limits.guard():
        weights = torch.ones(3 * MiB, dtype=torch.uint8)
        limits.accountant.suspend()
        del weights  # (freed while suspended: its finalizer still counts it out)
        unseen = torch.ones(5 * MiB, dtype=torch.uint8)  # born while suspended: never seen
        limits.accountant.resume()
        assert limits.accountant.allocated == 0
        del unseen
    assert torch._C._len_torch_dispatch_stack() == 0
